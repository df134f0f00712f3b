"""pretrain(): build the state, model, optimizer and data; run the loop; evaluate, log, save.

One iteration = one global batch: every microbatch of this DP rank is read up front (so the
number of loss tokens of the whole DP x CP group is known before any backward), run
through the schedule with loss ``sum(token_loss * mask) / global_tokens``, gradients are
SUM-reduced over DP x CP (exact global-batch gradient), then clipped and applied.
"""
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_cp import checkpointing
from megatron_cp import device as device_mod
from megatron_cp.context_parallel import partition_batch
from megatron_cp.data import build_data_iterator, build_tokenizer, build_train_valid_test_datasets
from megatron_cp.data import get_ltor_batch
from megatron_cp.initialize import initialize_distributed, initialize_model_parallel
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.optimizer import (DistributedDataParallel, MixedPrecisionOptimizer,
                                   OptimizerParamScheduler, finalize_model_grads, get_param_groups)
from megatron_cp.pipeline_parallel import (build_model_chunks, get_forward_backward_func,
                                           pad_microbatch, pipeline_tensor_shape)
from megatron_cp.training_log import TrainingLogger, model_flops_per_token


def config_from_args(args, vocab_size):
    """The GPTConfig that the command line describes."""
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=vocab_size,
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, normalization=args.normalization,
        norm_epsilon=args.norm_epsilon, activation="swiglu" if args.swiglu else "gelu",
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        init_method_std=args.init_method_std, seed=args.seed, params_dtype=args.params_dtype,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, cp_comm_type=args.cp_comm_type,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        allow_dummy_heads=not args.no_cp_dummy_heads)


class Trainer:
    """Everything one training run holds; ``pretrain`` drives it."""

    def __init__(self, args, state):
        self.args, self.state = args, state
        self.device = state.device
        self.tokenizer = build_tokenizer(args.tokenizer_type or "NullTokenizer", args.tokenizer_model,
                                         args.vocab_file, args.merge_file, args.vocab_size)
        self.config = config_from_args(args, self.tokenizer.vocab_size)
        vp_args = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        if (state.virtual_pipeline_model_parallel_size or 1) != vp_args:
            raise ValueError(f"the arguments ask for {vp_args} virtual pipeline stages but the "
                             f"ParallelState was built with "
                             f"{state.virtual_pipeline_model_parallel_size}; pass "
                             f"virtual_pipeline_model_parallel_size to initialize_model_parallel")
        _build_cp_subgroups(self.config, state)
        if state.size("pp") > 1:  # this rank's stage: one chunk, or one per virtual stage
            models = build_model_chunks(self.config, state, args.decoder_first_pipeline_num_layers,
                                        args.decoder_last_pipeline_num_layers)
        else:
            models = [GPTModel(self.config, state=state, device=self.device)]
        self.model_chunks = [DistributedDataParallel(m, state, overlap_grad_reduce=args.overlap_grad_reduce)
                             for m in models]
        self.model = self.model_chunks[0]
        self.optimizer = MixedPrecisionOptimizer(
            get_param_groups(models, args.weight_decay), state, lr=args.lr,
            weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, clip_grad=args.clip_grad, params_dtype=args.params_dtype,
            grad_scaler=_grad_scaler(args))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
            use_checkpoint_values=args.use_checkpoint_opt_param_scheduler,
            override_from_arguments=args.override_opt_param_scheduler)
        self.iteration, self.consumed_samples = 0, 0
        # Fixed P2P buffers [s/cp(/tp with SP), b, h] between pipeline stages.
        self.pipeline_seq_length = getattr(args, "pipeline_seq_length", None) or args.seq_length
        shape = pipeline_tensor_shape(self.pipeline_seq_length, args.micro_batch_size,
                                      args.hidden_size, state.size("cp"), state.size("tp"),
                                      self.config.sequence_parallel) if state.size("pp") > 1 else None
        self.forward_backward = get_forward_backward_func(
            state, shape, args.params_dtype, getattr(args, "overlap_p2p_comm", False))

    # ----- data -----------------------------------------------------------------------
    def build_iterators(self):
        a = self.args
        eval_rounds = a.train_iters // a.eval_interval + 1 if a.eval_iters > 0 else 0
        num_samples = (a.train_iters * a.global_batch_size,
                       eval_rounds * a.eval_iters * a.global_batch_size, a.eval_iters * a.global_batch_size)
        reads = self.state.rank("tp") == 0  # TP peers receive their batch by broadcast
        train, valid, _ = build_train_valid_test_datasets(
            a.data_path, a.split, num_samples, a.seq_length, a.seed, self.tokenizer,
            mock=a.mock_data, data_cache_path=a.data_cache_path) if reads else (None, None, None)
        dp_rank, dp_size = self.state.rank("dp"), self.state.size("dp")
        self.train_iter = build_data_iterator(train, a.global_batch_size, a.micro_batch_size,
                                              dp_rank, dp_size, self.consumed_samples, a.num_workers)
        self.valid_dataset = valid

    def next_microbatches(self, iterator):
        """This rank's microbatches of one global batch, built and (for CP) partitioned."""
        a, st = self.args, self.state
        out = []
        for _ in range(a.num_microbatches):
            text = next(iterator) if iterator is not None else None
            if st.size("tp") > 1:
                if text is None:
                    text = torch.empty(a.micro_batch_size, a.seq_length + 1, dtype=torch.long)
                text = text.to(self.device)
                dist.broadcast(text, src=st.group_ranks("tp")[0], group=st.group("tp"))
            batch = get_ltor_batch(text.to(self.device), self.tokenizer.eod, a.reset_position_ids,
                                   a.reset_attention_mask, a.eod_mask_loss)
            # Pipeline stages exchange fixed-shape buffers: pad every microbatch to the
            # buffer length by extending its last document (the CP partition does it there).
            target = self.pipeline_seq_length if st.size("pp") > 1 else None
            if st.size("cp") > 1:
                try:
                    batch = partition_batch(batch, st.rank("cp"), st.size("cp"), target_length=target)
                except ValueError as error:
                    if target is None:
                        raise
                    raise ValueError(f"{error}. The pipeline buffer holds --pipeline-seq-length "
                                     f"({target}) tokens per sample: raise --pipeline-seq-length") \
                        from error
            elif target is not None:
                batch = pad_microbatch(batch, target)
            out.append(batch)
        return out

    # ----- one step -------------------------------------------------------------------
    def _run_batches(self, microbatches, forward_only):
        st = self.state
        local_tokens = sum(b["loss_mask"].sum() for b in microbatches).float()
        totals = torch.stack([local_tokens, torch.zeros((), device=self.device)])
        dist.all_reduce(totals, group=st.group("dp_cp"))
        num_tokens = totals[0].clamp(min=1.0)  # a batch of only masked tokens must not divide by 0
        scale = 1.0 if forward_only else self.optimizer.get_loss_scale()

        def loss_func(output, batch):
            loss_sum = (output.float() * batch["loss_mask"]).sum()
            return loss_sum * (scale / num_tokens), loss_sum

        losses = self.forward_backward(forward_step, loss_func, microbatches, self.model_chunks, st,
                                       forward_only=forward_only)
        loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(loss_sum, group=st.group("dp_cp"))
        if st.size("pp") > 1:  # only the last stage holds the loss; share it with every stage
            dist.all_reduce(loss_sum, group=st.group("pp"))
        return (loss_sum / num_tokens).item(), int(totals[0].item())

    def train_step(self):
        microbatches = self.next_microbatches(self.train_iter)
        for chunk in self.model_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss, _ = self._run_batches(microbatches, forward_only=False)
        finalize_model_grads(self.model_chunks, self.state)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(1)
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        return loss, grad_norm, ok

    @torch.no_grad()
    def evaluate(self):
        a = self.args
        reads = self.state.rank("tp") == 0
        it = build_data_iterator(self.valid_dataset if reads else None, a.global_batch_size,
                                 a.micro_batch_size, self.state.rank("dp"), self.state.size("dp"),
                                 0, a.num_workers)
        for chunk in self.model_chunks:
            chunk.eval()
        total, tokens = 0.0, 0
        for _ in range(a.eval_iters):
            loss, n = self._run_batches(self.next_microbatches(it), forward_only=True)
            total, tokens = total + loss * n, tokens + n
        return total / max(tokens, 1)


def _build_cp_subgroups(config, state):
    """The a2a+p2p sub-groups of every CP group, built by every rank at start-up: attention
    would otherwise build them lazily, which only works when the CP group is the whole world
    (with PP or DP the ranks of other CP groups would never join the new_group calls)."""
    if state.size("cp") == 1:
        return
    from megatron_cp.context_parallel import build_hierarchical_groups, resolve_comm_type
    method, sizes = resolve_comm_type(config.cp_comm_type, config.num_query_groups // state.size("tp"),
                                      state.size("cp"), config.hierarchical_context_parallel_sizes)
    if method == "a2a+p2p":
        build_hierarchical_groups(state.layout["cp"], *sizes)


def forward_step(model, batch):
    """Per-token losses [b, s] of one microbatch (hidden states on non-last stages)."""
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 token_index=batch.get("token_index"), document_ids=batch.get("document_ids"))


def _grad_scaler(args):
    from megatron_cp.optimizer import ConstantGradScaler, DynamicGradScaler
    if not args.fp16:
        return None
    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
                             growth_interval=args.loss_scale_window, hysteresis=args.hysteresis)


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
    """Run a whole pretraining job from validated ``args``; returns the list of train losses."""
    if state is None:
        _, _, device = initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
        state = initialize_model_parallel(
            args.tensor_model_parallel_size, args.context_parallel_size,
            args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size,
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            device=device, timeout_minutes=args.distributed_timeout_minutes)
    trainer = Trainer(args, state)
    if args.load:
        trainer.iteration, trainer.consumed_samples = checkpointing.load_checkpoint(trainer, args.load)
    trainer.build_iterators()
    logger = TrainingLogger(args, state, model_flops_per_token(trainer.config, args.seq_length))
    sigterm = _SigtermFlag(args.exit_signal_handler)
    start = time.time()
    losses, saved_at = [], (trainer.iteration if args.load else None)
    while trainer.iteration < args.train_iters:
        t0 = time.time()
        loss, grad_norm, ok = trainer.train_step()
        device_mod.synchronize(state.device)
        losses.append(loss)
        logger.record(trainer, loss, grad_norm, ok, time.time() - t0)
        it = trainer.iteration
        if args.eval_iters > 0 and args.eval_interval and it % args.eval_interval == 0:
            logger.validation(it, trainer.evaluate())
        if args.save and args.save_interval and it % args.save_interval == 0:
            checkpointing.save_checkpoint(trainer, args.save)
            saved_at = it
        stop = bool(args.exit_interval and it % args.exit_interval == 0)
        if args.exit_duration_in_mins:
            stop = _any_rank(stop or (time.time() - start) / 60 > args.exit_duration_in_mins,
                             state.device)
        if args.exit_signal_handler and _any_rank(sigterm.received, state.device):
            logger.print(f"received SIGTERM: saving and exiting after iteration {it}")
            stop = True
        if stop:
            break
    if args.save and saved_at != trainer.iteration:
        checkpointing.save_checkpoint(trainer, args.save)
    logger.close()
    return losses


def main(argv=None):
    """Entry point used by pretrain_gpt.py: parse (validating before any group), then train."""
    from megatron_cp.arguments import parse_args
    from megatron_cp.initialize import distributed_env
    args = parse_args(argv, world_size=distributed_env()["world_size"])
    pretrain(args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
