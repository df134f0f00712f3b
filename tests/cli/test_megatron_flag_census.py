"""Every flag Megatron-LM defines is known here, and every flag accepted here is read.

The census (megatron_cp/cli/megatron_lm_flags.json) is the list of flags of Megatron-LM's
pretraining parser at the commit it records, written by tools/megatron_flag_census.py from
that parser itself. Each flag is either declared by megatron_cp's own code (a field of a
typed config section: implemented) or an entry of the table in megatron_flags.py (accepted
as what megatron_cp does anyway, an alias, or refused with the reason).
"""
import dataclasses
import glob
import json
import os
import re

import pytest

from megatron_cp.cli.arguments import SECTIONS, build_parser
from megatron_cp.cli.megatron_flags import (AS_IS, EFFECTS, IGNORABLE, IGNORED, MAP, MEMORY,
                                            NONE, NOT_BUILT, REFUSE, SAME, SOURCES_FILE,
                                            all_entries, megatron_census, note)
from megatron_cp.config.model import GPTConfig
from megatron_cp.config.setting import arg_of, flag_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "megatron_cp", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "tools", "*.py"))
                 + glob.glob(os.path.join(ROOT, "tasks", "**", "*.py"), recursive=True)
                 + [os.path.join(ROOT, "pretrain_gpt.py")])


def _census_flags():
    return [flag for action in megatron_census()["actions"] for flag in action["flags"]]


def test_census_is_one_megatron_lm_commit():
    census = megatron_census()
    assert re.fullmatch(r"[0-9a-f]{40}", census["commit"]), census["commit"]
    flags = _census_flags()
    assert len(flags) == len(set(flags)) == census["flag_count"] == 876


def test_no_megatron_lm_flag_is_unknown():
    known = {o for action in build_parser()._actions for o in action.option_strings}
    unknown = [flag for flag in _census_flags() if flag not in known]
    assert unknown == [], f"{len(unknown)} Megatron-LM flags unknown: {unknown[:20]}"


def test_each_megatron_lm_flag_has_one_home():
    """A census action is declared by our own code or by one table entry, never both."""
    table = [f for entry in all_entries() for f in (entry.flag, *entry.aliases)]
    assert len(table) == len(set(table)), sorted({f for f in table if table.count(f) > 1})
    grouped = [f for row in AS_IS + NOT_BUILT for f in row[-1]]
    census = set(_census_flags())
    assert set(grouped) <= census, sorted(set(grouped) - census)
    dests = {entry.dest for entry in all_entries()}
    actions = build_parser()._actions
    table = {o for a in actions if a.dest in dests for o in a.option_strings}  # with --no-x
    ours = {o for a in actions for o in a.option_strings} - table
    for action in megatron_census()["actions"]:
        homes = {"ours" if flag in ours else "table" for flag in action["flags"]}
        assert len(homes) == 1, (action["flags"], homes)


def test_grouped_entries_are_refused_or_noted_with_a_reason():
    for row in AS_IS + NOT_BUILT:
        why, flags = row[-2:]
        assert flags and why and not why.endswith(".") and len(why) < 240, why


def test_each_accepted_entry_says_what_megatron_lm_does_with_it():
    """An accepted entry that is not built has an effect class and the line where Megatron-LM
    reads it at the census commit (megatron_flag_sources.json, tools/megatron_flag_sources.py).
    One that changes numerics or behaviour in Megatron-LM is never ignored (it is built, or
    SAME: megatron_cp always computes what it selects); an ignored memory saving warns at
    start-up, an ignored speed / I/O / logging knob says "ignored: <what it does>"."""
    with open(SOURCES_FILE) as file:
        sources = json.load(file)
    assert sources["commit"] == megatron_census()["commit"]
    accepted = [e for e in all_entries() if e.kind in (SAME, IGNORED)]
    assert {e.flag for e in accepted} == set(sources["sources"])
    for entry in accepted:
        source = sources["sources"][entry.flag]
        assert entry.effect in EFFECTS, entry.flag
        assert (entry.effect == NONE) == (source == "read nowhere"), (entry.flag, source)
        if source != "read nowhere" and not source.startswith("not a flag"):
            assert re.match(r"megatron/\S+\.py:\d+: ", source), (entry.flag, source)
        line = note(entry, entry.flag)
        if entry.kind == IGNORED:
            assert entry.effect in IGNORABLE, f"{entry.flag} changes {entry.effect}: build or refuse it"
            if entry.effect == MEMORY:
                assert line.startswith(f"WARNING: {entry.flag}: in Megatron-LM it "), line
                assert "this run does not" in line, line
            else:
                assert line.startswith(f"{entry.flag}: ignored ({entry.effect}): in Megatron-LM it "), line
    flagged = {e.flag for e in accepted if e.kind == IGNORED}
    assert {"--no-clone-scatter-output-in-embedding"} <= {e.flag for e in accepted
                                                        if e.effect == MEMORY} & flagged


def _read_somewhere(name, declared_in):
    """Whether ``name`` (an argument or config field) is read by some source file: as an
    attribute (``args.name``, ``config.name``) or by its quoted name (``getattr``)."""
    pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
    for path in SOURCES:
        with open(path) as file:
            for line in file:
                if pattern.search(line) and not declared_in(path, line):
                    return True
    return False


def _declares(path, line):
    """A line that declares an argument or a field rather than reading one."""
    return "add_argument(" in line or "= setting(" in line or "CompatFlag(" in line


def test_no_accepted_flag_is_read_nowhere():
    """Every flag accepted with an effect (a config section's field) is read by the code; a
    SAME entry is accepted because it has none, a REFUSE entry is refused."""
    table = {entry.dest: entry for entry in all_entries()}
    fields = {arg_of(f): f.name for config in SECTIONS
              for f in dataclasses.fields(config) if flag_of(f)}
    # a gate flag (--group-query-attention) is read through the field it gates
    fields.update({f.metadata["gate"][0][2:].replace("-", "_"): f.name
                   for f in dataclasses.fields(GPTConfig) if f.metadata.get("gate")})
    unread = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry = table.get(action.dest)
        if entry is not None and entry.kind in (SAME, IGNORED, REFUSE, MAP):
            continue
        name = fields.get(action.dest, action.dest)
        if not _read_somewhere(name, _declares):
            unread.append(action.option_strings[0])
    assert unread == [], f"accepted but read nowhere: {unread}"


@pytest.mark.parametrize("kind", [SAME, REFUSE])
def test_grouped_flags_parse_as_megatron_does(kind):
    """A grouped entry takes Megatron's argparse spec from the census: its values parse, and
    giving it at Megatron's default is not giving it."""
    parser = build_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    census = {f: a for a in megatron_census()["actions"] for f in a["flags"]}
    grouped = {f for row in (AS_IS if kind == SAME else NOT_BUILT) for f in row[-1]}
    for entry in (e for e in all_entries() if e.flag in grouped):
        action, spec = by_flag[entry.flag], census[entry.flag]
        if spec["kind"] != "store":
            assert action.option_strings == spec["flags"], entry.flag
            continue
        assert action.nargs == spec["nargs"], entry.flag
        if not (isinstance(spec["default"], str) and spec["default"].startswith("<")):
            assert action.default == spec["default"], entry.flag


def test_census_runs_keep_their_losses_and_the_docs_show_them():
    """The census of Megatron-LM's own flag sets (benchmarks/results/megatron_flag_sets.json):
    a set counted as trained has its 3 finite losses recorded; the table in
    docs/megatron_lm_compatibility.md is the one the JSON gives (tools/megatron_flag_sets.py
    --summary)."""
    from megatron_flag_sets import counts, summary_table, trained
    with open(os.path.join(ROOT, "benchmarks", "results", "megatron_flag_sets.json")) as file:
        report = json.load(file)
    assert report["census"]["megatron_lm_commit"] == megatron_census()["commit"]
    runs = report["runs"]
    assert set(runs) == {name for name, lines in report["sets"].items() if not lines}
    for name, run in runs.items():
        if trained(run):
            assert all(isinstance(x, float) and x == x and abs(x) < 1e4
                       for x in run["losses"]), name
        else:  # a run that did not train says how it ended
            assert run.get("stopped_as_written") or run.get("tail"), name
    assert counts(runs)["trained"] + counts(runs)["stopped"] + counts(runs)["failed"] == len(runs)
    with open(os.path.join(ROOT, "docs", "megatron_lm_compatibility.md")) as file:
        assert summary_table(len(report["sets"]), runs) in file.read()
