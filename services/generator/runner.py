"""`python -m services.generator serve`: the generation-job runner.

Polls the adapter store for PENDING generation jobs (AdapterStoreService.ClaimGenerationJob; the
store owns the job's state machine), runs the greedy fusion of the job's sources on its base
model (a source is a built-in task, or a task of a dataset the user uploaded through the store:
fetched with FetchDataset and validated here, `job_tasks`), reports progress after every fused
source (UpdateGenerationJob), registers the fused adapters and one task per source, and
finishes the job SUCCEEDED with the versions and accuracies, or FAILED with the error.

A claim is a lease (the store's job_lease_s): every report carries its lease_id and renews it,
and a heartbeat thread re-sends the last progress whenever a third of the lease passed without
a report (a fusion step trains for minutes). A runner that dies or loses the store lets the
lease lapse; the store then requeues the job and another runner starts it over (attempt n),
registering under the same request ids, so a bundle the lost attempt already registered is
reused when it comes out byte-identical (training is seeded), and a task it created is replaced.
A job cancelled meanwhile (JOB_NOT_RUNNING), or whose lease was lost to another claim
(LEASE_LOST), makes the next report or heartbeat fail with FAILED_PRECONDITION; the runner then
stops that job at the next training step and registers nothing more. A runner asked to stop
(SIGTERM: a rolling update, a scale-down) stops its job at the next training step too and hands
it back (state PENDING): it is queued again at once and the attempt does not count.

Registration goes through the SDK (valora/client.py) to `admin_address`: the gateway (with the
admin key), or the store itself, which serves the registry part of AdminService. The runner is
a blocking process (torch training), so it talks over synchronous channels.

A job whose fusion_order is "probed" first trains the interference probes (each source alone and
each pair together, briefly: services/generator/fusion.py) and fuses in the order they suggest;
its result's fused_order says the order the sources were fused in, and its probe what the order
was chosen from (`probe_result`: each pair's accuracy drops, the planned adapters).

Progress: 5% once the model and data are loaded (and probed), up to 85% as sources are fused (one
step per source), 90% once test accuracy is measured and bundles exported, 100% when registered.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import grpc
import structlog
from pydantic import Field

from services.common.config import ServiceSettings
from services.common.internal_auth import internal_token
from valora.internal_token import with_token
from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.v1 import resources_pb2 as res

log = structlog.get_logger()

PENDING, RUNNING, SUCCEEDED, FAILED = (
    res.GENERATION_JOB_STATE_PENDING,
    res.GENERATION_JOB_STATE_RUNNING,
    res.GENERATION_JOB_STATE_SUCCEEDED,
    res.GENERATION_JOB_STATE_FAILED,
)


class RunnerSettings(ServiceSettings):
    adapter_store_address: str = Field(
        "127.0.0.1:50053", description="host:port of the adapter store (jobs are claimed and reported there)."
    )
    admin_address: str = Field(
        "",
        description="host:port where adapters and tasks are registered: a gateway "
        "(with admin_key) or the store; empty means adapter_store_address.",
    )
    admin_key: str = Field("", description="Admin key for the gateway (unused against the store).")
    runner_name: str = Field("", description="Name recorded on claimed jobs; empty means <hostname>-<pid>.")
    poll_s: float = Field(2.0, gt=0, description="Seconds between claims while no job is pending.")
    threads: int = Field(1, ge=1, description="torch CPU threads.")
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="Where jobs train: cpu, cuda or cuda:N (LoRA weights in float32 either way).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The frozen model's dtype in training: float32, or bfloat16 (a GPU)."
    )
    batch_size: int = Field(16, ge=1, description="Training batch size (each batch holds one task).")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of each call to the store.")
    heartbeat_s: float = Field(
        0.0,
        ge=0,
        description="Longest gap between reports on a running job (a heartbeat "
        "re-sends the last progress); 0 means a third of the store's lease.",
    )


# Transient failures of the store: a progress report or heartbeat that meets one is retried later
# (the lease covers the gap); the final report retries them while the lease lasts.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class JobCancelled(Exception):
    """The runner must stop the job: an admin cancelled it (reason JOB_NOT_RUNNING) or the
    runner's lease was lost, the job requeued or claimed by another runner (LEASE_LOST)."""

    def __init__(self, detail: str, reason: str = "") -> None:
        super().__init__(detail)
        self.reason = reason


class RunnerStopping(Exception):
    """The runner was asked to stop (SIGTERM) while it worked on a job: it hands the job back."""


def _reason(err: grpc.RpcError) -> str:
    from services.common.errors import from_rpc_error

    return from_rpc_error(err).reason


@dataclass
class Reporter:
    """Reports a claimed job's progress under the claim's lease; raises JobCancelled once the
    store refuses a report (and from then on, without asking it again). `start_heartbeat`
    renews the lease from a thread while the caller is busy, re-sending the last progress and
    message (`message` until the first report); `check()`, called at every training step,
    raises JobCancelled as soon as a heartbeat learned the job must stop, and RunnerStopping
    once the runner is asked to stop."""

    stub: store_grpc.AdapterStoreServiceStub
    name: str
    timeout_s: float
    lease_id: str = ""
    attempt: int = 1
    lease_s: float = 60.0
    message: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last: tuple[float, str] = (0.0, "")
    _sent_at: float = field(default_factory=time.monotonic)
    _stopped: JobCancelled | None = None
    _beat: threading.Thread | None = field(default=None, repr=False)
    _beat_stop: threading.Event = field(default_factory=threading.Event, repr=False)
    # Set when the runner is asked to stop; check() (each training step) then raises RunnerStopping.
    stopping: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self._last = (0.0, self.message)

    def __call__(
        self,
        progress: float,
        message: str,
        state: int = RUNNING,
        result: res.GenerationJobResult | None = None,
        error: str = "",
    ) -> res.GenerationJob | None:
        """Progress (RUNNING) returns the job, or None when the store could not be reached (the
        heartbeat retries); the final report (SUCCEEDED/FAILED) retries transient failures while
        the lease lasts, then raises."""
        progress = min(max(progress, 0.0), 1.0)
        deadline = time.monotonic() + self.lease_s
        delay = 0.2
        while True:
            with self._lock:
                if state == RUNNING:
                    self._last = (max(progress, self._last[0]), message)
                try:
                    return self._send(progress, message, state, result, error)
                except grpc.RpcError as err:
                    if err.code() not in TRANSIENT:
                        raise
                    if state == RUNNING:
                        log.warning("job_report_failed", job=self.name, code=str(err.code()))
                        return None
                    if time.monotonic() + delay > deadline:
                        raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _send(self, progress: float, message: str, state: int, result, error: str) -> res.GenerationJob:
        """One UpdateGenerationJob; the caller holds the lock."""
        if self._stopped is not None:
            raise JobCancelled(str(self._stopped), self._stopped.reason)
        try:
            job = self.stub.UpdateGenerationJob(
                store_pb.UpdateGenerationJobRequest(
                    name=self.name,
                    lease_id=self.lease_id,
                    progress=progress,
                    message=message,
                    state=state,
                    result=result,
                    error=error,
                ),
                timeout=self.timeout_s,
            ).job
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._stopped = JobCancelled(err.details(), _reason(err))
                raise JobCancelled(err.details(), self._stopped.reason) from None
            raise
        self._sent_at = time.monotonic()
        return job

    def check(self, stopping: bool = True) -> None:
        """Raises JobCancelled when a report or heartbeat learned that the job must stop, and
        (with `stopping`) RunnerStopping when the runner is asked to stop."""
        stopped = self._stopped
        if stopped is not None:
            raise JobCancelled(str(stopped), stopped.reason)
        if stopping and self.stopping.is_set():
            raise RunnerStopping("the runner is stopping")

    def hand_back(self, message: str) -> res.GenerationJob | None:
        """Returns the unfinished job to the queue (PENDING; this attempt does not count)."""
        with self._lock:
            try:
                return self._send(0.0, message, PENDING, None, "")
            except (JobCancelled, grpc.RpcError) as exc:  # lost meanwhile, or the lease will lapse instead
                log.warning("job_hand_back_failed", job=self.name, error=repr(exc))
                return None

    def start_heartbeat(self, interval_s: float) -> None:
        """From now on, no more than `interval_s` passes between two reports while the job runs."""
        interval_s = max(interval_s, 0.01)

        def beat() -> None:
            while True:
                wait = interval_s - (time.monotonic() - self._sent_at)
                if self._beat_stop.wait(max(wait, 0.01)):
                    return
                with self._lock:
                    if self._beat_stop.is_set() or self._stopped is not None:
                        return
                    if time.monotonic() - self._sent_at < interval_s:
                        continue
                    try:
                        self._send(*self._last, RUNNING, None, "")
                    except JobCancelled as exc:
                        log.info("job_stopping", job=self.name, reason=exc.reason, detail=str(exc))
                        return
                    except grpc.RpcError as err:  # the store is away: try again next interval
                        log.warning("job_heartbeat_failed", job=self.name, code=str(err.code()))
                        self._sent_at = time.monotonic()

        self._beat = threading.Thread(target=beat, name=f"heartbeat-{self.name}", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(self.timeout_s + 1)


def run_job(
    job: res.GenerationJob,
    report: Reporter,
    admin_address: str,
    admin_key: str | None = None,
    threads: int = 1,
    batch_size: int = 16,
    internal_token: str = "",
    device: str = "cpu",
    dtype: str = "float32",
) -> res.GenerationJobResult:
    """Greedy fusion of the job's sources, registration, and the result (the caller reports it).
    `internal_token`: sent when `admin_address` is the adapter store itself."""
    import torch

    from services.generator import pipeline
    from services.generator.model import BaseModel, training_device
    from services.generator.training import TorchTrainer, TrainConfig

    names = [s.task for s in job.sources]
    thresholds = {s.task: float(s.accuracy_threshold) for s in job.sources}
    job_id = job.name.removeprefix("generationJobs/")
    prefix = job.adapter_prefix or job_id
    rank, epochs = job.rank or 8, job.epochs or 4
    alpha = 2.0 * rank

    torch.set_num_threads(threads)
    report(0.01, f"loading {job.base_model} and {len(names)} task datasets")
    tasks = job_tasks(job, report)
    base = BaseModel.load(job.base_model, rank=rank, lora_alpha=alpha, **training_device(device, dtype))
    check = getattr(report, "check", None)  # stops training at the next step once the job must stop
    trainer = TorchTrainer(
        base,
        tasks,
        TrainConfig(epochs=epochs, batch_size=batch_size),
        progress=(lambda *_: check()) if check is not None else None,
    )
    record = None
    if job.fusion_order == "probed":  # the store accepts "", "given" and "probed"
        n = len(names)
        report(0.05, f"probing interference: {n + n * (n - 1) // 2} brief trainings of {', '.join(names)}")
        names, record = pipeline.fusion_order(trainer, names, thresholds, "probed")
        probe = record["probe"]
        report(
            0.05,
            f"fusing in the probed order {', '.join(names)} ({probe['trainings']} probes, {probe['seconds']:.0f}s)",
        )
    else:
        report(0.05, "fusing " + ", ".join(names))

    done = 0

    def on_step(step) -> None:
        nonlocal done
        done += 1
        acc = ", ".join(f"{k} {v:.3f}" for k, v in step.accuracy.items())
        report(
            0.05 + 0.8 * done / len(names),
            f"{step.source}: {step.decision} (adapter {prefix}-{step.adapter_index}; val {acc})",
        )

    greedy_result, fusion = pipeline.greedy(trainer, names, thresholds, prefix, on_step=on_step, order_record=record)
    bundles = pipeline.bundles_of(fusion, tasks, rank, alpha, prefix, base_model=job.base_model)
    report(0.9, f"registering {len(bundles)} adapters")
    if check is not None:
        check(stopping=False)  # cancelled or lost in the last step: register nothing; stopping: finish
    result = register(
        admin_address,
        job_id,
        prefix,
        bundles,
        greedy_result,
        {t: tasks[t].prompt for t in names},
        admin_key,
        attempt=getattr(report, "attempt", 1),
        internal_token=internal_token,
        max_new_tokens=pipeline.text_budgets(trainer, names),
    )
    result.fused_order.extend(names)
    if record is not None:
        result.probe.CopyFrom(probe_result(record))
    return result


def probe_result(record: dict) -> res.GenerationProbe:
    """A probed order's record (pipeline.fusion_order) as the job result's `probe`: each task's
    accuracy alone, one entry per probed pair (both tasks' accuracy in the pair and drop from
    alone), the adapters planned from them with their predicted margins, the rule and budget."""
    probe, budget = record["probe"], record["probe_budget"]
    out = res.GenerationProbe(
        given_order=record["given"],
        rule=record.get("how", ""),
        epochs=budget["epochs"],
        batches_per_epoch=budget["batches_per_epoch"],
        batch_size=budget["batch_size"],
        trainings=probe["trainings"],
        seconds=probe["seconds"],
    )
    for acc in probe["alone"].values():
        out.alone.update(acc)
    for pair in record["pairs"]:
        (a, b), acc, drop = pair["sources"], pair["accuracy"], pair["drop"]
        out.pairs.add(
            first=a,
            second=b,
            first_accuracy=acc[a],
            second_accuracy=acc[b],
            first_drop=drop[a],
            second_drop=drop[b],
        )
    for planned in record["planned"]:
        out.planned.add(tasks=planned["tasks"], predicted_margins=planned["predicted_margins"])
    return out


def job_tasks(job: res.GenerationJob, report: Reporter) -> dict:
    """{task: TaskData} of the job's sources: built-in tasks, and tasks of the datasets the
    sources name, fetched from the store (report.stub, FetchDataset) and unpacked into a
    temporary directory. A dataset's problems are reported as "datasets/{sha256}:file[:line]";
    a source whose task is not in the dataset it names fails the job."""
    import tempfile
    from pathlib import Path

    from services.generator.user_datasets import DatasetError, tasks_for, unpack_dataset

    names = [s.task for s in job.sources]
    datasets = list(dict.fromkeys(s.dataset for s in job.sources if s.dataset))
    with tempfile.TemporaryDirectory(prefix="valora-job-") as tmp:
        paths: dict[str, Path] = {}
        for i, name in enumerate(datasets):
            data = b"".join(
                part.chunk
                for part in report.stub.FetchDataset(store_pb.FetchDatasetRequest(name=name), timeout=report.timeout_s)
            )
            dest = Path(tmp) / str(i)
            dest.mkdir()
            try:
                paths[name] = unpack_dataset(data, dest, source=name)
            except DatasetError as exc:
                raise DatasetError(name, exc.problems) from None
        try:
            _, tasks, where = tasks_for(names, [paths[d] for d in datasets], limit=job.split_limit or None)
        except DatasetError as exc:
            for name, path in paths.items():
                if exc.source == str(path):
                    base = str(path.parent) + "/"
                    raise DatasetError(name, [p.replace(base, f"{name}:") for p in exc.problems]) from None
            raise
        for i, s in enumerate(job.sources):
            if where.get(s.task, "") != (str(paths[s.dataset]) if s.dataset else ""):
                origin = f"dataset {s.dataset}" if s.dataset else "the built-in tasks"
                raise ValueError(f"sources[{i}]: task {s.task!r} is not in {origin}")
    return tasks


def attempt_request_id(job_id: str, bundle_name: str, attempt: int) -> str:
    """The upload request id of a bundle in a later attempt whose bundle differs from the one a
    lost attempt registered under the job's own request id (at most 128 characters)."""
    rid = f"{job_id}/{bundle_name}#{attempt}"
    return rid if len(rid) <= 128 else f"{job_id}/{hashlib.sha256(rid.encode()).hexdigest()[:48]}"


def register(
    address: str,
    job_id: str,
    prefix: str,
    bundles,
    result,
    prompts: dict[str, str],
    admin_key: str | None = None,
    attempt: int = 1,
    internal_token: str = "",
    max_new_tokens: dict[str, int] | None = None,
) -> res.GenerationJobResult:
    """Each bundle as a version of `adapters/{bundle.name}` (request id derived from the job, so a
    rerun of the same job registers nothing twice) and one task `tasks/{prefix}-{task}` per task
    it serves: a head task with its head, a text task (`max_new_tokens`: their decoding budgets)
    without one (served as TEXT generation with the adapter).

    In a retry (attempt > 1) the lost attempt may have registered already: a byte-identical
    bundle is found by its request id; a different one (FAILED_PRECONDITION, the request id
    names another bundle) is registered under a request id of this attempt, and a task this
    job created for another version is replaced."""
    from services.generator.pipeline import task_description
    from valora.client import ValoraClient

    out = res.GenerationJobResult()
    made_by = f"(generated by {job_id})"
    budgets = max_new_tokens or {}
    with ValoraClient(address, admin_key=admin_key, internal_token=internal_token) as client:
        for b in bundles:
            try:
                v = client.upload_adapter_version(
                    b.name, b.data, b.config_json, heads=b.heads, request_id=f"{job_id}/{b.name}"
                )
            except grpc.RpcError as err:
                if attempt <= 1 or err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                v = client.upload_adapter_version(
                    b.name, b.data, b.config_json, heads=b.heads, request_id=attempt_request_id(job_id, b.name, attempt)
                )
            out.adapter_versions.append(v.name)
            for task in getattr(b, "served_tasks", b.heads):
                row = result.tasks[task]
                task_id = f"{prefix}-{task}"
                head = task if task in b.heads else ""
                kw = dict(
                    adapter=v.name,
                    head=head,
                    description=task_description(prompts[task], made_by, None if head else budgets.get(task)),
                    accuracy_threshold=row["threshold"],
                    measured_accuracy=row["accuracy"],
                )
                try:
                    t = client.create_task(task_id, **kw)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                        raise
                    t = client.get_task(task_id)
                    if t.adapter != v.name:
                        if attempt <= 1 or not t.description.endswith(made_by):
                            raise  # someone else's task by that name
                        client.delete_task(task_id)  # a lost attempt's, for a bundle now replaced
                        t = client.create_task(task_id, **kw)
                out.tasks.append(
                    res.GenerationTaskResult(
                        task=t.name,
                        adapter_version=v.name,
                        accuracy_threshold=row["threshold"],
                        measured_accuracy=row["accuracy"],
                    )
                )
    return out


class Runner:
    def __init__(self, settings: RunnerSettings, run: Callable[..., res.GenerationJobResult] = run_job) -> None:
        self.settings = settings
        self.name = settings.runner_name or f"{socket.gethostname()}-{os.getpid()}"
        self.token = internal_token(settings)  # the store's internal API (claims, reports, registration)
        self._channel = with_token(
            grpc.insecure_channel(
                settings.adapter_store_address,
                options=[
                    ("grpc.max_receive_message_length", settings.max_message_bytes),
                    ("grpc.max_send_message_length", settings.max_message_bytes),
                ],
            ),
            self.token,
        )
        self.stub = store_grpc.AdapterStoreServiceStub(self._channel)
        self._run = run
        self._health = None
        self._health_server: grpc.Server | None = None
        self.stopping = threading.Event()

    def stop(self) -> None:
        """Asks the runner to stop (a signal handler may call it): a job in progress is stopped at
        its next training step and handed back, and serve_forever returns."""
        self.stopping.set()

    def start_health(self) -> int:
        """gRPC health (grpc.health.v1, what the container probes ask) on settings.host:port,
        SERVING until close(); returns the bound port. Nothing calls the runner otherwise."""
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._health = health.HealthServicer()
        self._health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        port = self._health_server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        self._health_server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        return port

    def close(self) -> None:
        if self._health_server is not None:
            from grpc_health.v1 import health_pb2

            self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            self._health_server.stop(None)
        self._channel.close()

    def run_once(self) -> res.GenerationJob | None:
        """Claims one PENDING job and runs it to its end; returns the job as last reported (None
        when nothing was pending, or when the job was cancelled or its lease lost meanwhile)."""
        s = self.settings
        claimed = self.stub.ClaimGenerationJob(
            store_pb.ClaimGenerationJobRequest(runner=self.name), timeout=s.rpc_timeout_s
        )
        if not claimed.HasField("job"):
            return None
        job = claimed.job
        lease_s = claimed.lease_duration.ToTimedelta().total_seconds() or 60.0
        report = Reporter(
            self.stub,
            job.name,
            s.rpc_timeout_s,
            lease_id=claimed.lease_id,
            attempt=claimed.attempt or 1,
            lease_s=lease_s,
            message=job.message,
            stopping=self.stopping,
        )
        log.info(
            "job_claimed",
            job=job.name,
            sources=[x.task for x in job.sources],
            attempt=claimed.attempt,
            max_attempts=claimed.max_attempts,
            lease_s=lease_s,
        )
        report.start_heartbeat(s.heartbeat_s or lease_s / 3)
        started = time.monotonic()
        try:
            try:
                result = self._run(
                    job,
                    report,
                    s.admin_address or s.adapter_store_address,
                    s.admin_key or None,
                    s.threads,
                    s.batch_size,
                    internal_token="" if s.admin_address else self.token,
                    device=s.device,
                    dtype=s.dtype,
                )
            finally:
                report.stop_heartbeat()
            final = report(
                1.0,
                f"done in {time.monotonic() - started:.0f}s: {len(result.adapter_versions)} "
                f"adapters for {len(result.tasks)} tasks",
                SUCCEEDED,
                result,
            )
            log.info("job_succeeded", job=job.name, adapters=list(result.adapter_versions))
            return final
        except JobCancelled as exc:
            log.info("job_stopped", job=job.name, reason=exc.reason, detail=str(exc))
            return None
        except RunnerStopping:
            log.info("job_handed_back", job=job.name)
            report.hand_back(f"handed back by {self.name} (stopping) after {time.monotonic() - started:.0f}s")
            return None
        except Exception as exc:  # any failure of the job is the job's FAILED outcome
            log.warning("job_failed", job=job.name, error=repr(exc))
            try:
                return report(0.0, "failed", FAILED, error=f"{type(exc).__name__}: {exc}")
            except JobCancelled:
                return None

    def serve_forever(self, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop() and not self.stopping.is_set():
            try:
                job = self.run_once()
            except grpc.RpcError as err:  # the store is down or restarting: try again later
                log.warning("store_unreachable", code=str(err.code()), detail=err.details())
                job = None
            if job is None:
                self.stopping.wait(self.settings.poll_s)
