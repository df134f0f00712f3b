"""A dozen of Megatron-LM's own flag sets train here unchanged, and the refused ones stop early.

tests/fixtures/megatron_flag_sets.json holds flag sets as Megatron-LM's authors wrote them (its
functional-test configs and launch examples, at the commit the file records; written by
``python tools/megatron_flag_sets.py MEGATRON_LM --write-sample tests/fixtures/megatron_flag_sets.json``),
with only the paths dropped and mock data added. Each trains for 3 iterations on CPU through
tools/flag_set_runs.py: widths, sequence and batch sizes shrunk, everything else as written.
The whole census (224 sets) is measured by ``tools/megatron_flag_sets.py MEGATRON_LM --run``.

The ranks of one set start under torchrun, as users start them (``TORCHRUN_SETS``); the others
start through tools/fork_launch.py, which forks ranks from one process that has imported torch:
the ranks see the same environment and run the same script either way
(tests/integration/test_fork_launch.py), and on a 2-core CI machine each set then takes about a
third of the time (8 ranks importing torch afresh take most of a 3-iteration run). The launch
examples' one trainable set, Mixtral 8x7B (32 ranks: forked, it peaks near 15 GiB of the 24),
is trained by the census (``--run``) and not here: on 2 cores it took 190 s of CI's 30 minutes
(2026-11-29). torchrun's own start-up is also covered by tests/integration/
test_user_experience.py and tests/resilience/test_faults.py.
"""
import json
import os
import re

import pytest

from megatron_cp.cli.arguments import parse_args
import flag_set_runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "tests", "fixtures", "megatron_flag_sets.json")) as _file:
    SAMPLE = json.load(_file)
TORCHRUN_SETS = ("gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings",)


def test_the_sample_spans_gpt_and_moe_functional_tests():
    assert set(TORCHRUN_SETS) <= set(SAMPLE["train"])
    kinds = {name.split("/")[0] for name in SAMPLE["train"]}
    assert {"gpt", "moe"} <= kinds, kinds
    assert len(SAMPLE["train"]) >= 12


@pytest.mark.parametrize("name", sorted(SAMPLE["train"]))
def test_megatron_lm_flag_set_trains_three_iterations(name, tmp_path):
    launcher = "torchrun" if name in TORCHRUN_SETS else "fork"
    result = flag_set_runs.run(SAMPLE["train"][name], str(tmp_path), launcher=launcher)
    assert result["ok"], "\n".join(result["tail"])
    assert len(result["losses"]) == flag_set_runs.ITERATIONS, result["losses"]
    assert all(4.0 < loss < 9.0 for loss in result["losses"]), result["losses"]  # ~ln(1000)


@pytest.mark.parametrize("name", sorted(SAMPLE["refuse"]))
def test_refused_flag_set_stops_with_one_line_per_flag(name, tmp_path):
    """A set megatron_cp cannot honour stops while its flags are read (before any process
    group), one line per flag naming it and why (GPU-only features such as FP8 and CUDA
    graphs, and what is not built)."""
    argv = SAMPLE["refuse"][name]["argv"] + flag_set_runs.path_flags(str(tmp_path))
    with pytest.raises(ValueError) as err:
        parse_args(argv, world_size=flag_set_runs.parallel_sizes(argv)[3])
    lines = getattr(err.value, "lines", None) or [str(err.value)]
    flags = {re.match(r"(--[a-z0-9-]+)", line).group(1) for line in lines}
    assert flags == set(SAMPLE["refuse"][name]["flags"]), lines
    assert all("\n" not in line and len(line) > 40 for line in lines), lines


def test_a_persistent_error_set_stops_as_written_only_with_its_exit():
    """Megatron-LM's reruns_persistent sets inject a persistent error; stopping with status 16
    after the checkpoint is saved is what they are written for, anything else is a failure."""
    argv = ["--rerun-mode", "validate_results", "--error-injection-type", "persistent_error",
            "--error-injection-rate", "100"]
    out = ("WARNING Injecting error type Persistent error\nerror: iteration 2 gave the same "
           "rejected result when rerun here; its checkpoint was saved: resume with --load")
    assert flag_set_runs.stops_as_written(argv, 16, out)
    assert not flag_set_runs.stops_as_written(argv, 1, out)  # another failure
    assert not flag_set_runs.stops_as_written(argv, 16, out.replace("its checkpoint was saved",
                                                                    "its checkpoint is there"))
    transient = argv[:3] + ["transient_error"] + argv[4:]
    assert not flag_set_runs.stops_as_written(transient, 16, out)
    assert not flag_set_runs.stops_as_written(argv[2:], 16, out)  # no validation: no rerun
