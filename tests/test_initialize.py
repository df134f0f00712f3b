"""The rank grid: golden tables, invariants at thousands of ranks, validation, SLURM start-up."""
import pytest
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.initialize import (DEFAULT_RANK_ORDER, GROUP_NAMES, TP_PP_DP_RANK_ORDER,
                                    distributed_env, expand_slurm_nodelist,
                                    initialize_model_parallel, rank_layout, rank_order)

GOLDEN_8_TP2_CP2_PP2 = {  # world 8: DP=1
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "etp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "edp": [[0, 1, 2, 3], [4, 5, 6, 7]],
}

# world 16: TP=2, CP=2, PP=2, DP=2 in both of Megatron-LM's rank orders (its RankGenerator
# gives these lists). Default tp-cp-ep-dp-pp: rank = ((pp*DP + dp)*CP + cp)*TP + tp, a stage
# is 8 consecutive ranks.
GOLDEN_16_DP2_PP_OUTER = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "mp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
    "embedding": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    # EP = ETP = 1 (dense): the expert-DP group is the whole stage
    "etp": [[r] for r in range(16)],
    "ep": [[r] for r in range(16)],
    "edp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
}
# --use-tp-pp-dp-mapping, tp-cp-ep-pp-dp: rank = ((dp*PP + pp)*CP + cp)*TP + tp, a DP
# replica is 8 consecutive ranks. EP=2 x ETP=2 = TP x CP (Megatron's rule for this order).
GOLDEN_16_DP2_DP_OUTER_EP2_ETP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_cp": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "mp": [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "edp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
}
# The same 16 ranks with EP=4, ETP=1: the EP group is a stage's TP x CP block in both
# orders; the expert-DP group pairs the blocks of the two DP replicas.
GOLDEN_16_DP2_EP4_PP_OUTER = {
    "etp": [[r] for r in range(16)],
    "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
}
GOLDEN_16_DP2_EP4_DP_OUTER = dict(
    GOLDEN_16_DP2_EP4_PP_OUTER,
    edp=[[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]])

GOLDEN_16_TP4_CP2_ETP2_EP2 = {  # world 16: TP=4, CP=2, PP=1, DP=2, EP=2, ETP=2
    "cp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "edp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
}


@pytest.mark.parametrize("world,sizes,order,golden", [
    (8, (2, 2, 2, 1, 1), DEFAULT_RANK_ORDER, GOLDEN_8_TP2_CP2_PP2),
    (8, (2, 2, 2, 2, 2), TP_PP_DP_RANK_ORDER, {  # DP = 1: both orders agree
        k: v for k, v in GOLDEN_8_TP2_CP2_PP2.items() if k not in ("etp", "ep", "edp")}),
    (16, (2, 2, 2, 1, 1), DEFAULT_RANK_ORDER, GOLDEN_16_DP2_PP_OUTER),
    (16, (2, 2, 2, 2, 2), TP_PP_DP_RANK_ORDER, GOLDEN_16_DP2_DP_OUTER_EP2_ETP2),
    (16, (2, 2, 2, 4, 1), DEFAULT_RANK_ORDER, GOLDEN_16_DP2_EP4_PP_OUTER),
    (16, (2, 2, 2, 4, 1), TP_PP_DP_RANK_ORDER, GOLDEN_16_DP2_EP4_DP_OUTER),
    (16, (4, 2, 1, 2, 2), DEFAULT_RANK_ORDER, GOLDEN_16_TP4_CP2_ETP2_EP2),
    (16, (4, 2, 1, 2, 2), TP_PP_DP_RANK_ORDER, GOLDEN_16_TP4_CP2_ETP2_EP2),  # PP = 1: the same
])
def test_golden_tables(world, sizes, order, golden):
    layout = rank_layout(world, *sizes, order=order)
    for name, expected in golden.items():
        assert sorted(layout[name]) == sorted(expected), name


def test_default_order_is_megatron_lms_and_the_flag_selects_the_other():
    assert rank_order(False) == DEFAULT_RANK_ORDER == "tp-cp-ep-dp-pp"
    assert rank_order(True) == TP_PP_DP_RANK_ORDER == "tp-cp-ep-pp-dp"
    assert rank_layout(16, 2, 2, 2) == rank_layout(16, 2, 2, 2, order=DEFAULT_RANK_ORDER)


def test_dp_outer_order_refuses_expert_dp_unlike_dp():
    """Megatron-LM's rule for tp-pp-dp with PP > 1: EP x ETP = TP x CP (the attention and MoE
    layers' data-parallel sizes agree), dense models included (ETP defaults to TP)."""
    with pytest.raises(ValueError, match=r"needs expert_model_parallel_size \(1\) x "
                                         r"expert_tensor_parallel_size \(1\) = "
                                         r"tensor_model_parallel_size \(2\) x "
                                         r"context_parallel_size \(2\)"):
        rank_layout(16, 2, 2, 2, order=TP_PP_DP_RANK_ORDER)
    rank_layout(16, 2, 2, 1, order=TP_PP_DP_RANK_ORDER)  # PP = 1: the orders coincide
    with pytest.raises(ValueError, match="rank order 'dp-pp' is not one of"):
        rank_layout(8, order="dp-pp")


@pytest.mark.parametrize("order,world,tp,cp,pp,ep,etp", [
    (DEFAULT_RANK_ORDER, 4096, 8, 4, 8, 8, 1), (DEFAULT_RANK_ORDER, 2048, 4, 2, 4, 16, 2),
    (DEFAULT_RANK_ORDER, 1536, 8, 2, 3, 4, 4), (DEFAULT_RANK_ORDER, 1024, 1, 1, 1, 64, 1),
    (TP_PP_DP_RANK_ORDER, 4096, 8, 4, 8, 32, 1), (TP_PP_DP_RANK_ORDER, 2048, 4, 2, 4, 4, 2),
    (TP_PP_DP_RANK_ORDER, 1536, 8, 2, 3, 4, 4), (TP_PP_DP_RANK_ORDER, 1024, 1, 1, 1, 64, 1)])
def test_thousands_of_ranks(order, world, tp, cp, pp, ep, etp):
    layout = rank_layout(world, tp, cp, pp, ep, etp, order=order)
    dp = world // (tp * cp * pp)
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "dp_cp": dp * cp, "tp_cp": tp * cp,
             "mp": tp * pp, "ep": ep, "etp": etp, "edp": world // (pp * ep * etp)}
    for name, size in sizes.items():  # a partition of the world into equal groups
        assert all(len(g) == size for g in layout[name]), name
        assert sorted(r for g in layout[name] for r in g) == list(range(world)), name

    pp_outer = order == DEFAULT_RANK_ORDER

    def coords(r):  # the order's formula, innermost axis first
        outer = r // (tp * cp)
        return {"tp": r % tp, "cp": r // tp % cp,
                "pp": outer // dp if pp_outer else outer % pp,
                "dp": outer % dp if pp_outer else outer // pp}
    vary = {"tp": {"tp"}, "cp": {"cp"}, "pp": {"pp"}, "dp": {"dp"}, "dp_cp": {"dp", "cp"},
            "tp_cp": {"tp", "cp"}, "mp": {"tp", "pp"}}
    for name, axes in vary.items():  # members differ exactly along the group's own axes
        for group in layout[name][:: max(1, len(layout[name]) // 50)]:
            c0 = coords(group[0])
            for r in group:
                assert all(coords(r)[a] == c0[a] for a in c0 if a not in axes), (name, group)
            assert group == sorted(group) or name in ("dp_cp",), (name, group)
    # the formula, checked on the first and last groups
    assert layout["tp"][-1] == list(range(world - tp, world))
    stride = tp * cp if pp_outer else tp * cp * pp
    assert layout["dp"][0] == [d * stride for d in range(dp)]
    # embedding: first and last stage; expert groups stay inside one stage, ETP innermost
    for g in layout["embedding"]:
        assert [coords(r)["pp"] for r in g] == ([0, pp - 1] if pp > 1 else [0])
    for name in ("ep", "etp", "edp", "ep_etp"):
        for g in layout[name]:
            assert len({coords(r)["pp"] for r in g}) == 1
    assert layout["etp"][0] == list(range(etp))


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=6, tensor_model_parallel_size=4), r"world_size \(6\) must be divisible"),
    (dict(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=3),
     r"expert_model_parallel_size \(3\)"),
    (dict(world_size=8, context_parallel_size=0), r"context_parallel_size \(0\) must be"),
])
def test_bad_sizes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_layout(**kwargs)


def test_slurm_nodelist_and_env():
    assert expand_slurm_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_slurm_nodelist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert expand_slurm_nodelist("gpu-[098-100]x") == ["gpu-098", "gpu-099", "gpu-100", "x"]
    env = distributed_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "node[07-08]"})
    assert env == {"rank": 5, "world_size": 16, "local_rank": 1, "master_addr": "node07",
                   "master_port": 29500}
    env = distributed_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3",
                           "MASTER_ADDR": "h", "MASTER_PORT": "1234", "SLURM_PROCID": "0"})
    assert env["rank"] == 3 and env["master_addr"] == "h" and env["master_port"] == 1234


def _state_agrees(rank, world):
    """Every rank's groups, in both rank orders (TP=2, PP=2, DP=2, EP=2: the orders differ)."""
    for order in (DEFAULT_RANK_ORDER, TP_PP_DP_RANK_ORDER):
        state = initialize_model_parallel(tensor_model_parallel_size=2,
                                          pipeline_model_parallel_size=2,
                                          expert_model_parallel_size=2, order=order)
        layout = rank_layout(world, 2, 1, 2, 2, order=order)
        assert state.order == order
        for name in GROUP_NAMES:
            ranks = state.group_ranks(name)
            assert ranks in layout[name] and rank in ranks
            assert dist.get_process_group_ranks(state.group(name)) == ranks
            assert state.rank(name) == ranks.index(rank) == dist.get_rank(state.group(name))
            assert state.size(name) == len(ranks)
    return rank


def test_initialize_model_parallel_agrees_with_layout():
    assert run_workers(_state_agrees, 8) == list(range(8))
