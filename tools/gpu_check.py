"""Checks that need a CUDA GPU (run by hand on a GPU machine; CPU CI cannot run them).

1. The fused CUDA block-attention path of ring attention (memory-efficient attention with
   log-sum-exp, forward and backward) against the plain PyTorch blocks, fp32 and bf16.
2. One forward/backward of a small GPT on the GPU against the same model on the CPU.

    python tools/gpu_check.py        # exits 0 when every check passes
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_cp import device as device_mod  # noqa: E402
from megatron_cp.context_parallel import block_backward, block_forward, use_block_kernel  # noqa: E402
from megatron_cp.context_parallel.block_attention import attention_mask  # noqa: E402
from megatron_cp.model import GPTConfig, GPTModel  # noqa: E402


def check_block_kernels(device):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 16, generator=gen).to(device) for h in (4, 2, 2))
    tokens = torch.arange(40, device=device).expand(2, 40)
    docs = torch.tensor([[0] * 13 + [1] * 27, [0] * 40], device=device)
    cases = [(slice(None), slice(None), True, None), (slice(20, None), slice(None), False, None),
             (slice(None, 24), slice(8, None), False,
              attention_mask(tokens[:, :24], tokens[:, 8:], docs[:, :24], docs[:, 8:]))]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        for q_sl, kv_sl, causal, mask in cases:
            args = (q[:, :, q_sl].to(dtype), k[:, :, kv_sl].to(dtype), v[:, :, kv_sl].to(dtype))
            results = {}
            for kernel in ("auto", "torch"):
                with use_block_kernel(kernel):
                    o, lse = block_forward(*args, 0.25, causal, mask)
                    grads = block_backward(torch.ones_like(o), *args, o, lse, 0.25, causal, mask)
                results[kernel] = (o.float(), lse, *grads)
            for a, b in zip(results["auto"], results["torch"]):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def check_model(device):
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                       hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=64)
    cpu, gpu = GPTModel(config), GPTModel(config, device=device)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64).expand(2, 64)
    loss_cpu = cpu(tokens, pos, labels=tokens).mean()
    loss_gpu = gpu(tokens.to(device), pos.to(device), labels=tokens.to(device)).mean()
    loss_cpu.backward()
    loss_gpu.backward()
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-3, atol=1e-4, msg=name)


def main():
    if not device_mod.accelerator_available():
        print("no CUDA device: nothing checked")
        return 2
    device = torch.device("cuda", 0)
    for check in (check_block_kernels, check_model):
        check(device)
        print(f"{check.__name__}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
