"""muP (--use-mup and its settings, Megatron-LM's meaning): each rule changes what it should,
against hand-computed values, and a muP model under TP = 2 (with SP) equals one process.

The model is built twice from the same seed, with and without muP: every weight is drawn from
the same generator, so a muP init is the plain init times an exact factor (1/sqrt(width_mult)
for hidden weights, 1 for the embedding-class ones)."""
import math

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.optimizer import OptimizerParamScheduler, get_param_groups
from megatron_cp.optimizer.optimizer import mup_group_overrides
from megatron_cp.tensor_parallel import gather_from_tensor_model_parallel_region
from model_utils import full_grads, tiny_config
from training_utils import TINY, assert_refused, max_rel_diff, train_runs

close = torch.testing.assert_close
# hidden 32 over a base of 8: width_mult 4
MUP = dict(use_mup=True, mup_base_hidden_size=8)


def _batch(b=2, s=16, vocab=120):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    return tokens, torch.arange(s).expand(b, s), torch.randint(0, vocab, (b, s), generator=gen)


def test_config_derives_width_mult_output_mult_and_attention_scale():
    config = tiny_config(**MUP)  # hidden 32, 4 heads: kv_channels 8
    assert config.mup_width_mult == 4.0
    assert config.mup_output_mult == 0.25  # left at 1: 1 / width_mult
    assert config.softmax_scale == pytest.approx(1 / 8)  # 1/d instead of 1/sqrt(d)
    assert config.hidden_init_std == pytest.approx(0.02 / 2)
    config = tiny_config(**MUP, mup_base_head_dim=4.0, mup_attn_scale_power=0.5,
                         mup_output_mult=0.7)
    assert config.softmax_scale == pytest.approx(math.sqrt(4.0) / math.sqrt(8))
    assert config.mup_output_mult == 0.7  # given: kept
    plain = tiny_config()
    assert plain.softmax_scale is None and plain.hidden_init_std == 0.02


def test_init_scales_hidden_weights_only():
    """Hidden weights (QKV, fc1, and the residual outputs proj / fc2 on top of their 1/sqrt(2L))
    are the plain init / sqrt(4); the embeddings and the untied output layer are not scaled."""
    untied = dict(untie_embeddings_and_output_weights=True,
                  position_embedding_type="learned_absolute")
    plain = dict(GPTModel(tiny_config(**untied)).named_parameters())
    mup = dict(GPTModel(tiny_config(**untied, **MUP)).named_parameters())
    hidden = [n for n in plain if plain[n].dim() == 2 and "embedding" not in n
              and not n.startswith("output_layer")]
    assert {n.split(".")[-2] for n in hidden} == {"linear_qkv", "linear_proj", "linear_fc1",
                                                  "linear_fc2"}
    for name, weight in plain.items():
        ratio = 0.5 if name in hidden else 1.0
        close(mup[name], weight * ratio if weight.dim() == 2 else weight, msg=name)


def test_multipliers_scale_embeddings_and_logits():
    """At width_mult 1 (base = hidden) the weights are the plain ones: the embedding output is
    times --mup-embedding-mult and the logits times --mup-output-mult."""
    tokens, pos, _ = _batch()
    plain = GPTModel(tiny_config()).eval()
    mup = GPTModel(tiny_config(use_mup=True, mup_attn_scale_power=0.5, mup_embedding_mult=1.0,
                               mup_output_mult=0.3)).eval()
    close(mup(tokens, pos), plain(tokens, pos) * 0.3)
    mup = GPTModel(tiny_config(use_mup=True, mup_attn_scale_power=0.5,
                               mup_embedding_mult=2.5)).eval()
    close(mup.embedding(tokens, pos), plain.embedding(tokens, pos) * 2.5)
    assert not torch.allclose(mup(tokens, pos), plain(tokens, pos))


def test_attention_scale_is_one_over_head_dim():
    """Power 0.5 at width 1 is the standard 1/sqrt(d): the plain model's logits; power 1
    (muP's default) scales the scores by 1/d: the logits move; and the layer uses it."""
    tokens, pos, _ = _batch()
    plain = GPTModel(tiny_config()).eval()
    standard = GPTModel(tiny_config(use_mup=True, mup_attn_scale_power=0.5)).eval()
    close(standard(tokens, pos), plain(tokens, pos))
    mup = GPTModel(tiny_config(use_mup=True)).eval()
    assert mup.decoder.layers[0].self_attention.softmax_scale == pytest.approx(1 / 8)
    assert not torch.allclose(mup(tokens, pos), plain(tokens, pos), atol=1e-4)


def test_param_groups_scale_adam_hidden_lr_min_lr_and_eps():
    model = GPTModel(tiny_config(**MUP, untie_embeddings_and_output_weights=True,
                                 position_embedding_type="learned_absolute"))
    overrides = mup_group_overrides(4.0, lr=1e-2, min_lr=1e-3, adam_eps=1e-8)
    assert overrides == pytest.approx({"max_lr": 2.5e-3, "min_lr": 2.5e-4, "eps": 2.5e-9})
    assert mup_group_overrides(1.0, 1e-2, 1e-3, 1e-8) is None  # width 1: nothing scales
    assert "eps" not in mup_group_overrides(4.0, 1e-2, 1e-3, 1e-8, "muon")
    groups = get_param_groups(model, 0.1, mup=overrides)
    names = {id(p): n for n, p in model.named_parameters()}
    scaled = {names[id(p)] for g in groups if g["is_mup_hidden"] for p in g["params"]}
    want = {n for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n
            and not n.startswith("output_layer")}
    assert scaled == want
    for group in groups:
        assert (group.get("eps") == 2.5e-9) == group["is_mup_hidden"]
    # the schedule of each group runs between its own ends (linear: half way at step 6)
    scheduler = OptimizerParamScheduler(_Optimizer(groups), max_lr=1e-2, min_lr=1e-3,
                                        lr_warmup_steps=2, lr_decay_steps=10,
                                        lr_decay_style="linear")
    scheduler.step(6)
    for group in groups:
        want_lr = (2.5e-3 + 2.5e-4) / 2 if group["is_mup_hidden"] else (1e-2 + 1e-3) / 2
        assert group["lr"] == pytest.approx(want_lr)
    assert not any(g["is_mup_hidden"] for g in get_param_groups(model, 0.1))


class _Optimizer:
    def __init__(self, groups):
        self.param_groups = groups


def test_flags_without_use_mup_are_refused():
    assert_refused(TINY + " --mup-base-hidden-size 8",
                   "--mup-base-hidden-size (8) only applies with --use-mup")
    assert_refused(TINY + " --use-mup --mup-base-hidden-size 8 --mup-width-mult 2",
                   "--mup-width-mult (2.0) is computed as")


def _tp_parity(rank, world):
    """A muP model (width_mult 4, embedding multiplier, base head dim) under TP = 2 with and
    without SP: the logits, loss and every gradient of the one-process model."""
    tokens, pos, labels = _batch()
    kw = dict(MUP, mup_embedding_mult=1.7, mup_base_head_dim=6.0, num_query_groups=2,
              activation="swiglu")
    state = initialize_model_parallel(tensor_model_parallel_size=world)
    for sp in (False, True):
        ref = GPTModel(tiny_config(**kw, sequence_parallel=sp))
        model = GPTModel(tiny_config(**kw, sequence_parallel=sp), state=state)
        logits = gather_from_tensor_model_parallel_region(model(tokens, pos), state.group("tp"))
        close(logits, ref(tokens, pos))
        loss, loss_ref = model(tokens, pos, labels=labels), ref(tokens, pos, labels=labels)
        close(loss, loss_ref)
        loss.sum().backward()
        loss_ref.sum().backward()
        got = full_grads(model, state.group("tp"))
        for name, p in ref.named_parameters():
            close(got[name], p.grad, msg=lambda m: f"sp={sp} grad {name}: {m}")
    return True


def test_tp2_model_matches_one_process():
    assert all(run_workers(_tp_parity, 2))


MUP_RUN = TINY + " --train-iters 4 --use-mup --mup-base-hidden-size 8 --mup-embedding-mult 2"


def test_training_curve_tp2_and_dp2_distributed_match_one_process():
    """Loss curves (per-group rates and eps in the optimizer) under TP = 2 with SP and DP = 2
    with the distributed optimizer equal one process; without muP the curve differs."""
    runs = [MUP_RUN, TINY + " --train-iters 4",
            MUP_RUN + " --tensor-model-parallel-size 2 --sequence-parallel",
            MUP_RUN + " --use-distributed-optimizer"]
    one = run_workers(train_runs, 1, runs[:2])[0]
    two = run_workers(train_runs, 2, runs[2:])[0]
    ref, plain = one
    assert max_rel_diff(plain, ref) > 1e-3
    for losses in two:
        assert max_rel_diff(losses, ref) <= 1e-5, (losses, ref)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resume_keeps_the_mup_groups(tmp_path, ckpt_format):
    """A resumed muP run (its scaled groups saved and matched by key) continues the curve."""
    base = MUP_RUN.replace("--train-iters 4", "--train-iters 6") + f" --ckpt-format {ckpt_format}"
    straight, first, second = run_workers(train_runs, 1, [
        base, f"{base} --exit-interval 3 --save {tmp_path}", f"{base} --load {tmp_path}"])[0]
    assert first + second == straight
