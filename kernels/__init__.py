"""valora kernels: ATMM (multi-LoRA shrink+expand) and the switch kernel, with torch references.

Standalone: imports no service. CPU machines (and any machine without nvcc/the extension) use the
references in `kernels.reference`; `kernels.atmm` / `kernels.switch` dispatch automatically.
See kernels/README.md for the build, the API and the measured numbers.

The names below are imported on first use, so `kernels.tile_table` (plain Python) imports without
torch: the adapter store validates tile tables with it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AtmmPlan": "kernels.atmm",
    "LoraWeights": "kernels.atmm",
    "atmm_": "kernels.atmm",
    "SegmentPlan": "kernels.reference",
    "multi_lora_reference_": "kernels.reference",
    "switch_reference_": "kernels.reference",
    "LoraTerm": "kernels.switch",
    "SwitchPlan": "kernels.switch",
    "merge_": "kernels.switch",
    "switch_": "kernels.switch",
    "unmerge_": "kernels.switch",
    "TileConfig": "kernels.tile_table",
    "TileTable": "kernels.tile_table",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
