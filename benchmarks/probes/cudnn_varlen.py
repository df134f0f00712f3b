"""GPU probe (a diagnostic, not a goal): see benchmarks/probes/README.md. Run from the repository root on a CUDA machine."""
import time, torch
from megatron_cp.context_parallel import cuda_kernels as ck
dev = torch.device('cuda'); bf = torch.bfloat16
def ref(q, k, v, cu, dout):
    qs = [t.float().detach().requires_grad_() for t in (q, k, v)]
    outs = []
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        o = torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in qs), is_causal=True)
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    g = torch.autograd.grad(out, qs, dout.float())
    return out, g
def rel(a, b): return float((a.float() - b.float()).abs().max() / b.float().abs().max())
def bench(fn, n=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n
for s, ndoc in ((1024, 3), (4096, 8), (32768, 8)):
    h, d = 16, 128
    lens = [s // ndoc] * ndoc if s > 1024 else [100, 500, 424]
    cu_l = [0]
    for L in lens: cu_l.append(cu_l[-1] + L)
    cu = torch.tensor(cu_l, dtype=torch.int32, device=dev); mx = max(lens)
    q, k, v, do = (torch.randn(s, h, d, device=dev, dtype=bf) for _ in range(4))
    sc = d ** -0.5
    try:
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=sc)
        out, lse = r[0], r[1]
        print(s, 'cudnn ragged fwd ok: out', tuple(out.shape), out.stride(), 'lse', tuple(lse.shape), lse.stride())
        seed, off = r[6], r[7]
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(do, q, k, v, out, lse, seed, off, None, cu, cu, mx, mx, 0.0, True, scale=sc)
        if s <= 4096:
            ro, rg = ref(q, k, v, cu_l, do)
            print('   rel err out %.2e dq %.2e dk %.2e dv %.2e' % (rel(out, ro), rel(dq, rg[0]), rel(dk, rg[1]), rel(dv, rg[2])))
            fo, fl = ck.flash_varlen_forward(q, k, v, cu, cu, mx, mx, sc, True)
            print('   cudnn lse', tuple(lse.shape), 'flash lse', tuple(fl.shape))
            if lse.numel() == fl.numel():
                print('   lse as [nh,T]: rel %.2e   as [T,nh]: rel %.2e' % (rel(lse.reshape(h, s), fl), rel(lse.reshape(s, h).t(), fl)))
        fl_t = bench(lambda: ck.flash_varlen_backward(do, q, k, v, *ck.flash_varlen_forward(q, k, v, cu, cu, mx, mx, sc, True), cu, cu, mx, mx, sc, True))
        def cud():
            r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=sc)
            torch.ops.aten._cudnn_attention_backward(do, q, k, v, r[0], r[1], r[6], r[7], None, cu, cu, mx, mx, 0.0, True, scale=sc)
        cu_t = bench(cud)
        fl_flops = 3.5 * 4 * h * d * sum(L * L for L in lens) * 0.5
        print('   TFLOP/s fwd+bwd: flash varlen %.1f  cudnn ragged %.1f' % (fl_flops / fl_t / 1e12, fl_flops / cu_t / 1e12))
    except Exception as e:
        print(s, 'cudnn ragged FAILED:', type(e).__name__, str(e)[:300])
