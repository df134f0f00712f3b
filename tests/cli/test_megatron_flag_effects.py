"""What the Megatron-LM flags that megatron_cp accepts without building do, and the ones built
for issue 33 because they change behaviour or memory:

- every ignored flag (megatron_flags.py: IGNORED, speed / I/O / logging / memory only) given at
  once trains to exactly the losses of a run without them, and the start-up notes say of each
  what it does in Megatron-LM (a WARNING for an ignored memory saving);
- --dist-ckpt-strictness: each of Megatron-LM's modes on a checkpoint whose keys differ from
  the model's (a key the model loads removed, a key no rank loads added), under PP=2;
- --empty-unused-memory-level 1 / 2 empty the allocator where Megatron-LM does;
- --disable-gloo-process-groups creates no gloo group and still saves and loads;
- --distributed-timeout-seconds-after-init sets every group's timeout after the first
  iteration;
- --moe-token-dispatcher-type flex says it runs as the alltoall dispatcher.
"""
import argparse
import contextlib
import datetime
import io
import shutil

import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.distributed import device as device_mod
from megatron_cp.checkpoint.torch_dist_format import read_full, write_full
from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.cli.megatron_flags import IGNORED, MEMORY, all_entries, megatron_census
from megatron_cp.training import Trainer
from training_utils import TINY, assert_refused, run_and_state, train_losses

STEPS = f"{TINY} --train-iters 3"


def _non_default_value(action, census):
    """Command-line words giving ``action`` (an argparse action of our parser) a value other
    than its default, as Megatron-LM's parser reads it."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true / store_false / a boolean pair
        if isinstance(action, argparse.BooleanOptionalAction):
            return [f"--no-{flag[2:]}"] if action.default else [flag]
        return [flag]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
    elif census.get("type") == "int" or action.type is int:
        value = 3 if action.default != 3 else 4
    elif census.get("type") == "float" or action.type is float:
        value = 0.5
    else:
        value = "some_value"
    words = [flag, str(value)]
    if action.nargs in ("+", "*"):
        words.append(str(value))
    return words


def _ignored_flags():
    parser = build_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    census = {f: a for a in megatron_census()["actions"] for f in a["flags"]}
    words = []
    for entry in (e for e in all_entries() if e.kind == IGNORED):
        words += _non_default_value(by_flag[entry.flag], census.get(entry.flag, {}))
    return words


# multi-latent attention: --mla-down-proj-fusion needs it
MLA = (" --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 8")


def test_every_ignored_flag_at_once_changes_no_loss_and_is_named_at_start_up():
    ignored = [e for e in all_entries() if e.kind == IGNORED]
    words = _ignored_flags()
    args = parse_args((STEPS + MLA).split() + words, world_size=1)
    for entry in ignored:
        lines = [n for n in args.compat_notes if entry.flag in n]
        assert lines, f"{entry.flag}: no start-up line"
        if entry.effect == MEMORY:
            assert lines[0].startswith("WARNING: ") and "this run does not" in lines[0], lines[0]
        else:
            assert f": ignored ({entry.effect}): in Megatron-LM it " in lines[0], lines[0]
    plain, with_flags = run_workers(_two_runs, 1, STEPS + MLA,
                                    STEPS + MLA + " " + " ".join(words))[0]
    assert with_flags == plain


def _two_runs(rank, world, first, second):
    return train_losses(rank, world, first), train_losses(rank, world, second)


def test_flex_dispatcher_says_it_runs_as_alltoall():
    args = parse_args(f"{STEPS} --num-experts 2 --moe-token-dispatcher-type flex "
                      "--disable-bias-linear --swiglu".split(), world_size=1)
    line = next(n for n in args.compat_notes if n.startswith("--moe-token-dispatcher-type flex"))
    assert "ignored (speed)" in line and "alltoall dispatcher" in line


# --- --dist-ckpt-strictness ---------------------------------------------------------------

PP2 = f"{STEPS} --pipeline-model-parallel-size 2 --num-layers 4"
MODES = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
         "ignore_all")


def _save(rank, world, argv):
    train_losses(rank, world, argv)


def _load_each(rank, world, argv, roots, modes, probe):
    """Per (root, mode): the error line or the printed output of a load, and the first
    values of parameter ``probe`` (a name on rank 1's stage) after it."""
    out = {}
    for root in roots:
        for mode in modes:
            args = parse_args(f"{argv} --dist-ckpt-strictness {mode}".split(), world_size=world)
            run, state = run_and_state(args)
            trainer = Trainer(args, state, run)
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    trainer.checkpointer.load(trainer.train_state(), root)
                result = printed.getvalue()
            except ValueError as error:
                result = f"ERROR {error}"
            params = [p for n, p in trainer.model_chunks[0].named_parameters()
                      if n.endswith(probe)]  # (under the DDP wrapper's prefix)
            value = params[0].detach().flatten()[:4].tolist() if params else None
            out[(root, mode)] = (result, value)
    return out


def test_dist_ckpt_strictness_modes(tmp_path):
    saved = tmp_path / "saved"
    run_workers(_save, 2, f"{PP2} --save {saved} --save-interval 3")
    full, common = read_full(str(saved / "iter_0000003"))
    gone = next(k for k in sorted(full) if k.startswith("model.decoder.layers.3.")
                and "layernorm.weight" in k)
    extra = "model.decoder.layers.9.extra.weight"
    # "unexpected": the model loads a key the checkpoint lacks; "missing": the reverse
    cases = {"unexpected": {k: v for k, v in full.items() if k != gone},
             "missing": {**full, extra: torch.ones(3)}}
    for name, tensors in cases.items():
        shutil.copytree(saved, tmp_path / name)
        write_full(str(tmp_path / name / "iter_0000003"), tensors, common,
                   rng_from=str(saved / "iter_0000003"))
    probe = gone[len("model."):]
    argv = f"{PP2} --no-load-optim --no-load-rng"
    roots = [str(tmp_path / n) for n in cases]
    results = run_workers(_load_each, 2, argv, roots, MODES, probe.replace("layers.3", "layers.1"))
    by_rank1 = results[1]  # layer 3 lives on the second stage (its local layer 1)
    unexpected, missing = roots
    mine = results[0]
    # assume_ok_unexpected: no check; the load fails on the key, naming it
    assert by_rank1[(unexpected, "assume_ok_unexpected")][0].startswith("ERROR"), \
        by_rank1[(unexpected, "assume_ok_unexpected")]
    assert not mine[(missing, "assume_ok_unexpected")][0].startswith("ERROR")
    for mode in ("log_unexpected", "log_all"):
        text, value = by_rank1[(unexpected, mode)]
        assert not text.startswith("ERROR"), text
        assert value == [1.0] * 4  # the norm weight keeps its initialisation
    log_lines = [line for line in mine[(unexpected, "log_unexpected")][0].splitlines()
                 if "WARNING" in line]
    assert log_lines and gone in log_lines[0] and "loading the rest" in log_lines[0], log_lines
    assert extra in mine[(missing, "log_all")][0]
    assert "WARNING" not in mine[(missing, "log_unexpected")][0]  # missing keys not checked
    for mode in ("raise_unexpected", "raise_all"):  # every rank stops, not only the one
        for rank in results:                         # whose key is gone
            text = rank[(unexpected, mode)][0]
            assert text.startswith(f"ERROR --dist-ckpt-strictness {mode}: ") and gone in text
    assert not mine[(missing, "raise_unexpected")][0].startswith("ERROR")
    assert mine[(missing, "raise_all")][0].startswith("ERROR") and extra in \
        mine[(missing, "raise_all")][0]
    for root in roots:
        assert "WARNING" not in mine[(root, "ignore_all")][0]
        assert not by_rank1[(root, "ignore_all")][0].startswith("ERROR")
    # a checkpoint whose keys all match: no rank reports a missing key (each loads its stage;
    # with --no-load-optim the optimizer's keys would be missing ones, as in Megatron-LM)
    clean = run_workers(_load_each, 2, f"{PP2} --no-load-rng", [str(saved)], ("raise_all",),
                        probe)
    assert all(not r[(str(saved), "raise_all")][0].startswith("ERROR") for r in clean)


def test_dist_ckpt_strictness_return_modes_are_refused():
    for mode in ("return_unexpected", "return_all"):
        assert_refused(f"{STEPS} --dist-ckpt-strictness {mode}",
                       f"--dist-ckpt-strictness {mode}: it returns the mismatched keys")


# --- memory, process groups, timeouts -----------------------------------------------------

def _count_empty_cache(rank, world, argv):
    calls = []
    device_mod.empty_cache = lambda device: calls.append(device)
    train_losses(rank, world, argv)
    return len(calls)


def test_empty_unused_memory_level_empties_where_megatron_lm_does():
    base = f"{STEPS} --eval-iters 2 --eval-interval 3"
    counts = [run_workers(_count_empty_cache, 1, f"{base} --empty-unused-memory-level {level}")[0]
              for level in (0, 1, 2)]
    # level 1: after each of the 3 forward-backward passes and each of 2 evaluation steps;
    # level 2: after each optimizer step as well
    assert counts == [0, 3 + 2, 3 + 2 + 3]


def _save_and_load_without_gloo(rank, world, argv, root):
    created = []
    real = dist.new_group

    def new_group(*a, **kw):
        created.append(kw.get("backend"))
        return real(*a, **kw)

    dist.new_group = new_group
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.checkpointer.save(trainer.train_state(), root)
    trainer = Trainer(args, state, run)
    trainer.iteration, _ = trainer.checkpointer.load(trainer.train_state(), root)
    return created, trainer.iteration


def test_disable_gloo_process_groups_creates_none_and_checkpoints_still_work(tmp_path):
    out = run_workers(_save_and_load_without_gloo, 2,
                      f"{STEPS} --disable-gloo-process-groups --async-save", str(tmp_path))
    for created, iteration in out:
        assert "gloo" not in created and iteration == 0
    with_gloo = run_workers(_save_and_load_without_gloo, 2, STEPS, str(tmp_path / "b"))
    assert "gloo" in with_gloo[0][0]  # the checkpoint group it would otherwise create
    args = parse_args(f"{STEPS} --disable-gloo-process-groups --async-save --save x".split(),
                      world_size=1)  # as two of Megatron-LM's own flag sets give them
    assert any(n.startswith("--async-save with --disable-gloo-process-groups: ignored (speed)")
               for n in args.compat_notes)


def _timeouts(rank, world, argv):
    seen = []
    dist.distributed_c10d._set_pg_timeout = lambda timeout, group: seen.append((timeout, group))
    train_losses(rank, world, argv)
    return [t for t, _ in seen], len({id(g) for _, g in seen})


def test_distributed_timeout_seconds_after_init_applies_after_the_first_iteration():
    timeouts, groups = run_workers(_timeouts, 2,
                                   f"{STEPS} --distributed-timeout-seconds-after-init 123")[0]
    assert timeouts and set(timeouts) == {datetime.timedelta(seconds=123)}
    assert groups > 1  # the world and every group of the parallel state, once
    assert run_workers(_timeouts, 2, STEPS)[0] == ([], 0)
    assert_refused(f"{STEPS} --distributed-timeout-seconds-after-init 0",
                   "--distributed-timeout-seconds-after-init (0) is a timeout in seconds")
