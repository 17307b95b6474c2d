"""valora kernels: ATMM (multi-LoRA shrink+expand) and the switch kernel, with torch references.

Standalone: imports no service. CPU machines use the references in `kernels.reference`.
"""

from kernels.reference import SegmentPlan, multi_lora_reference_

__all__ = ["SegmentPlan", "multi_lora_reference_"]
