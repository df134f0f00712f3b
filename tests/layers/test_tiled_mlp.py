"""--mlp-chunks-for-training N: the dense MLP over N sequence chunks, each recomputed in backward.
Same loss and gradients as the whole-sequence MLP (one process and TP2 + SP), a fraction of
its peak memory, and refused for MoE models and N < 1 at argument validation."""
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.model import GPTConfig, GPTModel
from model_utils import full_grads, tiny_config
from training_utils import TINY, assert_refused

SEQ, FFN = 1024, 4096


def close(actual, expected, what):
    """fp32, the same per-token math; only weight-gradient sums change order (1e-5 relative)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale + 1e-12,
                               msg=lambda m: f"{what}: {m}")


def _step(chunks, activation):
    """(loss, grads, peak bytes) of forward + backward of a one-layer model whose MLP
    intermediate [s, b, ffn] (16 MiB) dwarfs everything else."""
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=FFN,
                       vocab_size=64, max_position_embeddings=SEQ, hidden_dropout=0.0,
                       attention_dropout=0.0, seed=3, activation=activation,
                       mlp_chunks_for_training=chunks)
    model = GPTModel(config)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 64, (1, SEQ), generator=gen) for _ in range(2))
    with PeakMemory("cpu", measure_baseline=False) as meter:
        loss = model(tokens, torch.arange(SEQ).unsqueeze(0), labels=labels)
        loss.mean().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, meter.peak_bytes


def test_chunked_mlp_is_exact_and_holds_one_chunk():
    for activation in ("gelu", "swiglu"):
        loss, grads, peak = _step(1, activation)
        chunked_loss, chunked_grads, chunked_peak = _step(8, activation)
        close(chunked_loss, loss, f"{activation} loss")
        for name, grad in grads.items():
            close(chunked_grads[name], grad, f"{activation} grad {name}")
        # whole: fc1's output and the activation's (and SwiGLU's gate/up) live at once;
        # chunked: one eighth of them, at a time
        assert peak > 2 * SEQ * FFN * 4, (activation, peak)
        assert chunked_peak <= peak / 4, (activation, chunked_peak, peak)


def _tp_sp_case(rank, world):
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    kw = dict(activation="swiglu", sequence_parallel=True)
    ref = GPTModel(tiny_config(**kw))
    model = GPTModel(tiny_config(**kw, mlp_chunks_for_training=3), state=state)
    gen = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, 120, (2, 16), generator=gen) for _ in range(2))
    pos = torch.arange(16).expand(2, 16)
    weights = torch.linspace(0.5, 1.5, 32).view(2, 16)
    for m in (ref, model):
        loss = m(tokens, pos, labels=labels)
        (loss * weights).sum().backward()
    close(model(tokens, pos, labels=labels), ref(tokens, pos, labels=labels), "loss")
    got = full_grads(model, state.group("tp"))
    for name, p in ref.named_parameters():
        close(got[name], p.grad, f"tp2 sp grad {name}")
    return True


def test_chunked_mlp_under_tp_and_sp_matches_one_process():
    """Each TP rank chunks its own s/tp tokens (3 chunks of 8 tokens: uneven), and each
    chunk's fc1 gather and fc2 reduce-scatter pair up across the ranks."""
    assert all(run_workers(_tp_sp_case, 2))


def test_refused_for_moe_and_below_one():
    assert_refused(TINY + " --train-iters 1 --mlp-chunks-for-training 0",
                   "--mlp-chunks-for-training (0) must be >= 1")
    assert_refused(TINY + " --train-iters 1 --mlp-chunks-for-training 2 --num-experts 4 "
                   "--no-bias-gelu-fusion",
                   "--mlp-chunks-for-training (2) chunks dense MLPs only")
