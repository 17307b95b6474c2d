"""`valora jobs ...`: the generation jobs `valora generate` queues."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, console, gateway_address, iso_time
from valora.client import ValoraClient

jobs_app = typer.Typer(help="Generation jobs (queued by `valora generate`).", no_args_is_help=True)


def job_state(job) -> str:
    from valora_protos.v1 import resources_pb2

    return resources_pb2.GenerationJobState.Name(job.state).removeprefix("GENERATION_JOB_STATE_")


def job_result_table(job) -> Table:
    """A SUCCEEDED job's tasks: adapter version, threshold and measured test accuracy."""
    table = Table("task", "adapter version", "threshold", "accuracy (test)", title=f"{job.name} {job_state(job)}")
    for t in job.result.tasks:
        ok = t.measured_accuracy >= t.accuracy_threshold
        table.add_row(
            t.task,
            t.adapter_version,
            f"{t.accuracy_threshold:.3f}",
            f"{'' if ok else '[red]'}{t.measured_accuracy:.3f}{'' if ok else '[/red]'}",
        )
    if job.result.fused_order:
        table.caption = f"fused in order ({job.fusion_order or 'given'}): " + ", ".join(job.result.fused_order)
    return table


def job_probe_table(job) -> Table | None:
    """A probed job's interference probes (its result's probe; None without one): each task's
    validation accuracy alone and its drop when trained with each other task, then the adapters
    the order was planned as, with their smallest predicted margin, and the probes' budget."""
    if not job.result.HasField("probe"):
        return None
    probe = job.result.probe
    tasks = list(probe.given_order)
    drop = {t: {} for t in tasks}
    for p in probe.pairs:
        drop[p.first][p.second] = p.first_drop
        drop[p.second][p.first] = p.second_drop
    table = Table(
        "task",
        "alone",
        *[f"drop with {t}" for t in tasks],
        title="interference probes: each task's val accuracy alone, and what it drops trained with another",
    )
    for t in tasks:
        cells = [f"{drop[t][o]:+.3f}" if o in drop[t] else "" for o in tasks]
        table.add_row(t, f"{probe.alone[t]:.3f}", *cells)
    planned = " / ".join(
        ", ".join(a.tasks) + (f" ({min(a.predicted_margins.values()):+.3f})" if a.predicted_margins else "")
        for a in probe.planned
    )
    table.caption = (
        f"planned adapters (smallest predicted margin): {planned}\n"
        f"{probe.trainings} probes of {probe.epochs} epochs x {probe.batches_per_epoch} batches of "
        f"{probe.batch_size} per task, {probe.seconds:.0f} s; {probe.rule}"
    )
    return table


def print_job_result(job) -> None:
    """A succeeded job's result table, and its probe table when it has one."""
    console.print(job_result_table(job))
    probes = job_probe_table(job)
    if probes is not None:
        console.print(probes)


@jobs_app.command("list")
def jobs_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List generation jobs, newest first."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        jobs = client.list_generation_jobs()
    table = Table(title="generation jobs")
    for col in ("job", "state", "progress", "sources", "created", "message"):
        table.add_column(col, justify="right" if col == "progress" else "left")
    for j in jobs:
        table.add_row(
            j.name,
            job_state(j),
            f"{j.progress:.0%}",
            ", ".join(f"{s.task}:{s.accuracy_threshold:g}" for s in j.sources),
            iso_time(j.create_time),
            Text(j.error or j.message),
        )
    console.print(table)


@jobs_app.command("get")
def jobs_get(
    name: str = typer.Argument(..., help="generationJobs/{j} or {j}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Show one generation job: state, progress, sources and, once it SUCCEEDED, its result."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        j = client.get_generation_job(name)
    console.print(
        f"{j.name}: {job_state(j)} progress={j.progress:.0%} rank={j.rank or 8} epochs={j.epochs or 4} "
        f"created={iso_time(j.create_time)} updated={iso_time(j.update_time)}",
        markup=False,
    )
    console.print(
        "sources: "
        + ", ".join(f"{s.task}:{s.accuracy_threshold:g}" + (f" ({s.dataset})" if s.dataset else "") for s in j.sources),
        markup=False,
    )
    if j.error or j.message:
        console.print(j.error or j.message, markup=False, highlight=False)
    if job_state(j) == "SUCCEEDED":
        print_job_result(j)


@jobs_app.command("cancel")
def jobs_cancel(
    name: str = typer.Argument(..., help="generationJobs/{j} or {j}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Cancel a PENDING or RUNNING job (a finished one: FAILED_PRECONDITION)."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        j = client.cancel_generation_job(name)
    console.print(f"{j.name}: {job_state(j)}", markup=False)
