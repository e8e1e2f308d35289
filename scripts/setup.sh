#!/usr/bin/env bash
# Creates .venv with the project installed. torch (CPU build, the PyTorch reference side of the
# parity tests) only with --test: it must be the local CPU build, installed before the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bwrap >/dev/null 2>&1; then
  # bubblewrap isolates model-written code (tools/); Debian/Ubuntu package.
  (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
    || echo "warning: could not install bubblewrap; the Python tool will refuse to start" >&2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
if [ "${1:-}" = "--test" ]; then
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test]'
else
  .venv/bin/pip install -q -e .
fi
