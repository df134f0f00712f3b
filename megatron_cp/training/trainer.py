"""The Trainer: what one training run holds (model chunks in their data-parallel wrappers, the
optimizer and schedule, the data feed, the rerun state machine, the Checkpointer) and one
training step, one skipped step and one evaluation. :mod:`megatron_cp.training.loop` drives
it."""
import math
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod
from megatron_cp.resilience import faults
from megatron_cp.pipeline_parallel import loss_weighting
from megatron_cp import fp8, moe
from megatron_cp.checkpoint.checkpointer import Checkpointer
from megatron_cp.checkpoint.train_state import TrainState
from megatron_cp.resilience import rerun
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.data import tokenizer_from_config
from megatron_cp.data.batch_schedule import BatchSchedule
from megatron_cp.data.feed import DataFeed
from megatron_cp.model import GPTModel
from megatron_cp.model import multi_token_prediction as mtp
from megatron_cp.model.transformer import TransformerLayer
from megatron_cp.optimizer import GradNormNotFinite, build_optimizer, build_scheduler
from megatron_cp.distributed.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_cp.distributed.fsdp import TorchFullyShardedDataParallel
from megatron_cp.distributed.meta_init import materialize
from megatron_cp.pipeline_parallel import (build_model_chunks, get_forward_backward_func,
                                           layout_from_config, pipeline_tensor_shape)
from megatron_cp.resilience.weight_hash import check_weight_hashes
from megatron_cp.startup import dynamic_forward_step, forward_step


def data_parallel_wrapper(optimizer, model, state, params_dtype):
    """``model`` in its data-parallel wrapper, as the optimizer section ``optimizer`` asks:
    FSDP2 with --use-torch-fsdp2 or Megatron-FSDP's optim_grads(_params) (each transformer
    layer one unit; optim_grads keeps the gathered params to the step; FSDP2's host offload of
    the rows with --optimizer-cpu-offload of fraction 1), else the DDP of flat gradient
    buckets in --main-grads-dtype (with or without the distributed optimizer)."""
    if optimizer.fully_sharded:
        return TorchFullyShardedDataParallel(
            model, state, (TransformerLayer,), params_dtype=params_dtype,
            reshard_after_forward=not optimizer.torch_fsdp2_no_reshard_after_forward,
            keep_params_whole=optimizer.keeps_params_whole,
            offload_params=optimizer.offload_fraction == 1.0, pin_memory=optimizer.pin_cpu_params,
            fp8_param_gather=optimizer.fp8_param_gather)
    return DistributedDataParallel(
        model, state, bucket_size_mb=optimizer.ddp_bucket_size_mb,
        grad_reduce_dtype=optimizer.state_dtype("main_grads_dtype"),
        overlap_grad_reduce=optimizer.overlap_grad_reduce,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
        overlap_param_gather=optimizer.overlap_param_gather)


def build_models(run, state):
    """This rank's model chunks (one, or one per virtual pipeline stage) of the run's sections
    ``run``, and each in its data-parallel wrapper. With --init-model-with-meta-device the
    chunks are built on the meta device and their weights drawn one at a time
    (distributed/meta_init.py): by FSDP2's wrapper once it has sharded them (this rank's rows
    only), else right after the build; the weights are the default build's."""
    config = run.model
    meta = torch.device("meta") if config.init_model_with_meta_device else nullcontext()
    with meta:
        if state.size("pp") > 1:  # this rank's stage: one chunk, or one per virtual stage
            models = build_model_chunks(config, state, layout_from_config(
                run.parallel, config.num_layers, config.mtp_num_layers))
        else:
            models = [GPTModel(config, state=state, device=state.device)]
    if not run.optimizer.fully_sharded:
        for model in models:
            materialize(model, state.device)
            if run.optimizer.fp8_param_gather:  # FP8 weights for the distributed optimizer
                fp8.keep_fp8_weights(model)
    return models, [data_parallel_wrapper(run.optimizer, m, state, config.params_dtype)
                    for m in models]


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
        models, self.model_chunks = build_models(self.run, state)
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
        # --rerun-mode: a rejected loss or gradient reruns the step (megatron_cp.resilience.rerun). Under
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
        self.scheduler = build_scheduler(self.run.optimizer, self.run.checkpoint, self.optimizer)
        self.iteration, self.consumed_samples = 0, 0
        # saves and loads train_state(); owns the checkpoint group and the --async-save in flight
        self.checkpointer = Checkpointer(self.run.checkpoint, parallel, self.run.optimizer)
        self.batches = BatchSchedule.from_config(self.run.training, parallel)
        self.global_batch_size = None  # of the latest iteration (the log line's)
        self.data = DataFeed(self.run.data, self.run.training, parallel, self.config, state,
                             self.tokenizer, self.batches)
        # The P2P buffers between pipeline stages are [length/cp(/tp with SP), b, h]; the
        # length follows each step's data (DataFeed._step_length), the shape is passed per step.
        self.forward_backward = get_forward_backward_func(
            state, dtype=self.config.params_dtype, overlap_p2p_comm=parallel.overlap_p2p_comm,
            microbatch_group_size=parallel.microbatch_group_size_per_vp_stage)

    def train_state(self):
        """What a checkpoint of this run saves and restores, as of now: the live model
        chunks, optimizer, schedule and rerun machine, and the progress (iteration, consumed
        samples) so far."""
        return TrainState(model_chunks=self.model_chunks, parallel_state=self.state,
                          model_config=self.config, args=self.args, optimizer=self.optimizer,
                          scheduler=self.scheduler, rerun=self.rerun, iteration=self.iteration,
                          consumed_samples=self.consumed_samples)

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
        if self.data.dynamic:  # bins, not microbatches: per-token loss needs only the total
            counts, totals = loss_weighting.bin_counts(microbatches, masks, st.group("dp_cp"),
                                                       self.device)
            micro_batch_size, length = self.run.training.micro_batch_size, 0
        else:
            counts, totals = loss_weighting.microbatch_counts(
                microbatches, masks, st.rank("dp"), st.size("dp"), st.group("dp_cp"),
                self.device)
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
        step = dynamic_forward_step if self.data.dynamic else forward_step
        losses = self.forward_backward(step, loss_func, microbatches, self.model_chunks, st,
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
        norm raises :class:`~megatron_cp.resilience.faults.NonFiniteError` on every rank, before the
        update (both values are the same on every rank, so all stop together). The forward
        and backward run again from the same batch and RNG states while the rerun state
        machine asks (:mod:`megatron_cp.resilience.rerun`); it may end the job instead, raising
        :class:`~megatron_cp.resilience.rerun.RerunExit` on every rank before the update."""
        current = self.iteration + 1
        self.progress.activity = f"iteration {current}"
        run = self.run
        global_batch_size = self.batches.global_batch_size(self.consumed_samples)
        num_microbatches = self.batches.num_microbatches(self.consumed_samples)
        microbatches = self.data.microbatches(
            self.data.train_iter, num_microbatches, run.training.micro_batch_size,
            self.consumed_samples)
        for chunk in self.model_chunks:  # fine-grained offloading's per-step rules
            for module in chunk.modules():
                if getattr(module, "fine_offload", None) is not None:
                    module.fine_offload.num_microbatches = num_microbatches
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
        # FP8: delayed scaling's amaxes over every rank of the stage, its scales moved, once
        # per step
        fp8.end_fp8_step(self.model_chunks, [self.state.group(name) for name in ("tp", "cp", "dp")])
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
        weights (megatron_cp.resilience.weight_hash), once the parameter all-gathers have landed."""
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
