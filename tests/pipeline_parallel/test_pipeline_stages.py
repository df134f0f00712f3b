"""Pipeline pieces that need no process group: the stage split, argument validation (bad
input fails before any communication), microbatch padding, the P2P shape check, and every
rank's schedule replayed against the others (no deadlock, exact theoretical bubble)."""
import pytest
import torch

from megatron_cp.cli.arguments import parse_args
from megatron_cp.pipeline_parallel import P2PCommunicator, pipeline_layout, pipeline_tensor_shape
from megatron_cp.pipeline_parallel.replay import record_program, simulate
from megatron_cp.pipeline_parallel.steps import backward_step, deallocate_output_tensor
from training_utils import TINY

BASE = TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 10"


def _counts(layout):
    return [len(layout.layer_numbers(r)) for r in range(layout.pp_size)]


def test_even_uneven_and_virtual_splits():
    assert _counts(pipeline_layout(8, 4)) == [2, 2, 2, 2]
    assert _counts(pipeline_layout(8, 4, first=1, last=1)) == [1, 3, 3, 1]
    assert _counts(pipeline_layout(7, 3, first=1)) == [1, 3, 3]
    assert _counts(pipeline_layout(5, 2, last=2)) == [3, 2]
    assert pipeline_layout(8, 4, first=1, last=1).chunk_layer_numbers(1) == [[1, 2, 3]]
    assert pipeline_layout(8, 4, first=1, last=1).chunk_layer_numbers(3) == [[7]]
    # 8 layers, PP=2, 2 layers per virtual stage: VP=2, rank r chunk c owns piece c*PP + r
    virtual = pipeline_layout(8, 2, num_layers_per_virtual_stage=2)
    assert virtual.vp_size == 2
    assert virtual.chunk_layer_numbers(0) == [[0, 1], [4, 5]]
    assert virtual.chunk_layer_numbers(1) == [[2, 3], [6, 7]]
    assert pipeline_layout(8, 2, num_layers_per_virtual_stage=4).vp_size == 1  # plain 1F1B
    every = sorted(n for r in range(4)
                   for c in pipeline_layout(12, 4, num_virtual_stages=3).chunk_layer_numbers(r)
                   for n in c)
    assert every == list(range(12))


@pytest.mark.parametrize("extra,world,message", [
    ("--pipeline-model-parallel-size 3", 3, r"--num-layers \(4\) must be divisible by "
                                            r"--pipeline-model-parallel-size \(3\)"),
    ("--pipeline-model-parallel-size 8", 8, r"must not exceed --num-layers \(4\)"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 6", 2, r"number of microbatches \(3\) to be a multiple of "
                                 r"--pipeline-model-parallel-size \(2\)"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2,
     r"must divide the layers per pipeline stage \(2\)"),
    ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2", 4,
     r"leaves 2 layers for the 3 other stage"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
     "--num-layers-per-virtual-pipeline-stage 1", 2, r"cannot be combined"),
    ("--pipeline-model-parallel-size 2 --pipeline-seq-length 16", 2,
     r"--pipeline-seq-length \(16\) must be at least --seq-length \(32\)"),
    ("--pipeline-model-parallel-size 2 --context-parallel-size 2 --pipeline-seq-length 34", 4,
     r"--pipeline-seq-length \(34\) must be divisible by 2 x CP = 4"),
])
def test_bad_pipeline_arguments_fail_before_any_communication(extra, world, message):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=message):
        parse_args(f"{BASE} {extra}".split(), world_size=world)
    assert not torch.distributed.is_initialized()


def test_pipeline_is_built_by_default():
    args = parse_args(f"{BASE} --pipeline-model-parallel-size 2 "
                      f"--num-layers-per-virtual-pipeline-stage 1".split(), world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.pipeline_seq_length is None  # the buffers follow each step's data


def test_buffer_shape_and_shape_check_before_sending():
    assert pipeline_tensor_shape(64, 2, 32, cp_size=2, tp_size=2, sequence_parallel=True) == (16, 2, 32)
    assert pipeline_tensor_shape(64, 2, 32, cp_size=2, tp_size=2) == (32, 2, 32)
    with pytest.raises(ValueError, match="must be divisible by CP"):
        pipeline_tensor_shape(30, 2, 32, cp_size=4)
    comm = P2PCommunicator(None, [0, 1], 0, (8, 2, 4), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \[6, 2, 4\] but the pipeline buffers are \[8, 2, 4\]"):
        comm.communicate(send_next=torch.zeros(6, 2, 4))
    with pytest.raises(ValueError, match="dtype"):
        comm.communicate(send_prev=torch.zeros(8, 2, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vp", [1, 2, 3])
def test_schedules_never_deadlock_and_have_the_theoretical_bubble(pp, vp):
    """Replay the real 1F1B / interleaved code of every rank against each other (rendezvous
    P2P, free communication): every message is matched, nothing deadlocks, and the bubble is
    exactly (p-1)/(v*m+p-1); forward-only (evaluation) replays too."""
    for m in ([1, 2, pp, 2 * pp + 1] if vp == 1 else [pp, 2 * pp, 3 * pp]):
        programs = [record_program(pp, r, vp, m) for r in range(pp)]
        computations = [sum(e[0] in "FB" for e in program) for program in programs]
        assert computations == [2 * m * vp] * pp  # one forward and one backward per chunk
        _, idle = simulate(programs, 1.0, 2.0, vp)
        assert sum(idle) / pp == pytest.approx((pp - 1) / (vp * m + pp - 1), abs=1e-12)
        simulate([record_program(pp, r, vp, m, forward_only=True) for r in range(pp)], 1.0, 0.0, vp)


def test_sent_outputs_are_freed_and_backward_still_works():
    x = torch.randn(8, 2, 4, requires_grad=True)
    output = x * 3.0 + 1.0  # [s, b, h], as a stage's residual output
    deallocate_output_tensor(output)
    assert output.numel() == 1  # the [s, b, h] storage is gone, the graph is kept
    backward_step(torch.nn.Linear(1, 1), None, output, torch.ones(8, 2, 4), sync_grads=True)
    torch.testing.assert_close(x.grad, torch.full((8, 2, 4), 3.0))
