"""The switcher: folds one adapter into the base weights in place, and out again.

Weights are changed where they live (no second model), with B·A computed on the fly per
projection, never materialising a dense ΔW for the model at once:

- CUDA bf16/fp16 weights with the kernels extension built: every targeted projection goes
  through ONE launch of the switch kernel (`kernels.switch.SwitchPlan`, adapter factors read in
  their ATMM layout A (in, r), B (r, out) straight from the device slot). Projections the kernel
  cannot take (a rank that is not a multiple of 8 or above 128, odd shapes, unaligned tensors)
  use the torch op below.
- otherwise (CPU, fp32, no extension, or a custom `op`): the switch op per projection
  (`kernels.reference.switch_reference_`: W += B_cat·A_cat, fp32 accumulation, one rounding).

Drift: a chain of in-place switches `W += [s_n B_n, −s_m B_m]·[A_n; A_m]` rounds once per
switch, so after many switches W drifts away from `round(W0 + s_n B_n A_n)`. Two strategies:

- "pristine" (default, exact): a pristine copy W0 of each targeted projection is kept; every
  merge/switch writes W = round(W0 + s_n·B_n·A_n) (unmerge: W = W0). With the kernel that is one
  out-of-place pass (read W0, write W) when W0 lives on W's device; otherwise W0 is copied in
  and merged in place. The result is bit-identical to a fresh merge however many switches came
  before.
- "delta": the paper's one-pass switch from the current W (reads no W0; the kernel's two-term
  pass), re-synchronised from W0 every `resync_every` switches so the drift stays bounded.

A plan packs 80 bytes of pointers per projection (no weight is copied; ~1-3 ms of host work for
224 projections), so the last `PLAN_CACHE` plans are kept per (merged, target) pair of adapter
objects. An entry is dropped at the next switch once either adapter object is gone (evicted from
its device slot), so a cached plan never keeps an evicted adapter's tensors alive for long.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kernels.reference import switch_reference_
from services.worker.adapter_staging import DeviceAdapter
from services.worker.lora import LayerModule, LoraLinear

SwitchOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_MAX_RANK = 128  # per adapter; the kernel also needs ranks that are multiples of 8
PLAN_CACHE = 8


def _factors(dev: DeviceAdapter, key: LayerModule, sign: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(B_cat part (out, r), A_cat part (r, in)) of sign·s·B·A in PEFT orientation."""
    a = dev.a.get(key)
    if a is None:
        return None
    return dev.b[key].t().float() * (sign * dev.weights.scale), a.t().float()


def _term(dev: DeviceAdapter | None, key: LayerModule, sign: float):
    """The adapter's LoraTerm for this projection in ATMM layout (A (in, r), B (r, out)), or None
    (no adapter, the adapter does not target it, or a zero scale)."""
    from kernels.switch import LoraTerm  # kernels stay optional for CPU imports

    if dev is None or dev.weights.scale == 0:
        return None
    a = dev.a.get(key)
    if a is None:
        return None
    return LoraTerm(a, dev.b[key], sign * dev.weights.scale)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def kernel_can_take(w: torch.Tensor, factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the switch kernel can update W (out, in) with these (A (in, r), B (r, out)) factors."""
    if not (w.is_cuda and w.dtype in KERNEL_DTYPES and w.dim() == 2 and w.is_contiguous() and _aligned(w)):
        return False
    out, inp = w.shape
    if out % 8 or inp % 8:
        return False
    for a, b in factors:
        r = a.shape[1] if a.dim() == 2 else -1
        if r <= 0 or r % 8 or r > KERNEL_MAX_RANK or tuple(a.shape) != (inp, r) or tuple(b.shape) != (r, out):
            return False
        for x in (a, b):
            if x.dtype != w.dtype or x.device != w.device or not x.is_contiguous() or not _aligned(x):
                return False
    return True


def kernel_available(layers: dict[LayerModule, LoraLinear]) -> bool:
    """CUDA bf16/fp16 weights and a built kernels extension."""
    ws = [lin.base.weight for lin in layers.values()]
    if not ws or not any(w.is_cuda and w.dtype in KERNEL_DTYPES for w in ws):
        return False
    from kernels.atmm import extension

    return extension() is not None


class Switcher:
    def __init__(
        self,
        layers: dict[LayerModule, LoraLinear],
        strategy: str = "pristine",
        resync_every: int = 64,
        pristine_device: str | torch.device | None = None,
        op: SwitchOp = switch_reference_,
        use_kernel: bool | None = None,
        kernel_config: str | None = None,
    ) -> None:
        """use_kernel: None = the switch kernel when `kernel_available` and `op` is the default;
        kernel_config: a switch kernel config name (default: kernels.switch.DEFAULT_CONFIG)."""
        if strategy not in ("pristine", "delta"):
            raise ValueError(f"unknown switch strategy {strategy!r}")
        self.layers = layers
        self.strategy = strategy
        self.resync_every = resync_every
        self.op = op
        self.pristine = {
            k: lin.base.weight.detach().to(pristine_device or lin.base.weight.device, copy=True)
            for k, lin in layers.items()
        }
        if use_kernel is None:
            use_kernel = op is switch_reference_ and kernel_available(layers)
        self.use_kernel = use_kernel
        self.kernel_config = kernel_config
        self.merged: DeviceAdapter | None = None
        self.switches = 0
        self.kernel_launches = 0  # switch-kernel plans run (tests, metrics)
        self._plans: OrderedDict[tuple, tuple] = OrderedDict()  # see _kernel_plan

    @property
    def merged_name(self) -> str | None:
        return None if self.merged is None else self.merged.weights.name

    @torch.no_grad()
    def set(self, target: DeviceAdapter | None) -> None:
        """Makes `target` the merged adapter (None: pristine base weights)."""
        if target is self.merged or (
            target is not None and self.merged is not None and target.weights.name == self.merged.weights.name
        ):
            self.merged = target
            return
        self.switches += 1
        resync = (
            self.strategy == "pristine"
            or self.merged is None
            or target is None
            or (self.resync_every and self.switches % self.resync_every == 0)
        )
        fast, copies, plan = self._kernel_plan(target, resync) if self.use_kernel else ([], [], None)
        fast_set = set(fast)
        for key, lin in self.layers.items():
            if key in fast_set:
                continue
            w = lin.base.weight
            if resync:
                w.copy_(self.pristine[key])
                parts = [] if target is None else [_factors(target, key, 1.0)]
            else:
                parts = [_factors(target, key, 1.0), _factors(self.merged, key, -1.0)]
            parts = [p for p in parts if p is not None]
            if parts:
                b_cat = torch.cat([p[0] for p in parts], dim=1)
                a_cat = torch.cat([p[1] for p in parts], dim=0)
                self.op(w, b_cat.to(w.device), a_cat.to(w.device))
        for w, p in copies:  # pristine copies the kernel cannot read: W = W0 first, merged in place
            w.copy_(p)
        if plan is not None:
            plan.run()
            self.kernel_launches += 1
        self.merged = target

    def _kernel_plan(self, target: DeviceAdapter | None, resync: bool):
        """(kernel keys, pristine copies to make first, SwitchPlan or None) of this switch, cached
        per (merged, target) adapter objects (weakly: dead entries are dropped here)."""
        from kernels.switch import SwitchPlan

        merged = None if resync else self.merged
        for k in [k for k, v in self._plans.items() if any(r is not None and r() is None for r in v[:2])]:
            del self._plans[k]
        key = (id(merged), id(target), resync)
        hit = self._plans.get(key)
        if hit is not None and (hit[0] is None or hit[0]() is merged) and (hit[1] is None or hit[1]() is target):
            self._plans.move_to_end(key)
            return hit[2:]
        fast = self.kernel_keys(target, resync)
        ws, srcs, first, second, copies = self.kernel_jobs(fast, target, resync)
        plan = None
        if ws:
            plan = SwitchPlan(
                ws,
                first,
                second if any(t is not None for t in second) else None,
                config=self.kernel_config,
                sources=srcs,
            )
        refs = tuple(None if d is None else weakref.ref(d) for d in (merged, target))
        self._plans[key] = (*refs, fast, copies, plan)
        while len(self._plans) > PLAN_CACHE:
            self._plans.popitem(last=False)
        return fast, copies, plan

    def kernel_keys(self, target: DeviceAdapter | None, resync: bool) -> list[LayerModule]:
        """Projections the switch kernel takes for this switch (the rest use the torch op)."""
        keys = []
        for key, lin in self.layers.items():
            adapters = [target] if resync else [target, self.merged]
            factors = [(d.a[key], d.b[key]) for d in adapters if d is not None and key in d.a]
            if kernel_can_take(lin.base.weight, factors):
                keys.append(key)
        return keys

    def kernel_jobs(self, keys: Sequence[LayerModule], target: DeviceAdapter | None, resync: bool):
        """(weights, sources, first terms, second terms, copies) of the one kernel launch for `keys`.

        Pristine/resync: W = W0 + s_n·B_n·A_n read from the pristine copy (out of place) when it is
        on W's device; otherwise (W, W0) is in `copies` (W = W0 before the launch) and W is merged in
        place. Delta: W += s_n·B_n·A_n − s_m·B_m·A_m in place; projections neither adapter targets
        are left out."""
        ws, srcs, first, second, copies = [], [], [], [], []
        for key in keys:
            w = self.layers[key].base.weight
            tn = _term(target, key, 1.0)
            if resync:
                p = self.pristine[key]
                if p.device == w.device and p.dtype == w.dtype and p.is_contiguous() and _aligned(p):
                    src = p
                else:
                    copies.append((w, p))
                    src = w
                    if tn is None:
                        continue  # the copy is all
                ws.append(w)
                srcs.append(src)
                first.append(tn)
                second.append(None)
            else:
                tm = _term(self.merged, key, -1.0)
                if tn is None and tm is None:
                    continue
                ws.append(w)
                srcs.append(w)
                first.append(tn)
                second.append(tm)
        return ws, srcs, first, second, copies
