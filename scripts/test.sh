#!/usr/bin/env bash
# The tests, from a fresh machine: set up .venv when needed (scripts/env.sh), then run pytest
# (extra arguments pass through, e.g. bash scripts/test.sh tests/parity/test_gpt_model.py -x).
# Two pytest-xdist workers share the tests, a test file at a time (MEGATRON_CP_TEST_WORKERS
# sets how many; 0 runs them in this process): while one test's ranks start up or wait on
# each other, the other worker's run.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -c "import torch; print('torch', torch.__version__)"
exec python -m pytest -q -n "${MEGATRON_CP_TEST_WORKERS:-2}" --dist loadfile "$@"
