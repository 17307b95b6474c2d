"""The import rules docs/CONTRIBUTING.md states, checked: a service imports services/common/, the
generated stubs (valora_protos, their own package) and its own package, never another service;
services/common/ imports no service; the stubs import only protobuf and grpc, and nothing imports
them from the client package (valora/); kernels/ imports no service, no gRPC and no API stubs;
gateway, scheduler, adapter_store and the client SDK load no torch (nor transformers, peft). That
the client and the CLI's client commands run on the base install (pyproject's dependencies, no
extra) is tests/unit/test_packaging.py's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler", "adapter_store", "worker", "generator")
STUBS = "valora_protos"
# Every directory holding Python of ours (the stubs' own package too).
CODE = ("valora", STUBS, "services", "kernels", "bench", "scripts", "tests")


def imports(path: Path) -> list[tuple[str, int]]:
    """Every absolute import of a file (function-level ones too), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def violations(directory: Path, refused) -> list[str]:
    return [f"{f.relative_to(REPO)}:{line} imports {mod}" for f in sorted(directory.rglob("*.py"))
            for mod, line in imports(f) if refused(mod.split("."))]


def test_no_service_imports_another():
    bad = []
    for svc in SERVICES:
        bad += violations(REPO / "services" / svc,
                          lambda p, svc=svc: p[0] == "services" and len(p) > 1 and p[1] not in (svc, "common"))
    bad += violations(REPO / "services" / "common", lambda p: p[0] == "services" and len(p) > 1 and p[1] != "common")
    assert not bad, "\n".join(bad)


def test_the_sdk_imports_no_service():
    """The SDK modules stand alone (the CLI and valora.cluster start services; tile_tables is a tool)."""
    sdk = [REPO / "valora" / name for name in ("client.py", "aio.py", "errors.py", "internal_token.py")]
    bad = [f"{f.relative_to(REPO)}:{line} imports {mod}" for f in sdk for mod, line in imports(f)
           if mod.split(".")[0] in ("services", "kernels", "torch")]
    assert not bad, "\n".join(bad)


def test_kernels_import_no_service_api():
    bad = violations(REPO / "kernels", lambda p: p[0] in ("services", "valora", STUBS, "grpc"))
    assert not bad, "\n".join(bad)


def test_the_stubs_import_only_protobuf_grpc_and_themselves():
    """valora_protos is the bottom layer: the SDK and the services import it, it imports neither."""
    bad = violations(REPO / STUBS, lambda p: p[0] not in (STUBS, "google", "grpc", "warnings", "__future__"))
    assert not bad, "\n".join(bad)
    assert [f.name for f in (REPO / STUBS).rglob("*_pb2.py")], "no generated stubs in valora_protos/"


def test_the_stubs_live_outside_the_client_package():
    """No generated module under valora/ and no import of the stubs' old home (valora.v1,
    valora.internal.v1): a service reaching its API through the SDK's package is what this forbids."""
    generated = sorted(str(f.relative_to(REPO)) for f in (REPO / "valora").rglob("*_pb2*.py"))
    assert not generated, generated
    bad = []
    for top in CODE:
        bad += violations(REPO / top, lambda p: p[0] == "valora" and len(p) > 1 and p[1] in ("v1", "internal"))
    assert not bad, "\n".join(bad)


def test_control_plane_and_sdk_load_no_torch():
    code = ("import sys; import services.gateway.server, services.scheduler.server, services.adapter_store.server, "
            "services.worker.config, valora.client, valora.aio; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_scanner_sees_function_level_imports(tmp_path):
    (tmp_path / "m.py").write_text("import os\ndef f():\n    from services.worker.engine import Engine\n"
                                   "    from . import sibling\n")
    assert imports(tmp_path / "m.py") == [("os", 1), ("services.worker.engine", 3)]


def test_one_mode_enum_and_its_proto_round_trip():
    """Mode is defined once (services/common/modes.py) and converts to valora.v1.InferenceMode and
    back for every value; an unknown proto value reads as UNKNOWN."""
    from services.common.modes import Mode

    defined = [f.relative_to(REPO) for f in sorted((REPO / "services").rglob("*.py"))
               if any(isinstance(n, ast.ClassDef) and n.name == "Mode" for n in ast.walk(ast.parse(f.read_text())))]
    assert defined == [Path("services/common/modes.py")]
    assert all(Mode.from_pb(m.to_pb()) is m for m in Mode)
    assert Mode.from_pb(999) is Mode.UNKNOWN


def test_package_maps_list_every_module():
    """A package whose docstring maps its modules (`    name.py  what it holds`) lists all of them:
    a newcomer reads the map first, and a module missing there is one nobody finds."""
    import re

    missing = []
    for init in sorted([*REPO.glob("services/**/__init__.py"), REPO / "valora" / "cli" / "__init__.py"]):
        doc = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
        listed = set(re.findall(r"^ {4}([a-z_0-9]+\.py)\b", doc, re.M))
        if not listed:
            continue
        missing += [f"{init.parent.relative_to(REPO)}/{f.name}" for f in sorted(init.parent.glob("*.py"))
                    if f.name != "__init__.py" and f.name not in listed]
    assert not missing, f"not in their package's map: {missing}"
