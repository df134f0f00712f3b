"""pretrain(): build the state, model, optimizer and data; run the loop; evaluate, log, save.

One iteration = one global batch: every microbatch of this DP rank is read up front (so the
number of loss tokens of every microbatch and of the whole global batch is known before any
backward), run through the schedule with each microbatch's masked loss sum weighted as
Megatron-LM weights it in one process (:mod:`megatron_cp.pipeline_parallel.loss_weighting`), gradients are
SUM-reduced over DP x CP (so every layout takes the one-process gradient), then clipped and
applied.

Faults (:mod:`megatron_cp.resilience.faults`) end the job with one line: a lost peer (a collective
failed because a rank died or stopped answering), a NaN or inf in the loss or the gradient
norm (``--check-for-nan-in-loss-and-grad``), or a file that one rank could not read at
start-up (every rank then raises it, so rank 0 prints it). Before those checks, the rerun
state machine (:mod:`megatron_cp.resilience.rerun`, ``--rerun-mode``) validates each rank's own losses
and gradients and may run the step again, or end the job with Megatron's exit status 16 or
17.
"""
import gc
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_cp.checkpoint import files as checkpoint_files
from megatron_cp.distributed import device as device_mod
from megatron_cp.resilience import faults
from megatron_cp.resilience import rerun
from megatron_cp.layers.activation_offload import offload_note
from megatron_cp.layers.fine_grained_offload import fine_grained_note
from megatron_cp.distributed.initialize import initialize_distributed, set_group_timeouts
from megatron_cp.observability.profiling import StepProfiler
from megatron_cp.observability.run_report import (
    count_parameters, format_arguments, format_compat_notes, format_dataset_sizes,
    format_parallel_sizes, format_parameter_counts, format_summary, is_global_rank_zero,
    print_rank_0)
from megatron_cp.observability.training_log import TrainingLogger, model_flops_per_token
from megatron_cp.startup import build_parallel_state, tokenizer_and_run
from megatron_cp.training.trainer import Trainer


class _SigtermFlag:
    def __init__(self, enabled):
        self.received = False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True


def _any_rank(flag, device):
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def pretrain(args, state=None):
    """Run a whole pretraining job from validated ``args``; returns the list of train losses.

    The front door (``main``, pretrain_gpt.py): the run's sections are built from ``args``
    first (:func:`run_config`) and everything after reads them; ``args`` itself is printed
    (the argument banner) and kept for what checkpoints save. ``state``: the ParallelState,
    when torch.distributed was started already (else started here).

    Global rank 0 prints the start-up banner (``run_report``: arguments, sizes, parameter
    and dataset counts, a line before each slow step) and the end summary. A ``--load`` that
    already reached ``--train-iters`` says so and trains nothing. A collective that fails
    because another rank died or stopped answering raises
    :class:`~megatron_cp.resilience.faults.LostContactError` naming this rank, what the job was doing
    and the checkpoint to resume from.
    """
    progress = faults.Progress()
    tokenizer, run = tokenizer_and_run(args)  # the run's sections, for the banner too
    try:
        return _pretrain(args, run, tokenizer, state, progress)
    except RuntimeError as error:
        if not faults.is_lost_contact(error) or not dist.is_initialized():
            raise
        latest, save = None, run.checkpoint.save
        if save:
            try:
                latest = checkpoint_files.read_tracker(save)
            except (OSError, ValueError):
                pass  # the message then names no iteration
        raise faults.lost_contact(error, dist.get_rank(), progress.activity, run.checkpoint,
                                  run.parallel, latest) from error


def _set_logging_level(level):
    """Megatron's --logging-level: Python's root logger at ``level``, with a handler to
    print the records it lets through (Python's fallback prints warnings and errors only)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(level)


def _on_every_rank(step, device):
    """Run ``step()``; a ValueError it raises on some ranks only is raised on every rank
    (:func:`megatron_cp.resilience.faults.raise_on_every_rank`), so rank 0 prints it. Returns its value."""
    result, error = None, None
    try:
        result = step()
    except ValueError as failure:
        error = failure
    faults.raise_on_every_rank(error, device)
    return result


def _pretrain(args, run, tokenizer, state, progress):
    """:func:`pretrain` of ``args`` and their RunConfig ``run``, which it reads (``args`` is
    printed, and handed to the Trainer for its checkpoints); ``tokenizer``: the one ``run``
    was built with, handed to the Trainer."""
    started = time.time()
    if run.logging.logging_level is not None:
        _set_logging_level(run.logging.logging_level)
    if run.training.deterministic_mode:
        device_mod.enable_deterministic_mode()  # before any NCCL communicator exists
    print_rank_0(format_arguments(args))
    if format_compat_notes(run.notes):
        print_rank_0(format_compat_notes(run.notes))
    if state is None:
        print_rank_0("> initializing torch distributed ...")
        _, _, device = initialize_distributed(run.parallel.distributed_backend,
                                              run.parallel.distributed_timeout_minutes)
        state = build_parallel_state(run.parallel, run.model, run.optimizer, device)
    print_rank_0(format_parallel_sizes(run, state))
    for note in (offload_note(run.model.cpu_offloading_num_layers, state.device),
                 fine_grained_note(run.model, state.device)):
        if note:
            print_rank_0(note)
    print_rank_0("> building tokenizer, model and optimizer ...")
    trainer = Trainer(args, state, run, tokenizer)
    trainer.progress = progress
    print_rank_0(format_parameter_counts(*count_parameters(trainer.model_chunks, state)))
    if run.checkpoint.load:
        print_rank_0(f"> loading checkpoint from {run.checkpoint.load} ...")
        progress.activity = f"the checkpoint load from {run.checkpoint.load}"
        trainer.iteration, trainer.consumed_samples = _on_every_rank(
            lambda: trainer.checkpointer.load(trainer.train_state()), state.device)
        train_iters = run.training.train_iters
        if trainer.iteration >= train_iters:
            print_rank_0(f"checkpoint at iteration {trainer.iteration} already reached --train-iters "
                         f"{train_iters}; raise --train-iters to train on")
            return []
    print_rank_0("> building train, validation and test datasets ...")
    progress.activity = "the dataset build"
    try:
        return _train_on_data(trainer, started)
    finally:
        trainer.data.close()  # its loader processes end with the run, also when it fails


def _train_on_data(trainer, started):
    """Build the data, train, evaluate at the end and print the summary; the losses."""
    run, state = trainer.run, trainer.state
    _on_every_rank(trainer.build_iterators, state.device)
    if trainer.data.datasets:
        print_rank_0(format_dataset_sizes(trainer.data.datasets))
    # The readers agree (the split is deterministic); the other TP ranks learn it here.
    trainer.has_validation = _any_rank(trainer.data.valid_dataset is not None, state.device)
    if run.training.eval_iters > 0 and not trainer.has_validation:
        print_rank_0(f"> no validation data (--split {run.data.split} leaves the validation "
                     f"split empty): evaluation is skipped")
    flops_per_token = model_flops_per_token(trainer.config, run.data.seq_length)
    logger = TrainingLogger(run, state, flops_per_token)
    first = trainer.iteration
    print_rank_0(f"> start-up took {time.time() - started:.1f} s; training from iteration {first} "
                 f"to {run.training.train_iters} ...")
    train_start = time.time()
    try:
        losses, stop_reason = _train(trainer, logger, train_start)
        evaluated = logger.last_validation and logger.last_validation[0] == trainer.iteration
        if losses and stop_reason.startswith("--train-iters") and trainer.evaluates \
                and not evaluated:  # Megatron's end-of-training evaluation
            logger.validation(trainer.iteration, trainer.evaluate())
    finally:
        logger.close()  # also when the rerun machine ends the job (RerunExit)
    if is_global_rank_zero():
        save = run.checkpoint.save
        latest = checkpoint_files.read_tracker(save) if save else None
        print(format_summary(run, first, trainer.iteration, stop_reason, time.time() - started,
                             time.time() - train_start, logger.last_validation, latest), flush=True)
    return losses


def _train(trainer, logger, start):
    """The loop: train, log, evaluate, save and stop as the arguments say (with --save, also
    before the first iteration of a new --step-batch-size-schedule batch size, as Megatron-LM
    does); returns the losses and what stopped it. ``--manual-gc`` turns Python's collector off during the loop
    and collects after evaluations and saves and every ``--manual-gc-interval`` iterations
    (0: only then) instead (Megatron's flags). Reads the run's training section (length,
    evaluation, exits, checks), its checkpoint section's folders and intervals and its logging
    section (the profiler)."""
    state, training, checkpoint = trainer.state, trainer.run.training, trainer.run.checkpoint
    manual_gc, gc_interval = training.manual_gc, training.manual_gc_interval
    if manual_gc:
        gc.disable()
        gc.collect()
    sigterm = _SigtermFlag(training.exit_signal_handler)
    save = checkpoint.save
    losses, saved_at = [], (trainer.iteration if checkpoint.load else None)
    stop_reason = f"--train-iters {training.train_iters}"
    profiler = StepProfiler(trainer.run.logging, save, state.global_rank, state.device)
    skips = rerun.iterations_to_skip(training, state.global_rank)
    microbatches = trainer.batches.num_microbatches(trainer.consumed_samples)
    hash_interval = training.check_weight_hash_across_dp_replicas_interval
    if hash_interval:  # Megatron-LM checks once before the first iteration too
        trainer.check_weight_hashes()
    try:
        while trainer.iteration < training.train_iters:
            if trainer.iteration + 1 in skips:
                trainer.skip_step()
                continue
            profiler.step(trainer.iteration)
            before, microbatches = microbatches, trainer.batches.num_microbatches(
                trainer.consumed_samples)
            if microbatches != before and save and saved_at != trainer.iteration:
                # Megatron-LM saves before the first iteration of a new batch size
                trainer.progress.activity = f"the checkpoint save at iteration {trainer.iteration}"
                trainer.checkpointer.save(trainer.train_state())
                saved_at = trainer.iteration
            t0 = time.time()
            try:
                with logger.memory.meter(trainer.iteration + 1):  # the memory report's peak
                    loss, grad_norm, ok = trainer.train_step()
            except rerun.RerunExit as stop:
                raise _checkpoint_for_rerun(trainer, stop) from None
            device_mod.synchronize(state.device)
            if len(losses) == 0 and trainer.run.parallel.distributed_timeout_seconds_after_init:
                set_group_timeouts(state, trainer.run.parallel.distributed_timeout_seconds_after_init)
            losses.append(loss)
            logger.record(trainer, loss, grad_norm, ok, time.time() - t0)
            it = trainer.iteration
            collect = manual_gc and gc_interval and it % gc_interval == 0
            evaluation = training.eval_interval
            if trainer.evaluates and evaluation and it % evaluation == 0:
                logger.validation(it, trainer.evaluate())
                collect = manual_gc
            if hash_interval and it % hash_interval == 0:  # before a save could keep the damage
                trainer.check_weight_hashes()
            if save and checkpoint.save_interval and it % checkpoint.save_interval == 0:
                trainer.progress.activity = f"the checkpoint save at iteration {it}"
                trainer.checkpointer.save(trainer.train_state())
                saved_at = it
                collect = manual_gc
            if collect:
                gc.collect()
            stop = None
            if training.exit_interval and it % training.exit_interval == 0:
                stop = f"--exit-interval {training.exit_interval}"
            minutes = training.exit_duration_in_mins
            if minutes and _any_rank((time.time() - start) / 60 > minutes, state.device):
                stop = stop or f"--exit-duration-in-mins {minutes}"
            if training.exit_signal_handler and _any_rank(sigterm.received, state.device):
                logger.print(f"received SIGTERM: saving and exiting after iteration {it}")
                stop = "SIGTERM (--exit-signal-handler)"
            if stop:
                stop_reason = stop
                break
        trainer.progress.activity = f"the end of training (iteration {trainer.iteration})"
        if save and saved_at != trainer.iteration:
            trainer.checkpointer.save(trainer.train_state())
        if save:
            trainer.checkpointer.wait_for_async_save()  # the tracker is written before we return
        trainer.optimizer.finish_param_sync()  # no all-gather left running (--overlap-param-gather)
    finally:
        profiler.close()
        if manual_gc:
            gc.enable()
    return losses, stop_reason


def _checkpoint_for_rerun(trainer, stop):
    """Save the checkpoint that a :class:`~megatron_cp.resilience.rerun.RerunExit` asks for (the state
    before the failed iteration, with the machine's verdict so far) under ``--save``; returns
    the exit to raise (without ``--save`` there is nothing to resume elsewhere: a failure)."""
    if not stop.checkpoint:
        return stop
    if not trainer.run.checkpoint.save:
        return stop.without_checkpoint(" and no --save to keep it for a rerun on another GPU")
    trainer.progress.activity = f"the checkpoint save before iteration {stop.iteration}"
    trainer.checkpointer.save(trainer.train_state())
    trainer.checkpointer.wait_for_async_save()
    return stop


def main(argv=None):
    """Entry point used by pretrain_gpt.py: parse (validating before any group), then train.

    A user error (ValueError) prints one ``error:`` line on global rank 0 and returns 2
    (``check_args``); a fault of the running job (a lost peer, a NaN: ``faults``) prints one
    line and returns 1 (a lost peer ends the process with status 1 at once, see below); the
    rerun state machine's exit returns Megatron's 16 (resume elsewhere) or 17 (failed
    result validation) after its log lines and one ``error:`` line; any other exception
    keeps its traceback."""
    from megatron_cp.cli.check_args import (OTHER_RANK_GRACE_SECONDS, parse_arguments,
                                            report_user_error)
    from megatron_cp.distributed.initialize import distributed_env
    try:
        args = parse_arguments(argv, distributed_env()["world_size"])
    except ValueError as error:
        return report_user_error(error)
    try:
        pretrain(args)
    except ValueError as error:
        return report_user_error(error, after_startup=True)
    except faults.LostContactError as fault:
        # A peer is gone: tearing the communicators down can hang or abort (a gloo thread
        # still joinable at exit), so this process ends here, its line printed.
        faults.report(fault, OTHER_RANK_GRACE_SECONDS)
        sys.stdout.flush()
        os._exit(faults.FAULT_EXIT_STATUS)
    except faults.TrainingFault as fault:
        return faults.report(fault, OTHER_RANK_GRACE_SECONDS)
    except rerun.RerunExit as stop:  # on every rank: they agreed on it
        if is_global_rank_zero():
            faults.print_error_lines([str(stop)])
        status = stop.code
    else:
        status = 0
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
