#!/usr/bin/env bash
# Creates .venv with every dependency, pinned. torch comes first from the CPU wheel on disk,
# so nothing below pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# The worker image's versions (deploy/requirements.lock) wherever the lock has the package, so the
# tests run on what the images ship; the test tools' own dependencies resolve freely.
python -m pip install -q -e ".[dev]" -c deploy/requirements.lock
