"""The levers the layout search tries on each parallel layout: settings that change what a
rank holds and how long a step takes, never what is computed.

A :class:`Lever` owns some training settings (its ``dests``: given on the command line, the
lever stays as given) and offers options. An option is a *ladder*: values ordered from the
fastest to the one that saves the most memory (full recompute of 1, 2, ... layers per chunk
up to every layer; 0, 1, 2, ... offloaded layers). The search (``search.py``) takes one option
of every lever and climbs the ladders only as far as memory demands; "trade-off" levers
(CP comm type, optimizer sharding) have options that neither dominates, the others ("saving"
levers) list their options from the plainest to the most saving.

:data:`LEVERS` is the list the search walks, in the order their ladders are climbed (the
cheapest savings first). A new lever is one more entry: its flags, its ladders, the
settings a value sets (``{section: {field: value}}`` of the :class:`RunConfig`) and the
check the argument validation would run across sections.
"""
from dataclasses import dataclass
from typing import Callable

from megatron_cp.distributed import fsdp

# --tiled-logits-chunk-size values tried, largest first: a chunk of positions' fp32 logits
# costs chunk x vocab/tp x ~14 bytes at its peak (1.8 GiB at 1024 x 128256, 0.1 GiB at 64)
LOGITS_CHUNKS = (4096, 1024, 256, 64)
MLP_PER_HIDDEN = 0  # --mlp-chunks-for-training value: ALST's ceil(tokens / hidden_size) chunks


@dataclass(frozen=True)
class Context:
    """What the levers' options depend on besides the run: the device kind ("cpu" or
    "gpu": on a CPU nothing offloads) and whether a host memory limit is given (offloading
    is planned only against one)."""
    device: str = "gpu"
    host_limited: bool = False


@dataclass(frozen=True)
class Lever:
    """A group of settings the search may choose. ``ladders(run, context)``: the options
    (each a list of values, fastest first); ``settings(run, value)``: ``{section: {field:
    value}}`` for ``run`` (at its sequence length); ``check(run)``: raise ValueError when the
    run with these settings breaks a rule across sections; ``saving``: the options are
    ordered from the plainest to the most memory-saving (False: a trade-off, each option
    tried on its own)."""
    name: str
    dests: tuple
    ladders: Callable
    settings: Callable
    check: Callable = lambda run: None
    saving: bool = True


def _hierarchical_splits(cp):
    return [(inner, cp // inner) for inner in range(2, cp) if cp % inner == 0]


def _cp_comm_ladders(run, context):
    cp = run.parallel.context_parallel_size
    if cp == 1:
        return [[None]]
    return [[("p2p", None)], [("a2a", None)], [("all_gather", None)]] + \
        [[("a2a+p2p", sizes)] for sizes in _hierarchical_splits(cp)]


def _cp_comm_settings(run, value):
    if value is None:
        return {}
    comm, sizes = value
    return {"model": {"cp_comm_type": comm, "hierarchical_context_parallel_sizes": sizes}}


def _cp_comm_check(run):
    run.model.validate_parallel(run.parallel.tensor_model_parallel_size,
                                run.parallel.context_parallel_size)


OPTIMIZERS = {"distributed": {"use_distributed_optimizer": True, "use_torch_fsdp2": False},
              "fsdp2": {"use_distributed_optimizer": False, "use_torch_fsdp2": True}}


def optimizer_name(optimizer):
    """"fsdp2", "megatron-fsdp", "distributed" or "replicated": how ``optimizer`` (an
    :class:`~megatron_cp.config.optimizer.OptimizerConfig`) shards the training state."""
    if optimizer.use_torch_fsdp2:
        return "fsdp2"
    if optimizer.use_megatron_fsdp:
        return "megatron-fsdp"
    return "distributed" if optimizer.use_distributed_optimizer else "replicated"


def _optimizer_check(run):
    problems = fsdp.argument_problems(run.optimizer, run.parallel, run.checkpoint, run.training)
    if problems:
        raise ValueError(problems[0])


def _recompute_ladders(run, context):
    layers_per_chunk = -(-run.model.num_layers // (run.parallel.pipeline_model_parallel_size
                                                   * (run.parallel.virtual_pipeline_model_parallel_size
                                                      or 1)))
    full = [("full", "block", n) for n in range(1, layers_per_chunk)] + [("full", "uniform", 1)]
    return [[(None, None, None)], [("selective", None, None)], full]


def _recompute_settings(run, value):
    granularity, method, num_layers = value
    return {"model": {"recompute_granularity": granularity, "recompute_method": method,
                      "recompute_num_layers": num_layers}}


def recompute_name(model):
    """"none", "selective", or "full/<method>/<layers>" of the model config ``model``."""
    if model.recompute_granularity is None:
        return "none"
    if model.recompute_granularity == "selective":
        return "selective"
    return f"full/{model.recompute_method}/{model.recompute_num_layers or 1}"


def _mlp_settings(run, chunks):
    if chunks == MLP_PER_HIDDEN:
        tokens = run.training.micro_batch_size * run.data.seq_length \
            // run.parallel.context_parallel_size
        chunks = max(2, -(-tokens // run.model.hidden_size))
    return {"model": {"mlp_chunks_for_training": chunks}}


# --optimizer-offload-fraction values tried (a trade-off: the host's Adam step costs time
# whatever else the run saves, so each is its own family rather than a rung of a ladder)
OFFLOAD_FRACTIONS = (0.5, 1.0)
# Megatron-FSDP's optim_grads_params: the same FSDP2 sharding as --use-torch-fsdp2 here, and
# the one FSDP Megatron-LM builds the precision-aware optimizer (which the optimizer on the
# host needs) with
MEGATRON_FSDP = {"use_torch_fsdp2": False, "use_megatron_fsdp": True,
                 "data_parallel_sharding_strategy": "optim_grads_params"}


def _optimizer_offload_ladders(run, context):
    if context.device != "gpu" or not context.host_limited:
        return [[0.0]]  # the host is the device's memory, or no host limit to plan against
    return [[0.0]] + [[fraction] for fraction in OFFLOAD_FRACTIONS]


def _optimizer_offload_settings(run, fraction):
    """--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction
    ``fraction`` (0: off); an FSDP2 run becomes Megatron-FSDP's optim_grads_params."""
    if not fraction:
        return {}
    optimizer = {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True,
                 "optimizer_offload_fraction": fraction}
    if run.optimizer.use_torch_fsdp2:
        return {"optimizer": {**optimizer, **MEGATRON_FSDP},
                "checkpoint": {"ckpt_format": "fsdp_dtensor"}}
    return {"optimizer": optimizer}


def _offload_ladders(run, context):
    if context.device != "gpu" or not context.host_limited:
        return [[0]]  # nothing to offload to, or no host limit to plan it against
    return [list(range(run.model.num_layers))]


LEVERS = [
    Lever("cp_comm_type", ("cp_comm_type", "hierarchical_context_parallel_sizes"),
          _cp_comm_ladders, _cp_comm_settings, _cp_comm_check, saving=False),
    Lever("optimizer", ("use_distributed_optimizer", "use_torch_fsdp2", "use_megatron_fsdp",
                        "data_parallel_sharding_strategy", "overlap_param_gather",
                        "num_distributed_optimizer_instances",
                        "torch_fsdp2_no_reshard_after_forward"),
          lambda run, context: [[name] for name in OPTIMIZERS],
          lambda run, name: {"optimizer": OPTIMIZERS[name]}, _optimizer_check, saving=False),
    Lever("tiled_logits_chunk_size", ("tiled_logits_chunk_size",),
          lambda run, context: [[0], list(LOGITS_CHUNKS)],
          lambda run, chunk: {"model": {"tiled_logits_chunk_size": chunk}}),
    Lever("mlp_chunks_for_training", ("mlp_chunks_for_training",),
          lambda run, context: [[1], [MLP_PER_HIDDEN]], _mlp_settings),
    Lever("recompute", ("recompute_granularity", "recompute_method", "recompute_num_layers"),
          _recompute_ladders, _recompute_settings),
    Lever("cpu_offloading_num_layers", ("cpu_offloading_num_layers",), _offload_ladders,
          lambda run, layers: {"model": {"cpu_offloading_num_layers": layers}}),
    Lever("optimizer_offload_fraction", ("optimizer_cpu_offload", "optimizer_offload_fraction",
                                         "use_precision_aware_optimizer"),
          _optimizer_offload_ladders, _optimizer_offload_settings, _optimizer_check,
          saving=False),
]


def open_levers(given):
    """The levers of :data:`LEVERS` whose settings the command line (``given``: the dests
    it sets) leaves open."""
    return [lever for lever in LEVERS if not set(lever.dests) & given]
