#!/usr/bin/env bash
# The whole test suite on a fresh machine (installs first: the test install, with the test and
# serve extras, into $VENV, default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV="${VENV:-.venv}"
bash scripts/setup.sh --test
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/pytest" tests "$@"
