"""The worker's domain objects: what the engine runs and what it reports (no protobuf here)."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from PIL import Image

from services.common.modes import Mode
from services.common.release_rules import ReleaseRule
from services.worker.sampling import SamplingParams
from services.worker.vision import CacheStats


class OutputKind(enum.Enum):
    TEXT = "text"
    LABEL = "label"


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    LABEL = "label"


@dataclass
class WorkRequest:
    request_id: str
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    videos: list[list[Image.Image]] = field(default_factory=list)  # video chunks, each a list of frames
    adapter: str | None = None  # "adapters/{a}/versions/{v}"; None = base model
    output_kind: OutputKind = OutputKind.TEXT
    head: str = ""
    max_new_tokens: int = 0  # 0: the engine's default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    # LoRazor-style early release (release.py): after ceil(fraction * max_new_tokens) tokens the
    # request continues on the base model (KV cache kept). 0 = never. With the rule SENTENCE_END,
    # after the answer's first sentence (the fraction's tokens the least before it counts).
    adapter_release_fraction: float = 0.0
    adapter_release_rule: ReleaseRule = ReleaseRule.NONE
    # The conversation around the prompt: a system prompt replacing the model's default, and the
    # earlier turns (role, text, how many of `images` they show, in order).
    system: str = ""
    history: list[tuple[str, str, int]] = field(default_factory=list)
    raw_prompt: bool = False  # the prompt is the whole text: no chat template (then no images or turns)
    # With raw_prompt, instead of the prompt's text: the model's input as token ids (not tokenized)
    prompt_token_ids: list[int] = field(default_factory=list)
    # Log-probabilities of the generated tokens: -1 none; 0 each token's own; k (<= 20) and the k
    # most likely tokens at its position. From the model's distribution (before temperature).
    logprobs: int = -1
    # What is left of the request's latency objective, seconds, when the scheduler dispatched it
    # (WorkItem.slo_left_ms; None: no objective, or a first-come-first-served policy): the engine
    # admits and prefills the earliest due first (PreparedRequest.due).
    slo_left_s: float | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the `top` (token id, log-probability) most likely
    at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    label: str = ""
    scores: list[tuple[str, float]] = field(default_factory=list)  # best first
    finish_reason: FinishReason = FinishReason.LENGTH
    image_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    mode: Mode = Mode.BASE
    adapter: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry (when asked)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() each token reached the host
    # Early adapter release: the tokens generated with the adapter before the rest went on the base
    # path (0: never released).
    released_after_tokens: int = 0


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens since the previous event (when asked)


@dataclass(frozen=True)
class Finished:
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = TextDelta | Finished | Failed


class RequestHandle:
    """Returned by Engine.submit: cancel() frees the sequence at the next step boundary."""

    def __init__(self, request_id: str, wake: threading.Condition, deadline: float | None = None) -> None:
        self.request_id = request_id
        self._cancelled = threading.Event()
        self._wake = wake
        # time.monotonic() past which the engine drops the sequence itself at the next step
        # boundary, without waiting for the caller to notice the deadline.
        self.deadline = deadline

    def cancel(self) -> None:
        self._cancelled.set()
        with self._wake:
            self._wake.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


STEP_WINDOW = 1024  # latest engine steps the step-time percentiles cover


@dataclass(frozen=True)
class StepTimes:
    """Wall-time percentiles of recent engine steps. A decode step decoded running rows and ran
    no prefill; a prefill step ran at least one prefill (and possibly the decode beside it)."""

    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    decode_ms_p50: float = 0.0
    decode_ms_p90: float = 0.0
    prefill_ms_p50: float = 0.0
    prefill_ms_p90: float = 0.0


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 when empty."""
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def step_times(step_log, window: int = STEP_WINDOW) -> StepTimes:
    """StepTimes over the latest `window` entries of the engine's step log, a deque of
    (prefill rows, decode rows, ms) the engine thread appends to (copied at once: safe to call
    from another thread)."""
    for _ in range(3):
        try:
            entries = list(step_log)[-window:]
            break
        except RuntimeError:  # "deque mutated during iteration": copy again
            continue
    else:
        entries = []
    decode = sorted(ms for prefill, rows, ms in entries if not prefill and rows)
    prefill = sorted(ms for p, _, ms in entries if p)
    return StepTimes(
        steps=len(entries),
        decode_steps=len(decode),
        prefill_steps=len(prefill),
        decode_ms_p50=_percentile(decode, 0.5),
        decode_ms_p90=_percentile(decode, 0.9),
        prefill_ms_p50=_percentile(prefill, 0.5),
        prefill_ms_p90=_percentile(prefill, 0.9),
    )


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_cache_bytes: int
    max_batch_size: int
    mode: Mode
    merged_adapter: str
    resident_adapters: list[str]
    host_adapters: list[str]
    device: str
    alive: bool
    last_step_ms: float = 0.0  # wall time of the last engine step that ran a forward
    image_cache: CacheStats | None = None
