#!/usr/bin/env bash
# N local CPU processes of one jaxrl-tools job on 127.0.0.1 (multi-host testing on one machine).
#
#   scripts/launch_local.sh N SUBCOMMAND [args...]
#   scripts/launch_local.sh 2 train --config grpo_tool_math trainer.mesh=2x2x2
#
# Each process gets DEVICES_PER_PROCESS simulated CPU devices (default 4), so the job sees
# N x DEVICES_PER_PROCESS devices; set trainer.mesh to a shape of that size. Process 0's output
# goes to the console, the others' to LOG_DIR/process_I.log (default runs/launch_local). The
# script exits with the first non-zero status of any process (and stops the others).
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: $0 N SUBCOMMAND [args...]   (N local processes, e.g. $0 2 train --config X)" >&2
  exit 2
fi
N=$1
shift
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-4}
LOG_DIR=${LOG_DIR:-runs/launch_local}
JAXRL_TOOLS=${JAXRL_TOOLS:-jaxrl-tools}
if [[ -z "${PORT:-}" ]]; then
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
mkdir -p "$LOG_DIR"
export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES_PER_PROCESS"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

for ((i = 0; i < N; i++)); do
  cmd=("$JAXRL_TOOLS" "$@" --coordinator "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i")
  if ((i == 0)); then
    "${cmd[@]}" &
  else
    "${cmd[@]}" >"$LOG_DIR/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

status=0
for ((k = 0; k < N; k++)); do
  # the first process to end decides: a failure stops the rest instead of leaving them waiting
  if ! wait -n; then
    status=1
    break
  fi
done
if ((status != 0)); then
  echo "launch_local: a process failed; logs of processes 1..$((N - 1)) are in $LOG_DIR" >&2
  exit 1
fi
trap - EXIT
