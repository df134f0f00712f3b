"""How many of Megatron-LM's own flag sets megatron_cp's pretrain_gpt.py accepts, and trains.

    python tools/megatron_flag_sets.py /path/to/Megatron-LM [--json out.json]
    python tools/megatron_flag_sets.py /path/to/Megatron-LM --run [--only REGEX] [--json out.json]

Reads the MODEL_ARGS of Megatron-LM's GPT, MoE and Mixtral pretraining functional tests
(tests/functional_tests/test_cases/{gpt,moe,mixtral}/*/model_config.yaml; the inference and
RL ones run other entry points) and the flags of its GPT launch examples (EXAMPLES: each script
runs under bash with ``torchrun`` replaced by a function that prints its arguments), and parses
each
set with megatron_cp's arguments, as a user switching over would run it: the data mocked
(``--mock-data``, NullTokenizer; a set with ``--fim-data`` gets a small real corpus instead,
tools/fim_corpus.py), the paths dropped, the world size the one the set's parallel
sizes need. Prints how many sets are accepted, how many problems of each kind the others
meet, and writes the details as JSON when asked.

With ``--run``, every accepted set then trains for 3 iterations on CPU (gloo, on this machine;
its ranks forked from one process by tools/fork_launch.py, or started by torchrun with
``--launcher torchrun``) with its sizes shrunk (``shrink``: widths, sequence and batch sizes;
layer counts, expert counts and parallel sizes stay), and a table says which ran and why the
others stopped; PASS when at least GOAL sets train. The two sets that inject a persistent
error are counted apart when they stop as their test expects (flag_set_runs.stops_as_written).
``--json`` is rewritten after every set, and ``--resume`` takes such a file to run only the
sets it lacks.
"""
import argparse
import collections
import glob
import json
import os
import re
import subprocess
import tempfile

import yaml

from megatron_cp.cli.arguments import build_parser, parse_args
from flag_set_runs import (LAUNCHERS, parallel_sizes, path_flags, run,
                                 with_data)

GOAL = 200  # sets that must train unchanged (the bar, of 224 here)
# what tests/integration/test_megatron_flag_set_runs.py trains (spread over GPT and MoE tests, and
# over TP/PP/CP/DP/EP, virtual stages, recompute, the distributed optimizer, FSDP2,
# Megatron-FSDP) and sees refused
SAMPLE_TRAIN = (
    "gpt/gpt3_mcore_te_tp2_pp2_cp2",
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline",
    "gpt/gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic",
    "gpt/gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt/gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode", "gpt/gpt3_mcore_reruns_enable",
    "gpt/gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute",
    "gpt/gpt3_mcore_te_tp2_pp1_cp2_nondeterministic", "gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings",
    "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer",
    "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4",
    "gpt/gpt3_mcore_te_tp1_pp1_mup", "gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset",
    # (the --use-torch-fsdp2 sets: tests/parity/test_fsdp2.py and the census)
    "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor")
SAMPLE_REFUSE = ("examples/train_llama3_8b_h100_fp8",
                 "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph")

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
    single = _single_value_flags()
    sets = {}
    for family in ("gpt", "moe", "mixtral"):
        for path in sorted(glob.glob(pattern.replace("{gpt,moe,mixtral}", family))):
            with open(path) as file:
                config = yaml.safe_load(file) or {}
            name = os.path.basename(os.path.dirname(path))
            if config.get("MODE", "pretraining") != "pretraining" or "inference" in name:
                continue  # inference and RL tests run other entry points
            args = config.get("MODEL_ARGS") or {}
            sets[f"{family}/{name}"] = _argv(args, single)
            gpus = ((config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE")
            if gpus:  # the harness's world size for this MODEL_ARGS
                GPUS[f"{family}/{name}"] = int(gpus)
    return sets


# {set name: world size} of the configs that name theirs (MODEL_ENV_VARS: GPUS_PER_NODE)
GPUS = {}


# Megatron-LM's GPT pretraining launch scripts and the positional arguments they take (paths,
# dropped later). The others under examples/ need files or tools that are not here (gptoss: a
# checkpoint; megatron_fsdp: uv).
EXAMPLES = {"examples/gpt3/train_gpt3_175b_distributed.sh": ["ckpt", "tb", "vocab", "merge", "data"],
            "examples/mixtral/train_mixtral_8x7b_distributed.sh": ["ckpt", "tb", "tok", "data"],
            "examples/llama/train_llama3_8b_h100_fp8.sh": []}
_PRINT_TORCHRUN = 'torchrun() { printf "%s\\0" "$@"; exit 0; }; export -f torchrun; bash ./run.sh "$@"'


def example_sets(megatron_root):
    """``{example name: argv}`` of the launch scripts in EXAMPLES, as their torchrun would
    receive them (the script's own defaults and conditionals applied)."""
    single = _single_value_flags()
    sets = {}
    for path, positional in EXAMPLES.items():
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(megatron_root, path)) as source, \
                    open(os.path.join(folder, "run.sh"), "w") as script:
                script.write(source.read())
            open(os.path.join(folder, "pretrain_gpt.py"), "w").close()  # its existence check
            words = subprocess.run(["bash", "-c", _PRINT_TORCHRUN, "bash", *positional],
                                   cwd=folder, stdout=subprocess.PIPE, check=True,
                                   timeout=60).stdout.decode().split("\0")
        words = [w for w in words[words.index("pretrain_gpt.py") + 1:] if w]
        sets[f"examples/{os.path.basename(path)[:-3]}"] = _argv(_flag_values(words), single)
    return sets


def _flag_values(words):
    """``["--a", "1", "--b"]`` -> ``{"--a": "1", "--b": True}`` (several words: one value)."""
    values, flag = {}, None
    for word in words:
        if word.startswith("--"):
            flag = word
            values[flag] = True
        elif flag is not None:
            values[flag] = word if values[flag] is True else f"{values[flag]} {word}"
    return values


def _single_value_flags():
    return {o for a in build_parser()._actions for o in a.option_strings if a.nargs is None}


def _argv(model_args, single):
    """``model_args`` as command-line words; ``single``: the flags that take one value."""
    argv = []
    for flag, value in model_args.items():
        if flag in DROPPED:
            continue
        if value is True:
            argv.append(flag)
            continue
        if value is False or value is None:
            continue
        value = str(value).replace("${REPEAT}", "1")  # the harness's repeat number
        if value.startswith("[") and value.endswith("]"):  # the harness strips the brackets
            argv += [flag, *value[1:-1].replace(",", " ").split()]
        elif flag in single:  # one value, spaces and all ("0:384 200B:768")
            argv += [flag, str(value)]
        else:
            argv += [flag, *str(value).split()]
    return argv + MOCK


def check(sets):
    """``{name: list of problem lines}`` (empty: accepted)."""
    results = {}
    for name, argv in sets.items():
        try:
            # with the paths a run gets (tools/flag_set_runs.py): --save, --load, tensorboard
            folder = os.path.join(tempfile.gettempdir(), "flag_set_check")
            parse_args(with_data(argv, folder) + path_flags(folder),
                       world_size=parallel_sizes(argv, GPUS.get(name))[3])
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
    parser.add_argument("--run", action="store_true",
                        help="train every accepted set for 3 iterations (CPU, torchrun)")
    parser.add_argument("--only", default=None, help="with --run: the sets matching this regex")
    parser.add_argument("--workdir", default=None, help="with --run: where runs write "
                        "(default: a temporary folder)")
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="fork",
                        help="with --run: how the ranks start (fork: tools/fork_launch.py, "
                             "one import of torch for all ranks; torchrun: as users launch)")
    parser.add_argument("--resume", default=None, metavar="JSON",
                        help="with --run: keep the runs of this earlier --json and run the rest")
    parser.add_argument("--summary", default=None, metavar="JSON",
                        help="print the census table of an earlier --run --json file and stop")
    parser.add_argument("--write-sample", default=None, metavar="JSON",
                        help="write SAMPLE_TRAIN and SAMPLE_REFUSE's flag sets here (the data of "
                             "tests/integration/test_megatron_flag_set_runs.py) and stop")
    args = parser.parse_args()
    if args.summary:
        with open(args.summary) as file:
            report = json.load(file)
        return print(summary_table(len(report["sets"]), report["runs"]))
    if args.write_sample:
        return write_sample({**flag_sets(args.megatron_root), **example_sets(args.megatron_root)},
                            args.write_sample)
    sets = {**flag_sets(args.megatron_root), **example_sets(args.megatron_root)}
    if args.only:
        sets = {name: argv for name, argv in sets.items() if re.search(args.only, name)}
    results = check(sets)
    accepted = sum(not lines for lines in results.values())
    kinds = collections.Counter(k for lines in results.values() for k in {_kind(l) for l in lines})
    only = collections.Counter(_kind(lines[0]) for lines in results.values() if len(lines) == 1)
    print(f"flag sets: {len(results)}, accepted: {accepted}")
    print("sets meeting each problem (and, in brackets, the sets it alone stops):")
    for kind, count in kinds.most_common():
        print(f"  {count:4d} ({only.get(kind, 0):3d})  {kind}")
    report = {"accepted": accepted, "sets": results}
    if args.run:
        earlier = {}
        if args.resume:
            with open(args.resume) as file:
                earlier = json.load(file).get("runs", {})
        report["runs"] = _run_accepted(sets, results, args.workdir, args.launcher, earlier,
                                       lambda runs: _write(args.json, dict(report, runs=runs)))
    _write(args.json, report)


def _write(path, report):
    if path:
        with open(path, "w") as file:
            json.dump(report, file, indent=1)


def write_sample(sets, path):
    """The sets the tests train (SAMPLE_TRAIN) and see refused (SAMPLE_REFUSE, with the flags
    their lines name), as JSON at ``path``."""
    results = check(sets)
    refuse = {name: {"argv": sets[name], "flags": sorted({_kind(l) for l in results[name]})}
              for name in SAMPLE_REFUSE}
    with open(os.path.join(os.path.dirname(__file__), "..", "megatron_cp", "cli",
                           "megatron_lm_flags.json")) as file:
        commit = json.load(file)["commit"]
    with open(path, "w") as file:
        json.dump({"megatron_lm_commit": commit, "train": {n: sets[n] for n in SAMPLE_TRAIN},
                   "refuse": refuse}, file, indent=1)
        file.write("\n")


def _run_accepted(sets, results, workdir, launcher, earlier, save):
    """Train each accepted set (keeping the ``earlier`` runs of those, a resumed census);
    print one line per set and the table against GOAL; ``save(runs)`` after each set."""
    workdir = workdir or tempfile.mkdtemp(prefix="flag_sets_")
    runs = {}
    for name, argv in sets.items():
        if results[name]:
            continue
        if name in earlier:
            runs[name] = earlier[name]
            continue
        runs[name] = dict(run(argv, os.path.join(workdir, name.replace("/", "__")),
                              gpus=GPUS.get(name), launcher=launcher), launcher=launcher)
        if runs[name]["ok"]:  # the output's tail says why a run failed; a trained one keeps
            del runs[name]["tail"]  # its losses
        outcome = ("trained" if runs[name]["ok"] else
                   "stopped as written (the injected error, as its test expects)"
                   if runs[name].get("stopped_as_written") else
                   "FAILED: " + " | ".join(runs[name]["tail"][-3:]))
        print(f"{name}: {outcome} ({runs[name]['seconds']} s)", flush=True)
        save(runs)
    print("\n" + summary_table(len(sets), runs))
    return runs


def trained(run):
    """A set counts as trained when it ran to the end and its 3 losses are recorded."""
    losses = run.get("losses") or []
    return bool(run["ok"]) and len(losses) == run.get("iterations", 3) == 3


def counts(runs):
    """``{trained, stopped, failed}`` of the census ``runs`` (a run that ended without its
    losses recorded is failed: nothing shows it trained)."""
    done = sum(trained(r) for r in runs.values())
    stopped = sum(bool(r.get("stopped_as_written")) for r in runs.values())
    return {"trained": done, "stopped": stopped, "failed": len(runs) - done - stopped}


def summary_table(sets, runs):
    """The census table (printed in docs/megatron_lm_compatibility.md) of ``sets`` flag sets
    and the accepted ones' ``runs``."""
    c = counts(runs)
    return ("| sets | accepted | trained 3 iterations (losses recorded) | stopped as written | "
            "failed | goal | result |\n| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| {sets} | {len(runs)} | {c['trained']} | {c['stopped']} | {c['failed']} | {GOAL} | "
            f"{'PASS' if c['trained'] >= GOAL else 'FAIL'} |")


if __name__ == "__main__":
    main()
