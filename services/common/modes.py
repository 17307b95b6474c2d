"""How a worker applies adapters, one enum for every service: valora.v1.InferenceMode without
its prefix, with the conversions to and from the proto (which import the stubs only when used:
the engine's domain objects stay free of protobuf)."""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    UNKNOWN = "unknown"  # a worker not heard from yet (the scheduler's view)
    BASE = "base"  # no adapter (a request's mode)
    MERGED = "merged"  # one adapter folded into the base weights
    UNMERGED = "unmerged"  # every adapter's LoRA term beside the base (ATMM)
    MIXTURE = "mixture"  # one merged, the others through deLoRA terms

    def to_pb(self) -> int:
        from valora_protos.v1 import types_pb2

        if self is Mode.UNKNOWN:
            return types_pb2.INFERENCE_MODE_UNSPECIFIED
        return types_pb2.InferenceMode.Value(f"INFERENCE_MODE_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> "Mode":
        """UNKNOWN for UNSPECIFIED and values this build does not know."""
        from valora_protos.v1 import types_pb2

        try:
            name = types_pb2.InferenceMode.Name(value).removeprefix("INFERENCE_MODE_")
        except ValueError:
            return cls.UNKNOWN
        return cls.__members__.get(name, cls.UNKNOWN)
