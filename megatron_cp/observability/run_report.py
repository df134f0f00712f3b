"""What a run prints once, on global rank 0, around the training loop.

- the start-up banner, Megatron's way: the arguments (sorted ``name ..... value`` lines), the
  compatibility notes, the world/TP/CP/PP/DP sizes, the parameters of every model-parallel
  rank and of the whole model, the dataset sizes, and a progress line before each slow
  start-up step, so a start-up is never long and silent;
- the end summary: time, iterations, final validation loss, where checkpoints and
  tensorboard went, and how to go on.

The periodic log lines live in ``training_log``; this module only prints once.
"""
import math
import os

import torch
import torch.distributed as dist

from megatron_cp.data.batch_schedule import BatchSchedule
from megatron_cp.distributed.initialize import distributed_env
from megatron_cp.optimizer.clip_grads import counted_here
from megatron_cp.pipeline_parallel.stages import layout_from_config

# Above this many model-parallel ranks the banner summarizes the per-rank counts.
MAX_RANK_LINES = 8
# Attributes of ``args`` that are not arguments (printed on their own, or not at all).
NOT_ARGUMENTS = ("compat_notes",)


def is_global_rank_zero():
    """True on global rank 0; before torch.distributed starts, the launcher's rank says."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return distributed_env()["rank"] == 0


def print_rank_0(text=""):
    """Print (and flush) on global rank 0 only."""
    if is_global_rank_zero():
        print(text, flush=True)


def format_arguments(args):
    """Megatron's argument block: every argument of the parsed command line ``args``, sorted,
    as ``name ..... value``. The one report that reads the namespace: it prints the command
    line as given and checked, the Megatron-LM flags that set no config field included."""
    lines = ["------------------------ arguments ------------------------"]
    for name, value in sorted(vars(args).items()):
        if name not in NOT_ARGUMENTS:
            lines.append(f"  {name} {'.' * max(48 - len(name), 3)} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def format_compat_notes(notes):
    """The Megatron flags accepted because they select what this code does anyway: ``notes``,
    a note per flag (the run's ``RunConfig.notes``; empty: none)."""
    return "\n".join(["> compatibility notes:"] + [f"  - {note}" for note in notes]) if notes else ""


def format_parallel_sizes(run, state):
    """World size and every parallel size, as Megatron's ``using world size`` line, plus the
    microbatch split of the global batch (or Megatron's table of a batch-size schedule).
    ``run``: the :class:`~megatron_cp.config.run.RunConfig`, whose model (sequence
    parallelism, CP comm type, layers), parallel (pipeline split), training (batch sizes) and
    data (sequence length) sections it reads."""
    model, training = run.model, run.training
    tp, cp, pp, dp = (state.size(n) for n in ("tp", "cp", "pp", "dp"))
    vp = state.virtual_pipeline_model_parallel_size
    line = (f"using world size: {state.world_size}, data-parallel size: {dp}, "
            f"context-parallel size: {cp}, tensor-model-parallel size: {tp}, "
            f"pipeline-model-parallel size: {pp}")
    if vp:
        line += f", virtual pipeline stages per rank: {vp}"
    details = [f"sequence parallel: {model.sequence_parallel}"]
    if cp > 1:
        details.append(f"cp comm type: {' '.join(model.cp_comm_types())}")
    if training.step_batch_size_schedule is not None:  # Megatron's lines for a schedule
        schedule = BatchSchedule.from_config(training, run.parallel)
        return (line + "\n> " + ", ".join(details) + "\n> using step batch size schedule: "
                f"{training.step_batch_size_schedule}\n"
                + schedule.describe(run.data.seq_length))
    details.append(f"number of microbatches: {training.num_microbatches} (global batch "
                   f"{training.global_batch_size} = micro batch {training.micro_batch_size} x "
                   f"DP {dp} x {training.num_microbatches})")
    details.append(f"rank order: {state.order}")
    text = line + "\n> " + ", ".join(details)
    if pp > 1:  # what each stage holds, as a layout string and per rank
        layout = layout_from_config(run.parallel, model.num_layers, model.mtp_num_layers)
        text += "\n".join([f"\n> pipeline layout: {layout}"] + [f">   {row}" for row in layout.describe()])
    return text


def count_parameters(model_chunks, state):
    """Parameter counts: ``(rows, total)``, with ``rows`` one ``(tp_rank, pp_rank, count)`` per
    model-parallel rank (all of this rank's chunks) and ``total`` the whole model's, each
    parameter counted once (TP-replicated ones on TP rank 0, the tied embedding on the first
    stage; the rule of the grad norm), expert parameters summed over the EP x ETP ranks of
    every stage. A collective over the model-parallel (TP x PP) and expert groups: every
    rank calls it."""
    params = list({id(p): p for chunk in model_chunks for p in chunk.parameters()}.values())
    local = sum(p.numel() for p in params)
    owned = [sum(p.numel() for p in params if counted_here(p, state)
                 and bool(getattr(p, "is_expert", False)) == expert) for expert in (False, True)]
    mine = torch.tensor([state.rank("tp"), state.rank("pp"), local, owned[0]], dtype=torch.long,
                        device=state.device)
    gathered = [mine]
    if state.size("mp") > 1:
        gathered = [torch.empty_like(mine) for _ in range(state.size("mp"))]
        dist.all_gather(gathered, mine, group=state.group("mp"))
    experts = torch.tensor([owned[1]], dtype=torch.long, device=state.device)
    for name in ("ep", "etp", "pp"):
        if state.size(name) > 1:
            dist.all_reduce(experts, group=state.group(name))
    rows = sorted((int(t[0]), int(t[1]), int(t[2])) for t in gathered)
    return rows, sum(int(t[3]) for t in gathered) + int(experts.item())


def format_parameter_counts(rows, total):
    """Megatron's per-rank parameter lines (summarized above MAX_RANK_LINES ranks), and the total."""
    if len(rows) <= MAX_RANK_LINES:
        lines = [f" > number of parameters on (tensor, pipeline) model parallel rank ({tp}, {pp}): "
                 f"{count}" for tp, pp, count in rows]
    else:
        counts = [count for _, _, count in rows]
        lines = [f" > number of parameters per (tensor, pipeline) model parallel rank: "
                 f"{min(counts)} to {max(counts)} over {len(rows)} ranks"]
    lines.append(f" > total number of parameters: {total} ({total / 1e6:.2f} M; shared and "
                 f"replicated weights counted once)")
    return "\n".join(lines)


def format_dataset_sizes(datasets):
    """``datasets``: {split name: dataset or None} -> one line of sample counts."""
    parts = [f"{name}: {len(d) if d is not None else 'none'}" for name, d in datasets.items()]
    return " > dataset samples: " + ", ".join(parts)


def format_summary(run, first_iteration, last_iteration, stop_reason, total_seconds,
                   train_seconds, validation, latest_checkpoint):
    """The end-of-run block. ``run``: the :class:`~megatron_cp.config.run.RunConfig` (its
    ``train_iters``, --save and tensorboard folder); ``validation``: (iteration, loss) of the
    last evaluation or None; ``latest_checkpoint``: the iteration in --save's tracker (None
    without --save)."""
    save, tensorboard_dir = run.checkpoint.save, run.logging.tensorboard_dir
    ran = last_iteration - first_iteration
    per_iter = f", {train_seconds / ran:.3f} s per iteration" if ran else ""
    lines = ["-------------------------- end of training --------------------------",
             f" iterations: {ran} this run (from {first_iteration} to {last_iteration} of "
             f"--train-iters {run.training.train_iters}); stopped by {stop_reason}",
             f" time: {total_seconds:.1f} s in all, {train_seconds:.1f} s training{per_iter}"]
    if validation is not None:
        iteration, loss = validation
        lines.append(f" final validation loss: {loss:.6E} (PPL {math.exp(min(20.0, loss)):.6E}) "
                     f"at iteration {iteration}")
    else:
        lines.append(" final validation loss: not evaluated (--eval-iters 0, or stopped before "
                     "an evaluation)")
    if save:
        lines.append(f" checkpoints: {os.path.abspath(save)} (latest: iteration "
                     f"{latest_checkpoint}); resume or extend with --load {save}")
    else:
        lines.append(" checkpoints: none saved (no --save)")
    if tensorboard_dir:
        lines.append(f" tensorboard: {os.path.abspath(tensorboard_dir)} "
                     f"(tensorboard --logdir {tensorboard_dir})")
    lines.append("-" * len(lines[0]))
    return "\n".join(lines)
