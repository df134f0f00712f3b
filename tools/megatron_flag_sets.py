"""How many of Megatron-LM's own flag sets megatron_cp's pretrain_gpt.py accepts.

    python tools/megatron_flag_sets.py /path/to/Megatron-LM [--json out.json]

Reads the MODEL_ARGS of Megatron-LM's GPT, MoE and Mixtral pretraining functional tests
(tests/functional_tests/test_cases/{gpt,moe,mixtral}/*/model_config.yaml; the inference and
RL ones run other entry points) and parses each
set with megatron_cp's arguments, as a user switching over would run it: the data mocked
(``--mock-data``, NullTokenizer), the paths dropped, the world size the one the set's parallel
sizes need. Prints how many sets are accepted, how many problems of each kind the others
meet, and writes the details as JSON when asked. Nothing is trained.
"""
import argparse
import collections
import glob
import json
import math
import os
import re
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_cp.arguments import build_parser, parse_args  # noqa: E402

# Paths and data: replaced by mock data, as the sets' ${VARIABLES} have no value here.
DROPPED = {"--data-path", "--data-cache-path", "--vocab-file", "--merge-file",
           "--tokenizer-model", "--tokenizer-type", "--save", "--load", "--tensorboard-dir",
           "--pretrained-checkpoint", "--wandb-save-dir", "--per-split-data-args-path",
           "--data-args-path", "--ckpt-convert-save", "--non-persistent-global-ckpt-dir",
           "--non-persistent-local-ckpt-dir", "--logits-save-dir", "--logits-load-dir",
           "--config-logger-dir", "--result-rejected-tracker-filename", "--mock-data",
           "--use-checkpoint-args"}  # (it reads the checkpoint under the dropped --load)
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def flag_sets(megatron_root):
    """``{test name: argv}`` of every GPT / MoE / Mixtral functional test."""
    pattern = os.path.join(megatron_root, "tests", "functional_tests", "test_cases",
                           "{gpt,moe,mixtral}", "*", "model_config.yaml")
    single = {o for a in build_parser()._actions for o in a.option_strings if a.nargs is None}
    sets = {}
    for family in ("gpt", "moe", "mixtral"):
        for path in sorted(glob.glob(pattern.replace("{gpt,moe,mixtral}", family))):
            with open(path) as file:
                config = yaml.safe_load(file) or {}
            if config.get("MODE", "pretraining") != "pretraining":
                continue  # inference and RL tests run other entry points
            args = config.get("MODEL_ARGS") or {}
            sets[f"{family}/{os.path.basename(os.path.dirname(path))}"] = _argv(args, single)
    return sets


def _argv(model_args, single):
    """``model_args`` as command-line words; ``single``: the flags that take one value."""
    argv = []
    for flag, value in model_args.items():
        if flag in DROPPED:
            continue
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif flag in single:  # one value, spaces and all ("0:384 200B:768")
            argv += [flag, str(value)]
        else:
            argv += [flag, *str(value).split()]
    return argv + MOCK


def _world_size(argv):
    def size(flag, default=1):
        return int(argv[argv.index(flag) + 1]) if flag in argv else default
    model = (size("--tensor-model-parallel-size") * size("--pipeline-model-parallel-size")
             * size("--context-parallel-size"))
    expert = size("--expert-model-parallel-size") * size(
        "--expert-tensor-parallel-size", size("--tensor-model-parallel-size")) \
        * size("--pipeline-model-parallel-size")
    return max(8, math.lcm(model, expert))


def check(sets):
    """``{name: list of problem lines}`` (empty: accepted)."""
    results = {}
    for name, argv in sets.items():
        try:
            parse_args(argv, world_size=_world_size(argv))
            results[name] = []
        except ValueError as error:
            results[name] = getattr(error, "lines", None) or [str(error)]
    return results


def _kind(line):
    """The flag or rule a problem line is about (its first flag, or its first words)."""
    match = re.match(r"(?:argument )?(--[a-z0-9_-]+)", line)
    if line.startswith("unrecognized arguments"):
        return "unknown flag"
    return match.group(1) if match else " ".join(line.split()[:4])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("megatron_root")
    parser.add_argument("--json", default=None, help="write every set's problems here")
    args = parser.parse_args()
    results = check(flag_sets(args.megatron_root))
    accepted = sum(not lines for lines in results.values())
    kinds = collections.Counter(k for lines in results.values() for k in {_kind(l) for l in lines})
    only = collections.Counter(_kind(lines[0]) for lines in results.values() if len(lines) == 1)
    print(f"flag sets: {len(results)}, accepted: {accepted}")
    print("sets meeting each problem (and, in brackets, the sets it alone stops):")
    for kind, count in kinds.most_common():
        print(f"  {count:4d} ({only.get(kind, 0):3d})  {kind}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"accepted": accepted, "sets": results}, file, indent=1)


if __name__ == "__main__":
    main()
