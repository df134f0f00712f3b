"""Predicted seconds per training iteration: compute over the device's measured throughput,
plus the time of every collective's volume over its link, plus the pipeline bubble.

The device figures come from a calibration run (:func:`calibrate`): a few timed matmuls and
one causal attention call at a representative size, and on CPU a gloo all-reduce between two
processes, cached per device in a JSON file (``~/.cache/megatron_cp/planner_calibration.json``
unless a cache path is given). A GPU that is not here (planning a GPU job from a laptop) gets
the documented defaults of :data:`GPU_DEFAULTS`, which flags override.

Recompute adds the forward of what it reruns (every layer, a block's, or core attention),
tiled logits and a tiled MLP a forward of each chunk, activation offloading the host
copies its microbatch's compute does not hide, and the optimizer on the host its share's
copies and host Adam step.

Communication adds to compute (Megatron overlaps some of it), except the gradient reduction
under ``--overlap-grad-reduce``, hidden behind the last microbatch's backward as far as that
lasts; the figure is an upper bound that ranks layouts, not a promise.
"""
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from megatron_cp.distributed.initialize import rank_layout
from megatron_cp.planning.memory import (offloaded_activation_bytes, pipeline_layout_of,
                                         routed_tokens, stage_param_counts)

# H100 SXM, bf16: ~60% of the 989 TFLOP/s dense peak for large GEMMs, flash attention a
# little lower; NVLink 4 moves ~450 GB/s each way per GPU; an NDR InfiniBand port 50 GB/s;
# pinned copies to and from the host about half of PCIe 5 x16's 64 GB/s per direction.
GPU_DEFAULTS = {"matmul_flops": 600e12, "attention_flops": 400e12,
                "intra_node_bytes_per_s": 450e9, "inter_node_bytes_per_s": 50e9,
                "host_bytes_per_s": 25e9}
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megatron_cp",
                             "planner_calibration.json")


@dataclass
class DeviceRates:
    """Throughputs a step-time prediction divides by (FLOP/s, bytes/s)."""
    matmul_flops: float
    attention_flops: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    host_bytes_per_s: float = GPU_DEFAULTS["host_bytes_per_s"]  # device <-> host, per device


def _timed(fn, repeats):
    fn()  # warm-up: kernels chosen, memory touched
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _measure_compute(device, dtype):
    """(matmul FLOP/s, causal attention FLOP/s) of forward + backward at a representative size."""
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def matmul():
        torch.mm(a, b)
        sync()
    matmul_rate = 2 * n ** 3 / _timed(matmul, 5)
    s, heads, d = (1024, 8, 64) if device.type == "cpu" else (8192, 32, 128)
    q, k, v = (torch.randn(1, heads, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        sync()
    # causal: half of the 4 s^2 h d forward multiply-adds, x 3 for forward + backward
    flops = 3 * 0.5 * 4 * s * s * heads * d
    return matmul_rate, flops / _timed(attention, 3)


def _gloo_worker(rank, store_dir, nbytes, out_path):
    import torch.distributed as dist
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.ones(nbytes // 4)

    def all_reduce():
        dist.all_reduce(x)
    seconds = _timed(all_reduce, 5)
    if rank == 0:  # a ring all-reduce of n bytes over 2 ranks moves n bytes each way
        with open(out_path, "w") as f:
            f.write(str(nbytes / seconds))
    dist.destroy_process_group()


def _measure_gloo(nbytes=16 * 2 ** 20):
    """Bytes/s of a gloo all-reduce between two processes of this machine."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rate")
        mp.start_processes(_gloo_worker, args=(tmp, nbytes, out), nprocs=2, join=True,
                           start_method="spawn")
        with open(out) as f:
            return float(f.read())


def device_key(device):
    """The cache key of ``device``: the GPU's name, or the CPU's model and thread count."""
    if device.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{platform.processor() or 'cpu'}:{torch.get_num_threads()}"


def calibrate(device="cpu", cache_path=None, dtype=torch.float32):
    """The :class:`DeviceRates` of this machine's ``device`` ("cpu" or "cuda"), measured once
    and cached in ``cache_path`` (JSON, one entry per device key and dtype)."""
    device = torch.device(device)
    cache_path = cache_path or DEFAULT_CACHE
    key = f"{device_key(device)}:{str(dtype).replace('torch.', '')}"
    cache = {}
    if os.path.isfile(cache_path):
        with open(cache_path) as f:
            cache = json.load(f)
    if key not in cache:
        matmul, attention = _measure_compute(device, dtype)
        if device.type == "cpu":
            link = _measure_gloo()
            rates = DeviceRates(matmul, attention, link, link, gpus_per_node=1)
        else:
            rates = DeviceRates(matmul, attention, GPU_DEFAULTS["intra_node_bytes_per_s"],
                                GPU_DEFAULTS["inter_node_bytes_per_s"])
        cache[key] = asdict(rates)
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        with open(cache_path, "w") as f:
            json.dump(cache, f, indent=1)
    return DeviceRates(**cache[key])


# ----- the model -----------------------------------------------------------------------
def _layer_flops_per_token(c, number, seq_length):
    """(matmul, attention) forward FLOPs of one token through global layer ``number`` (the
    whole layer, before any split); attention is causal: half of the s x s products."""
    h, d = c.hidden_size, c.kv_channels
    swiglu = 3 if c.activation == "swiglu" else 2
    attention = 0
    if c.linear_attention_pattern()[number]:
        kd = c.linear_num_key_heads * c.linear_key_head_dim
        vd = c.linear_num_value_heads * c.linear_value_head_dim
        matmul = 2 * h * (2 * kd + 3 * vd) + 2 * 2 * kd * vd // c.linear_num_value_heads
    else:
        nh, ng = c.num_attention_heads, c.num_query_groups
        matmul = 2 * h * (nh + 2 * ng) * d + 2 * nh * d * h
        attention = 0.5 * 2 * 2 * seq_length * nh * d
    if c.moe_layer_pattern()[number]:
        matmul += 2 * h * c.num_moe_experts
        matmul += 2 * h * swiglu * c.moe_router_topk * c.moe_ffn_hidden_size
        matmul += 2 * h * swiglu * (c.moe_shared_expert_intermediate_size or 0)
    else:
        matmul += 2 * h * swiglu * c.ffn_hidden_size
    return matmul, attention


def _link(rates, span):
    """Bytes/s of a group whose ranks span ``span`` consecutive ranks."""
    if span <= rates.gpus_per_node:
        return rates.intra_node_bytes_per_s
    return rates.inter_node_bytes_per_s


def _spans(parallel):
    """``{group name: consecutive ranks its first group spans}`` in the run's rank order
    (``parallel``: its ParallelConfig; a pipeline group is TP x CP ranks apart with DP
    outermost, a stage apart with PP outermost)."""
    layout = rank_layout(parallel.world_size, parallel.tensor_model_parallel_size,
                         parallel.context_parallel_size, parallel.pipeline_model_parallel_size,
                         parallel.expert_model_parallel_size,
                         parallel.expert_tensor_parallel_size, order=parallel.rank_order)
    return {name: max(groups[0]) - min(groups[0]) + 1 for name, groups in layout.items()}


def recomputed_fraction(c, layers_per_chunk):
    """The fraction of the layers whose forward full recompute runs again: all of them
    (uniform), or the first ``recompute_num_layers`` of each model chunk of
    ``layers_per_chunk`` layers (block); 0 without full recompute."""
    if c.recompute_granularity != "full":
        return 0.0
    if c.recompute_method == "block":
        return min(c.recompute_num_layers or 1, layers_per_chunk) / layers_per_chunk
    return 1.0


def offload_seconds(run, rates, compute):
    """Seconds per microbatch that activation offloading (--cpu-offloading-num-layers) adds:
    the offloading rank's saved bytes go to the host in forward and come back in backward
    over the host link (``rates.host_bytes_per_s``), on a side stream, so only what the
    microbatch's ``compute`` seconds do not cover shows."""
    if not run.model.cpu_offloading_num_layers:
        return 0.0
    moved = max(offloaded_activation_bytes(run, "gpu", in_flight=False))
    return max(0.0, 2 * moved / rates.host_bytes_per_s - compute)


# AdamW elements per second a host steps for one GPU's share (DeepSpeed reports its
# vectorised CPU Adam at roughly 1e9 params/s on a server's cores shared by 8 GPUs: a
# stated assumption, like GPU_DEFAULTS, that ranks layouts rather than promises a time)
HOST_ADAM_PARAMS_PER_S = 1e9


def optimizer_offload_seconds(run, rates, stage_params):
    """Seconds per step that the optimizer on the host (--optimizer-cpu-offload) adds: its
    share of this rank's optimizer elements (``stage_params`` over the group the state is
    sharded over) stepped by the host's Adam, their fp32 gradients copied to the host and the
    updated params back, unoverlapped (the step waits for them)."""
    optimizer = run.optimizer
    if not optimizer.offload_fraction:
        return 0.0
    parallel = run.parallel
    sharded = optimizer.use_distributed_optimizer or optimizer.fully_sharded
    group = parallel.data_parallel_size * parallel.context_parallel_size if sharded else 1
    elements = optimizer.offload_fraction * stage_params / group
    act = torch.tensor([], dtype=run.model.params_dtype).element_size()
    return elements * (4 + act) / rates.host_bytes_per_s + elements / HOST_ADAM_PARAMS_PER_S


def predict_step_time(run, rates):
    """Seconds per iteration of ``run`` (a :class:`~megatron_cp.config.run.RunConfig` of
    checked arguments) on ``rates``."""
    c, parallel, optimizer = run.model, run.parallel, run.optimizer
    tp, cp, pp = parallel.tensor_model_parallel_size, parallel.context_parallel_size, \
        parallel.pipeline_model_parallel_size
    ep, dp = parallel.expert_model_parallel_size, parallel.data_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size or 1  # None: no virtual stages
    act = torch.tensor([], dtype=c.params_dtype).element_size()
    s, b = run.data.seq_length, run.training.micro_batch_size
    tokens = b * s // cp  # this rank's tokens of one microbatch
    layers_per_stage = c.num_layers / pp
    full = recomputed_fraction(c, layers_per_stage / vp)  # of each layer's forward, again
    matmul = attention = mlp = 0.0
    for n in range(c.num_layers):
        layer_matmul, layer_attention = _layer_flops_per_token(c, n, s)
        matmul += layer_matmul
        attention += layer_attention
        if c.mlp_chunks_for_training > 1 and not c.moe_layer_pattern()[n]:
            mlp += 2 * c.hidden_size * (3 if c.activation == "swiglu" else 2) * c.ffn_hidden_size
    # forward + backward is 3 forwards; full recompute adds that fraction of a forward, and a
    # tiled MLP runs each chunk's forward again in its backward
    matmul = (3 + full) * matmul / (tp * pp) + mlp / (tp * pp)
    selective = c.recompute_granularity == "selective"  # core attention's forward again
    attention = (3 + (1.0 if selective else full)) * attention / (tp * pp)
    # tiled logits: each chunk's logits formed again in backward
    logits = (4 if c.tiled_logits_chunk_size else 3) * 2 * c.hidden_size \
        * c.padded_vocab_size(tp) / tp
    compute = tokens * ((matmul + logits / pp) / rates.matmul_flops
                        + attention / rates.attention_flops)
    # communication of one microbatch through this rank's stage (forward + backward)
    h_bytes = tokens * c.hidden_size * act
    comm = 0.0
    spans = _spans(parallel)
    if tp > 1:  # 2 all-reduces (or all-gather + reduce-scatter) forward, 2 backward, per layer
        comm += layers_per_stage * 4 * 2 * (tp - 1) / tp * h_bytes / _link(rates, spans["tp"])
    if cp > 1:
        kv = 2 * tokens * c.num_query_groups // tp * c.kv_channels * act
        q = tokens * c.num_attention_heads // tp * c.kv_channels * act

        def volume(method):
            if method == "a2a":  # q, k, v and the output, there and back
                return 2 * (cp - 1) / cp * (2 * q + kv)
            if method == "a2a+p2p":  # the all-to-all over U ranks, then a ring over R
                inner, outer = c.hierarchical_cp_sizes(tp, cp)
                return 2 * (inner - 1) / inner * (2 * q + kv) + 3 * (outer - 1) * kv
            # all_gather: K/V gathered, dK/dV reduced; ring: K/V blocks forward, again
            # with dK/dV backward
            return 3 * (cp - 1) * kv
        # the mean over the layers of their own comm types (--cp-comm-type per layer)
        mean = sum(volume(c.layer_cp_comm_type(n)) for n in range(c.num_layers)) / c.num_layers
        comm += layers_per_stage * mean / _link(rates, spans["cp"])
    if ep > 1:
        moe_layers = sum(c.moe_layer_pattern()) / pp
        routed = routed_tokens(c, tokens, ep) * c.hidden_size * act
        comm += moe_layers * 4 * (ep - 1) / ep * routed / _link(rates, spans["ep"])
    if pp > 1:
        sent = h_bytes / tp if c.sequence_parallel else h_bytes  # [s/cp(/tp), b, h]
        comm += 2 * sent / _link(rates, spans["pp"])  # the activation and its gradient
    microbatches = run.training.num_microbatches or 1
    layout = pipeline_layout_of(run)
    stage_params = max(sum(stage_param_counts(c, layout, r, tp, ep,
                                              parallel.expert_tensor_parallel_size))
                       for r in range(pp))
    group = dp * cp
    fsdp = optimizer.fully_sharded and group > 1
    if fsdp:  # every microbatch: params gathered for forward and again for backward (in the
        # compute dtype; once with no resharding), fp32 gradients reduce-scattered
        gathers = 1 if optimizer.torch_fsdp2_no_reshard_after_forward else 2
        if optimizer.keeps_params_whole:  # optim_grads: gathered once per step
            gathers = 1 / (run.training.num_microbatches or 1)
        volume = (group - 1) / group * stage_params * (gathers * act + 4)
        comm += volume / _link(rates, spans["dp_cp"])
    per_microbatch = compute + comm + offload_seconds(run, rates, compute)
    bubble = (pp - 1) / vp * per_microbatch if pp > 1 else 0.0
    # gradient reduction over DP x CP once per step (fp32 grads; the distributed optimizer
    # reduce-scatters them and all-gathers the params: the same volume)
    grad_sync = 0.0
    if group > 1 and not fsdp:
        grad_sync = 2 * (group - 1) / group * stage_params * 4 / _link(rates, spans["dp_cp"])
        if optimizer.overlap_grad_reduce:
            # the buckets reduce during the last microbatch's backward (2/3 of its compute)
            grad_sync = max(0.0, grad_sync - 2 / 3 * compute)
    return microbatches * per_microbatch + bubble + grad_sync + \
        optimizer_offload_seconds(run, rates, stage_params)
