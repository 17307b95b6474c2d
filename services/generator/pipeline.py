"""End-to-end generation: measure, choose thresholds, fuse greedily, export, register, compare.

Strategies compared (all on the same base model, data splits and training settings):

    base-head-only    no adapter: a linear head per task on the frozen base model
    adapter-per-task  one LoRA adapter (+ head) per task
    all-in-one        one adapter trained on every task at once
    greedy-fusion     VaLoRA's accuracy-aware greedy fusion (fusion.greedy_fusion)

Thresholds, unless given, are measured: each task's single-adapter *validation* accuracy minus
`margin`. Fusion decides on validation accuracy; reported accuracies are on the test split.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from services.generator.bundle import Bundle, export_bundle
from services.generator.datasets import TaskData
from services.generator.fusion import FusionResult, FusionStep, Source, greedy_fusion
from services.generator.training import AdapterState, TorchTrainer

Log = Callable[[str], None]


@dataclass
class StrategyResult:
    strategy: str
    adapters: list[list[str]]  # tasks per adapter
    tasks: dict[str, dict]  # task -> {"threshold", "accuracy", "val_accuracy", "adapter"}
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "n_adapters": len(self.adapters), "tasks": self.tasks, **self.extra}

    def meets_thresholds(self) -> bool:
        return all(v["accuracy"] >= v["threshold"] for v in self.tasks.values())


def _row(threshold: float, test: float, val: float, adapter: str | None) -> dict:
    return {"threshold": round(threshold, 4), "accuracy": round(test, 4), "val_accuracy": round(val, 4),
            "adapter": adapter}


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
    return StrategyResult("all-in-one", [list(order)],
                          {t: _row(thresholds[t], test[t], val[t], "all-in-one-0") for t in order})


def greedy(trainer: TorchTrainer, order: Sequence[str], thresholds: Mapping[str, float], prefix: str,
           on_step: Callable[[FusionStep], None] | None = None) -> tuple[StrategyResult, FusionResult]:
    res = greedy_fusion([Source.single(t) for t in order], thresholds, trainer, on_step=on_step)
    rows = {}
    for a in res.adapters:
        test = trainer.validate(a.state, a.tasks, "test")
        for t in a.tasks:
            rows[t] = _row(thresholds[t], test[t], a.accuracy[t], f"{prefix}-{a.index}")
    steps = [{"source": s.source, "adapter": f"{prefix}-{s.adapter_index}", "decision": s.decision,
              "val_accuracy": {k: round(v, 4) for k, v in s.accuracy.items()}, "failing": list(s.failing)}
             for s in res.steps]
    return StrategyResult("greedy-fusion", [a.tasks for a in res.adapters], {t: rows[t] for t in order},
                          {"steps": steps}), res


def bundles_of(res: FusionResult, tasks: Mapping[str, TaskData], rank: int, lora_alpha: float, prefix: str,
               base_model: str = "") -> list[Bundle]:
    labels = {t: d.labels for t, d in tasks.items()}
    return [export_bundle(f"{prefix}-{a.index}", a.state, labels, rank, lora_alpha, base_model)
            for a in res.adapters]


def register(address: str, bundles: Sequence[Bundle], result: StrategyResult, prompts: Mapping[str, str],
             api_key: str | None = None, admin_key: str | None = None, log: Log = print) -> dict[str, str]:
    """Uploads each bundle as a new version of `adapters/{bundle.name}` and creates one task per
    head pointing at that version, with its threshold and measured test accuracy (the task's
    description carries the prompt the head was trained with). Returns {task: version name}."""
    from valora.client import ValoraClient

    versions: dict[str, str] = {}
    with ValoraClient(address, api_key=api_key, admin_key=admin_key) as client:
        for b in bundles:
            v = client.upload_adapter_version(b.name, b.data, b.config_json, heads=b.heads)
            log(f"registered {v.name} (sha256 {v.sha256[:12]}, heads {sorted(b.heads)})")
            for task in b.heads:
                row = result.tasks[task]
                client.create_task(task, adapter=v.name, head=task,
                                   description=f"prompt: {prompts[task]} (generated by valora generator)",
                                   accuracy_threshold=row["threshold"], measured_accuracy=row["accuracy"])
                versions[task] = v.name
    return versions


def load_generated(out_dir: Path) -> tuple[dict, list[Bundle], StrategyResult]:
    """What `generate` wrote to `out_dir`: (manifest, bundles, greedy result)."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    bundles = []
    for a in manifest["adapters"]:
        d = out_dir / a["name"]
        bundles.append(Bundle(a["name"], (d / "adapter_model.safetensors").read_bytes(),
                              (d / "adapter_config.json").read_text(), json.loads((d / "heads.json").read_text())))
    g = manifest["greedy"]
    result = StrategyResult(g["strategy"], [a["tasks"] for a in manifest["adapters"]], g["tasks"])
    return manifest, bundles, result


def write_results(results: Sequence[StrategyResult], path: Path | None = None, meta: dict | None = None,
                  append: bool = False) -> Path:
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


def served_accuracy(address: str, manifest: dict, per_task: int,
                    api_key: str | None = None) -> dict[str, tuple[float, int]]:
    """Accuracy of the served tasks on the first `per_task` test images of each (through the
    gateway: task + LABEL output, the task's prompt). {task: (accuracy, n)}."""
    import io

    from services.common.names import task_name
    from services.generator.datasets import build_task
    from valora.client import ValoraClient

    out = {}
    with ValoraClient(address, api_key=api_key) as client:
        for task in manifest["order"]:
            data = build_task(task, limit=per_task)
            correct = 0
            for img, y in zip(data.images["test"], data.targets["test"]):
                buf = io.BytesIO()
                img.save(buf, format="PNG")
                r = client.infer(manifest["prompts"][task], [buf.getvalue()], task=task_name(task), label=True)
                correct += int(r.label == data.labels[int(y)])
            out[task] = (correct / len(data.targets["test"]), len(data.targets["test"]))
    return out
