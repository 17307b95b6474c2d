"""The switcher: folds one adapter into the base weights in place, and out again.

Weights are changed where they live (no second model), with B·A computed on the fly per
projection through the switch op (`kernels.reference.switch_reference_`: W += B_cat·A_cat,
fp32 accumulation, one rounding), never materialising a dense ΔW for the model at once.

Drift: a chain of in-place switches `W += [s_n B_n, −s_m B_m]·[A_n; A_m]` rounds once per
switch, so after many switches W drifts away from `round(W0 + s_n B_n A_n)`. Two strategies:

- "pristine" (default, exact): a pristine copy W0 of each targeted projection is kept; every
  merge/switch writes W = round(W0 + s_n·B_n·A_n) in one pass over W0 (unmerge: W = W0). The
  result is bit-identical to a fresh merge however many switches came before.
- "delta": the paper's one-pass switch from the current W (reads no W0), re-synchronised from
  W0 every `resync_every` switches so the drift stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.reference import switch_reference_
from services.worker.adapters import DeviceAdapter
from services.worker.lora import LayerModule, LoraLinear

SwitchOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _factors(dev: DeviceAdapter, key: LayerModule, sign: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(B_cat part (out, r), A_cat part (r, in)) of sign·s·B·A in PEFT orientation."""
    a = dev.a.get(key)
    if a is None:
        return None
    return dev.b[key].t().float() * (sign * dev.weights.scale), a.t().float()


class Switcher:
    def __init__(self, layers: dict[LayerModule, LoraLinear], strategy: str = "pristine",
                 resync_every: int = 64, pristine_device: str | torch.device | None = None,
                 op: SwitchOp = switch_reference_) -> None:
        if strategy not in ("pristine", "delta"):
            raise ValueError(f"unknown switch strategy {strategy!r}")
        self.layers = layers
        self.strategy = strategy
        self.resync_every = resync_every
        self.op = op
        self.pristine = {k: lin.base.weight.detach().to(pristine_device or lin.base.weight.device, copy=True)
                         for k, lin in layers.items()}
        self.merged: DeviceAdapter | None = None
        self.switches = 0

    @property
    def merged_name(self) -> str | None:
        return None if self.merged is None else self.merged.weights.name

    @torch.no_grad()
    def set(self, target: DeviceAdapter | None) -> None:
        """Makes `target` the merged adapter (None: pristine base weights)."""
        if target is self.merged or (target is not None and self.merged is not None
                                     and target.weights.name == self.merged.weights.name):
            self.merged = target
            return
        self.switches += 1
        resync = self.strategy == "pristine" or self.merged is None or target is None or (
            self.resync_every and self.switches % self.resync_every == 0)
        for key, lin in self.layers.items():
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
        self.merged = target
