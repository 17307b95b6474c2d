"""Training LoRA adapters with vision task heads on cached image features (the real `Trainer`).

`AdapterState` is one adapter being generated: LoRA A/B per (layer, module) and one linear head
per head task. `TorchTrainer.fuse(state, tasks)` continues training a copy of `state` on the union
of the tasks' train splits (each batch from one task), the LoRA weights and all heads jointly; the
input state is never modified, so rolling back is keeping the old object. `validate` measures
accuracy per task on the val (or test) split.

A head task's batch is cross-entropy of its head over the last prompt token's hidden state. A
text task (datasets.TEXT, VQA-style) has no head: its batch (examples asking one question) is
the language model's own cross-entropy on the answer tokens (the reference answer then
<|im_end|>, teacher-forced; the prompt's tokens carry no loss), through the LoRA projections and
the frozen LM head. It is scored by normalised exact match (answers.py) of the greedy-decoded
answer (`max_new_tokens`: the longest reference answer's tokens + 2, capped), which is what a
worker answers a plain TEXT request with that adapter at temperature 0.
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

from services.generator.answers import exact_match_accuracy
from services.generator.datasets import TEXT, TaskData, shifted_copies
from services.generator.model import BaseModel

LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AdapterState:
    """LoRA weights + heads {task: (weight (labels, hidden), bias (labels,))} of one adapter,
    and the text tasks (no head) it was trained on."""

    lora: LoraWeights
    heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per-task (mean, std) of the hidden state when the head was created: training runs the head
    # on standardised features (well-conditioned); `heads` always holds the folded raw-space head.
    norms: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    text: tuple[str, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.heads) + self.text


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
    augment: int = 0  # extra shifted copies of each head task's train split (datasets.shifted_copies)
    max_new_tokens: int = 16  # cap on a text task's greedy decoding (tokens, the stop token included)
    # Cap on each task's batches per epoch, drawn at random from its whole train split (0: every
    # batch). Interference probes (fusion.probe_interference) train with a few.
    batches_per_epoch: int = 0


Progress = Callable[[str, int, int], None]  # (what is training, done steps, total steps)


def _task_seed(seed: int, tasks: Sequence[str]) -> int:
    return (seed * 1_000_003 + zlib.crc32("|".join(tasks).encode())) % (2**31)


class TorchTrainer:
    """The `fusion.Trainer` over a real base model; image features are encoded once per task."""

    def __init__(
        self,
        base: BaseModel,
        tasks: dict[str, TaskData],
        config: TrainConfig = TrainConfig(),
        progress: Progress | None = None,
    ):
        self.base, self.tasks, self.config = base, tasks, config
        self.progress = progress
        self._features: dict[tuple[str, str], torch.Tensor] = {}
        self._grids: dict[str, tuple[int, int, int]] = {}
        self._answer_ids: dict[str, list[list[int]]] = {}
        # A linear probe fitted on a fresh adapter (B = 0: the base model's features) is the same
        # for every fresh adapter: fitted once per (task, what it depends on).
        self._first_heads: dict[tuple, tuple] = {}
        self._fresh = 0

    def with_config(self, config: TrainConfig) -> "TorchTrainer":
        """A trainer with other settings over the same base, tasks and cached features (an
        interference probe's smaller budget)."""
        other = TorchTrainer(self.base, self.tasks, config, self.progress)
        other._features, other._grids, other._answer_ids = self._features, self._grids, self._answer_ids
        other._first_heads = self._first_heads
        return other

    # -- data --------------------------------------------------------------------------------

    def features(self, task: str, split: str) -> torch.Tensor:
        key = (task, split)
        if key not in self._features:
            feats, grid = self.base.encode_images(self.tasks[task].images[split])
            self._features[key] = feats
            self._grids[task] = grid
        return self._features[key]

    def targets(self, task: str, split: str) -> torch.Tensor:
        return torch.as_tensor(self.tasks[task].targets[split], dtype=torch.long, device=self.base.device)

    def train_set(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Train features and targets, with `config.augment` shifted copies appended."""
        key = (task, f"train+{self.config.augment}")
        if key not in self._features:
            feats = [self.features(task, "train")]
            for copy in shifted_copies(
                self.tasks[task].images["train"],
                self.config.augment,
                seed=_task_seed(self.config.seed, (task, "augment")),
            ):
                feats.append(self.base.encode_images(copy)[0])
            self._features[key] = torch.cat(feats)
        y = self.targets(task, "train")
        return self._features[key], y.repeat(1 + self.config.augment)

    def template(self, task: str, question: str | None = None):
        self.features(task, "train")
        return self.base.template(self.tasks[task].prompt if question is None else question, self._grids[task])

    def is_text(self, task: str) -> bool:
        return self.tasks[task].kind == TEXT

    def answer_ids(self, task: str) -> list[list[int]]:
        """Each reference answer (label index order) as the tokens a text task is trained to
        generate: the answer's tokens then <|im_end|>."""
        if task not in self._answer_ids:
            end = self.base.tokenizer.convert_tokens_to_ids("<|im_end|>")
            tok = self.base.tokenizer
            self._answer_ids[task] = [
                tok(a, add_special_tokens=False)["input_ids"] + [end] for a in self.tasks[task].labels
            ]
        return self._answer_ids[task]

    def max_new_tokens(self, task: str) -> int:
        """A text task's decoding budget: its longest answer's tokens (with the stop) + 2, capped."""
        return min(self.config.max_new_tokens, max(len(a) for a in self.answer_ids(task)) + 2)

    def question_groups(self, task: str, split: str) -> dict[str, np.ndarray]:
        """{question: indices of the examples of `split` asking it} (one group without questions)."""
        data = self.tasks[task]
        if not data.questions:
            return {data.prompt: np.arange(data.size(split))}
        groups: dict[str, list[int]] = {}
        for i, q in enumerate(data.questions[split]):
            groups.setdefault(q, []).append(i)
        return {q: np.asarray(idx) for q, idx in groups.items()}

    def text_loss(self, task: str, question: str, idx: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the answer tokens (prompt tokens carry none) of a batch of
        train examples that ask `question`."""
        feats = self.features(task, "train")[idx]
        seqs = [self.answer_ids(task)[y] for y in self.targets(task, "train")[idx].tolist()]
        width = max(len(a) for a in seqs)
        pad = seqs[0][-1]  # <|im_end|>: padding after the answer, masked out of the loss
        inputs = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, a in enumerate(seqs):
            inputs[i, : len(a)] = torch.tensor(a)
            labels[i, : len(a)] = torch.tensor(a)
        dev = self.base.device
        logits = self.base.answer_logits(self.template(task, question), feats, inputs.to(dev))
        labels = labels.to(dev)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

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
        text = [t for t in tasks if self.is_text(t)]
        for t in tasks:
            if t in text:
                continue
            head = nn.Linear(self.base.hidden_size, len(self.tasks[t].labels)).to(self.base.device)
            # A task new to this adapter starts from a linear probe on the adapter's current
            # features (LP-FT); the LoRA weights and every head then train jointly.
            if t in state.heads:
                w, b = state.heads[t]
            elif not state.tasks:  # a fresh adapter: the base model's features
                key = (t, cfg.seed, cfg.head_only_steps, cfg.augment)
                if key not in self._first_heads:
                    self._first_heads[key] = self.fit_head(t)
                w, b, norms[t] = self._first_heads[key]
            else:
                w, b, norms[t] = self.fit_head(t)
            mu, sd = norms[t]
            with torch.no_grad():  # raw-space head -> standardised-space head
                head.weight.copy_(w * sd)
                head.bias.copy_(b + w @ mu)
            heads[t] = head
        rng = np.random.default_rng(seed)
        plan: list[tuple[str, np.ndarray, str | None]] = []
        for _ in range(cfg.epochs):
            epoch = []
            for t in tasks:
                batches = []
                if t in text:  # a text task's batch asks one question (one prompt template)
                    for q, group in self.question_groups(t, "train").items():
                        perm = group[rng.permutation(len(group))]
                        bs = cfg.batch_size
                        batches.extend((t, perm[i : i + bs], q) for i in range(0, len(perm), bs))
                else:
                    n = len(self.tasks[t].targets["train"]) * (1 + cfg.augment)
                    perm = rng.permutation(n)
                    batches.extend((t, perm[i : i + cfg.batch_size], None) for i in range(0, n, cfg.batch_size))
                if 0 < cfg.batches_per_epoch < len(batches):
                    keep = np.sort(rng.choice(len(batches), cfg.batches_per_epoch, replace=False))
                    batches = [batches[i] for i in keep]
                epoch.extend(batches)
            order = rng.permutation(len(epoch))
            plan.extend(epoch[i] for i in order)
        # Training on n tasks is n times longer; a fixed LoRA learning rate that suits one task
        # diverged on seven (all-in-one collapsed to near chance), so it is scaled by 1/sqrt(n).
        lora_lr = cfg.lr / math.sqrt(len(tasks)) if cfg.scale_lr_with_tasks else cfg.lr
        groups = [{"params": self.base.lora_parameters(), "lr": lora_lr}]
        if len(heads):
            groups.append({"params": list(heads.parameters()), "lr": cfg.head_lr})
        opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        total = len(plan)
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))),
        )
        dev = self.base.device
        on_device = {t: (mu.to(dev), sd.to(dev)) for t, (mu, sd) in norms.items() if t in heads}
        templates = {t: self.template(t) for t in tasks}
        train = {t: self.train_set(t) for t in tasks if t not in text}
        feats = {t: f for t, (f, _) in train.items()}
        ys = {t: y for t, (_, y) in train.items()}
        for step, (t, idx, question) in enumerate(plan):
            idx_t = torch.as_tensor(idx)
            if question is not None:
                loss = self.text_loss(t, question, idx_t)
            else:
                h = (self.base.head_features(templates[t], feats[t][idx_t]) - on_device[t][0]) / on_device[t][1]
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
            for t in heads:  # kept on the host, as the LoRA weights
                mu, sd = on_device[t]
                w = heads[t].weight / sd
                new_heads[t] = (w.cpu(), (heads[t].bias - w @ mu).cpu())
        held_text = state.text + tuple(t for t in text if t not in state.text)
        return AdapterState(lora=self.base.read_lora(), heads=new_heads, norms=norms, text=held_text)

    def validate(self, state: AdapterState, tasks: Sequence[str], split: str = "val") -> dict[str, float]:
        """Accuracy of each task with the adapter applied, on `split`: a head task's label
        accuracy, a text task's normalised exact match of its greedy-decoded answers."""
        head = self.predict(state, [t for t in tasks if not self.is_text(t)], split)
        return {
            t: float((head[t] == self.targets(t, split)).float().mean())
            if t in head
            else self.score(t, self.answers(state, t, split), split)
            for t in tasks
        }

    def score(self, task: str, predictions: Sequence[str], split: str) -> float:
        """The accuracy of `predictions` (one per example of `split`, `predictions`' format)."""
        truth = self.tasks[task].answers(split)
        if self.is_text(task):
            return exact_match_accuracy(predictions, truth)
        return sum(p == y for p, y in zip(predictions, truth)) / len(truth) if truth else 0.0

    def predict(self, state: AdapterState, tasks: Sequence[str], split: str = "test") -> dict[str, torch.Tensor]:
        """Each head task's predicted label index per image of `split` (in split order), with
        the adapter applied."""
        self.base.set_lora_enabled(True)
        self.base.load_lora(state.lora)
        return {t: self._predict(t, split, state.heads[t]) for t in tasks}

    def answers(self, state: AdapterState | None, task: str, split: str = "test", batch: int = 256) -> list[str]:
        """A text task's greedy-decoded answer per image of `split` with the adapter applied
        (`state` None: the base model, no adapter)."""
        self.base.set_lora_enabled(state is not None)
        try:
            if state is not None:
                self.base.load_lora(state.lora)
            feats = self.features(task, split)
            out: list[str] = [""] * len(feats)
            for q, group in self.question_groups(task, split).items():
                tpl = self.template(task, q)
                for i in range(0, len(group), batch):
                    chunk = group[i : i + batch]
                    for j, text in zip(
                        chunk, self.base.greedy_answers(tpl, feats[torch.as_tensor(chunk)], self.max_new_tokens(task))
                    ):
                        out[int(j)] = text
            return out
        finally:
            self.base.set_lora_enabled(True)

    # -- evaluation & the no-adapter baseline ---------------------------------------------------

    @torch.no_grad()
    def _hidden(self, task: str, split: str) -> torch.Tensor:
        return self._hidden_of(task, self.features(task, split))

    @torch.no_grad()
    def _hidden_of(self, task: str, feats: torch.Tensor, batch: int = 256) -> torch.Tensor:
        tpl = self.template(task)
        return torch.cat([self.base.head_features(tpl, feats[i : i + batch]) for i in range(0, len(feats), batch)])

    @torch.no_grad()
    def _predict(self, task: str, split: str, head: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self._hidden(task, split)
        return (h @ head[0].to(h.device).t() + head[1].to(h.device)).argmax(-1)

    def _accuracy(self, task: str, split: str, head: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float((self._predict(task, split, head) == self.targets(task, split)).float().mean())

    def logits(self, state: AdapterState, task: str, split: str) -> torch.Tensor:
        self.base.set_lora_enabled(True)
        self.base.load_lora(state.lora)
        w, b = state.heads[task]
        h = self._hidden(task, split)
        return h @ w.to(h.device).t() + b.to(h.device)

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
        head = nn.Linear(x.shape[1], len(self.tasks[task].labels)).to(x.device)
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(cfg.head_only_steps):
            loss = F.cross_entropy(head(xs), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():  # on the host, as the adapter states that keep them
            w = head.weight / sd
            b = head.bias - (w * mu).sum(-1)
        return w.cpu(), b.cpu(), (mu.cpu(), sd.cpu())

    def head_only(self, task: str) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, dict[str, float]]:
        """The "no adapter" baseline: a linear head trained alone on the frozen base model's
        last-token hidden state (a text task: the base model's own answers, no head). Returns
        (head or None, {"val": acc, "test": acc})."""
        if self.is_text(task):
            return None, {s: self.score(task, self.answers(None, task, s), s) for s in ("val", "test")}
        self.base.set_lora_enabled(False)
        try:
            w, b, _ = self.fit_head(task)
            folded = (w, b)
            acc = {s: self._accuracy(task, s, folded) for s in ("val", "test")}
        finally:
            self.base.set_lora_enabled(True)
        return folded, acc
