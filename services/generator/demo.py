"""The adapters `valora demo` serves: a briefly pretrained base and greedy-fused adapters on a
small, fast task subset, generated once and cached under `$VALORA_HOME`.

    ensure_base(tiny, home, steps, seed, threads) -> <home>/models/demo-base-s{steps}-seed{seed}-t{threads}
    ensure_adapters(home, base, settings)         -> <home>/demo/gen-{settings.key()} (bundles + manifest.json)

The cache directory is keyed by every setting that changes the result (tasks and their order,
pretraining steps, epochs, split cap, rank, margin, seed, prefix, and torch's CPU thread count:
torch splits CPU reductions by thread, so the trained weights depend on it; both functions set
that count themselves, so a key always says how its directory was made); a directory is only used once
its manifest.json exists (written last, into a temporary directory that is then renamed), so an
interrupted run regenerates. The manifest has `generate`'s layout (pipeline.manifest, with every
test image's prediction; `python -m services.generator check --out <dir>` works on it) plus a
`demo` block with the settings, timings and the single-task accuracies the thresholds were
measured from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

Log = Callable[[str], None]

# Bumped when what a cached directory holds would change for the same settings (2: the manifest
# keeps every test image's prediction and the split cap, for the demo's per-image check).
CACHE_FORMAT = 2
# Fast tasks: digit identity (what the base was pretrained on), parity, rotated digits (new to the
# base) and counting squares (synthetic; new to the base).
DEMO_TASKS = ("digit", "parity", "digit-rot90", "count")


@dataclass(frozen=True)
class DemoSettings:
    tasks: tuple[str, ...] = DEMO_TASKS
    pretrain_steps: int = 300
    epochs: int = 2
    limit: int | None = 400  # cap on each split's size (train/val/test); None: full splits
    rank: int = 8
    margin: float = 0.03  # threshold = single-task val accuracy - margin
    seed: int = 0
    prefix: str = "demo-fused"
    threads: int = 2  # torch CPU threads (`valora demo --threads`); ensure_adapters sets it

    @property
    def lora_alpha(self) -> float:
        return 2.0 * self.rank

    def key(self) -> str:
        doc = {"format": CACHE_FORMAT, **asdict(self), "tasks": list(self.tasks)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


class _ReuseSingles:
    """The trainer, except that a fresh adapter trained on one task alone is the one `per_task`
    already trained for its threshold (the same training; saves one run per new adapter)."""

    def __init__(self, trainer, singles: dict):
        self.trainer, self.singles = trainer, singles

    def __getattr__(self, name: str):  # everything but `fuse` is the trainer's own
        return getattr(self.trainer, name)

    def fuse(self, state, tasks):
        if not state.heads and len(tasks) == 1 and tasks[0] in self.singles:
            return self.singles[tasks[0]]
        return self.trainer.fuse(state, tasks)


def base_dir(home: Path, steps: int, seed: int, threads: int = 2) -> Path:
    return Path(home) / "models" / f"demo-base-s{steps}-seed{seed}-t{threads}"


def ensure_base(
    tiny_model: Path,
    home: Path,
    steps: int = 300,
    seed: int = 0,
    log: Log = print,
    progress: Callable[[int, int, float], None] | None = None,
    threads: int = 2,
) -> tuple[Path, dict, bool]:
    """The briefly pretrained base (pretrain.py) with `threads` torch CPU threads, built once per
    (steps, seed, threads). Returns (path, provenance, cached)."""
    from services.generator.pretrain import PROVENANCE_FILE, pretrain

    out = base_dir(home, steps, seed, threads)
    record = out / PROVENANCE_FILE
    if record.exists() and (out / "config.json").exists():
        return out, json.loads(record.read_text()), True
    import torch

    torch.set_num_threads(threads)
    log(f"pretraining the demo base ({steps} steps on the digit train split) -> {out}")
    pretrain(tiny_model, out, steps=steps, seed=seed, progress=progress)
    return out, json.loads(record.read_text()), False


def ensure_adapters(
    home: Path,
    base: Path,
    settings: DemoSettings = DemoSettings(),
    log: Log = print,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Path, dict, bool]:
    """Greedy-fused adapters for `settings.tasks` on `base`, generated once per settings key.
    Returns (directory, manifest, cached)."""
    out = Path(home) / "demo" / f"gen-{settings.key()}"
    if (out / "manifest.json").exists():
        return out, json.loads((out / "manifest.json").read_text()), True

    import torch

    from services.generator import pipeline
    from services.generator.datasets import TASKS, build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    unknown = [t for t in settings.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {sorted(TASKS)}")
    names = list(settings.tasks)
    started = time.time()
    torch.set_num_threads(settings.threads)
    tasks = build_tasks(names, limit=settings.limit)
    model = BaseModel.load(base, rank=settings.rank, lora_alpha=settings.lora_alpha)
    cfg = TrainConfig(epochs=settings.epochs, seed=settings.seed)
    trainer = TorchTrainer(model, tasks, cfg, progress=progress)
    log(f"measuring thresholds: one adapter per task ({', '.join(names)})")
    singles, single = pipeline.per_task(trainer, names)
    thresholds = pipeline.measured_thresholds(single, settings.margin)

    def on_step(step) -> None:
        acc = ", ".join(f"{k} {v:.3f}" for k, v in step.accuracy.items())
        log(
            f"  fuse {step.source}: {step.decision} (adapter {settings.prefix}-{step.adapter_index}; val {acc})"
            + (f" failing {list(step.failing)}" if step.failing else "")
        )

    log("greedy fusion (accuracy-aware, with rollback)")
    greedy_result, fusion = pipeline.greedy(
        _ReuseSingles(trainer, singles), names, thresholds, settings.prefix, on_step=on_step
    )
    bundles = pipeline.bundles_of(
        fusion, tasks, settings.rank, settings.lora_alpha, settings.prefix, base_model=str(base)
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for b in bundles:
        b.write(tmp)
    manifest = {
        **pipeline.manifest(
            str(base),
            tasks,
            names,
            thresholds,
            settings.margin,
            settings.rank,
            settings.lora_alpha,
            cfg,
            settings.limit,
            bundles,
            greedy_result,
        ),
        "demo": {
            "key": settings.key(),
            "settings": {**asdict(settings), "tasks": names},
            "single_task_accuracy": {t: {k: round(v, 4) for k, v in a.items()} for t, a in single.items()},
            "split_sizes": {t: {s: tasks[t].size(s) for s in ("train", "val", "test")} for t in names},
            "generate_s": round(time.time() - started, 1),
        },
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, manifest, False
