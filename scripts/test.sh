#!/usr/bin/env bash
# The tests, from a fresh machine: set up .venv when needed (scripts/env.sh), then run pytest
# (extra arguments pass through, e.g. bash scripts/test.sh tests/test_gpt_model.py -x).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -c "import torch; print('torch', torch.__version__)"
exec python -m pytest -q "$@"
