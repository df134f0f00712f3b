"""The routed experts' FP8 grouped GEMMs quantize exactly as one process under every EP
layout (megatron_cp/fp8/grouped.py): EP over DP (alltoall and allgather), EP over TP2+SP
with ETP1 and ETP2 (beside DP2), EP over CP, for the tensorwise and delayed recipes, and with
--moe-router-padding-for-fp8; the block recipes (fp8/grouped_blocks.py) under EP over DP
(blockwise), EP over TP2+SP with routing padding and with ETP2 beside DP2 (mxfp8).

As in test_fp8_layouts.py the claim is checked where it is exact: after step 1 (the same
weights everywhere) each expert's ``last_amax`` (input, weight, output gradient of fc1 and
fc2; delayed: its history and scales too) equals one process's within a few fp32 ulps, and so
does the step-1 loss (delayed: step 2's, the first under scales from step 1's amaxes). The
control puts every sender in one microbatch class, so an expert's amax mixes DP peers'
microbatches: its step-1 loss misses (blockwise: its wgrad token blocks mix them, so the
experts' block amaxes miss; the block recipes run 2 steps, step 2 on step 1's block-scaled
wgrad). Routing padding adds rows that change nothing: padded
layouts equal the unpadded one process, and a padded bf16 run the unpadded one bitwise.

The delayed recipe's expert state (whole on every rank) saved under EP2 loads bitwise under
EP1, in the torch_dist and torch formats.
"""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.fp8.grouped import GroupedFp8Meta
from training_utils import TINY, max_rel_diff, trained, trainer_of

BASE = (TINY.replace("--micro-batch-size 2 --global-batch-size 8",
                     "--micro-batch-size 1 --global-batch-size 2")
        .replace("--seq-length 32", "--seq-length 16").replace("--num-layers 2", "--num-layers 1")
        + " --train-iters 10")
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --no-bias-gelu-fusion "
       "--moe-token-dispatcher-type alltoall")
RECIPES = {"tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
           "delayed": "--fp8-format hybrid --fp8-recipe delayed",
           "blockwise": "--fp8-format hybrid --fp8-recipe blockwise",
           "mxfp8": "--fp8-format hybrid --fp8-recipe mxfp8"}
BLOCK_RECIPES = ("blockwise", "mxfp8")
PAD = "--moe-router-padding-for-fp8"
# delayed: step 2 runs on step 1's scales; block recipes: step 2 on step 1's wgrad (its
# token blocks: the forward's row blocks never cross rows)
STEPS = {"tensorwise": 1, "delayed": 2, "blockwise": 2, "mxfp8": 2}
TP_SP = "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2"
# name: (world, layout flags, recipes). Routing padding changes nothing (its rows stay out
# of the amaxes), so some layouts run with it against the unpadded one process.
LAYOUTS = {
    "ep2_dp": (2, "--expert-model-parallel-size 2", ("tensorwise", "delayed")),
    "ep2_dp_allgather": (2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type "
                            "allgather", ("tensorwise",)),
    "ep2_tp2sp_etp1_padded": (2, f"{TP_SP} --expert-tensor-parallel-size 1 {PAD}",
                              ("tensorwise", "delayed")),
    "ep2_cp2_padded": (2, f"--context-parallel-size 2 --expert-model-parallel-size 2 {PAD}",
                       ("tensorwise", "delayed")),
    "ep2_tp2sp_etp1_dp2": (4, f"{TP_SP} --expert-tensor-parallel-size 1", ("tensorwise",)),
    "ep2_tp2sp_etp2_dp2": (4, f"{TP_SP} --expert-tensor-parallel-size 2",
                           ("tensorwise", "delayed")),
    # block recipes: each (expert, microbatch) wgrad in one process's token blocks
    "ep2_dp_blocks": (2, "--expert-model-parallel-size 2", ("blockwise",)),
    "ep2_tp2sp_etp1_padded_blocks": (2, f"{TP_SP} --expert-tensor-parallel-size 1 {PAD}",
                                     ("mxfp8",)),
    # the sources come DP-major here: the dispatcher lays each class's TP pieces in order
    "ep2_tp2sp_etp2_dp2_blocks": (4, f"{TP_SP} --expert-tensor-parallel-size 2", ("mxfp8",)),
}
EXACT = 1e-6  # a few fp32 ulps: TP / CP activations differ from one process's by ulps


def _argv(recipe, layout=""):
    base = BASE.replace("--hidden-size 32", "--hidden-size 64") if recipe == "mxfp8" else BASE
    return f"{base} {MOE} {RECIPES[recipe]} {layout}"  # mxfp8: TP2 shards of whole blocks


def _expert_state(trainer):
    """{(linear name, expert): {buffer: values}}: each expert's ``last_amax`` (tensorwise:
    the MAX over the ranks, which hold their own experts and saw their own microbatches;
    block recipes: the MIN, their smallest block amaxes) and, for delayed scaling (whole on
    every rank), its history and scales."""
    out = {}
    for name, meta in trainer.model_chunks[0].named_modules():
        if not isinstance(meta, GroupedFp8Meta):
            continue
        last = meta.last_amax.clone()  # [E, 3]
        if meta.blocks is not None:
            dist.all_reduce(last, op=dist.ReduceOp.MIN)
        elif not meta.delayed:
            dist.all_reduce(last, op=dist.ReduceOp.MAX)
        name = name.removeprefix("module.").removesuffix(".fp8_meta")
        for e in range(last.shape[0]):
            state = {"last_amax": last[e].tolist()}
            if meta.delayed:
                state.update(amax_history=meta.amax_history[e].tolist(),
                             scale=meta.scale[e].tolist())
            out[(name, e)] = state
    return out


def _train(argv, world, steps):
    trainer = trainer_of(argv, world)
    losses = [trainer.train_step()[0]]
    state = _expert_state(trainer)
    losses += [trainer.train_step()[0] for _ in range(steps - 1)]
    return losses, state


def _one_class(dp_rank, groups, device):
    import megatron_cp.moe.dispatcher as dispatcher
    return [0] * len(dispatcher._REAL_SOURCE_CLASSES(dp_rank, groups, device))


def _control(argv, world, steps):
    """:func:`_train` with every sender in microbatch class 0: DP peers' rows share amaxes
    (block recipes: token blocks; their source order check is skipped)."""
    import megatron_cp.moe.dispatcher as dispatcher
    dispatcher._REAL_SOURCE_CLASSES = dispatcher._source_classes
    dispatcher._source_classes = _one_class
    check, dispatcher.check_source_order = dispatcher.check_source_order, lambda *_: None
    try:
        return _train(argv, world, steps)
    finally:
        dispatcher._source_classes = dispatcher._REAL_SOURCE_CLASSES
        dispatcher.check_source_order = check


def _jobs(rank, world, jobs):
    return {name: fn(argv, world, steps) for name, (fn, argv, steps) in jobs.items()}


@pytest.fixture(scope="module")
def results():
    references = {recipe: (_train, _argv(recipe), STEPS[recipe]) for recipe in RECIPES}
    references["bf16"] = (_train, _argv("tensorwise", "--bf16"), 2)
    references["bf16_padded"] = (_train, _argv("tensorwise", f"--bf16 {PAD}"), 2)
    runs = {w: {} for w in (2, 4)}
    for name, (world, layout, recipes) in LAYOUTS.items():
        for recipe in recipes:
            runs[world][(name, recipe)] = (_train, _argv(recipe, layout), STEPS[recipe])
    runs[2]["control"] = (_control, _argv("tensorwise", LAYOUTS["ep2_dp"][1]), 1)
    runs[2]["control_blocks"] = (_control, _argv("blockwise", LAYOUTS["ep2_dp"][1]), 2)
    return (run_workers(_jobs, 1, references, timeout=300)[0],
            {w: run_workers(_jobs, w, jobs, timeout=300) for w, jobs in runs.items()})


def _state_diff(ranks_state, reference):
    """The largest relative difference of any buffer of any expert on any rank from one
    process's; every expert is on some rank."""
    assert set().union(*ranks_state) == set(reference) and reference
    worst = 0.0
    for state in ranks_state:
        for key, buffers in state.items():
            for buffer, values in buffers.items():
                a = torch.tensor(values, dtype=torch.float64)
                b = torch.tensor(reference[key][buffer], dtype=torch.float64)
                worst = max(worst, ((a - b).abs() / b.abs().clamp(min=1e-30)).max().item())
    return worst


@pytest.mark.parametrize("name,recipe", [(name, recipe) for name, (_, _, recipes) in
                                         LAYOUTS.items() for recipe in recipes])
def test_expert_fp8_layout_quantizes_as_one_process(results, name, recipe):
    references, runs = results
    ref_losses, ref_state = references[recipe]
    ranks = runs[LAYOUTS[name][0]]
    state_diff = _state_diff([r[(name, recipe)][1] for r in ranks], ref_state)
    loss_diff = max(max_rel_diff(r[(name, recipe)][0], ref_losses) for r in ranks)
    print(f"{name} {recipe}: expert FP8 state {state_diff:.1e}, losses {loss_diff:.1e}")
    assert state_diff <= EXACT and loss_diff <= EXACT


def test_amaxes_mixed_across_dp_peers_miss(results):
    references, runs = results
    ref_losses = references["tensorwise"][0]
    loss_diff = max(abs(r["control"][0][0] - ref_losses[0]) / ref_losses[0] for r in runs[2])
    print(f"control (one class over DP peers): step-1 loss {loss_diff:.1e}")
    assert loss_diff > EXACT


def test_block_wgrad_token_blocks_mixed_across_dp_peers_miss(results):
    """Blockwise with both microbatches' rows of an expert in one run: its wgrad token
    blocks mix DP peers' rows, so the experts' block amaxes miss. (The losses may not: a
    power-of-2 scale rounds an element to the same mantissa bits in any block, unless it
    falls among the FP8 subnormals.)"""
    references, runs = results
    ref_losses, ref_state = references["blockwise"]
    state_diff = _state_diff([r["control_blocks"][1] for r in runs[2]], ref_state)
    loss_diff = max(max_rel_diff(r["control_blocks"][0], ref_losses) for r in runs[2])
    print(f"control blocks (one class over DP peers): state {state_diff:.1e}, losses "
          f"{loss_diff:.1e}")
    assert state_diff > EXACT


def test_router_padding_changes_nothing_in_bf16(results):
    """The padded rows run through the experts and add nothing: 2 steps in bf16 (FP8
    experts) padded and not, the same losses and expert amaxes."""
    references, _ = results
    losses, state = references["bf16"]
    padded_losses, padded_state = references["bf16_padded"]
    loss_diff, state_diff = max_rel_diff(padded_losses, losses), _state_diff([padded_state], state)
    print(f"bf16 padded: expert FP8 state {state_diff:.1e}, losses {loss_diff:.1e}")
    assert loss_diff == 0 and state_diff == 0


def _buffers(chunks):
    return {name: (meta.amax_history.clone(), meta.scale.clone())
            for name, meta in chunks[0].named_modules() if isinstance(meta, GroupedFp8Meta)}


def _saved(rank, world, runs):
    """Worker: each run's expert FP8 buffers at its end (the saved ones)."""
    return {name: _buffers(trained(rank, world, argv)[1].model_chunks) for name, argv in
            runs.items()}


def _loaded(rank, world, runs):
    """Worker: each run's expert FP8 buffers as its first step found them (the loaded ones)."""
    from megatron_cp import fp8
    real, out = fp8.end_fp8_step, {}
    for name, argv in runs.items():
        seen = []

        def end_step(chunks, groups):
            seen.append(_buffers(chunks))
            real(chunks, groups)
        fp8.end_fp8_step = end_step
        try:
            trained(rank, world, argv)
        finally:
            fp8.end_fp8_step = real
        out[name] = seen[0]
    return out


def test_expert_fp8_state_loads_under_another_ep_size(tmp_path):
    argv = (f"{_argv('delayed')} --fp8-amax-history-len 2 --fp8-amax-compute-algo max "
            f"--train-iters 4")
    formats = {"torch_dist": "", "torch": "--ckpt-format torch"}
    saves = {name: f"{argv} {flags} --exit-interval 2 --save {tmp_path / name} --save-interval 2 "
                   f"--expert-model-parallel-size 2" for name, flags in formats.items()}
    loads = {name: f"{argv} {flags} --load {tmp_path / name}" for name, flags in formats.items()}
    saved = run_workers(_saved, 2, saves, timeout=300)
    loaded = run_workers(_loaded, 1, loads, timeout=300)[0]
    for name in formats:
        assert saved[0][name].keys() == loaded[name].keys() and loaded[name]
        for linear, (history, scale) in loaded[name].items():
            for rank in saved:  # whole on every rank
                assert torch.equal(history, rank[name][linear][0]), (name, linear)
                assert torch.equal(scale, rank[name][linear][1]), (name, linear)
