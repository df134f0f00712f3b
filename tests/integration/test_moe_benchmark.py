"""benchmarks/moe.py runs end to end in its smallest mode (``--smoke``): exit status 0 (which
needs the dispatcher's all-to-all bytes to equal the routing-map formula exactly; the timing
verdicts of tiny sizes are not counted), the JSON written with every part, in under 60 s."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "moe.py")
LIMIT_S = 60


def test_moe_benchmark_smoke(tmp_path):
    output = tmp_path / "moe.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--output", str(output)], cwd=ROOT,
                          capture_output=True, text=True, timeout=LIMIT_S + 60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert elapsed < LIMIT_S, f"--smoke took {elapsed:.1f} s (limit {LIMIT_S} s)"
    data = json.loads(output.read_text())
    assert {"device", "torch", "smoke", "model", "goals", "training", "matmul", "checks",
            "passed"} <= set(data)
    assert data["smoke"] is True and data["passed"] is True
    training = {r["ep"]: r for r in data["training"]}
    assert set(training) == {1, 2}
    for r in training.values():
        assert {"tokens_per_s", "vs_ep1", "median_step_seconds", "rank0_last_step",
                "bytes_exact"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["bytes_exact"]
    sent = training[2]["rank0_last_step"]
    assert sent["measured_row_bytes"] == sent["exact_row_bytes"] > 0
    assert training[1]["rank0_last_step"]["measured_row_bytes"] == 0  # one rank sends nothing
    assert data["checks"]["dispatcher bytes = exact formula (every rank, step)"] is True
    for r in data["matmul"]:
        assert {"loop_s", "dense_s", "dense_tflops"} <= set(r)
        if r["grouped_mm"]:
            assert {"grouped_vs_loop", "grouped_vs_dense"} <= set(r)
            assert r["max_rel_diff"] < 1e-2  # bf16 rows included
    assert any(r["grouped_mm"] for r in data["matmul"])  # this torch has grouped_mm on the CPU
