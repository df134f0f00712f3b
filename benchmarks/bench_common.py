"""What every benchmark shares: where its JSON goes and how it states its verdict.

Results go to ``runs/benchmarks/<name>.json`` (untracked: /runs/ is in .gitignore) unless
``--output PATH`` says otherwise, so a run never overwrites the committed figures in
``benchmarks/results/``; pass ``--output benchmarks/results/<name>.json`` to update them.
Each benchmark prints PASS or FAIL against the goal stated in its docstring.
"""
import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "runs", "benchmarks")


def default_output(name):
    """The untracked default JSON path of benchmark ``name``."""
    return os.path.join(RESULTS_DIR, f"{name}.json")


def add_output_argument(parser, name):
    """``--output PATH`` with the untracked default of benchmark ``name``."""
    parser.add_argument("--output", default=default_output(name),
                        help=f"where the JSON goes (default runs/benchmarks/{name}.json, untracked; "
                             f"benchmarks/results/{name}.json holds the committed figures)")


def verdict(passed):
    """'PASS' or 'FAIL'."""
    return "PASS" if passed else "FAIL"


def write_json(path, data):
    """Write ``data`` to ``path`` (creating its folder) and say where it went."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")


def min_thread_time(fn, repeats, warmup=0):
    """Min CPU time of this thread over ``repeats`` calls of ``fn`` after ``warmup`` calls
    (time the thread spends descheduled does not count: steadier on a shared machine)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def layer_fwd_bwd_time(layer, s, hidden, repeats):
    """Min thread seconds of forward + backward of a token mixer ``layer(x [s, 1, hidden],
    positions [1, s])`` (batch 1, fp32, gradients set to None before each)."""
    import torch

    x = torch.randn(s, 1, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    positions = torch.arange(s)[None]

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x, positions).sum().backward()
    return min_thread_time(step, repeats, warmup=1)
