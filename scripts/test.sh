#!/usr/bin/env bash
# The whole test suite on a fresh machine (installs first: the test install, with the test and
# serve extras, into $VENV, default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV="${VENV:-.venv}"
bash scripts/setup.sh --test
# The suite runs on the CPU: with libtpu and the CUDA plugin installed (the aot extras), jax would
# otherwise try to start a TPU and a GPU backend in every process. The target-compiler tests
# compile for them without starting them.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# One worker per core (at most 4: each holds a JAX runtime); a file's tests stay on one worker,
# so a module's expensive fixture (an 8-device run, a trained tokenizer) is built once. Files are
# handed out in tests/conftest.py's order, longest first: xdist's own reorder (by test count)
# started the longest file, test_multihost.py, 30 minutes into the run. --durations: where the
# time goes, in the CI log.
"$VENV/bin/pytest" -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=25 tests "$@"
