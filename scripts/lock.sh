#!/usr/bin/env bash
# Writes deploy/requirements.lock: every package of the worker image (pyproject's `generator` and
# `cuda` extras, the base requirements with them) at one version, torch and what only torch
# requires left out: the Dockerfile installs torch first, from PyTorch's index for its CUDA build,
# and that wheel brings its own. The cpu image installs `server` under the lock's versions (-c).
# Resolved by uv from PyPI, for every platform (markers) and Python >= 3.11 (the cpu image has
# 3.11, the worker image 3.12). Run it after changing a pin in pyproject.toml
# (tests/unit/test_packaging.py checks that each pin equals the lock's):
#   python3 -m venv /tmp/uv && /tmp/uv/bin/pip install uv==0.13.9 && UV=/tmp/uv/bin/uv bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# uv drops a requirement through an override that can never apply.
printf 'torch ; sys_platform == "never"\n' > "$tmp/no-torch.txt"
"$UV" pip compile pyproject.toml --extra generator --extra cuda --override "$tmp/no-torch.txt" \
  --universal --python-version 3.11 --no-header --quiet -o "$tmp/lock.txt"
{
  echo "# The worker image's packages, pinned: pyproject.toml's base requirements + the generator and"
  echo "# cuda extras, without torch (deploy/Dockerfile installs it first from PyTorch's CUDA index)."
  echo "# Written by scripts/lock.sh (uv pip compile --universal, Python >= 3.11); do not edit by hand."
  # leave out torch and the packages only it requires (marked to never apply), with their "# via" lines
  awk '/sys_platform == .never./ { skip = 1; next } skip && /^ +#/ { next } { skip = 0; print }' "$tmp/lock.txt"
} > "$tmp/requirements.lock"
# The worker image's torch (deploy/Dockerfile's TORCH_VERSION; PyPI's Linux wheel of it is the same
# CUDA build, with the same requirements) must resolve beside the lock on its Python (3.12).
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/Dockerfile)
grep -v '^ *#' "$tmp/requirements.lock" > "$tmp/pins.txt"
printf 'torch==%s\n-r pins.txt\n' "$torch_version" > "$tmp/with-torch.in"
"$UV" pip compile "$tmp/with-torch.in" --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --quiet -o "$tmp/with-torch.txt"
mv "$tmp/requirements.lock" deploy/requirements.lock
echo "wrote deploy/requirements.lock ($(grep -c '==' deploy/requirements.lock) packages)"
