#!/usr/bin/env bash
# Installs what the tests need, then runs the static checks and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
# PostgreSQL is started by the machine; start it if it is down.
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
fi
python scripts/gen_protos.py --check
ruff check .  # pyflakes and line length (pyproject.toml [tool.ruff])
ruff format --check .  # one layout; `ruff format .` writes it
if [ -d examples/node ]; then (cd examples/node && npm ci --silent --no-audit --no-fund); fi
if ! command -v buf >/dev/null; then npm install -g --silent @bufbuild/buf@1; fi
# Debian's gRPC for the C++ client test; its skip reason says why when apt cannot install.
bash scripts/install_cpp.sh || echo "scripts/install_cpp.sh failed: the C++ client tests will skip" >&2
(cd protos && buf lint)
python -m pytest -q "$@"
