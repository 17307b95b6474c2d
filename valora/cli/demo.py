"""`valora demo`: serve greedy-fused adapters generated on real data (or, --quick, random ones)
and report served accuracy and latency. What it serves and measures is the generator's
(services/generator/demo.py, demo_workload.py); this module starts, prints and writes the report."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import typer
from rich.table import Table

from valora import cluster as cluster_mod
from valora.cli.common import ADDRESS, ADMIN_KEY, API_KEY, HOME, app, console, gateway_address, server_code
from valora.client import ValoraClient


def _quick_demo(
    requests: int,
    concurrency: int,
    max_new_tokens: int,
    home: Path,
    address: str | None,
    api_key: str | None,
    admin_key: str | None,
    report: Path | None,
) -> None:
    """The quick demo: three random adapters on the tiny random base, synthetic images, latency only."""
    adapter_format = server_code("adapter-format")
    workload = server_code("demo-workload", extra="generator")

    started = None
    if address is None and cluster_mod.Cluster.load(home) is None:
        with console.status("starting a local cluster…"):
            started = cluster_mod.start_cluster(home, gateway_port=0)
    try:
        gateway = gateway_address(home, address)
        model_path = Path(os.environ.get("VALORA_MODEL_PATH", cluster_mod.default_model_path(home)))
        shapes = adapter_format.BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
        with ValoraClient(gateway, api_key=api_key, admin_key=admin_key) as client:
            targets: dict[str, dict] = {"base": {}}
            for i, rank in enumerate((8, 16, 4)):
                bundle, cfg = adapter_format.make_random_bundle(shapes, rank=rank, seed=100 + i, lora_alpha=2 * rank)
                v = client.upload_adapter_version(f"demo-{i}", bundle, cfg, request_id=f"demo-{i}-r{rank}")
                client.set_alias(f"adapters/demo-{i}", "prod", v.name)
                targets[f"adapters/demo-{i}@prod"] = {"adapter": f"adapters/demo-{i}@prod"}
                console.print(f"registered {v.name} (rank {rank}, sha256 {v.sha256[:12]})")
            images = workload.synthetic_images(4, seed=0)
            names = list(targets)
            # (target, picture) pairs repeat, so determinism under batching can be checked.
            work = [(names[i % len(names)], i % len(images)) for i in range(requests)]

            def run(item):
                target, picture = item
                t0 = time.perf_counter()
                r = client.infer(
                    f"Describe picture {picture}.", [images[picture]], max_new_tokens=max_new_tokens, **targets[target]
                )
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
            row = workload.latency_row(target, [(ms, r) for (t, _), ms, r in results if t == target])
            rows.append(row)
            table.add_row(
                target,
                str(row["n"]),
                ",".join(row["modes"]),
                f"{row['mean_ms']:.0f}",
                f"{row['p50_ms']:.0f}",
                f"{row['p99_ms']:.0f}",
                f"{row['ttft_ms']:.0f}",
                f"{row['queue_ms']:.0f}",
                str(row["output_tokens"]),
            )
        console.print(table)
        all_lat = [ms for _, ms, _ in results]
        summary = {
            "demo": "quick",
            "requests": requests,
            "concurrency": concurrency,
            "wall_s": wall_s,
            "throughput_rps": requests / wall_s,
            "p50_ms": workload.percentile(all_lat, 50),
            "p99_ms": workload.percentile(all_lat, 99),
            "workers": sorted({r.worker for _, _, r in results}),
            "deterministic": consistent,
            "rows": rows,
            "sample": {t: next(r.text for (tt, _), _, r in results if tt == t) for t in names},
        }
        console.print(
            f"throughput {summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']:.0f} ms, "
            f"p99 {summary['p99_ms']:.0f} ms, workers {summary['workers']}"
        )
        for t, text in summary["sample"].items():
            console.print(f"[dim]{t}: {text!r}")
        out = report or Path(home) / "demo-report.json"
        out.write_text(json.dumps(summary, indent=2))
        console.print(f"report: {out}")
    finally:
        if started is not None:
            cluster_mod.stop_cluster(home)


_DEMO_HELP = (
    "Serve greedy-fused adapters generated on real data; report served accuracy and latency.\n\n"
    "Pretrains the tiny base briefly and generates adapters for a few vision tasks with the accuracy-aware greedy "
    "fusion (both cached under --home, keyed by the settings), starts a local cluster on that base when none is "
    "running (and stops it afterwards), registers the adapters and one task per head (idempotent), then sends "
    "the generator's whole test split as task-head label requests mixed concurrently with text-generation "
    "requests through the adapters and the base, and checks every served label against the generator's "
    "prediction for the same image."
)


@app.command(help=_DEMO_HELP)
def demo(
    quick: bool = typer.Option(
        False,
        "--quick",
        help="The old quick demo instead: random adapters on the "
        "tiny random base, synthetic images, latency only (no training).",
    ),
    tasks: str = typer.Option(
        "digit,parity,digit-rot90,count",
        help="Tasks to generate adapters for, in fusion order (`python -m services.generator tasks`).",
    ),
    per_task: int = typer.Option(
        0,
        min=0,
        help="Test images per task sent as label requests (0: the "
        "generator's whole test split; fewer: its first ones, a wider interval).",
    ),
    text_requests: int = typer.Option(
        32,
        min=0,
        help='Text-generation requests ("Which digit is this?" on '
        "held-out digit images) spread over the base and the adapters.",
    ),
    concurrency: int = typer.Option(8, min=1),
    max_new_tokens: int = typer.Option(None, help="Tokens per text request (default 8; --quick: 12)."),
    epochs: int = typer.Option(2, min=1, help="Training epochs per fusion step."),
    limit: int = typer.Option(400, min=0, help="Cap on each split's size for generation (0: full splits)."),
    pretrain_steps: int = typer.Option(300, min=1, help="Pretraining steps of the demo base."),
    margin: float = typer.Option(0.03, help="Thresholds = single-task val accuracy minus this."),
    rank: int = typer.Option(8, min=1),
    seed: int = typer.Option(0),
    threads: int = typer.Option(
        2,
        min=1,
        help="torch CPU threads for pretraining/generation (the trained "
        "weights depend on it: torch splits CPU reductions by thread).",
    ),
    requests: int = typer.Option(48, help="--quick: requests in the workload."),
    home: Path = HOME,
    address: str = ADDRESS,
    api_key: str = API_KEY,
    admin_key: str = ADMIN_KEY,
    report: Path = typer.Option(None, help="Write the report JSON here (default: <home>/demo-report.json)."),
):
    """Serve greedy-fused adapters generated on real data; report served accuracy and latency."""
    if not console.is_terminal:  # logs and pipes: wide enough for the tables
        console.width = max(console.width, 120)
    if quick:
        return _quick_demo(requests, concurrency, max_new_tokens or 12, home, address, api_key, admin_key, report)
    max_new_tokens = max_new_tokens or 8
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    home = Path(home).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    names = [t.strip() for t in tasks.split(",") if t.strip()]

    t0 = time.perf_counter()
    tiny = cluster_mod.default_model_path(home)
    with console.status("building the tiny Qwen2-VL (first run only)…"):
        cluster_mod.ensure_model(tiny)
    # ensure_base and ensure_adapters run torch on `threads` CPU threads when they train
    gdemo = server_code("demo", extra="generator")
    workload = server_code("demo-workload", extra="generator")
    with console.status("pretraining the demo base…") as st:
        base, provenance, base_cached = gdemo.ensure_base(
            tiny,
            home,
            steps=pretrain_steps,
            seed=seed,
            log=console.print,
            threads=threads,
            progress=lambda s, n, loss: st.update(f"pretraining the demo base: step {s}/{n}, loss {loss:.3f}"),
        )
    timings["pretrain_s"] = round(time.perf_counter() - t0, 1)
    console.print(
        f'base: {base} ({"cached" if base_cached else "pretrained"}; text answer to "Which digit is '
        f'this?" on the digit val split: {provenance["val_accuracy"]:.3f})'
    )

    settings = gdemo.DemoSettings(
        tasks=tuple(names),
        pretrain_steps=pretrain_steps,
        epochs=epochs,
        limit=limit or None,
        rank=rank,
        margin=margin,
        seed=seed,
        threads=threads,
    )
    t0 = time.perf_counter()
    with console.status("generating adapters…") as st:
        gen_dir, manifest, gen_cached = gdemo.ensure_adapters(
            home,
            base,
            settings,
            log=console.print,
            progress=lambda what, d, n: st.update(f"generating adapters: training [{what}] {d}/{n}"),
        )
    timings["generate_s"] = round(time.perf_counter() - t0, 1)
    greedy = manifest["greedy"]["tasks"]
    console.print(
        f"adapters: {gen_dir} ({'cached; ' if gen_cached else ''}generated in "
        f"{manifest['demo']['generate_s']:.0f} s; key {manifest['demo']['key']}): "
        + "; ".join(f"{a['name']} = {'+'.join(a['tasks'])}" for a in manifest["adapters"])
    )

    started = None
    t0 = time.perf_counter()
    if address is None and cluster_mod.Cluster.load(home) is None:
        with console.status(f"starting a local cluster on {base.name}…"):
            started = cluster_mod.start_cluster(home, gateway_port=0, model_path=base)
    else:
        console.print(
            f"[yellow]using the running cluster at {gateway_address(home, address)}: its workers must serve "
            f"{base} for the accuracies to hold"
        )
    timings["cluster_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        gateway = gateway_address(home, address)
        with ValoraClient(gateway, api_key=api_key, admin_key=admin_key) as client:
            t0 = time.perf_counter()
            registered = workload.register(client, gen_dir, log=console.print)
            timings["register_s"] = round(time.perf_counter() - t0, 1)

            # The mixed workload: label requests (task heads) and text requests, shuffled together.
            work, text_targets = workload.mixed_workload(
                names, registered, manifest, settings.limit, per_task, text_requests, seed
            )
            t0 = time.perf_counter()
            with console.status(f"mixed workload: {len(work)} requests, concurrency {concurrency}…"):
                results = workload.run_workload(client, work, concurrency, max_new_tokens)
            wall_s = time.perf_counter() - t0
            timings["workload_s"] = round(wall_s, 1)
    finally:
        if started is not None:
            cluster_mod.stop_cluster(home)

    # Per task: served accuracy on the generator's test images vs the threshold the fusion had to
    # keep, and every served label vs the generator's prediction for the same image.
    acc_table = Table(
        title=f"served accuracy: {'the whole test split' if not per_task else f'{per_task} test images'}"
        f" per task, label requests through the gateway ({len(manifest['adapters'])} greedy-fused "
        f"adapter{'s' if len(manifest['adapters']) != 1 else ''})"
    )
    for col in (
        "task",
        "adapter",
        "n",
        "served",
        "95% interval",
        "generator",
        "agree",
        "thresh.",
        "ok",
        "mean ms",
        "p99 ms",
    ):
        acc_table.add_column(col, justify="left" if col in ("task", "adapter", "ok") else "right")
    task_rows = workload.task_rows(names, results, registered, manifest)
    for row in task_rows:
        ok, same = row["meets_threshold"], row["agree"] == row["n"]
        acc_table.add_row(
            row["task"],
            row["adapter"].replace("adapters/", "").replace("/versions/", " v"),
            str(row["n"]),
            f"{'[green]' if ok else '[red]'}{row['served_accuracy']:.3f}",
            "{:.3f}-{:.3f}".format(*row["interval_95"]),
            f"{row['generator_accuracy_same_images']:.3f}",
            f"{'' if same else '[red]'}{row['agree']}/{row['n']}",
            f"{row['threshold']:.3f}",
            "yes" if ok else "[red]no",
            f"{row['mean_ms']:.0f}",
            f"{row['p99_ms']:.0f}",
        )
    console.print(acc_table)
    console.print(
        "[dim]questions: "
        + "; ".join(f"{t}: {manifest['prompts'][t]!r}" for t in names)
        + ". served = served label == truth (95% interval: Wilson's, for other images of the same kind); "
        "generator = its accuracy on the same images; agree = served labels equal to the generator's "
        "prediction; thresh. = single-task val accuracy - margin"
    )

    # Per target: latency of every request kind in the mixed batch.
    targets = [registered[t]["task"] for t in names] + (text_targets if text_requests else [])
    lat_table = Table(
        title=f"mixed workload: {len(results)} requests ({len(results) - text_requests} label, "
        f"{text_requests} text) in one stream, concurrency {concurrency}"
    )
    for col in ("target", "kind", "n", "mode", "mean", "p50", "p99", "ttft", "queue", "tok", "correct"):
        lat_table.add_column(col, justify="left" if col in ("target", "kind", "mode") else "right")
    target_rows = workload.target_rows(targets, results)
    for row in target_rows:
        lat_table.add_row(
            row["target"].replace("adapters/", "").replace("tasks/", "task "),
            row["kind"],
            str(row["n"]),
            ",".join(row["modes"]),
            f"{row['mean_ms']:.0f}",
            f"{row['p50_ms']:.0f}",
            f"{row['p99_ms']:.0f}",
            f"{row['ttft_ms']:.0f}",
            f"{row['queue_ms']:.0f}",
            str(row["output_tokens"]),
            f"{row['correct']:.2f}",
        )
    console.print(lat_table)
    console.print(
        '[dim]latencies in ms; correct: label == truth for task heads; for text ("Which digit is this?"), '
        "the generated answer == the digit (the base was pretrained to answer in text; the adapters were "
        "trained for their heads, not for text)"
    )
    all_lat = [ms for _, ms, _, _ in results]
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    summary = {
        "demo": "generated",
        "gateway": gateway,
        "base_model": str(base),
        "base_pretraining": provenance,
        "base_cached": base_cached,
        "generated_dir": str(gen_dir),
        "generated_cached": gen_cached,
        "settings": manifest["demo"]["settings"],
        "cache_key": manifest["demo"]["key"],
        "generation": {
            "adapters": [{"name": a["name"], "tasks": a["tasks"]} for a in manifest["adapters"]],
            "steps": manifest["greedy"].get("steps", []),
            "thresholds": manifest["thresholds"],
            "single_task_accuracy": manifest["demo"]["single_task_accuracy"],
            "test_accuracy": {t: greedy[t]["accuracy"] for t in names},
            "split_sizes": manifest["demo"]["split_sizes"],
            "generate_s": manifest["demo"]["generate_s"],
        },
        "registered": registered,
        "requests": len(results),
        "label_requests": len(results) - text_requests,
        "text_requests": text_requests,
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "wall_s": round(wall_s, 2),
        "throughput_rps": round(len(results) / wall_s, 2),
        "p50_ms": round(workload.percentile(all_lat, 50), 1),
        "p99_ms": round(workload.percentile(all_lat, 99), 1),
        "workers": sorted({r.worker for _, _, r, _ in results}),
        "all_tasks_meet_threshold": all(r["meets_threshold"] for r in task_rows),
        "served_equals_generator": all(r["agree"] == r["n"] for r in task_rows),
        "tasks": task_rows,
        "rows": target_rows,
        "timings": timings,
    }
    console.print(
        f"throughput {summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']:.0f} ms, p99 "
        f"{summary['p99_ms']:.0f} ms; every task meets its threshold: {summary['all_tasks_meet_threshold']}; "
        f"served = generator on every image: {summary['served_equals_generator']}; "
        f"times: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in timings.items())
    )
    out = report or home / "demo-report.json"
    out.write_text(json.dumps(summary, indent=2))
    console.print(f"report: {out}")
