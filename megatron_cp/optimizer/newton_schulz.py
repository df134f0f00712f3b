"""Newton-Schulz orthogonalisation, the heart of Muon: ``X ~ U V^T`` for ``G = U S V^T``.

Each step maps ``X`` to ``a X + b (X X^T) X + c (X X^T)^2 X``, an odd polynomial of the
singular values that drives every one of them in (0, 1] towards 1 while leaving U and V
alone; ``X`` starts as ``G`` over its Frobenius norm, so the singular values start below 1.
The coefficient sets are the published ones that Megatron-LM's Muon picks by name
(``--muon-coefficient-type``): tuned sets push small singular values up faster than the
classic ``(1.5, -0.5, 0)`` and land near (not exactly at) 1, which is all Muon needs.

With a ``group``, ``G`` is split over its ranks along the dimension the Gram matrix
``X X^T`` sums over: each rank keeps its columns, and the Gram matrix and the norm are
summed over the group (Megatron-LM's ``--muon-tp-mode distributed``). The iteration runs on
the smaller side of ``G`` (``transpose``) unless the split decides it; both sides give the
same polynomial, ``p(X X^T) X = X p(X^T X)``.
"""
import itertools

import torch
import torch.distributed as dist

from megatron_cp.config.optimizer import SCALE_MODES

# Megatron-LM's sets (emerging_optimizers' NSCoeffT): (a, b, c) per step.
COEFFICIENT_SETS = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Keller Jordan's modded-nanogpt quintic, tuned per step (leloykun's derivation)
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)),
    # Polar Express (arXiv 2505.16932), its 1.01 safety factor folded in
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    # CANS (arXiv 2506.10935): Remez polynomials on adaptive intervals
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806),
             (3.9619, -2.9541, 0.5630), (3.2866, -2.4647, 0.5074),
             (2.2737, -1.6447, 0.4162)),
    # flash-newton-schulz's AOL set
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)),
    # DeepSeek-V4: eight fast steps, then two converging ones
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}
# Sets whose last step converges: more steps than listed repeat it (the others cycle).
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")


def coefficients(kind, steps):
    """The ``(a, b, c)`` of each of ``steps`` steps of set ``kind``."""
    sets = COEFFICIENT_SETS[kind]
    endless = itertools.chain(sets, itertools.repeat(sets[-1])) if kind in REPEAT_LAST \
        else itertools.cycle(sets)
    return list(itertools.islice(endless, steps))


def _sum(tensor, group):
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def newton_schulz(g, steps, kind="quintic", bf16=False, transpose=None, group=None, eps=1e-7):
    """The orthogonalised ``g`` [m, n] (fp32; this rank's columns with ``group``, see the
    module docstring). ``bf16``: the steps run in bfloat16 (Megatron-LM's "medium" matmul
    precision), the normalisation and the result in fp32."""
    if transpose is None:
        transpose = g.shape[-2] > g.shape[-1]  # iterate on the smaller Gram matrix
    x = g.mT if transpose else g  # [r, c]: the Gram matrix is [r, r]
    norm = _sum((x * x).sum(), group).sqrt()
    x = x / norm.clamp_min(eps)
    if bf16:
        x = x.to(torch.bfloat16)
    for a, b, c in coefficients(kind, steps):
        gram = _sum(x @ x.mT, group)  # [r, r]
        poly = torch.addmm(gram, gram, gram, alpha=c, beta=b)  # b A + c A^2
        x = torch.addmm(x, poly, x, alpha=1.0, beta=a)  # a X + (b A + c A^2) X
    x = x.float()
    return x.mT if transpose else x


def update_scale(rows, cols, mode):
    """Muon's factor on an orthogonalised ``rows x cols`` update (``--muon-scale-mode``):
    spectral ``sqrt(max(rows, cols))`` (Kimi's Moonlight: Adam-like update sizes),
    unit_rms_norm ``sqrt(rows / cols)`` (Scion) or shape_scaling ``sqrt(max(1, rows /
    cols))`` (Keller Jordan's Muon)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    raise ValueError(f"scale mode {mode!r}: use one of {SCALE_MODES}")
