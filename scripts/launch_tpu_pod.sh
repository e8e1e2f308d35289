#!/usr/bin/env bash
# The same jaxrl-tools command on every worker of a TPU VM slice (one process per host).
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a scripts/launch_tpu_pod.sh train --config my.yaml
#
# JAX finds the slice's coordinator, process count and rank by itself on TPU VMs
# (JAXRL_DISTRIBUTED=auto). Every worker needs the same checkout and environment at REPO_DIR
# (default: this repository's path), and the run's data, tokenizer, model folder and
# trainer.checkpoint_dir on storage all workers see (a gs:// bucket for checkpoints, or an NFS /
# Filestore mount). Set PROJECT to pass --project. Extra gcloud ssh flags go in GCLOUD_SSH_FLAGS.
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM slice's name}"
: "${ZONE:?set ZONE to the slice's zone}"
if [[ $# -lt 1 ]]; then
  echo "usage: TPU_NAME=... ZONE=... $0 SUBCOMMAND [args...]" >&2
  exit 2
fi
REPO_DIR=${REPO_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
project=()
[[ -n "${PROJECT:-}" ]] && project=(--project "$PROJECT")

# The command, quoted for the remote shell.
remote="cd $(printf %q "$REPO_DIR") && JAXRL_DISTRIBUTED=auto .venv/bin/jaxrl-tools"
for arg in "$@"; do remote+=" $(printf %q "$arg")"; done

# shellcheck disable=SC2086
exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${project[@]}" --worker=all \
  ${GCLOUD_SSH_FLAGS:-} --command "$remote"
