"""`python -m services.generator serve`: the generation-job runner.

Polls the adapter store for PENDING generation jobs (AdapterStoreService.ClaimGenerationJob; the
store owns the job's state machine), runs the greedy fusion of the job's sources on its base
model, reports progress after every fused source (UpdateGenerationJob), registers the fused
adapters and one task per source, and finishes the job SUCCEEDED with the versions and
accuracies, or FAILED with the error. A job cancelled meanwhile makes the next report fail with
FAILED_PRECONDITION; the runner then stops that job between steps and registers nothing.

Registration goes through the SDK (valora/client.py) to `admin_address`: the gateway (with the
admin key), or the store itself, which serves the registry part of AdminService. The runner is
a blocking process (torch training), so it talks over synchronous channels.

Progress: 5% once the model and data are loaded, up to 85% as sources are fused (one step per
source), 90% once test accuracy is measured and bundles exported, 100% when registered.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import structlog
from pydantic import Field

from services.common.config import ServiceSettings
from valora.internal.v1 import adapter_store_service_pb2 as store_pb
from valora.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora.v1 import resources_pb2 as res

log = structlog.get_logger()

RUNNING, SUCCEEDED, FAILED = (res.GENERATION_JOB_STATE_RUNNING, res.GENERATION_JOB_STATE_SUCCEEDED,
                              res.GENERATION_JOB_STATE_FAILED)


class RunnerSettings(ServiceSettings):
    adapter_store_address: str = Field("127.0.0.1:50053", description="host:port of the adapter store "
                                       "(jobs are claimed and reported there).")
    admin_address: str = Field("", description="host:port where adapters and tasks are registered: a gateway "
                               "(with admin_key) or the store; empty means adapter_store_address.")
    admin_key: str = Field("", description="Admin key for the gateway (unused against the store).")
    runner_name: str = Field("", description="Name recorded on claimed jobs; empty means <hostname>-<pid>.")
    poll_s: float = Field(2.0, gt=0, description="Seconds between claims while no job is pending.")
    threads: int = Field(1, ge=1, description="torch CPU threads.")
    batch_size: int = Field(16, ge=1, description="Training batch size (each batch holds one task).")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of each call to the store.")


class JobCancelled(Exception):
    """The job left RUNNING (an admin cancelled it) while the runner worked on it."""


@dataclass
class Reporter:
    """Reports a claimed job's progress; raises JobCancelled once the store refuses the report."""

    stub: store_grpc.AdapterStoreServiceStub
    name: str
    timeout_s: float

    def __call__(self, progress: float, message: str, state: int = RUNNING,
                 result: res.GenerationJobResult | None = None, error: str = "") -> res.GenerationJob:
        try:
            return self.stub.UpdateGenerationJob(store_pb.UpdateGenerationJobRequest(
                name=self.name, progress=min(max(progress, 0.0), 1.0), message=message, state=state,
                result=result, error=error), timeout=self.timeout_s).job
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise JobCancelled(err.details()) from None
            raise


def run_job(job: res.GenerationJob, report: Reporter, admin_address: str, admin_key: str | None = None,
            threads: int = 1, batch_size: int = 16) -> res.GenerationJobResult:
    """Greedy fusion of the job's sources, registration, and the result (the caller reports it)."""
    import torch

    from services.generator import pipeline
    from services.generator.datasets import TASKS, build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    names = [s.task for s in job.sources]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {sorted(TASKS)}")
    thresholds = {s.task: float(s.accuracy_threshold) for s in job.sources}
    job_id = job.name.removeprefix("generationJobs/")
    prefix = job.adapter_prefix or job_id
    rank, epochs = job.rank or 8, job.epochs or 4
    alpha = 2.0 * rank

    torch.set_num_threads(threads)
    report(0.01, f"loading {job.base_model} and {len(names)} task datasets")
    tasks = build_tasks(names, limit=job.split_limit or None)
    base = BaseModel.load(job.base_model, rank=rank, lora_alpha=alpha)
    trainer = TorchTrainer(base, tasks, TrainConfig(epochs=epochs, batch_size=batch_size))
    report(0.05, "fusing " + ", ".join(names))

    done = 0

    def on_step(step) -> None:
        nonlocal done
        done += 1
        acc = ", ".join(f"{k} {v:.3f}" for k, v in step.accuracy.items())
        report(0.05 + 0.8 * done / len(names),
               f"{step.source}: {step.decision} (adapter {prefix}-{step.adapter_index}; val {acc})")

    greedy_result, fusion = pipeline.greedy(trainer, names, thresholds, prefix, on_step=on_step)
    bundles = pipeline.bundles_of(fusion, tasks, rank, alpha, prefix, base_model=job.base_model)
    report(0.9, f"registering {len(bundles)} adapters")
    return register(admin_address, job_id, prefix, bundles, greedy_result,
                    {t: tasks[t].prompt for t in names}, admin_key)


def register(address: str, job_id: str, prefix: str, bundles, result, prompts: dict[str, str],
             admin_key: str | None = None) -> res.GenerationJobResult:
    """Each bundle as a version of `adapters/{bundle.name}` (request id derived from the job, so a
    rerun of the same job registers nothing twice) and one task `tasks/{prefix}-{task}` per head."""
    from valora.client import ValoraClient

    out = res.GenerationJobResult()
    with ValoraClient(address, admin_key=admin_key) as client:
        for b in bundles:
            v = client.upload_adapter_version(b.name, b.data, b.config_json, heads=b.heads,
                                              request_id=f"{job_id}/{b.name}")
            out.adapter_versions.append(v.name)
            for task in b.heads:
                row = result.tasks[task]
                task_id = f"{prefix}-{task}"
                try:
                    t = client.create_task(task_id, adapter=v.name, head=task,
                                           description=f"prompt: {prompts[task]} (generated by {job_id})",
                                           accuracy_threshold=row["threshold"], measured_accuracy=row["accuracy"])
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                        raise
                    t = client.get_task(task_id)
                    if t.adapter != v.name:  # someone else's task by that name
                        raise
                out.tasks.append(res.GenerationTaskResult(task=t.name, adapter_version=v.name,
                                                          accuracy_threshold=row["threshold"],
                                                          measured_accuracy=row["accuracy"]))
    return out


class Runner:
    def __init__(self, settings: RunnerSettings,
                 run: Callable[..., res.GenerationJobResult] = run_job) -> None:
        self.settings = settings
        self.name = settings.runner_name or f"{socket.gethostname()}-{__import__('os').getpid()}"
        self._channel = grpc.insecure_channel(settings.adapter_store_address, options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes)])
        self.stub = store_grpc.AdapterStoreServiceStub(self._channel)
        self._run = run

    def close(self) -> None:
        self._channel.close()

    def run_once(self) -> res.GenerationJob | None:
        """Claims one PENDING job and runs it to its end; returns the job as last reported (None
        when nothing was pending)."""
        s = self.settings
        claimed = self.stub.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner=self.name),
                                               timeout=s.rpc_timeout_s)
        if not claimed.HasField("job"):
            return None
        job = claimed.job
        report = Reporter(self.stub, job.name, s.rpc_timeout_s)
        log.info("job_claimed", job=job.name, sources=[x.task for x in job.sources])
        started = time.monotonic()
        try:
            result = self._run(job, report, s.admin_address or s.adapter_store_address, s.admin_key or None,
                               s.threads, s.batch_size)
            final = report(1.0, f"done in {time.monotonic() - started:.0f}s: {len(result.adapter_versions)} "
                                f"adapters for {len(result.tasks)} tasks", SUCCEEDED, result)
            log.info("job_succeeded", job=job.name, adapters=list(result.adapter_versions))
            return final
        except JobCancelled as exc:
            log.info("job_cancelled", job=job.name, detail=str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - any failure of the job is the job's FAILED outcome
            log.warning("job_failed", job=job.name, error=repr(exc))
            try:
                return report(0.0, "failed", FAILED, error=f"{type(exc).__name__}: {exc}")
            except JobCancelled:
                return None

    def serve_forever(self, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            try:
                job = self.run_once()
            except grpc.RpcError as err:  # the store is down or restarting: try again later
                log.warning("store_unreachable", code=str(err.code()), detail=err.details())
                job = None
            if job is None:
                time.sleep(self.settings.poll_s)
