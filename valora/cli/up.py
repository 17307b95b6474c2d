"""`valora up` and `valora down`: start and stop the local cluster."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from valora import cluster as cluster_mod
from valora.cli.common import HOME, app, console, refuse


class WorkerDevice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class WorkerDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@app.command()
def up(
    ctx: typer.Context,
    home: Path = HOME,
    workers: int = typer.Option(1, min=1, help="Worker processes (with --device cuda: one per visible GPU in turn)."),
    port: int = typer.Option(50051, help="Gateway port (0: any free port)."),
    http_port: int = typer.Option(
        8080,
        help="Gateway's OpenAI-compatible HTTP port (0: any free port). "
        "Given while the gateway's http_enabled is false (--set, --config or "
        "VALORA_HTTP_ENABLED) it is an error (exit 2), never ignored.",
    ),
    model_path: Path = typer.Option(None, help="Local model directory (default: the tiny embedded model)."),
    device: WorkerDevice = typer.Option(
        WorkerDevice.cpu,
        "--device",
        envvar="VALORA_DEVICE",
        help="Workers' torch device. cuda: worker i gets visible GPU i mod the "
        "GPU count as its only GPU (CUDA_VISIBLE_DEVICES), so several GPUs get "
        "one worker each and with one GPU every worker shares it.",
    ),
    dtype: WorkerDtype = typer.Option(
        None,
        "--dtype",
        envvar="VALORA_DTYPE",
        show_default=False,
        help="Workers' model dtype (default: float32 on cpu, bfloat16 on cuda). "
        "CUDA workers in bfloat16/float16 build the kernels extension at "
        "start-up (ATMM, switch).",
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        envvar="VALORA_TP_SIZE",
        help="Tensor-parallel size of every worker (VALORA_TP_SIZE): with --device cuda "
        "each worker takes the next block of this many visible GPUs.",
    ),
    settings: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        show_default=False,
        help="A worker setting by its field name (max_batch_size=64, "
        "decode_graphs=off), or SERVICE.KEY=VALUE for another service's; "
        "repeatable; checked before anything starts.",
    ),
    config: Path = typer.Option(
        None,
        "--config",
        exists=True,
        dir_okay=False,
        show_default=False,
        help="TOML file of settings: tables worker, gateway, scheduler and "
        "adapter_store, each mapping setting names to values.",
    ),
    startup_timeout: float = typer.Option(
        cluster_mod.STARTUP_TIMEOUT_S,
        "--startup-timeout",
        metavar="SECONDS",
        help="Seconds each service (the workers "
        "together) has to become healthy; past it every process "
        "started is stopped.",
    ),
):
    """Start the local cluster (adapter_store, workers, scheduler, gateway) and print the ports.

    --device cuda: GPUs are counted without initialising CUDA here, from
    CUDA_VISIBLE_DEVICES when it is set (restrict the GPUs with it), else
    `nvidia-smi -L`; worker i runs on GPU i mod that count.

    Settings (the worker's: WorkerSettings of services/worker/config.py; also
    the gateway's, scheduler's and adapter_store's, each field VALORA_<FIELD>):
    --set over --config over the caller's environment over the defaults.
    --device, --dtype, --tp, --port and --http-port given on the command line
    win over --config, and a --set of the same setting must agree with them."""
    if cluster_mod.Cluster.load(home):
        console.print(f"[yellow]a cluster is already recorded in {home}; run `valora down` first")
        raise typer.Exit(1)
    if startup_timeout <= 0:
        refuse(f"--startup-timeout {startup_timeout:g}: must be more than 0 seconds")
    try:
        sets = cluster_mod.parse_set(settings)
        from_file = cluster_mod.load_settings_file(config) if config else {}
        checked = cluster_mod.check_settings(sets, from_file, os.environ, config)
        device, dtype, tp, port, http_port = (
            _flag_or_setting(ctx, flag, value, service, key, sets, from_file, checked)
            for flag, value, service, key in (
                ("device", device, "worker", "device"),
                ("dtype", dtype, "worker", "dtype"),
                ("tp", tp, "worker", "tp_size"),
                ("port", port, "gateway", "port"),
                ("http_port", http_port, "gateway", "http_port"),
            )
        )
        http_given = getattr(ctx.get_parameter_source("http_port"), "name", "") == "COMMANDLINE"
        cluster_mod.check_http_port(
            f"--http-port {http_port}" if http_given else None, sets, from_file, os.environ, config
        )
    except cluster_mod.SettingsError as e:
        refuse(str(e))
    device_name = device.value if isinstance(device, Enum) else device  # a setting's value: its text
    dtype_name = (
        (dtype.value if isinstance(dtype, Enum) else dtype)
        if dtype
        else ("bfloat16" if device_name == "cuda" else "float32")
    )
    gpu_ids = cluster_mod.visible_gpus() if device_name == "cuda" else []
    try:
        worker_env = cluster_mod.worker_device_env(workers, device_name, dtype_name, gpu_ids, tp)
    except ValueError as e:
        refuse(str(e))
    # The settings of the flags above are the flags' values (worker_env, the ports); the tensor-parallel
    # size always, or a VALORA_TP_SIZE of the caller's would outlive --tp 1.
    flagged = {"VALORA_DEVICE", "VALORA_DTYPE", "VALORA_TP_SIZE", "VALORA_PORT", "VALORA_HTTP_PORT"}
    service_env = {
        svc: {k: v for k, v in env.items() if k not in flagged}
        for svc, env in cluster_mod.merge_settings(sets, from_file).items()
    }
    service_env["worker"]["VALORA_TP_SIZE"] = str(tp)
    if "VALORA_GPU_MEMORY_FRACTION" in service_env["worker"]:  # the user's share, not the split
        worker_env = [{k: v for k, v in e.items() if k != "VALORA_GPU_MEMORY_FRACTION"} for e in worker_env]
    try:
        with console.status("starting valora (building the tiny model on first run)…"):
            c = cluster_mod.start_cluster(
                home,
                workers=workers,
                gateway_port=port,
                model_path=model_path,
                http_port=http_port,
                worker_env=worker_env,
                service_env=service_env,
                startup_timeout_s=startup_timeout,
            )
    except cluster_mod.StartupError as e:
        console.print(
            f"error: {e}; every process started was stopped", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(1) from None
    table = Table(title="valora cluster")
    for col in ("service", "name", "address", "metrics", "pid", "log"):
        table.add_column(col)
    for p in c.processes:
        table.add_row(p.service, p.name, p.address, p.metrics_url, str(p.pid), p.log)
    console.print(table)
    if device_name == "cuda":
        used = sorted({g for e in worker_env for g in e["CUDA_VISIBLE_DEVICES"].split(",")}, key=gpu_ids.index)
        blocks = " | ".join(e["CUDA_VISIBLE_DEVICES"] for e in worker_env) if tp > 1 else ", ".join(used)
        console.print(
            f"workers: cuda {dtype_name} on GPU {blocks}"
            + (f" (tensor parallel {tp})" if tp > 1 else "")
            + (
                f" ({workers} workers share {len(used)} GPU{'s' if len(used) > 1 else ''})"
                if workers * tp > len(used)
                else ""
            )
        )
    http = f"  OpenAI-compatible HTTP: [bold]{c.http_url}[/bold]" if c.http_url else ""  # none: http_enabled off
    console.print(f"gateway: [bold]{c.gateway}[/bold]{http}")


def _flag_or_setting(
    ctx: typer.Context, flag: str, value, service: str, key: str, sets: dict, from_file: dict, checked: dict
):
    """The value of a `valora up` flag that is also a service setting: the flag given on the command
    line, else --set, else --config, else the flag's environment variable or default (`value`). A
    --set that disagrees with the flag given is a SettingsError."""
    # (by name: this typer vendors its own click, whose ParameterSource is not click's)
    given = getattr(ctx.get_parameter_source(flag), "name", "") == "COMMANDLINE"
    if key not in sets.get(service, {}) and key not in from_file.get(service, {}):
        return value
    setting = getattr(checked[service], key)
    option = "--" + flag.replace("_", "-")
    if not given:
        return setting
    flag_value = value.value if isinstance(value, Enum) else value
    if key in sets.get(service, {}) and setting != flag_value:
        prefix = "" if service == "worker" else f"{service}."
        raise cluster_mod.SettingsError(
            f"--set {prefix}{key}={sets[service][key]} disagrees with {option} {flag_value}"
        )
    return value


@app.command()
def down(home: Path = HOME):
    """Stop the local cluster (graceful drain, then kill)."""
    stopped = cluster_mod.stop_cluster(home)
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
