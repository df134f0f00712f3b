"""Which TP, CP, PP, DP, EP and recompute for this model on these GPUs, and how long a sequence?

Takes the same flags as pretrain_gpt.py (parsed by its own parser, so the line you would train
with is accepted as is) plus the machine:

    python tools/plan_layout.py <pretrain_gpt.py flags> --num-gpus 8 --gpu-memory-gb 80 \
        [--device gpu|cpu] [--json] [--top 20]

and prints every layout the flags leave open that the argument validation accepts, best first
(those that fit, fastest first): the predicted peak memory of the most loaded rank
(megatron_cp.planning.memory), the predicted step time (megatron_cp.planning.step_time), the
longest sequence that fits in --gpu-memory-gb, and whether the given --seq-length fits.
``--device cpu`` predicts gloo CPU processes (each with --gpu-memory-gb of memory), measuring
this machine's throughput once (cached under --calibration-cache); ``--device gpu`` uses the
documented H100 defaults unless a GPU is here to measure, and the rate flags override either.
``--json`` prints ``{"layouts": [...]}``.
"""
import argparse
import json
import sys

import torch

from megatron_cp.distributed.device import accelerator_available
from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.checkpoint.use_checkpoint_args import given_on_command_line
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.planning.memory import tokenizer_vocab_size
from megatron_cp.planning.search import plan_layouts
from megatron_cp.planning.step_time import DEFAULT_CACHE, GPU_DEFAULTS, DeviceRates, calibrate

GIB = 2 ** 30
# the arguments each open dimension owns (given on the command line: not searched)
DIMENSIONS = {
    "tp": ("tensor_model_parallel_size",),
    "cp": ("context_parallel_size", "cp_comm_type"),
    "pp": ("pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
           "num_virtual_stages_per_pipeline_rank"),
    "ep": ("expert_model_parallel_size",),
    "recompute": ("recompute_granularity", "recompute_method", "recompute_num_layers"),
    "distributed_optimizer": ("use_distributed_optimizer",),
}


def planner_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True,
                                allow_abbrev=False)
    p.add_argument("--num-gpus", type=int, required=True, help="Ranks the job will have.")
    p.add_argument("--gpu-memory-gb", type=float, required=True,
                   help="Memory of one rank in GiB (the cap the layouts must fit under).")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: NCCL ranks on GPUs; cpu: gloo CPU processes (measured here).")
    p.add_argument("--json", action="store_true", help='Print {"layouts": [...]} instead.')
    p.add_argument("--top", type=int, default=None, help="Print only the best N rows.")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: groups within one use the intra-node bandwidth.")
    p.add_argument("--matmul-tflops", type=float, default=None,
                   help="Override the matmul throughput (TFLOP/s per device).")
    p.add_argument("--attention-tflops", type=float, default=None,
                   help="Override the causal attention throughput (TFLOP/s per device).")
    p.add_argument("--intra-node-bandwidth-gbs", type=float, default=None,
                   help="Override the intra-node (NVLink) bandwidth, GB/s per device.")
    p.add_argument("--inter-node-bandwidth-gbs", type=float, default=None,
                   help="Override the inter-node (InfiniBand) bandwidth, GB/s per device.")
    p.add_argument("--calibration-cache", default=DEFAULT_CACHE,
                   help="JSON file caching this machine's measured throughput.")
    return p


def run_config(args, vocab_size=None):
    """The :class:`RunConfig` of checked arguments ``args`` (:func:`parse_args`), with the
    vocabulary of the tokenizer they name (``vocab_size`` when known already)."""
    return RunConfig.from_args(args, vocab_size or tokenizer_vocab_size(
        build_config(DataConfig, args)))


def open_dimensions(argv):
    """The names of :data:`DIMENSIONS` that the training flags ``argv`` leave open."""
    given = given_on_command_line(build_parser(), argv)
    return {dim for dim, dests in DIMENSIONS.items() if not given & set(dests)}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_argvs(argv, num_gpus, open_dims, num_experts):
    """``argv`` with the flags of every layout of the open dimensions whose sizes divide
    ``num_gpus``."""
    base = {"tp": [None], "cp": [(None, None)], "pp": [(None, None)], "ep": [None]}
    if "tp" in open_dims:
        base["tp"] = _divisors(num_gpus)
    if "cp" in open_dims:
        base["cp"] = [(1, None)] + [(c, t) for c in _divisors(num_gpus) if c > 1
                                    for t in ("p2p", "a2a")]
    if "pp" in open_dims:
        base["pp"] = [(1, None)] + [(p, v) for p in _divisors(num_gpus) if p > 1 for v in (1, 2)]
    if "ep" in open_dims and num_experts:
        base["ep"] = [e for e in _divisors(num_gpus) if num_experts % e == 0]
    for tp in base["tp"]:
        for cp, comm in base["cp"]:
            for pp, vp in base["pp"]:
                for ep in base["ep"]:
                    sizes = [x or 1 for x in (tp, cp, pp)]
                    if num_gpus % (sizes[0] * sizes[1] * sizes[2]):
                        continue
                    extra = []
                    if tp is not None:
                        extra += ["--tensor-model-parallel-size", str(tp)]
                        if tp > 1:
                            extra += ["--sequence-parallel"]
                    if cp is not None:
                        extra += ["--context-parallel-size", str(cp)]
                        extra += ["--cp-comm-type", comm] if comm else []
                    if pp is not None:
                        extra += ["--pipeline-model-parallel-size", str(pp)]
                        if vp and vp > 1:
                            extra += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
                    if ep is not None:
                        extra += ["--expert-model-parallel-size", str(ep)]
                    yield argv + extra


def layout_runs(argv, num_gpus, open_dims):
    """The :class:`RunConfig` of every parallel layout of the training flags ``argv`` on
    ``num_gpus`` ranks (the open dimensions searched) that the argument validation accepts;
    the tokenizer is built once, for the first."""
    num_experts = build_parser().parse_known_args(argv)[0].num_experts \
        if "ep" in open_dims else None
    vocab_size = None
    for candidate in _layout_argvs(list(argv), num_gpus, open_dims, num_experts):
        try:
            args = parse_args(candidate, world_size=num_gpus)
        except ValueError:
            continue  # the validation refuses this layout
        run = run_config(args, vocab_size)
        vocab_size = run.model.vocab_size
        yield run


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
                               ("inter_node_bandwidth_gbs", "inter_node_bytes_per_s", 1e9)):
        if getattr(opts, flag) is not None:
            setattr(rates, field, getattr(opts, flag) * scale)
    return rates


def format_table(rows, cap_bytes, seq_length):
    """The plan as a fixed-width table, one layout per line."""
    head = (f"{'tp':>3} {'cp':>3} {'cp comm':>8} {'pp':>3} {'vp':>3} {'dp':>4} {'ep':>3} "
            f"{'recompute':>16} {'dist opt':>8} {'memory GiB':>10} {'step s':>9} "
            f"{'max seq':>9} {'fits':>4}")
    lines = [f"layouts for --seq-length {seq_length} under {cap_bytes / GIB:.1f} GiB per rank "
             f"(best first)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.tp:>3} {r.cp:>3} {r.cp_comm_type:>8} {r.pp:>3} {r.vp:>3} {r.dp:>4} "
                     f"{r.ep:>3} {r.recompute:>16} {'yes' if r.distributed_optimizer else 'no':>8} "
                     f"{r.memory_bytes / GIB:>10.2f} {r.step_time_s:>9.3f} "
                     f"{r.max_seq_length:>9d} {'yes' if r.fits else 'no':>4}")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, training_argv = planner_parser().parse_known_args(argv)
    if opts.num_gpus < 1 or opts.gpu_memory_gb <= 0:
        raise SystemExit(f"error: --num-gpus ({opts.num_gpus}) must be at least 1 and "
                         f"--gpu-memory-gb ({opts.gpu_memory_gb}) above 0")
    flags, _ = build_parser().parse_known_args(training_argv)
    dtype = torch.float16 if flags.fp16 else torch.bfloat16 if flags.bf16 else torch.float32
    cap = int(opts.gpu_memory_gb * GIB)
    rates = device_rates(opts, dtype)
    open_dims = open_dimensions(training_argv)
    rows = plan_layouts(layout_runs(training_argv, opts.num_gpus, open_dims), open_dims, cap,
                        rates, opts.device)
    if not rows:  # say why: the line's own problems on this many ranks, one line each
        try:
            parse_args(training_argv, world_size=opts.num_gpus)
        except ValueError as error:
            lines = getattr(error, "lines", None) or [str(error)]
            raise SystemExit("\n".join(f"error: {line}" for line in lines))
        raise SystemExit(f"error: no layout of these flags on {opts.num_gpus} ranks passes the "
                         f"argument validation")
    if opts.top:
        rows = rows[:opts.top]
    if opts.json:
        print(json.dumps({"layouts": [vars(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows, cap, flags.seq_length))
    return 0
