"""The GELU Megatron-LM computes for its flags, against megatron-core 0.16.1's own MLP.

Megatron-LM's arguments.py passes ``bias_gelu_fusion`` (on unless --no-bias-gelu-fusion; off
with --disable-bias-linear) as TransformerConfig.bias_activation_fusion; its MLP then runs
``bias_gelu_impl`` (the tanh approximation) or ``F.gelu`` (erf). --openai-gelu and
--transformer-impl change neither. Our MLP, built from our parse of the same flags, gives
megatron-core's output with the same weights, on inputs where the two GELUs differ.
"""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.cli.arguments import ArgumentErrors, parse_args
from megatron_cp.layers.mlp import MLP
from megatron_cp.startup import config_from_args
from training_utils import TINY

H, F = 32, 64
# flags -> Megatron-LM's bias_activation_fusion for them (arguments.py, argument_utils.py)
CASES = {
    "": True,
    "--no-bias-gelu-fusion": False,
    "--disable-bias-linear": False,
    "--openai-gelu": True,
    "--openai-gelu --no-bias-gelu-fusion": False,
    "--transformer-impl local": True,
    "--transformer-impl transformer_engine --no-bias-gelu-fusion": False,
}


def _megatron_mlp(rank, world, fusion, bias, x):
    """Worker: megatron-core's MLP (its local linears) with ``bias_activation_fusion`` = fusion
    on ``x`` [s, b, h]: its output and its weights."""
    import megatron_core_utils as mcu
    mcu._patch_cpu()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP as CoreMLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               ffn_hidden_size=F, add_bias_linear=bias,
                               bias_activation_fusion=fusion, use_cpu_initialization=True,
                               init_method_std=0.5)
    torch.manual_seed(0)
    mlp = CoreMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                        linear_fc2=RowParallelLinear))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
        out, out_bias = mlp(x)
    out = out + out_bias if out_bias is not None else out
    return out, {k: v.clone() for k, v in mlp.state_dict().items() if "extra_state" not in k}


def _ours(flags, weights, x):
    args = parse_args(f"{TINY} --train-iters 4 --ffn-hidden-size {F} {flags}".split(),
                      world_size=1)
    config = config_from_args(args, 200)
    mlp = MLP(config, "decoder.layers.0.mlp", tp_group=None)
    mlp.load_state_dict(weights)
    with torch.no_grad():
        return mlp(x), config


@pytest.fixture(scope="module")
def megatron_outputs():
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(1)) * 2
    runs = {(fusion, bias): run_workers(_megatron_mlp, 1, fusion, bias, x)[0]
            for fusion, bias in ((True, True), (False, True), (False, False))}
    return x, runs


@pytest.mark.parametrize("flags", list(CASES))
def test_our_mlp_computes_megatron_lms_gelu(megatron_outputs, flags):
    x, runs = megatron_outputs
    bias = "--disable-bias-linear" not in flags
    theirs, weights = runs[(CASES[flags], bias)]
    ours, config = _ours(flags, weights, x)
    assert config.activation == ("gelu_tanh" if CASES[flags] else "gelu")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if bias:  # sharp: the other GELU's megatron-core output is far off
        other = runs[(not CASES[flags], True)][0]
        assert (other - theirs).abs().max() > 1e-3


def _core_moe_forward(rank, world, fusion):
    """Worker: megatron-core's SequentialMLP experts (GELU, biases) on a few routed tokens:
    "ran", or the error it stops with."""
    import megatron_core_utils as mcu
    mcu._patch_cpu()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               num_moe_experts=2, moe_ffn_hidden_size=F, add_bias_linear=True,
                               bias_activation_fusion=fusion, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False)
    experts = SequentialMLP(2, config, spec.submodules.mlp.submodules.experts.submodules,
                            ProcessGroupCollection.use_mpu_process_groups())
    try:
        with torch.no_grad():  # its in-place bias add is refused by autograd on CPU
            experts(torch.randn(4, H), torch.tensor([2, 2]), torch.ones(4))
    except ValueError as error:
        return str(error)
    return "ran"


def test_moe_gelu_with_biases_refused_as_megatron_core_stops():
    """MoE experts, GELU, biases: megatron-core's experts stop at their first forward under
    the bias-GELU fusion and run without it; we refuse the first and build the second."""
    assert "Only support fusion of swiglu and quick_gelu" in run_workers(
        _core_moe_forward, 1, True)[0]
    assert run_workers(_core_moe_forward, 1, False)[0] == "ran"
    moe = f"{TINY} --train-iters 4 --num-experts 2 --moe-ffn-hidden-size 16"
    with pytest.raises(ArgumentErrors) as refused:
        parse_args(moe.split(), world_size=1)
    assert len(refused.value.lines) == 1 and "--no-bias-gelu-fusion" in refused.value.lines[0]
    config = config_from_args(parse_args(f"{moe} --no-bias-gelu-fusion".split(), world_size=1),
                              200)
    assert config.activation == "gelu"


def test_squared_relu_with_the_fusion_refused_as_megatron_core_does():
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig
    with pytest.raises(ValueError, match="bias_activation_fusion"):
        TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                          activation_func=squared_relu, bias_activation_fusion=True)
    with pytest.raises(ArgumentErrors) as refused:
        parse_args(f"{TINY} --train-iters 4 --squared-relu".split(), world_size=1)
    assert len(refused.value.lines) == 1 and "--no-bias-gelu-fusion" in refused.value.lines[0]
    for fix in ("--no-bias-gelu-fusion", "--disable-bias-linear"):
        args = parse_args(f"{TINY} --train-iters 4 --squared-relu {fix}".split(), world_size=1)
        assert config_from_args(args, 200).activation == "squared_relu"


def _resumed_mlp(rank, world, argv, x):
    """Worker: the trainer of ``argv`` after its load; (its banner notes, layer 0's MLP on
    ``x``, that MLP's fc2(gelu(fc1(x))) with the erf and with the tanh GELU, its activation)."""
    from megatron_cp.observability.run_report import format_compat_notes
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.checkpointer.load(trainer.train_state(), args.load)
    model = trainer.model_chunks[0]
    model = getattr(model, "module", model)
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        h = mlp.linear_fc1(x)
        erf = mlp.linear_fc2(torch.nn.functional.gelu(h))
        tanh = mlp.linear_fc2(torch.nn.functional.gelu(h, approximate="tanh"))
        return format_compat_notes(run.notes), mlp(x), erf, tanh, mlp.activation


def test_checkpoint_of_the_old_default_resumes_with_the_erf_gelu(tmp_path):
    """A checkpoint saved before the setting existed (no bias_gelu_fusion in its saved
    arguments, as megatron_cp wrote them) resumes with the exact GELU it was trained with,
    and the banner says so in one line; one saved now keeps Megatron-LM's tanh GELU."""
    ck = tmp_path / "ck"
    run = f"{TINY} --ffn-hidden-size {F} --lr-warmup-iters 1 --lr-decay-iters 8 --ckpt-format torch"
    run_workers(_train, 1, f"{run} --train-iters 2 --save {ck}")
    shard = ck / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(2)) * 30
    notes, out, erf, tanh, activation = run_workers(_resumed_mlp, 1, f"{run} --load {ck} "
                                                    f"--train-iters 4", x)[0]
    assert activation == "gelu_tanh" and not notes
    torch.testing.assert_close(out, tanh, rtol=0, atol=0)
    assert (tanh - erf).abs().max() > 1e-5  # sharp: the two GELUs differ here
    payload = torch.load(shard, weights_only=False)
    assert payload["args"]["bias_gelu_fusion"] is True
    del payload["args"]["bias_gelu_fusion"]
    torch.save(payload, shard)
    notes, out, erf, _, activation = run_workers(_resumed_mlp, 1, f"{run} --load {ck} "
                                                 f"--train-iters 4", x)[0]
    assert activation == "gelu"
    torch.testing.assert_close(out, erf, rtol=0, atol=0)
    lines = [line for line in notes.splitlines() if "GELU" in line]
    assert len(lines) == 1 and "exact (erf) GELU of megatron_cp's earlier default" in lines[0]
    # a flag on the command line wins, and then there is nothing to say
    notes, _, _, _, activation = run_workers(_resumed_mlp, 1, f"{run} --load {ck} --train-iters 4 "
                                             f"--no-bias-gelu-fusion", x)[0]
    assert activation == "gelu" and "GELU" not in notes


def _train(rank, world, argv):
    from training_utils import train_losses
    return train_losses(rank, world, argv)


def test_old_openai_gelu_checkpoints_keep_their_tanh_gelu():
    from megatron_cp.checkpoint.old_defaults import with_old_defaults
    assert with_old_defaults({"openai_gelu": True})[0]["bias_gelu_fusion"] is True
    assert with_old_defaults({"openai_gelu": False})[0]["bias_gelu_fusion"] is False
    now = {"bias_gelu_fusion": True, "calculate_per_token_loss": False}
    assert with_old_defaults(now) == (now, [])
    # a SwiGLU model (a Llama import) computes the same either way: nothing to say
    assert with_old_defaults({"swiglu": True, "calculate_per_token_loss": False})[1] == \
        [("bias_gelu_fusion", None)]
    with pytest.raises(ValueError, match="--openai-gelu --disable-bias-linear"):
        with_old_defaults({"openai_gelu": True, "disable_bias_linear": True})
