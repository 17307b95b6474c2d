"""`valora generate`: queue accuracy-aware adapter generation (a GenerationJob)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from valora import cluster as cluster_mod
from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, app, console, gateway_address, refuse, server_code
from valora.cli.jobs import job_state, print_job_result
from valora.client import ValoraClient


def _parse_sources(items: list[str]) -> list[tuple[str, float]]:
    out = []
    for item in items:
        task, _, threshold = item.partition(":")
        try:
            out.append((task.strip(), float(threshold) if threshold else 0.0))
        except ValueError:
            raise typer.BadParameter(f"--source expects task[:threshold], got {item!r}") from None
    return out


@app.command()
def generate(
    source: list[str] = typer.Option(
        [],
        "--source",
        "-s",
        help="task[:accuracy threshold], in fusion "
        "order (repeatable); `python -m services.generator tasks` lists tasks.",
    ),
    dataset: Path = typer.Option(
        None,
        "--dataset",
        help="Your dataset (an image folder, a JSONL file, or "
        "an archive of one): validated here, uploaded through the store, its "
        "tasks added to the sources.",
    ),
    threshold: float = typer.Option(
        0.0, min=0.0, max=1.0, help="Accuracy threshold of the --dataset tasks that no --source names."
    ),
    base_model: Path = typer.Option(
        None, help="Base model path on the runner's machine (default: the local cluster's tiny model)."
    ),
    rank: int = typer.Option(8, min=1, max=256),
    epochs: int = typer.Option(4, min=1),
    limit: int = typer.Option(0, min=0, help="Cap on each split's size (0: full splits)."),
    fusion_order: str = typer.Option(
        "given",
        help="given: fuse the sources in their order; probed: in an order the runner chooses from "
        "interference probes (each source alone and each pair together, briefly trained).",
    ),
    prefix: str = typer.Option("", help="Adapter/task id prefix (default: the job id)."),
    job_id: str = typer.Option("", help="Job id (default: the store picks one)."),
    wait: bool = typer.Option(False, "--wait", help="Poll the job with a progress bar until it ends."),
    poll_s: float = typer.Option(1.0, help="Seconds between polls with --wait."),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Queue accuracy-aware adapter generation (a GenerationJob run by `python -m services.generator serve`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    model = str(Path(base_model or cluster_mod.default_model_path(home)).expanduser().resolve())
    if not source and dataset is None:
        raise typer.BadParameter("give --source (built-in tasks) and/or --dataset")
    sources = _parse_sources(source)
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        if dataset is not None:
            datasets = server_code("user-datasets", extra="generator")
            try:
                sources = datasets.upload_for_job(client, dataset, sources, threshold)
            except datasets.DatasetError as exc:
                refuse(str(exc))
        job = client.create_generation_job(
            model,
            sources,
            rank=rank,
            epochs=epochs,
            adapter_prefix=prefix,
            split_limit=limit,
            job_id=job_id,
            fusion_order=fusion_order,
        )
        console.print(f"{job.name}: {job_state(job)}")
        if not wait:
            return
        with Progress(
            TextColumn("[bold]{task.fields[state]}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
        ) as progress:
            bar = progress.add_task(job.message, total=1.0, state=job_state(job))
            while job_state(job) in ("PENDING", "RUNNING"):
                time.sleep(poll_s)
                job = client.get_generation_job(job.name)
                progress.update(bar, completed=job.progress, description=job.message, state=job_state(job))
    state = job_state(job)
    if state != "SUCCEEDED":
        console.print(f"[red]{job.name} {state}[/red] {job.error or job.message}")
        raise typer.Exit(1)
    print_job_result(job)
