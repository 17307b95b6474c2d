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
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import time
from pathlib import Path


def given_orders(names: list[str], specs: list[str], seed: int = 0) -> dict[str, list[str]]:
    """{label: order} for each spec: "default" (as listed), "reversed", "shuffled" (seeded), or a
    comma-separated order of the same tasks."""
    out = {}
    for spec in specs:
        if spec == "default":
            out[spec] = list(names)
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


def main() -> None:
    from services.generator.datasets import DEFAULT_TASKS
    from services.generator.fusion import PROBE_BATCHES, PROBE_EPOCHS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, type=Path)
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="Comma-separated tasks (the default order).")
    ap.add_argument("--given", action="append", default=[], help="default | reversed | shuffled | t1,t2,...")
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
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    orders = given_orders(names, args.given or ["default"], args.seed)
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

    provenance = args.model_path.expanduser() / "valora_pretrain.json"
    meta = {
        "what": "fusion order: the same tasks and thresholds, fused in given orders and the probed one",
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
    out = args.out or Path("bench/results") / f"generation-order-cpu{os.cpu_count()}-{dt.date.today().isoformat()}.json"
    path = pipeline.write_results(results, out, meta, append=args.append)
    print(f"results -> {path}")
    print(json.dumps({r.extra["fusion_order"]["label"]: len(r.adapters) for r in results}))


if __name__ == "__main__":
    main()
