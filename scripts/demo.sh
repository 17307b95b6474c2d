#!/usr/bin/env bash
# Installs valora into .venv and runs `valora demo`: builds the tiny Qwen2-VL (fixed seed, no
# download), pretrains it briefly on real digits, generates adapters for a few vision tasks with
# the accuracy-aware greedy fusion (both cached in $VALORA_HOME, so a second run skips training),
# starts the local cluster on that base (four processes on loopback: SQLite + local blobs),
# registers the adapters and tasks through the gateway, sends the generator's whole test split
# (task-head label requests) mixed with text-generation requests, prints served accuracy per task
# (each served label checked against the generator's prediction for the same image) and latency
# per target, writes $VALORA_HOME/demo-report.json, and stops the cluster.
# `bash scripts/demo.sh --quick`: the old latency-only demo with random adapters (no training).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export VALORA_HOME="${VALORA_HOME:-$PWD/.valora}"
valora down >/dev/null 2>&1 || true
exec valora demo "$@"
