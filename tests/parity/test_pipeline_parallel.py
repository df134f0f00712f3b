"""Pipeline parallelism end to end: 5 training steps under every layout reproduce the
single-process losses to a relative 1e-5 (fp32, CPU), with and without
--overlap-p2p-comm; a padded variable-length batch gives
the unpadded loss and gradients; resume under PP is bit-exact.

To keep process start-up cheap, all layouts of one world size train one after the other
inside one set of workers (a fixture per world size); each test then checks one layout.
"""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.distributed.data_parallel import allreduce_embedding_grads
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.pipeline_parallel import build_model_chunks, get_forward_backward_func
from model_utils import tiny_config
from training_utils import TINY, max_rel_diff, train_losses

STEPS = TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 5"
PACKED = "--reset-position-ids --reset-attention-mask --eod-mask-loss"
REFERENCES = {"tied": STEPS, "untied": f"{STEPS} --untie-embeddings-and-output-weights",
              "packed": f"{STEPS} {PACKED}"}
PP2, PP4 = "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4"
TP2, CP2 = "--tensor-model-parallel-size 2 --sequence-parallel", "--context-parallel-size 2"
# name: (world, reference, extra arguments)
LAYOUTS = {
    "pp2": (2, "tied", f"{PP2}"),
    "pp2_untied_eval": (2, "untied", f"{PP2} --eval-iters 1 --eval-interval 5"),
    "pp2_interleaved_vp2": (2, "tied", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
                                       f"--eval-iters 1 --eval-interval 5"),
    "pp2_interleaved_untied": (2, "untied", f"{PP2} --num-layers-per-virtual-pipeline-stage 1"),
    "pp2_overlap_p2p": (2, "tied", f"{PP2} --overlap-p2p-comm"),
    "pp2_vp2_overlap_p2p": (2, "tied", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
                                       f"--overlap-p2p-comm --eval-iters 1 --eval-interval 5"),
    "pp2_uneven_recompute": (2, "tied", f"{PP2} --decoder-first-pipeline-num-layers 1 "
                                        f"--recompute-granularity full --recompute-method uniform "
                                        f"--recompute-num-layers 1"),
    "pp2_padded_packed": (2, "packed", f"{PP2} {PACKED} --pipeline-seq-length 40"),
    "pp4": (4, "tied", f"{PP4} --eval-iters 1 --eval-interval 5"),
    "tp2_pp2": (4, "tied", f"{TP2} {PP2}"),
    "cp2_pp2_packed_ring": (4, "packed", f"{CP2} {PP2} {PACKED}"),  # buffers follow the data
    "cp2_pp2_packed_hybrid": (4, "packed", f"{CP2} {PP2} {PACKED} --pipeline-seq-length 48 "
                                           f"--cp-comm-type a2a+p2p "
                                           f"--hierarchical-context-parallel-sizes 2 1"),
    "pp2_dp2_overlap_untied": (4, "untied", f"{PP2} --overlap-grad-reduce"),
    "pp2_vp2_dp2_overlap": (4, "tied", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
                                       f"--overlap-grad-reduce"),
    "tp2_cp2_pp2_a2a": (8, "tied", f"{TP2} {CP2} {PP2} --cp-comm-type a2a"),
    "pp2_dp2_cp2_packed_all_gather": (8, "packed", f"{PP2} {CP2} {PACKED} --cp-comm-type all_gather"),
}


def _train_all(rank, world, argvs):
    return {name: train_losses(rank, world, argv) for name, argv in argvs.items()}


@pytest.fixture(scope="module")
def references():
    return run_workers(_train_all, 1, REFERENCES)[0]


_RUNS = {}


def _results(world):
    """Train every layout of ``world`` ranks once (cached for the module)."""
    if world not in _RUNS:
        argvs = {name: f"{REFERENCES[ref]} {extra}" for name, (w, ref, extra) in LAYOUTS.items()
                 if w == world}
        _RUNS[world] = run_workers(_train_all, world, argvs, timeout=400)
    return _RUNS[world]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(references, name):
    world, ref, _ = LAYOUTS[name]
    reference = references[ref]
    assert reference[-1] < reference[0], "the tiny model must learn"
    for rank_results in _results(world):  # every rank reports the same global loss
        diff = max_rel_diff(rank_results[name], reference)
        print(f"{name}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


def _variable_length_microbatches(lengths, b=2, vocab=120):
    """Packed microbatches of different lengths (two documents per sample, some masked)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        cut = n // 3
        doc = torch.cat([torch.zeros(cut, dtype=torch.long), torch.ones(n - cut, dtype=torch.long)])
        pos = torch.cat([torch.arange(cut), torch.arange(n - cut)])
        mask = (torch.rand(b, n, generator=gen) > 0.2).float()
        out.append({"tokens": torch.randint(0, vocab, (b, n), generator=gen),
                    "labels": torch.randint(0, vocab, (b, n), generator=gen),
                    "loss_mask": mask, "position_ids": pos.expand(b, n).clone(),
                    "document_ids": doc.expand(b, n).clone()})
    return out


def _forward(model, batch):
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 document_ids=batch["document_ids"])


def _variable_length_worker(rank, world, untied):
    """PP=2 on microbatches of lengths 20, 32, 13, 27 padded to 32 vs the unpadded ones on
    one process: the same loss and the same gradient for every parameter of each stage."""
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    config = tiny_config(num_layers=4, untie_embeddings_and_output_weights=untied)
    chunks = build_model_chunks(config, state)
    reference = GPTModel(tiny_config(num_layers=4, untie_embeddings_and_output_weights=untied))
    microbatches = _variable_length_microbatches([20, 32, 13, 27])
    num_tokens = sum(b["loss_mask"].sum() for b in microbatches)

    def loss_func(output, batch):
        loss_sum = (output * batch["loss_mask"]).sum()
        return loss_sum / num_tokens, loss_sum

    schedule = get_forward_backward_func(state, (32, 2, config.hidden_size), torch.float32)
    losses = schedule(_forward, loss_func, [prepare_microbatch(b, 0, 1, 32) for b in microbatches], chunks,
                      state)
    allreduce_embedding_grads(chunks, state)
    expected = []
    for batch in microbatches:
        _, loss_sum = loss_func(_forward(reference, batch), batch)
        (loss_sum / num_tokens).backward()
        expected.append(loss_sum.detach())
    if state.is_pipeline_last_stage:
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    else:
        assert losses == []
    ref_params = dict(reference.named_parameters())
    layers = chunks[0].decoder.layer_numbers
    checked = 0
    for name, param in chunks[0].named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            ref_name = f"decoder.layers.{layers[int(local)]}.{rest}"
        elif name == "output_layer.weight" and not untied:
            ref_name = "embedding.word_embeddings.weight"  # the tied copy
        else:
            ref_name = name
        torch.testing.assert_close(param.grad, ref_params[ref_name].grad, rtol=1e-5, atol=1e-6)
        checked += 1
    return checked


@pytest.mark.parametrize("untied", [False, True])
def test_padded_variable_length_batch_matches_unpadded(untied):
    checked = run_workers(_variable_length_worker, 2, untied)
    assert all(n > 0 for n in checked)


def _resume_worker(rank, world, base, save_dir):
    straight = train_losses(rank, world, f"{base} --train-iters 20")
    first = train_losses(rank, world, f"{base} --train-iters 20 --exit-interval 10 --save {save_dir}")
    second = train_losses(rank, world, f"{base} --train-iters 20 --load {save_dir}")
    return straight, first + second


def test_resume_under_pp_is_bit_exact(tmp_path):
    """20 straight iterations == 10 + save + load + 10, interleaved PP=2 (two model chunks
    per rank, saved as model0/model1), with dropout so the RNG states matter too."""
    base = STEPS.replace("--train-iters 5", "") + f" {PP2} --num-layers-per-virtual-pipeline-stage 1"
    for straight, resumed in run_workers(_resume_worker, 2, base, str(tmp_path)):
        assert len(straight) == 20
        assert resumed == straight  # exact equality, not a tolerance
