"""`valora adapters ...`: register, inspect and delete adapters, their versions and aliases."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from valora.cli.common import ADDRESS, ADMIN_KEY, HOME, console, gateway_address, iso_time
from valora.client import ValoraClient

adapters_app = typer.Typer(
    help="Register, inspect and delete adapters, their versions and aliases.", no_args_is_help=True
)


@adapters_app.command("register")
def adapters_register(
    adapter: str,
    bundle: Path = typer.Option(..., exists=True, dir_okay=False, help="adapter_model.safetensors"),
    config: Path = typer.Option(..., exists=True, dir_okay=False, help="adapter_config.json"),
    alias: str = typer.Option(None),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Upload a PEFT adapter (safetensors + adapter_config.json) as a new immutable version."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        version = client.upload_adapter_version(adapter, bundle.read_bytes(), config.read_text())
        if alias:
            client.set_alias(version.name.split("/versions/")[0], alias, version.name)
    console.print(f"{version.name} sha256={version.sha256[:12]} rank={version.rank} state={version.state}")


@adapters_app.command("list")
def adapters_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List adapters with their versions and aliases."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        table = Table(title="adapters")
        for col in ("adapter", "versions", "aliases"):
            table.add_column(col)
        for a in client.list_adapters():
            versions = client.list_versions(a.name)
            table.add_row(
                a.name,
                ", ".join(f"v{v.name.rsplit('/', 1)[1]} r{v.rank} {v.state}" for v in versions),
                ", ".join(f"{k}→{v.rsplit('/', 1)[1]}" for k, v in sorted(a.aliases.items())),
            )
        console.print(table)


def _adapter_name(name: str) -> str:
    return name if name.startswith("adapters/") else f"adapters/{name}"


def _version_number(version_name: str) -> str:
    return version_name.rsplit("/", 1)[1]


@adapters_app.command("get")
def adapters_get(
    name: str = typer.Argument(..., help="adapters/{a} or {a}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Show one adapter: latest version, aliases, creation time, etag, description."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        a = client.get_adapter(name)
    aliases = ", ".join(f"{k}→{_version_number(v)}" for k, v in sorted(a.aliases.items())) or "-"
    console.print(
        f"{a.name} latest=v{a.latest_version} aliases={aliases} created={iso_time(a.create_time)} etag={a.etag}",
        markup=False,
    )
    if a.description:
        console.print(a.description, markup=False, highlight=False)


@adapters_app.command("delete")
def adapters_delete(
    name: str = typer.Argument(..., help="adapters/{a} or {a}"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    etag: str = typer.Option(
        "", help="Delete only if the adapter still has this etag (`valora adapters get` shows it)."
    ),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Delete an adapter: retire every version, remove its aliases and name (refused while a task uses it)."""
    name = _adapter_name(name)
    if not yes:
        typer.confirm(f"delete {name}, retiring all its versions?", abort=True)
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        client.delete_adapter(name, etag=etag)
    console.print(f"deleted {name}", markup=False)


@adapters_app.command("versions")
def adapters_versions(
    name: str = typer.Argument(..., help="adapters/{a} or {a}"),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """List an adapter's versions with their rank, state, size, heads and the aliases on them."""
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        a = client.get_adapter(name)
        versions = client.list_versions(a.name)
    on = {}
    for alias, target in sorted(a.aliases.items()):
        on.setdefault(target, []).append(alias)
    table = Table(title=f"{a.name} versions")
    for col in ("version", "rank", "state", "size", "sha256", "heads", "aliases"):
        table.add_column(col, justify="right" if col in ("rank", "size") else "left")
    for v in versions:
        table.add_row(
            f"v{_version_number(v.name)}",
            str(v.rank),
            v.state,
            str(v.size_bytes),
            v.sha256[:12],
            ", ".join(f"{h} ({len(labels)})" for h, labels in v.heads.items()) or "-",
            ", ".join(on.get(v.name, [])) or "-",
        )
    console.print(table)


@adapters_app.command("alias")
def adapters_alias(
    name: str = typer.Argument(..., help="adapters/{a} or {a}"),
    alias: str = typer.Argument(..., help="Alias to set (prod, canary, ...)."),
    version: str = typer.Argument(..., help="Version number (3 or v3) or adapters/{a}/versions/{v}."),
    etag: str = typer.Option("", help="Move the alias only if it still has this etag."),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Point an alias at a READY version (creating the alias or moving it)."""
    name = _adapter_name(name)
    number = version.removeprefix("v")
    target = f"{name}/versions/{number}" if number.isdigit() else _adapter_name(version)
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        new_etag = client.set_alias(name, alias, target, etag=etag)
    console.print(f"{name}@{alias} → {target} etag={new_etag}", markup=False)


@adapters_app.command("unalias")
def adapters_unalias(
    name: str = typer.Argument(..., help="adapters/{a} or {a}"),
    alias: str = typer.Argument(..., help="Alias to remove."),
    home: Path = HOME,
    address: str = ADDRESS,
    admin_key: str = ADMIN_KEY,
):
    """Remove an alias (refused while a task uses it)."""
    name = _adapter_name(name)
    with ValoraClient(gateway_address(home, address), admin_key=admin_key) as client:
        client.delete_alias(name, alias)
    console.print(f"removed {name}@{alias}", markup=False)
