"""The numerics flags (--qk-layernorm, --apply-layernorm-1p, YaRN, --rotary-interleaved,
--squared-relu, Llama 3.1's --use-rope-scaling with position interpolation) under TP (with and
without SP) and CP against one process, in outputs and every gradient, and in training
(--use-rope-scaling); their weight-decay rule in training (--apply-wd-to-qk-layernorm, Megatron's
point of zero-centred weights); their weights through both checkpoint formats, a reshard and
the Hugging Face export."""
import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.checkpoint.hf import convert as hf_convert
from megatron_cp.cli.arguments import parse_args
from megatron_cp.context_parallel import zigzag_indices, zigzag_split
from megatron_cp.checkpoint.torch_dist_format import read_full
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.optimizer import get_param_groups
from megatron_cp.distributed.data_parallel import finalize_model_grads
from megatron_cp.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron_cp.training import Trainer
from model_utils import gather_full, tiny_config
from tools import checkpoint_convert as convert
from training_utils import TINY, max_rel_diff, run_and_state, train_losses

close = torch.testing.assert_close

PARALLEL_CONFIGS = {
    "qk_layernorm": dict(qk_layernorm=True),
    "qk_rmsnorm_1p_gqa": dict(qk_layernorm=True, normalization="RMSNorm", num_query_groups=2,
                              layernorm_zero_centered_gamma=True),
    "yarn": dict(position_embedding_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
                 mscale_all_dim=0.5, yarn_original_max_position_embeddings=16),
    "interleaved_squared_relu": dict(rotary_interleaved=True, squared_relu=True),
    "llama3_interpolated": dict(use_rope_scaling=True, rope_scaling_factor=16.0,
                                rotary_base=500000.0, rotary_seq_len_interpolation_factor=2),
}
LAYOUTS = ((2, 1, False), (2, 1, True), (1, 2, False))  # (TP, CP, SP)


def _reference(kw, tokens, positions, labels, weights):
    model = GPTModel(tiny_config(**kw))
    with torch.no_grad():
        logits = model(tokens, positions)  # [s, b, v]
    loss = model(tokens, positions, labels=labels)  # [b, s]
    (loss * weights).sum().backward()
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check_layout(kw, tp, cp, sp, batch, reference):
    """The model under (TP, CP, SP) on this rank's share of ``batch``: its logits and losses
    are the reference's, and every gradient, after the step's reductions (finalize_model_grads
    over TP; the DP x CP sum DDP does), is the reference's."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model = GPTModel(tiny_config(**kw, sequence_parallel=sp), state=state)
    cp_rank = state.rank("cp")
    tokens, positions, labels, weights = (zigzag_split(t, cp_rank, cp, dim=1) for t in batch)
    # positions stay global under CP; attention's causality reads each token's index
    index = zigzag_indices(cp_rank, cp, batch[0].shape[1]).expand(tokens.shape[0], -1) \
        if cp > 1 else None
    logits = model(tokens, positions, token_index=index)  # [s/cp, b, v/tp]
    if tp > 1:
        logits = gather_from_tensor_model_parallel_region(logits, state.group("tp"))
    close(logits.detach(), zigzag_split(reference[0], cp_rank, cp, dim=0))
    loss = model(tokens, positions, labels=labels, token_index=index)
    close(loss.detach(), zigzag_split(reference[1], cp_rank, cp, dim=1))
    (loss * weights).sum().backward()
    finalize_model_grads([model], state)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if cp > 1:
            dist.all_reduce(grad, group=state.group("cp"))
        close(gather_full(grad, p, state.group("tp")), reference[2][name],
              msg=lambda m: f"{kw} tp={tp} cp={cp} sp={sp} grad {name}: {m}")


def _parallel_cases(rank, world):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 120, (2, 16), generator=gen)
    labels = torch.randint(0, 120, (2, 16), generator=gen)
    positions = torch.arange(40, 56).expand(2, 16)  # beyond YaRN's original context of 16
    weights = torch.linspace(0.5, 1.5, 32).view(2, 16)
    batch = (tokens, positions, labels, weights)
    for kw in PARALLEL_CONFIGS.values():
        reference = _reference(kw, *batch)
        for tp, cp, sp in LAYOUTS:
            _check_layout(kw, tp, cp, sp, batch, reference)
    return True


def test_tp_sp_cp_match_one_process():
    """The QK norms' weights see other heads on each TP rank, with or without SP: their
    gradients are summed over TP. Rotary (YaRN, interleaved) reads global positions under CP."""
    assert all(run_workers(_parallel_cases, 2))


def _jobs(rank, world, jobs):
    return [fn(rank, world, *job_args) for fn, *job_args in jobs]


def test_llama3_rope_scaling_trains_under_cp_and_tp_as_one_process():
    """Llama 3.1's scaling (every band of frequencies at base 500000) trains 4 steps under
    CP=2 (zigzag chunks, global positions) and TP=2 with SP to the one-process losses."""
    argv = f"{TINY} --train-iters 4 --use-rope-scaling --rotary-base 500000"
    reference = run_workers(train_losses, 1, argv)[0]
    layouts = ("--context-parallel-size 2 --cp-comm-type p2p",
               "--tensor-model-parallel-size 2 --sequence-parallel")
    for rank_losses in run_workers(_jobs, 2, [(train_losses, f"{argv} {extra}")
                                              for extra in layouts]):
        for extra, losses in zip(layouts, rank_losses):
            assert max_rel_diff(losses, reference) < 1e-5, (extra, losses, reference)
    plain = run_workers(train_losses, 1, argv.replace(" --use-rope-scaling", ""))[0]
    # the flag reached the model: positions below 32 turn the slow channels little, so the
    # losses move a little (the effect itself: tests/layers/test_rope_scaling.py)
    assert plain != reference


# ----- weight decay: --apply-wd-to-qk-layernorm, and why zero-centred weights -----------

def test_qk_norms_decay_only_with_apply_wd_to_qk_layernorm():
    """Megatron-LM's rule: no norm weight or bias (no 1-D param) is decayed, except the QK
    norms' with --apply-wd-to-qk-layernorm."""
    model = GPTModel(tiny_config(qk_layernorm=True))
    names = {id(p): n for n, p in model.named_parameters()}
    qk = {n for n in names.values() if "q_layernorm." in n or "k_layernorm." in n}
    assert len(qk) == 2 * 2 * 2  # weight and bias of the q and k norms of 2 layers
    for apply_wd in (False, True):
        decay, no_decay = get_param_groups(model, 0.1, apply_wd_to_qk_layernorm=apply_wd)
        assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
        decayed = {names[id(p)] for p in decay["params"]}
        assert decayed & qk == (qk if apply_wd else set())
        assert all(p.dim() == 2 for p in decay["params"] if names[id(p)] not in qk)


def _trained(rank, world, argv, steps=3):
    """Every parameter after ``steps`` training steps, zero-centred norm weights w given as
    the scale 1 + w they stand for."""
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    for _ in range(steps):
        trainer.train_step()
    shift = 1.0 if args.apply_layernorm_1p else 0.0
    return {n: p.detach() + shift if n.endswith("layernorm.weight") else p.detach().clone()
            for n, p in trainer.model_chunks[0].module.named_parameters()}


def test_zero_centred_weights_change_training_only_where_norms_decay():
    """Zero-centred norms train exactly like plain ones (Adam moves w and 1 + w alike) as long
    as no norm weight decays, Megatron's default; with --apply-wd-to-qk-layernorm the decay
    pulls a plain QK norm's scale towards 0 and a zero-centred one's towards 1."""
    base = TINY + " --train-iters 3 --qk-layernorm --weight-decay 0.1"
    runs = {(one_p, wd): run_workers(_trained, 1, base + one_p + wd)[0]
            for one_p in ("", " --apply-layernorm-1p")
            for wd in ("", " --apply-wd-to-qk-layernorm")}
    plain, zero_centred = runs["", ""], runs[" --apply-layernorm-1p", ""]
    for name in plain:  # fp32: 1 + w and the plain scale round apart by ~1e-7 per step
        close(zero_centred[name], plain[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    plain = runs["", " --apply-wd-to-qk-layernorm"]
    zero_centred = runs[" --apply-layernorm-1p", " --apply-wd-to-qk-layernorm"]
    qk = [n for n in plain if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    for name in qk:  # 3 steps of lr x wd ~ 1e-4 each: the plain scales shrank that much more
        assert (plain[name] - zero_centred[name]).max() < -1e-4, name


# ----- checkpoints and export ---------------------------------------------------------------

FLAGS = (TINY.replace("--vocab-size 200 --make-vocab-size-divisible-by 64",
                      "--tokenizer-type NullTokenizer --vocab-size 512")
         + " --qk-layernorm --apply-layernorm-1p --apply-wd-to-qk-layernorm --lr-decay-iters 10")


def test_checkpoints_carry_the_qk_norms(tmp_path):
    """Saved under TP=2 at iteration 2 in both formats, resumed to 4: under TP=2 (torch), under
    DP=2 (torch_dist, any layout) and after conversions to torch_dist and back to torch at
    TP=1 with the Adam moments (the decayed QK norms sit in the optimizer's first group, as
    the trainer orders them), and from the trainer's torch_dist to torch at TP=1, each resume repeats the straight run's losses 3 and 4."""
    tp2 = f"{FLAGS} --tensor-model-parallel-size 2"
    torch_ck, dist_ck, resharded = tmp_path / "torch", tmp_path / "dist", tmp_path / "tp1"
    straight, _, _ = run_workers(_jobs, 2, [
        (train_losses, f"{tp2} --train-iters 4"),
        (train_losses, f"{tp2} --train-iters 2 --save {torch_ck} --ckpt-format torch"),
        (train_losses, f"{tp2} --train-iters 2 --save {dist_ck} --ckpt-format torch_dist")])[0]
    full, args, _ = convert.load_full(str(torch_ck))
    saved, _ = read_full(str(dist_ck / "iter_0000002"))
    for layer in range(2):
        for norm in ("q_layernorm", "k_layernorm"):
            name = f"decoder.layers.{layer}.self_attention.{norm}.weight"
            assert full[name].shape == (8,) and full[name].abs().max() > 0  # trained away from 0
            assert torch.equal(saved[f"model.{name}"], full[name])
    # torch -> torch_dist -> torch TP=1 carries the Adam moments, in the optimizer's order
    convert.main(["--load-dir", str(torch_ck), "--save-dir", str(tmp_path / "converted"),
                  "--target-ckpt-format", "torch_dist"])
    convert.main(["--load-dir", str(tmp_path / "converted"), "--save-dir", str(resharded),
                  "--target-tensor-parallel-size", "1"])
    # a trainer's torch_dist lists the params in its own order; the torch output keeps the model's
    convert.main(["--load-dir", str(dist_ck), "--save-dir", str(tmp_path / "from_dist"),
                  "--target-tensor-parallel-size", "1"])
    resumed = run_workers(_jobs, 2, [
        (train_losses, f"{tp2} --train-iters 4 --load {torch_ck}"),
        (train_losses, f"{FLAGS} --train-iters 4 --load {dist_ck}"),
        (train_losses, f"{FLAGS} --train-iters 4 --load {resharded}"),
        (train_losses, f"{FLAGS} --train-iters 4 --load {tmp_path / 'from_dist'}")])[0]
    for losses in resumed:
        assert max_rel_diff(losses, straight[2:]) < 1e-5, (losses, straight)


def _llama_args(**extra):
    return {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
            "max_position_embeddings": 64, "normalization": "RMSNorm", "swiglu": True,
            "disable_bias_linear": True, "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "true_vocab_size": 120,
            "norm_epsilon": 1e-5, "rotary_base": 10000.0, **extra}


def test_hugging_face_export_turns_zero_centred_weights_into_scales(tmp_path):
    """A --apply-layernorm-1p Llama exports its norms' 1 + w: transformers' logits are ours.
    Settings no layout expresses are refused, one line naming the flag."""
    from transformers import LlamaForCausalLM
    config = tiny_config(normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128,
                         layernorm_zero_centered_gamma=True)
    model = GPTModel(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    full = dict(model.state_dict())
    assert hf_convert.export_hf(full, _llama_args(apply_layernorm_1p=True), str(tmp_path),
                                tokenizer=False) == "LlamaForCausalLM"
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = torch.randint(0, 120, (2, 16), generator=gen)
    with torch.no_grad():
        ours = model(tokens, torch.arange(16).expand(2, 16)).transpose(0, 1)[..., :120]
        theirs = hf(input_ids=tokens).logits
    close(theirs, ours, rtol=1e-4, atol=1e-4)
    for flag, key in (("--qk-layernorm", "qk_layernorm"),
                      ("--rotary-interleaved", "rotary_interleaved"),
                      ("--squared-relu", "squared_relu")):
        try:
            hf_convert.export_hf(full, _llama_args(**{key: True}), str(tmp_path / key),
                                 tokenizer=False)
        except ValueError as err:
            assert str(err).startswith(f"the checkpoint was trained with {flag} ") and \
                "cannot be exported" in str(err), str(err)
        else:
            raise AssertionError(f"{flag} was exported")
        assert not (tmp_path / key).exists()
