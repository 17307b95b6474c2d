"""Fusion order, measured (issue 24): greedy fusion of the same tasks, with the same thresholds,
in several given orders and in the order chosen from interference probes.

    python bench/generation_order.py --model-path <pretrained tiny base> --threads 2 \\
        --given default --given reversed --given shuffled --out bench/results/generation-order-cpu2-<date>.json

Thresholds are measured once (one adapter per task, in the default order: its val accuracy minus
--margin); then each order's greedy fusion starts from the same trainer state (a fresh adapter
counter over the same cached features), so orders differ only in the order. Per order the file
keeps the adapters, each task's test and val accuracy, threshold and margin, the minimum margins
and the fusion's wall time; the probed row also keeps the probe matrix, its budget and time.
`bench/generation_report.py FILE` prints it as tables.

    python bench/generation_order.py --model-path <base> --task-set conflict --full-pairs --seed 0 \
        --given default --given grouped --out bench/results/generation-order-conflict-cpu2-<date>.json

`--task-set conflict` (`TASK_SETS`) fuses tasks whose pairwise interference is larger than the
run-to-run noise, listed so that conflicting ones alternate; `--full-pairs` also measures every
pair's interference at the fusion's own budget (not the probes'), kept in the setup with the
probes' agreement with it; `--seed` varies the LoRA initialisation and batch order (two seeds
give the noise).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import time
from pathlib import Path


# Named task sets (--task-set), each in its listed (default) order, and named given orders of it.
# "conflict": count loses accuracy trained beside the digit-shape tasks (at the fusion's budget,
# seeds 0 and 1: .113/.083 beside digit-noisy, .083/.053 beside digit-inverted, where a pair's
# drop differs between the seeds by .017 in the median; bench/results/
# generation-order-conflict-cpu2-2026-12-08.json), colour a little (.03 beside digit-inverted),
# while the digit-shape tasks barely interfere with each other; listed so that they alternate,
# and in its "grouped" order each kind together. (Labelings that contradict each other on the
# same images do not conflict in this generator: each task has a head of its own, so the shared
# LoRA only has to keep what both heads read.)
TASK_SETS = {
    "conflict": ("digit", "count", "digit-noisy", "colour", "digit-inverted"),
}
NAMED_ORDERS = {
    "conflict": {"grouped": ("digit", "digit-noisy", "digit-inverted", "colour", "count")},
}


def given_orders(
    names: list[str], specs: list[str], seed: int = 0, named: dict[str, tuple[str, ...]] | None = None
) -> dict[str, list[str]]:
    """{label: order} for each spec: "default" (as listed), "reversed", "shuffled" (seeded), a
    name in `named` (the task set's own orders), or a comma-separated order of the same tasks."""
    out = {}
    for spec in specs:
        if spec == "default":
            out[spec] = list(names)
        elif named and spec in named:
            out[spec] = list(named[spec])
        elif spec == "reversed":
            out[spec] = list(reversed(names))
        elif spec == "shuffled":
            order = list(names)
            random.Random(seed).shuffle(order)
            out[spec] = order
        else:
            order = [t.strip() for t in spec.split(",") if t.strip()]
            if sorted(order) != sorted(names):
                raise SystemExit(f"--given {spec!r}: not an order of {names}")
            out[spec] = order
    return out


def drops(interference) -> dict[str, float]:
    """{"task|partner": task's accuracy alone less with partner} over every ordered pair."""
    return {
        f"{a}|{b}": round(d, 4)
        for a in interference.sources
        for b in interference.sources
        if a != b
        for d in interference.drop(a, b).values()
    }


def correlation(x: list[float], y: list[float]) -> float | None:
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return round(sxy / (sxx * syy) ** 0.5, 3) if sxx and syy else None


def full_pairs(trainer, names: list[str], record: dict) -> dict:
    """Every task alone and every pair at `trainer`'s own (the fusion's) budget: the interference
    the probes stand in for, its largest drops, and the probes' drops' correlation with it."""
    from services.generator.fusion import Source, probe_interference

    inter = probe_interference([Source.single(t) for t in names], trainer)
    full = drops(inter)
    probe = record["probe"]
    probed = {f"{a}|{b}": probe["alone"][a][a] - probe["paired"][a][b][a] for a in names for b in names if a != b}
    keys = sorted(full)
    out = {
        "budget": {"epochs": trainer.config.epochs, "batches_per_epoch": 0, "batch_size": trainer.config.batch_size},
        "probe": inter.to_json(),
        "drops": dict(sorted(full.items(), key=lambda kv: -kv[1])),
        "probe_drop_correlation": correlation([probed[k] for k in keys], [full[k] for k in keys]),
    }
    top = ", ".join(f"{k} {v:+.3f}" for k, v in list(out["drops"].items())[:6])
    r = out["probe_drop_correlation"]
    print(f"full-budget pairs ({inter.seconds:.0f}s): largest drops {top}; probe correlation {r}", flush=True)
    return out


def main() -> None:
    from services.generator.datasets import DEFAULT_TASKS
    from services.generator.fusion import PROBE_BATCHES, PROBE_EPOCHS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, type=Path)
    ap.add_argument("--tasks", default=None, help="Comma-separated tasks (the default order; default: the built-in 7).")
    ap.add_argument(
        "--task-set", choices=sorted(TASK_SETS), default=None, help="A named task set instead of --tasks (TASK_SETS)."
    )
    ap.add_argument(
        "--given", action="append", default=[], help="default | reversed | shuffled | a task set's order | t1,t2,..."
    )
    ap.add_argument(
        "--full-pairs",
        action="store_true",
        help="Also train every task alone and every pair at the fusion's budget (the interference the probes predict).",
    )
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-epochs", type=int, default=PROBE_EPOCHS)
    ap.add_argument("--probe-batches", type=int, default=PROBE_BATCHES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()

    import json

    import torch

    from services.generator import pipeline
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    torch.set_num_threads(args.threads)
    if args.task_set and args.tasks:
        raise SystemExit("give --tasks or --task-set, not both")
    names = list(TASK_SETS[args.task_set]) if args.task_set else [t.strip() for t in (args.tasks or "").split(",")]
    names = [t for t in names if t] or list(DEFAULT_TASKS)
    orders = given_orders(names, args.given or ["default"], args.seed, NAMED_ORDERS.get(args.task_set))
    started = time.perf_counter()
    tasks = build_tasks(names, limit=args.limit)
    base = BaseModel.load(args.model_path, rank=args.rank, lora_alpha=2.0 * args.rank)
    cfg = TrainConfig(epochs=args.epochs, seed=args.seed)
    trainer = TorchTrainer(base, tasks, cfg)
    t0 = time.perf_counter()
    _, single = pipeline.per_task(trainer, names)
    single_s = time.perf_counter() - t0
    thresholds = pipeline.measured_thresholds(single, args.margin)
    print(f"thresholds ({single_s:.0f}s): {thresholds}", flush=True)

    results = []

    def run(label: str, order: list[str], record: dict) -> None:
        t = time.perf_counter()
        result, _ = pipeline.greedy(trainer.with_config(cfg), order, thresholds, "fused", order_record=record)
        record["label"] = label
        result.extra.update(
            min_margin=result.min_margin(),
            min_val_margin=result.min_margin("val_accuracy"),
            fusion_s=round(time.perf_counter() - t, 1),
        )
        for row in result.tasks.values():
            row["margin"] = round(row["accuracy"] - row["threshold"], 4)
        results.append(result)
        print(
            f"{label}: {len(result.adapters)} adapters {result.adapters}, min margin test "
            f"{result.extra['min_margin']:+.4f} val {result.extra['min_val_margin']:+.4f} "
            f"({result.extra['fusion_s']:.0f}s)",
            flush=True,
        )

    for label, order in orders.items():
        run(label, order, {"rule": "given", "order": order})
    probed, record = pipeline.fusion_order(
        trainer.with_config(cfg), names, thresholds, "probed", args.probe_epochs, args.probe_batches
    )
    print(f"probed order ({record['probe']['seconds']:.0f}s): {probed}", flush=True)
    run("probed", probed, record)
    full = full_pairs(trainer.with_config(cfg), names, record) if args.full_pairs else None

    provenance = args.model_path.expanduser() / "valora_pretrain.json"
    meta = {
        "what": "fusion order: the same tasks and thresholds, fused in given orders and the probed one",
        "task_set": args.task_set,
        "base_model": os.path.basename(str(args.model_path).rstrip("/")),
        "base_pretraining": json.loads(provenance.read_text()) if provenance.exists() else None,
        "rank": args.rank,
        "epochs": args.epochs,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "lr_rule": "lr / sqrt(tasks in the run)",
        "head_lr": cfg.head_lr,
        "margin": args.margin,
        "seed": args.seed,
        "limit": args.limit,
        "thresholds_from": "one adapter per task, default order: val accuracy - margin",
        "single_task_accuracy": {t: {k: round(v, 4) for k, v in a.items()} for t, a in single.items()},
        "single_s": round(single_s, 1),
        "torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if full is not None:
        meta["full_budget_interference"] = full
    out = args.out or Path("bench/results") / f"generation-order-cpu{os.cpu_count()}-{dt.date.today().isoformat()}.json"
    path = pipeline.write_results(results, out, meta, append=args.append)
    print(f"results -> {path}")
    print(json.dumps({r.extra["fusion_order"]["label"]: len(r.adapters) for r in results}))


if __name__ == "__main__":
    main()
