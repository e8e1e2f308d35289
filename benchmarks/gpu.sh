#!/usr/bin/env bash
# GPU checks and figures, on a CUDA machine whose python3 has JAX with its CUDA plugin (e.g. the
# device tool's H200; packages it lacks travel as wheels, see below). From the repo root:
#   bash benchmarks/gpu.sh            (outputs under $OUT, default /tmp/gpu_out)
# 1. gpu_step.py: the RL step and the decode step (Qwen2.5-0.5B shapes) planned by XLA:GPU
#    deviceless and compiled on the GPU, run: memory planned vs measured, time vs floor, cuDNN
#    flash attention in the step against the dense path;
# 2. the attention tests that only run on a GPU (cuDNN flash against the dense path);
# 3. bench_utilisation.py: MFU of an update and bandwidth use of decode against the roofline
#    measured in the same process.
# Wheels: `pip download` the core dependencies the image lacks into .whl/ (the device README
# says how), carry .whl, and export WHEELS=.whl: they are installed into /tmp/site first.
# Each part runs even when an earlier one fails; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package as an install lays it out (jaxrl_tools.models is models/, ...), without pip.
pkg="$(mktemp -d)"
cp -r jaxrl_tools "$pkg/"
for d in models sharding tools configs; do cp -r "$d" "$pkg/jaxrl_tools/$d"; done
export PYTHONPATH="$pkg:$PYTHONPATH" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$PY" -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', d; print(jax.__version__, d.device_kind)" \
  | tee -a "$out/gpu.txt" || exit 1
parts=" ${PARTS:-gpu_step attention utilisation} "  # a subset: PARTS="attention"
part() {  # part NAME SECONDS COMMAND...: its output in $out/NAME.log
  local name="$1" seconds="$2"
  shift 2
  [[ "$parts" == *" $name "* ]] || return 0
  echo "== $name"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" || { s=$?; echo "== $name: exit $s"; [ $status -ne 0 ] || status=$s; }
}
part gpu_step 240 "$PY" benchmarks/gpu_step.py --json "$out/gpu_step.json"
# a larger model with per-layer remat: the plan against the device's peak once more
part gpu_step_remat 200 "$PY" benchmarks/gpu_step.py --model qwen2.5-1.5b --remat --rows 16 \
  --seq-len 4096 --micro 4 --slots 64 --cache-len 4096 --json "$out/gpu_step_remat.json"
part attention 120 "$PY" -P -m pytest -q -p no:cacheprovider tests/test_models_attention.py \
  -k "cudnn or chunked_equals_dense"
part utilisation 180 "$PY" benchmarks/bench_utilisation.py --dtype bfloat16 --seqs 16 \
  --seq-len 2048 --micro 4 --steps 5 --decode-batches 1,64,256 --new-tokens 128
exit $status
