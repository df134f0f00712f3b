"""Which TP, CP, PP, DP, EP, and which recompute, tiling, offloading and optimizer sharding,
for this model on these GPUs, and how long a sequence?

Takes the model, batch and precision flags of pretrain_gpt.py (parsed by its own parser: the
line you would train with is accepted as is; data, iterations and learning rate may be left
out) plus the machine:

    python tools/plan_layout.py <pretrain_gpt.py flags> --num-gpus 8 --gpu-memory-gb 80 \
        [--host-memory-gb 2048 --gpus-per-node 8] [--longest] [--device gpu|cpu] \
        [--json] [--top 20]

and prints one row per parallel layout the flags leave open that the argument validation
accepts, with the lever settings the search picks for it (megatron_cp.planning.search): by
default the fastest that fits at --seq-length (those that fit first, fastest first); with
--longest the fastest at the longest sequence the layout trains at (longest first). Each row
has the predicted peak memory of the most loaded rank (megatron_cp.planning.memory), the
host memory of the fullest node, the step time (megatron_cp.planning.step_time), the
longest sequence and the term that limits it. ``--device cpu`` predicts gloo CPU processes
(each with --gpu-memory-gb of memory), measuring this machine's throughput once (cached
under --calibration-cache); ``--device gpu`` uses the documented H100 defaults unless a GPU
is here to measure, and the rate flags override either. ``--json`` prints
``{"layouts": [...]}``. A mistake prints ``error: ...`` lines, all at once, and exits 2.
"""
import argparse
import json
import sys

from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.cli.check_args import USAGE_ERROR, error_lines
from megatron_cp.distributed.device import accelerator_available
from megatron_cp.planning.layouts import given_dests, layout_runs, with_planner_defaults
from megatron_cp.planning.levers import open_levers
from megatron_cp.planning.search import Limits, plan_layouts
from megatron_cp.planning.step_time import DEFAULT_CACHE, GPU_DEFAULTS, DeviceRates, calibrate

GIB = 2 ** 30


class _Refusal(Exception):
    """argparse's own error, raised instead of exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refusal(message)


# (flag, converter, accepted, what it must be); every value is read as text and converted
# here, so that every bad value is reported at once
_NUMBERS = (
    ("--num-gpus", int, lambda v: v >= 1, "a whole number of ranks, at least 1"),
    ("--gpu-memory-gb", float, lambda v: v > 0, "the memory of one rank in GiB, above 0"),
    ("--host-memory-gb", float, lambda v: v > 0, "the host memory of one node in GiB, above 0"),
    ("--gpus-per-node", int, lambda v: v >= 1, "a whole number, at least 1"),
    ("--top", int, lambda v: v >= 1, "a whole number of rows, at least 1"),
    ("--matmul-tflops", float, lambda v: v > 0, "above 0"),
    ("--attention-tflops", float, lambda v: v > 0, "above 0"),
    ("--intra-node-bandwidth-gbs", float, lambda v: v > 0, "above 0"),
    ("--inter-node-bandwidth-gbs", float, lambda v: v > 0, "above 0"),
    ("--host-bandwidth-gbs", float, lambda v: v > 0, "above 0"),
)
_REQUIRED = ("--num-gpus", "--gpu-memory-gb")
_WHAT = {flag: what for flag, _, _, what in _NUMBERS}


def planner_parser():
    p = _Parser(description=__doc__.split("\n")[0], add_help=True, allow_abbrev=False)
    p.add_argument("--num-gpus", help="Ranks the job will have (required).")
    p.add_argument("--gpu-memory-gb",
                   help="Memory of one rank in GiB: the cap the layouts must fit under (required).")
    p.add_argument("--host-memory-gb",
                   help="Host memory of one node in GiB: the offloaded activations of its ranks "
                        "must fit in it. Without it nothing is offloaded.")
    p.add_argument("--gpus-per-node", default="8",
                   help="GPUs per node (default 8): the ranks that share a node's host memory "
                        "and its intra-node bandwidth.")
    p.add_argument("--longest", action="store_true",
                   help="Plan each layout at the longest sequence it trains at (longest first), "
                        "instead of at --seq-length (fastest first).")
    p.add_argument("--device", default="gpu",
                   help="gpu: NCCL ranks on GPUs; cpu: gloo CPU processes (measured here).")
    p.add_argument("--json", action="store_true", help='Print {"layouts": [...]} instead.')
    p.add_argument("--top", help="Print only the best N rows.")
    for flag, what in (("--matmul-tflops", "the matmul throughput (TFLOP/s per device)"),
                       ("--attention-tflops", "the causal attention throughput (TFLOP/s)"),
                       ("--intra-node-bandwidth-gbs", "the intra-node (NVLink) bandwidth, GB/s"),
                       ("--inter-node-bandwidth-gbs", "the inter-node (InfiniBand) bandwidth, "
                                                      "GB/s"),
                       ("--host-bandwidth-gbs", "the device <-> host copy bandwidth, GB/s per "
                                                "device (activation offloading)")):
        p.add_argument(flag, help=f"Override {what}.")
    p.add_argument("--calibration-cache", default=DEFAULT_CACHE,
                   help="JSON file caching this machine's measured throughput.")
    return p


def parse_planner_flags(argv):
    """(options, training flags, problems): the planner's own flags converted and checked,
    one problem line each."""
    try:
        opts, training_argv = planner_parser().parse_known_args(argv)
    except _Refusal as refusal:
        return None, [], [f"{refusal} (see --help)"]
    problems = []
    for flag in _REQUIRED:
        if getattr(opts, flag[2:].replace("-", "_")) is None:
            problems.append(f"{flag} is required: {_WHAT[flag]}")
    for flag, convert, accepted, what in _NUMBERS:
        name = flag[2:].replace("-", "_")
        text = getattr(opts, name)
        if text is None:
            continue
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accepted(value):
            problems.append(f"{flag} ({text}) must be {what}")
            value = None
        setattr(opts, name, value)
    if opts.device not in ("gpu", "cpu"):
        problems.append(f"--device ({opts.device}) must be gpu or cpu")
    return opts, training_argv, problems


def _given_world(argv):
    """TP x CP x PP as the training flags ``argv`` give them (1 for each not given or not
    readable): the world size that checks the line without planning a layout."""
    try:
        args, _ = build_parser(_Parser).parse_known_args(argv)
    except _Refusal:
        return 1
    return args.tensor_model_parallel_size * args.context_parallel_size \
        * args.pipeline_model_parallel_size


def training_problems(argv, world_size):
    """The problems of the training flags ``argv`` on ``world_size`` ranks, one line each."""
    try:
        parse_args(argv, world_size=world_size)
    except ValueError as error:
        return error_lines(error)
    return []


def device_rates(opts, params_dtype):
    """The throughputs the step-time model divides by, measured or documented, overridden."""
    if opts.device == "cpu":
        rates = calibrate("cpu", opts.calibration_cache, params_dtype)
    elif accelerator_available():
        rates = calibrate("cuda", opts.calibration_cache, params_dtype)
    else:
        rates = DeviceRates(**GPU_DEFAULTS)
    if opts.device == "gpu":
        rates.gpus_per_node = opts.gpus_per_node
    for flag, field, scale in (("matmul_tflops", "matmul_flops", 1e12),
                               ("attention_tflops", "attention_flops", 1e12),
                               ("intra_node_bandwidth_gbs", "intra_node_bytes_per_s", 1e9),
                               ("inter_node_bandwidth_gbs", "inter_node_bytes_per_s", 1e9),
                               ("host_bandwidth_gbs", "host_bytes_per_s", 1e9)):
        if getattr(opts, flag) is not None:
            setattr(rates, field, getattr(opts, flag) * scale)
    return rates


def _tiled(r):
    return f"{r.tiled_logits_chunk_size or '-'}/{r.mlp_chunks if r.mlp_chunks > 1 else '-'}"


# (header, width, cell of a row) of the table; the ep and host columns only when they vary
COLUMNS = [
    ("tp", 3, lambda r: r.tp), ("cp", 3, lambda r: r.cp), ("cp comm", 11, lambda r: r.cp_comm_type),
    ("pp", 3, lambda r: r.pp), ("vp", 3, lambda r: r.vp), ("dp", 4, lambda r: r.dp),
    ("ep", 3, lambda r: r.ep), ("optimizer", 13, lambda r: r.optimizer),
    ("recompute", 14, lambda r: r.recompute), ("offload", 7, lambda r: r.offload_layers),
    ("opt host", 8, lambda r: f"{r.optimizer_offload_fraction:g}"),
    ("tiled l/mlp", 11, _tiled), ("mem GiB", 7, lambda r: f"{r.memory_bytes / GIB:.2f}"),
    ("host GiB", 8, lambda r: f"{r.host_bytes / GIB:.1f}"),
    ("step s", 9, lambda r: f"{r.step_time_s:.3f}"), ("max seq", 9, lambda r: r.max_seq_length),
    ("limited by", 19, lambda r: r.limiting_term), ("fits", 4, lambda r: "yes" if r.fits else "no"),
]


def format_table(rows, limits, seq_length, longest=False):
    """The plan as a fixed-width table, one layout per line (``limits``: the
    :class:`~megatron_cp.planning.search.Limits` it was planned under)."""
    columns = [c for c in COLUMNS if (c[0] != "ep" or any(r.ep > 1 for r in rows))
               and (c[0] not in ("host GiB", "opt host") or limits.host_bytes is not None)]
    where = f"under {limits.device_bytes / GIB:.1f} GiB per rank"
    if limits.host_bytes is not None:
        where += (f" and {limits.host_bytes / GIB:.0f} GiB of host memory per node of "
                  f"{limits.gpus_per_node}")
    title = (f"layouts at their longest sequence {where} (longest first)" if longest else
             f"layouts for --seq-length {seq_length} {where} (best first)")
    head = " ".join(f"{name:>{width}}" for name, width, _ in columns)
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{cell(r):>{width}}" for _, width, cell in columns))
    return "\n".join(lines)


def _fail(problems):
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return USAGE_ERROR


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, training_argv, problems = parse_planner_flags(argv)
    if opts is None:
        return _fail(problems)
    given = given_dests(training_argv)
    training_argv = with_planner_defaults(training_argv)
    if problems:  # the line's own problems too, on the ranks its given sizes need
        return _fail(problems + training_problems(training_argv, _given_world(training_argv)))
    runs = list(layout_runs(training_argv, opts.num_gpus, given))
    if not runs:  # say why: the line's own problems on this many ranks, one line each
        return _fail(training_problems(training_argv, opts.num_gpus) or [
            f"no layout of these flags on {opts.num_gpus} ranks passes the argument "
            f"validation"])
    rates = device_rates(opts, runs[0].model.params_dtype)
    host = None if opts.host_memory_gb is None else int(opts.host_memory_gb * GIB)
    limits = Limits(int(opts.gpu_memory_gb * GIB), host, opts.gpus_per_node,
                    "cpu" if opts.device == "cpu" else "gpu")
    rows = plan_layouts(runs, open_levers(given), limits, rates, opts.longest, opts.top)
    if opts.top:
        rows = rows[:opts.top]
    if opts.json:
        print(json.dumps({"layouts": [vars(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows, limits, runs[0].data.seq_length, opts.longest))
    return 0
