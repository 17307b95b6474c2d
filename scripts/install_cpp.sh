#!/usr/bin/env bash
# Installs the C++ example's toolchain (examples/cpp) from Debian's packages when any piece is
# missing: a no-op once they are there, 6-12 s from nothing (download included). Quiet
# unless apt fails; exits non-zero then, which the C++ e2e test reports as its skip reason.
set -euo pipefail
have() {
  for tool in c++ make pkg-config protoc grpc_cpp_plugin; do command -v "$tool" >/dev/null || return 1; done
  pkg-config --exists grpc++ protobuf
}
if have; then exit 0; fi
SUDO=()
if [ "$(id -u)" != 0 ]; then SUDO=(sudo -n); fi
PKGS=(libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc pkg-config g++ make)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
apt() {
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q=2 -y -o DPkg::Lock::Timeout=300 "$@" >>"$LOG" 2>&1
}
# A fresh machine may have no package lists yet (or stale ones): update once, then retry.
if ! apt install --no-install-recommends "${PKGS[@]}" \
    && ! { apt update && apt install --no-install-recommends "${PKGS[@]}"; }; then
  tail -n 5 "$LOG" >&2
  exit 1
fi
