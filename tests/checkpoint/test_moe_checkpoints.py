"""MoE checkpoints: expert params saved per EP / ETP rank (torch), under global names with
the expert dimension (torch_dist), and resharded over EP / ETP (tools/checkpoint_convert.py).

The runs are shared (one module fixture, three worker launches) to keep the file fast:

- world 2, TP1 x EP2 (EP borrows the DP ranks): 6 straight iterations == 3 + save + 3, with
  and without the distributed optimizer; the torch files resumed under EP=1 (resharded on load);
- world 4: a torch-format resume under TP2 x EP2 x ETP1 with the distributed optimizer
  (expert shards over expert-DP 2; TP rank t pairs with EP rank t, two files); a
  torch_dist save under that layout, resumed under EP=4; the converted EP=4 checkpoint;
- world 2: the torch_dist save resumed under EP=1 (ZeRO) and TP=ETP=2; the converted
  TP1 x EP1 x ETP2 (ETP rank in the file names) and TP2 x EP1 (weights only) checkpoints.

The model has SwiGLU experts (a stride-2 ETP split), a gated shared expert (TP-split) and
the aux-loss-free expert bias (a buffer that must be saved).
"""
import os

import pytest
import torch

from dist_harness import run_workers
from test_dist_checkpoint import _jobs, _load_and_resave
from megatron_cp.checkpoint import torch_shards
from megatron_cp.cli.arguments import parse_args
from megatron_cp.checkpoint.torch_dist_format import read_full
from megatron_cp.config.parallel import RANK_ORDERS
from megatron_cp.distributed.initialize import ParallelState, rank_layout
from megatron_cp.startup import config_from_args
from tools import checkpoint_convert as convert
from training_utils import max_rel_diff, train_losses

MOE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
       "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-iters 20 "
       "--hidden-dropout 0 --attention-dropout 0 --mock-data --vocab-size 512 "
       "--log-interval 100 --eval-iters 0 --seed 11 --num-experts 4 --moe-router-topk 2 "
       "--moe-aux-loss-coeff 0.01 --moe-ffn-hidden-size 64 --moe-token-dispatcher-type alltoall "
       "--swiglu --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate "
       "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --train-iters 6 "
       "--ckpt-format torch")  # the torch format's files; dist_run's later flag overrides it
EP2 = "--expert-model-parallel-size 2"
ZERO = "--use-distributed-optimizer"
TP2_EP2_ETP1 = ("--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                "--expert-tensor-parallel-size 1")
FC1 = "decoder.layers.1.mlp.experts.linear_fc1.weight"


def _convert(*argv):
    convert.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ckpt")
    ck, ck_zero, ck_etp, dist = (tmp / n for n in ("ck", "ck_zero", "ck_etp", "dist"))
    first = "--exit-interval 3"
    r2 = run_workers(_jobs, 2, {
        "straight": (train_losses, f"{MOE} {EP2}"),
        "first": (train_losses, f"{MOE} {EP2} {first} --save {ck}"),
        "second": (train_losses, f"{MOE} {EP2} --load {ck}"),
        "zero:straight": (train_losses, f"{MOE} {EP2} {ZERO}"),
        "zero:first": (train_losses, f"{MOE} {EP2} {ZERO} {first} --save {ck_zero}"),
        "zero:second": (train_losses, f"{MOE} {EP2} {ZERO} --load {ck_zero}"),
        "ep1:resharded": (train_losses, f"{MOE} {ZERO} --load {ck}")}, timeout=300)[0]
    # ck (iteration 3, EP=2) -> EP=4 and TP1 x EP1 x ETP2 through torch_dist (optimizer
    # carried), and -> TP2 x EP1 directly (weights only)
    _convert("--load-dir", ck, "--save-dir", tmp / "conv_dist", "--target-ckpt-format", "torch_dist")
    _convert("--load-dir", tmp / "conv_dist", "--save-dir", tmp / "conv_ep4",
             "--target-expert-model-parallel-size", 4, "--target-expert-tensor-parallel-size", 1)
    _convert("--load-dir", tmp / "conv_dist", "--save-dir", tmp / "conv_etp2",
             "--target-expert-tensor-parallel-size", 2)
    _convert("--load-dir", ck, "--save-dir", tmp / "conv_tp2", "--target-tensor-parallel-size", 2)
    dist_run = f"{MOE} --ckpt-format torch_dist --train-iters 5"
    r4 = run_workers(_jobs, 4, {
        "etp:straight": (train_losses, f"{MOE} {TP2_EP2_ETP1} {ZERO}"),
        "etp:first": (train_losses, f"{MOE} {TP2_EP2_ETP1} {ZERO} {first} --save {ck_etp}"),
        "etp:second": (train_losses, f"{MOE} {TP2_EP2_ETP1} {ZERO} --load {ck_etp}"),
        "dist:save": (train_losses, f"{dist_run} {TP2_EP2_ETP1} {ZERO} --exit-interval 3 "
                                    f"--save {dist}"),
        "dist:original": (train_losses, f"{dist_run} {TP2_EP2_ETP1} {ZERO} --load {dist}"),
        "dist:ep4": (train_losses, f"{dist_run} --expert-model-parallel-size 4 --load {dist}"),
        "dist:ep4:resave": (_load_and_resave, f"{dist_run} --expert-model-parallel-size 4 "
                                              f"--load {dist}", str(tmp / "resave_ep4")),
        "conv:ep4": (train_losses, f"{MOE} --expert-model-parallel-size 4 --load {tmp / 'conv_ep4'}"),
    }, timeout=400)[0]
    r2b = run_workers(_jobs, 2, {
        "dist:ep1": (train_losses, f"{dist_run} {ZERO} --load {dist}"),
        "dist:tp2": (train_losses, f"{dist_run} --tensor-model-parallel-size 2 --load {dist}"),
        "dist:tp2:resave": (_load_and_resave, f"{dist_run} --tensor-model-parallel-size 2 "
                                              f"--load {dist}", str(tmp / "resave_tp2")),
        "conv:etp2": (train_losses, f"{MOE} --expert-tensor-parallel-size 2 "
                                    f"--load {tmp / 'conv_etp2'}"),
        "conv:tp2": (train_losses, f"{MOE} --tensor-model-parallel-size 2 "
                                   f"--load {tmp / 'conv_tp2'}"),
    }, timeout=300)[0]
    return tmp, {**r2, **r4, **r2b}


def _files(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))


def test_torch_format_resume_under_expert_parallelism_is_bit_exact(runs):
    tmp, r = runs
    assert len(r["straight"]) == 6
    assert r["first"] + r["second"] == r["straight"]  # exact equality, not a tolerance
    assert r["zero:first"] + r["zero:second"] == r["zero:straight"]
    assert r["etp:first"] + r["etp:second"] == r["etp:straight"]
    # one file per EP rank (each holds its own experts and their Adam state)
    assert _files(tmp / "ck" / "iter_0000003") == ["mp_rank_00_000", "mp_rank_00_001"]
    assert _files(tmp / "ck_zero" / "iter_0000003") == ["mp_rank_00_000", "mp_rank_00_001"]
    # TP2 x EP2 x ETP1: the expert mesh pairs TP rank t with EP rank t
    assert _files(tmp / "ck_etp" / "iter_0000003") == ["mp_rank_00_000", "mp_rank_01_001"]
    shards = [torch.load(tmp / "ck" / "iter_0000003" / name / "model_optim_rng.pt",
                         weights_only=False) for name in _files(tmp / "ck" / "iter_0000003")]
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert shards[0]["model"][key].shape == (2, 128, 32)  # 2 local experts, [gate; up]
    assert not torch.equal(shards[0]["model"][key], shards[1]["model"][key])
    bias = "decoder.layers.0.mlp.router.expert_bias"  # the buffer is saved, and has moved
    assert torch.equal(shards[0]["model"][bias], shards[1]["model"][bias])
    assert shards[0]["model"][bias].abs().sum() > 0
    states = [s["optimizer"]["optimizer"]["state"] for s in shards]
    assert len(states[0]) == len(states[1]) > 0
    assert any(not torch.equal(states[0][i]["exp_avg"], states[1][i]["exp_avg"]) for i in states[0])


def test_torch_format_resume_under_another_expert_layout_reshards(runs):
    """The torch checkpoint saved at EP=2 resumes at EP=1 x DP=2 with the distributed
    optimizer: weights, Adam state and schedule carry, the straight run's losses follow."""
    resumed, straight = runs[1]["ep1:resharded"], runs[1]["straight"]
    assert len(resumed) == 3
    assert max_rel_diff(resumed, straight[3:]) < 1e-5


@pytest.mark.parametrize("order", RANK_ORDERS)
@pytest.mark.parametrize("tp,pp,ep,etp,world,cp", [
    (1, 1, 2, 1, 2, 1), (2, 1, 2, 1, 4, 1), (1, 1, 2, 2, 4, 1), (2, 2, 4, 1, 16, 1),
    (2, 1, 2, 2, 8, 2), (4, 1, 2, 2, 8, 1), (1, 2, 1, 1, 4, 1), (1, 2, 2, 1, 8, 2)])
def test_every_shard_is_written_by_exactly_one_rank(tp, pp, ep, etp, world, cp, order):
    """Over the rank grid, in either rank order, the writers of a layout write each existing
    shard name once, and every rank reads a file that is written."""
    args = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "num_experts": 4, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    file_sizes = torch_shards.file_layout(args)
    layout = rank_layout(world, tp, cp, pp, ep, etp, order=order)
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}
    states = [ParallelState(world, rank, torch.device("cpu"), sizes, layout, order=order)
              for rank in range(world)]
    written = [torch_shards.own_shard_name(s, file_sizes) for s in states
               if torch_shards.is_shard_writer(s, file_sizes)]
    expected = torch_shards.shard_names(tp, pp, ep, etp)
    assert sorted(written) == sorted(expected.values())
    assert {torch_shards.own_shard_name(s, file_sizes) for s in states} == set(written)
    if etp > 1 and etp != tp:
        assert all("_etp" in name for name in written)
    dense = torch_shards.file_layout(dict(args, num_experts=0))  # a dense model: TP x PP files
    assert sorted(torch_shards.own_shard_name(s, dense) for s in states
                  if torch_shards.is_shard_writer(s, dense)) == \
        sorted(torch_shards.shard_names(tp, pp).values())


def test_torch_dist_loads_under_other_expert_layouts(runs):
    tmp, r = runs
    original = r["dist:original"]
    assert len(r["dist:save"]) == 3 and len(original) == 2
    for name in ("dist:ep4", "dist:ep1", "dist:tp2"):
        assert max_rel_diff(r[name], original) < 1e-5, (name, r[name], original)
    saved, common = read_full(str(tmp / "dist" / "iter_0000003"))
    assert saved[f"model.{FC1}"].shape == (4, 2, 64, 32)  # [E, gate|up, ffn, h]
    assert saved["model.decoder.layers.1.mlp.experts.linear_fc2.weight"].shape == (4, 32, 64)
    assert saved["model.decoder.layers.1.mlp.experts.linear_fc1.bias"].shape == (4, 2, 64)
    assert saved["model.decoder.layers.1.mlp.router.expert_bias"].abs().sum() > 0
    assert saved[f"optimizer.exp_avg_sq.{FC1}"].shape == (4, 2, 64, 32)
    for resave in ("resave_ep4", "resave_tp2"):  # the same full state from any layout
        again, _ = read_full(str(tmp / resave / "iter_0000003"))
        assert set(again) == set(saved), resave
        for key in saved:
            assert torch.equal(again[key], saved[key]), (resave, key)


def test_convert_reshards_experts_and_resumes(runs):
    tmp, r = runs
    unconverted = r["second"]  # iterations 4-6 resumed from ck at EP=2
    for name in ("conv:ep4", "conv:etp2"):  # Adam state carried: the same continuation
        assert len(r[name]) == 3
        assert max_rel_diff(r[name], unconverted) < 1e-5, (name, r[name], unconverted)
    # weights only: the first forward is the same model's
    assert abs(r["conv:tp2"][0] - unconverted[0]) / unconverted[0] < 1e-5
    assert _files(tmp / "conv_ep4" / "iter_0000003") == [f"mp_rank_00_{e:03d}" for e in range(4)]
    assert _files(tmp / "conv_etp2" / "iter_0000003") == ["mp_rank_00_etp00", "mp_rank_00_etp01"]
    assert _files(tmp / "conv_tp2" / "iter_0000003") == ["mp_rank_00", "mp_rank_01"]
    full, args, meta = convert.load_full(str(tmp / "ck"))
    assert full[FC1].shape == (4, 128, 32) and meta["optimizer"]["exp_avg"][FC1].shape == (4, 128, 32)
    for other in ("conv_ep4", "conv_etp2", "conv_tp2"):  # merge(split(x)) == x
        again, _, again_meta = convert.load_full(str(tmp / other))
        assert set(again) == set(full)
        for key in full:
            assert torch.equal(again[key], full[key]), (other, key)
        if other != "conv_tp2":  # converted through torch_dist: the Adam moments came along
            for kind, per in meta["optimizer"].items():
                for key, value in per.items():
                    assert torch.equal(again_meta["optimizer"][kind][key], value), (other, key)
    # the full tensors are a one-process model's state dict
    from megatron_cp.model import GPTModel
    namespace = parse_args(f"{MOE}".split(), world_size=1)
    model = GPTModel(config_from_args(namespace, args["true_vocab_size"]))
    model.load_state_dict(convert.pad_vocab_rows(full, args, 1))  # strict: names and shapes
    for name, param in model.named_parameters():
        expected = (param.partition_dim, param.partition_stride) \
            if getattr(param, "tensor_model_parallel", False) else None
        assert convert.tp_spec(name, True) == expected, name
    with pytest.raises(ValueError, match="--target-expert-model-parallel-size 3 must divide"):
        _convert("--load-dir", tmp / "ck", "--save-dir", tmp / "bad",
                 "--target-expert-model-parallel-size", 3)
