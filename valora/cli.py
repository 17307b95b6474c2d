"""`valora` command line: run a local cluster, register adapters, send requests, run the demo."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from valora import cluster as cluster_mod
from valora.client import ValoraClient
from valora.v1 import types_pb2

app = typer.Typer(help="valora: multi-LoRA serving for vision applications.", no_args_is_help=True)


def _version(show: bool) -> None:
    if show:
        typer.echo(f"valora {importlib.metadata.version('valora')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """valora: multi-LoRA serving for vision applications."""
adapters_app = typer.Typer(help="Register, inspect and delete adapters, their versions and aliases.",
                            no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
tasks_app = typer.Typer(help="Tasks: named adapter references with a head and an accuracy threshold.",
                        no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")
jobs_app = typer.Typer(help="Generation jobs (queued by `valora generate`).", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
console = Console()

HOME = typer.Option(cluster_mod.DEFAULT_HOME, "--home", envvar="VALORA_HOME", help="State, logs, model cache.")
ADDRESS = typer.Option(None, "--address", envvar="VALORA_ADDRESS",
                       help="Gateway host:port (default: the running local cluster).")
API_KEY = typer.Option(None, "--api-key", envvar="VALORA_API_KEY", help="Inference API key.")
ADMIN_KEY = typer.Option(None, "--admin-key", envvar="VALORA_ADMIN_KEY", help="Admin API key.")


def _address(home: Path, address: str | None) -> str:
    if address:
        return address
    running = cluster_mod.Cluster.load(home)
    return running.gateway if running else "127.0.0.1:50051"


class WorkerDevice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class WorkerDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@app.command()
def up(ctx: typer.Context, home: Path = HOME,
       workers: int = typer.Option(1, min=1, help="Worker processes (with --device cuda: one per visible GPU "
                                   "in turn)."),
       port: int = typer.Option(50051, help="Gateway port (0: any free port)."),
       http_port: int = typer.Option(8080, help="Gateway's OpenAI-compatible HTTP port (0: any free port). "
                                     "Given while the gateway's http_enabled is false (--set, --config or "
                                     "VALORA_HTTP_ENABLED) it is an error (exit 2), never ignored."),
       model_path: Path = typer.Option(None, help="Local model directory (default: the tiny embedded model)."),
       device: WorkerDevice = typer.Option(WorkerDevice.cpu, "--device", envvar="VALORA_DEVICE",
                                           help="Workers' torch device. cuda: worker i gets visible GPU i mod the "
                                           "GPU count as its only GPU (CUDA_VISIBLE_DEVICES), so several GPUs get "
                                           "one worker each and with one GPU every worker shares it."),
       dtype: WorkerDtype = typer.Option(None, "--dtype", envvar="VALORA_DTYPE", show_default=False,
                                         help="Workers' model dtype (default: float32 on cpu, bfloat16 on cuda). "
                                         "CUDA workers in bfloat16/float16 build the kernels extension at "
                                         "start-up (ATMM, switch)."),
       tp: int = typer.Option(1, "--tp", min=1, envvar="VALORA_TP_SIZE",
                              help="Tensor-parallel size of every worker (VALORA_TP_SIZE): with --device cuda "
                              "each worker takes the next block of this many visible GPUs."),
       settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", show_default=False,
                                          help="A worker setting by its field name (max_batch_size=64, "
                                          "decode_graphs=off), or SERVICE.KEY=VALUE for another service's; "
                                          "repeatable; checked before anything starts."),
       config: Path = typer.Option(None, "--config", exists=True, dir_okay=False, show_default=False,
                                   help="TOML file of settings: tables worker, gateway, scheduler and "
                                   "adapter_store, each mapping setting names to values."),
       startup_timeout: float = typer.Option(cluster_mod.STARTUP_TIMEOUT_S, "--startup-timeout",
                                             metavar="SECONDS", help="Seconds each service (the workers "
                                             "together) has to become healthy; past it every process "
                                             "started is stopped.")):
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
        _refuse(f"--startup-timeout {startup_timeout:g}: must be more than 0 seconds")
    try:
        sets = cluster_mod.parse_set(settings)
        from_file = cluster_mod.load_settings_file(config) if config else {}
        checked = cluster_mod.check_settings(sets, from_file, os.environ, config)
        device, dtype, tp, port, http_port = (
            _flag_or_setting(ctx, flag, value, service, key, sets, from_file, checked)
            for flag, value, service, key in (("device", device, "worker", "device"),
                                              ("dtype", dtype, "worker", "dtype"), ("tp", tp, "worker", "tp_size"),
                                              ("port", port, "gateway", "port"),
                                              ("http_port", http_port, "gateway", "http_port")))
        http_given = getattr(ctx.get_parameter_source("http_port"), "name", "") == "COMMANDLINE"
        cluster_mod.check_http_port(f"--http-port {http_port}" if http_given else None, sets, from_file,
                                    os.environ, config)
    except cluster_mod.SettingsError as e:
        _refuse(str(e))
    device_name = device.value if isinstance(device, Enum) else device  # a setting's value: its text
    dtype_name = (dtype.value if isinstance(dtype, Enum) else dtype) if dtype else (
        "bfloat16" if device_name == "cuda" else "float32")
    gpu_ids = cluster_mod.visible_gpus() if device_name == "cuda" else []
    try:
        worker_env = cluster_mod.worker_device_env(workers, device_name, dtype_name, gpu_ids, tp)
    except ValueError as e:
        _refuse(str(e))
    # The settings of the flags above are the flags' values (worker_env, the ports); the tensor-parallel
    # size always, or a VALORA_TP_SIZE of the caller's would outlive --tp 1.
    flagged = {"VALORA_DEVICE", "VALORA_DTYPE", "VALORA_TP_SIZE", "VALORA_PORT", "VALORA_HTTP_PORT"}
    service_env = {svc: {k: v for k, v in env.items() if k not in flagged}
                   for svc, env in cluster_mod.merge_settings(sets, from_file).items()}
    service_env["worker"]["VALORA_TP_SIZE"] = str(tp)
    if "VALORA_GPU_MEMORY_FRACTION" in service_env["worker"]:  # the user's share, not the split
        worker_env = [{k: v for k, v in e.items() if k != "VALORA_GPU_MEMORY_FRACTION"} for e in worker_env]
    try:
        with console.status("starting valora (building the tiny model on first run)…"):
            c = cluster_mod.start_cluster(home, workers=workers, gateway_port=port, model_path=model_path,
                                          http_port=http_port, worker_env=worker_env, service_env=service_env,
                                          startup_timeout_s=startup_timeout)
    except cluster_mod.StartupError as e:
        console.print(f"error: {e}; every process started was stopped", style="red", markup=False,
                      highlight=False, soft_wrap=True)
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
        console.print(f"workers: cuda {dtype_name} on GPU {blocks}" + (f" (tensor parallel {tp})" if tp > 1 else "")
                      + (f" ({workers} workers share {len(used)} GPU{'s' if len(used) > 1 else ''})"
                         if workers * tp > len(used) else ""))
    http = f"  OpenAI-compatible HTTP: [bold]{c.http_url}[/bold]" if c.http_url else ""  # none: http_enabled off
    console.print(f"gateway: [bold]{c.gateway}[/bold]{http}")


def _refuse(message: str) -> NoReturn:
    """A bad `valora up` setting or option: one red line, exit 2, nothing started."""
    console.print(f"error: {message}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _flag_or_setting(ctx: typer.Context, flag: str, value, service: str, key: str, sets: dict, from_file: dict,
                     checked: dict):
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
        raise cluster_mod.SettingsError(f"--set {prefix}{key}={sets[service][key]} disagrees with {option} "
                                        f"{flag_value}")
    return value


@app.command()
def down(home: Path = HOME):
    """Stop the local cluster (graceful drain, then kill)."""
    stopped = cluster_mod.stop_cluster(home)
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@app.command()
def infer(prompt: str = typer.Option("", "--prompt", "-p"),
          image: list[Path] = typer.Option([], "--image", "-i", exists=True, dir_okay=False),
          adapter: str = typer.Option(None, help="adapters/{a}, adapters/{a}/versions/{v} or adapters/{a}@{alias}"),
          task: str = typer.Option(None, help="tasks/{t}"),
          label: bool = typer.Option(False, help="Answer with the task head's label."),
          max_new_tokens: int = typer.Option(0), temperature: float = typer.Option(0.0),
          stream: bool = typer.Option(False), home: Path = HOME, address: str = ADDRESS, api_key: str = API_KEY):
    """Send one request."""
    with ValoraClient(_address(home, address), api_key=api_key) as client:
        if stream:
            for part in client.infer_stream(prompt, image, adapter=adapter, task=task,
                                            max_new_tokens=max_new_tokens, temperature=temperature):
                if isinstance(part, str):
                    console.print(part, end="")
                else:
                    console.print()
                    result = part
        else:
            result = client.infer(prompt, image, adapter=adapter, task=task, label=label,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
            console.print(result.label if label else result.text)
    console.print(f"[dim]mode={result.mode} adapter={result.adapter_version or '-'} worker={result.worker} "
                  f"tokens={result.output_tokens} ttft={result.first_token_ms:.1f}ms total={result.total_ms:.1f}ms")


@adapters_app.command("register")
def adapters_register(adapter: str, bundle: Path = typer.Option(..., exists=True, dir_okay=False,
                                                                help="adapter_model.safetensors"),
                      config: Path = typer.Option(..., exists=True, dir_okay=False, help="adapter_config.json"),
                      alias: str = typer.Option(None), home: Path = HOME, address: str = ADDRESS,
                      admin_key: str = ADMIN_KEY):
    """Upload a PEFT adapter (safetensors + adapter_config.json) as a new immutable version."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        version = client.upload_adapter_version(adapter, bundle.read_bytes(), config.read_text())
        if alias:
            client.set_alias(version.name.split("/versions/")[0], alias, version.name)
    console.print(f"{version.name} sha256={version.sha256[:12]} rank={version.rank} state={version.state}")


@adapters_app.command("list")
def adapters_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List adapters with their versions and aliases."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        table = Table(title="adapters")
        for col in ("adapter", "versions", "aliases"):
            table.add_column(col)
        for a in client.list_adapters():
            versions = client.list_versions(a.name)
            table.add_row(a.name, ", ".join(f"v{v.name.rsplit('/', 1)[1]} r{v.rank} {v.state}" for v in versions),
                          ", ".join(f"{k}→{v.rsplit('/', 1)[1]}" for k, v in sorted(a.aliases.items())))
        console.print(table)


def _adapter_name(name: str) -> str:
    return name if name.startswith("adapters/") else f"adapters/{name}"


def _when(ts) -> str:
    """A protobuf Timestamp as UTC ISO time ("-" when unset)."""
    import datetime as dt

    if not ts.seconds and not ts.nanos:
        return "-"
    return ts.ToDatetime(tzinfo=dt.timezone.utc).isoformat(timespec="seconds")


def _version_number(version_name: str) -> str:
    return version_name.rsplit("/", 1)[1]


@adapters_app.command("get")
def adapters_get(name: str = typer.Argument(..., help="adapters/{a} or {a}"), home: Path = HOME,
                 address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Show one adapter: latest version, aliases, creation time, etag, description."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        a = client.get_adapter(name)
    aliases = ", ".join(f"{k}→{_version_number(v)}" for k, v in sorted(a.aliases.items())) or "-"
    console.print(f"{a.name} latest=v{a.latest_version} aliases={aliases} created={_when(a.create_time)} "
                  f"etag={a.etag}", markup=False)
    if a.description:
        console.print(a.description, markup=False, highlight=False)


@adapters_app.command("delete")
def adapters_delete(name: str = typer.Argument(..., help="adapters/{a} or {a}"),
                    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
                    etag: str = typer.Option("", help="Delete only if the adapter still has this etag "
                                             "(`valora adapters get` shows it)."),
                    home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Delete an adapter: retire every version, remove its aliases and name (refused while a task uses it)."""
    name = _adapter_name(name)
    if not yes:
        typer.confirm(f"delete {name}, retiring all its versions?", abort=True)
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        client.delete_adapter(name, etag=etag)
    console.print(f"deleted {name}", markup=False)


@adapters_app.command("versions")
def adapters_versions(name: str = typer.Argument(..., help="adapters/{a} or {a}"), home: Path = HOME,
                      address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List an adapter's versions with their rank, state, size, heads and the aliases on them."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        a = client.get_adapter(name)
        versions = client.list_versions(a.name)
    on = {}
    for alias, target in sorted(a.aliases.items()):
        on.setdefault(target, []).append(alias)
    table = Table(title=f"{a.name} versions")
    for col in ("version", "rank", "state", "size", "sha256", "heads", "aliases"):
        table.add_column(col, justify="right" if col in ("rank", "size") else "left")
    for v in versions:
        table.add_row(f"v{_version_number(v.name)}", str(v.rank), v.state, str(v.size_bytes), v.sha256[:12],
                      ", ".join(f"{h} ({len(labels)})" for h, labels in v.heads.items()) or "-",
                      ", ".join(on.get(v.name, [])) or "-")
    console.print(table)


@adapters_app.command("alias")
def adapters_alias(name: str = typer.Argument(..., help="adapters/{a} or {a}"),
                   alias: str = typer.Argument(..., help="Alias to set (prod, canary, ...)."),
                   version: str = typer.Argument(..., help="Version number (3 or v3) or adapters/{a}/versions/{v}."),
                   etag: str = typer.Option("", help="Move the alias only if it still has this etag."),
                   home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Point an alias at a READY version (creating the alias or moving it)."""
    name = _adapter_name(name)
    number = version.removeprefix("v")
    target = f"{name}/versions/{number}" if number.isdigit() else _adapter_name(version)
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        new_etag = client.set_alias(name, alias, target, etag=etag)
    console.print(f"{name}@{alias} → {target} etag={new_etag}", markup=False)


@adapters_app.command("unalias")
def adapters_unalias(name: str = typer.Argument(..., help="adapters/{a} or {a}"),
                     alias: str = typer.Argument(..., help="Alias to remove."), home: Path = HOME,
                     address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Remove an alias (refused while a task uses it)."""
    name = _adapter_name(name)
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        client.delete_alias(name, alias)
    console.print(f"removed {name}@{alias}", markup=False)


def _slo(t) -> str:
    """The task's latency objective as `{class}:{ms}ms`, "-" when it has none."""
    return f"{t.slo_class}:{t.slo_ms:g}ms" if t.slo_ms else "-"


def _task_line(t) -> str:
    return (f"{t.name} adapter={t.adapter} head={t.head or '-'} threshold={t.accuracy_threshold:.3f} "
            f"accuracy={t.measured_accuracy:.3f} created={_when(t.create_time)} slo={_slo(t)}")


@tasks_app.command("list")
def tasks_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List tasks with their adapter, head, threshold, measured accuracy and latency objective."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
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
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
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
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        t = client.create_task(task_id, adapter, head=head, description=description, accuracy_threshold=threshold,
                               measured_accuracy=accuracy, slo_ms=slo_ms, slo_class=slo_class)
    console.print(_task_line(t), markup=False)


@tasks_app.command("delete")
def tasks_delete(name: str = typer.Argument(..., help="tasks/{t} or {t}"), home: Path = HOME, address: str = ADDRESS,
                 admin_key: str = ADMIN_KEY):
    """Delete a task (its adapter stays)."""
    name = name if name.startswith("tasks/") else f"tasks/{name}"
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        client.delete_task(name)
    console.print(f"deleted {name}", markup=False)


def _mode_name(mode: int) -> str:
    """An InferenceMode as a user reads it (merged, unmerged, mixture, ...), not its number."""
    return types_pb2.InferenceMode.Name(mode).removeprefix("INFERENCE_MODE_").lower()


@app.command()
def status(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Workers, their mode and the adapters they hold."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        s = client.cluster_status()
    table = Table(title=f"workers (queued: {s.queued_requests})")
    for col in ("worker", "healthy", "mode", "merged", "resident", "running", "decode step ms", "prefill step ms"):
        table.add_column(col)
    for w in s.workers:
        table.add_row(w.address, str(w.healthy), _mode_name(w.mode), w.merged_adapter or "-",
                      ", ".join(w.resident_adapters) or "-", f"{w.running_requests}/{w.max_batch_size}",
                      f"{w.decode_step_ms_p50:.1f}" if w.decode_step_ms_p50 else "-",
                      f"{w.prefill_step_ms_p50:.1f}" if w.prefill_step_ms_p50 else "-")
    console.print(table)


def _parse_sources(items: list[str]) -> list[tuple[str, float]]:
    out = []
    for item in items:
        task, _, threshold = item.partition(":")
        try:
            out.append((task.strip(), float(threshold) if threshold else 0.0))
        except ValueError:
            raise typer.BadParameter(f"--source expects task[:threshold], got {item!r}") from None
    return out


def _job_state(job) -> str:
    from valora.v1 import resources_pb2

    return resources_pb2.GenerationJobState.Name(job.state).removeprefix("GENERATION_JOB_STATE_")


@app.command()
def generate(source: list[str] = typer.Option([], "--source", "-s", help="task[:accuracy threshold], in fusion "
                                              "order (repeatable); `python -m services.generator tasks` lists tasks."),
             dataset: Path = typer.Option(None, "--dataset", help="Your dataset (an image folder, a JSONL file, or "
                                          "an archive of one): validated here, uploaded through the store, its "
                                          "tasks added to the sources."),
             threshold: float = typer.Option(0.0, min=0.0, max=1.0, help="Accuracy threshold of the --dataset "
                                             "tasks that no --source names."),
             base_model: Path = typer.Option(None, help="Base model path on the runner's machine (default: the "
                                             "local cluster's tiny model)."),
             rank: int = typer.Option(8, min=1, max=256), epochs: int = typer.Option(4, min=1),
             limit: int = typer.Option(0, min=0, help="Cap on each split's size (0: full splits)."),
             prefix: str = typer.Option("", help="Adapter/task id prefix (default: the job id)."),
             job_id: str = typer.Option("", help="Job id (default: the store picks one)."),
             wait: bool = typer.Option(False, "--wait", help="Poll the job with a progress bar until it ends."),
             poll_s: float = typer.Option(1.0, help="Seconds between polls with --wait."),
             home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Queue accuracy-aware adapter generation (a GenerationJob run by `python -m services.generator serve`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    model = str(Path(base_model or cluster_mod.default_model_path(home)).expanduser().resolve())
    if not source and dataset is None:
        raise typer.BadParameter("give --source (built-in tasks) and/or --dataset")
    sources = _parse_sources(source)
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        if dataset is not None:
            from services.generator.user_datasets import DatasetError, upload_for_job

            try:
                sources = upload_for_job(client, dataset, sources, threshold)
            except DatasetError as exc:
                _refuse(str(exc))
        job = client.create_generation_job(model, sources, rank=rank, epochs=epochs,
                                           adapter_prefix=prefix, split_limit=limit, job_id=job_id)
        console.print(f"{job.name}: {_job_state(job)}")
        if not wait:
            return
        with Progress(TextColumn("[bold]{task.fields[state]}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), TextColumn("{task.description}"), console=console) as progress:
            bar = progress.add_task(job.message, total=1.0, state=_job_state(job))
            while _job_state(job) in ("PENDING", "RUNNING"):
                time.sleep(poll_s)
                job = client.get_generation_job(job.name)
                progress.update(bar, completed=job.progress, description=job.message, state=_job_state(job))
    state = _job_state(job)
    if state != "SUCCEEDED":
        console.print(f"[red]{job.name} {state}[/red] {job.error or job.message}")
        raise typer.Exit(1)
    console.print(_job_result_table(job))


def _job_result_table(job) -> Table:
    """A SUCCEEDED job's tasks: adapter version, threshold and measured test accuracy."""
    table = Table("task", "adapter version", "threshold", "accuracy (test)", title=f"{job.name} {_job_state(job)}")
    for t in job.result.tasks:
        ok = t.measured_accuracy >= t.accuracy_threshold
        table.add_row(t.task, t.adapter_version, f"{t.accuracy_threshold:.3f}",
                      f"{'' if ok else '[red]'}{t.measured_accuracy:.3f}{'' if ok else '[/red]'}")
    return table


@jobs_app.command("list")
def jobs_list(home: Path = HOME, address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """List generation jobs, newest first."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        jobs = client.list_generation_jobs()
    table = Table(title="generation jobs")
    for col in ("job", "state", "progress", "sources", "created", "message"):
        table.add_column(col, justify="right" if col == "progress" else "left")
    for j in jobs:
        table.add_row(j.name, _job_state(j), f"{j.progress:.0%}",
                      ", ".join(f"{s.task}:{s.accuracy_threshold:g}" for s in j.sources), _when(j.create_time),
                      Text(j.error or j.message))
    console.print(table)


@jobs_app.command("get")
def jobs_get(name: str = typer.Argument(..., help="generationJobs/{j} or {j}"), home: Path = HOME,
             address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Show one generation job: state, progress, sources and, once it SUCCEEDED, its result."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        j = client.get_generation_job(name)
    console.print(f"{j.name}: {_job_state(j)} progress={j.progress:.0%} rank={j.rank or 8} epochs={j.epochs or 4} "
                  f"created={_when(j.create_time)} updated={_when(j.update_time)}", markup=False)
    console.print("sources: " + ", ".join(f"{s.task}:{s.accuracy_threshold:g}" + (f" ({s.dataset})" if s.dataset
                                          else "") for s in j.sources), markup=False)
    if j.error or j.message:
        console.print(j.error or j.message, markup=False, highlight=False)
    if _job_state(j) == "SUCCEEDED":
        console.print(_job_result_table(j))


@jobs_app.command("cancel")
def jobs_cancel(name: str = typer.Argument(..., help="generationJobs/{j} or {j}"), home: Path = HOME,
                address: str = ADDRESS, admin_key: str = ADMIN_KEY):
    """Cancel a PENDING or RUNNING job (a finished one: FAILED_PRECONDITION)."""
    with ValoraClient(_address(home, address), admin_key=admin_key) as client:
        j = client.cancel_generation_job(name)
    console.print(f"{j.name}: {_job_state(j)}", markup=False)


def _demo_images(n: int, seed: int) -> list[bytes]:
    """Small synthetic RGB images (PNG) so the demo needs no dataset."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _quick_demo(requests: int, concurrency: int, max_new_tokens: int, home: Path, address: str | None,
                api_key: str | None, admin_key: str | None, report: Path | None) -> None:
    """The quick demo: three random adapters on the tiny random base, synthetic images, latency only."""
    from services.common.adapter_format import BaseModelShapes, make_random_bundle

    started = None
    if address is None and cluster_mod.Cluster.load(home) is None:
        with console.status("starting a local cluster…"):
            started = cluster_mod.start_cluster(home, gateway_port=0)
    try:
        gateway = _address(home, address)
        model_path = Path(os.environ.get("VALORA_MODEL_PATH", cluster_mod.default_model_path(home)))
        shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
        with ValoraClient(gateway, api_key=api_key, admin_key=admin_key) as client:
            targets: dict[str, dict] = {"base": {}}
            for i, rank in enumerate((8, 16, 4)):
                bundle, cfg = make_random_bundle(shapes, rank=rank, seed=100 + i, lora_alpha=2 * rank)
                v = client.upload_adapter_version(f"demo-{i}", bundle, cfg, request_id=f"demo-{i}-r{rank}")
                client.set_alias(f"adapters/demo-{i}", "prod", v.name)
                targets[f"adapters/demo-{i}@prod"] = {"adapter": f"adapters/demo-{i}@prod"}
                console.print(f"registered {v.name} (rank {rank}, sha256 {v.sha256[:12]})")
            images = _demo_images(4, seed=0)
            names = list(targets)
            # (target, picture) pairs repeat, so determinism under batching can be checked.
            work = [(names[i % len(names)], i % len(images)) for i in range(requests)]

            def run(item):
                target, picture = item
                t0 = time.perf_counter()
                r = client.infer(f"Describe picture {picture}.", [images[picture]],
                                 max_new_tokens=max_new_tokens, **targets[target])
                return item, (time.perf_counter() - t0) * 1000, r

            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(run, work))
            wall_s = time.perf_counter() - t0
        # Same (target, image, prompt) must give the same text under greedy decoding, however batched.
        seen: dict[tuple, str] = {}
        consistent = all(seen.setdefault(item, r.text) == r.text for item, _, r in results)
        table = Table(title=f"valora demo --quick: {requests} requests, concurrency {concurrency}, via {gateway}")
        for col in ("target", "n", "mode", "mean ms", "p50 ms", "p99 ms", "ttft ms", "queue ms", "tokens"):
            table.add_column(col, justify="right" if col not in ("target", "mode") else "left")
        rows = []
        for target in names:
            row = _latency_row(target, [(ms, r) for (t, _), ms, r in results if t == target])
            rows.append(row)
            table.add_row(target, str(row["n"]), ",".join(row["modes"]), f"{row['mean_ms']:.0f}",
                          f"{row['p50_ms']:.0f}", f"{row['p99_ms']:.0f}", f"{row['ttft_ms']:.0f}",
                          f"{row['queue_ms']:.0f}", str(row["output_tokens"]))
        console.print(table)
        all_lat = [ms for _, ms, _ in results]
        summary = {"demo": "quick", "requests": requests, "concurrency": concurrency, "wall_s": wall_s,
                   "throughput_rps": requests / wall_s, "p50_ms": _percentile(all_lat, 50),
                   "p99_ms": _percentile(all_lat, 99), "workers": sorted({r.worker for _, _, r in results}),
                   "deterministic": consistent, "rows": rows,
                   "sample": {t: next(r.text for (tt, _), _, r in results if tt == t) for t in names}}
        console.print(f"throughput {summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']:.0f} ms, "
                      f"p99 {summary['p99_ms']:.0f} ms, workers {summary['workers']}")
        for t, text in summary["sample"].items():
            console.print(f"[dim]{t}: {text!r}")
        out = report or Path(home) / "demo-report.json"
        out.write_text(json.dumps(summary, indent=2))
        console.print(f"report: {out}")
    finally:
        if started is not None:
            cluster_mod.stop_cluster(home)


def _latency_row(target: str, mine: list[tuple[float, object]]) -> dict:
    lat = [ms for ms, _ in mine]
    return {"target": target, "n": len(mine), "modes": sorted({r.mode for _, r in mine}),
            "mean_ms": round(statistics.mean(lat), 1), "p50_ms": round(_percentile(lat, 50), 1),
            "p99_ms": round(_percentile(lat, 99), 1),
            "ttft_ms": round(statistics.mean(r.first_token_ms for _, r in mine), 1),
            "queue_ms": round(statistics.mean(r.queue_ms for _, r in mine), 1),
            "output_tokens": sum(r.output_tokens for _, r in mine)}


DEMO_TASK_PREFIX = "demo-"  # the demo's tasks are tasks/demo-{task}
DEMO_ALIAS = "demo"


def _register_demo(client: ValoraClient, gen_dir: Path, log=console.print) -> dict[str, dict]:
    """Registers the generated bundles and one task per head; safe to repeat.

    Uploads carry a request id derived from the bundle's sha256, so a repeat returns the version
    registered before (no new version); the alias `demo` points at it. A task that exists already
    is kept when it names the same version and head, and replaced otherwise (tasks/demo-* belong
    to the demo). Returns {task: {"task", "adapter", "version", "threshold", "accuracy"}}."""
    import grpc

    from services.generator.pipeline import load_generated

    _, bundles, result = load_generated(gen_dir)
    prompts = json.loads((gen_dir / "manifest.json").read_text())["prompts"]
    out: dict[str, dict] = {}
    for b in bundles:
        sha = hashlib.sha256(b.data).hexdigest()
        v = client.upload_adapter_version(b.name, b.data, b.config_json, heads=b.heads,
                                          request_id=f"valora-demo-{b.name}-{sha[:32]}")
        client.set_alias(f"adapters/{b.name}", DEMO_ALIAS, v.name)
        log(f"adapter {v.name} (sha256 {v.sha256[:12]}, rank {v.rank}, heads {', '.join(b.heads)}) "
            f"alias @{DEMO_ALIAS}")
        for head in b.heads:
            task_id = f"{DEMO_TASK_PREFIX}{head}"
            row = result.tasks[head]
            kwargs = dict(adapter=v.name, head=head, accuracy_threshold=row["threshold"],
                          measured_accuracy=row["accuracy"],
                          description=f"prompt: {prompts[head]} (valora demo; greedy-fused adapter)")
            try:
                client.create_task(task_id, **kwargs)
                what = "created"
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                name = f"tasks/{task_id}"
                have = client.get_task(name)
                if have.adapter == v.name and have.head == head:
                    what = "exists"
                else:
                    client.delete_task(name)
                    client.create_task(task_id, **kwargs)
                    what = f"replaced (was {have.adapter} head {have.head})"
            log(f"  task tasks/{task_id} -> {v.name} head {head}: {what}")
            out[head] = {"task": f"tasks/{task_id}", "adapter": f"adapters/{b.name}", "version": v.name,
                         "threshold": row["threshold"], "accuracy": row["accuracy"]}
    return out


_DEMO_HELP = (
    "Serve greedy-fused adapters generated on real data; report served accuracy and latency.\n\n"
    "Pretrains the tiny base briefly and generates adapters for a few vision tasks with the accuracy-aware greedy "
    "fusion (both cached under --home, keyed by the settings), starts a local cluster on that base when none is "
    "running (and stops it afterwards), registers the adapters and one task per head (idempotent), then sends "
    "the generator's whole test split as task-head label requests mixed concurrently with text-generation "
    "requests through the adapters and the base, and checks every served label against the generator's "
    "prediction for the same image.")


@app.command(help=_DEMO_HELP)
def demo(quick: bool = typer.Option(False, "--quick", help="The old quick demo instead: random adapters on the "
                                    "tiny random base, synthetic images, latency only (no training)."),
         tasks: str = typer.Option("digit,parity,digit-rot90,count",
                                   help="Tasks to generate adapters for, in fusion order "
                                   "(`python -m services.generator tasks`)."),
         per_task: int = typer.Option(0, min=0, help="Test images per task sent as label requests (0: the "
                                      "generator's whole test split; fewer: its first ones, a wider interval)."),
         text_requests: int = typer.Option(32, min=0, help="Text-generation requests (\"Which digit is this?\" on "
                                           "held-out digit images) spread over the base and the adapters."),
         concurrency: int = typer.Option(8, min=1),
         max_new_tokens: int = typer.Option(None, help="Tokens per text request (default 8; --quick: 12)."),
         epochs: int = typer.Option(2, min=1, help="Training epochs per fusion step."),
         limit: int = typer.Option(400, min=0, help="Cap on each split's size for generation (0: full splits)."),
         pretrain_steps: int = typer.Option(300, min=1, help="Pretraining steps of the demo base."),
         margin: float = typer.Option(0.03, help="Thresholds = single-task val accuracy minus this."),
         rank: int = typer.Option(8, min=1), seed: int = typer.Option(0),
         threads: int = typer.Option(2, min=1, help="torch CPU threads for pretraining/generation (the trained "
                                     "weights depend on it: torch splits CPU reductions by thread)."),
         requests: int = typer.Option(48, help="--quick: requests in the workload."),
         home: Path = HOME, address: str = ADDRESS, api_key: str = API_KEY, admin_key: str = ADMIN_KEY,
         report: Path = typer.Option(None, help="Write the report JSON here (default: <home>/demo-report.json).")):
    """Serve greedy-fused adapters generated on real data; report served accuracy and latency."""
    if not console.is_terminal:  # logs and pipes: wide enough for the tables
        console.width = max(console.width, 120)
    if quick:
        return _quick_demo(requests, concurrency, max_new_tokens or 12, home, address, api_key, admin_key, report)
    max_new_tokens = max_new_tokens or 8
    import random

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    home = Path(home).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    names = [t.strip() for t in tasks.split(",") if t.strip()]

    t0 = time.perf_counter()
    tiny = cluster_mod.default_model_path(home)
    with console.status("building the tiny Qwen2-VL (first run only)…"):
        cluster_mod.ensure_model(tiny)
    import torch

    from services.generator import demo as gdemo
    from services.generator.pipeline import agreement, held_out_images

    torch.set_num_threads(threads)
    with console.status("pretraining the demo base…") as st:
        base, provenance, base_cached = gdemo.ensure_base(
            tiny, home, steps=pretrain_steps, seed=seed, log=console.print, threads=threads,
            progress=lambda s, n, loss: st.update(f"pretraining the demo base: step {s}/{n}, loss {loss:.3f}"))
    timings["pretrain_s"] = round(time.perf_counter() - t0, 1)
    console.print(f"base: {base} ({'cached' if base_cached else 'pretrained'}; text answer to \"Which digit is "
                  f"this?\" on the digit val split: {provenance['val_accuracy']:.3f})")

    settings = gdemo.DemoSettings(tasks=tuple(names), pretrain_steps=pretrain_steps, epochs=epochs,
                                  limit=limit or None, rank=rank, margin=margin, seed=seed, threads=threads)
    t0 = time.perf_counter()
    with console.status("generating adapters…") as st:
        gen_dir, manifest, gen_cached = gdemo.ensure_adapters(
            home, base, settings, log=console.print,
            progress=lambda what, d, n: st.update(f"generating adapters: training [{what}] {d}/{n}"))
    timings["generate_s"] = round(time.perf_counter() - t0, 1)
    greedy = manifest["greedy"]["tasks"]
    console.print(f"adapters: {gen_dir} ({'cached; ' if gen_cached else ''}generated in "
                  f"{manifest['demo']['generate_s']:.0f} s; key {manifest['demo']['key']}): "
                  + "; ".join(f"{a['name']} = {'+'.join(a['tasks'])}" for a in manifest["adapters"]))

    started = None
    t0 = time.perf_counter()
    if address is None and cluster_mod.Cluster.load(home) is None:
        with console.status(f"starting a local cluster on {base.name}…"):
            started = cluster_mod.start_cluster(home, gateway_port=0, model_path=base)
    else:
        console.print(f"[yellow]using the running cluster at {_address(home, address)}: its workers must serve "
                      f"{base} for the accuracies to hold")
    timings["cluster_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        gateway = _address(home, address)
        with ValoraClient(gateway, api_key=api_key, admin_key=admin_key) as client:
            t0 = time.perf_counter()
            registered = _register_demo(client, gen_dir)
            timings["register_s"] = round(time.perf_counter() - t0, 1)

            # The mixed workload: label requests (task heads) and text requests, shuffled together.
            work: list[dict] = []
            for t in names:
                pngs, truth = held_out_images(t, settings.limit)
                work += [{"kind": "label", "target": registered[t]["task"], "task": t, "prompt": manifest["prompts"][t],
                          "image": png, "truth": y, "index": i}
                         for i, (png, y) in enumerate(zip(pngs[:per_task or None], truth))]
            text_targets = ["base"] + [f"adapters/{a['name']}@{DEMO_ALIAS}" for a in manifest["adapters"]]
            if text_requests:
                pngs, truth = held_out_images("digit", text_requests)
                work += [{"kind": "text", "target": text_targets[i % len(text_targets)], "task": "digit",
                          "prompt": "Which digit is this?", "image": pngs[i], "truth": truth[i]}
                         for i in range(len(pngs))]
            random.Random(seed).shuffle(work)

            def run(item: dict):
                t1 = time.perf_counter()
                if item["kind"] == "label":
                    r = client.infer(item["prompt"], [item["image"]], task=item["target"], label=True)
                    answer = r.label
                else:
                    adapter = None if item["target"] == "base" else item["target"]
                    r = client.infer(item["prompt"], [item["image"]], adapter=adapter, max_new_tokens=max_new_tokens)
                    answer = r.text.strip()
                return item, (time.perf_counter() - t1) * 1000, r, answer

            t0 = time.perf_counter()
            with console.status(f"mixed workload: {len(work)} requests, concurrency {concurrency}…"):
                with ThreadPoolExecutor(concurrency) as pool:
                    results = list(pool.map(run, work))
            wall_s = time.perf_counter() - t0
            timings["workload_s"] = round(wall_s, 1)
    finally:
        if started is not None:
            cluster_mod.stop_cluster(home)

    # Per task: served accuracy on the generator's test images vs the threshold the fusion had to
    # keep, and every served label vs the generator's prediction for the same image.
    acc_table = Table(title=f"served accuracy: {'the whole test split' if not per_task else f'{per_task} test images'}"
                            f" per task, label requests through the gateway ({len(manifest['adapters'])} greedy-fused "
                            f"adapter{'s' if len(manifest['adapters']) != 1 else ''})")
    for col in ("task", "adapter", "n", "served", "95% interval", "generator", "agree", "thresh.", "ok", "mean ms",
                "p99 ms"):
        acc_table.add_column(col, justify="left" if col in ("task", "adapter", "ok") else "right")
    task_rows = []
    for t in names:
        mine = sorted(((it["index"], ms, r, ans, it["truth"]) for it, ms, r, ans in results
                       if it["kind"] == "label" and it["task"] == t), key=lambda row: row[0])
        reg = registered[t]
        check = agreement([ans for _, _, _, ans, _ in mine], [y for *_, y in mine],
                          manifest["test_predictions"][t][:len(mine)])
        row = {"task": t, "target": reg["task"], "prompt": manifest["prompts"][t], "adapter": reg["version"],
               "n": check["n"], "served_accuracy": check["served_accuracy"], "interval_95": check["interval_95"],
               "generator_accuracy_same_images": check["offline_accuracy"], "agree": check["agree"],
               "generator_test_accuracy": reg["accuracy"], "test_split": len(manifest["test_predictions"][t]),
               "threshold": reg["threshold"], "meets_threshold": check["served_accuracy"] >= reg["threshold"],
               "single_task_val_accuracy": manifest["demo"]["single_task_accuracy"][t]["val"],
               **{k: v for k, v in _latency_row(reg["task"], [(ms, r) for _, ms, r, _, _ in mine]).items()
                  if k.endswith("_ms")}}
        task_rows.append(row)
        ok, same = row["meets_threshold"], row["agree"] == row["n"]
        acc_table.add_row(t, reg["version"].replace("adapters/", "").replace("/versions/", " v"), str(row["n"]),
                          f"{'[green]' if ok else '[red]'}{row['served_accuracy']:.3f}",
                          "{:.3f}-{:.3f}".format(*row["interval_95"]), f"{row['generator_accuracy_same_images']:.3f}",
                          f"{'' if same else '[red]'}{row['agree']}/{row['n']}", f"{reg['threshold']:.3f}",
                          "yes" if ok else "[red]no", f"{row['mean_ms']:.0f}", f"{row['p99_ms']:.0f}")
    console.print(acc_table)
    console.print("[dim]questions: " + "; ".join(f"{t}: {manifest['prompts'][t]!r}" for t in names)
                  + ". served = served label == truth (95% interval: Wilson's, for other images of the same kind); "
                  "generator = its accuracy on the same images; agree = served labels equal to the generator's "
                  "prediction; thresh. = single-task val accuracy - margin")

    # Per target: latency of every request kind in the mixed batch.
    targets = [registered[t]["task"] for t in names] + (text_targets if text_requests else [])
    lat_table = Table(title=f"mixed workload: {len(results)} requests ({len(results) - text_requests} label, "
                            f"{text_requests} text) in one stream, concurrency {concurrency}")
    for col in ("target", "kind", "n", "mode", "mean", "p50", "p99", "ttft", "queue", "tok", "correct"):
        lat_table.add_column(col, justify="left" if col in ("target", "kind", "mode") else "right")
    target_rows = []
    for target in targets:
        mine = [(it, ms, r, ans) for it, ms, r, ans in results if it["target"] == target]
        row = {**_latency_row(target, [(ms, r) for _, ms, r, _ in mine]), "kind": mine[0][0]["kind"],
               "correct": round(sum(ans == it["truth"] for it, _, _, ans in mine) / len(mine), 4)}
        if row["kind"] == "text":
            row["sample"] = [{"truth": it["truth"], "text": r.text} for it, _, r, _ in mine[:3]]
        target_rows.append(row)
        lat_table.add_row(target.replace("adapters/", "").replace("tasks/", "task "), row["kind"], str(row["n"]),
                          ",".join(row["modes"]), f"{row['mean_ms']:.0f}", f"{row['p50_ms']:.0f}",
                          f"{row['p99_ms']:.0f}", f"{row['ttft_ms']:.0f}", f"{row['queue_ms']:.0f}",
                          str(row["output_tokens"]), f"{row['correct']:.2f}")
    console.print(lat_table)
    console.print("[dim]latencies in ms; correct: label == truth for task heads; for text (\"Which digit is this?\"), "
                  "the generated answer == the digit (the base was pretrained to answer in text; the adapters were "
                  "trained for their heads, not for text)")
    all_lat = [ms for _, ms, _, _ in results]
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    summary = {
        "demo": "generated", "gateway": gateway, "base_model": str(base), "base_pretraining": provenance,
        "base_cached": base_cached, "generated_dir": str(gen_dir), "generated_cached": gen_cached,
        "settings": manifest["demo"]["settings"], "cache_key": manifest["demo"]["key"],
        "generation": {"adapters": [{"name": a["name"], "tasks": a["tasks"]} for a in manifest["adapters"]],
                       "steps": manifest["greedy"].get("steps", []), "thresholds": manifest["thresholds"],
                       "single_task_accuracy": manifest["demo"]["single_task_accuracy"],
                       "test_accuracy": {t: greedy[t]["accuracy"] for t in names},
                       "split_sizes": manifest["demo"]["split_sizes"], "generate_s": manifest["demo"]["generate_s"]},
        "registered": registered, "requests": len(results), "label_requests": len(results) - text_requests,
        "text_requests": text_requests, "concurrency": concurrency, "max_new_tokens": max_new_tokens,
        "wall_s": round(wall_s, 2), "throughput_rps": round(len(results) / wall_s, 2),
        "p50_ms": round(_percentile(all_lat, 50), 1), "p99_ms": round(_percentile(all_lat, 99), 1),
        "workers": sorted({r.worker for _, _, r, _ in results}),
        "all_tasks_meet_threshold": all(r["meets_threshold"] for r in task_rows),
        "served_equals_generator": all(r["agree"] == r["n"] for r in task_rows),
        "tasks": task_rows, "rows": target_rows, "timings": timings,
    }
    console.print(f"throughput {summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']:.0f} ms, p99 "
                  f"{summary['p99_ms']:.0f} ms; every task meets its threshold: {summary['all_tasks_meet_threshold']}; "
                  f"served = generator on every image: {summary['served_equals_generator']}; "
                  f"times: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in timings.items()))
    out = report or home / "demo-report.json"
    out.write_text(json.dumps(summary, indent=2))
    console.print(f"report: {out}")


# -- bench: benchmarks that need no cluster ---------------------------------------------------------
bench_app = typer.Typer(help="Benchmarks (the scheduling simulator; GPU harnesses live in bench/).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@bench_app.command("sched")
def bench_sched(policies: str = typer.Option("valora,dlora,slora,punica", help="Comma-separated policies."),
                alphas: str = typer.Option("0.5,1,1.5", help="Zipf skews of adapter popularity."),
                rates: str = typer.Option("40,80", help="Arrival rates, requests/s (2 workers: ~75 req/s saturate)."),
                seconds: float = typer.Option(15.0, help="Trace length in seconds of arrivals (bounds the run)."),
                workers: int = typer.Option(2), max_batch: int = typer.Option(16),
                adapters: int = typer.Option(64, help="Adapters in the popularity distribution (32-128)."),
                burst_cvs: str = typer.Option("1,3", help="Inter-arrival CVs: 1 Poisson, >1 gamma bursts."),
                task_head_fraction: float = typer.Option(0.3, help="Share of one-forward task-head requests."),
                thetas: str = typer.Option("1.0", help="Starvation thresholds θ (s) for valora/dlora."),
                profile: str = typer.Option("h200-7b", help="Cost profile (h200-7b, cpu-tiny)."),
                results_dir: Path = typer.Option(Path("bench/results"), help="Measured kernel/switch JSON."),
                azure_csv: Path = typer.Option(None, exists=True, dir_okay=False,
                                               help="Replay an Azure LLM trace CSV (TIMESTAMP, ContextTokens, "
                                               "GeneratedTokens) instead of synthetic arrivals; its own arrival "
                                               "times are kept and rate x seconds caps the rows replayed."),
                workload: str = typer.Option("synthetic", help="synthetic (one mixed stream), or two-app: issue 23's "
                                             "video streams (task heads, one chunk a second each, class video) "
                                             "and visual retrieval (rates, alphas; class retrieval) at once."),
                video_streams: int = typer.Option(16, help="two-app: camera streams."),
                video_tasks: int = typer.Option(4, help="two-app: task-head adapters the streams use."),
                video_slo_ms: float = typer.Option(1000.0, help="two-app: the video class's objective."),
                retrieval_slo_ms: float = typer.Option(0.0, help="two-app: the retrieval class's objective (0: none)."),
                deadlines: str = typer.Option("on", help="valora/dlora with latency objectives: on (earliest deadline "
                                              "first), off (ignored), or both (one row each)."),
                seed: int = typer.Option(0),
                out: Path = typer.Option(None, help="Default bench/results/sched-<date>.json."),
                write: bool = typer.Option(True, help="Write the results JSON.")):
    """Scheduling policies in the discrete-event simulator (real policy code, cost model from
    measured H200 numbers): mean/p50/p99 latency, token latency, throughput, switches/s, and per
    SLO class latency and attainment."""
    import datetime as dt
    import itertools
    import platform
    import subprocess

    from services.scheduler.cost_model import load_profile
    from services.scheduler.policies import make_policy
    from services.scheduler.sim import run_matrix
    from services.scheduler.traces import load_azure_csv, synthetic_trace, two_app_trace

    cost = load_profile(profile, results_dir if results_dir.is_dir() else None)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if workload not in ("synthetic", "two-app"):
        raise typer.BadParameter(f"--workload is synthetic or two-app, not {workload!r}")
    modes = {"on": [True], "off": [False], "both": [True, False]}.get(deadlines)
    if modes is None:
        raise typer.BadParameter(f"--deadlines is on, off or both, not {deadlines!r}")
    credit_policies = ("valora", "dlora")

    def trace_for(alpha: float, rate: float, burst_cv: float) -> list:
        if workload == "two-app":
            return two_app_trace(seconds=seconds, streams=video_streams, retrieval_rate=rate, video_tasks=video_tasks,
                                 video_slo_ms=video_slo_ms, retrieval_slo_ms=retrieval_slo_ms,
                                 retrieval_adapters=adapters, alpha=alpha, seed=seed)
        if azure_csv is not None:
            return load_azure_csv(azure_csv, alpha=alpha, adapters=adapters, task_head_fraction=task_head_fraction,
                                  max_requests=int(rate * seconds), seed=seed)
        return synthetic_trace(n=max(1, int(rate * seconds)), rate=rate, alpha=alpha, adapters=adapters,
                               burst_cv=burst_cv, task_head_fraction=task_head_fraction, seed=seed)

    rows: list[dict] = []
    t0 = time.perf_counter()
    cvs = [1.0] if azure_csv is not None or workload == "two-app" else _floats(burst_cvs)
    trace_name = workload if workload == "two-app" else "azure-csv" if azure_csv is not None else "synthetic"
    for cv in cvs:
        for theta, on in itertools.product(_floats(thetas), modes):
            first = theta == _floats(thetas)[0] and on == modes[0]
            run_names = names if first else [n for n in names if n in credit_policies]
            got = run_matrix(run_names, _floats(alphas), _floats(rates),
                             make=lambda n, th=theta, on=on: make_policy(n, cost, theta_s=th, deadlines=on), cost=cost,
                             trace_for=lambda a, r, cv=cv: trace_for(a, r, cv), workers=workers, max_batch=max_batch)
            for r in got:
                r["theta_s"] = theta if r["policy"] in credit_policies else None
                r["deadlines"] = on if r["policy"] in credit_policies else None
                r["burst_cv"] = cv
                r["trace"] = trace_name
            rows.extend(got)
    wall = time.perf_counter() - t0
    for cv, alpha, rate in itertools.product(cvs, _floats(alphas), _floats(rates)):
        table = Table(title=f"sched sim: alpha {alpha}, {rate:g} req/s, arrival CV {cv:g}, {workers} workers x "
                            f"batch {max_batch}, {adapters} adapters, profile {cost.name}"
                            + (f", {video_streams} video streams" if workload == "two-app" else ""))
        selected = [r for r in rows if r["alpha"] == alpha and r["rate"] == rate and r["burst_cv"] == cv]
        classes = sorted({c for r in selected for c in r.get("classes", {})})
        cols = ["policy", "θ s", "deadlines", "mean ms", "p50 ms", "p99 ms", "token ms", "ttft ms", "req/s",
                "switch/s", "max queue ms"]
        for c in classes:
            cols += [f"{c} mean/p99 ms", f"{c} SLO"]
        for col in cols:
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in selected:
            cells = [r["policy"], "-" if r["theta_s"] is None else f"{r['theta_s']:g}",
                     "-" if r["deadlines"] is None else ("on" if r["deadlines"] else "off"),
                     f"{r['mean_ms']:.0f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}",
                     f"{r['token_ms']:.1f}", f"{r['ttft_ms']:.0f}", f"{r['throughput_rps']:.1f}",
                     f"{r['switches_per_s']:.1f}", f"{r['max_queue_ms']:.0f}"]
            for c in classes:
                k = r.get("classes", {}).get(c, {})
                cells += [f"{k.get('mean_ms', float('nan')):.0f}/{k.get('p99_ms', float('nan')):.0f}",
                          f"{100 * k['attainment']:.1f}%" if "attainment" in k else "-"]
            table.add_row(*cells)
        console.print(table)
    console.print(f"[dim]{len(rows)} simulations in {wall:.1f} s")
    if not write:
        return
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    now = dt.datetime.now(dt.timezone.utc)
    info = {"date": now.isoformat(timespec="seconds"), "git_commit": commit, "python": platform.python_version(),
            "source": "sim", "cost_profile": cost.name, "workers": workers, "max_batch": max_batch,
            "adapters": adapters, "seconds": seconds, "burst_cvs": cvs, "task_head_fraction": task_head_fraction,
            "trace": str(azure_csv) if azure_csv else workload, "seed": seed, "wall_s": round(wall, 2),
            "deadlines": deadlines,
            "cost_model": {"decode_base_ms": cost.decode_base_ms, "decode_row_ms": cost.decode_row_ms,
                           "prefill_ms_per_token": cost.prefill_ms_per_token, "switch_ms": cost.switch_ms,
                           "merge_ms": cost.merge_ms, "load_ms": cost.load_ms, "mixture_factor": cost.mixture_factor,
                           "atmm_us_16x8": cost.atmm_op_us(16, 8)}}
    if workload == "two-app":
        info["two_app"] = {"video_streams": video_streams, "video_tasks": video_tasks, "video_slo_ms": video_slo_ms,
                           "retrieval_slo_ms": retrieval_slo_ms, "retrieval_rates": _floats(rates)}
    path = out or Path("bench/results") / f"sched-{now.date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=float))
    console.print(f"results: {path}")


@bench_app.command("scale", add_help_option=False,
                   context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_scale(ctx: typer.Context):
    """Throughput scaling over 1, 2, 4… workers (bench/scale_bench.py; --help lists its options).

    A real cluster per worker count, generation requests with images through the gateway."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "scale_bench.py"
    if not path.exists():
        console.print(f"[red]{path} not found: `valora bench scale` runs from a source checkout")
        raise typer.Exit(2)
    spec = importlib.util.spec_from_file_location("scale_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    raise typer.Exit(module.main(list(ctx.args), prog="valora bench scale"))


RPC_EXIT_BASE = 10  # a failed call exits 10 + its gRPC status code (INVALID_ARGUMENT 13, NOT_FOUND 15, UNAVAILABLE 24)


def main(argv: list[str] | None = None) -> int:
    """The `valora` command: the CLI, with a failed RPC printed as `CODE: message (reason)` and
    field violations, exiting RPC_EXIT_BASE + its status code, instead of a traceback."""
    import grpc

    from valora import errors

    try:
        app(args=argv)  # standalone: ends in SystemExit (0, or a usage error's 2) unless an RPC failed
    except grpc.RpcError as raw:
        err = errors.from_rpc_error(raw)
        console.print(f"[red]{err.code().name}[/red]: {err.message}" + (f" ({err.reason})" if err.reason else ""),
                      markup=True, highlight=False)
        for field_path, why in err.field_violations:
            console.print(f"  {field_path}: {why}", markup=False, highlight=False)
        return RPC_EXIT_BASE + err.code().value[0]
    return 0


def run() -> None:
    """Entry point of the `valora` script."""
    sys.exit(main())


if __name__ == "__main__":
    run()
