"""The rank grid: golden tables, invariants at thousands of ranks, validation, SLURM start-up."""
import pytest
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.config.parallel import DEFAULT_RANK_ORDER, PP_OUTER_RANK_ORDER, RANK_ORDERS
from megatron_cp.distributed.initialize import (GROUP_NAMES, distributed_env, expand_slurm_nodelist,
                                    initialize_model_parallel, rank_layout, rank_order)

# Both orders, innermost axis first (Megatron-LM's RankGenerator gives these dense lists):
#   tp-cp-ep-pp-dp (the default, DP outermost)  rank = ((dp*PP + pp)*CP + cp)*TP + tp
#   tp-cp-ep-dp-pp (Megatron-LM's default)      rank = ((pp*DP + dp)*CP + cp)*TP + tp
# The expert mesh, in either order: a stage's ranks dp-major, then cp, then tp, re-viewed as
# EDP x EP x ETP (ETP innermost).

GOLDEN_8_TP2_CP2_PP2 = {  # world 8: DP=1, so both orders give these lists
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
    "ep_etp": [[0], [1], [2], [3], [4], [5], [6], [7]],
}
GOLDEN_8_TP2_CP2_PP2_EP2_ETP2 = dict(  # the same ranks, a stage one EP x ETP block
    GOLDEN_8_TP2_CP2_PP2,
    etp=[[0, 1], [2, 3], [4, 5], [6, 7]],
    ep=[[0, 2], [1, 3], [4, 6], [5, 7]],
    edp=[[0], [1], [2], [3], [4], [5], [6], [7]],
    ep_etp=[[0, 1, 2, 3], [4, 5, 6, 7]])

GOLDEN_4_PP2_DP2 = {  # world 4: PP=2, DP=2, the smallest grid the orders move
    "tp": [[0], [1], [2], [3]],
    "pp": [[0, 1], [2, 3]],
    "dp": [[0, 2], [1, 3]],
    "dp_cp": [[0, 2], [1, 3]],
    "mp": [[0, 1], [2, 3]],
    "embedding": [[0, 1], [2, 3]],
    "edp": [[0, 2], [1, 3]],
}
GOLDEN_4_PP2_DP2_PP_OUTER = {
    "tp": [[0], [1], [2], [3]],
    "pp": [[0, 2], [1, 3]],
    "dp": [[0, 1], [2, 3]],
    "dp_cp": [[0, 1], [2, 3]],
    "mp": [[0, 2], [1, 3]],
    "embedding": [[0, 2], [1, 3]],
    "edp": [[0, 1], [2, 3]],
}

# world 16: TP=2, CP=2, PP=2, DP=2. The default order: a DP replica is 8 consecutive ranks,
# stage 0 is ranks 0-3 and 8-11, stage 1 ranks 4-7 and 12-15.
GOLDEN_16_DP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_cp": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "mp": [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    # EP = ETP = 1 (dense): the expert-DP group is the whole stage
    "etp": [[r] for r in range(16)],
    "ep": [[r] for r in range(16)],
    "edp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
    "ep_etp": [[r] for r in range(16)],
}
GOLDEN_16_DP2_EP2_ETP2 = dict(  # EP x ETP = TP x CP: the expert-DP group is the DP group
    GOLDEN_16_DP2,
    etp=[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    ep=[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    edp=[[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    ep_etp=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
GOLDEN_16_DP2_EP4 = {  # EP=4, ETP=1: the EP group is a stage's TP x CP block
    "etp": [[r] for r in range(16)],
    "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "edp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
}
# EP x ETP unlike TP x CP: EP=2, ETP=1 (4 expert-DP ranks per stage) and EP=4, ETP=2 (an EP
# group that spans the two DP replicas).
GOLDEN_16_DP2_EP2 = {
    "etp": [[r] for r in range(16)],
    "ep": [[0, 1], [2, 3], [8, 9], [10, 11], [4, 5], [6, 7], [12, 13], [14, 15]],
    "edp": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
    "ep_etp": [[0, 1], [2, 3], [8, 9], [10, 11], [4, 5], [6, 7], [12, 13], [14, 15]],
}
GOLDEN_16_DP2_EP4_ETP2 = {
    "etp": [[0, 1], [2, 3], [8, 9], [10, 11], [4, 5], [6, 7], [12, 13], [14, 15]],
    "ep": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
    "edp": [[r] for r in range(16)],
    "ep_etp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
}

# The same 16 ranks in Megatron-LM's order: a stage is 8 consecutive ranks.
GOLDEN_16_DP2_PP_OUTER = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "mp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
    "embedding": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "etp": [[r] for r in range(16)],
    "ep": [[r] for r in range(16)],
    "edp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
    "ep_etp": [[r] for r in range(16)],
}
GOLDEN_16_DP2_EP4_PP_OUTER = dict(
    GOLDEN_16_DP2_EP4,
    edp=[[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]])
GOLDEN_16_DP2_EP4_ETP2_PP_OUTER = {
    "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "edp": [[r] for r in range(16)],
    "ep_etp": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
}

GOLDEN_16_TP4_CP2_ETP2_EP2 = {  # world 16: TP=4, CP=2, PP=1, DP=2, EP=2, ETP=2
    "cp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "edp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
}

DP_OUTER, PP_OUTER = DEFAULT_RANK_ORDER, PP_OUTER_RANK_ORDER


@pytest.mark.parametrize("world,sizes,order,golden", [
    (8, (2, 2, 2, 1, 1), DP_OUTER, GOLDEN_8_TP2_CP2_PP2),
    (8, (2, 2, 2, 1, 1), PP_OUTER, GOLDEN_8_TP2_CP2_PP2),  # DP = 1: the orders agree
    (8, (2, 2, 2, 2, 2), DP_OUTER, GOLDEN_8_TP2_CP2_PP2_EP2_ETP2),
    (8, (2, 2, 2, 2, 2), PP_OUTER, GOLDEN_8_TP2_CP2_PP2_EP2_ETP2),
    (4, (1, 1, 2, 1, 1), DP_OUTER, GOLDEN_4_PP2_DP2),
    (4, (1, 1, 2, 1, 1), PP_OUTER, GOLDEN_4_PP2_DP2_PP_OUTER),
    (16, (2, 2, 2, 1, 1), DP_OUTER, GOLDEN_16_DP2),
    (16, (2, 2, 2, 2, 2), DP_OUTER, GOLDEN_16_DP2_EP2_ETP2),
    (16, (2, 2, 2, 4, 1), DP_OUTER, GOLDEN_16_DP2_EP4),
    (16, (2, 2, 2, 2, 1), DP_OUTER, GOLDEN_16_DP2_EP2),
    (16, (2, 2, 2, 4, 2), DP_OUTER, GOLDEN_16_DP2_EP4_ETP2),
    (16, (2, 2, 2, 1, 1), PP_OUTER, GOLDEN_16_DP2_PP_OUTER),
    (16, (2, 2, 2, 4, 1), PP_OUTER, GOLDEN_16_DP2_EP4_PP_OUTER),
    (16, (2, 2, 2, 4, 2), PP_OUTER, GOLDEN_16_DP2_EP4_ETP2_PP_OUTER),
    (16, (4, 2, 1, 2, 2), DP_OUTER, GOLDEN_16_TP4_CP2_ETP2_EP2),
    (16, (4, 2, 1, 2, 2), PP_OUTER, GOLDEN_16_TP4_CP2_ETP2_EP2),  # PP = 1: the same
])
def test_golden_tables(world, sizes, order, golden):
    layout = rank_layout(world, *sizes, order=order)
    for name, expected in golden.items():
        assert sorted(layout[name]) == sorted(expected), name


def test_default_order_is_the_design_cards_and_a_flag_selects_megatron_lms():
    assert rank_order() == DEFAULT_RANK_ORDER == "tp-cp-ep-pp-dp"
    assert rank_order(None, use_tp_pp_dp_mapping=True) == DEFAULT_RANK_ORDER
    assert rank_order(DEFAULT_RANK_ORDER, use_tp_pp_dp_mapping=True) == DEFAULT_RANK_ORDER
    assert rank_order("tp-cp-ep-dp-pp") == PP_OUTER_RANK_ORDER
    with pytest.raises(ValueError, match="use_tp_pp_dp_mapping selects rank order "
                                         "tp-cp-ep-pp-dp but rank_order is tp-cp-ep-dp-pp"):
        rank_order(PP_OUTER_RANK_ORDER, use_tp_pp_dp_mapping=True)
    with pytest.raises(ValueError, match="rank_order 'dp-pp' is not one of"):
        rank_order("dp-pp")
    assert rank_layout(16, 2, 2, 2) == rank_layout(16, 2, 2, 2, order=DEFAULT_RANK_ORDER)


@pytest.mark.parametrize("order", RANK_ORDERS)
def test_any_expert_mesh_that_divides_a_stage_fits_either_order(order):
    """No EP / ETP size is refused for the order alone (TP=2, CP=2, PP=2, DP=2: 8 ranks a
    stage); only an EP x ETP that does not divide a stage's ranks is."""
    for ep, etp in [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (8, 1), (4, 2), (1, 8)]:
        layout = rank_layout(16, 2, 2, 2, ep, etp, order=order)
        assert all(len(group) == 8 // (ep * etp) for group in layout["edp"])
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(16\) x "
                                         r"expert_tensor_parallel_size \(1\) = 16 must divide "
                                         r"the data x context x tensor parallel ranks of a "
                                         r"pipeline stage \(8\)"):
        rank_layout(16, 2, 2, 2, 16, 1, order=order)
    with pytest.raises(ValueError, match="rank order 'dp-pp' is not one of"):
        rank_layout(8, order="dp-pp")


@pytest.mark.parametrize("order", RANK_ORDERS)
@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", [
    (4096, 8, 4, 8, 8, 1), (4096, 8, 4, 8, 32, 1), (2048, 4, 2, 4, 16, 2), (2048, 4, 2, 4, 4, 2),
    (1536, 8, 2, 3, 4, 4), (1024, 1, 1, 1, 64, 1)])
def test_thousands_of_ranks(order, world, tp, cp, pp, ep, etp):
    layout = rank_layout(world, tp, cp, pp, ep, etp, order=order)
    dp = world // (tp * cp * pp)
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "dp_cp": dp * cp, "tp_cp": tp * cp,
             "mp": tp * pp, "ep": ep, "etp": etp, "edp": world // (pp * ep * etp)}
    for name, size in sizes.items():  # a partition of the world into equal groups
        assert all(len(g) == size for g in layout[name]), name
        assert sorted(r for g in layout[name] for r in g) == list(range(world)), name

    pp_outer = order == PP_OUTER_RANK_ORDER

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
    def expert_coords(r):  # the rank's place in its stage, dp-major, re-viewed EDP x EP x ETP
        c = coords(r)
        place = (c["dp"] * cp + c["cp"]) * tp + c["tp"]
        return {"pp": c["pp"], "etp": place % etp, "ep": place // etp % ep,
                "edp": place // (ep * etp)}
    expert_vary = {"etp": {"etp"}, "ep": {"ep"}, "edp": {"edp"}, "ep_etp": {"ep", "etp"}}
    for name, axes in expert_vary.items():
        for group in layout[name][:: max(1, len(layout[name]) // 50)]:
            c0 = expert_coords(group[0])
            for i, r in enumerate(group):
                assert all(expert_coords(r)[a] == c0[a] for a in c0 if a not in axes), (name, group)
                if name != "ep_etp":  # members in group-rank order
                    assert expert_coords(r)[name] == i, (name, group)
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
    """Every rank's groups, in both rank orders (TP=2, PP=2, DP=2, EP=4: the orders differ,
    and EP x ETP is not TP x CP)."""
    for order in RANK_ORDERS:
        state = initialize_model_parallel(tensor_model_parallel_size=2,
                                          pipeline_model_parallel_size=2,
                                          expert_model_parallel_size=4, order=order)
        layout = rank_layout(world, 2, 1, 2, 4, order=order)
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
