"""The rank grid: golden tables, invariants at thousands of ranks, validation, SLURM start-up."""
import pytest
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.initialize import (GROUP_NAMES, distributed_env, expand_slurm_nodelist,
                                    initialize_model_parallel, rank_layout)

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

GOLDEN_16_TP2_PP2_EP4 = {  # world 16: TP=2, CP=1, PP=2, DP=4, EP=4, ETP=1
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "mp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "embedding": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    # stage 0 ranks in order: 0 1 4 5 8 9 12 13 -> [EDP=2, EP=4, ETP=1]
    "ep": [[0, 1, 4, 5], [8, 9, 12, 13], [2, 3, 6, 7], [10, 11, 14, 15]],
    "edp": [[0, 8], [1, 9], [4, 12], [5, 13], [2, 10], [3, 11], [6, 14], [7, 15]],
}

GOLDEN_16_TP4_CP2_ETP2_EP2 = {  # world 16: TP=4, CP=2, PP=1, DP=2, EP=2, ETP=2
    "cp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "edp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
}


@pytest.mark.parametrize("world,sizes,golden", [
    (8, (2, 2, 2, 1, 1), GOLDEN_8_TP2_CP2_PP2),
    (16, (2, 1, 2, 4, 1), GOLDEN_16_TP2_PP2_EP4),
    (16, (4, 2, 1, 2, 2), GOLDEN_16_TP4_CP2_ETP2_EP2),
])
def test_golden_tables(world, sizes, golden):
    layout = rank_layout(world, *sizes)
    for name, expected in golden.items():
        assert sorted(layout[name]) == sorted(expected), name


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", [
    (4096, 8, 4, 8, 8, 1), (2048, 4, 2, 4, 16, 2), (1536, 8, 2, 3, 4, 4), (1024, 1, 1, 1, 64, 1)])
def test_thousands_of_ranks(world, tp, cp, pp, ep, etp):
    layout = rank_layout(world, tp, cp, pp, ep, etp)
    dp = world // (tp * cp * pp)
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "dp_cp": dp * cp, "tp_cp": tp * cp,
             "mp": tp * pp, "ep": ep, "etp": etp, "edp": world // (pp * ep * etp)}
    for name, size in sizes.items():  # a partition of the world into equal groups
        assert all(len(g) == size for g in layout[name]), name
        assert sorted(r for g in layout[name] for r in g) == list(range(world)), name

    def coords(r):
        return {"tp": r % tp, "cp": r // tp % cp, "pp": r // (tp * cp) % pp, "dp": r // (tp * cp * pp)}
    vary = {"tp": {"tp"}, "cp": {"cp"}, "pp": {"pp"}, "dp": {"dp"}, "dp_cp": {"dp", "cp"},
            "tp_cp": {"tp", "cp"}, "mp": {"tp", "pp"}}
    for name, axes in vary.items():  # members differ exactly along the group's own axes
        for group in layout[name][:: max(1, len(layout[name]) // 50)]:
            c0 = coords(group[0])
            for r in group:
                assert all(coords(r)[a] == c0[a] for a in c0 if a not in axes), (name, group)
            assert group == sorted(group) or name in ("dp_cp",), (name, group)
    # the formula rank = ((dp*PP + pp)*CP + cp)*TP + tp, checked on the first and last groups
    assert layout["tp"][-1] == list(range(world - tp, world))
    assert layout["dp"][0] == [d * tp * cp * pp for d in range(dp)]
    # embedding: first and last stage; expert groups stay inside one stage, ETP innermost
    for g in layout["embedding"]:
        assert [coords(r)["pp"] for r in g] == ([0, pp - 1] if pp > 1 else [0])
    for name in ("ep", "etp", "edp"):
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
    state = initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                      pipeline_model_parallel_size=2)
    layout = rank_layout(world, 2, 2, 2)
    for name in GROUP_NAMES:
        ranks = state.group_ranks(name)
        assert ranks in layout[name] and rank in ranks
        assert dist.get_process_group_ranks(state.group(name)) == ranks
        assert state.rank(name) == ranks.index(rank) == dist.get_rank(state.group(name))
        assert state.size(name) == len(ranks)
    return rank


def test_initialize_model_parallel_agrees_with_layout():
    assert run_workers(_state_agrees, 8) == list(range(8))
