"""Megatron-style log lines, tensorboard and Weights & Biases scalars and the model-FLOPs
count behind throughput.

The line carries throughput (tokens/s and model TFLOP/s per GPU) at every log interval, so
Megatron's ``--log-throughput`` adds nothing here; ``--log-params-norm`` adds the norm of
all parameters (each counted once over TP/PP) to the line and to the scalars. The scalars go
to every sink the run has: tensorboard (``--tensorboard-dir``, written by global rank 0) and
Weights & Biases (``--wandb-project``, written by the last rank, as Megatron does;
:mod:`megatron_cp.observability.wandb_logging`).

Memory is reported as Megatron-LM does, after the first logged iteration (and once more after
the second iteration when the first was logged, so the optimizer state is in it): a line
``[Rank r] (after N iterations) memory (MB) | allocated: .. | max allocated: ..`` for every
rank of DP rank 0 (gathered and printed by the logging rank, so no other rank prints), tensor
bytes measured by :class:`~megatron_cp.observability.memory_peak.PeakMemory`, and the largest
peak over all ranks with its rank. On GPUs the allocator's counters are read over every iteration until the
report. On CPU the exact live-tensor peak comes through the profiler's allocation events
(operators are not recorded), which still cost a metered step some time and memory in every
process (on a 32-layer MoE model about 0.3 CPU-seconds a step and 55 MB a rank), so it is
measured only when asked (``--log-memory-to-tensorboard``), over the run's first
``CPU_METERED_ITERATIONS`` iterations, and not under ``--profile``, whose profiler would
nest. With ``--log-memory-to-tensorboard`` the figures go to tensorboard too, under
Megatron's tags ``mem-allocated-bytes`` and ``mem-max-allocated-bytes``.
"""
import contextlib
import math
import time

import torch

import torch.distributed as dist

from megatron_cp import moe
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.observability import wandb_logging
from megatron_cp.optimizer.clip_grads import get_param_norm
from megatron_cp.distributed.fsdp import is_fully_sharded


def model_flops_per_token(config, seq_length):
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron's convention:
    every matmul counts 2 FLOPs per multiply-add and attention counts the full s x s."""
    h, d = config.hidden_size, config.kv_channels
    nh, ng, ffn = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    if config.multi_latent_attention:
        per_layer = _mla_flops_per_token(config, seq_length)
    else:
        per_layer = 2 * h * (nh + 2 * ng) * d + 2 * nh * d * h  # qkv + output projections
        per_layer += 2 * 2 * seq_length * nh * d  # q k^T and p v
    mlp_matrices = 3 if config.activation == "swiglu" else 2
    dense_mlp = 2 * h * ffn * mlp_matrices
    moe_mlp = 2 * h * config.num_moe_experts  # router
    if config.num_moe_experts:  # each token runs top-k routed experts and the shared one
        moe_mlp += 2 * h * mlp_matrices * (config.moe_router_topk * config.moe_ffn_hidden_size
                                           + (config.moe_shared_expert_intermediate_size or 0))
    pattern = config.moe_layer_pattern()
    depths = config.mtp_depths()  # each MTP depth: a layer of the last layer's kind (Megatron's)
    mlps = sum(moe_mlp if is_moe else dense_mlp for is_moe in pattern + pattern[-1:] * depths)
    mtp = depths * 2 * (3 * h + 2 * h * h)  # Megatron's count of the MTP norms and eh_proj
    logits = 2 * h * config.padded_vocab_size(1) * (1 + depths)
    return 3 * ((config.num_layers + depths) * per_layer + mlps + mtp + logits)


def _mla_flops_per_token(config, seq_length):
    """Forward FLOPs per token of one multi-latent attention layer: its projections (query
    down + up or one query projection, key/value down + up, output) and q k^T (key head
    dim qk_head_dim + qk_pos_emb_head_dim) and p v (v_head_dim) over the full s x s."""
    h, nh = config.hidden_size, config.num_attention_heads
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    rank = config.q_lora_rank
    query = h * nh * qk if rank is None else rank * (h + nh * qk)
    kv = h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + \
        config.kv_lora_rank * nh * (config.qk_head_dim + config.v_head_dim)
    projections = 2 * (query + kv + nh * config.v_head_dim * h)
    return projections + 2 * seq_length * nh * (qk + config.v_head_dim)


class TrainingLogger:
    """Prints one line every --log-interval iterations (on global rank 0) and writes the same
    scalars to tensorboard under --tensorboard-dir and to the --wandb-project run.

    ``run``: the :class:`~megatron_cp.config.run.RunConfig`; the logger reads its logging
    section (intervals, sinks, what is logged), the training section's ``train_iters`` and
    ``micro_batch_size``, the data section's ``seq_length``, and hands the wandb run the
    checkpoint folder and every setting (its config)."""

    def __init__(self, run, state, flops_per_token):
        self.logging, self.training = run.logging, run.training
        self.seq_length = run.data.seq_length
        self.state, self.flops_per_token = state, flops_per_token
        self.is_writer = state.global_rank == 0
        self.sinks = []  # scalar writers: add_scalar(name, value, iteration), flush, close
        self.last_validation = None  # (iteration, loss) of the latest evaluation
        self.memory = MemoryReport(run.logging, state)
        if self.is_writer and self.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.sinks.append(SummaryWriter(log_dir=self.logging.tensorboard_dir))
        if self.logging.wandb_project and state.global_rank == state.world_size - 1:
            self.sinks.append(wandb_logging.WandbWriter(
                self.logging, run.checkpoint.save, wandb_logging.run_settings(run),
                state.global_rank, state.world_size))
        self._reset()

    def _scalar(self, name, value, iteration):
        for sink in self.sinks:
            sink.add_scalar(name, value, iteration)

    def _flush(self):
        for sink in self.sinks:
            sink.flush()

    def _reset(self):
        self.time, self.loss, self.count = 0.0, 0.0, 0
        self.mtp_losses = None  # per MTP depth, summed over the interval's iterations
        self.samples = 0  # of the interval's iterations (their batch sizes may differ)

    def print(self, line):
        if self.is_writer:
            print(line, flush=True)

    def record(self, trainer, loss, grad_norm, ok, seconds):
        log, train_iters = self.logging, self.training.train_iters
        self.time, self.count = self.time + seconds, self.count + 1
        self.loss += loss
        self.samples += trainer.global_batch_size
        it = trainer.iteration
        scale = trainer.optimizer.get_loss_scale()
        scale = scale.item() if torch.is_tensor(scale) else float(scale)
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        lr = trainer.scheduler.get_lr()
        mtp_losses = getattr(trainer, "mtp_losses", None) or []
        if mtp_losses:
            self.mtp_losses = [x + (self.mtp_losses[k] if self.mtp_losses else 0.0)
                               for k, x in enumerate(mtp_losses)]
        for k, value in enumerate(mtp_losses):  # Megatron-LM writes them every iteration
            self._scalar(f"mtp_{k + 1} loss", value, it)
        if self.sinks and it % log.tensorboard_log_interval == 0:
            w = self._scalar
            w("lm loss", loss, it)
            w("learning-rate", lr, it)
            w("grad-norm", grad_norm, it)
            w("consumed-samples", trainer.consumed_samples, it)
            w("batch-size", trainer.global_batch_size, it)
            w("batch-size vs samples", trainer.global_batch_size, trainer.consumed_samples)
            if getattr(trainer, "skipped_samples", 0):
                w("skipped-train-samples", trainer.skipped_samples, it)
            if log.log_loss_scale_to_tensorboard:  # Megatron's default: on
                w("loss-scale", scale, it)
            if log.log_world_size_to_tensorboard:
                w("world-size", self.state.world_size, it)
            if getattr(trainer, "num_zeros", None) is not None:
                w("num-zeros", trainer.num_zeros, it)
        if it % log.log_interval != 0 and it != train_iters:
            return
        per_iter = self.time / self.count
        tokens_per_s = self.samples * self.seq_length / self.time
        tflops = tokens_per_s * self.flops_per_token / self.state.world_size / 1e12
        params_norm = ""
        if log.log_params_norm:  # a collective: every rank gets here
            norm = get_param_norm([p for c in trainer.model_chunks for p in c.parameters()],
                                  self.state, sharded=is_fully_sharded(trainer.model_chunks))
            params_norm = f" params norm: {norm:.3f} |"
            self._scalar("params-norm", norm, it)
        moe_line = self._moe_stats(trainer, it)  # a collective too, on every rank
        zeros = getattr(trainer, "num_zeros", None)
        zeros = f" num zeros: {zeros} |" if zeros is not None else ""
        skipped = getattr(trainer, "skipped_samples", 0)  # Megatron's, after consumed samples
        skipped = f" skipped samples: {skipped:12d} |" if skipped else ""
        self.print(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {it:8d}/{train_iters:8d} |"
            f" consumed samples: {trainer.consumed_samples:12d} |{skipped}"
            f" elapsed time per iteration (ms): {per_iter * 1000:.1f} |"
            f" throughput per GPU (TFLOP/s/GPU): {tflops:.4f} |"
            f" tokens per second: {tokens_per_s:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {trainer.global_batch_size:5d} |"
            f" lm loss: {self.loss / self.count:.6E} |{self._mtp_line()} loss scale: {scale:.1f} |"
            f" grad norm: {grad_norm:.4f} |{zeros}{params_norm}{moe_line}"
            f" number of skipped iterations: {trainer.optimizer.num_skipped_iters:3d} |")
        self.memory.report(it, self.print, self._scalar)
        if log.log_timers_to_tensorboard:  # Megatron's tags: seconds, TFLOP/s per GPU
            self._scalar("iteration-time", per_iter, it)
            self._scalar("throughput", tflops, it)
            self._scalar("tokens-per-second", tokens_per_s, it)
        self._flush()
        self._reset()

    def _mtp_line(self):
        """Megatron-LM's "mtp_k loss" entries of the log line: each depth's token-mean cross
        entropy (before --mtp-loss-scaling-factor), averaged over the interval."""
        return "".join(f" mtp_{k + 1} loss: {total / self.count:.6E} |"
                       for k, total in enumerate(self.mtp_losses or []))

    def _moe_stats(self, trainer, it):
        """The MoE part of the log line (empty for a dense model): balancing and z-loss, mean
        over MoE layers and over the interval's microbatches, and the tokens per iteration of
        the least and most loaded expert (over all MoE layers); tensorboard also gets them per
        layer with --moe-per-layer-logging."""
        config = trainer.config
        if not config.num_moe_experts:
            return ""
        # MTP layers are numbered after the decoder's and take its last layer's kind
        built_mtp = 1 if config.mtp_use_repeated_layer else config.mtp_depths()
        pattern = config.moe_layer_pattern()
        pattern = pattern + pattern[-1:] * (built_mtp if config.mtp_depths() else 0)
        aux, z, tokens = moe.take_stats(trainer.model_chunks, self.state, len(pattern),
                                        config.num_moe_experts)
        layers = [n for n, is_moe in enumerate(pattern) if is_moe]
        microbatches = self.samples // self.training.micro_batch_size  # over every DP rank
        aux, z = aux[layers] / microbatches, z[layers] / microbatches  # [moe layers]
        tokens = tokens[layers] / self.count  # [moe layers, E] per iteration
        fewest, most = tokens.min().item(), tokens.max().item()
        line = (f" load_balancing_loss: {aux.mean().item():.6E} | z_loss: {z.mean().item():.6E} |"
                f" tokens per expert min/max: {fewest:.0f}/{most:.0f} |")
        if self.logging.moe_per_layer_logging:
            line += "".join(f" layer {n} balancing/z/min/max: {a:.4E}/{b:.4E}/{lo:.0f}/{hi:.0f} |"
                            for n, a, b, lo, hi in zip(layers, aux.tolist(), z.tolist(),
                                                       tokens.min(1).values.tolist(),
                                                       tokens.max(1).values.tolist()))
        if self.sinks:
            w = self._scalar
            w("load_balancing_loss", aux.mean().item(), it)
            w("z_loss", z.mean().item(), it)
            w("moe/tokens-per-expert-min", fewest, it)
            w("moe/tokens-per-expert-max", most, it)
            if self.logging.moe_per_layer_logging:
                for n, a, b, row in zip(layers, aux.tolist(), z.tolist(), tokens):
                    w(f"moe/load_balancing_loss_layer_{n}", a, it)
                    w(f"moe/z_loss_layer_{n}", b, it)
                    w(f"moe/tokens_per_expert_min_layer_{n}", row.min().item(), it)
                    w(f"moe/tokens_per_expert_max_layer_{n}", row.max().item(), it)
        return line

    def validation(self, iteration, loss):
        self.last_validation = (iteration, loss)
        ppl = math.exp(min(20.0, loss))
        line = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} |")
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        self._scalar("lm loss validation", loss, iteration)
        if self.logging.log_validation_ppl_to_tensorboard:
            self._scalar("lm loss validation ppl", ppl, iteration)
        self._flush()

    def close(self):
        for sink in self.sinks:
            sink.close()
        self.sinks = []


# The CPU meter's allocation events cost a step time and memory: only this many iterations
# are metered (the second report holds the optimizer state the first step allocated).
CPU_METERED_ITERATIONS = 2


class MemoryReport:
    """Per-rank peak tensor memory for Megatron's memory lines (see the module docstring).

    ``meter()`` wraps one training iteration; ``report()`` runs at a logged iteration on every
    rank (it all-reduces the peak) and prints while Megatron's report window is open.
    ``logging``: the logging section (``log_memory_to_tensorboard``, ``profile``)."""

    def __init__(self, logging, state):
        self.logging, self.state = logging, state
        self.loaded = None  # the iteration the run started from (Megatron's loaded_iteration)
        self.metered = 0  # iterations measured so far
        self.max_allocated = self.allocated = None  # bytes, over the metered iterations
        self.open = True  # Megatron's report_memory_flag
        self.cpu = state.device.type != "cuda"

    def meter(self, iteration):
        """A PeakMemory over iteration ``iteration`` (the one about to run) while the report
        still needs it, else a null context."""
        if self.loaded is None:
            self.loaded = iteration - 1
        if not self.open or (self.cpu and (self.metered >= CPU_METERED_ITERATIONS
                                           or not self.logging.log_memory_to_tensorboard
                                           or self.logging.profile)):
            return contextlib.nullcontext()
        return _Metered(self, PeakMemory(self.state.device, measure_baseline=True))

    def _add(self, meter):
        self.metered += 1
        peak = meter.peak_total_bytes
        self.max_allocated = peak if self.max_allocated is None else max(self.max_allocated, peak)
        self.allocated = meter.baseline_bytes + meter.retained_bytes

    def report(self, iteration, print_line, scalar):
        """Megatron's ``[Rank r] (after N iterations) memory (MB)`` line on each DP-rank-0
        rank, the largest peak over ranks on global rank 0, and the tensorboard scalars."""
        if not self.open or self.max_allocated is None:
            return
        if iteration > self.loaded + 1:
            self.open = False  # the report after the second iteration holds the optimizer
        mb = 2 ** 20
        device = self.state.device
        # [max allocated, allocated, global rank, 1 on a DP-rank-0 rank] of every rank, so
        # that rank 0 prints Megatron's per-rank lines and no other rank prints
        mine = torch.tensor([float(self.max_allocated), float(self.allocated),
                             float(self.state.global_rank), float(self.state.rank("dp") == 0)],
                            dtype=torch.float64, device=device)
        ranks = [mine]
        if dist.is_initialized() and self.state.world_size > 1:
            ranks = [torch.zeros_like(mine) for _ in range(self.state.world_size)]
            dist.all_gather(ranks, mine)
        for row in ranks:
            if row[3].item():
                print_line(f" [Rank {int(row[2].item())}] (after {iteration} iterations) memory "
                           f"(MB) | allocated: {row[1].item() / mb:.2f} | max allocated:"
                           f" {row[0].item() / mb:.2f}")
        peak = max(ranks, key=lambda t: (t[0].item(), -t[2].item()))
        print_line(f" peak tensor memory (MB) after {iteration} iterations: "
                   f"{peak[0].item() / mb:.2f} on rank {int(peak[2].item())} (the most loaded)")
        if self.logging.log_memory_to_tensorboard:  # Megatron's tags
            scalar("mem-allocated-bytes", self.allocated, iteration)
            scalar("mem-max-allocated-bytes", self.max_allocated, iteration)


class _Metered:
    """The meter of one iteration; its result goes to the report on exit."""

    def __init__(self, report, meter):
        self.report, self.meter = report, meter

    def __enter__(self):
        self.meter.__enter__()
        return self.meter

    def __exit__(self, *exc):
        self.meter.__exit__(*exc)
        if exc[0] is None:
            self.report._add(self.meter)
        return False
