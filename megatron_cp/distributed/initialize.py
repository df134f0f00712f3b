"""Distributed start-up and the rank grid.

``rank_layout`` is a pure function from sizes to the rank lists of every group;
``initialize_model_parallel`` validates the sizes, builds one torch.distributed group per
rank list and returns a :class:`ParallelState`. Ranks are laid out in one of two orders
(Megatron-LM's ``RankGenerator`` strings, innermost axis first):

    tp-cp-ep-pp-dp (the default)           rank = ((dp * PP + pp) * CP + cp) * TP + tp
    tp-cp-ep-dp-pp (--rank-order; Megatron-LM's default)
                                           rank = ((pp * DP + dp) * CP + cp) * TP + tp

TP is innermost in both (a TP group is TP consecutive ranks: one NVLink domain), then CP.
The default is the design card's: a data-parallel replica's ranks are consecutive (what
Megatron-LM's --use-tp-pp-dp-mapping selects); Megatron-LM's default keeps a pipeline
stage's ranks together instead.

The expert mesh is built inside each pipeline stage, the same way in either order: the
stage's DP x CP x TP ranks, taken dp-major, then cp, then tp (their places in the dense grid),
are re-viewed as EDP x EP x ETP, ETP innermost (groups ep, etp, edp and ep_etp, the EP x ETP
block). Any EP x ETP that divides a stage's DP x CP x TP ranks fits, in either order.
"""
import datetime
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod
from megatron_cp.config.parallel import (DEFAULT_RANK_ORDER, DP_OUTER_RANK_ORDER,
                                         PP_OUTER_RANK_ORDER, RANK_ORDERS,
                                         check_hierarchical_sizes)

GROUP_NAMES = ("tp", "cp", "pp", "dp", "dp_cp", "tp_cp", "mp", "embedding", "ep", "etp", "edp",
               "ep_etp")
HIERARCHICAL_GROUP_NAMES = ("hcp_inner", "hcp_outer")  # with hierarchical CP sizes only
# The rank orders as Megatron-LM's RankGenerator strings, innermost axis first: DP
# outermost (the design card's, our default; Megatron-LM's --use-tp-pp-dp-mapping) or PP
# outermost (Megatron-LM's default).


def rank_order(order=None, use_tp_pp_dp_mapping=False):
    """The rank order that ``rank_order`` (``order``; None: the default) and Megatron-LM's
    ``use_tp_pp_dp_mapping`` (its spelling of our default) select together."""
    order = DEFAULT_RANK_ORDER if order is None else order
    if order not in RANK_ORDERS:
        raise ValueError(f"rank_order {order!r} is not one of {list(RANK_ORDERS)}")
    if use_tp_pp_dp_mapping and order != DP_OUTER_RANK_ORDER:
        raise ValueError(f"use_tp_pp_dp_mapping selects rank order {DP_OUTER_RANK_ORDER} but "
                         f"rank_order is {order}; give one of the two")
    return order


# With K > 1 distributed-optimizer instances only: each dp_cp / edp group cut into K
# consecutive slices (intra: one instance) and the ranks at one position in every slice
# (inter: the K copies of one shard).
INSTANCE_GROUP_NAMES = ("dp_cp_intra", "dp_cp_inter", "edp_intra", "edp_inter")


def dynamic_cp_group_name(size):
    """Dynamic CP's groups of ``size`` ranks: aligned blocks of each dp_cp group."""
    return f"dcp{size}"


def dynamic_cp_sizes(dp_cp_size):
    """The CP group sizes dynamic CP runs documents on: the powers of two up to the DP x CP
    pool (1: no CP; the whole pool: the dp_cp group)."""
    return tuple(2 ** i for i in range(dp_cp_size.bit_length()) if 2 ** i <= dp_cp_size)


def _check_positive(**sizes):
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value}) must be an integer >= 1")


def validate_sizes(world_size, tensor_model_parallel_size=1, context_parallel_size=1,
                   pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                   expert_tensor_parallel_size=1, order=DEFAULT_RANK_ORDER):
    """Raise ValueError (naming the values and the fix) unless the sizes tile ``world_size``
    in rank order ``order``; returns the data-parallel size."""
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if order not in RANK_ORDERS:
        raise ValueError(f"rank order {order!r} is not one of {list(RANK_ORDERS)}")
    _check_positive(world_size=world_size, tensor_model_parallel_size=tp, context_parallel_size=cp,
                    pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=etp)
    model = tp * cp * pp
    if world_size % model != 0:
        raise ValueError(
            f"world_size ({world_size}) must be divisible by tensor_model_parallel_size ({tp}) x "
            f"context_parallel_size ({cp}) x pipeline_model_parallel_size ({pp}) = {model}; "
            f"change the parallel sizes or launch a multiple of {model} processes")
    stage = world_size // pp  # DP x CP x TP ranks inside one PP stage
    if stage % (ep * etp) != 0:
        raise ValueError(
            f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) = {ep * etp} "
            f"must divide the data x context x tensor parallel ranks of a pipeline stage ({stage}); "
            f"pick EP x ETP among the divisors of {stage}")
    return world_size // model


def _grid(world_size, order, dp, pp, cp, tp):
    """The ranks as an array ``[DP, PP, CP, TP]``, whichever of DP and PP is outermost in
    ``order``."""
    if order == PP_OUTER_RANK_ORDER:
        return np.arange(world_size).reshape(pp, dp, cp, tp).swapaxes(0, 1)
    return np.arange(world_size).reshape(dp, pp, cp, tp)


def rank_layout(world_size, tensor_model_parallel_size=1, context_parallel_size=1,
                pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, hierarchical_context_parallel_sizes=None,
                order=DEFAULT_RANK_ORDER, num_distributed_optimizer_instances=1,
                dynamic_context_parallel=False):
    """Return ``{group name: [rank list, ...]}`` for every group in rank order ``order``; no
    torch.distributed needed.

    Every rank appears in exactly one list of each name, except ``embedding`` which holds the
    first and last pipeline stage of each (dp, cp, tp) position. With
    ``hierarchical_context_parallel_sizes`` (U, R) each CP group is also cut into
    ``hcp_inner`` groups (U consecutive CP ranks: the a2a+p2p all-to-all) and ``hcp_outer``
    groups (the R CP ranks with equal cp_rank % U: its ring). With
    ``num_distributed_optimizer_instances`` K > 1 each dp_cp and edp group is cut into K
    consecutive slices (``dp_cp_intra``, ``edp_intra``: Megatron-LM's instances) and the
    ranks of one position across the slices form ``dp_cp_inter`` / ``edp_inter``. With
    ``dynamic_context_parallel`` each dp_cp group is also cut into aligned blocks of every
    power of two k between 2 and half the group (``dcp{k}``; Megatron-LM's hybrid DP x CP
    groups); the whole group is dp_cp itself.
    """
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    dp = validate_sizes(world_size, tp, cp, pp, ep, etp, order)
    grid = _grid(world_size, order, dp, pp, cp, tp)  # [DP, PP, CP, TP]

    def lists(array_2d):
        return [list(map(int, row)) for row in array_2d]

    layout = {
        # move the group's axes last, flatten the rest: one row per group
        "tp": lists(grid.reshape(-1, tp)),
        "cp": lists(grid.transpose(0, 1, 3, 2).reshape(-1, cp)),
        "pp": lists(grid.transpose(0, 2, 3, 1).reshape(-1, pp)),
        "dp": lists(grid.transpose(1, 2, 3, 0).reshape(-1, dp)),
        "dp_cp": lists(grid.transpose(1, 3, 0, 2).reshape(-1, dp * cp)),
        "tp_cp": lists(grid.reshape(dp * pp, cp * tp)),
        "mp": lists(grid.transpose(0, 2, 1, 3).reshape(dp * cp, pp * tp)),
    }
    firsts_lasts = grid[:, [0, -1]] if pp > 1 else grid[:, [0]]  # [DP, 1|2, CP, TP]
    layout["embedding"] = lists(firsts_lasts.transpose(0, 2, 3, 1).reshape(-1, firsts_lasts.shape[1]))
    # Expert mesh, inside each stage in either order: the stage's ranks dp-major, then cp,
    # then tp, re-viewed as EDP x EP x ETP (ETP innermost).
    edp = dp * cp * tp // (ep * etp)
    expert = grid.swapaxes(0, 1).reshape(pp, edp, ep, etp)  # [PP, EDP, EP, ETP]
    layout["etp"] = lists(expert.reshape(-1, etp))
    layout["ep"] = lists(expert.transpose(0, 1, 3, 2).reshape(-1, ep))
    layout["edp"] = lists(expert.transpose(0, 2, 3, 1).reshape(-1, edp))
    layout["ep_etp"] = lists(expert.reshape(-1, ep * etp))  # the allgather dispatcher's group
    if hierarchical_context_parallel_sizes is not None:
        inner, outer = check_hierarchical_sizes(hierarchical_context_parallel_sizes, cp)
        cp_groups = np.array(layout["cp"]).reshape(-1, outer, inner)  # [groups, R, U]
        layout["hcp_inner"] = lists(cp_groups.reshape(-1, inner))
        layout["hcp_outer"] = lists(cp_groups.transpose(0, 2, 1).reshape(-1, outer))
    if dynamic_context_parallel:
        pool = dp * cp
        if pool & (pool - 1):
            raise ValueError(f"dynamic context parallelism needs a power-of-two DP x CP pool; "
                             f"DP ({dp}) x CP ({cp}) = {pool}: change the sizes")
        for k in dynamic_cp_sizes(pool)[1:-1]:
            blocks = np.array(layout["dp_cp"]).reshape(-1, k)  # [groups x pool/k, k]
            layout[dynamic_cp_group_name(k)] = lists(blocks)
    instances = num_distributed_optimizer_instances
    if instances > 1:
        check_instances(instances, dp * cp, edp)
        for name in ("dp_cp", "edp"):
            slices = np.array(layout[name]).reshape(len(layout[name]), instances, -1)  # [g, K, n/K]
            layout[f"{name}_intra"] = lists(slices.reshape(-1, slices.shape[2]))
            layout[f"{name}_inter"] = lists(slices.transpose(0, 2, 1).reshape(-1, instances))
    return layout


def check_instances(instances, dp_cp_size, edp_size):
    """K distributed-optimizer instances split the DP x CP and the expert-DP ranks evenly."""
    _check_positive(num_distributed_optimizer_instances=instances)
    for size, what in ((dp_cp_size, "data-parallel x context-parallel size"),
                       (edp_size, "expert data-parallel size")):
        if size % instances != 0:
            raise ValueError(f"num_distributed_optimizer_instances ({instances}) must divide the "
                             f"{what} ({size}); pick a divisor of {size}")


def optimizer_groups(state, expert):
    """``(group name the distributed optimizer shards over, group name its shards are summed
    over across instances or None)`` for dense (``expert`` False) or expert params."""
    name = "edp" if expert else "dp_cp"
    return (f"{name}_intra", f"{name}_inter") if f"{name}_intra" in state.layout else (name, None)


@dataclass
class ParallelState:
    """Every process group, rank and size of this process, plus its device.

    Layers get the groups they need from here when they are built; nothing reads a global.
    """
    world_size: int
    global_rank: int
    device: torch.device
    sizes: dict
    layout: dict
    groups: dict = field(default_factory=dict, repr=False)
    virtual_pipeline_model_parallel_size: int | None = None
    hierarchical_context_parallel_sizes: tuple | None = None
    order: str = DEFAULT_RANK_ORDER  # the rank order of ``layout`` (RANK_ORDERS)
    dynamic_context_parallel: bool = False  # the dcp{k} groups were built

    def dynamic_cp_groups(self):
        """``{k: this rank's CP group of k ranks}`` for dynamic CP (None at k = 1; the
        dp_cp group for the whole pool); {} when the state was built without them."""
        if not self.dynamic_context_parallel:
            return {}
        pool = self.sizes["dp_cp"]
        return {k: None if k == 1 else self.group("dp_cp") if k == pool
                else self.group(dynamic_cp_group_name(k)) for k in dynamic_cp_sizes(pool)}

    def group_ranks(self, name):
        """The ranks of this process's group ``name``, in group-rank order."""
        for ranks in self.layout[name]:
            if self.global_rank in ranks:
                return ranks
        return []

    def group(self, name):
        """The torch.distributed group ``name`` this process belongs to (None if not a member)."""
        return self.groups.get(name)

    def size(self, name):
        """Size of this process's group ``name``."""
        return len(self.group_ranks(name)) if name == "embedding" else self.sizes[name]

    def rank(self, name):
        """This process's rank inside group ``name`` (-1 if not a member)."""
        ranks = self.group_ranks(name)
        return ranks.index(self.global_rank) if ranks else -1

    @property
    def is_pipeline_first_stage(self):
        return self.rank("pp") == 0

    @property
    def is_pipeline_last_stage(self):
        return self.rank("pp") == self.size("pp") - 1


def initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1,
                              pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=1,
                              virtual_pipeline_model_parallel_size=None,
                              hierarchical_context_parallel_sizes=None,
                              world_size=None, rank=None, device=None, timeout_minutes=10,
                              order=DEFAULT_RANK_ORDER,
                              num_distributed_optimizer_instances=1,
                              dynamic_context_parallel=False):
    """Validate the sizes, build one process group per rank list and return a ParallelState.

    ``order``: the rank order, one of :data:`RANK_ORDERS` (DP outermost, the design card's,
    unless given). ``torch.distributed`` must already be initialized (see
    :func:`initialize_distributed`).
    ``num_distributed_optimizer_instances``, ``dynamic_context_parallel``: see
    :func:`rank_layout`.
    """
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if hierarchical_context_parallel_sizes is not None:
        hierarchical_context_parallel_sizes = check_hierarchical_sizes(
            hierarchical_context_parallel_sizes, cp)
        if len(hierarchical_context_parallel_sizes) != 2:
            raise ValueError(f"hierarchical_context_parallel_sizes "
                             f"{list(hierarchical_context_parallel_sizes)}: give two sizes, the "
                             f"inner (all-to-all) and the outer (ring) one")
    layout = rank_layout(world_size, tp, cp, pp, ep, etp, hierarchical_context_parallel_sizes,
                         order, num_distributed_optimizer_instances, dynamic_context_parallel)
    if virtual_pipeline_model_parallel_size is not None and pp < 2:
        raise ValueError(f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) "
                         f"needs pipeline_model_parallel_size > 1 (got {pp})")
    if device is None:
        device = torch.device("cpu") if dist.get_backend() == "gloo" else \
            device_mod.device_for_local_rank(int(os.environ.get("LOCAL_RANK", 0)), "nccl")
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": world_size // (tp * cp * pp),
             "ep": ep, "etp": etp}
    sizes.update(dp_cp=sizes["dp"] * cp, tp_cp=tp * cp, mp=tp * pp,
                 edp=world_size // (pp * ep * etp), ep_etp=ep * etp)
    if hierarchical_context_parallel_sizes is not None:
        sizes.update(zip(HIERARCHICAL_GROUP_NAMES, hierarchical_context_parallel_sizes))
    sizes.update({name: len(layout[name][0]) for name in layout
                  if name in INSTANCE_GROUP_NAMES or name.startswith("dcp")})
    state = ParallelState(world_size=world_size, global_rank=rank, device=device, sizes=sizes,
                          layout=layout,
                          virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                          hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
                          order=order, dynamic_context_parallel=dynamic_context_parallel)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # Every rank must create every group, in the same order, even those it is not in.
    dynamic = tuple(n for n in layout if n.startswith("dcp"))
    for name in GROUP_NAMES + dynamic + tuple(n for n in HIERARCHICAL_GROUP_NAMES
                                              + INSTANCE_GROUP_NAMES if n in layout):
        for ranks in layout[name]:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.groups[name] = group
    return state


def set_group_timeouts(state, seconds):
    """--distributed-timeout-seconds-after-init: every process group of ``state`` and the
    default group time out after ``seconds`` from now on (Megatron-LM's update_pg_timeout,
    after the first iteration; every rank calls it, after a barrier)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    timeout = datetime.timedelta(seconds=seconds)
    for group in [dist.group.WORLD, *state.groups.values()]:
        if group is not None:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def expand_slurm_nodelist(nodelist: str):
    """Expand SLURM's compressed host list, e.g. ``a[01-03,07],b5`` -> ``[a01, a02, a03, a07, b5]``.

    Zero padding of a range is kept (``n[08-10]`` -> n08, n09, n10).
    """
    hosts = []
    for prefix, bracket in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?,?", nodelist):
        if not bracket:
            hosts.append(prefix)
            continue
        for part in bracket.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                for number in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{number:0{width}d}")
            else:
                hosts.append(prefix + part)
    return hosts


def distributed_env(environ=None):
    """Read rank, world size, local rank and master address from torchrun's or SLURM's variables.

    Returns a dict with rank, world_size, local_rank, master_addr, master_port.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                "master_port": int(env.get("MASTER_PORT", 29500))}
    if "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0)),
                "master_addr": env.get("MASTER_ADDR", expand_slurm_nodelist(nodelist)[0]),
                "master_port": int(env.get("MASTER_PORT", 29500))}
    return {"rank": 0, "world_size": 1, "local_rank": 0, "master_addr": "127.0.0.1",
            "master_port": int(env.get("MASTER_PORT", 29500))}


def initialize_distributed(backend=None, timeout_minutes=10, environ=None):
    """Start torch.distributed from torchrun's or SLURM's variables; return (rank, world, device).

    Backend defaults to nccl when CUDA is available, else gloo. A single process with no
    launcher variables still gets a one-rank process group so the same code path runs.
    """
    info = distributed_env(environ)
    backend = backend or device_mod.default_backend()
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"distributed backend {backend!r} is not supported; use 'nccl' or 'gloo'")
    device = device_mod.device_for_local_rank(info["local_rank"], backend)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
            rank=info["rank"], world_size=info["world_size"],
            timeout=datetime.timedelta(minutes=timeout_minutes))
    return info["rank"], info["world_size"], device
