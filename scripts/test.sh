#!/usr/bin/env bash
# The whole test suite on a fresh machine (installs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/pytest tests "$@"
