"""The pieces of tools/gpu_check.py that are not checks: the table, the fp32 truth, test data.

- ``errors`` / :class:`Report`: one row per check (worst quantity, max abs error, relative
  error = max abs error / max |truth|, tolerance, PASS / FAIL / SKIP / CAPPED), printed as it
  comes; a check returns the quantities to compare, a :class:`Series` (two loss curves) or a
  :class:`Verdict` (yes / no), and runs only while its section is within its time budget.
- the tolerances of each precision (``TOLERANCE``, ...), shared by every section.
- ``masked_reference``: fp32 masked attention and its backward, chunked over query rows so
  a 32k-token block fits (proven against ``reference_attention`` by the suite's first row);
  ``self_reference``: the truth of a whole causal sample (reference_attention with autograd
  while the s x s scores are small).
- ``doc_lengths`` / ``microbatch`` / :class:`Randn`: packed-document microbatches and random
  q, k, v in the layouts the model passes (contiguous or permuted [s, b, h, d] views).
- :func:`process_group`: the one-rank process group that the checks of distributed code
  (the TP linears) run in.
"""
import contextlib
import math
import os
import time
import traceback
from collections import namedtuple

import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod
from megatron_cp.context_parallel.reference import (attention_mask, reference_attention,
                                                    softmax_scale_for)

AUTOGRAD_REFERENCE_MAX_SEQ = 4096  # beyond: masked_reference (autograd would keep s x s tensors)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HEAD_DIM = 64

# max |error| / max |truth| per dtype. bf16: flash accumulates in fp32 (~1e-2 measured on the
# CPU up to s = 2k, where the CPU kernel's bf16 backward error grows slowly with s); the bug this
# suite was built for (bf16 document-masked gradients off by 8-17 on O(1) values) is > 10x over.
# The log-sum-exp is fp32 from every kernel, hence tighter.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}
# fp32 operands rounded to TF32 (10 mantissa bits: unit roundoff 2^-11) by a kernel's matmuls
# (Triton's dot, torch's "high" matmul precision): bf16's allowance (~10 unit roundoffs of
# its 2^-8) at TF32's unit roundoff
TF32_TOLERANCE = 10 * 2.0 ** -11
# loss curves of a few optimizer steps: fp32 against fp32 (sums in another order), and a run
# whose step involves bf16 (parameters, or Muon's Newton-Schulz) against fp32
TRAIN_FP32_TOL, TRAIN_BF16_TOL = 1e-4, 3e-2

Series = namedtuple("Series", "values reference tol")
Series.__doc__ = "A check's result: two curves (float64 [n]) within ``tol`` relative."
Verdict = namedtuple("Verdict", "ok note")
Verdict.__doc__ = "A check's result: yes / no (coverage, a route taken), with a note line."


def errors(got, want):
    """(max abs error, max abs error / max |want|) in fp32. Infinities that agree (rows that
    see no key: lse -inf) are exact; NaN or a shape mismatch is infinitely wrong."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf"), float("inf")
    got = got.detach().float()
    want = want.detach().float().to(got.device)  # a device run judged against the CPU
    agree = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    diff = (got - want).abs().masked_fill(agree, 0.0).nan_to_num(nan=float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    finite = want[torch.isfinite(want)].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    return max_abs, (0.0 if max_abs == 0.0 else max_abs / max(scale, 1e-6))


class Report:
    """The rows of the table, printed as they come: every check is one row.

    Each section runs under a time budget (:meth:`begin`): once the section has used it,
    :meth:`run` starts no more checks and prints each remaining one as CAPPED (not run, so
    not passed either; ``capped()`` lists them)."""

    HEADER = f"{'check':<64} {'worst':<6} {'max abs err':>11} {'rel err':>10} {'tol':>8}  result"
    clock = staticmethod(time.perf_counter)  # of the budgets

    def __init__(self):
        self.rows = []  # (name, status)
        self.deadline, self.budget = math.inf, math.inf
        print(self.HEADER)
        print("-" * len(self.HEADER))

    def begin(self, seconds):
        """A section starts: its checks may start during the next ``seconds``."""
        self.budget = seconds
        self.deadline = self.clock() + seconds

    def over_budget(self):
        return self.clock() > self.deadline

    def _row(self, name, worst, max_abs, rel, tol, status):
        self.rows.append((name, status))
        fmt = (lambda x: f"{x:.3e}") if max_abs is not None else (lambda x: "-")
        print(f"{name:<64} {worst:<6} {fmt(max_abs):>11} {fmt(rel):>10} "
              f"{(f'{tol:.1e}' if tol is not None else '-'):>8}  {status}", flush=True)

    def compare(self, name, quantities):
        """One row for ``quantities`` {label: (got, want, tol)}: PASS when every relative
        error is within its tolerance; the row shows the worst one (error / tolerance)."""
        worst = None
        for label, (got, want, tol) in quantities.items():
            max_abs, rel = errors(got, want)
            if tol == 0.0:  # bits that must be equal
                ratio = 0.0 if rel == 0.0 else float("inf")
            else:
                ratio = rel / tol if rel == rel else float("inf")
            if worst is None or ratio > worst[0]:
                worst = (ratio, label, max_abs, rel, tol)
        ratio, label, max_abs, rel, tol = worst
        self._row(name, label, max_abs, rel, tol, "PASS" if ratio <= 1.0 else "FAIL")

    def series(self, name, values, reference, tol):
        """One row for two curves (float64 [n], e.g. losses per step): PASS when every
        point is within ``tol`` relative; both curves go on a note line."""
        diff = (values - reference).abs()
        rel = float((diff / reference.abs()).max())
        self._row(name, "value", float(diff.max()), rel, tol, "PASS" if rel <= tol else "FAIL")
        print(f"    {[round(x, 5) for x in values.tolist()]} vs "
              f"{[round(x, 5) for x in reference.tolist()]}")

    def verdict(self, name, ok, note):
        """A yes/no row (coverage), with a note line."""
        self._row(name, "-", None, None, None, "PASS" if ok else "FAIL")
        print(f"    {note}")

    def skip(self, name, why):
        self._row(name, "-", None, None, None, "SKIP")
        print(f"    not run: {why}")

    def error(self, name, exc):
        """A FAIL row for a check that raised, with the exception and where on a note line."""
        self._row(name, "error", None, None, None, "FAIL")
        last = traceback.extract_tb(exc.__traceback__)[-1]
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(f"    {type(exc).__name__}: {message} ({os.path.basename(last.filename)}:"
              f"{last.lineno})")

    def cap(self, name):
        """A check not run: its section used its time budget (a note on the first one)."""
        if not self.rows or self.rows[-1][1] != "CAPPED":
            print(f"    the section used its {self.budget:g} s budget: the checks below are "
                  f"not run")
        self._row(name, "-", None, None, None, "CAPPED")

    def run(self, name, check, *args):
        """``check(*args)`` -> quantities for :meth:`compare`, a :class:`Series` or a
        :class:`Verdict`; an exception is a FAIL row. Over the section's budget: CAPPED."""
        if self.over_budget():
            self.cap(name)
            return
        try:
            result = check(*args)
            if isinstance(result, Series):
                self.series(name, *result)
            elif isinstance(result, Verdict):
                self.verdict(name, *result)
            else:
                self.compare(name, result)
        except Exception as exc:  # a kernel that raises on the device is a failed check
            self.error(name, exc)  # (and so is a comparison that cannot be made)

    def failures(self):
        return [name for name, status in self.rows if status == "FAIL"]

    def capped(self):
        return [name for name, status in self.rows if status == "CAPPED"]


# ----------------------------------------------------------------------------- the fp32 truth
def masked_reference(q, k, v, dout, tq, tk, dq_ids=None, dk_ids=None, softmax_scale=None,
                     budget=2 ** 27):
    """fp32 masked attention of q [b, nh, sq, d] over k/v [b, nkv, sk, d] and its backward
    for ``dout``, chunked over query rows (at most ``budget`` scores at once): returns
    (out, lse [b, nh, sq], dq, dk, dv). A query sees a key when tq >= tk (token indices
    [b, sq] / [b, sk]) and, given document ids, both are in one document; rows that see no
    key give out 0, lse -inf and no gradient. v (and dout, out) may have a head dim dv of
    their own (multi-latent attention)."""
    b, nh, sq, d = q.shape
    nkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    scale = softmax_scale_for(q, softmax_scale)
    qf = q.float().reshape(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
    dof = dout.float().reshape(b, nkv, nh // nkv, sq, dv_dim)
    kf, vf = k.float(), v.float()
    out, dq = qf.new_empty(*qf.shape[:4], dv_dim), torch.empty_like(qf)
    lse = torch.empty(qf.shape[:4], dtype=torch.float32, device=q.device)  # [b, nkv, g, sq]
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    rows = max(1, budget // (b * nh * sk))
    for lo in range(0, sq, rows):
        sl = slice(lo, min(sq, lo + rows))
        mask = attention_mask(tq[:, sl], tk, None if dq_ids is None else dq_ids[:, sl],
                              dk_ids)[:, :, None]  # [b, 1, 1, c, sk]
        scores = torch.einsum("bkgqd,bksd->bkgqs", qf[:, :, :, sl], kf) * scale
        scores = scores.masked_fill(~mask, float("-inf"))  # [b, nkv, g, c, sk]
        row_lse = scores.logsumexp(-1)  # -inf where a row sees no key
        probs = torch.exp(scores - row_lse.masked_fill(torch.isinf(row_lse), 0.0)[..., None])
        o = torch.einsum("bkgqs,bksd->bkgqd", probs, vf)
        do = dof[:, :, :, sl]
        dprobs = torch.einsum("bkgqd,bksd->bkgqs", do, vf)
        dscores = probs * (dprobs - (do * o).sum(-1, keepdim=True))
        out[:, :, :, sl], lse[..., sl] = o, row_lse
        dq[:, :, :, sl] = torch.einsum("bkgqs,bksd->bkgqd", dscores, kf) * scale
        dk += torch.einsum("bkgqs,bkgqd->bksd", dscores, qf[:, :, :, sl]) * scale
        dv += torch.einsum("bkgqs,bkgqd->bksd", probs, do)
    return (out.reshape(b, nh, sq, dv_dim), lse.reshape(b, nh, sq), dq.reshape(b, nh, sq, d), dk,
            dv)


def self_reference(q, k, v, dout, document_ids=None):
    """(out, dq, dk, dv) fp32 of causal self-attention over a whole sample (token index
    0..s-1): reference_attention with autograd, or masked_reference for long samples."""
    b, s = q.shape[0], q.shape[2]
    if s <= AUTOGRAD_REFERENCE_MAX_SEQ:
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out = reference_attention(*leaves, None, document_ids)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.float()))
    tokens = torch.arange(s, device=q.device).expand(b, s)
    out, _, *grads = masked_reference(q, k, v, dout, tokens, tokens, document_ids, document_ids)
    return (out, *grads)


# ----------------------------------------------------------------------------- problem data
def doc_lengths(n, seed):
    """Document lengths summing to n: a 1-token one, short ones (shorter than a zigzag chunk)
    and three long ones, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    small = [1, 3, 2 + n // 64]
    rest = n - sum(small)
    cuts = sorted(torch.randint(1, rest, (2,), generator=gen).tolist())
    lengths = [x for x in small + [cuts[0], cuts[1] - cuts[0], rest - cuts[1]] if x > 0]
    return [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]


def microbatch(n, b, packed, seed=0):
    """A microbatch of b samples of n tokens; packed: documents of :func:`doc_lengths` (a
    different split per sample) with position ids restarting at each document."""
    gen = torch.Generator().manual_seed(seed)
    batch = {"tokens": torch.randint(0, 256, (b, n), generator=gen),
             "labels": torch.randint(0, 256, (b, n), generator=gen),
             "loss_mask": torch.ones(b, n), "position_ids": torch.arange(n).repeat(b, 1)}
    if packed:
        lengths = [doc_lengths(n, seed * 31 + row) for row in range(b)]
        batch["document_ids"] = torch.stack([torch.cat([torch.full((m,), i) for i, m in
                                                        enumerate(row)]) for row in lengths])
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(m) for m in row])
                                             for row in lengths])
    return batch


class Randn:
    """Random test tensors in a dtype on a device, from one seeded CPU generator."""

    def __init__(self, seed, dtype, device):
        self.gen, self.dtype, self.device = torch.Generator().manual_seed(seed), dtype, device

    def bhsd(self, b, h, s, d=HEAD_DIM, view="bhsd"):
        """[b, h, s, d]: contiguous ("bhsd") or a permuted view of a contiguous [s, b, h, d]
        activation ("sbhd", what the model's attention passes)."""
        if view == "sbhd":
            x = torch.randn(s, b, h, d, generator=self.gen)
            return x.to(self.device, self.dtype).permute(1, 2, 0, 3)  # [b, h, s, d] view
        return torch.randn(b, h, s, d, generator=self.gen).to(self.device, self.dtype)


def supported_dtypes(device):
    """fp32 everywhere; bf16 on the CPU and on CUDA devices with the flash kernels (sm80+,
    native bf16); fp16 on CUDA."""
    if device.type == "cuda":
        bf16 = [torch.bfloat16] if device_mod.flash_attention_supported(device) else []
        return [torch.float32, *bf16, torch.float16]
    return [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- patches, groups
@contextlib.contextmanager
def patched(owner, name, value):
    """``owner.name`` is ``value`` inside, restored after."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def process_group(device):
    """A one-rank process group for checks of distributed code (gloo for CPU tensors, and
    NCCL for CUDA ones when ``device`` is CUDA), destroyed afterwards; an existing one is
    used as it is."""
    if dist.is_initialized():
        yield
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
