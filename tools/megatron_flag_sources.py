"""Where Megatron-LM reads each flag that megatron_cp accepts without building: the source line
of every SAME / IGNORED entry of megatron_cp/cli/megatron_flags.py at the census commit.

    python tools/megatron_flag_sources.py /path/to/Megatron-LM-tree [--write]

The tree is Megatron-LM's ``megatron/`` package at the census commit (e.g. ``git archive
d98e8a64... megatron | tar -x -C TREE``). For each flag, the destination name Megatron-LM's
parser gives it (from the census) is looked up outside the argument definitions
(megatron/training/arguments.py, megatron/training/config/): the first line that reads it as
an attribute (``args.name``, ``config.name``, ...) in megatron/core, then megatron/training,
then elsewhere; a flag read nowhere says so. ``--write`` stores the result in
megatron_cp/cli/megatron_flag_sources.json, which tests/cli/test_megatron_flag_census.py holds
every accepted entry to.
"""
import argparse
import json
import os
import re

from megatron_cp.cli.megatron_flags import (IGNORED, SAME, SOURCES_FILE, all_entries,
                                            megatron_census)

DEFINITIONS = ("megatron/training/arguments.py", "megatron/training/config/")
PREFERENCE = ("megatron/core/", "megatron/training/", "megatron/")


def python_files(tree):
    """Megatron-LM's .py files under ``tree``/megatron, as paths relative to ``tree``."""
    found = []
    for folder, _, names in os.walk(os.path.join(tree, "megatron")):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), tree)
                if not path.startswith(DEFINITIONS):
                    found.append(path)
    return sorted(found, key=lambda p: (next(i for i, pre in enumerate(PREFERENCE)
                                             if p.startswith(pre)), p))


def first_read(tree, files, dest):
    """``"path:line: code"`` of the first line reading attribute ``dest``, else None."""
    pattern = re.compile(rf"\.{re.escape(dest)}\b|['\"]{re.escape(dest)}['\"]")
    for path in files:
        with open(os.path.join(tree, path), errors="replace") as file:
            for number, line in enumerate(file, 1):
                if pattern.search(line) and not line.lstrip().startswith("#"):
                    return f"{path}:{number}: {line.strip()[:160]}"
    return None


def sources(tree):
    """``{flag: source line or "read nowhere"}`` for every accepted, unbuilt entry."""
    dests = {flag: action["dest"] for action in megatron_census()["actions"]
             for flag in action["flags"]}
    files = python_files(tree)
    found = {}
    for entry in all_entries():
        if entry.kind not in (SAME, IGNORED):
            continue
        if entry.flag not in dests:
            found[entry.flag] = "not a flag of Megatron-LM at the census commit (an older one)"
        else:
            found[entry.flag] = first_read(tree, files, dests[entry.flag]) or "read nowhere"
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="a folder holding Megatron-LM's megatron/ package")
    parser.add_argument("--write", action="store_true", help=f"write {SOURCES_FILE}")
    args = parser.parse_args()
    found = sources(args.tree)
    for flag, line in found.items():
        print(f"{flag:50s} {line}")
    if args.write:
        with open(SOURCES_FILE, "w") as file:
            json.dump({"commit": megatron_census()["commit"], "sources": found}, file, indent=1)
            file.write("\n")
        print(f"wrote {SOURCES_FILE}")


if __name__ == "__main__":
    main()
