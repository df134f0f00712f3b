"""GPU probe (a diagnostic, not a goal): see benchmarks/probes/README.md. Run from the repository root on a CUDA machine."""
import time, torch
from megatron_cp.context_parallel import local_attention, cuda_kernels as ck
dev = torch.device('cuda'); h, d, D = 16, 128, 8
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n
for s in (16384, 32768):
    L = s // D; sc = d ** -0.5
    flops = 3.5 * 4 * h * d * (L * L * 0.5) * D
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(s, 1, h, d, generator=gen).to(dev, torch.bfloat16).permute(1, 2, 0, 3) for _ in range(4))
    tokens = torch.arange(s, device=dev).expand(1, s)
    docs = (torch.arange(s, device=dev) * D // s).expand(1, s)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    def v0():
        out = local_attention(*leaves, tokens, docs); torch.autograd.grad(out, leaves, g)
    # padded views of the packed rows: [D, h, L, d] of [D, L, h, d] (bshd)
    bshd = [t[0].transpose(0, 1).reshape(D, L, h, d).transpose(1, 2) for t in (q, k, v, g)]
    bhsd = [t.contiguous() for t in bshd]
    def direct(ts):
        def run():
            out, lse = ck.cudnn_forward(ts[0], ts[1], ts[2], sc, True)
            ck.cudnn_backward(ts[3], ts[0], ts[1], ts[2], out, lse, sc, True)
        return run
    def direct_dout_contig(ts):
        def run():
            out, lse = ck.cudnn_forward(ts[0], ts[1], ts[2], sc, True)
            ck.cudnn_backward(ts[3].contiguous(), ts[0], ts[1], ts[2], out, lse, sc, True)
        return run
    sd = [t.detach().requires_grad_() for t in bhsd[:3]]
    def v3():
        out = torch.nn.functional.scaled_dot_product_attention(*sd, is_causal=True); torch.autograd.grad(out, sd, bhsd[3])
    sdb = [t.detach().requires_grad_() for t in bshd[:3]]
    def v4():
        out = torch.nn.functional.scaled_dot_product_attention(*sdb, is_causal=True); torch.autograd.grad(out, sdb, bshd[3])
    for name, fn in (("ours local_attention packed", v0), ("direct cudnn, bshd views", direct(bshd)),
                     ("direct cudnn, bhsd contiguous", direct(bhsd)), ("direct cudnn bshd, dout bhsd", direct_dout_contig(bshd)),
                     ("SDPA batch bhsd", v3), ("SDPA batch bshd views", v4), ("ours again", v0)):
        t = bench(fn)
        print(f"s={s:6d} {name:<32} {t*1e3:7.3f} ms {flops/t/1e12:7.1f} TFLOP/s", flush=True)
