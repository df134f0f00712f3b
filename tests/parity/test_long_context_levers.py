"""Every long-context lever at once, at world size 4, against one process (issue 36).

One run composes what a long-sequence job turns on together: FSDP2 (parameters, gradients and
Adam sharded over DP x CP), context parallelism of each kind (Ulysses all-to-all, the zigzag
ring, and their a2a+p2p hybrid over CP = 4), logits and cross entropy in sequence tiles
(--tiled-logits-chunk-size), the MLP in sequence chunks (--mlp-chunks-for-training), full
recomputation (uniform and block) with the recomputed layers' checkpoints offloaded
(--cpu-offloading-num-layers: on the CPU nothing has anywhere to go, so the decoder is given
the GPU's offloader over host tensors, which copies every checkpoint out and back as a GPU
run would), and the optimizer on the host (--optimizer-cpu-offload, all of it or half).
The model is Llama-style (RoPE, RMSNorm, SwiGLU, untied) or Megatron-LM's defaults (learned
absolute positions, tied embeddings, LayerNorm / GELU, a padded vocabulary), with dropout 0.1.
Each run's losses and gradient norms equal the one-process run of the same model
without any lever, within the fp32 bound every layout's parity test uses (1e-5: the shards and
tiles sum the same fp32 numbers in another order); and the offloader really moved the
checkpoints (so a run that silently dropped the lever would not pass).
"""
import pytest

from dist_harness import run_workers
from megatron_cp.layers.activation_offload import ActivationOffloader
from megatron_cp.optimizer import memory_breakdown
from training_utils import TINY, max_rel_diff, trainer_of

STEPS = 6
LLAMA_FLAGS = "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights"
MODEL = (TINY.replace("--num-layers 2", "--num-layers 3")
         .replace("--seq-length 32", "--seq-length 64")
         .replace("--num-attention-heads 4", "--num-attention-heads 4 --group-query-attention "
                  "--num-query-groups 4")
         + f" --train-iters {STEPS} {LLAMA_FLAGS}")
# Megatron-LM's defaults: learned absolute positions, tied embeddings, LayerNorm / GELU, and
# 300 tokens padded to 384 vocabulary rows
MEGATRON = (TINY.replace("--num-layers 2", "--num-layers 3")
            .replace("--seq-length 32", "--seq-length 64")
            .replace("--position-embedding-type rope", "")
            .replace("--vocab-size 200 --make-vocab-size-divisible-by 64", "--vocab-size 300")
            + f" --train-iters {STEPS}")
TILES = "--tiled-logits-chunk-size 16 --mlp-chunks-for-training 2"
FULL_UNIFORM = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
FULL_BLOCK = "--recompute-granularity full --recompute-method block --recompute-num-layers 2"
OFFLOAD = "--cpu-offloading-num-layers 1"
FSDP = "--use-torch-fsdp2"
# FSDP2 with the optimizer on the host: Megatron-LM builds the precision-aware optimizer (which
# --optimizer-cpu-offload needs) with Megatron-FSDP, not --use-torch-fsdp2; ours runs on the
# same FSDP2 wrapper (fraction 1: torch's CPUOffloadPolicy, params and gradients on the host
# too; below 1: the first parameters' masters and Adam state on the host)
FSDP_HOST = ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --use-precision-aware-optimizer "
             "--optimizer-cpu-offload --optimizer-offload-fraction")
TOL = 1e-5
# name: (model, layout flags at world size 4; FSDP2 shards over DP x CP = 4 in each); the
# reference is one process of the model
RUNS = {
    "ulysses_cp2_dp2": (MODEL, f"--context-parallel-size 2 --cp-comm-type a2a {FSDP_HOST} 1.0 "
                               f"{TILES} {FULL_UNIFORM} {OFFLOAD}"),
    "ring_cp2_dp2": (MODEL, f"--context-parallel-size 2 --cp-comm-type p2p {FSDP_HOST} 0.5 "
                            f"{TILES} {FULL_BLOCK} {OFFLOAD}"),
    "hybrid_cp4": (MODEL, f"--context-parallel-size 4 --cp-comm-type a2a+p2p "
                          f"--hierarchical-context-parallel-sizes 2 2 {FSDP} {TILES} "
                          f"{FULL_UNIFORM} {OFFLOAD}"),
    "megatron_defaults_ring_cp2_dp2": (MEGATRON, f"--context-parallel-size 2 --cp-comm-type p2p "
                                                 f"{FSDP_HOST} 1.0 {TILES} {FULL_UNIFORM} "
                                                 f"{OFFLOAD}"),
}


class _CountingOffloader(ActivationOffloader):
    """The offloader a GPU run builds, over host tensors: counts the bytes it copies out."""

    def __init__(self):
        super().__init__("cpu", pin=False)
        self.moved_bytes = 0

    def pack(self, tensor):
        packed = super().pack(tensor)
        if packed is not tensor:
            self.moved_bytes += tensor.numel() * tensor.element_size()
        return packed


def _train(rank, world, argv):
    """(losses, grad norms, bytes the offloader moved, bytes the optimizer keeps on the
    host) of ``argv``."""
    trainer = trainer_of(argv, world)
    offloader = None
    if trainer.run.model.cpu_offloading_num_layers:
        offloader = _CountingOffloader()
        for chunk in trainer.model_chunks:
            chunk.module.decoder.offloader = offloader
    losses, norms = [], []
    for _ in range(trainer.args.train_iters):
        loss, norm, _ = trainer.train_step()
        losses.append(loss)
        norms.append(norm)
    host = memory_breakdown(trainer.model_chunks, trainer.optimizer)["host"]
    return losses, norms, offloader.moved_bytes if offloader else 0, host


def _jobs(rank, world, jobs):
    return {name: _train(rank, world, argv) for name, argv in jobs.items()}


@pytest.fixture(scope="module")
def results():
    out = {"ref": run_workers(_jobs, 1, {model: model for model in (MODEL, MEGATRON)},
                              timeout=300)[0]}
    out.update({"runs": run_workers(_jobs, 4, {name: f"{model} {layout}"
                                               for name, (model, layout) in RUNS.items()},
                                    timeout=500)})
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_all_levers_together_equal_one_process(results, name):
    model, layout = RUNS[name]
    ref_losses, ref_norms, _, _ = results["ref"][model]
    assert ref_losses[-1] < ref_losses[0], "the tiny model must learn"
    for rank_results in results["runs"]:
        losses, norms, moved, host = rank_results[name]
        loss_diff, norm_diff = max_rel_diff(losses, ref_losses), max_rel_diff(norms, ref_norms)
        print(f"{name}: losses {loss_diff:.1e}, grad norms {norm_diff:.1e} (tolerance {TOL})")
        assert loss_diff <= TOL and norm_diff <= TOL
        # layer 0's checkpoint input, [s/cp, b, h] fp32, went out once per microbatch and step
        # layer 0's checkpoint input [s/cp, b, h] (fp32) went to the host once per microbatch
        # and step (its small companions, position ids and rotary angles, with it): the
        # lever was on, not silently dropped
        cp = int(layout.split("--context-parallel-size ")[1].split()[0])
        microbatches = 8 // (2 * (4 // cp))  # global batch / (micro batch x DP)
        checkpoints = STEPS * microbatches * (2 * 64 // cp) * 32 * 4
        assert checkpoints <= moved <= 1.25 * checkpoints, (moved, checkpoints)
        # the optimizer on the host held its share there (a run that dropped the flags would
        # hold nothing)
        assert (host > 0) == ("--optimizer-cpu-offload" in layout), (name, host)
