"""Starts and stops a local valora cluster: the four services as separate processes on loopback.

Used by `valora up/down` and by the e2e tests. State (pids, ports, logs) lives in
`<home>/cluster.json`, so `valora down` from another shell finds the processes.
"""

from __future__ import annotations

import collections
import difflib
import itertools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_HOME = Path(os.environ.get("VALORA_HOME", Path.home() / ".cache" / "valora"))
STATE_FILE = "cluster.json"
# Start order; stopped in reverse.
SERVICES = ("adapter_store", "worker", "scheduler", "gateway")
STARTUP_TIMEOUT_S = 180.0  # start_cluster's default: seconds each service (the workers together) has to be SERVING


@dataclass
class ProcessInfo:
    service: str
    name: str
    pid: int
    port: int
    log: str
    # Prometheus /metrics port (VALORA_METRICS_PORT); 0 = none.
    metrics_port: int = 0
    # The gateway's OpenAI-compatible HTTP port (VALORA_HTTP_PORT); 0 for the other services.
    http_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class Cluster:
    home: str
    processes: list[ProcessInfo] = field(default_factory=list)
    # The services' shared internal token (services/common/internal_auth.py); "" = internal APIs open.
    internal_token: str = ""

    def channel(self, address: str, options=()) -> grpc.Channel:
        """A channel to one of the cluster's internal services (the store, scheduler, a worker)."""
        from valora.internal_token import with_token

        return with_token(grpc.insecure_channel(address, options=list(options)), self.internal_token)

    @property
    def gateway(self) -> str:
        return next(p.address for p in self.processes if p.service == "gateway")

    @property
    def http_url(self) -> str | None:
        """Base URL of the gateway's OpenAI-compatible API (ends in /v1); None when the gateway
        serves none (http_enabled false: no HTTP port recorded)."""
        gateway = next(p for p in self.processes if p.service == "gateway")
        return f"http://127.0.0.1:{gateway.http_port}/v1" if gateway.http_port else None

    def by_service(self, service: str) -> list[ProcessInfo]:
        return [p for p in self.processes if p.service == service]

    def save(self) -> None:
        """Atomically (temp file + rename): `valora status` or a test may read it while `up` writes."""
        path = Path(self.home, STATE_FILE)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the internal token
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, home: Path) -> "Cluster | None":
        path = Path(home, STATE_FILE)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(
            home=data["home"],
            processes=[ProcessInfo(**p) for p in data["processes"]],
            internal_token=data.get("internal_token", ""),
        )


class StartupError(RuntimeError):
    """A service of start_cluster did not become healthy (timed out or exited); the processes
    started were stopped before it was raised."""

    def __init__(self, service: str, name: str, log: str, message: str):
        super().__init__(message)
        self.service, self.name, self.log = service, name, log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_healthy(address: str, timeout_s: float, proc: subprocess.Popen | None = None, log: str = "") -> None:
    """Blocks until the server's overall health is SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                tail = Path(log).read_text()[-3000:] if log else ""
                raise RuntimeError(f"{address}: process exited with {proc.returncode}\n{tail}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s (log: {log})")
            time.sleep(0.2)


def wait_registered(scheduler: str, workers: int, timeout_s: float, token: str = "") -> None:
    """Blocks until the scheduler lists `workers` healthy workers (registered ones join at run time)."""
    from valora.internal_token import with_token
    from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with with_token(grpc.insecure_channel(scheduler), token) as channel:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            try:
                st = stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest(), timeout=1.0)
                if sum(w.healthy for w in st.workers) >= workers:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scheduler}: {workers} workers not registered after {timeout_s:.0f}s")
            time.sleep(0.2)


def default_model_path(home: Path) -> Path:
    return home / "models" / "tiny-qwen2-vl"


def ensure_model(model_path: Path) -> None:
    """The embedded default model: built once from a config with a fixed seed (no download)."""
    if not (model_path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "services.worker.tiny_model", str(model_path)], check=True)


WORKER_DEVICES = ("cpu", "cuda")
WORKER_DTYPES = ("float32", "bfloat16", "float16")


def visible_gpus() -> list[str]:
    """Ids of the GPUs this process may hand to its children (CUDA_VISIBLE_DEVICES values), found
    without creating a CUDA context here: the CUDA_VISIBLE_DEVICES list when it is set (up to a
    "-1" or an empty entry, as CUDA reads it), else one index per `nvidia-smi -L` GPU line, else
    torch.cuda.device_count() (NVML-based; no context), else none."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = []
        for x in (x.strip() for x in listed.split(",")):
            if not x or x == "-1":
                break
            ids.append(x)
        return ids
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return [str(i) for i in range(len(re.findall(r"^GPU \d+:", out.stdout, flags=re.M)))]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch  # last resort, only for CUDA workers
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def worker_device_env(
    workers: int, device: str = "cpu", dtype: str = "float32", gpu_ids: Sequence[str] = (), tp: int = 1
) -> list[dict[str, str]]:
    """Per-worker environment (start_cluster's `worker_env`) for `workers` workers on `device`.
    CUDA: worker i runs on gpu_ids[i % len(gpu_ids)] through its own CUDA_VISIBLE_DEVICES (it sees
    that GPU alone, as cuda:0), so several GPUs get one worker each in turn and with one GPU every
    worker shares it. tp > 1 (VALORA_TP_SIZE): worker i gets the next block of tp GPUs in turn
    (its ranks run on cuda:0..tp-1 of that block); fewer than tp visible GPUs is an error."""
    if device not in WORKER_DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(WORKER_DEVICES)}")
    if dtype not in WORKER_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(WORKER_DTYPES)}")
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    envs = [{"VALORA_DEVICE": device, "VALORA_DTYPE": dtype} for _ in range(workers)]
    if tp > 1:
        for env in envs:
            env["VALORA_TP_SIZE"] = str(tp)
    if device == "cuda":
        if not gpu_ids:
            raise ValueError("device cuda: no GPU visible (CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
        if len(gpu_ids) < tp:
            raise ValueError(f"tensor-parallel size {tp} needs {tp} GPUs per worker, {len(gpu_ids)} visible")
        n = len(gpu_ids)
        for i, env in enumerate(envs):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu_ids[(i * tp + j) % n]) for j in range(tp))
        # Workers sharing a GPU split its memory: each preallocates its KV pool from its share.
        sharing = collections.Counter(g for env in envs for g in env["CUDA_VISIBLE_DEVICES"].split(","))
        for env in envs:
            most = max(sharing[g] for g in env["CUDA_VISIBLE_DEVICES"].split(","))
            if most > 1:
                env["VALORA_GPU_MEMORY_FRACTION"] = f"{0.9 / most:.3f}"
    return envs


# -- the services' settings: `valora up --set` and `--config` ---------------------------------------

# Each service's pydantic settings class (every field is also VALORA_<FIELD>): the server's entry
# point `<service>-settings` (valora/server_code.py), loaded only when settings are checked (the
# classes need the server extra).
SETTINGS_ENTRY_POINTS = {svc: f"{svc}-settings" for svc in SERVICES}
_ONE_TOKEN = "one token for every service: set VALORA_INTERNAL_TOKEN in the environment"
_WIRED = "it wires the services together"
# Settings start_cluster sets per process (ports, addresses, names, caches, the shared token), or that
# a flag of `valora up` sets: refused in --set and --config, with what to use instead. The gateway's
# port and http_port are --port and --http-port (the config may give them; the flags given win).
MANAGED_SETTINGS: dict[str, dict[str, str]] = {
    svc: {
        "metrics_port": "each process gets a free port",
        "internal_token": _ONE_TOKEN,
        "internal_token_file": _ONE_TOKEN,
        **({} if svc == "gateway" else {"port": "each process gets a free port; the gateway's is --port"}),
    }
    for svc in SERVICES
}
MANAGED_SETTINGS["adapter_store"] |= {"model_path": "use --model-path"}
MANAGED_SETTINGS["worker"] |= {
    "model_path": "use --model-path",
    "worker_name": _WIRED,
    "adapter_cache_dir": _WIRED,
    "adapter_store_address": _WIRED,
    "scheduler_address": _WIRED,
    "advertise_address": _WIRED,
}
MANAGED_SETTINGS["scheduler"] |= {"worker_addresses": _WIRED}
MANAGED_SETTINGS["gateway"] |= {"scheduler_address": _WIRED, "adapter_store_address": _WIRED}


class SettingsError(ValueError):
    """A --set or --config entry that names no setting, or gives a setting a bad value (one line)."""


# service -> setting name -> its text, as the service reads it from VALORA_<NAME>.
Layer = dict[str, dict[str, str]]


def settings_class(service: str) -> type:
    from valora import server_code

    try:
        return server_code.load(SETTINGS_ENTRY_POINTS[service])
    except server_code.ServerCodeMissing as e:
        raise SettingsError(f"checking the {service} settings: {e}") from None


def env_name(key: str) -> str:
    return f"VALORA_{key.upper()}"


def _key(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def parse_set(items: Sequence[str]) -> Layer:
    """`--set KEY=VALUE` entries: a worker setting, or SERVICE.KEY for another service's; the last
    of a key wins. The value is the text VALORA_<KEY> gets."""
    layer: Layer = {}
    for item in items:
        key, eq, value = item.partition("=")
        service, dot, name = key.rpartition(".")
        service = _key(service) if dot else "worker"
        if not eq or not _key(name):
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE (a worker setting) or SERVICE.KEY=VALUE")
        if service not in SERVICES:
            raise SettingsError(f"--set {item!r}: no service {service!r} (services: {', '.join(SERVICES)})")
        layer.setdefault(service, {})[_key(name)] = value
    return layer


def env_text(value: object) -> str:
    """A TOML value as VALORA_<KEY> text: booleans true/false, numbers as written, lists as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return json.dumps(value)
    raise TypeError(f"a {type(value).__name__} is not a setting value (strings, numbers, booleans, lists)")


def load_settings_file(path: Path) -> Layer:
    """A TOML file of tables named after the services ([worker], [gateway], [scheduler],
    [adapter_store]), each mapping setting names to values."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"--config {path}: {exc}") from None
    layer: Layer = {}
    for table, values in data.items():
        if table not in SERVICES or not isinstance(values, dict):
            raise SettingsError(
                f"--config {path}: {table!r} is not a table of settings; the tables are "
                f"{', '.join(f'[{s}]' for s in SERVICES)}"
            )
        for name, value in values.items():
            try:
                layer.setdefault(table, {})[_key(name)] = env_text(value)
            except TypeError as exc:
                raise SettingsError(f"--config {path} [{table}] {name}: {exc}") from None
    return layer


def merge_settings(sets: Layer, config: Layer, environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Each service's VALORA_* environment from the settings layers: `sets` (--set) over `config`
    (--config) over the VALORA_* variables of `environ` (the caller's environment; None: none) over
    the defaults (what is left unset). Every service of SERVICES has an entry."""
    out = {}
    for service in SERVICES:
        env = {k: v for k, v in (environ or {}).items() if k.startswith("VALORA_")}
        for layer in (config, sets):
            env.update({env_name(k): v for k, v in layer.get(service, {}).items()})
        out[service] = env
    return out


def _source(service: str, key: str, sets: Layer, config: Layer, config_path: object) -> str:
    if key in sets.get(service, {}):
        return "--set " + ("" if service == "worker" else f"{service}.") + f"{key}={sets[service][key]}"
    if key in config.get(service, {}):
        return f"--config {config_path} [{service}] {key}"
    return f"{env_name(key)} in the environment"


def check_settings(sets: Layer, config: Layer, environ: Mapping[str, str], config_path: object = "") -> dict:
    """Validates every service that `sets` or `config` name, as it will read its VALORA_*
    environment (merge_settings; the settings valora up wires are left out): each key must be a
    field of its settings class and not one of MANAGED_SETTINGS, and the whole must validate.
    Returns the settings instances by service; SettingsError names the setting and where it came from."""
    checked = {}
    for service in SERVICES:
        keys = {**config.get(service, {}), **sets.get(service, {})}
        if not keys:
            continue
        cls = settings_class(service)
        for key in keys:
            where = _source(service, key, sets, config, config_path)
            if key in MANAGED_SETTINGS[service]:
                raise SettingsError(
                    f"{where}: {service} setting {key} is set by valora up ({MANAGED_SETTINGS[service][key]})"
                )
            if key not in cls.model_fields:
                near = difflib.get_close_matches(key, list(cls.model_fields), n=1)
                raise SettingsError(
                    f"{where}: {service} has no setting {key!r}" + (f" (did you mean {near[0]}?)" if near else "")
                )
        managed = {env_name(k) for k in MANAGED_SETTINGS[service]} | (
            {"VALORA_PORT", "VALORA_HTTP_PORT"} if service == "gateway" else set()
        )
        env = {
            k: v
            for k, v in merge_settings(sets, config, environ)[service].items()
            if k not in managed or k.lower().removeprefix("valora_") in keys
        }
        checked[service] = _validate(service, cls, env, sets, config, config_path)
    return checked


def _validate(service: str, cls: type, env: dict[str, str], sets: Layer, config: Layer, config_path: object):
    """An instance of `cls` read from `env` alone (os.environ swapped for it, then restored), as
    the service reads its environment."""
    import pydantic

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return cls()
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a check across fields: name the ones given
            given = "; ".join(
                _source(service, k, sets, config, config_path)
                for k in {**config.get(service, {}), **sets.get(service, {})}
            )
            raise SettingsError(f"{given}: {service} settings: {msg}") from None
        key = str(err["loc"][0])
        raise SettingsError(
            f"{_source(service, key, sets, config, config_path)}: {service} setting {key}: {msg}"
        ) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def http_enabled(env: Mapping[str, str]) -> bool:
    """Whether a gateway of this environment serves the OpenAI-compatible HTTP API
    (VALORA_HTTP_ENABLED, read as GatewaySettings reads it; a value it cannot read fails the
    gateway's start, so it counts as on here)."""
    import pydantic

    try:
        return pydantic.TypeAdapter(bool).validate_python(env.get("VALORA_HTTP_ENABLED", "true"))
    except pydantic.ValidationError:
        return True


def check_http_port(
    flag: str | None, sets: Layer, config: Layer, environ: Mapping[str, str], config_path: object = ""
) -> None:
    """A port for the OpenAI-compatible HTTP API (`flag`, the `--http-port N` given on the command
    line, else a gateway http_port of --set or --config) while the gateway's settings turn that API
    off (http_enabled false by --set, --config or VALORA_HTTP_ENABLED): a SettingsError naming
    both, instead of a port that is silently never opened."""
    if flag is None and "http_port" not in {**config.get("gateway", {}), **sets.get("gateway", {})}:
        return
    if http_enabled(merge_settings(sets, config, environ)["gateway"]):
        return
    port = flag or _source("gateway", "http_port", sets, config, config_path)
    off = _source("gateway", "http_enabled", sets, config, config_path)
    if off.endswith("in the environment"):
        off = f"VALORA_HTTP_ENABLED={environ.get('VALORA_HTTP_ENABLED', '')} in the environment"
    raise SettingsError(f"{port} is a port of the OpenAI-compatible HTTP API, which {off} turns off: drop one of them")


def start_cluster(
    home: Path = DEFAULT_HOME,
    workers: int = 1,
    gateway_port: int = 0,
    model_path: Path | None = None,
    http_port: int = 0,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    register: bool = False,
    worker_env: Sequence[Mapping[str, str]] | None = None,
    service_env: Mapping[str, Mapping[str, str]] | None = None,
) -> Cluster:
    """Starts adapter_store, `workers` workers, scheduler and gateway; returns once all are SERVING.
    The workers start together (each loads the model) and are waited for as a group.
    Every process gets a free Prometheus port; the gateway's HTTP API gets `http_port` (0: a free one)
    unless its settings turn it off (VALORA_HTTP_ENABLED false: no HTTP port, `Cluster.http_url` None).
    `env` goes to every process; `worker_env[i]` only to worker i, over `env` (per-worker device
    settings: VALORA_DEVICE, CUDA_VISIBLE_DEVICES…); it has one entry per worker when given.
    `service_env[service]` goes to that service's processes, over `env` and under `worker_env` (the
    services' VALORA_* settings, `valora up --set/--config`); the ports and addresses the cluster
    wires up win over both. Each service (the workers as a group) has `startup_timeout_s` to become
    SERVING; one that does not, or exits first, is a StartupError naming it and its log, raised
    after every process started is stopped.
    The services share an internal token (VALORA_INTERNAL_TOKEN from `env`, else the environment,
    else a new random one; "" turns internal auth off), kept in the cluster's state file.
    `register`: workers join the scheduler through RegisterWorker + heartbeats (VALORA_SCHEDULER_ADDRESS;
    they retry until the scheduler is up) instead of its static VALORA_WORKER_ADDRESSES; returns once
    the scheduler lists them all healthy."""
    if worker_env is not None and len(worker_env) != workers:
        raise ValueError(f"worker_env has {len(worker_env)} entries for {workers} workers")
    if service_env is not None and set(service_env) - set(SERVICES):
        raise ValueError(f"service_env: unknown services {sorted(set(service_env) - set(SERVICES))}")
    settings_env = {svc: dict((service_env or {}).get(svc, {})) for svc in SERVICES}
    home = Path(home).resolve()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    model_path = Path(model_path or default_model_path(home)).resolve()
    ensure_model(model_path)
    base_env = {**os.environ, "VALORA_MODEL_PATH": str(model_path), "PYTHONUNBUFFERED": "1", **(env or {})}
    if "VALORA_INTERNAL_TOKEN" not in base_env and "VALORA_INTERNAL_TOKEN_FILE" not in base_env:
        base_env["VALORA_INTERNAL_TOKEN"] = secrets.token_urlsafe(32)
    token_file = base_env.get("VALORA_INTERNAL_TOKEN_FILE", "")
    token = base_env.get("VALORA_INTERNAL_TOKEN") or (Path(token_file).read_text().strip() if token_file else "")
    cluster = Cluster(home=str(home), internal_token=token)
    # Every port of the cluster at once, so none is handed out twice while processes are still binding.
    spare = iter(free_ports(2 * (workers + 3) + 2))
    store_port = next(spare)
    worker_ports = [next(spare) for _ in range(workers)]
    scheduler_port = next(spare)
    plan: list[tuple[str, str, int, dict[str, str]]] = [  # service, name, port, wiring
        (
            "adapter_store",
            "adapter_store",
            store_port,
            {
                "VALORA_DATABASE_URL": settings_env["adapter_store"].get(
                    "VALORA_DATABASE_URL", base_env.get("VALORA_DATABASE_URL", f"sqlite:///{home / 'registry.db'}")
                ),
                "VALORA_BLOB_DIR": settings_env["adapter_store"].get(
                    "VALORA_BLOB_DIR", base_env.get("VALORA_BLOB_DIR", str(home / "blobs"))
                ),
            },
        ),
        *[
            (
                "worker",
                f"worker-{i}",
                port,
                {
                    "VALORA_ADAPTER_STORE_ADDRESS": f"127.0.0.1:{store_port}",
                    "VALORA_WORKER_NAME": f"worker-{i}",
                    "VALORA_ADAPTER_CACHE_DIR": str(home / f"adapter-cache-{i}"),
                    **(
                        {
                            "VALORA_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler_port}",
                            "VALORA_ADVERTISE_ADDRESS": f"127.0.0.1:{port}",
                        }
                        if register
                        else {}
                    ),
                    **(worker_env[i] if worker_env is not None else {}),
                },
            )
            for i, port in enumerate(worker_ports)
        ],
        (
            "scheduler",
            "scheduler",
            scheduler_port,
            {
                "VALORA_WORKER_ADDRESSES": "" if register else ",".join(f"127.0.0.1:{p}" for p in worker_ports),
            },
        ),
        (
            "gateway",
            "gateway",
            gateway_port or next(spare),
            {
                "VALORA_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler_port}",
                "VALORA_ADAPTER_STORE_ADDRESS": f"127.0.0.1:{store_port}",
            },
        ),
    ]
    try:
        # Consecutive entries of one service (the workers) are started together, then waited for.
        for service, group in itertools.groupby(plan, key=lambda entry: entry[0]):
            started: list[tuple[str, int, subprocess.Popen, str]] = []
            for _, name, port, entry_env in group:
                log = str(home / "logs" / f"{name}.log")
                ports = {"VALORA_PORT": str(port), "VALORA_METRICS_PORT": str(next(spare))}
                if service == "gateway" and http_enabled({**base_env, **settings_env[service], **entry_env}):
                    ports["VALORA_HTTP_PORT"] = str(http_port or next(spare))
                with open(log, "ab") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", f"services.{service}"],
                        env={**base_env, **settings_env[service], **entry_env, **ports},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                cluster.processes.append(
                    ProcessInfo(
                        service,
                        name,
                        proc.pid,
                        port,
                        log,
                        metrics_port=int(ports["VALORA_METRICS_PORT"]),
                        http_port=int(ports.get("VALORA_HTTP_PORT", 0)),
                    )
                )
                cluster.save()
                started.append((name, port, proc, log))
            for name, port, proc, log in started:
                try:
                    wait_healthy(f"127.0.0.1:{port}", startup_timeout_s, proc, log)
                except TimeoutError:
                    raise StartupError(
                        service, name, log, f"{name} did not become healthy within {startup_timeout_s:g} s (log: {log})"
                    ) from None
                except RuntimeError as exc:
                    raise StartupError(
                        service,
                        name,
                        log,
                        f"{name} exited with {proc.returncode} before it became healthy (log: {log})",
                    ) from exc
            if service == "scheduler" and register:
                try:
                    wait_registered(f"127.0.0.1:{port}", workers, startup_timeout_s, cluster.internal_token)
                except TimeoutError:
                    logs = str(home / "logs" / "worker-*.log")
                    raise StartupError(
                        "worker",
                        "worker",
                        logs,
                        f"the workers did not all register with the "
                        f"scheduler within {startup_timeout_s:g} s (logs: {logs})",
                    ) from None
    except BaseException:
        stop_cluster(home)
        raise
    return cluster


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a child that exited is reaped here)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reap our own children so they do not linger as zombies
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for process `pid` to exit; whether it did."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def process_env(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with (Linux: /proc/<pid>/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def restart_process(
    cluster: Cluster,
    name: str,
    env: Mapping[str, str] | None = None,
    grace_s: float = 15.0,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> ProcessInfo:
    """Stops the cluster's live process `name` (SIGTERM, SIGKILL after `grace_s`) and starts its
    service again on the same ports, log and environment, `env` over that environment (e.g. the
    scheduler under another VALORA_POLICY, the other services and their state untouched); returns
    its new ProcessInfo (respawn_process). The environment is read from /proc before the stop
    (Linux). A scheduler that lists its workers statically (VALORA_WORKER_ADDRESSES) sees them
    again at its first status round."""
    old = _process(cluster, name)
    if not alive(old.pid):
        raise RuntimeError(f"{name} (pid {old.pid}) is not running")
    started_env = {**process_env(old.pid), **(env or {})}
    _signal(old.pid, signal.SIGTERM)
    if not wait_exit(old.pid, grace_s):
        _signal(old.pid, signal.SIGKILL)
        wait_exit(old.pid, 5.0)  # the port is free once the kernel has closed its sockets
    return respawn_process(cluster, name, started_env, startup_timeout_s)


def respawn_process(
    cluster: Cluster, name: str, env: Mapping[str, str], startup_timeout_s: float = STARTUP_TIMEOUT_S
) -> ProcessInfo:
    """Starts the cluster's exited process `name` again on its ports and log with environment
    `env` (what process_env read before it stopped); returns its new ProcessInfo, saved in the
    state file, once it is SERVING (else a StartupError)."""
    old = _process(cluster, name)
    if alive(old.pid):
        raise RuntimeError(f"{name} (pid {old.pid}) is still running")
    with open(old.log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{old.service}"],
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    new = ProcessInfo(**{**asdict(old), "pid": proc.pid})
    cluster.processes[cluster.processes.index(old)] = new
    cluster.save()
    try:
        wait_healthy(new.address, startup_timeout_s, proc, new.log)
    except TimeoutError:
        raise StartupError(
            old.service, name, new.log, f"{name} did not become healthy within {startup_timeout_s:g} s (log: {new.log})"
        ) from None
    except RuntimeError as exc:
        raise StartupError(
            old.service, name, new.log, f"{name} exited with {proc.returncode} before it became healthy"
        ) from exc
    return new


def _process(cluster: Cluster, name: str) -> ProcessInfo:
    old = next((p for p in cluster.processes if p.name == name), None)
    if old is None:
        raise ValueError(f"no process {name!r} in the cluster; it has {', '.join(p.name for p in cluster.processes)}")
    return old


def stop_cluster(home: Path = DEFAULT_HOME, grace_s: float = 15.0) -> list[str]:
    """SIGTERM every process (gateway first; consecutive processes of one service, the workers,
    together), SIGKILL what is left of each group after the grace period."""
    cluster = Cluster.load(home)
    if cluster is None:
        return []
    stopped = []
    for _, group in itertools.groupby(reversed(cluster.processes), key=lambda p: p.service):
        live = [p for p in group if alive(p.pid)]
        for p in live:
            _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(alive(p.pid) for p in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in live:
            if alive(p.pid):
                _signal(p.pid, signal.SIGKILL)
        stopped.extend(p.name for p in live)
    Path(home, STATE_FILE).unlink(missing_ok=True)
    return stopped
