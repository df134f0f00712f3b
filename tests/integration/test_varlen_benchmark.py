"""benchmarks/varlen.py runs end to end on a tiny configuration (stand-in corpus, 8 ranks) in
a few seconds, and its counts hold together: the attention FLOPs over all ranks are the
documents' causal pairs x FLOPs per pair in both layouts (independent of the layout), the
matmul FLOPs are FLOPs per token x the tokens held (every token once, padding less than
2 x the group per document), no rank's modelled work exceeds the step, and when every
sample is one full-length document both layouts take the same time."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "varlen.py")
TINY = ["--seq-length", "256", "--dp", "2", "--cp", "4", "--global-batch", "4", "--steps", "3",
        "--model", "64", "128", "2", "4", "2", "16", "1000", "--tail-median", "200",
        "--sweep", "0.0", "--configs", "512:2:2", "--cpu-iters", "0"]


def test_varlen_benchmark_smoke(tmp_path):
    output = tmp_path / "varlen.json"
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--output", str(output),
                           "--data-prefix", str(tmp_path / "absent")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "not measured (--cpu-iters 0)" in proc.stdout
    data = json.loads(output.read_text())
    assert {"config", "stream", "long_tail", "full_group", "measured_cpu_static_over_dynamic",
            "tail_fraction_sweep", "other_configs", "goals", "passed"} <= set(data)
    assert data["measured_cpu_static_over_dynamic"] is None
    assert data["passed"]["exact_counts"] is True
    assert data["config"]["corpus"] == "stand-in" and data["notes"]
    config = data["config"]
    per_token, per_pair = config["flops_per_token"], config["flops_per_pair"]
    pool = config["dp"] * config["cp"]
    for scenario in ("long_tail", "full_group"):
        for step in data[scenario]["steps"]:
            assert step["tokens"] == config["global_batch"] * config["seq_length"]
            for layout in ("static", "dynamic"):
                s = step[layout]
                assert s["total_attention_flops"] == per_pair * step["causal_pairs"]
                assert s["total_matmul_flops"] == per_token * s["padded_tokens"]
                assert 0 <= s["padded_tokens"] - step["tokens"] < step["documents"] * 2 * pool
                assert s["attention_flops"] * pool >= s["total_attention_flops"]
                assert s["mean_rank_seconds"] <= s["seconds"] <= s["step_seconds"] * (1 + 1e-12)
                assert s["cp_bytes"] >= 0
    full = data["full_group"]
    assert abs(full["static_over_dynamic"] - 1) < 1e-9
    long_tail = data["long_tail"]
    assert long_tail["static_over_dynamic"] == (long_tail["static_seconds"]
                                                / long_tail["dynamic_seconds"])
    assert set(data["other_configs"]) == {"S 512, DP 2 x CP 2, 2 samples"}
