"""LoRA-aware linear layers and the per-step LoRA plan they share.

`install_lora(model)` replaces the language model's q/k/v/o/gate/up/down `nn.Linear`s with
`LoraLinear`, which computes `base(x)` and then adds, per token segment, `s·(x·A)·B` through the
one multi-LoRA op (ATMM's contract, `kernels.reference.multi_lora_reference_` on CPU).

The engine builds one `StepLora` per forward (tokens grouped by LoRA entry into a
`SegmentPlan`) and sets it on the shared `LoraRuntime`; every layer reads it. An entry is
whatever one segment adds: an adapter's device slot (unmerged), or the rank-2r deLoRA term of
mixture mode. Rows the engine already sorted by entry need no permutation.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from kernels.reference import SegmentPlan, multi_lora_reference_
from services.common.adapter_format import TARGET_MODULES, module_parent
from services.worker.adapter_weights import LayerModule
from services.worker.architectures import language_model

MultiLoraOp = Callable[..., torch.Tensor]


class LoraEntry(ABC):
    """What one segment adds in layer `key`: (A (in, r), B (r, out), scale) or None."""

    @abstractmethod
    def tensors(self, key: LayerModule) -> tuple[torch.Tensor, torch.Tensor, float] | None: ...

    @property
    @abstractmethod
    def rank(self) -> int: ...


@dataclass(frozen=True, eq=False)
class AdapterEntry(LoraEntry):
    """Plain unmerged LoRA of one resident adapter."""

    a: dict
    b: dict
    scale: float

    def tensors(self, key):
        a = self.a.get(key)
        return None if a is None else (a, self.b[key], self.scale)

    @property
    def rank(self) -> int:
        return next(iter(self.a.values())).shape[1]


@dataclass(eq=False)
class StepLora:
    """The LoRA plan of one forward: built once, read by every LoraLinear.

    row_entries[i] is the entry index of input row i (-1: no LoRA); `tokens_per_row` is how many
    tokens each row holds of the flattened activations: one count for every row (rows x tokens,
    a decode step or padded rows), or one per row (rows packed without padding, a prefill).
    """

    entries: list[LoraEntry]
    row_entries: list[int]
    tokens_per_row: int | tuple[int, ...]
    plan: SegmentPlan = field(init=False)
    perm: torch.Tensor | None = field(init=False, default=None)
    kernel: bool = field(init=False, default=False)  # the runtime's kernel backend took this step
    _per_key: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.row_entries)
        t = self.tokens_per_row
        counts = [t] * n if isinstance(t, int) else list(t)
        if len(counts) != n:
            raise ValueError(f"{len(counts)} token counts for {n} rows")
        order = sorted(range(n), key=lambda i: self.row_entries[i])
        starts, slots = [0], []
        for i in order:  # runs of rows with one entry: one segment
            if slots and slots[-1] == self.row_entries[i]:
                starts[-1] += counts[i]
            else:
                slots.append(self.row_entries[i])
                starts.append(starts[-1] + counts[i])
        self.plan = SegmentPlan(starts, slots)
        if order != list(range(n)):
            first = [0]
            for c in counts:
                first.append(first[-1] + c)
            self.perm = torch.tensor([first[i] + j for i in order for j in range(counts[i])], dtype=torch.long)

    @property
    def active(self) -> bool:
        return any(e >= 0 for e in self.row_entries)

    def for_key(self, key: LayerModule):
        """(plan, a_list, b_list, scales) for one layer/module; entries lacking it are skipped."""
        got = self._per_key.get(key)
        if got is None:
            a_list, b_list, scales = [], [], []
            for e in self.entries:
                t = e.tensors(key)
                a_list.append(None if t is None else t[0])
                b_list.append(None if t is None else t[1])
                scales.append(0.0 if t is None else t[2])
            plan = self.plan
            if any(a_list[k] is None for k in plan.seg_slots if k >= 0):
                plan = SegmentPlan(
                    plan.seg_starts, [k if k >= 0 and a_list[k] is not None else -1 for k in plan.seg_slots]
                )
            got = (plan, a_list, b_list, scales)
            self._per_key[key] = got
        return got


class KernelPlan(Protocol):
    version: int  # bumped at every write of the step's segments to the device


class LoraBackend(Protocol):
    """What the LoRA layers and the planner ask of a kernel backend (atmm_backend.AtmmBackend):
    a step's multi-LoRA term added into y in place, on the device, launch by launch."""

    plan: KernelPlan

    def begin(self, step: StepLora) -> bool:
        """Writes the step's plan for the kernels; False: this step runs the torch reference."""
        ...

    def run(self, key: LayerModule, y: torch.Tensor, x: torch.Tensor, step: StepLora) -> None:
        """y += the step's term of projection `key` over x (tokens, in_features)."""
        ...

    def run_group(
        self, group: LayerModule, parts: tuple[LayerModule, ...], y: torch.Tensor, x: torch.Tensor, step: StepLora
    ) -> None:
        """The same for a LoraGroup, into its concatenated output."""
        ...

    def folded_linear(self, key: LayerModule, x: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
        """base(x) plus the term with the shrink folded into the base GEMM; None: not folded."""
        ...

    def launch_key(self) -> tuple:
        """What a CUDA graph of the step's launches must match (step_graphs.lora_launch_key)."""
        ...


class LoraRuntime:
    """Shared by every LoraLinear of one model: the current step's plan and the op to run."""

    def __init__(self, op: MultiLoraOp = multi_lora_reference_, backend: LoraBackend | None = None) -> None:
        self.op = op
        self.backend = backend  # None: every step on `op` (the torch reference on CPUs)
        self.step: StepLora | None = None


class LoraLinear(nn.Module):
    """`base(x)` plus the segment-wise multi-LoRA term of the current step."""

    def __init__(self, base: nn.Linear, key: LayerModule, runtime: LoraRuntime) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.runtime = runtime

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reserve_lora_rows(self, rows: int) -> None:
        """Moves the weight (and bias) into a buffer with `rows` spare rows below it, which the
        backend fills with the step's A^T (`AtmmBackend` folding); the weight stays a view."""
        self.w_ext, self.b_ext = _with_spare_rows(self.base.weight, self.base.bias, rows)
        n = self.base.out_features
        self.base.weight = nn.Parameter(self.w_ext[:n], requires_grad=False)
        if self.b_ext is not None:
            self.base.bias = nn.Parameter(self.b_ext[:n], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.runtime.step
        if (
            step is not None
            and step.kernel
            and (y := self.runtime.backend.folded_linear(self.key, x, self)) is not None
        ):
            return y
        y = self.base(x)
        if step is None or not step.active:
            return y
        yf = y.reshape(-1, y.shape[-1])
        self.add_lora(yf, x.reshape(-1, x.shape[-1]), step)
        return yf.view_as(y) if yf.data_ptr() == y.data_ptr() else yf.reshape(y.shape)

    def add_lora(self, yf: torch.Tensor, xf: torch.Tensor, step: StepLora) -> None:
        """In place yf (tokens, out) += this projection's multi-LoRA term of x (yf may be a column
        view of a wider output, as in LoraGroup)."""
        if step.kernel:
            self.runtime.backend.run(self.key, yf, xf, step)
            return
        plan, a_list, b_list, scales = step.for_key(self.key)
        if step.perm is None:
            self.runtime.op(yf, xf, plan, a_list, b_list, scales)
        else:
            perm = step.perm.to(xf.device)
            ys = yf.index_select(0, perm)
            self.runtime.op(ys, xf.index_select(0, perm), plan, a_list, b_list, scales)
            yf.index_copy_(0, perm, ys)


# Projections of a decoder layer that read the same input: computed as one LoraGroup.
PROJECTION_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LoraGroup(nn.Module):
    """Projections reading the same x (q/k/v, gate/up) as ONE linear: one GEMM over their
    concatenated weights and, on the ATMM backend, one multi-LoRA call over block-diagonal factors
    (`group_tensors`): two launch pairs fewer than q, k, v apart, which is most of a decode
    step's LoRA cost (each launch is latency, not bytes). The parts stay LoraLinears whose weight
    and bias are views of the group's, so the switcher, the adapter tables and HF's own forward
    (which calls the parts) keep working on them. forward returns the parts' outputs (views).
    """

    def __init__(self, parts: Sequence[LoraLinear], key: LayerModule, runtime: LoraRuntime) -> None:
        super().__init__()
        bases = [p.base for p in parts]
        self.key = key
        self.runtime = runtime
        self.part_keys = tuple(p.key for p in parts)
        self.sizes = [b.out_features for b in bases]
        self.weight = nn.Parameter(torch.cat([b.weight.detach() for b in bases]), requires_grad=False)
        self._has_bias = [b.bias is not None for b in bases]
        self.bias = None
        if any(self._has_bias):
            self.bias = nn.Parameter(
                torch.cat(
                    [
                        b.bias.detach() if b.bias is not None else b.weight.new_zeros(n)
                        for b, n in zip(bases, self.sizes)
                    ]
                ),
                requires_grad=False,
            )
        self._parts = list(parts)  # not submodules: they stay registered where HF put them
        self._point_parts()

    @property
    def out_features(self) -> int:
        return sum(self.sizes)

    def _point_parts(self) -> None:
        """The parts' weights (and biases) become views of the group's: updates reach the group."""
        lo = 0
        for p, n, with_bias in zip(self._parts, self.sizes, self._has_bias):
            p.base.weight = nn.Parameter(self.weight[lo : lo + n], requires_grad=False)
            if with_bias:
                p.base.bias = nn.Parameter(self.bias[lo : lo + n], requires_grad=False)
            lo += n

    def reserve_lora_rows(self, rows: int) -> None:
        """As `LoraLinear.reserve_lora_rows`, for the concatenated weight (parts re-pointed)."""
        self.w_ext, self.b_ext = _with_spare_rows(self.weight, self.bias, rows)
        n = self.out_features
        self.weight = nn.Parameter(self.w_ext[:n], requires_grad=False)
        if self.b_ext is not None:
            self.bias = nn.Parameter(self.b_ext[:n], requires_grad=False)
        self._point_parts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        step = self.runtime.step
        if (
            step is not None
            and step.kernel
            and (y := self.runtime.backend.folded_linear(self.key, x, self)) is not None
        ):
            return y.split(self.sizes, dim=-1)
        y = nn.functional.linear(x, self.weight, self.bias)
        if step is not None and step.active:
            yf, xf = y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
            if step.kernel:
                self.runtime.backend.run_group(self.key, self.part_keys, yf, xf, step)
            else:
                for part, col in zip(self._parts, yf.split(self.sizes, dim=1)):
                    part.add_lora(col, xf, step)
        return y.split(self.sizes, dim=-1)


def _with_spare_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out + rows, in) copy of weight with zero rows below it (and the bias with zeros)."""
    n = weight.shape[0]
    w_ext = weight.new_zeros((n + rows, weight.shape[1]))
    w_ext[:n].copy_(weight.detach())
    b_ext = None
    if bias is not None:
        b_ext = bias.new_zeros(n + rows)
        b_ext[:n].copy_(bias.detach())
    return w_ext, b_ext


_group_cache: "weakref.WeakKeyDictionary[LoraEntry, dict]" = weakref.WeakKeyDictionary()


def group_tensors(
    entry: LoraEntry, parts: Sequence[LayerModule], sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """One entry's LoRA over a group's concatenated output: A = [A_1 | A_2 | ...] (in, Σr),
    B = block-diagonal (Σr, Σout) with each part's s·B in its own rows and columns, scale 1.
    Parts the entry does not target add nothing. Built once per (entry, group) and kept while the
    entry lives (a device copy of the parts' factors, the zero blocks included)."""
    per_entry = _group_cache.setdefault(entry, {})
    if parts in per_entry:
        return per_entry[parts]
    got = [entry.tensors(k) for k in parts]
    present = [t for t in got if t is not None]
    result = None
    if present:
        a = torch.cat([t[0] for t in present], dim=1).contiguous()
        b = present[0][1].new_zeros((a.shape[1], sum(sizes)))
        row = col = 0
        for t, n in zip(got, sizes):
            if t is not None:
                r = t[0].shape[1]
                b[row : row + r, col : col + n] = (t[1].float() * t[2]).to(b.dtype)
                row += r
            col += n
        result = (a, b, 1.0)
    per_entry[parts] = result
    return result


@dataclass(eq=False)
class MixtureEntry(LoraEntry):
    """deLoRA term of a request for adapter x while adapter m is merged into the base weights:
    x·([A_x | A_m] · [s_x·B_x ; −s_m·B_m]), rank r_x + r_m (x None: a base request, −m only).
    Concatenations are built once per layer and kept while the entry lives."""

    x: "AdapterEntry | None"
    m: AdapterEntry
    _cache: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return (self.x.rank if self.x is not None else 0) + self.m.rank

    def tensors(self, key):
        if key in self._cache:
            return self._cache[key]
        parts = []
        if self.x is not None and (t := self.x.tensors(key)) is not None:
            parts.append((t[0], (t[1].float() * t[2]).to(t[1].dtype)))
        if (t := self.m.tensors(key)) is not None:
            parts.append((t[0], (t[1].float() * -t[2]).to(t[1].dtype)))
        got = None
        if parts:
            got = (
                torch.cat([p[0] for p in parts], dim=1).contiguous(),
                torch.cat([p[1] for p in parts], dim=0).contiguous(),
                1.0,
            )
        self._cache[key] = got
        return got


def language_layers(model: nn.Module) -> Sequence[nn.Module]:
    return language_model(model).layers


def install_lora(model: nn.Module, runtime: LoraRuntime) -> dict[LayerModule, LoraLinear]:
    """Wraps every LoRA-targetable projection of the language model; returns them by (layer, module)."""
    wrapped: dict[LayerModule, LoraLinear] = {}
    for i, layer in enumerate(language_layers(model)):
        for module in TARGET_MODULES:
            parent = getattr(layer, module_parent(module))
            base = getattr(parent, module)
            if isinstance(base, LoraLinear):
                base = base.base
            lin = LoraLinear(base, (i, module), runtime)
            setattr(parent, module, lin)
            wrapped[(i, module)] = lin
    return wrapped


def install_lora_groups(
    model: nn.Module, layers: dict[LayerModule, LoraLinear], runtime: LoraRuntime
) -> dict[LayerModule, LoraGroup]:
    """Puts a LoraGroup beside each decoder layer's q/k/v and gate/up LoraLinears (as
    `self_attn.qkv_proj` and `mlp.gate_up_proj`, which fused_layers' forward calls); returns them
    by (layer, group name)."""
    groups: dict[LayerModule, LoraGroup] = {}
    for i, layer in enumerate(language_layers(model)):
        for name, modules in PROJECTION_GROUPS.items():
            parts = [layers.get((i, m)) for m in modules]
            if any(p is None for p in parts):
                continue
            group = LoraGroup(parts, (i, name), runtime)
            setattr(getattr(layer, module_parent(modules[0])), name, group)
            groups[(i, name)] = group
    return groups
