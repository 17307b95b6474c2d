"""Starts and stops a local valora cluster: the four services as separate processes on loopback.

Used by `valora up/down` and by the e2e tests. State (pids, ports, logs) lives in
`<home>/cluster.json`, so `valora down` from another shell finds the processes.
"""

from __future__ import annotations

import collections

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
        from valora.internal_token import with_token  # noqa: PLC0415

        return with_token(grpc.insecure_channel(address, options=list(options)), self.internal_token)

    @property
    def gateway(self) -> str:
        return next(p.address for p in self.processes if p.service == "gateway")

    @property
    def http_url(self) -> str:
        """Base URL of the gateway's OpenAI-compatible API (ends in /v1)."""
        return next(f"http://127.0.0.1:{p.http_port}/v1" for p in self.processes if p.service == "gateway")

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
        return cls(home=data["home"], processes=[ProcessInfo(**p) for p in data["processes"]],
                   internal_token=data.get("internal_token", ""))


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
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s (log: {log})")
            time.sleep(0.2)


def wait_registered(scheduler: str, workers: int, timeout_s: float, token: str = "") -> None:
    """Blocks until the scheduler lists `workers` healthy workers (registered ones join at run time)."""
    from valora.internal_token import with_token
    from valora.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc

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
        import torch  # noqa: PLC0415 - last resort, only for CUDA workers
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def worker_device_env(workers: int, device: str = "cpu", dtype: str = "float32",
                      gpu_ids: Sequence[str] = (), tp: int = 1) -> list[dict[str, str]]:
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


def start_cluster(home: Path = DEFAULT_HOME, workers: int = 1, gateway_port: int = 0,
                  model_path: Path | None = None, http_port: int = 0, env: dict[str, str] | None = None,
                  startup_timeout_s: float = 180.0, register: bool = False,
                  worker_env: Sequence[Mapping[str, str]] | None = None) -> Cluster:
    """Starts adapter_store, `workers` workers, scheduler and gateway; returns once all are SERVING.
    The workers start together (each loads the model) and are waited for as a group.
    Every process gets a free Prometheus port; the gateway's HTTP API gets `http_port` (0: a free one).
    `env` goes to every process; `worker_env[i]` only to worker i, over `env` (per-worker device
    settings: VALORA_DEVICE, CUDA_VISIBLE_DEVICES…); it has one entry per worker when given.
    The services share an internal token (VALORA_INTERNAL_TOKEN from `env`, else the environment,
    else a new random one; "" turns internal auth off), kept in the cluster's state file.
    `register`: workers join the scheduler through RegisterWorker + heartbeats (VALORA_SCHEDULER_ADDRESS;
    they retry until the scheduler is up) instead of its static VALORA_WORKER_ADDRESSES; returns once
    the scheduler lists them all healthy."""
    if worker_env is not None and len(worker_env) != workers:
        raise ValueError(f"worker_env has {len(worker_env)} entries for {workers} workers")
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
    plan: list[tuple[str, str, int, dict[str, str]]] = [
        ("adapter_store", "adapter_store", store_port, {
            "VALORA_DATABASE_URL": base_env.get("VALORA_DATABASE_URL", f"sqlite:///{home / 'registry.db'}"),
            "VALORA_BLOB_DIR": base_env.get("VALORA_BLOB_DIR", str(home / "blobs")),
        }),
        *[("worker", f"worker-{i}", port, {
            "VALORA_ADAPTER_STORE_ADDRESS": f"127.0.0.1:{store_port}",
            "VALORA_WORKER_NAME": f"worker-{i}",
            "VALORA_ADAPTER_CACHE_DIR": str(home / f"adapter-cache-{i}"),
            **({"VALORA_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler_port}",
                "VALORA_ADVERTISE_ADDRESS": f"127.0.0.1:{port}"} if register else {}),
            **(worker_env[i] if worker_env is not None else {}),
        }) for i, port in enumerate(worker_ports)],
        ("scheduler", "scheduler", scheduler_port, {
            "VALORA_WORKER_ADDRESSES": "" if register else ",".join(f"127.0.0.1:{p}" for p in worker_ports),
        }),
        ("gateway", "gateway", gateway_port or next(spare), {
            "VALORA_SCHEDULER_ADDRESS": f"127.0.0.1:{scheduler_port}",
            "VALORA_ADAPTER_STORE_ADDRESS": f"127.0.0.1:{store_port}",
        }),
    ]
    try:
        # Consecutive entries of one service (the workers) are started together, then waited for.
        for service, group in itertools.groupby(plan, key=lambda entry: entry[0]):
            started: list[tuple[int, subprocess.Popen, str]] = []
            for _, name, port, service_env in group:
                log = str(home / "logs" / f"{name}.log")
                ports = {"VALORA_PORT": str(port), "VALORA_METRICS_PORT": str(next(spare))}
                if service == "gateway":
                    ports["VALORA_HTTP_PORT"] = str(http_port or next(spare))
                with open(log, "ab") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", f"services.{service}"],
                        env={**base_env, **service_env, **ports},
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                cluster.processes.append(ProcessInfo(service, name, proc.pid, port, log,
                                                     metrics_port=int(ports["VALORA_METRICS_PORT"]),
                                                     http_port=int(ports.get("VALORA_HTTP_PORT", 0))))
                cluster.save()
                started.append((port, proc, log))
            for port, proc, log in started:
                wait_healthy(f"127.0.0.1:{port}", startup_timeout_s, proc, log)
            if service == "scheduler" and register:
                wait_registered(f"127.0.0.1:{port}", workers, startup_timeout_s, cluster.internal_token)
    except BaseException:
        stop_cluster(home)
        raise
    return cluster


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reap our own children so they do not linger as zombies
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_cluster(home: Path = DEFAULT_HOME, grace_s: float = 15.0) -> list[str]:
    """SIGTERM every process (gateway first; consecutive processes of one service, the workers,
    together), SIGKILL what is left of each group after the grace period."""
    cluster = Cluster.load(home)
    if cluster is None:
        return []
    stopped = []
    for _, group in itertools.groupby(reversed(cluster.processes), key=lambda p: p.service):
        live = [p for p in group if _alive(p.pid)]
        for p in live:
            _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(_alive(p.pid) for p in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in live:
            if _alive(p.pid):
                _signal(p.pid, signal.SIGKILL)
        stopped.extend(p.name for p in live)
    Path(home, STATE_FILE).unlink(missing_ok=True)
    return stopped
