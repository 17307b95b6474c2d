"""End-to-end generation: measure, choose thresholds, fuse greedily, export, register, compare.

Strategies compared (all on the same base model, data splits and training settings):

    base-head-only    no adapter: a linear head per task on the frozen base model
    adapter-per-task  one LoRA adapter (+ head) per task
    all-in-one        one adapter trained on every task at once
    greedy-fusion     VaLoRA's accuracy-aware greedy fusion (fusion.greedy_fusion)

Thresholds, unless given, are measured: each task's single-adapter *validation* accuracy minus
`margin`. Fusion decides on validation accuracy; reported accuracies are on the test split.

The fusion order (`fusion_order`) is the given one, or ("probed") one chosen from cheap
interference probes (fusion.probe_interference: every task alone and every pair together, a few
batches each); the result records the rule, the order, the probe matrix with its time, each
pair's accuracy drops and the adapters the order was planned as.

A text task (datasets.TEXT) is fused beside head tasks by the same algorithm; its accuracy is the
normalised exact match of its greedy-decoded answers, its prediction per test image is that
answer, and it is registered as a task without a head (served as plain TEXT generation with its
adapter, `max_new_tokens` from the manifest).

A generated directory (`manifest`, `load_generated`) also keeps the greedy adapters' prediction
for every test image, so serving can be checked image by image (`served_accuracy`, `valora
demo`): a worker computing the serving contract (services/generator/__init__.py) answers those
labels exactly, and a served accuracy then differs from the generator's only where it was
measured on other images: `binomial_interval` says how far a sample of n may fall.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from services.generator.answers import exact_match
from services.generator.bundle import Bundle, export_bundle
from services.generator.datasets import TEXT, TaskData, build_task
from services.generator.fusion import (
    FUSION_ORDERS,
    PROBE_BATCHES,
    PROBE_EPOCHS,
    PROBED_RULE,
    FusionResult,
    FusionStep,
    Source,
    greedy_fusion,
    planned_adapters,
    predicted_margins,
    probe_interference,
)
from services.generator.training import AdapterState, TorchTrainer, TrainConfig

Log = Callable[[str], None]


@dataclass
class StrategyResult:
    strategy: str
    adapters: list[list[str]]  # tasks per adapter
    tasks: dict[str, dict]  # task -> {"threshold", "accuracy", "val_accuracy", "adapter"}
    extra: dict = field(default_factory=dict)
    # task -> predicted label per test image (split order); kept in the manifest, not in results files
    predictions: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "n_adapters": len(self.adapters), "tasks": self.tasks, **self.extra}

    def meets_thresholds(self) -> bool:
        return all(v["accuracy"] >= v["threshold"] for v in self.tasks.values())

    def min_margin(self, key: str = "accuracy") -> float:
        """The smallest margin over the thresholds: min over tasks of accuracy (`key`: "accuracy",
        test; "val_accuracy") minus threshold."""
        return round(min(v[key] - v["threshold"] for v in self.tasks.values()), 4)


def _row(threshold: float, test: float, val: float, adapter: str | None) -> dict:
    return {
        "threshold": round(threshold, 4),
        "accuracy": round(test, 4),
        "val_accuracy": round(val, 4),
        "adapter": adapter,
    }


def head_only(trainer: TorchTrainer, order: Sequence[str], thresholds: Mapping[str, float]) -> StrategyResult:
    rows = {}
    for t in order:
        _, acc = trainer.head_only(t)
        rows[t] = _row(thresholds.get(t, 0.0), acc["test"], acc["val"], None)
    return StrategyResult("base-head-only", [], rows)


def per_task(trainer: TorchTrainer, order: Sequence[str]) -> tuple[dict[str, AdapterState], dict[str, dict]]:
    """One adapter per task: {task: state}, {task: {"val", "test"}}."""
    states, acc = {}, {}
    for t in order:
        s = trainer.fuse(trainer.empty(), [t])
        states[t] = s
        acc[t] = {"val": trainer.validate(s, [t])[t], "test": trainer.validate(s, [t], "test")[t]}
    return states, acc


def measured_thresholds(single: Mapping[str, Mapping[str, float]], margin: float) -> dict[str, float]:
    return {t: max(0.0, round(a["val"] - margin, 4)) for t, a in single.items()}


def all_in_one(trainer: TorchTrainer, order: Sequence[str], thresholds: Mapping[str, float]) -> StrategyResult:
    s = trainer.fuse(trainer.empty(), list(order))
    val, test = trainer.validate(s, order), trainer.validate(s, order, "test")
    return StrategyResult(
        "all-in-one", [list(order)], {t: _row(thresholds[t], test[t], val[t], "all-in-one-0") for t in order}
    )


def fusion_order(
    trainer: TorchTrainer,
    order: Sequence[str],
    thresholds: Mapping[str, float],
    rule: str = "given",
    epochs: int = PROBE_EPOCHS,
    batches: int = PROBE_BATCHES,
    on_probe: Callable[[tuple[str, ...], Mapping[str, float]], None] | None = None,
) -> tuple[list[str], dict]:
    """The order to fuse `order`'s tasks in under `rule`, and what decided it (kept in the
    result as `fusion_order`): "given", `order` itself; "probed", `fusion.probed_order` on
    interference probes trained by `trainer` with a budget of `epochs` x `batches` batches per
    task (the probe matrix, its wall time and its trainings are in the record, with `pairs`,
    one entry per probed pair with each task's accuracy in it and drop from alone, and
    `planned`, the adapters the order was planned as with each task's predicted margin)."""
    if rule not in FUSION_ORDERS:
        raise ValueError(f"fusion order {rule!r}: expected one of {FUSION_ORDERS}")
    if rule == "given":
        return list(order), {"rule": "given", "order": list(order)}
    probe = trainer.with_config(dataclasses.replace(trainer.config, epochs=epochs, batches_per_epoch=batches))
    sources = [Source.single(t) for t in order]
    interference = probe_interference(sources, probe, on_probe)
    planned = planned_adapters(sources, thresholds, interference)
    chosen = [s.name for group in planned for s in group]
    return chosen, {
        "rule": "probed",
        "given": list(order),
        "order": chosen,
        "probe_budget": {"epochs": epochs, "batches_per_epoch": batches, "batch_size": trainer.config.batch_size},
        "probe": interference.to_json(),
        "pairs": interference.pairs(),
        "planned": [
            {
                "tasks": [s.name for s in group],
                "predicted_margins": {
                    t: round(m, 4) for t, m in predicted_margins(group, thresholds, interference).items()
                },
            }
            for group in planned
        ],
        "how": PROBED_RULE,
    }


def greedy(
    trainer: TorchTrainer,
    order: Sequence[str],
    thresholds: Mapping[str, float],
    prefix: str,
    on_step: Callable[[FusionStep], None] | None = None,
    order_record: dict | None = None,
) -> tuple[StrategyResult, FusionResult]:
    """The greedy fusion of `order`; its rows' test accuracies come from the same per-image test
    predictions the result keeps (`StrategyResult.predictions`, label names). `order_record`:
    how `order` was chosen (`fusion_order`'s record; default: given)."""
    res = greedy_fusion([Source.single(t) for t in order], thresholds, trainer, on_step=on_step)
    rows, predictions = {}, {}
    for a in res.adapters:
        head = [t for t in a.tasks if not trainer.is_text(t)]
        for t, pred in trainer.predict(a.state, head, "test").items():
            test = float((pred == trainer.targets(t, "test")).float().mean())
            rows[t] = _row(thresholds[t], test, a.accuracy[t], f"{prefix}-{a.index}")
            labels = trainer.tasks[t].labels
            predictions[t] = [labels[i] for i in pred.tolist()]
        for t in a.tasks:
            if t not in head:  # a text task: its greedy-decoded answers, scored by exact match
                predictions[t] = trainer.answers(a.state, t, "test")
                rows[t] = _row(
                    thresholds[t], trainer.score(t, predictions[t], "test"), a.accuracy[t], f"{prefix}-{a.index}"
                )
    steps = [
        {
            "source": s.source,
            "adapter": f"{prefix}-{s.adapter_index}",
            "decision": s.decision,
            "val_accuracy": {k: round(v, 4) for k, v in s.accuracy.items()},
            "failing": list(s.failing),
        }
        for s in res.steps
    ]
    return StrategyResult(
        "greedy-fusion",
        [a.tasks for a in res.adapters],
        {t: rows[t] for t in order},
        {"fusion_order": order_record or {"rule": "given", "order": list(order)}, "steps": steps},
        {t: predictions[t] for t in order},
    ), res


def text_budgets(trainer: TorchTrainer, order: Sequence[str]) -> dict[str, int]:
    """{text task: the max_new_tokens its answers were decoded (and must be served) with}."""
    return {t: trainer.max_new_tokens(t) for t in order if trainer.is_text(t)}


def bundles_of(
    res: FusionResult, tasks: Mapping[str, TaskData], rank: int, lora_alpha: float, prefix: str, base_model: str = ""
) -> list[Bundle]:
    labels = {t: d.labels for t, d in tasks.items()}
    return [export_bundle(f"{prefix}-{a.index}", a.state, labels, rank, lora_alpha, base_model) for a in res.adapters]


def task_description(prompt: str, made_by: str, max_new_tokens: int | None = None) -> str:
    """A registered task's description: the prompt it was trained with (and, for a text task, that
    it is answered in text, with the decoding budget its accuracy was measured with)."""
    if max_new_tokens is None:
        return f"prompt: {prompt} {made_by}"
    return f"prompt: {prompt} (text task: answer as TEXT, greedy, max_new_tokens {max_new_tokens}) {made_by}"


def register(
    address: str,
    bundles: Sequence[Bundle],
    result: StrategyResult,
    prompts: Mapping[str, str],
    api_key: str | None = None,
    admin_key: str | None = None,
    log: Log = print,
    max_new_tokens: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Uploads each bundle as a new version of `adapters/{bundle.name}` and creates one task per
    task it serves pointing at that version, with its threshold and measured test accuracy: a
    head task with its head, a text task (`max_new_tokens` names them) without one. The task's
    description carries the prompt it was trained with. Returns {task: version name}."""
    from valora.client import ValoraClient

    text = dict(max_new_tokens or {})
    versions: dict[str, str] = {}
    with ValoraClient(address, api_key=api_key, admin_key=admin_key) as client:
        for b in bundles:
            v = client.upload_adapter_version(b.name, b.data, b.config_json, heads=b.heads)
            log(f"registered {v.name} (sha256 {v.sha256[:12]}, heads {sorted(b.heads)})")
            for task in b.served_tasks:
                row = result.tasks[task]
                client.create_task(
                    task,
                    adapter=v.name,
                    head=task if task in b.heads else "",
                    description=task_description(
                        prompts[task],
                        "(generated by valora generator)",
                        text.get(task) if task not in b.heads else None,
                    ),
                    accuracy_threshold=row["threshold"],
                    measured_accuracy=row["accuracy"],
                )
                versions[task] = v.name
    return versions


HEAD_INPUT = "final-norm hidden state of the last prompt token (chat template, image then prompt)"


def manifest(
    base_model: str,
    tasks: Mapping[str, TaskData],
    order: Sequence[str],
    thresholds: Mapping[str, float],
    margin: float,
    rank: int,
    lora_alpha: float,
    config: TrainConfig,
    limit: int | None,
    bundles: Sequence[Bundle],
    result: StrategyResult,
    datasets: Mapping[str, str] | None = None,
    max_new_tokens: Mapping[str, int] | None = None,
) -> dict:
    """A generated directory's manifest.json (`generate` and the demo write it, `load_generated`
    reads it): settings, adapters, prompts, the greedy result, the split cap `limit` the splits
    were built with (so the same test images can be rebuilt), every test image's prediction
    (a text task's: its decoded answer), each task's kind, a text task's decoding budget
    (`max_new_tokens`) and, for a task from a user's dataset, where the dataset was (`datasets`,
    task -> path)."""
    return {
        "base_model": base_model,
        "rank": rank,
        "lora_alpha": lora_alpha,
        "epochs": config.epochs,
        "lr": config.lr,
        "head_lr": config.head_lr,
        "seed": config.seed,
        "order": list(order),
        "thresholds": dict(thresholds),
        "margin": margin,
        "limit": limit,
        "adapters": [
            {
                "name": b.name,
                "tasks": list(b.served_tasks),
                "heads": b.heads,
                "sha256": hashlib.sha256(b.data).hexdigest(),
            }
            for b in bundles
        ],
        "prompts": {t: tasks[t].prompt for t in order},
        "kinds": {t: tasks[t].kind for t in order},
        "max_new_tokens": {t: n for t, n in (max_new_tokens or {}).items() if t in order},
        "head_input": HEAD_INPUT,
        "greedy": result.to_json(),
        "test_predictions": result.predictions,
        "datasets": dict(datasets or {}),
    }


def load_generated(out_dir: Path) -> tuple[dict, list[Bundle], StrategyResult]:
    """What `generate` wrote to `out_dir`: (manifest, bundles, greedy result)."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    bundles = []
    for a in manifest["adapters"]:
        d = out_dir / a["name"]
        bundles.append(
            Bundle(
                a["name"],
                (d / "adapter_model.safetensors").read_bytes(),
                (d / "adapter_config.json").read_text(),
                json.loads((d / "heads.json").read_text()),
                tuple(a.get("tasks", ())),
            )
        )
    g = manifest["greedy"]
    result = StrategyResult(
        g["strategy"],
        [a["tasks"] for a in manifest["adapters"]],
        g["tasks"],
        predictions=manifest.get("test_predictions", {}),
    )
    return manifest, bundles, result


def write_results(
    results: Sequence[StrategyResult], path: Path | None = None, meta: dict | None = None, append: bool = False
) -> Path:
    """bench/results/generation-<date>.json: a list of {"strategy", "n_adapters", "tasks", "setup"};
    `append` adds to the list already in the file (several setups, e.g. margins, in one file)."""
    if path is None:
        path = Path("bench/results") / f"generation-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(path.read_text()) if append and path.exists() else []
    for r in results:
        d = r.to_json()
        if meta:
            d["setup"] = meta
        doc.append(d)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def held_out_task(task: str, limit: int | None = None, dataset: str | None = None) -> TaskData:
    """`task` as the generator built it with split cap `limit` (from `dataset` when it came from one)."""
    if dataset:
        from services.generator.user_datasets import load_dataset

        return load_dataset(dataset, limit=limit)[task]
    return build_task(task, limit=limit)


def held_out_images(
    task: str, limit: int | None = None, dataset: str | None = None, data: TaskData | None = None
) -> tuple[list[bytes], list[str]]:
    """The generator's test split of `task` built with split cap `limit` (the manifest's), as PNG
    bytes (lossless: a worker decodes the very pixels) with the true labels (a text task's:
    reference answers), in the order of the manifest's test predictions. A smaller `limit` gives
    the first images of the same split. `dataset`: the user's dataset the task came from (the
    manifest's `datasets`); its images are the resized ones the generator measured."""
    import io

    data = data or held_out_task(task, limit, dataset)
    pngs = []
    for img in data.images["test"]:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs, [data.labels[int(y)] for y in data.targets["test"]]


def binomial_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval for an accuracy measured as `correct` of `n` images: the model's
    accuracy on the task's whole distribution lies in it (95%), so a number measured on other
    images may differ by about its half-width (40 images at 0.54: ±0.15; 300: ±0.06)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def agreement(served: Sequence[str], truth: Sequence[str], offline: Sequence[str], text: bool = False) -> dict:
    """Served labels against the truth and the generator's predictions for the same images:
    {"n", "served_accuracy", "interval_95", "offline_accuracy" (same images), "agree"}. `text`:
    answers of a text task, compared by normalised exact match (answers.py)."""
    same = exact_match if text else (lambda a, b: a == b)
    n = len(served)
    correct = sum(same(s, y) for s, y in zip(served, truth))
    lo, hi = binomial_interval(correct, n)
    offline_correct = sum(same(o, y) for o, y in zip(offline, truth))
    return {
        "n": n,
        "served_accuracy": round(correct / n, 4) if n else 0.0,
        "interval_95": [round(lo, 4), round(hi, 4)],
        "offline_accuracy": round(offline_correct / n, 4) if n and offline else None,
        "agree": sum(same(s, o) for s, o in zip(served, offline)) if offline else None,
    }


def served_accuracy(
    address: str, manifest: dict, per_task: int | None = None, api_key: str | None = None
) -> dict[str, dict]:
    """Each served task on its test split (`per_task`: only the first that many images), through
    the gateway: a head task as task + LABEL output with the task's prompt; a text task as task +
    TEXT output (greedy, the manifest's max_new_tokens) with each image's own question.
    {task: `agreement`'s row}."""
    from services.common.names import task_name
    from valora.client import ValoraClient

    out = {}
    with ValoraClient(address, api_key=api_key) as client:
        for task in manifest["order"]:
            data = held_out_task(task, manifest.get("limit"), (manifest.get("datasets") or {}).get(task))
            pngs, truth = held_out_images(task, data=data)
            pngs, truth = pngs[: per_task or None], truth[: per_task or None]
            if data.kind == TEXT:
                budget = (manifest.get("max_new_tokens") or {}).get(task, 16)
                served = [
                    client.infer(data.question("test", i), [png], task=task_name(task), max_new_tokens=budget).text
                    for i, png in enumerate(pngs)
                ]
            else:
                served = [
                    client.infer(manifest["prompts"][task], [png], task=task_name(task), label=True).label
                    for png in pngs
                ]
            out[task] = agreement(
                served, truth, manifest.get("test_predictions", {}).get(task, [])[: len(served)], text=data.kind == TEXT
            )
    return out
