"""`valora tasks ...`: tasks, named adapter references with a head and an accuracy threshold."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, console, gateway_address, iso_time
from valora.client import ValoraClient

tasks_app = typer.Typer(help="Tasks: named adapter references with a head and an accuracy threshold.",
                        no_args_is_help=True)


def _slo(t) -> str:
    """The task's latency objective as `{class}:{ms}ms`, "-" when it has none."""
    return f"{t.slo_class}:{t.slo_ms:g}ms" if t.slo_ms else "-"


def _task_line(t) -> str:
    return (f"{t.name} adapter={t.adapter} head={t.head or '-'} threshold={t.accuracy_threshold:.3f} "
            f"accuracy={t.measured_accuracy:.3f} created={iso_time(t.create_time)} slo={_slo(t)}")


@tasks_app.command("list")
def tasks_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List tasks with their adapter, head, threshold, measured accuracy and latency objective."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        tasks = client.list_tasks()
    table = Table(title="tasks")
    for col in ("task", "adapter", "head", "threshold", "accuracy", "slo", "description"):
        table.add_column(col, justify="right" if col in ("threshold", "accuracy", "slo") else "left")
    for t in tasks:
        table.add_row(t.name, t.adapter, t.head or "-", f"{t.accuracy_threshold:.3f}", f"{t.measured_accuracy:.3f}",
                      _slo(t), Text(t.description))  # user text, not markup
    console.print(table)


@tasks_app.command("get")
def tasks_get(name: str = typer.Argument(..., help="tasks/{t} or {t}"), home: Path = HOME, address: str = ADDRESS,
              admin_key: str = ADMIN_KEY):
    """Show one task."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        t = client.get_task(name)
    console.print(_task_line(t), markup=False)
    if t.description:
        console.print(t.description, markup=False, highlight=False)


@tasks_app.command("create")
def tasks_create(task_id: str = typer.Argument(..., help="{t} of tasks/{t}"),
                 adapter: str = typer.Option(..., help="Adapter reference: adapters/{a}, adapters/{a}@{alias} or "
                                             "adapters/{a}/versions/{v}."),
                 head: str = typer.Option("", help="Head in the adapter bundle (empty: LM-head text task)."),
                 description: str = typer.Option(""),
                 threshold: float = typer.Option(0.0, min=0.0, max=1.0, help="Accuracy the task must keep."),
                 accuracy: float = typer.Option(0.0, min=0.0, max=1.0, help="Last measured accuracy."),
                 slo_ms: float = typer.Option(0.0, min=0.0, help="Latency objective of the task's requests in ms, "
                                              "arrival at the scheduler to result (0: none)."),
                 slo_class: str = typer.Option("", help="Application the objective belongs to; tasks of one class "
                                               "share it (empty: the task's id)."),
                 home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Create a task naming an adapter (and head) so requests can say tasks/{t}."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        t = client.create_task(task_id, adapter, head=head, description=description, accuracy_threshold=threshold,
                               measured_accuracy=accuracy, slo_ms=slo_ms, slo_class=slo_class)
    console.print(_task_line(t), markup=False)


@tasks_app.command("delete")
def tasks_delete(name: str = typer.Argument(..., help="tasks/{t} or {t}"), home: Path = HOME, address: str = ADDRESS,
                 admin_key: str = ADMIN_KEY):
    """Delete a task (its adapter stays)."""
    name = name if name.startswith("tasks/") else f"tasks/{name}"
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        client.delete_task(name)
    console.print(f"deleted {name}", markup=False)
