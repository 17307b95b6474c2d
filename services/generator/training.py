"""Training LoRA adapters with vision task heads on cached image features (the real `Trainer`).

`AdapterState` is one adapter being generated: LoRA A/B per (layer, module) and one linear head
per task. `TorchTrainer.fuse(state, tasks)` continues training a copy of `state` on the union of
the tasks' train splits (each batch from one task, through that task's head, cross-entropy), the
LoRA weights and all heads jointly; the input state is never modified, so rolling back is
keeping the old object. `validate` measures accuracy per task on the val (or test) split.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from services.generator.datasets import TaskData, shifted_copies
from services.generator.model import BaseModel

LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AdapterState:
    """LoRA weights + heads {task: (weight (labels, hidden), bias (labels,))} of one adapter."""

    lora: LoraWeights
    heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per-task (mean, std) of the hidden state when the head was created: training runs the head
    # on standardised features (well-conditioned); `heads` always holds the folded raw-space head.
    norms: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.heads)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 4
    batch_size: int = 16
    lr: float = 5e-3  # LoRA A/B
    head_lr: float = 3e-3
    weight_decay: float = 0.0
    scale_lr_with_tasks: bool = True  # LoRA lr = lr / sqrt(number of tasks trained together)
    clip_norm: float = 1.0  # max gradient norm of the LoRA weights per step (0: no clipping)
    seed: int = 0
    head_only_steps: int = 400  # full-batch steps for the frozen-base (no adapter) baseline
    augment: int = 0  # extra shifted copies of each train split (datasets.shifted_copies)


Progress = Callable[[str, int, int], None]  # (what is training, done steps, total steps)


def _task_seed(seed: int, tasks: Sequence[str]) -> int:
    return (seed * 1_000_003 + zlib.crc32("|".join(tasks).encode())) % (2**31)


class TorchTrainer:
    """The `fusion.Trainer` over a real base model; image features are encoded once per task."""

    def __init__(self, base: BaseModel, tasks: dict[str, TaskData], config: TrainConfig = TrainConfig(),
                 progress: Progress | None = None):
        self.base, self.tasks, self.config = base, tasks, config
        self.progress = progress
        self._features: dict[tuple[str, str], torch.Tensor] = {}
        self._grids: dict[str, tuple[int, int, int]] = {}
        self._fresh = 0

    # -- data --------------------------------------------------------------------------------

    def features(self, task: str, split: str) -> torch.Tensor:
        key = (task, split)
        if key not in self._features:
            feats, grid = self.base.encode_images(self.tasks[task].images[split])
            self._features[key] = feats
            self._grids[task] = grid
        return self._features[key]

    def targets(self, task: str, split: str) -> torch.Tensor:
        return torch.as_tensor(self.tasks[task].targets[split], dtype=torch.long)

    def train_set(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Train features and targets, with `config.augment` shifted copies appended."""
        key = (task, f"train+{self.config.augment}")
        if key not in self._features:
            feats = [self.features(task, "train")]
            for copy in shifted_copies(self.tasks[task].images["train"], self.config.augment,
                                       seed=_task_seed(self.config.seed, (task, "augment"))):
                feats.append(self.base.encode_images(copy)[0])
            self._features[key] = torch.cat(feats)
        y = self.targets(task, "train")
        return self._features[key], y.repeat(1 + self.config.augment)

    def template(self, task: str):
        self.features(task, "train")
        return self.base.template(self.tasks[task].prompt, self._grids[task])

    # -- the Trainer protocol ------------------------------------------------------------------

    def empty(self) -> AdapterState:
        """A new adapter: PEFT-initialised LoRA (B = 0, so it starts as the base model), no heads."""
        self._fresh += 1
        return AdapterState(lora=self.base.fresh_lora(self.config.seed * 7919 + self._fresh))

    def fuse(self, state: AdapterState, tasks: Sequence[str]) -> AdapterState:
        """A copy of `state` trained on the union of `tasks` (a task new to it starts from a linear probe)."""
        cfg = self.config
        tasks = tuple(tasks)
        seed = _task_seed(cfg.seed, tasks)
        self.base.set_lora_enabled(True)
        self.base.load_lora(state.lora)
        heads = nn.ModuleDict()
        norms = dict(state.norms)
        for t in tasks:
            head = nn.Linear(self.base.hidden_size, len(self.tasks[t].labels))
            # A task new to this adapter starts from a linear probe on the adapter's current
            # features (LP-FT); the LoRA weights and every head then train jointly.
            if t in state.heads:
                w, b = state.heads[t]
            else:
                w, b, norms[t] = self.fit_head(t)
            mu, sd = norms[t]
            with torch.no_grad():  # raw-space head -> standardised-space head
                head.weight.copy_(w * sd)
                head.bias.copy_(b + w @ mu)
            heads[t] = head
        rng = np.random.default_rng(seed)
        plan: list[tuple[str, np.ndarray]] = []
        for _ in range(cfg.epochs):
            epoch = []
            for t in tasks:
                n = len(self.tasks[t].targets["train"]) * (1 + cfg.augment)
                perm = rng.permutation(n)
                epoch.extend((t, perm[i:i + cfg.batch_size]) for i in range(0, n, cfg.batch_size))
            order = rng.permutation(len(epoch))
            plan.extend(epoch[i] for i in order)
        # Training on n tasks is n times longer; a fixed LoRA learning rate that suits one task
        # diverged on seven (all-in-one collapsed to near chance), so it is scaled by 1/sqrt(n).
        lora_lr = cfg.lr / math.sqrt(len(tasks)) if cfg.scale_lr_with_tasks else cfg.lr
        opt = torch.optim.AdamW([
            {"params": self.base.lora_parameters(), "lr": lora_lr},
            {"params": list(heads.parameters()), "lr": cfg.head_lr},
        ], weight_decay=cfg.weight_decay)
        total = len(plan)
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
        templates = {t: self.template(t) for t in tasks}
        train = {t: self.train_set(t) for t in tasks}
        feats = {t: f for t, (f, _) in train.items()}
        ys = {t: y for t, (_, y) in train.items()}
        for step, (t, idx) in enumerate(plan):
            idx_t = torch.as_tensor(idx)
            h = (self.base.head_features(templates[t], feats[t][idx_t]) - norms[t][0]) / norms[t][1]
            loss = F.cross_entropy(heads[t](h), ys[t][idx_t])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_norm:
                torch.nn.utils.clip_grad_norm_(self.base.lora_parameters(), cfg.clip_norm)
            opt.step()
            sched.step()
            if self.progress is not None:
                self.progress("+".join(tasks), step + 1, total)
        new_heads = dict(state.heads)
        with torch.no_grad():
            for t in tasks:
                mu, sd = norms[t]
                w = heads[t].weight / sd
                new_heads[t] = (w.clone(), (heads[t].bias - w @ mu).clone())
        return AdapterState(lora=self.base.read_lora(), heads=new_heads, norms=norms)

    def validate(self, state: AdapterState, tasks: Sequence[str], split: str = "val") -> dict[str, float]:
        """Accuracy of each task's head with the adapter applied, on `split`."""
        return {t: float((pred == self.targets(t, split)).float().mean())
                for t, pred in self.predict(state, tasks, split).items()}

    def predict(self, state: AdapterState, tasks: Sequence[str], split: str = "test") -> dict[str, torch.Tensor]:
        """Each task's predicted label index per image of `split` (in split order), with the
        adapter applied: what a worker must answer for the same images (the served = offline
        check compares its labels with these, image by image)."""
        self.base.set_lora_enabled(True)
        self.base.load_lora(state.lora)
        return {t: self._predict(t, split, state.heads[t]) for t in tasks}

    # -- evaluation & the no-adapter baseline ---------------------------------------------------

    @torch.no_grad()
    def _hidden(self, task: str, split: str) -> torch.Tensor:
        return self._hidden_of(task, self.features(task, split))

    @torch.no_grad()
    def _hidden_of(self, task: str, feats: torch.Tensor, batch: int = 256) -> torch.Tensor:
        tpl = self.template(task)
        return torch.cat([self.base.head_features(tpl, feats[i:i + batch]) for i in range(0, len(feats), batch)])

    @torch.no_grad()
    def _predict(self, task: str, split: str, head: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (self._hidden(task, split) @ head[0].t() + head[1]).argmax(-1)

    def _accuracy(self, task: str, split: str, head: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float((self._predict(task, split, head) == self.targets(task, split)).float().mean())

    def logits(self, state: AdapterState, task: str, split: str) -> torch.Tensor:
        self.base.set_lora_enabled(True)
        self.base.load_lora(state.lora)
        w, b = state.heads[task]
        return self._hidden(task, split) @ w.t() + b

    def fit_head(self, task: str):
        """A linear probe: a head trained alone (full batch, standardised inputs, folded back)
        on the last-token hidden state of the model as currently loaded.
        Returns (weight, bias, (mean, std)): the raw-space head and the standardisation used."""
        cfg = self.config
        feats, y = self.train_set(task)
        x = self._hidden_of(task, feats)
        mu, sd = x.mean(0), x.std(0) + 1e-6  # standardise for the optimiser, fold back after
        xs = (x - mu) / sd
        torch.manual_seed(_task_seed(cfg.seed, (task, "head")))
        head = nn.Linear(x.shape[1], len(self.tasks[task].labels))
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(cfg.head_only_steps):
            loss = F.cross_entropy(head(xs), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            w = head.weight / sd
            b = head.bias - (w * mu).sum(-1)
        return w.detach().clone(), b.detach().clone(), (mu.detach().clone(), sd.detach().clone())

    def head_only(self, task: str) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float]]:
        """The "no adapter" baseline: a linear head trained alone on the frozen base model's
        last-token hidden state. Returns (head, {"val": acc, "test": acc})."""
        self.base.set_lora_enabled(False)
        try:
            w, b, _ = self.fit_head(task)
            folded = (w, b)
            acc = {s: self._accuracy(task, s, folded) for s in ("val", "test")}
        finally:
            self.base.set_lora_enabled(True)
        return folded, acc
