"""Early adapter release's run-time rules, one enum for every service: valora.v1.AdapterReleaseRule
without its prefix (NONE for UNSPECIFIED), its value the name HTTP's extra_body, the CLI and the
store's tasks table use; with the conversions to and from the proto (which import the stubs only
when used: the engine's domain objects stay free of protobuf). What a rule does is the worker's
(services/worker/release.py)."""

from __future__ import annotations

import enum


class ReleaseRule(enum.Enum):
    NONE = "none"  # no rule: the fraction alone decides
    SENTENCE_END = "sentence_end"  # at the end of the answer's first sentence or line

    def to_pb(self) -> int:
        from valora_protos.v1 import types_pb2

        if self is ReleaseRule.NONE:
            return types_pb2.ADAPTER_RELEASE_RULE_UNSPECIFIED
        return types_pb2.AdapterReleaseRule.Value(f"ADAPTER_RELEASE_RULE_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> ReleaseRule:
        """ValueError for a value this build does not know."""
        from valora_protos.v1 import types_pb2

        name = types_pb2.AdapterReleaseRule.Name(value).removeprefix("ADAPTER_RELEASE_RULE_")
        if name == "UNSPECIFIED":
            return cls.NONE
        if name not in cls.__members__:
            raise ValueError(f"rule {name} is not known to this build")
        return cls[name]


RULE_NAMES = tuple(r.value for r in ReleaseRule)
