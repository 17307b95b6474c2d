"""`valora tasks ...`: tasks, named adapter references with a head and an accuracy threshold."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, console, gateway_address, iso_time
from valora.client import RELEASE_RULES, ValoraClient, release_rule_name

tasks_app = typer.Typer(
    help="Tasks: named adapter references with a head and an accuracy threshold.", no_args_is_help=True
)


def _slo(t) -> str:
    """The task's latency objective as `{class}:{ms}ms`, "-" when it has none."""
    return f"{t.slo_class}:{t.slo_ms:g}ms" if t.slo_ms else "-"


def _release(t) -> str:
    """The task's early adapter release policy (its requests' default): the fraction, the rule,
    or the rule with its least share (`sentence_end>=0.25`); "-" when off."""
    fraction = f"{t.adapter_release_fraction:g}" if t.adapter_release_fraction else ""
    if not t.adapter_release_rule:
        return fraction or "-"
    return release_rule_name(t.adapter_release_rule) + (f">={fraction}" if fraction else "")


def _rule(name: str | None) -> str | None:
    """--release-rule checked before any call."""
    if name is not None and name not in ("none", *RELEASE_RULES):
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(RELEASE_RULES)}", param_hint="--release-rule")
    return name


def _task_line(t) -> str:
    return (
        f"{t.name} adapter={t.adapter} head={t.head or '-'} threshold={t.accuracy_threshold:.3f} "
        f"accuracy={t.measured_accuracy:.3f} created={iso_time(t.create_time)} slo={_slo(t)} "
        f"release={_release(t)} etag={t.etag}"
    )


RELEASE_HELP = (
    "Early adapter release of the task's requests that set none of their own: after this share of "
    "max_new_tokens a request goes on without the adapter (0: never); with --release-rule, the least share "
    "before the rule may release it."
)
RULE_HELP = (
    "Early adapter release decided at run time for the task's requests that set none of their own: "
    "sentence_end releases it after the answer's first sentence or line (none: no rule)."
)


@tasks_app.command("list")
def tasks_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List tasks with their adapter, head, threshold, measured accuracy, latency objective and
    early adapter release policy."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        tasks = client.list_tasks()
    table = Table(title="tasks")
    for col in ("task", "adapter", "head", "threshold", "accuracy", "slo", "release", "description"):
        table.add_column(col, justify="right" if col in ("threshold", "accuracy", "slo", "release") else "left")
    for t in tasks:
        table.add_row(
            t.name,
            t.adapter,
            t.head or "-",
            f"{t.accuracy_threshold:.3f}",
            f"{t.measured_accuracy:.3f}",
            _slo(t),
            _release(t),
            Text(t.description),
        )  # user text, not markup
    console.print(table)


@tasks_app.command("get")
def tasks_get(
    name: str = typer.Argument(..., help="tasks/{t} or {t}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Show one task."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        t = client.get_task(name)
    console.print(_task_line(t), markup=False)
    if t.description:
        console.print(t.description, markup=False, highlight=False)


@tasks_app.command("create")
def tasks_create(
    task_id: str = typer.Argument(..., help="{t} of tasks/{t}"),
    adapter: str = typer.Option(
        ..., help="Adapter reference: adapters/{a}, adapters/{a}@{alias} or adapters/{a}/versions/{v}."
    ),
    head: str = typer.Option("", help="Head in the adapter bundle (empty: LM-head text task)."),
    description: str = typer.Option(""),
    threshold: float = typer.Option(0.0, min=0.0, max=1.0, help="Accuracy the task must keep."),
    accuracy: float = typer.Option(0.0, min=0.0, max=1.0, help="Last measured accuracy."),
    slo_ms: float = typer.Option(
        0.0,
        min=0.0,
        help="Latency objective of the task's requests in ms, arrival at the scheduler to result (0: none).",
    ),
    slo_class: str = typer.Option(
        "", help="Application the objective belongs to; tasks of one class share it (empty: the task's id)."
    ),
    release_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=RELEASE_HELP),
    release_rule: str = typer.Option("none", help=RULE_HELP),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Create a task naming an adapter (and head) so requests can say tasks/{t}."""
    _rule(release_rule)
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        t = client.create_task(
            task_id,
            adapter,
            head=head,
            description=description,
            accuracy_threshold=threshold,
            measured_accuracy=accuracy,
            slo_ms=slo_ms,
            slo_class=slo_class,
            adapter_release_fraction=release_fraction,
            adapter_release_rule=release_rule,
        )
    console.print(_task_line(t), markup=False)


@tasks_app.command("update")
def tasks_update(
    name: str = typer.Argument(..., help="tasks/{t} or {t}"),
    description: str = typer.Option(None),
    slo_ms: float = typer.Option(
        None, min=0.0, help="Latency objective in ms (0: none; alone, it clears the class too)."
    ),
    slo_class: str = typer.Option(None, help="Application the objective belongs to (empty: the task's id)."),
    release_fraction: float = typer.Option(None, min=0.0, max=1.0, help=RELEASE_HELP),
    release_rule: str = typer.Option(None, help=RULE_HELP),
    etag: str = typer.Option("", help="Update only if the task still has this etag (`valora tasks get` shows it)."),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Change a task's description, latency objective, SLO class or release policy (the options
    given; the rest stay). Its adapter, head and threshold are fixed: create a new task for those."""
    given = (description, slo_ms, slo_class, release_fraction, _rule(release_rule))
    if all(v is None for v in given):
        raise typer.BadParameter(
            "give at least one of --description, --slo-ms, --slo-class, --release-fraction, --release-rule"
        )
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        t = client.update_task(
            name,
            description=description,
            slo_ms=slo_ms,
            slo_class=slo_class,
            adapter_release_fraction=release_fraction,
            adapter_release_rule=release_rule,
            etag=etag,
        )
    console.print(_task_line(t), markup=False)


@tasks_app.command("delete")
def tasks_delete(
    name: str = typer.Argument(..., help="tasks/{t} or {t}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Delete a task (its adapter stays)."""
    name = name if name.startswith("tasks/") else f"tasks/{name}"
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        client.delete_task(name)
    console.print(f"deleted {name}", markup=False)
