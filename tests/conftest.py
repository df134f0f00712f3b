"""Shared pytest setup. The package, the test helpers (dist_harness, training_utils, ...) and
the tool scripts are found through pytest.ini's ``pythonpath`` (the repository root, tests/ and
tools/), nothing here touches the import path."""
import os

# torch.compile's kernel cache lives under /tmp by default and outlives a run; kernels built
# for another CPU capability (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine) were found to
# be reused from it and to give NaN. Each test session compiles into its own folder
# (inherited by the worker processes) unless the caller chose one.
_OWN_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile
    _OWN_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="megatron_cp_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _OWN_INDUCTOR_CACHE

# Under pytest-xdist (scripts/test.sh runs two workers) each worker gets its own default
# MASTER_PORT, so one-process runs that start torch.distributed at the default port (29500)
# in two workers at once do not collide; tests that pick a free port set their own.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and "MASTER_PORT" not in os.environ:
    os.environ["MASTER_PORT"] = str(29500 + 100 * (int(_XDIST_WORKER[2:]) + 1))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_INDUCTOR_CACHE:
        import shutil
        shutil.rmtree(_OWN_INDUCTOR_CACHE, ignore_errors=True)
