"""--optimizer muon / dist_muon with Megatron-LM's --muon-* flags: Newton-Schulz against the
direct formula (the step polynomials applied to the singular values), the orthogonaliser's
QKV split, experts and tensor-parallel modes against one process, one optimizer step against
a hand-written reference, loss curves under TP (+SP, both TP-invariant modes), DP
(dist_muon), PP and EP equal to one process, and checkpoints of the Muon state (torch and
torch_dist) resuming with identical losses."""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.optimizer import MixedPrecisionOptimizer, get_param_groups
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.optimizer.muon import Orthogonalizer
from megatron_cp.optimizer.newton_schulz import (COEFFICIENT_SETS, coefficients, newton_schulz,
                                                 update_scale)
from training_utils import TINY, max_rel_diff, train_runs

close = torch.testing.assert_close
FP32_FLOAT_EPS, BF16_EPS = 2.0 ** -24, 2.0 ** -8  # unit roundoffs


def _direct(g, steps, kind):
    """Newton-Schulz by its closed form, in float64: ``U p(s) V^T`` with ``p`` the step
    polynomials ``a s + b s^3 + c s^5`` composed, ``s`` the singular values over ||G||_F."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / torch.linalg.norm(g.double())
    for a, b, c in coefficients(kind, steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return u @ torch.diag(x) @ vh, u @ vh


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
@pytest.mark.parametrize("kind, steps", [("quintic", 5), ("simple", 5), ("polar_express", 8),
                                         ("cans", 7), ("aol", 4), ("deepseekv4", 10)])
def test_newton_schulz_is_the_polynomial_of_the_singular_values(shape, kind, steps):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(steps))
    want, _ = _direct(g, steps, kind)
    inner = min(shape)  # the length of the Gram matrix's dot products
    # fp32: each step's three matmuls round dot products of ~inner terms
    fp32 = newton_schulz(g, steps, kind)
    assert fp32.dtype == torch.float32
    close(fp32.double(), want, rtol=0, atol=2 * steps * inner * FP32_FLOAT_EPS)
    # "medium": the steps in bf16, each storing X at 8 bits of mantissa
    bf16 = newton_schulz(g, steps, kind, bf16=True)
    close(bf16.double(), want, rtol=0, atol=2 * steps * BF16_EPS * want.abs().max().item())


def test_newton_schulz_orthogonalises():
    """The quintic set leaves the singular values near 1 after its 5 steps (Muon's design);
    Polar Express converges: 8 steps give U V^T to fp32 accuracy."""
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(g, 5, "quintic").double()
    s = torch.linalg.svdvals(out)
    assert 0.7 < s.min() and s.max() < 1.2, s
    _, uv = _direct(g, 5, "quintic")
    close(newton_schulz(g, 8, "polar_express").double(), uv, rtol=0, atol=1e-5)


def test_coefficient_schedules_and_scales():
    from megatron_cp.config import optimizer as optimizer_config
    assert tuple(COEFFICIENT_SETS) == optimizer_config.COEFFICIENT_SETS  # the flag's choices
    quintic, polar = COEFFICIENT_SETS["quintic"], COEFFICIENT_SETS["polar_express"]
    assert coefficients("quintic", 7) == list(quintic) + list(quintic[:2])  # cycles
    assert coefficients("polar_express", 10) == list(polar) + [polar[-1]] * 2  # repeats last
    assert update_scale(16, 64, "spectral") == 8.0
    assert update_scale(64, 16, "unit_rms_norm") == 2.0
    assert update_scale(16, 64, "shape_scaling") == 1.0
    assert update_scale(64, 16, "shape_scaling") == 2.0


def _config(**overrides):
    return OptimizerConfig(**{"optimizer": "muon", "muon_fp32_matmul_prec": "high", **overrides})


def _param(tensor, **attrs):
    p = torch.nn.Parameter(tensor.clone())
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


QKV_SPLIT = (8, 4, 4)  # one query group's rows: 2 heads x 4 dims of q, then k, then v


def test_orthogonalizer_splits_qkv_and_experts_and_scales():
    gen = torch.Generator().manual_seed(2)
    orth = Orthogonalizer(_config(muon_scale_mode="shape_scaling", muon_extra_scale_factor=0.5))
    ns = lambda m: newton_schulz(m, 5, "quintic")  # noqa: E731
    qkv = torch.randn(32, 12, generator=gen)  # two query groups
    rows = qkv.view(2, 16, 12)
    parts = [rows[:, :8].reshape(16, 12), rows[:, 8:12].reshape(8, 12), rows[:, 12:].reshape(8, 12)]
    outs = [ns(p) * 0.5 * max(1, p.shape[0] / 12) ** 0.5 for p in parts]
    want = torch.cat([o.view(2, -1, 12) for o in outs], dim=1).view(32, 12)
    close(orth(_param(qkv, qkv_split_shapes=QKV_SPLIT), qkv), want)
    whole = Orthogonalizer(_config(muon_split_qkv=False))
    close(whole(_param(qkv, qkv_split_shapes=QKV_SPLIT), qkv), ns(qkv) * 32 ** 0.5)
    experts = torch.randn(3, 6, 10, generator=gen)  # each expert's [out, in] on its own
    close(whole(_param(experts, is_expert=True), experts),
          torch.stack([ns(e) * 10 ** 0.5 for e in experts]))


def _tp_cases(gen):
    """(name, full tensor, TP split dim, attributes): a column- and a row-parallel weight, a
    fused QKV (two query groups) and experts split over expert-TP."""
    return [("column", torch.randn(20, 12, generator=gen), 0, {}),
            ("row", torch.randn(12, 20, generator=gen), 1, {}),
            ("qkv", torch.randn(32, 12, generator=gen), 0, {"qkv_split_shapes": QKV_SPLIT}),
            ("experts", torch.randn(3, 8, 12, generator=gen), 1, {"is_expert": True})]


def _tp_worker(rank, world):
    state = initialize_model_parallel(2, 1, 1, 1, 2, device=torch.device("cpu"))  # TP = ETP = 2
    for mode in ("duplicated", "distributed", "blockwise"):
        for name, full, dim, attrs in _tp_cases(torch.Generator().manual_seed(3)):
            shard = tpar.split_full(full, dim, 1, 2, rank)
            local = _param(shard, tensor_model_parallel=True, partition_dim=dim, **attrs)
            got = Orthogonalizer(_config(muon_tp_mode=mode), state)(local, shard)
            one = Orthogonalizer(_config(muon_tp_mode=mode))  # one process
            if mode == "blockwise":  # each rank orthogonalises its own block
                want = one(_param(shard, **attrs), shard)
            else:  # the whole matrix, this rank's part of it
                want = tpar.split_full(one(_param(full, **attrs), full), dim, 1, 2, rank)
            close(got, want, rtol=0, atol=2e-5, msg=lambda m: f"{mode} {name}: {m}")
    return True


def test_tensor_parallel_modes_against_one_process():
    """duplicated and distributed give every rank its part of the whole matrix's update
    (TP-invariant); blockwise orthogonalises each rank's shard on its own."""
    assert run_workers(_tp_worker, 2) == [True, True]


def _ns_by_hand(m):
    """Independent of the code under test: the closed form (float64), fp32."""
    return _direct(m, 5, "quintic")[0].float()


def _one_step_worker(rank, world, dtype):
    """Two steps of MixedPrecisionOptimizer with Muon + Adam against the update rule
    written out (Nesterov, weight decay, QKV split, shape scaling, extra scale)."""
    state = initialize_model_parallel(1, 1, 1, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.ModuleDict({"qkv": torch.nn.Linear(12, 32, bias=False),
                                 "proj": torch.nn.Linear(12, 12),
                                 "final_norm": torch.nn.LayerNorm(12),
                                 "embedding": torch.nn.Embedding(20, 12)})
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.qkv.weight.qkv_split_shapes = QKV_SPLIT
    model.embedding.weight.is_embedding_or_output_parameter = True
    model.to(dtype)
    lr, wd, mu = 0.05, 0.1, 0.8
    config = _config(muon_nesterov=True, muon_momentum=mu, muon_scale_mode="shape_scaling",
                     muon_extra_scale_factor=0.7)
    groups = get_param_groups(model, wd, muon=True)
    assert [g["optimizer"] for g in groups] == ["muon", "adam", "adam"]
    assert {id(p) for p in groups[0]["params"]} == {id(model.qkv.weight), id(model.proj.weight)}
    opt = MixedPrecisionOptimizer(groups, state, lr=lr, weight_decay=wd, betas=(0.9, 0.95),
                                  eps=1e-8, clip_grad=0.0, params_dtype=dtype, muon=config)
    mains = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    adam_ref = {name: torch.nn.Parameter(mains[name].clone()) for name in
                ("proj.bias", "final_norm.weight", "final_norm.bias", "embedding.weight")}
    adam = torch.optim.AdamW([{"params": [adam_ref["embedding.weight"]], "weight_decay": wd},
                              {"params": [adam_ref[n] for n in ("proj.bias", "final_norm.weight",
                                                                "final_norm.bias")],
                               "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    momentum = {name: torch.zeros_like(mains[name]) for name in ("qkv.weight", "proj.weight")}
    for step in range(2):
        grads = {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = grads[name].to(dtype)
            grads[name] = p.grad.float()  # what the optimizer sees
        opt.step()
        for name in momentum:  # Muon written out
            w, g = mains[name], grads[name]
            w -= lr * wd * w
            momentum[name] = mu * momentum[name] + (1 - mu) * g
            u = g + mu * (momentum[name] - g)
            if name == "qkv.weight":
                rows = u.view(2, 16, 12)
                parts = [rows[:, :8].reshape(16, 12), rows[:, 8:12].reshape(8, 12),
                         rows[:, 12:].reshape(8, 12)]
                orth = torch.cat([(_ns_by_hand(p) * max(1, p.shape[0] / 12) ** 0.5).view(2, -1, 12)
                                  for p in parts], dim=1).view(32, 12)
            else:
                orth = _ns_by_hand(u)  # 12 x 12: shape scale 1
            w -= lr * 0.7 * orth
        for name, p in adam_ref.items():
            p.grad = grads[name]
        adam.step()
        main_of = {id(s.model_param): s.model_param.view(-1) if s.main is None else s.main
                   for s in opt.param_shards()}  # the fp32 main params
        got = {name: main_of[id(p)].detach().view(p.shape) for name, p in model.named_parameters()}
        for name in momentum:
            close(got[name], mains[name], rtol=0, atol=1e-5, msg=lambda m: f"{name} {step}: {m}")
        for name, p in adam_ref.items():
            close(got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_against_the_rule_written_out(dtype):
    assert run_workers(_one_step_worker, 1, dtype) == [True]


MUON = TINY + " --train-iters 5 --optimizer muon --muon-fp32-matmul-prec high --swiglu"
MOE = (MUON + " --num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 "
       "--moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall")
LAYOUTS = [  # (reference, extra arguments at world 2)
    (MUON, "--tensor-model-parallel-size 2 --sequence-parallel"),
    (MUON, "--tensor-model-parallel-size 2 --sequence-parallel --muon-tp-mode distributed"),
    (MUON, "--use-distributed-optimizer"),
    (MUON, "--optimizer dist_muon --overlap-grad-reduce --overlap-param-gather"),
    (MUON, "--pipeline-model-parallel-size 2"),
    (MOE, "--expert-model-parallel-size 2 --optimizer dist_muon"),
    (MOE, "--tensor-model-parallel-size 2 --sequence-parallel --muon-nesterov"),
]


def test_muon_loss_curves_equal_one_process():
    """5 steps of Muon (fp32 Newton-Schulz) under TP + SP (duplicated and distributed),
    DP with the distributed optimizer (dist_muon, also overlapped), PP, and an MoE model
    under EP (expert weights per expert, dist_muon) and TP + SP + ETP, against one process;
    Adam's curve differs."""
    references = list(dict.fromkeys(ref for ref, _ in LAYOUTS))
    refs = run_workers(train_runs, 1, references + [
        MUON.replace("--optimizer muon --muon-fp32-matmul-prec high", ""),
        MOE + " --muon-nesterov"])[0]
    curves = dict(zip(references, refs))
    assert max_rel_diff(refs[len(references)], curves[MUON]) > 1e-3  # Adam: another curve
    argvs = [f"{ref} {extra}" for ref, extra in LAYOUTS]
    results = run_workers(train_runs, 2, argvs)[0]
    for (ref, extra), losses in zip(LAYOUTS, results):
        want = refs[-1] if "--muon-nesterov" in extra else curves[ref]
        assert max_rel_diff(losses, want) <= 1e-5, (extra, losses, want)


def test_muon_state_resumes_from_both_checkpoint_formats(tmp_path):
    """Straight 6 steps == 3 + save + load + 3: Muon alone (torch format), dist_muon at DP=2
    (torch_dist, also loaded by TP = 2 Muon: the momentum is resharded); Adam refuses to
    load Muon's state."""
    base = MUON.replace("--train-iters 5", "--train-iters 6")
    adam = base.replace("--optimizer muon --muon-fp32-matmul-prec high", "")
    one = tmp_path / "torch"
    straight, first, second, refused = run_workers(train_runs, 1, [
        base, f"{base} --exit-interval 3 --save {one}", f"{base} --load {one}",
        f"{adam} --load {one}"])[0]
    assert first + second == straight
    assert refused.startswith("the checkpoint holds the optimizer state of --optimizer muon, "
                              "but this run uses --optimizer adam"), refused
    two = tmp_path / "dist"
    sharded = f"{base} --optimizer dist_muon --ckpt-format torch_dist"
    straight_dp, first, second, tp = run_workers(train_runs, 2, [
        sharded, f"{sharded} --exit-interval 3 --save {two}", f"{sharded} --load {two}",
        f"{base} --tensor-model-parallel-size 2 --load {two}"])[0]
    assert first + second == straight_dp
    assert max_rel_diff(first + tp, straight) <= 1e-5


def test_conversion_carries_the_muon_state(tmp_path):
    """torch -> torch_dist -> torch at PP = 2 carries Muon's momentum and the param groups
    (here with --decoupled-lr, untied): the converted checkpoint resumes the straight curve."""
    from tools import checkpoint_convert as convert
    base = (MUON.replace("--train-iters 5", "--train-iters 6")
            + " --decoupled-lr 1e-2 --untie-embeddings-and-output-weights")
    ours, dist, pp2 = tmp_path / "torch", tmp_path / "dist", tmp_path / "pp2"
    straight, first = run_workers(train_runs, 1, [
        base, f"{base} --exit-interval 3 --save {ours}"])[0]
    convert.main(["--load-dir", str(ours), "--save-dir", str(dist),
                  "--target-ckpt-format", "torch_dist"])
    convert.main(["--load-dir", str(dist), "--save-dir", str(pp2),
                  "--target-pipeline-parallel-size", "2"])
    (resumed,) = run_workers(train_runs, 2, [
        f"{base} --pipeline-model-parallel-size 2 --load {pp2}"])[0]
    assert max_rel_diff(first + resumed, straight) <= 1e-5


@pytest.mark.parametrize("flags, message", [
    ("--optimizer sgd", "--optimizer ('sgd'): SGD is not built; use adam or muon"),
    ("--optimizer adaptive_muon", "--optimizer ('adaptive_muon'): adaptive Muon"),
    ("--muon-nesterov --muon-tp-mode blockwise", "--muon-nesterov, --muon-tp-mode ('blockwise') "
                                                 "set Muon, but --optimizer ('adam') is not Muon"),
    ("--optimizer muon --fp16", "--optimizer ('muon') does not train fp16 models"),
    ("--optimizer muon --muon-scalar-optimizer lion", "--muon-scalar-optimizer ('lion'): Lion"),
    ("--optimizer muon --muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec ('low') is no torch"),
    ("--optimizer muon --muon-coefficient-type custom", "--muon-coefficient-type ('custom') must "
                                                        "be one of simple, quintic"),
    ("--optimizer muon --muon-num-ns-steps 0", "--muon-num-ns-steps (0) must be at least 1"),
    ("--optimizer muon --muon-momentum 1.0", "--muon-momentum (1.0) must be in [0, 1)"),
    ("--lion-beta1 0.9", "--lion-beta1 0.9: SGD and Lion are not built"),
])
def test_bad_muon_flags_name_the_flag(flags, message):
    from megatron_cp.cli.arguments import parse_args
    with pytest.raises(ValueError) as error:
        parse_args(f"{TINY} --train-iters 4 {flags}".split())
    lines = error.value.lines
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_dist_muon_is_muon_with_the_distributed_optimizer_and_syrk_is_noted():
    from megatron_cp.cli.arguments import parse_args
    args = parse_args(f"{TINY} --train-iters 4 --optimizer dist_muon --muon-use-syrk".split())
    assert args.optimizer == "muon" and args.use_distributed_optimizer
    assert any(note.startswith("--muon-use-syrk: Megatron-LM reads it nowhere at this commit; "
                               "Muon's Newton-Schulz Gram matrix") for note in args.compat_notes)
