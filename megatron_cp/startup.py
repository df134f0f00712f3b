"""What a job needs to start, below the training loop: the run's sections and tokenizer from the
checked arguments, the ParallelState of those sections, the model config, and the forward step
of one microbatch. The training loop (megatron_cp.training), inference, the evaluation tasks
and the tools all start from here; nothing here imports the loop."""
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.data import tokenizer_from_config
from megatron_cp.data.batch import mtp_targets
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTConfig
from megatron_cp.model.attention import use_cp_size


def config_from_args(args, vocab_size):
    """The GPTConfig that the command line describes (derived from its fields' flags)."""
    return build_config(GPTConfig, args, vocab_size=vocab_size)


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
    distributed-optimizer instances of the optimizer section (``optimizer``) and dynamic CP's
    groups of every size."""
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    hierarchical = model.hierarchical_cp_sizes(tp, cp) if cp > 1 else None
    return initialize_model_parallel(
        tp, cp, parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical, device=device,
        timeout_minutes=parallel.distributed_timeout_minutes, order=parallel.rank_order,
        num_distributed_optimizer_instances=optimizer.num_distributed_optimizer_instances,
        dynamic_context_parallel=parallel.dynamic_context_parallel)


def forward_step(model, batch):
    """Per-token losses [b, s] of one microbatch (hidden states on non-last stages)."""
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 token_index=batch.get("token_index"), document_ids=batch.get("document_ids"),
                 loss_mask=batch.get("loss_mask"), sample_ids=batch.get("sample_ids"),
                 unpadded_index=batch.get("unpadded_index"), mtp_targets=mtp_targets(batch),
                 real_token=batch.get("real_token"))


def dynamic_forward_step(model, batch):
    """:func:`forward_step` of one dynamic-CP bin, on the CP group of its ``cp_size``."""
    use_cp_size(model, batch["cp_size"])
    return forward_step(model, batch)
