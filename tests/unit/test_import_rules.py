"""The import rules docs/CONTRIBUTING.md states, checked: no import cycles; a service imports
services/common/, the generated stubs (valora_protos, their own package) and its own package,
never another service; services/common/ imports no service; the stubs import only protobuf and grpc, and nothing imports
them from the client package (valora/); kernels/ imports no service, no gRPC and no API stubs;
gateway, scheduler, adapter_store and the client SDK load no torch (nor transformers, peft). That
the client and the CLI's client commands run on the base install (pyproject's dependencies, no
extra) is tests/unit/test_packaging.py's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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
    return [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in sorted(directory.rglob("*.py"))
        for mod, line in imports(f)
        if refused(mod.split("."))
    ]


def test_no_service_imports_another():
    bad = []
    for svc in SERVICES:
        bad += violations(
            REPO / "services" / svc,
            lambda p, svc=svc: p[0] == "services" and len(p) > 1 and p[1] not in (svc, "common"),
        )
    bad += violations(REPO / "services" / "common", lambda p: p[0] == "services" and len(p) > 1 and p[1] != "common")
    assert not bad, "\n".join(bad)


def test_the_sdk_imports_no_service():
    """The SDK modules stand alone (the CLI and valora.cluster start services; tile_tables is a tool)."""
    sdk = [REPO / "valora" / name for name in ("client.py", "aio.py", "errors.py", "internal_token.py")]
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in sdk
        for mod, line in imports(f)
        if mod.split(".")[0] in ("services", "kernels", "torch")
    ]
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
    code = (
        "import sys; import services.gateway.server, services.scheduler.server, services.adapter_store.server, "
        "services.worker.config, valora.client, valora.aio; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_scanner_sees_function_level_imports(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\ndef f():\n    from services.worker.engine import Engine\n    from . import sibling\n"
    )
    assert imports(tmp_path / "m.py") == [("os", 1), ("services.worker.engine", 3)]


def test_one_mode_enum_and_its_proto_round_trip():
    """Mode is defined once (services/common/modes.py) and converts to valora.v1.InferenceMode and
    back for every value; an unknown proto value reads as UNKNOWN."""
    from services.common.modes import Mode

    defined = [
        f.relative_to(REPO)
        for f in sorted((REPO / "services").rglob("*.py"))
        if any(isinstance(n, ast.ClassDef) and n.name == "Mode" for n in ast.walk(ast.parse(f.read_text())))
    ]
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
        missing += [
            f"{init.parent.relative_to(REPO)}/{f.name}"
            for f in sorted(init.parent.glob("*.py"))
            if f.name != "__init__.py" and f.name not in listed
        ]
    assert not missing, f"not in their package's map: {missing}"


# The client package's imports of server-side code that stay, each with why.
CLIENT_EXCEPTIONS = {
    ("valora/tile_tables.py", "kernels"): "the tile-table push tool, bound for the CLI or bench/ (issue 25)",
    ("valora/cluster.py", "torch"): "`valora up --device cuda` counts GPUs with torch when nvidia-smi is missing",
}


def test_the_client_package_reaches_server_code_through_entry_points():
    """valora/ (the SDK, the CLI, valora.cluster) imports nothing of services/, kernels/ or bench/,
    nor torch: the server code `bench sched`, `demo`, `up` and `generate --dataset` run is an entry
    point of group valora.server (valora/server_code.py), so the client installs without it."""
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in sorted((REPO / "valora").rglob("*.py"))
        for mod, line in imports(f)
        if mod.split(".")[0] in ("services", "kernels", "bench", "torch")
        and (f.relative_to(REPO).as_posix(), mod.split(".")[0]) not in CLIENT_EXCEPTIONS
    ]
    assert not bad, "\n".join(bad)


def test_every_server_entry_point_resolves_and_every_one_used_is_declared():
    """Each of pyproject's valora.server entry points imports here (read from pyproject, not the
    installed metadata, which an editable install only refreshes on reinstall), and every name
    the client package loads is one of them."""
    import importlib
    import tomllib

    from valora.cluster import SETTINGS_ENTRY_POINTS

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["valora.server"]
    for name, value in declared.items():
        module, _, attr = value.partition(":")
        assert module.split(".")[0] == "services", f"{name} = {value}: server code lives in services/"
        obj = importlib.import_module(module)
        if attr:
            assert hasattr(obj, attr), f"{name} = {value}: no {attr} in {module}"
    used = set(SETTINGS_ENTRY_POINTS.values())
    for f in sorted((REPO / "valora").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and (
                    getattr(node.func, "id", None) == "server_code"
                    or (
                        getattr(node.func, "attr", None) == "load"
                        and getattr(node.func.value, "id", None) in ("server_code", "code")
                    )
                )
            ):
                used.add(node.args[0].value)
    assert {"scheduler-sim", "demo", "worker-settings"} <= used, used
    assert used <= set(declared), f"loaded but not declared in pyproject: {sorted(used - set(declared))}"


def test_a_missing_entry_point_names_the_install():
    from valora import server_code

    with pytest.raises(server_code.ServerCodeMissing, match=r"pip install 'valora\[generator\]'"):
        server_code.load("no-such-entry-point", extra="generator")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(path: Path) -> list[str]:
    """The absolute imports a module runs when it is imported: module-level statements (inside
    try/if blocks too), not those in functions or under `if TYPE_CHECKING:`."""
    found: list[str] = []

    def walk(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append(node.module)
                found.extend(f"{node.module}.{a.name}" for a in node.names)  # submodules by name
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    walk(block)

    walk(ast.parse(path.read_text(), str(path)).body)
    return found


def import_cycles(files: list[Path]) -> list[list[str]]:
    """The strongly connected components of more than one module in the load-time import graph
    of `files` (Tarjan), each sorted."""
    graph = {module_name(f): {m for m in load_time_imports(f)} for f in files}
    graph = {m: sorted(d for d in deps if d in graph and d != m) for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # recursion depth: the longest import chain (tens)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_import_cycles():
    """No two of our modules import each other at load time, directly or through others (a cycle
    makes import order matter and half-initialised modules possible)."""
    files = [f for d in CODE for f in sorted((REPO / d).rglob("*.py"))]
    assert not import_cycles(files)


def test_the_cycle_finder_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc import b\n")
    (pkg / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import cyc.c\nimport cyc.c\n")
    (pkg / "c.py").write_text("def f():\n    import cyc.a\n")  # function-level: no load-time edge
    (pkg / "d.py").write_text("try:\n    import cyc.e\nexcept ImportError:\n    pass\n")
    (pkg / "e.py").write_text("from cyc.d import x\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_cycles(sorted(pkg.glob("*.py"))) == [["cyc.d", "cyc.e"]]
