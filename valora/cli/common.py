"""What every command shares: the root `app` (and its --version), the console, the options
that name the cluster (--home, --address, the keys) and the helpers that read them."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from valora import cluster as cluster_mod

app = typer.Typer(help="valora: multi-LoRA serving for vision applications.", no_args_is_help=True)


def _version(show: bool) -> None:
    if show:
        typer.echo(f"valora {importlib.metadata.version('valora')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """valora: multi-LoRA serving for vision applications."""


console = Console()

HOME = typer.Option(cluster_mod.DEFAULT_HOME, "--home", envvar="VALORA_HOME", help="State, logs, model cache.")
ADDRESS = typer.Option(
    None, "--address", envvar="VALORA_ADDRESS", help="Gateway host:port (default: the running local cluster)."
)
API_KEY = typer.Option(None, "--api-key", envvar="VALORA_API_KEY", help="Inference API key.")
ADMIN_KEY = typer.Option(None, "--admin-key", envvar="VALORA_ADMIN_KEY", help="Admin API key.")


def gateway_address(home: Path, address: str | None) -> str:
    """The gateway to call: --address, else the running local cluster's, else 127.0.0.1:50051."""
    if address:
        return address
    running = cluster_mod.Cluster.load(home)
    return running.gateway if running else "127.0.0.1:50051"


def refuse(message: str) -> NoReturn:
    """A bad `valora up` setting or option: one red line, exit 2, nothing started."""
    console.print(f"error: {message}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def server_code(name: str, extra: str = "server"):
    """Entry point `name` of the server's distribution (valora/server_code.py), loaded; when it is
    not installed, or its code lacks `extra`'s packages here: one red line naming the install, exit 1."""
    from valora import server_code as code

    try:
        return code.load(name, extra)
    except code.ServerCodeMissing as e:
        console.print(f"error: {e}", style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def iso_time(ts) -> str:
    """A protobuf Timestamp as UTC ISO time ("-" when unset)."""
    import datetime as dt

    if not ts.seconds and not ts.nanos:
        return "-"
    return ts.ToDatetime(tzinfo=dt.timezone.utc).isoformat(timespec="seconds")
