"""What the engine holds of a request: the prepared request, its sequence while it runs, and a
launched decode step whose tokens the host has not taken yet."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.release import ReleasePolicy, ReleaseWatch
from services.worker.requests import RequestHandle, WorkRequest
from services.common.modes import Mode
from services.worker.vision import VisionItem

# A request without a latency objective orders as one due this long after it arrived, beside
# requests with one (step_scheduler.py): it yields to them, but never for ever.
NO_OBJECTIVE_S = 30.0


@dataclass
class PreparedRequest:
    request: WorkRequest
    inputs: dict
    max_new_tokens: int
    image_tokens: int
    prompt_tokens: int
    vision: list[VisionItem] = field(default_factory=list)  # images then videos, with content keys
    release: ReleasePolicy = ReleasePolicy()  # early adapter release (none by default)
    arrived: float = field(default_factory=time.monotonic)

    @property
    def due(self) -> float:
        """When (time.monotonic()) its latency objective runs out; without one, NO_OBJECTIVE_S after
        it arrived: it yields to requests with an objective, but not for ever."""
        left = self.request.slo_left_s
        return self.arrived + (NO_OBJECTIVE_S if left is None else left)


@dataclass(eq=False)
class Sequence:
    id: int
    prep: PreparedRequest
    sink: object  # None on a tensor-parallel follower: it emits nothing
    handle: RequestHandle
    detok: IncrementalDetokenizer | None = None
    length: int = 0  # tokens in its KV cache
    preemptions: int = 0  # times its blocks were taken back (it is prefilled again over its tokens)
    rope_delta: int = 0
    last_token: int = 0
    tokens: list[int] = field(default_factory=list)
    pinned: str | None = None  # adapter whose device slot this sequence holds
    t_prefill: float = 0.0
    t_first: float = 0.0
    mode: Mode = Mode.BASE
    released: bool = False  # early adapter release: decodes on the base path from now on
    release_watch: ReleaseWatch = field(init=False)  # when it comes (release.py)
    # Prefill: context tokens already in the KV cache; where this step's piece of the context
    # ends (StepScheduler.take_prefills); and, while a context is prefilled in chunks, its
    # embeddings (context, hidden), M-RoPE positions (3, context) and delta for the next chunks.
    prefilled: int = 0
    prefill_to: int = 0
    chunk_inputs: tuple | None = None
    finished: bool = False  # out of the engine (answered, failed or cancelled)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token (when asked)
    logprobs_sent: int = 0  # how many of them went out with a TextDelta
    token_times: list[float] = field(default_factory=list)  # time.monotonic() each token was accepted

    def __post_init__(self) -> None:
        self.release_watch = ReleaseWatch(self.prep.release)

    @property
    def req(self) -> WorkRequest:
        return self.prep.request

    @property
    def context(self) -> int:
        """Tokens a prefill of this sequence runs over: its prompt, and after a preemption the
        tokens it generated too."""
        return self.prep.prompt_tokens + len(self.tokens)


@dataclass(eq=False)
class PendingStep:
    """A launched decode step whose tokens the host has not taken yet (pipelined decode)."""

    rows: list[Sequence]
    tokens: torch.Tensor  # (rows,) on the device: the next step's input ids
    host: torch.Tensor  # (rows,) host copy of `tokens` (pinned on CUDA), valid once `copied` has completed
    copied: torch.cuda.Event | None  # None on CPU: the copy was synchronous
    logprobs: torch.Tensor | None = None  # host copy of the rows' packed log-probabilities (token_logprobs)
