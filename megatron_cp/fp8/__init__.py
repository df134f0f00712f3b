"""FP8 training without Transformer Engine: the GEMMs of the transformer layers' linears on
``torch._scaled_mm`` with Megatron-LM's tensorwise (current) and delayed scaling recipes, and
on ``scaled_mm``'s block-scaled kernels with its blockwise and MXFP8 recipes.

- :mod:`~megatron_cp.fp8.scaling`: the formats, scales from amaxes, saturating casts;
- :mod:`~megatron_cp.fp8.blocks`: the block recipes' scales, quantizations (one per GEMM
  direction: :class:`BlockRecipe`) and GEMMs (:func:`block_matmul`), which grouped expert
  GEMMs and FP8 parameters can reuse;
- :mod:`~megatron_cp.fp8.rows`: which rows are real tokens, and each one's row in one process;
- :mod:`~megatron_cp.fp8.linear`: the FP8 GEMM's autograd function and each linear's
  scaling state (:class:`Fp8Meta`);
- :mod:`~megatron_cp.fp8.grouped`: the routed experts' grouped FP8 GEMMs, one scale per
  expert and microbatch;
- :mod:`~megatron_cp.fp8.model`: which linears run in FP8 (Megatron-LM's rules) and the
  delayed recipe's once-per-step update (:func:`end_fp8_step`);
- :mod:`~megatron_cp.fp8.params`: FP8 weights kept between steps (``--fp8-param-gather``).

Every amax is the whole logical tensor's: reduced over the ranks that hold pieces of it
(TP, CP; at the delayed recipe's step end also DP), and every block holds the elements one
process's block holds, so every layout quantizes exactly as one process does.
"""
from megatron_cp.fp8.blocks import BlockRecipe, block_matmul
from megatron_cp.fp8.linear import Fp8Meta, fp8_linear
from megatron_cp.fp8.model import attach_fp8, end_fp8_step, fp8_layer, fp8_metas
from megatron_cp.fp8.params import Fp8Weight, keep_fp8_weights
from megatron_cp.fp8.scaling import FORMATS, quantize, scale_from_amax

__all__ = ["BlockRecipe", "FORMATS", "Fp8Meta", "Fp8Weight", "attach_fp8", "block_matmul",
           "end_fp8_step", "fp8_layer", "fp8_linear", "fp8_metas", "keep_fp8_weights", "quantize",
           "scale_from_amax"]
