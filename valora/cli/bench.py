"""`valora bench ...`: benchmarks that need no cluster (the scheduling simulator), and
`bench scale`, which runs bench/scale_bench.py from a source checkout."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from valora.cli.common import console, server_code

bench_app = typer.Typer(
    help="Benchmarks (the scheduling simulator; GPU harnesses live in bench/).", no_args_is_help=True
)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@bench_app.command("sched")
def bench_sched(
    policies: str = typer.Option("valora,dlora,slora,punica", help="Comma-separated policies."),
    alphas: str = typer.Option("0.5,1,1.5", help="Zipf skews of adapter popularity."),
    rates: str = typer.Option("40,80", help="Arrival rates, requests/s (2 workers: ~75 req/s saturate)."),
    seconds: float = typer.Option(15.0, help="Trace length in seconds of arrivals (bounds the run)."),
    workers: int = typer.Option(2),
    max_batch: int = typer.Option(16),
    adapters: int = typer.Option(64, help="Adapters in the popularity distribution (32-128)."),
    burst_cvs: str = typer.Option("1,3", help="Inter-arrival CVs: 1 Poisson, >1 gamma bursts."),
    task_head_fraction: float = typer.Option(0.3, help="Share of one-forward task-head requests."),
    thetas: str = typer.Option("1.0", help="Starvation thresholds θ (s) for valora/dlora."),
    profile: str = typer.Option("h200-7b", help="Cost profile (h200-7b, cpu-tiny)."),
    results_dir: Path = typer.Option(Path("bench/results"), help="Measured kernel/switch JSON."),
    azure_csv: Path = typer.Option(
        None,
        exists=True,
        dir_okay=False,
        help="Replay an Azure LLM trace CSV (TIMESTAMP, ContextTokens, "
        "GeneratedTokens) instead of synthetic arrivals; its own arrival "
        "times are kept and rate x seconds caps the rows replayed.",
    ),
    workload: str = typer.Option(
        "synthetic",
        help="synthetic (one mixed stream), or two-app: issue 23's "
        "video streams (task heads, one chunk a second each, class video) "
        "and visual retrieval (rates, alphas; class retrieval) at once.",
    ),
    video_streams: int = typer.Option(16, help="two-app: camera streams."),
    video_tasks: int = typer.Option(4, help="two-app: task-head adapters the streams use."),
    video_slo_ms: float = typer.Option(1000.0, help="two-app: the video class's objective."),
    retrieval_slo_ms: float = typer.Option(0.0, help="two-app: the retrieval class's objective (0: none)."),
    deadlines: str = typer.Option(
        "on",
        help="valora/dlora with latency objectives: on (earliest deadline "
        "first), off (ignored), or both (one row each).",
    ),
    seed: int = typer.Option(0),
    out: Path = typer.Option(None, help="Default bench/results/sched-<date>.json."),
    write: bool = typer.Option(True, help="Write the results JSON."),
):
    """Scheduling policies in the discrete-event simulator (real policy code, cost model from
    measured H200 numbers): mean/p50/p99 latency, token latency, throughput, switches/s, and per
    SLO class latency and attainment."""
    import datetime as dt
    import itertools
    import platform
    import subprocess

    sim = server_code("scheduler-sim")
    cost = sim.load_profile(profile, results_dir if results_dir.is_dir() else None)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if workload not in ("synthetic", "two-app"):
        raise typer.BadParameter(f"--workload is synthetic or two-app, not {workload!r}")
    modes = {"on": [True], "off": [False], "both": [True, False]}.get(deadlines)
    if modes is None:
        raise typer.BadParameter(f"--deadlines is on, off or both, not {deadlines!r}")

    t0 = time.perf_counter()
    cvs = [1.0] if azure_csv is not None or workload == "two-app" else _floats(burst_cvs)
    rows = sim.matrix(
        names,
        _floats(alphas),
        _floats(rates),
        cvs,
        _floats(thetas),
        modes,
        cost,
        workload=workload,
        seconds=seconds,
        workers=workers,
        max_batch=max_batch,
        adapters=adapters,
        task_head_fraction=task_head_fraction,
        azure_csv=azure_csv,
        video_streams=video_streams,
        video_tasks=video_tasks,
        video_slo_ms=video_slo_ms,
        retrieval_slo_ms=retrieval_slo_ms,
        seed=seed,
    )
    wall = time.perf_counter() - t0
    for cv, alpha, rate in itertools.product(cvs, _floats(alphas), _floats(rates)):
        table = Table(
            title=f"sched sim: alpha {alpha}, {rate:g} req/s, arrival CV {cv:g}, {workers} workers x "
            f"batch {max_batch}, {adapters} adapters, profile {cost.name}"
            + (f", {video_streams} video streams" if workload == "two-app" else "")
        )
        selected = [r for r in rows if r["alpha"] == alpha and r["rate"] == rate and r["burst_cv"] == cv]
        classes = sorted({c for r in selected for c in r.get("classes", {})})
        cols = [
            "policy",
            "θ s",
            "deadlines",
            "mean ms",
            "p50 ms",
            "p99 ms",
            "token ms",
            "ttft ms",
            "req/s",
            "switch/s",
            "max queue ms",
        ]
        for c in classes:
            cols += [f"{c} mean/p99 ms", f"{c} SLO"]
        for col in cols:
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in selected:
            cells = [
                r["policy"],
                "-" if r["theta_s"] is None else f"{r['theta_s']:g}",
                "-" if r["deadlines"] is None else ("on" if r["deadlines"] else "off"),
                f"{r['mean_ms']:.0f}",
                f"{r['p50_ms']:.0f}",
                f"{r['p99_ms']:.0f}",
                f"{r['token_ms']:.1f}",
                f"{r['ttft_ms']:.0f}",
                f"{r['throughput_rps']:.1f}",
                f"{r['switches_per_s']:.1f}",
                f"{r['max_queue_ms']:.0f}",
            ]
            for c in classes:
                k = r.get("classes", {}).get(c, {})
                cells += [
                    f"{k.get('mean_ms', float('nan')):.0f}/{k.get('p99_ms', float('nan')):.0f}",
                    f"{100 * k['attainment']:.1f}%" if "attainment" in k else "-",
                ]
            table.add_row(*cells)
        console.print(table)
    console.print(f"[dim]{len(rows)} simulations in {wall:.1f} s")
    if not write:
        return
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        commit = "unknown"
    now = dt.datetime.now(dt.timezone.utc)
    info = {
        "date": now.isoformat(timespec="seconds"),
        "git_commit": commit,
        "python": platform.python_version(),
        "source": "sim",
        "cost_profile": cost.name,
        "workers": workers,
        "max_batch": max_batch,
        "adapters": adapters,
        "seconds": seconds,
        "burst_cvs": cvs,
        "task_head_fraction": task_head_fraction,
        "trace": str(azure_csv) if azure_csv else workload,
        "seed": seed,
        "wall_s": round(wall, 2),
        "deadlines": deadlines,
        "cost_model": {
            "decode_base_ms": cost.decode_base_ms,
            "decode_row_ms": cost.decode_row_ms,
            "prefill_ms_per_token": cost.prefill_ms_per_token,
            "switch_ms": cost.switch_ms,
            "merge_ms": cost.merge_ms,
            "load_ms": cost.load_ms,
            "mixture_factor": cost.mixture_factor,
            "atmm_us_16x8": cost.atmm_op_us(16, 8),
        },
    }
    if workload == "two-app":
        info["two_app"] = {
            "video_streams": video_streams,
            "video_tasks": video_tasks,
            "video_slo_ms": video_slo_ms,
            "retrieval_slo_ms": retrieval_slo_ms,
            "retrieval_rates": _floats(rates),
        }
    path = out or Path("bench/results") / f"sched-{now.date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=float))
    console.print(f"results: {path}")


@bench_app.command(
    "scale", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def bench_scale(ctx: typer.Context):
    """Throughput scaling over 1, 2, 4… workers (bench/scale_bench.py; --help lists its options).

    A real cluster per worker count, generation requests with images through the gateway."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "scale_bench.py"
    if not path.exists():
        console.print(f"[red]{path} not found: `valora bench scale` runs from a source checkout")
        raise typer.Exit(2)
    spec = importlib.util.spec_from_file_location("scale_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    raise typer.Exit(module.main(list(ctx.args), prog="valora bench scale"))
