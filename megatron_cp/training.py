"""pretrain(): build the state, model, optimizer and data; run the loop; evaluate, log, save.

One iteration = one global batch: every microbatch of this DP rank is read up front (so the
number of loss tokens of every microbatch and of the whole global batch is known before any
backward), run through the schedule with each microbatch's masked loss sum weighted as
Megatron-LM weights it in one process (:mod:`megatron_cp.pipeline_parallel.loss_weighting`), gradients are
SUM-reduced over DP x CP (so every layout takes the one-process gradient), then clipped and
applied.

Faults (:mod:`megatron_cp.faults`) end the job with one line: a lost peer (a collective
failed because a rank died or stopped answering), a NaN or inf in the loss or the gradient
norm (``--check-for-nan-in-loss-and-grad``), or a file that one rank could not read at
start-up (every rank then raises it, so rank 0 prints it). Before those checks, the rerun
state machine (:mod:`megatron_cp.rerun`, ``--rerun-mode``) validates each rank's own losses
and gradients and may run the step again, or end the job with Megatron's exit status 16 or
17.
"""
import gc
import logging
import math
import os
import signal
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_cp.checkpoint import files as checkpoint_files
from megatron_cp.checkpoint import load_save
from megatron_cp import device as device_mod
from megatron_cp import faults
from megatron_cp.pipeline_parallel import loss_weighting
from megatron_cp import moe
from megatron_cp import rerun
from megatron_cp.activation_offload import offload_note
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.data import tokenizer_from_config
from megatron_cp.data.batch import mtp_targets
from megatron_cp.data.batch_schedule import BatchSchedule
from megatron_cp.data.feed import DataFeed
from megatron_cp.initialize import (initialize_distributed, initialize_model_parallel,
                                   set_group_timeouts)
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.model import multi_token_prediction as mtp
from megatron_cp.model.transformer import TransformerLayer
from megatron_cp.optimizer import (DistributedDataParallel, GradNormNotFinite, build_optimizer,
                                   build_scheduler, finalize_model_grads)
from megatron_cp.optimizer.fsdp import TorchFullyShardedDataParallel
from megatron_cp.pipeline_parallel import (build_model_chunks, get_forward_backward_func,
                                           layout_from_config, pipeline_tensor_shape)
from megatron_cp.observability.profiling import StepProfiler
from megatron_cp.observability.run_report import (
    count_parameters, format_arguments, format_compat_notes, format_dataset_sizes,
    format_parallel_sizes, format_parameter_counts, format_summary, is_global_rank_zero,
    print_rank_0)
from megatron_cp.observability.training_log import TrainingLogger, model_flops_per_token
from megatron_cp.weight_hash import check_weight_hashes


def data_parallel_wrapper(optimizer, model, state, params_dtype):
    """``model`` in its data-parallel wrapper, as the optimizer section ``optimizer`` asks:
    FSDP2 with --use-torch-fsdp2 or Megatron-FSDP's optim_grads(_params) (each transformer
    layer one unit; optim_grads keeps the gathered params to the step), else the DDP of flat
    gradient buckets (with or without the distributed optimizer)."""
    if optimizer.fully_sharded:
        return TorchFullyShardedDataParallel(
            model, state, (TransformerLayer,), params_dtype=params_dtype,
            reshard_after_forward=not optimizer.torch_fsdp2_no_reshard_after_forward,
            keep_params_whole=optimizer.keeps_params_whole)
    return DistributedDataParallel(
        model, state, bucket_size_mb=optimizer.ddp_bucket_size_mb,
        overlap_grad_reduce=optimizer.overlap_grad_reduce,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
        overlap_param_gather=optimizer.overlap_param_gather)


def config_from_args(args, vocab_size):
    """The GPTConfig that the command line describes (derived from its fields' flags)."""
    return build_config(GPTConfig, args, vocab_size=vocab_size)


class Trainer:
    """Everything one training run holds; ``pretrain`` drives it.

    ``args``: the checked arguments, kept for what checkpoints save (Megatron-LM's names);
    ``run``: their :class:`~megatron_cp.config.run.RunConfig` where the caller built it
    (:func:`run_config`; ``pretrain`` does, for its banner), else built here; ``tokenizer``:
    the one ``run`` was built with, where the caller has it (else built from the data section,
    so the job builds it once). The trainer and each part it builds read the run's sections."""

    def __init__(self, args, state, run=None, tokenizer=None):
        self.args, self.state = args, state  # args: what checkpoints save (Megatron-LM's names)
        self.device = state.device
        self.progress = faults.Progress()  # what a lost-contact error says the job was doing
        self.tokenizer = tokenizer or tokenizer_from_config(
            run.data if run is not None else build_config(DataConfig, args))
        # the run's frozen configuration; each part below is handed its own section
        self.run = run or RunConfig.from_args(args, self.tokenizer.vocab_size)
        self.check_for_nan = self.run.training.check_for_nan_in_loss_and_grad
        self.config = self.run.model
        # saved with the arguments: conversions carry exactly the real vocabulary
        args.true_vocab_size = self.config.vocab_size
        args.padded_vocab_size = self.config.padded_vocab_size(state.size("tp"))
        parallel = self.run.parallel
        vp_args = parallel.virtual_pipeline_model_parallel_size or 1  # None: no virtual stages
        if (state.virtual_pipeline_model_parallel_size or 1) != vp_args:
            raise ValueError(f"the arguments ask for {vp_args} virtual pipeline stages but the "
                             f"ParallelState was built with "
                             f"{state.virtual_pipeline_model_parallel_size}; pass "
                             f"virtual_pipeline_model_parallel_size to initialize_model_parallel")
        if state.order != parallel.rank_order:
            raise ValueError(f"the arguments ask for rank order {parallel.rank_order} but the "
                             f"ParallelState was built with {state.order}; pass order to "
                             f"initialize_model_parallel")
        if state.size("pp") > 1:  # this rank's stage: one chunk, or one per virtual stage
            models = build_model_chunks(self.config, state, layout_from_config(
                parallel, self.config.num_layers, self.config.mtp_num_layers))
        else:
            models = [GPTModel(self.config, state=state, device=self.device)]
        self.model_chunks = [data_parallel_wrapper(self.run.optimizer, m, state,
                                                   self.config.params_dtype) for m in models]
        self.model = self.model_chunks[0]
        training = self.run.training
        if training.test_mode:  # Megatron-LM's realtime test: QK norms equal over DP, each forward
            for m in models:
                for module in m.modules():
                    if getattr(module, "q_layernorm", None) is not None:
                        module.replica_check_group = state.group("dp")
        self.optimizer = build_optimizer(self.run.optimizer, self.config, models, self.model_chunks,
                                         state, self.check_for_nan)
        self.optimizer.count_zeros_in_grad = self.run.logging.log_num_zeros_in_grad
        # --rerun-mode: a rejected loss or gradient reruns the step (megatron_cp.rerun). Under
        # dynamic fp16 loss scaling an overflow is the scaler's signal, not a fault: Megatron
        # turns the checks off there, and so does this (the loop's NaN checks stay).
        self.rerun = rerun.from_config(training, state.global_rank, self.device,
                                       save_extra=self._rerun_extra,
                                       restore_extra=self._restore_rerun_extra)
        precision = self.run.optimizer
        dynamic_fp16 = precision.fp16 and not precision.loss_scale
        self.validate_nan = self.check_for_nan and not dynamic_fp16
        for chunk in self.model_chunks:
            chunk.grad_check = partial(rerun.check_grad_bucket, self.rerun,
                                       check_nan=self.validate_nan,
                                       check_large=training.check_for_large_grads)
        self.skipped_samples = 0  # of the iterations skipped (--iterations-to-skip)
        self.num_zeros = None  # of the latest step, with --log-num-zeros-in-grad
        self.pending_save = None  # the --async-save in flight (megatron_cp.checkpoint.torch_dist_format)
        self.scheduler = build_scheduler(self.run.optimizer, self.run.checkpoint, self.optimizer)
        self.iteration, self.consumed_samples = 0, 0
        self.batches = BatchSchedule.from_config(self.run.training, parallel)
        self.global_batch_size = None  # of the latest iteration (the log line's)
        self.data = DataFeed(self.run.data, self.run.training, parallel, self.config, state,
                             self.tokenizer, self.batches)
        # The P2P buffers between pipeline stages are [length/cp(/tp with SP), b, h]; the
        # length follows each step's data (DataFeed._step_length), the shape is passed per step.
        self.forward_backward = get_forward_backward_func(
            state, dtype=self.config.params_dtype, overlap_p2p_comm=parallel.overlap_p2p_comm,
            microbatch_group_size=parallel.microbatch_group_size_per_vp_stage)

    # ----- data (megatron_cp.data.feed) -------------------------------------------------
    def build_iterators(self):
        """Build the datasets; training resumes after the samples already consumed."""
        self.data.build(self.consumed_samples)

    # ----- one step -------------------------------------------------------------------
    def _run_batches(self, microbatches, forward_only):
        st = self.state
        depths = self.config.mtp_depths()
        # the LM's loss-masked tokens, then each MTP depth's: per microbatch (over its CP
        # parts) and over the global batch
        masks = ["loss_mask"] + [f"mtp_loss_mask_{d}" for d in range(1, depths + 1)]
        counts, totals = loss_weighting.microbatch_counts(
            microbatches, masks, st.rank("dp"), st.size("dp"), st.group("dp_cp"), self.device)
        micro_batch_size, length = microbatches[0]["tokens"].shape
        weights = loss_weighting.step_weights(
            counts, totals, num_microbatches=len(microbatches) * st.size("dp"),
            tokens_per_microbatch=micro_batch_size * self.run.data.seq_length,
            per_token_loss=self.run.training.calculate_per_token_loss,
            mtp_factor=self.config.mtp_loss_scaling_factor,
            loss_scale=1.0 if forward_only else float(self.optimizer.get_loss_scale()))
        for batch, lm, mtp_weights in zip(microbatches, weights.lm, weights.mtp):
            batch["loss_weight"], batch["mtp_loss_weights"] = lm, mtp_weights
        mtp.reset_loss_sums(self.model_chunks)
        if not forward_only:
            moe.set_aux_loss_scale(self.model_chunks, weights.aux)

        def loss_func(output, batch):
            loss_sum = (output.float() * batch["loss_mask"]).sum()
            if not forward_only:  # this rank's own loss, before any reduction (Megatron's)
                rerun.check_loss(self.rerun, loss_sum, self.validate_nan,
                                 self.run.training.check_for_spiky_loss)
            return loss_sum * batch["loss_weight"], loss_sum

        shape = None
        if st.size("pp") > 1:  # [length/cp(/tp with SP), b, h], the same on every stage
            shape = pipeline_tensor_shape(length * st.size("cp"), micro_batch_size,
                                          self.config.hidden_size, st.size("cp"), st.size("tp"),
                                          self.config.sequence_parallel)
        losses = self.forward_backward(forward_step, loss_func, microbatches, self.model_chunks, st,
                                       forward_only=forward_only, tensor_shape=shape)
        loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        self._loss_finite_here = torch.isfinite(loss_sum)  # read only if the sum is not finite
        # with the MTP depths' masked cross-entropy sums: [1 + D]
        sums = torch.cat([loss_sum.reshape(1).float(),
                          mtp.local_loss_sums(self.model_chunks, depths, self.device)])
        dist.all_reduce(sums, group=st.group("dp_cp"))
        if st.size("pp") > 1:  # only the last stage holds the loss; share it with every stage
            dist.all_reduce(sums, group=st.group("pp"))
        # Megatron-LM's "mtp_k loss": each depth's token mean (not weighted by the factor)
        self.mtp_losses = (sums[1:].double() / totals[1:1 + depths].clamp(min=1.0)).tolist()
        # the logged loss: the token-weighted mean over the global batch, as Megatron-LM logs
        return sums[0].item() / weights.num_tokens, int(totals[0].item())

    def train_step(self):
        """One iteration; with ``--check-for-nan-in-loss-and-grad`` a NaN/inf loss or gradient
        norm raises :class:`~megatron_cp.faults.NonFiniteError` on every rank, before the
        update (both values are the same on every rank, so all stop together). The forward
        and backward run again from the same batch and RNG states while the rerun state
        machine asks (:mod:`megatron_cp.rerun`); it may end the job instead, raising
        :class:`~megatron_cp.rerun.RerunExit` on every rank before the update."""
        current = self.iteration + 1
        self.progress.activity = f"iteration {current}"
        run = self.run
        global_batch_size = self.batches.global_batch_size(self.consumed_samples)
        microbatches = self.data.microbatches(
            self.data.train_iter, self.batches.num_microbatches(self.consumed_samples),
            run.training.micro_batch_size, self.consumed_samples)
        while self.rerun.should_run_forward_backward(self.iteration):
            for chunk in self.model_chunks:
                chunk.train()
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss, _ = self._run_batches(microbatches, forward_only=False)
            finalize_model_grads(self.model_chunks, self.state)
        if run.training.empty_unused_memory_level >= 1:
            device_mod.empty_cache(self.device)
        stop = self.rerun.step_exit()
        if stop is not None:
            raise stop
        rank = self.state.global_rank
        if self.check_for_nan and not math.isfinite(loss):
            bad = faults.ranks_where(not bool(self._loss_finite_here), self.device)
            raise faults.non_finite("loss", loss, current, rank, bad)
        moe.update_expert_bias(self.model_chunks, self.state)
        moe.update_qb_beta(self.model_chunks, self.state)
        try:
            ok, grad_norm, self.num_zeros = self.optimizer.step()
        except GradNormNotFinite as bad:
            raise faults.non_finite("gradient norm", bad.grad_norm, current, rank, bad.ranks) from None
        if ok:
            self.scheduler.step(global_batch_size if run.optimizer.lr_counts_samples else 1)
        if run.training.empty_unused_memory_level >= 2:
            device_mod.empty_cache(self.device)
        self.iteration += 1
        self.consumed_samples += global_batch_size
        self.global_batch_size = global_batch_size
        if run.logging.log_params_norm and (self.iteration % run.logging.log_interval == 0
                                            or self.iteration == run.training.train_iters):
            self.optimizer.finish_param_sync()  # the norm reads every param: wait for the gathers
        return loss, grad_norm, ok

    def skip_step(self):
        """Megatron's ``--iterations-to-skip``: read the next iteration's batch and count it
        consumed (and skipped), without a forward, backward or update."""
        global_batch_size = self.batches.global_batch_size(self.consumed_samples)
        self.data.microbatches(self.data.train_iter,
                               self.batches.num_microbatches(self.consumed_samples),
                               self.run.training.micro_batch_size)
        self.iteration += 1
        self.consumed_samples += global_batch_size
        self.skipped_samples += global_batch_size

    def _rerun_extra(self):
        """What a rerun of the step starts from again, beside the global RNGs: the tracker's
        RNG states (dropout inside TP regions) and the MoE routers' counters."""
        return {"tracker": self.model.module.rng_tracker.get_states(),
                "moe": moe.router_counters(self.model_chunks)}

    def _restore_rerun_extra(self, saved):
        self.model.module.rng_tracker.set_states(saved["tracker"])
        moe.restore_router_counters(self.model_chunks, saved["moe"])

    def check_weight_hashes(self):
        """--check-weight-hash-across-dp-replicas-interval: every DP replica holds the same
        weights (megatron_cp.weight_hash), once the parameter all-gathers have landed."""
        self.progress.activity = f"the weight-hash check after iteration {self.iteration}"
        self.optimizer.finish_param_sync()
        check_weight_hashes(self.model_chunks, self.state, self.iteration)

    @property
    def evaluates(self):
        """Evaluation is asked for (--eval-iters > 0) and there is validation data."""
        return self.run.training.eval_iters > 0 and getattr(self, "has_validation", True)

    @torch.no_grad()
    def evaluate(self):
        self.progress.activity = f"the evaluation after iteration {self.iteration}"
        it = self.data.validation_iterator()
        for chunk in self.model_chunks:
            chunk.eval()
        total, tokens = 0.0, 0
        training = self.run.training
        for _ in range(training.eval_iters):  # batches of --eval-global-batch-size samples
            microbatches = self.data.microbatches(it, training.eval_num_microbatches,
                                                  training.eval_micro_batch_size)
            loss, n = self._run_batches(microbatches, forward_only=True)
            total, tokens = total + loss * n, tokens + n
            if training.empty_unused_memory_level >= 1:
                device_mod.empty_cache(self.device)
        return total / max(tokens, 1)


def tokenizer_and_run(args):
    """The tokenizer that the checked ``args`` (:func:`megatron_cp.cli.arguments.parse_args`)
    name, and their :class:`~megatron_cp.config.run.RunConfig`, built with its vocabulary."""
    tokenizer = tokenizer_from_config(build_config(DataConfig, args))
    return tokenizer, RunConfig.from_args(args, tokenizer.vocab_size)


def run_config(args):
    """The :class:`~megatron_cp.config.run.RunConfig` of the checked ``args``
    (:func:`tokenizer_and_run`)."""
    return tokenizer_and_run(args)[1]


def build_parallel_state(parallel, model, optimizer, device=None):
    """The ParallelState of a run (torch.distributed already started): every group of the
    parallel section ``parallel`` (sizes, virtual stages, rank order, timeout), including the
    a2a+p2p sub-groups that the model section's (``model``) CP comm type resolves to and the
    distributed-optimizer instances of the optimizer section (``optimizer``)."""
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    hierarchical = model.hierarchical_cp_sizes(tp, cp) if cp > 1 else None
    return initialize_model_parallel(
        tp, cp, parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical, device=device,
        timeout_minutes=parallel.distributed_timeout_minutes, order=parallel.rank_order,
        num_distributed_optimizer_instances=optimizer.num_distributed_optimizer_instances)


def forward_step(model, batch):
    """Per-token losses [b, s] of one microbatch (hidden states on non-last stages)."""
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 token_index=batch.get("token_index"), document_ids=batch.get("document_ids"),
                 loss_mask=batch.get("loss_mask"), sample_ids=batch.get("sample_ids"),
                 unpadded_index=batch.get("unpadded_index"), mtp_targets=mtp_targets(batch))


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
    :class:`~megatron_cp.faults.LostContactError` naming this rank, what the job was doing
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
    (:func:`megatron_cp.faults.raise_on_every_rank`), so rank 0 prints it. Returns its value."""
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
    offloaded = offload_note(run.model.cpu_offloading_num_layers, state.device)
    if offloaded:
        print_rank_0(offloaded)
    print_rank_0("> building tokenizer, model and optimizer ...")
    trainer = Trainer(args, state, run, tokenizer)
    trainer.progress = progress
    print_rank_0(format_parameter_counts(*count_parameters(trainer.model_chunks, state)))
    if run.checkpoint.load:
        print_rank_0(f"> loading checkpoint from {run.checkpoint.load} ...")
        progress.activity = f"the checkpoint load from {run.checkpoint.load}"
        trainer.iteration, trainer.consumed_samples = _on_every_rank(
            lambda: load_save.load_checkpoint(trainer), state.device)
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
                load_save.save_checkpoint(trainer)
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
                load_save.save_checkpoint(trainer)
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
            load_save.save_checkpoint(trainer)
        if save:
            load_save.wait_for_async_save(trainer)  # the tracker is written before we return
        trainer.optimizer.finish_param_sync()  # no all-gather left running (--overlap-param-gather)
    finally:
        profiler.close()
        if manual_gc:
            gc.enable()
    return losses, stop_reason


def _checkpoint_for_rerun(trainer, stop):
    """Save the checkpoint that a :class:`~megatron_cp.rerun.RerunExit` asks for (the state
    before the failed iteration, with the machine's verdict so far) under ``--save``; returns
    the exit to raise (without ``--save`` there is nothing to resume elsewhere: a failure)."""
    if not stop.checkpoint:
        return stop
    if not trainer.run.checkpoint.save:
        return stop.without_checkpoint(" and no --save to keep it for a rerun on another GPU")
    trainer.progress.activity = f"the checkpoint save before iteration {stop.iteration}"
    load_save.save_checkpoint(trainer)
    load_save.wait_for_async_save(trainer)
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
    from megatron_cp.initialize import distributed_env
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
