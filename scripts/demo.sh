#!/usr/bin/env bash
# Installs valora into .venv, starts the local cluster (four processes on loopback, embedded
# defaults: SQLite + local blobs + the tiny Qwen2-VL built from a fixed seed), runs the demo
# workload through the gateway, prints the report, and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export VALORA_HOME="${VALORA_HOME:-$PWD/.valora}"
valora down >/dev/null 2>&1 || true
exec valora demo "$@"
