"""FLA called right: tests/fla_call_checks.py (megatron_cp's call of flash-linear-attention's
``chunk_gated_delta_rule`` through FLA's real entry point, on CPU) run in a subprocess.

FLA is installed for the tests into a folder of its own, ``<venv>/fla-test`` (scripts/env.sh:
fla-core and Triton, which FLA imports, with ``pip install --target``), that only that
subprocess puts on its path. Installed into the environment itself, FLA would be importable by
every test: transformers' Qwen3-Next then runs FLA's Triton kernels, which fail on CPU
(tests/inference/test_gdn_generation.py's comparisons with transformers). Where the folder is missing
the test fails, saying how to make it.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLA_PATH = os.environ.get("MEGATRON_CP_FLA_PATH", os.path.join(sys.prefix, "fla-test"))
PINS = ("fla-core==0.6.0", "triton==3.5.1")  # scripts/env.sh installs these


def test_fla_call_checks_pass_with_fla_importable():
    installed = ("fla_core-0.6.0.dist-info", "triton-3.5.1.dist-info")
    if not all(os.path.isdir(os.path.join(FLA_PATH, name)) for name in installed):
        pytest.fail(f"FLA for the tests is not installed in {FLA_PATH}: bash scripts/test.sh "
                    f"installs it (scripts/env.sh), or: pip install --target {FLA_PATH} "
                    f"--upgrade --no-deps {' '.join(PINS)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FLA_PATH, ROOT]))
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(ROOT, "tests", "fla_call_checks.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = result.stdout[-12000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]  # all passed: none skipped
    assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in .*", summary), report
