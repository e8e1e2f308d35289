#!/usr/bin/env bash
# Creates a venv ($VENV, default .venv) with the project installed.
#   scripts/setup.sh         the core install the README's demo runs in: no torch, no TensorFlow.
#   scripts/setup.sh --test  adds the test and serve extras (pytest, ruff, torch, JetStream), the
#                            agents, agent-sdks, mcp, trackers, openenv, verifiers and gguf
#                            extras (openai, the OpenAI Agents SDK, LangChain, smolagents, MCP,
#                            W&B, MLflow, OpenEnv, verifiers, gguf), and the compilers of
#                            `plan --accelerator` (aot-tpu: libtpu, +0.7 GB; aot-gpu: the jax
#                            CUDA plugin and cuDNN, about +2 GB).
# torch must be the local CPU build, installed before the test extra: `torch>=2.4` resolved by
# pip alone would fetch a multi-GB CUDA build. JetStream stays out of the core install because
# it pulls seqio -> TensorFlow (~2 GB) that training never imports.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"  # CI: a plain venv in a temp dir, the test extras added after the demo
if ! command -v bwrap >/dev/null 2>&1; then
  # bubblewrap isolates model-written code (tools/); Debian/Ubuntu package.
  (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
    || echo "warning: could not install bubblewrap; the Python tool will refuse to start" >&2
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if [ "${1:-}" = "--test" ]; then
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e '.[test,serve,aot-tpu,aot-gpu,agents,agent-sdks,mcp,trackers,openenv,verifiers,gguf]'
else
  "$VENV/bin/pip" install -q -e .
fi
