# Sourced by scripts/main.sh and scripts/test.sh: make sure the project's virtual environment
# (.venv at the repository root) exists and holds megatron_cp and what it needs, then
# activate it. Only Python >= 3.10 is required on the machine.
#
# torch goes in first, pinned to its CPU build (torch==2.13.0), so that no later requirement
# pulls the multi-gigabyte CUDA wheels. On a GPU machine, install the CUDA build of torch into
# .venv before the first run (python3 -m venv .venv && .venv/bin/pip install torch): a torch
# that already imports is kept. MEGATRON_CP_VENV picks another folder; MEGATRON_CP_PYTHON
# another interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_CP_VENV:-$ROOT/.venv}"
PYTHON="${MEGATRON_CP_PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: $PYTHON is not Python >= 3.10; set MEGATRON_CP_PYTHON to one" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "> creating the virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
pip() { python -m pip --disable-pip-version-check "$@"; }
if ! python -c "import torch" 2>/dev/null; then
    echo "> installing $TORCH_PIN (CPU build) into $VENV"
    pip install --quiet "$TORCH_PIN"
fi
# Reinstall the project when setup.py changed since the last install.
STAMP="$VENV/.megatron_cp_setup"
WANT="$(cksum < "$ROOT/setup.py")"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "> installing megatron_cp and its requirements into $VENV"
    pip install --quiet -e "$ROOT[dev]"
    echo "$WANT" > "$STAMP"
fi
# The scripts (tools/, benchmarks/, tasks/) import megatron_cp as an installed package, never
# through a path of their own: make sure the environment's editable install is this checkout's
# (a .venv copied from, or shared with, another checkout points elsewhere). -I: what the
# environment holds, not the megatron_cp/ of the current folder. --no-deps: nothing else moves.
HERE="$(python -I -c 'import megatron_cp, os; print(os.path.dirname(os.path.dirname(os.path.abspath(megatron_cp.__file__))))' 2>/dev/null || true)"
if [ "$HERE" != "$ROOT" ]; then
    echo "> installing megatron_cp from $ROOT (editable, --no-deps) into $VENV"
    pip install --quiet --no-deps --no-build-isolation -e "$ROOT"
fi
# megatron-core itself, for the tests that check Megatron-LM checkpoints in and out against it
# (tests/checkpoint/test_megatron_lm_checkpoints.py); test-only, never a runtime dependency. --no-deps:
# its requirements would pull another torch.
MCORE_PIN="megatron-core==0.16.1"
if ! python -c 'import importlib.metadata as m, sys; sys.exit(m.version("megatron-core") != "0.16.1")' 2>/dev/null; then
    echo "> installing $MCORE_PIN (tests only, --no-deps) into $VENV"
    pip install --quiet --no-deps "$MCORE_PIN"
fi
# einops: megatron-core's Megatron-FSDP builds its device meshes with it
# (tests/parity/test_megatron_fsdp.py saves a checkpoint with it); test-only as well
if ! python -c 'import einops' 2>/dev/null; then
    echo "> installing einops==0.8.2 (tests only) into $VENV"
    pip install --quiet --no-deps "einops==0.8.2"
fi
# torchao: tests/fp8/test_linear.py and benchmarks/fp8.py compare our FP8 linear with its
# Float8Linear (convert_to_float8_training); test-only. --no-deps: it needs only torch.
if ! python -c 'import importlib.metadata as m, sys; sys.exit(m.version("torchao") != "0.18.0")' 2>/dev/null; then
    echo "> installing torchao==0.18.0 (tests only, --no-deps) into $VENV"
    pip install --quiet --no-deps "torchao==0.18.0"
fi
# flash-linear-attention's ops (fla-core, what setup.py's "gpu" extra pins) and Triton, which
# FLA imports, for tests/layers/test_fla_call.py only: it calls FLA's own entry point through
# megatron_cp's route in a subprocess that puts this folder on its path. Not in the environment
# itself: transformers' Qwen3-Next would then run FLA's Triton kernels, which fail on CPU.
# --no-deps: fla-core's extras would pull torch.
FLA_TEST="$VENV/fla-test"
if [ ! -d "$FLA_TEST/fla_core-0.6.0.dist-info" ] || [ ! -d "$FLA_TEST/triton-3.5.1.dist-info" ]; then
    echo "> installing fla-core==0.6.0 and triton==3.5.1 (tests only, --no-deps) into $FLA_TEST"
    pip install --quiet --target "$FLA_TEST" --upgrade --no-deps "fla-core==0.6.0" "triton==3.5.1"
fi
cd "$ROOT"
