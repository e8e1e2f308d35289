#!/usr/bin/env bash
# GPU checks and figures, on a CUDA machine whose python3 has JAX with its CUDA plugin (e.g. the
# device tool's H200; packages it lacks travel as wheels, see below). From the repo root:
#   bash benchmarks/gpu.sh
# 1. the attention paths that only run on a GPU (cuDNN flash through
#    jax.nn.dot_product_attention) against the dense path, and the chunked path there too;
# 2. MFU of the GRPO update and HBM-bandwidth utilisation of decode, Qwen2.5-0.5B shapes,
#    bfloat16 compute over float32 master weights, against the roofline measured in the same
#    process (benchmarks/roofline.py).
# Wheels: `pip download` the core dependencies the image lacks into .whl/ (the device README
# says how), carry .whl, and export WHEELS=.whl: they are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', d; print(d.device_kind)"
"$PY" -m pytest -q -p no:cacheprovider tests/test_models_attention.py \
  -k "cudnn or chunked_equals_dense"
"$PY" benchmarks/bench_utilisation.py --dtype bfloat16 --seqs 16 --seq-len 2048 --micro 4 \
  --steps 5 --decode-batches 1,64,256 --new-tokens 128
