"""MoE from the user's side: one-line errors naming the flags, the log line and tensorboard
(mean and per-layer balancing / z-loss, tokens per expert), --torch-compile with full
recomputation under EP, and generation with the key/value cache through MoE layers."""
import glob

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from training_utils import max_rel_diff, train_losses, train_runs

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --hidden-dropout 0 "
        "--attention-dropout 0 --mock-data --vocab-size 512 --eval-iters 0 --seed 11 "
        "--train-iters 4 --num-experts 4 --moe-ffn-hidden-size 64 --no-bias-gelu-fusion")


@pytest.mark.parametrize("extra, world, message", [
    ("--num-experts 0 --expert-model-parallel-size 2", 2,
     "--expert-model-parallel-size 2 splits MoE experts, but the model has none: add --num-experts"),
    ("--num-experts 3 --expert-model-parallel-size 2", 2,
     "--num-experts (3) must be divisible by --expert-model-parallel-size (2)"),
    ("--moe-router-topk 5", 1, "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    ("--moe-router-enable-expert-bias", 1,
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or sqrtsoftplus"),
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01", 1,
     "--moe-router-load-balancing-type (aux_loss seq_aux_loss) lists 2 types, so "
     "--moe-aux-loss-coeff needs 2 coefficients, one per type in the same order"),
    ("--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 0.02", 1,
     "--moe-aux-loss-coeff (0.01 0.02) gives 2 coefficients for one "
     "--moe-router-load-balancing-type (aux_loss)"),
    ("--moe-router-load-balancing-type quantile_balancing --moe-aux-loss-coeff 0.01", 1,
     "--moe-router-load-balancing-type 'quantile_balancing' balances with its per-expert bias, "
     "so --moe-aux-loss-coeff (0.01) must be 0"),
    ("--moe-router-load-balancing-type quantile_balancing --moe-expert-capacity-factor 1", 1,
     "chooses the experts with its own bias, and --moe-expert-capacity-factor: token dropping "
     "works with the aux-loss types or none only"),
    ("--moe-router-load-balancing-type quantile_balancing --moe-router-topk 4", 1,
     "so --moe-router-topk (4) must be below --num-experts (4)"),
    ("--moe-router-load-balancing-type quantile_balancing --num-experts 3", 1,
     "--micro-batch-size x --seq-length (64) tokens x --moe-router-topk (2) assignments, which "
     "must divide by --num-experts (3) (Megatron-LM's rule)"),
    ("--moe-router-load-balancing-type aux_loss sinkhorn --moe-aux-loss-coeff 0.01 0", 1,
     "--moe-router-load-balancing-type (aux_loss sinkhorn): sinkhorn balances by routing"),
    ("--moe-layer-freq [1]*3", 1, "--moe-layer-freq ([1]*3) has 3 entries for --num-layers (2)"),
    ("--moe-layer-freq foo", 1, "--moe-layer-freq (foo) must be an integer or a 0/1 list"),
    ("--moe-router-num-groups 2", 1, "--moe-router-num-groups (2) and --moe-router-group-topk "
                                     "(None) go together"),
    ("--moe-pad-expert-input-to-capacity", 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ("--expert-model-parallel-size 4", 2, "must divide the data x context x tensor parallel ranks "
                                          "of a pipeline stage (2)"),
    ("--moe-ffn-hidden-size 30 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 4",
     4, "--moe-ffn-hidden-size (30) must be divisible by --expert-tensor-parallel-size (4)"),
])
def test_bad_moe_flags_name_the_flag_and_the_fix(extra, world, message):
    with pytest.raises(ValueError) as error:
        parse_args(f"{BASE} {extra}".split(), world_size=world)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_balancing_lists_parse_as_megatron_lm_keeps_them():
    """A list of one type or coefficient is that value (Megatron-LM's validate_args), in the
    arguments too; longer lists are kept, one coefficient per type."""
    args = parse_args(f"{BASE} --moe-router-load-balancing-type seq_aux_loss "
                      f"--moe-aux-loss-coeff 0.01".split(), world_size=1)
    assert (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)
    args = parse_args(f"{BASE} --moe-router-load-balancing-type aux_loss global_aux_loss "
                      f"--moe-aux-loss-coeff 0.01 0.001".split(), world_size=1)
    assert args.moe_router_load_balancing_type == ("aux_loss", "global_aux_loss")
    assert args.moe_aux_loss_coeff == (0.01, 0.001)


def test_quantile_balancing_bias_is_saved_and_resumed(tmp_path):
    """qb_beta is a buffer of the checkpoint: 3 + save + 3 iterations equal 6 straight ones
    (a resume from a zero bias would route otherwise)."""
    from megatron_cp.checkpoint.torch_dist_format import read_full
    argv = f"{BASE} --moe-router-load-balancing-type quantile_balancing --train-iters 6"
    straight, first, second = run_workers(train_runs, 1, [
        argv, f"{argv} --exit-interval 3 --save {tmp_path}", f"{argv} --load {tmp_path}"])[0]
    assert len(straight) == 6 and first + second == straight
    saved, _ = read_full(str(tmp_path / "iter_0000003"))
    assert saved["model.decoder.layers.1.mlp.router.qb_beta"].abs().sum() > 0


def test_expert_tensor_parallel_size_defaults_to_tp():
    args = parse_args(f"{BASE} --tensor-model-parallel-size 2".split(), world_size=2)
    assert args.expert_tensor_parallel_size == 2
    args = parse_args(f"{BASE} --moe-grouped-gemm".split(), world_size=1)  # Megatron's flag
    assert any("--moe-grouped-gemm" in note for note in args.compat_notes)


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(glob.glob(f"{folder}/events.*")[0])
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_log_line_and_tensorboard_show_balancing_and_imbalance(tmp_path, capfd):
    argv = (f"{BASE} --log-interval 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
            f"--moe-layer-freq ([0]+[1]) --moe-per-layer-logging "
            f"--tensorboard-dir {tmp_path} --expert-model-parallel-size 2")
    run_workers(train_losses, 2, argv)
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 2
    for line in lines:
        assert "load_balancing_loss: " in line and "z_loss: " in line
        assert "tokens per expert min/max: " in line and "layer 1 balancing/z/min/max" in line
        assert "layer 0 " not in line  # the dense first layer
    scalars = _events(tmp_path)
    assert len(scalars["load_balancing_loss"]) == 2
    # one MoE layer: its per-layer value is the mean; about coeff with balanced routing
    assert scalars["load_balancing_loss"] == scalars["moe/load_balancing_loss_layer_1"]
    assert 0.005 < scalars["load_balancing_loss"][0] < 0.05
    assert scalars["z_loss"][0] > 0
    # 8 x 32 tokens x top-2 per iteration over 4 experts: the counts sum to 512
    low, high = scalars["moe/tokens-per-expert-min"][0], scalars["moe/tokens-per-expert-max"][0]
    assert 0 <= low <= 128 <= high <= 512
    assert "moe/load_balancing_loss_layer_0" not in scalars


def test_torch_compile_with_full_recompute_under_ep():
    argv = (f"{BASE} --moe-aux-loss-coeff 0.01 --moe-shared-expert-intermediate-size 32 "
            f"--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --log-interval 100")
    eager = run_workers(train_losses, 2, argv)[0]
    compiled = run_workers(train_losses, 2, f"{argv} --torch-compile --recompute-granularity full "
                                            f"--recompute-method uniform --recompute-num-layers 1",
                                            timeout=400)[0]
    assert max_rel_diff(compiled, eager) <= 1e-5


def test_kv_cache_through_moe_layers():
    from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
    from megatron_cp.model import GPTConfig, GPTModel
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                       num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=16,
                       hidden_dropout=0.0, attention_dropout=0.0, seed=3)
    model = GPTModel(config).eval()
    tokens = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(3, 12)
    cache = KVCache([model], 12)
    with torch.no_grad():
        cached_chunk_forward(model, tokens[:, :5], positions[:, :5], None, cache.layers[0])
        pieces = cached_chunk_forward(model, tokens[:, 5:], positions[:, 5:], None, cache.layers[0])
        whole = model(tokens, positions)  # [s, b, v]
    torch.testing.assert_close(pieces, whole[-1:], rtol=1e-5, atol=1e-5)  # the last position


def _expert_bias_after_steps(rank, world, argv, steps):
    from megatron_cp import moe
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    (_, layer), = moe.moe_layers(trainer.model_chunks)
    before = layer.router.weight.detach().clone()
    for _ in range(steps):
        trainer.train_step()
    names = [n for n, _ in trainer.model.module.named_parameters()]
    saved = "decoder.layers.1.mlp.router.expert_bias" in trainer.model.module.state_dict()
    return (layer.router.expert_bias.clone(), saved, names,
            not torch.equal(before, layer.router.weight.detach()))


def test_expert_bias_moves_once_per_global_batch_and_is_not_trained():
    argv = (f"{BASE} --moe-layer-freq ([0]+[1]) --moe-router-score-function sigmoid "
            f"--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.25 --log-interval 100")
    bias, saved, names, router_trained = run_workers(_expert_bias_after_steps, 1, argv, 3)[0]
    # three updates of +-0.25 each (sign of mean count - count; 0 when exactly even)
    assert bias.abs().max() > 0 and bias.abs().max() <= 0.75
    assert torch.equal(bias * 4, (bias * 4).round())
    assert saved  # in the state dict: checkpoints keep it
    assert not any("expert_bias" in n for n in names) and router_trained  # a buffer, not a param



def _generate(rank, world, argv):
    from megatron_cp.inference.launch import parse_inference_args
    from training_utils import parallel_state
    from tools.run_text_generation import (check_generation_args, get_generation_args,
                                           run_generation)
    args = parse_inference_args(argv, world, get_generation_args, check_generation_args)
    return run_generation(args, parallel_state(args))


def test_generation_when_experts_span_data_parallel_ranks(tmp_path):
    """EP=2 borrows the two DP ranks: both must run every forward together (each generates
    every prompt); the tokens equal one process's (the torch_dist checkpoint loads at EP=1)."""
    run_workers(train_losses, 2, f"{BASE} --expert-model-parallel-size 2 --log-interval 100 "
                                 f"--moe-token-dispatcher-type alltoall --ckpt-format torch_dist "
                                 f"--save {tmp_path}")
    prompts = ["1", "5 7 9", "3 4"]
    argv = f"--load {tmp_path} --use-checkpoint-args --greedy --max-new-tokens 6".split()
    for prompt in prompts:
        argv += ["--prompt", prompt]
    one = run_workers(_generate, 1, argv)[0]
    both = run_workers(_generate, 2, argv + ["--expert-model-parallel-size", "2"])
    assert [r["prompt"] for r in one] == prompts and all(r["ids"] for r in one)
    assert both[0] == both[1] == one
