"""`python -m services.generator`: accuracy-aware adapter generation from the command line.

    python -m services.generator tasks
    python -m services.generator pretrain --model-path ~/.cache/valora/tiny-qwen2-vl --out ~/.cache/valora/demo-qwen2-vl
    python -m services.generator generate --model-path ~/.cache/valora/tiny-qwen2-vl --out out/gen \\
        [--gateway localhost:50051] [--order digit,parity,...] [--rank 8] [--epochs 4] [--compare]
    python -m services.generator generate --model-path ... --out out/pets --dataset ~/pets [--threshold pets=0.8]
    python -m services.generator register --out out/gen --gateway localhost:50051 [--check 60]
    python -m services.generator check --out out/gen --gateway localhost:50051 [--n 60]   # default: whole test split
    python -m services.generator serve   # runs GenerationJobs (settings: VALORA_ADAPTER_STORE_ADDRESS, ...;
                                         # VALORA_PORT > 0 serves gRPC health there, VALORA_METRICS_PORT /metrics)

`generate` measures one adapter per task (for thresholds = single-task val accuracy - margin,
unless --threshold task=acc is given for every task), runs the greedy fusion (in the given order,
or with --fusion-order probed in one chosen from interference probes; with --compare, the given
order's fusion is measured too), writes the bundles
and a manifest to --out, optionally registers them through the gateway (adapter versions + one
task per head, with threshold and measured accuracy), and with --compare also measures the
no-adapter and all-in-one baselines and writes bench/results/generation-<date>.json.
`--dataset` (repeatable) adds a user's tasks: an image folder or a JSONL file, validated first
(services/generator/user_datasets.py says what each may hold and what is refused); JSONL records
with "answer" text instead of a "label" make a text task (VQA-style: generated answers, scored by
normalised exact match, registered without a head).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.generator.fusion import FUSION_ORDERS, PROBE_BATCHES, PROBE_EPOCHS

app = typer.Typer(add_completion=False, help="Accuracy-aware LoRA adapter generation (VaLoRA §4.2).")
console = Console()


@app.command("tasks")
def list_tasks() -> None:
    """List the built-in vision tasks."""
    from services.generator.datasets import DEFAULT_TASKS, TASKS

    table = Table("task", "kind", "labels / answers", "prompt", "default", "description")
    for name, spec in TASKS.items():
        table.add_row(
            name,
            spec.kind,
            ",".join(spec.labels),
            spec.prompt,
            "yes" if name in DEFAULT_TASKS else "",
            spec.description,
        )
    console.print(table)


@app.command("pretrain")
def pretrain_cmd(
    model_path: Path = typer.Option(..., help="Source Qwen2-VL model directory (e.g. the tiny random one)."),
    out: Path = typer.Option(..., help="Where to write the pretrained model directory."),
    steps: int = typer.Option(300, min=1, help="Training steps (batch 32; ~30 s on one CPU core for the tiny model)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (one-cycle)."),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
) -> None:
    """Briefly pretrain a base model to answer "Which digit is this?" in text on upright digits."""
    import torch

    from services.generator.pretrain import pretrain

    torch.set_num_threads(threads)
    with Progress(
        TextColumn("[bold]pretrain"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bar = progress.add_task("pretrain", total=steps, loss="-")
        result = pretrain(
            model_path,
            out,
            steps=steps,
            lr=lr,
            seed=seed,
            progress=lambda s, n, loss: progress.update(bar, completed=s, loss=f"{loss:.3f}"),
        )
    console.print(f"{out}: text-answer accuracy on the digit val split {result['val_accuracy']:.3f}")


def _parse_thresholds(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value:
            raise typer.BadParameter(f"--threshold expects task=accuracy, got {item!r}")
        out[name.strip()] = float(value)
    return out


@app.command()
def generate(
    model_path: Path = typer.Option(..., help="Local Qwen2-VL model directory (config.json, weights, tokenizer)."),
    out: Path = typer.Option(..., help="Directory for the bundles and manifest.json."),
    gateway: Optional[str] = typer.Option(None, help="host:port of a valora gateway to register the adapters with."),
    order: str = typer.Option(
        "", help="Comma-separated tasks in fusion order (default: the datasets' tasks, else the built-in order)."
    ),
    fusion_order: str = typer.Option(
        "given",
        help="given: fuse in --order (or the datasets') order; probed: in an order chosen from "
        "interference probes (each task alone and each pair together, briefly trained; "
        "services/generator/fusion.py), recorded with the probe matrix in the manifest and results.",
    ),
    probe_epochs: int = typer.Option(PROBE_EPOCHS, min=1, help="--fusion-order probed: epochs per probe."),
    probe_batches: int = typer.Option(
        PROBE_BATCHES, min=1, help="--fusion-order probed: batches per task per probe epoch."
    ),
    dataset: list[Path] = typer.Option(
        [],
        help="A dataset of yours: an image folder (one sub-folder per label) "
        "or a JSONL file (image, question, label or answer text); "
        "repeatable.",
    ),
    rank: int = typer.Option(8, min=1, help="LoRA rank r."),
    lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha (scale = alpha / r); default 2r."),
    epochs: int = typer.Option(4, min=1, help="Epochs over the (union of the) tasks' train splits per fusion."),
    lr: float = typer.Option(5e-3, help="Learning rate of the LoRA weights."),
    head_lr: float = typer.Option(3e-3, help="Learning rate of the task heads (standardised space)."),
    margin: float = typer.Option(0.03, help="Measured thresholds = single-task val accuracy minus this."),
    threshold: list[str] = typer.Option([], help="task=accuracy; overrides the measured threshold (repeatable)."),
    prefix: str = typer.Option("fused", help="Adapter id prefix: adapters are {prefix}-0, {prefix}-1, ..."),
    compare: bool = typer.Option(
        False, help="Also measure the no-adapter and all-in-one baselines and write the results file."
    ),
    results: Optional[Path] = typer.Option(None, help="Results file (default bench/results/generation-<date>.json)."),
    append: bool = typer.Option(False, help="Append to the results file instead of replacing it."),
    limit: Optional[int] = typer.Option(None, help="Cap each split's size (quick runs)."),
    batch_size: int = typer.Option(16, min=1, help="Batch size (each batch holds one task)."),
    seed: int = typer.Option(0, help="Training seed (splits use a fixed seed of their own)."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
    device: str = typer.Option(
        "cpu", help="Where training runs: cpu, cuda or cuda:N (the LoRA weights train in float32 either way)."
    ),
    dtype: str = typer.Option(
        "float32", help="The frozen model's and activations' dtype: float32, or bfloat16 (on a GPU)."
    ),
    api_key: Optional[str] = typer.Option(None, envvar="VALORA_API_KEY", help="API key for the gateway."),
    admin_key: Optional[str] = typer.Option(None, envvar="VALORA_ADMIN_KEY", help="Admin key for the gateway."),
) -> None:
    """Generate fused adapters with vision task heads; optionally register and compare."""
    import torch

    from services.generator import pipeline
    from services.generator.model import BaseModel, training_device
    from services.generator.training import TorchTrainer, TrainConfig
    from services.generator.user_datasets import DatasetError, tasks_for

    torch.set_num_threads(threads)
    given = _parse_thresholds(threshold)
    alpha = lora_alpha if lora_alpha is not None else 2.0 * rank
    started = time.time()
    try:
        names, tasks, datasets = tasks_for([t.strip() for t in order.split(",") if t.strip()], dataset, limit=limit)
    except DatasetError as exc:
        console.print(f"[red]{exc}[/red]", markup=True, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}; see `python -m services.generator tasks`") from None
    if fusion_order not in FUSION_ORDERS:
        raise typer.BadParameter(f"--fusion-order {fusion_order!r}: expected one of {', '.join(FUSION_ORDERS)}")
    extra = sorted(set(given) - set(names))
    if extra:
        raise typer.BadParameter(f"--threshold names tasks not generated: {extra} (tasks: {names})")
    try:
        placement = training_device(device, dtype)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    base = BaseModel.load(model_path, rank=rank, lora_alpha=alpha, **placement)
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, head_lr=head_lr, seed=seed)

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("loading", total=1)

        def on_progress(what: str, done: int, total: int) -> None:
            progress.update(bar, description=f"train [{what}]", completed=done, total=total)

        def phase(text: str) -> None:
            progress.update(bar, description=text, completed=0)

        trainer = TorchTrainer(base, tasks, cfg, progress=on_progress)

        single = None
        if not all(t in given for t in names) or compare:
            single_states, single = pipeline.per_task(trainer, names)
        thresholds = dict(pipeline.measured_thresholds(single, margin)) if single else {}
        thresholds.update(given)

        def on_step(step) -> None:
            acc = ", ".join(f"{k} {v:.3f}" for k, v in step.accuracy.items())
            progress.console.print(
                f"  {step.source}: {step.decision} (adapter {prefix}-{step.adapter_index}; "
                f"val {acc})" + (f" failing {list(step.failing)}" if step.failing else "")
            )

        def on_probe(group, acc) -> None:
            progress.console.print(f"  probe {'+'.join(group)}: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))

        fused, record = pipeline.fusion_order(
            trainer, names, thresholds, fusion_order, probe_epochs, probe_batches, on_probe=on_probe
        )
        if fusion_order != "given":
            for pair in record["pairs"]:
                drops = ", ".join(f"{t} {d:+.3f}" for t, d in pair["drop"].items())
                progress.console.print(f"  drop {'+'.join(pair['sources'])}: {drops}")
            planned = " / ".join(
                f"{', '.join(a['tasks'])} ({min(a['predicted_margins'].values()):+.3f})" for a in record["planned"]
            )
            progress.console.print(
                f"{fusion_order} order: {', '.join(fused)} "
                f"({record['probe']['trainings']} probes in {record['probe']['seconds']:.0f}s; "
                f"planned adapters, smallest predicted margin: {planned})"
            )
        greedy_result, fusion = pipeline.greedy(
            trainer, fused, thresholds, prefix, on_step=on_step, order_record=record
        )
        strategies = [greedy_result]
        if compare and fused != names:  # the given order's fusion, on the same tasks and thresholds
            phase("greedy fusion, given order")
            given_result, _ = pipeline.greedy(trainer, names, thresholds, f"{prefix}-given", on_step=on_step)
            strategies.insert(0, given_result)
        if compare:
            phase("no-adapter heads")
            base_rows = pipeline.head_only(trainer, names, thresholds)
            per_rows = {}
            for t in names:
                test = trainer.validate(single_states[t], [t], "test")[t]
                per_rows[t] = pipeline._row(thresholds[t], test, single[t]["val"], f"single-{t}")
            per_task_result = pipeline.StrategyResult("adapter-per-task", [[t] for t in names], per_rows)
            all_result = pipeline.all_in_one(trainer, names, thresholds)
            strategies = [base_rows, per_task_result, all_result, *strategies]

    bundles = pipeline.bundles_of(fusion, tasks, rank, alpha, prefix, base_model=str(model_path))
    out.mkdir(parents=True, exist_ok=True)
    for b in bundles:
        b.write(out)
    budgets = pipeline.text_budgets(trainer, names)
    manifest = pipeline.manifest(
        str(model_path),
        tasks,
        fused,
        thresholds,
        margin,
        rank,
        alpha,
        cfg,
        limit,
        bundles,
        greedy_result,
        datasets=datasets,
        max_new_tokens=budgets,
    )
    if gateway:
        manifest["registered"] = pipeline.register(
            gateway,
            bundles,
            greedy_result,
            {t: tasks[t].prompt for t in names},
            api_key=api_key,
            admin_key=admin_key,
            log=console.print,
            max_new_tokens=budgets,
        )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    table = Table("strategy", "adapters", *names, "min margin", title="test accuracy (threshold)")
    for r in strategies:
        cells = []
        for t in names:
            row = r.tasks[t]
            ok = row["accuracy"] >= row["threshold"]
            cells.append(f"{'' if ok else '[red]'}{row['accuracy']:.3f}{'' if ok else '[/red]'}")
        rule = r.extra.get("fusion_order", {}).get("rule")
        label = f"{r.strategy} ({rule} order)" if rule and fusion_order != "given" else r.strategy
        table.add_row(label, str(len(r.adapters)), *cells, f"{r.min_margin():+.3f}")
    table.add_row("threshold", "", *[f"{thresholds[t]:.3f}" for t in names], "")
    console.print(table)
    if compare:
        provenance = Path(model_path).expanduser() / "valora_pretrain.json"
        meta = {
            "base_model": os.path.basename(str(model_path).rstrip("/")),
            "base_pretraining": json.loads(provenance.read_text()) if provenance.exists() else None,
            "rank": rank,
            "lora_alpha": alpha,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "lr_rule": "lr / sqrt(tasks in the run)",
            "clip_norm": cfg.clip_norm,
            "head_lr": head_lr,
            "margin": margin,
            "fusion_order": fusion_order,
            "seed": seed,
            "split_sizes": {t: {s: tasks[t].size(s) for s in ("train", "val", "test")} for t in names},
            "wall_s": round(time.time() - started, 1),
            "torch_threads": threads,
        }
        path = pipeline.write_results(strategies, results, meta, append=append)
        console.print(f"results -> {path}")
    console.print(f"bundles -> {out} ({len(bundles)} adapters for {len(names)} tasks) in {time.time() - started:.0f}s")


@app.command()
def register(
    out: Path = typer.Option(..., exists=True, file_okay=False, help="A directory written by `generate`."),
    gateway: str = typer.Option(..., help="host:port of a valora gateway."),
    api_key: Optional[str] = typer.Option(None, envvar="VALORA_API_KEY", help="API key for the gateway."),
    admin_key: Optional[str] = typer.Option(None, envvar="VALORA_ADMIN_KEY", help="Admin key for the gateway."),
    check: int = typer.Option(
        0,
        min=0,
        help="Then send this many test images per task through the gateway "
        "(task + label output) and compare with the measured accuracy.",
    ),
) -> None:
    """Register adapters generated earlier (bundles + one task per head), optionally check them served."""
    from services.generator import pipeline

    manifest, bundles, result = pipeline.load_generated(out)
    manifest["registered"] = pipeline.register(
        gateway,
        bundles,
        result,
        manifest["prompts"],
        api_key=api_key,
        admin_key=admin_key,
        log=console.print,
        max_new_tokens=manifest.get("max_new_tokens"),
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if check:
        _check(out, gateway, check, api_key)


@app.command()
def check(
    out: Path = typer.Option(..., exists=True, file_okay=False, help="A directory written by `generate`."),
    gateway: str = typer.Option(..., help="host:port of a valora gateway where `register` put them."),
    n: int = typer.Option(0, min=0, help="Test images per task (0: the whole test split)."),
    api_key: Optional[str] = typer.Option(None, envvar="VALORA_API_KEY", help="API key for the gateway."),
) -> None:
    """Send test images through the gateway (task + label output); compare with the generator's
    prediction for each image and its measured accuracy."""
    _check(out, gateway, n, api_key)


def _check(out: Path, gateway: str, n: int, api_key: str | None) -> None:
    from services.generator import pipeline

    manifest, _, result = pipeline.load_generated(out)
    served = pipeline.served_accuracy(gateway, manifest, n or None, api_key=api_key)
    table = Table(
        "task", "adapter", "n", "served", "95% interval", "generator (same images)", "agree", "generator (test split)"
    )
    for task, row in served.items():
        agree = "?" if row["agree"] is None else f"{row['agree']}/{row['n']}"
        offline = "?" if row["offline_accuracy"] is None else f"{row['offline_accuracy']:.3f}"
        table.add_row(
            task,
            (manifest.get("registered") or {}).get(task, "?"),
            str(row["n"]),
            f"{row['served_accuracy']:.3f}",
            "{:.3f}-{:.3f}".format(*row["interval_95"]),
            offline,
            agree,
            f"{result.tasks[task]['accuracy']:.3f}",
        )
    console.print(table)


@app.command()
def serve(
    once: bool = typer.Option(False, help="Run at most one pending job, then exit."),
) -> None:
    """Run generation jobs queued in the adapter store (AdminService.CreateGenerationJob), one at a
    time. Settings come from VALORA_* (services/generator/runner.py: RunnerSettings)."""
    import signal

    from services.common.logging import configure_logging
    from services.common.metrics import start_metrics_server
    from services.generator.runner import Runner, RunnerSettings

    settings = RunnerSettings()
    configure_logging("generator", settings.log_level, settings.log_json)
    runner = Runner(settings)
    # SIGTERM: a job in progress stops at its next training step and goes back to the queue.
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    if settings.port:  # containers: gRPC health for the probes, and /metrics
        runner.start_health()
        start_metrics_server(settings.metrics_port, settings.host)
    console.print(f"runner {runner.name}: polling {settings.adapter_store_address} every {settings.poll_s}s")
    try:
        if once:
            job = runner.run_once()
            console.print(f"{job.name}: {job.message}" if job is not None else "no job ran")
        else:
            runner.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()


if __name__ == "__main__":
    app()
