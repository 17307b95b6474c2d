"""valora kernels: ATMM (multi-LoRA shrink+expand) and the switch kernel, with torch references.

Standalone: imports no service. CPU machines (and any machine without nvcc/the extension) use the
references in `kernels.reference`; `kernels.atmm` / `kernels.switch` dispatch automatically.
See kernels/README.md for the build, the API and the measured numbers.
"""

from kernels.atmm import AtmmPlan, LoraWeights, atmm_
from kernels.reference import SegmentPlan, multi_lora_reference_, switch_reference_
from kernels.switch import LoraTerm, SwitchPlan, merge_, switch_, unmerge_
from kernels.tile_table import TileConfig, TileTable

__all__ = ["AtmmPlan", "LoraTerm", "LoraWeights", "SegmentPlan", "SwitchPlan", "TileConfig", "TileTable", "atmm_",
           "merge_", "multi_lora_reference_", "switch_", "switch_reference_", "unmerge_"]
