"""The parallel layouts a training command line leaves open, as checked runs.

A dimension the command line sets itself (``--tensor-model-parallel-size 2``,
``--num-virtual-stages-per-pipeline-rank 2`` ...) stays as given; the others are searched:
TP (with sequence parallelism), CP, PP, VP (1 or 2 virtual stages) and EP (MoE models). DP
is what is left of the GPU count. Each candidate's flags go through
:func:`megatron_cp.cli.arguments.parse_args` for the GPU count, so a layout the validation
refuses is never planned. The settings that are not parallel sizes (CP comm type, optimizer
sharding, recompute, tiling, offloading) are the search's levers (``levers.py``).

The planner needs only the model, batch and precision flags: what a training line must
also give (data, an iteration count, a learning rate) and changes nothing the planner
predicts is filled in with :data:`PLANNER_DEFAULTS` when missing.
"""
import itertools

from megatron_cp.checkpoint.use_checkpoint_args import given_on_command_line
from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.planning.memory import tokenizer_vocab_size

# the arguments each searched parallel dimension owns (given on the command line: not searched)
DIMENSIONS = {
    "tp": ("tensor_model_parallel_size",),
    "cp": ("context_parallel_size",),
    "pp": ("pipeline_model_parallel_size", "pipeline_model_parallel_layout"),
    "vp": ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"),
    "ep": ("expert_model_parallel_size",),
}
# (the dests that make a default unneeded, the flags the planner adds without them): the
# training line's required parts that change no prediction; the mock dataset stands in for
# a --data-path, whose files the planner never reads (they need not exist where it runs)
PLANNER_DEFAULTS = (
    (("mock_data", "fim_data"), ["--mock-data"]),
    (("train_iters", "train_samples"), ["--train-iters", "1"]),
    (("lr",), ["--lr", "1e-4"]),
)


def given_dests(argv):
    """The argument names the training flags ``argv`` set themselves."""
    return given_on_command_line(build_parser(), argv)


def with_planner_defaults(argv):
    """``argv`` with :data:`PLANNER_DEFAULTS` added where it gives none of their flags."""
    given, out = given_dests(argv), list(argv)
    for dests, flags in PLANNER_DEFAULTS:
        if not given & set(dests):
            out += flags
    return out


def run_config(args, vocab_size=None):
    """The :class:`RunConfig` of checked arguments ``args`` (:func:`parse_args`), with the
    vocabulary of the tokenizer they name (``vocab_size`` when known already)."""
    return RunConfig.from_args(args, vocab_size or tokenizer_vocab_size(
        build_config(DataConfig, args)))


def open_dimensions(given):
    """The names of :data:`DIMENSIONS` that the command line (``given``: the dests it sets)
    leaves open."""
    return {dim for dim, dests in DIMENSIONS.items() if not given & set(dests)}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_argvs(argv, num_gpus, open_dims, num_experts, given):
    """``argv`` with the flags of every layout of the open dimensions whose sizes divide
    ``num_gpus`` (None: the dimension as the command line gives it)."""
    tps = _divisors(num_gpus) if "tp" in open_dims else [None]
    cps = _divisors(num_gpus) if "cp" in open_dims else [None]
    pps = _divisors(num_gpus) if "pp" in open_dims else [None]
    vps = [1, 2] if "vp" in open_dims else [None]
    eps = [e for e in _divisors(num_gpus) if num_experts and num_experts % e == 0] \
        if "ep" in open_dims and num_experts else [None]
    for tp, cp, pp, vp, ep in itertools.product(tps, cps, pps, vps, eps):
        if num_gpus % ((tp or 1) * (cp or 1) * (pp or 1)):
            continue
        if pp is not None and vp == 2 and pp == 1:
            continue  # virtual stages need a pipeline
        extra = []
        if tp is not None:
            extra += ["--tensor-model-parallel-size", str(tp)]
            if tp > 1 and "sequence_parallel" not in given:
                extra += ["--sequence-parallel"]
        if cp is not None:
            extra += ["--context-parallel-size", str(cp)]
        if pp is not None:
            extra += ["--pipeline-model-parallel-size", str(pp)]
        if vp is not None and vp > 1:
            extra += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
        if ep is not None:
            extra += ["--expert-model-parallel-size", str(ep)]
        yield argv + extra


def layout_runs(argv, num_gpus, given):
    """The :class:`RunConfig` of every parallel layout of the training flags ``argv`` on
    ``num_gpus`` ranks (the open dimensions searched; ``given``: the dests ``argv`` sets)
    that the argument validation accepts; the tokenizer is built once, for the first."""
    open_dims = open_dimensions(given)
    num_experts = build_parser().parse_known_args(argv)[0].num_experts \
        if "ep" in open_dims else None
    vocab_size = None
    for candidate in _layout_argvs(list(argv), num_gpus, open_dims, num_experts, given):
        try:
            args = parse_args(candidate, world_size=num_gpus)
        except ValueError:
            continue  # the validation refuses this layout
        run = run_config(args, vocab_size)
        vocab_size = run.model.vocab_size
        yield run
