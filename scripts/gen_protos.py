"""Generate the Python gRPC stubs from protos/ into valora/ (the proto package path).

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 if the committed stubs are stale
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED_DIRS = ("valora/v1", "valora/internal/v1")


def generate(out: Path) -> None:
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"-I{well_known}",
         f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos],
        check=True,
    )
    for d in GENERATED_DIRS:
        (out / d / "__init__.py").touch()
    (out / "valora/internal/__init__.py").touch()


def main() -> int:
    check = "--check" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        generate(tmp_path)
        stale = []
        for d in GENERATED_DIRS:
            fresh, committed = tmp_path / d, ROOT / d
            cmp = filecmp.dircmp(fresh, committed) if committed.exists() else None
            if cmp is None or cmp.left_only or cmp.right_only or cmp.diff_files:
                stale.append(d)
            if not check:
                shutil.rmtree(committed, ignore_errors=True)
                shutil.copytree(fresh, committed)
        if not check:
            shutil.copy(tmp_path / "valora/internal/__init__.py", ROOT / "valora/internal/__init__.py")
    if check and stale:
        print(f"stale generated stubs in {stale}: run python scripts/gen_protos.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
