"""Each setting is declared once, with Megatron-LM's default.

Every flag of the command line has exactly one declaration site: a field of a typed config
section (megatron_cp/config/) or an entry of Megatron-LM's flag table
(megatron_cp/cli/megatron_flags.py), and the parser is derived from them. Every default
equals Megatron-LM's (its census, megatron_cp/cli/megatron_lm_flags.json) unless the short
list of deliberate differences (megatron_cp/cli/differences.py, printed by
docs/megatron_lm_compatibility.md) says why not.
"""
import argparse
import dataclasses
import glob
import inspect
import os
import re

from megatron_cp.cli import arguments
from megatron_cp.cli.arguments import build_parser
from megatron_cp.cli.differences import DEFAULTS_THAT_DIFFER, DELIBERATE, FILLED_IN_LATER
from megatron_cp.cli.megatron_flags import all_entries, megatron_census
from megatron_cp.config.setting import flag_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _field_flags(f):
    """Every flag a config field declares: its own, its aliases, its negative and gate."""
    meta = f.metadata
    flags = [flag_of(f), *meta.get("aliases", ())]
    if meta.get("negative"):
        flags.append(meta["negative"][0])
    if meta.get("gate"):
        flags.append(meta["gate"][0])
    return [flag for flag in flags if flag]


def _declaring_class(section, name):
    """The class of ``section``'s MRO whose body declares field ``name`` (a section may
    inherit its parts: GPTConfig its MoE, MLA, Gated DeltaNet and MTP settings)."""
    return next(cls for cls in section.__mro__ if name in vars(cls).get("__annotations__", {}))


def _declarations():
    """``{flag: [site, ...]}``: where each flag is declared."""
    sites = {}
    for section in arguments.SECTIONS:
        for f in dataclasses.fields(section):
            cls = _declaring_class(section, f.name)
            path = os.path.relpath(inspect.getsourcefile(cls), ROOT)
            for flag in _field_flags(f):
                sites.setdefault(flag, []).append(f"{path}: {cls.__name__}.{f.name}")
    for entry in all_entries():
        flags = [entry.flag, *entry.aliases]
        if entry.argparse.get("action") is argparse.BooleanOptionalAction:
            flags.append("--no-" + entry.flag[2:])  # argparse's own negative spelling
        for flag in flags:
            sites.setdefault(flag, []).append(f"megatron_cp/cli/megatron_flags.py: {entry.flag}")
    return sites


def test_every_flag_has_one_declaration_site():
    parser_flags = {flag for action in build_parser()._actions for flag in action.option_strings
                    if action.dest != "help"}
    sites = _declarations()
    twice = {flag: where for flag, where in sites.items() if len(where) > 1}
    assert twice == {}, f"flags declared twice: {twice}"
    assert set(sites) == parser_flags, (sorted(parser_flags - set(sites))[:10],
                                        sorted(set(sites) - parser_flags)[:10])


def test_each_field_is_found_by_its_name_at_one_line():
    """A newcomer who searches a setting's name finds its declaration: ``name: type =
    setting(`` on one line of its section's file under megatron_cp/config/, and no other
    section declares a flag for that name."""
    owners = {}
    for section in arguments.SECTIONS:
        for f in dataclasses.fields(section):
            if not _field_flags(f):
                continue
            cls = _declaring_class(section, f.name)
            path = inspect.getsourcefile(cls)
            assert os.path.dirname(path) == os.path.join(ROOT, "megatron_cp", "config"), path
            owners.setdefault(f.name, []).append(cls.__name__)
            pattern = re.compile(rf"^\s+{f.name}: .*= setting\(", re.MULTILINE)
            assert len(pattern.findall(open(path).read())) == 1, (cls.__name__, f.name)
    assert {name: owner for name, owner in owners.items() if len(owner) > 1} == {}


def test_no_flag_is_added_outside_the_derivation():
    """``add_argument`` appears only where flags are derived: setting.py (config fields),
    megatron_flags.py (the table) and use_checkpoint_args.py (a silent copy of the parser
    that finds which flags the command line gave) — besides the own command lines of two
    tools, whose logic lives in the package (tools/plan_layout.py's planner options,
    tools/preprocess_data.py's corpus options: none of them a pretrain_gpt.py flag)."""
    allowed = {"megatron_cp/config/setting.py", "megatron_cp/cli/megatron_flags.py",
               "megatron_cp/checkpoint/use_checkpoint_args.py",
               "megatron_cp/planning/plan_layout.py", "megatron_cp/data/preprocess.py"}
    found = set()
    for path in glob.glob(os.path.join(ROOT, "megatron_cp", "**", "*.py"), recursive=True):
        if ".add_argument(" in open(path).read():
            found.add(os.path.relpath(path, ROOT))
    assert found == allowed, found ^ allowed


def _comparable(value):
    """A census default as Python compares it: an enum's repr (``<AttnBackend.auto: 5>``)
    by its member name."""
    if isinstance(value, str):
        match = re.fullmatch(r"<\w+\.(\w+): .*>", value)
        if match:
            return match.group(1)
    return value


def _same(ours, megatron, action, census):
    if isinstance(ours, tuple):
        ours = list(ours)
    if census["nargs"] in ("+", "*") and isinstance(megatron, list) and len(megatron) == 1 \
            and action.nargs is None:
        megatron = megatron[0]  # a per-layer list of one value (--cp-comm-type), ours a value
    if isinstance(ours, str) != isinstance(megatron, str) and None not in (ours, megatron):
        return str(ours) == str(megatron)  # --moe-layer-freq: ours keeps the text
    return ours == megatron


def _differences():
    parser = build_parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    differ = {}
    for census in megatron_census()["actions"]:
        flag = census["flags"][0]
        action = by_flag[flag]
        megatron, ours = _comparable(census["default"]), parser.get_default(action.dest)
        if census["kind"] == "store_false" and isinstance(action, argparse._StoreTrueAction):
            ours = not ours  # ours: a switch --no-x that sets a field x to False
        if census["kind"] == "store_true":
            ours, megatron = bool(ours), bool(megatron)  # a default of None is "not given"
        if not _same(ours, megatron, action, census):
            differ[flag] = (megatron, ours)
    return differ


def test_every_default_is_megatron_lms():
    """Every default equals Megatron-LM's at the census commit, except the deliberate
    differences and the values Megatron-LM fills in after parsing."""
    differ = _differences()
    unexplained = {flag: values for flag, values in differ.items()
                   if flag not in DEFAULTS_THAT_DIFFER and flag not in FILLED_IN_LATER}
    assert unexplained == {}, f"(Megatron-LM's default, ours): {unexplained}"
    for flag, (value, _) in FILLED_IN_LATER.items():
        megatron, ours = differ[flag]
        assert megatron is None and str(ours).replace(" ", "") == value.replace(" ", ""), flag
    rows = {row[0] for row in DELIBERATE}
    assert set(DEFAULTS_THAT_DIFFER.values()) <= rows
    assert set(DEFAULTS_THAT_DIFFER) | set(FILLED_IN_LATER) == set(differ)  # none stale


def test_the_compatibility_page_lists_every_deliberate_difference():
    """docs/megatron_lm_compatibility.md prints every deliberate difference, each cell as
    megatron_cp/cli/differences.py words it."""
    with open(os.path.join(ROOT, "docs", "megatron_lm_compatibility.md")) as file:
        page = " ".join(file.read().split())
    for what, megatron, ours, why in DELIBERATE:
        for text in (what, megatron, ours, why):
            assert " ".join(text.split()) in page, text
