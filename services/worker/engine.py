"""The iteration-level engine: one thread, one model, continuous batching with multi-LoRA.

`Engine` owns the loop and its collaborators, each step: what other threads sent (inbox.py:
requests, commands, cancellations; tensor parallel: rank 0's broadcast), commands (lora_manager.py:
adapter loads, offloads, mode switches), admission and the step's prefill batch
(step_scheduler.py: FIFO, each request pinning its adapter and taking its KV blocks from the paged
pool, kv_cache.py), one prefill forward of whole contexts or of the next chunk of a long one
(prefiller.py over model_runner.py), one decode step of every running sequence over the pool,
replayed from a CUDA graph and pipelined with the host (decoder.py, decode_graphs.py), and the
tokens' hand-off (outputs.py: streaming, stops, early adapter release, LABEL answers). LoRA is
planned once per forward (lora_plans.py). When blocks run out the youngest sequence is preempted
and recomputed later.

Callers (the gRPC server) `prepare()` a request (intake.py: checks, image decode + processor, any
thread), then `submit()` it with a sink that receives TextDelta / Finished / Failed events on the
engine thread. Under tensor parallelism every rank runs its own Engine in lockstep.
docs/engine.md describes the whole.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from pathlib import Path

import structlog
import torch

from services.common.errors import (
    CapacityExceeded,
    FailedPrecondition,
    ValoraError,
    WorkerUnavailable,
    invalid_field,
)
from services.worker.adapter_weights import AdapterWeights
from services.worker.adapter_pool import AdapterPool
from services.worker.architectures import architecture_of
from services.worker.config import EngineConfig
from services.worker.decoder import Decoder
from services.worker.kv_cache import PoolMemory
from services.worker.lora_manager import Command, LoraManager
from services.worker.lora_plans import LoraPlanner
from services.worker.lora_model import load_lora_model
from services.worker.model import load_processor
from services.worker.mixed_step import MixedStep
from services.worker.model_runner import ModelRunner
from services.worker.outputs import OutputProcessor
from services.worker.inbox import Inbox
from services.worker.intake import RequestIntake
from services.worker.prefiller import Prefiller
from services.worker.processor import vision_token_ids
from services.worker.requests import (
    EngineStats,
    Event,
    Failed,
    Finished,
    GenerationResult,
    OutputKind,
    RequestHandle,
    TextDelta,
    WorkRequest,
)
from services.common.modes import Mode
from services.worker.sequence import PreparedRequest, Sequence
from services.worker.step_scheduler import StepScheduler
from services.worker.step_trace import StepTrace
from services.worker.vision import FeatureCache, VisionEncoder, VisionItem

log = structlog.get_logger()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N
        self.dtype = getattr(torch, config.dtype)  # EngineConfig checked the name
        path = Path(config.model_path).expanduser()
        self.arch = architecture_of(path)  # a family the worker does not serve is refused here, by name
        self.processor = load_processor(path)
        self.tokenizer = self.processor.tokenizer
        self.tp = config.tp if config.tp is not None and config.tp.world_size > 1 else None
        self.leader = self.tp is None or self.tp.rank == 0
        m = load_lora_model(path, config, self.device, self.dtype, self.tp)
        self.model, self.runtime, self.lora_layers, self.shapes = m.model, m.runtime, m.lora_layers, m.shapes
        self.model_config, self.text_config, eos_ids = m.model_config, m.model.config.text_config, m.eos_ids
        self.vision = VisionEncoder(
            self.model,
            FeatureCache(config.image_cache_bytes),
            self.device,
            self.dtype,
            self.tp,
            graphs=config.vision_graphs,
        )
        self.runner = ModelRunner(self.model, self.runtime, self.vision, config, self.dtype, self.device, self.tp)
        self.kv_pool, self.kv, self.graphs = self.runner.pool, self.runner.blocks, self.runner.graphs
        self.max_model_len = self.runner.max_model_len
        self.intake = RequestIntake(
            self.processor,
            config,
            self.device,
            self.dtype,
            self.max_model_len,
            self.kv,
            vision_token_ids(self.model.config),
            self.text_config.vocab_size,
        )
        # resident adapters live in the KV pool's blocks (S-LoRA's unified pool): KV and adapters trade memory
        self.pool = AdapterPool(
            self.device,
            self.dtype,
            config.device_slots,
            on_swap=config.on_adapter_swap,
            memory=PoolMemory(self.kv_pool, self.kv),
        )
        self.lora = LoraPlanner(self.pool, self.runtime)
        self.adapters = LoraManager(
            self.pool, self.lora, self.lora_layers, self.shapes, config.max_rank, config.switch_strategy, self.tp
        )
        self._wake = threading.Condition()
        self._loads = threading.Lock()  # adapter loads, one at a time (load_adapter_bytes)
        self.sched = StepScheduler(config, self.kv, self.pool, self._wake, padded=self.runner.prefill_tokens)
        self.inbox = Inbox(self.sched, self._wake, self.tp)
        self.outputs = OutputProcessor(self.sched, self.pool, self.device, eos_ids, self.tp)
        self.decoder = Decoder(self.sched, self.lora, self.runner, self.outputs, self.device, config.pipeline_decode)
        self.prefiller = Prefiller(self.sched, self.lora, self.runner, self.outputs, self.decoder, self.tokenizer)
        self.mixed = (
            MixedStep(self.sched, self.lora, self.runner, self.outputs, self.decoder, self.prefiller)
            if config.mixed_steps
            else None
        )
        self.trace = self.runner.trace = StepTrace(config.step_trace, self.device)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step_log: collections.deque = collections.deque(maxlen=4096)  # (prefill rows, decode rows, ms)
        self.step_tokens: collections.deque = collections.deque(maxlen=4096)  # each step's prefill + decode tokens
        self.steps = 0  # steps logged so far (readers take step_log's entries since their last look)
        self._stats_lock = threading.Lock()
        self._kv_bytes = 0
        self._running_count = 0
        self._last_step_ms = 0.0
        # When the loop last began a step (an idle loop begins one every 0.1 s): the worker's
        # watchdog takes a loop that stops beating for a stalled engine.
        self.beat = time.monotonic()

    @property
    def eos_ids(self) -> set[int]:
        """Tokens that end a sequence (tests clear it so requests run to max_new_tokens)."""
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.outputs.eos_ids = ids

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="valora-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop (a tensor-parallel follower's ends when rank 0's stop reaches it: this
        waits for that, up to `timeout`)."""
        self.inbox.stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # -- adapters and modes (lora_manager.py) -------------------------------------------------
    def load_adapter_bytes(
        self,
        name: str,
        sha256: str,
        data: bytes,
        config_json: str,
        head_labels: dict[str, list[str]] | None = None,
        to_device: bool = False,
    ) -> bool:
        """Validates and adds an adapter bundle; False if that version was already loaded. The
        host pool stays within host_adapter_bytes: least recently used idle adapters leave it.
        Loads run one at a time: each makes room for itself in the pool the previous ones left
        (concurrent loads each chose victims for themselves only, together going over)."""
        with self._loads:
            evict = tuple(
                self.pool.host_victims(len(data), self.config.host_adapter_bytes, keep={name, self.lora.merged or ""})
            )
            return self._pool_change(Command("load", (name, sha256, data, config_json, head_labels, to_device, evict)))

    def add_adapter(self, weights: AdapterWeights) -> bool:
        """Adds full-shape adapter weights (tensor parallel: every rank its shard)."""
        return self._pool_change(Command("add", (weights,)))

    def adapter_to_device(self, name: str) -> int | None:
        """Makes a loaded adapter resident now (AdapterPool.to_device: its slot, or None when every
        slot is held)."""
        return self._pool_change(Command("to_device", (name,)))

    def offload_adapter(self, name: str) -> None:
        return self._pool_change(Command("offload", (name,)))

    def _pool_change(self, command: Command):
        """An adapter-pool change: here and now in one process; tensor parallel, on every rank's
        engine thread at the same step (the loop must run), so slots and LRU order stay alike."""
        return self.adapters.run(command) if self.tp is None else self._call(command, timeout=120.0)

    def set_mode(self, mode: Mode, merged: str | None = None, timeout: float = 120.0) -> None:
        """UNMERGED, or MERGED/MIXTURE holding `merged` folded into the base weights. Runs on the
        engine thread at the next step boundary (running requests keep going: their LoRA term
        follows the new weights); returns once applied."""
        self._call(Command("apply_mode", (mode, self.adapters.check_mode(mode, merged))), timeout=timeout)

    def switch(self, to: str, expected: str | None = None, timeout: float = 120.0) -> bool:
        """Replaces the merged adapter by `to` in one in-place pass, keeping the mode (MERGED or
        MIXTURE). False when `to` is already merged (nothing done). FailedPrecondition when no
        adapter is merged, or when `expected` is given and is not the merged adapter."""
        self.pool.get(to)
        return self._call(Command("switch", (to, expected or None)), timeout=timeout)

    def _call(self, command: Command, timeout: float):
        """Runs `command` on the engine thread between steps; returns its result or raises its error."""
        self._check_leader()
        if not self.alive:
            raise WorkerUnavailable("the engine is not running", reason="ENGINE_DOWN")
        return self.inbox.call(command, timeout)

    def _check_leader(self) -> None:
        if not self.leader:
            raise FailedPrecondition(
                "a tensor-parallel follower takes no requests or commands; rank 0 does", reason="TP_FOLLOWER"
            )

    # -- requests ----------------------------------------------------------------------------
    def prepare(self, request: WorkRequest, processed: tuple[dict, list[VisionItem]] | None = None) -> PreparedRequest:
        """Validates and tokenizes a request (RequestIntake.prepare; any thread, CPU work)."""
        return self.intake.prepare(request, processed)

    def submit(self, prep: PreparedRequest, sink, deadline: float | None = None) -> RequestHandle:
        """Queues a prepared request; `sink(event)` is called on the engine thread. Past `deadline`
        (time.monotonic()) the engine drops it at the next step boundary with DEADLINE_EXCEEDED."""
        self._check_leader()
        if not self.alive:
            raise WorkerUnavailable("the engine is not running", reason="ENGINE_DOWN")
        req = prep.request
        if req.adapter:
            weights = self.pool.get(req.adapter)  # AdapterNotFound when not loaded
            if req.output_kind == OutputKind.LABEL and req.head not in weights.heads:
                raise invalid_field(
                    "item.head",
                    f"adapter {req.adapter} has no head {req.head!r} (heads: {sorted(weights.heads)})",
                    reason="UNKNOWN_HEAD",
                )
        with self._wake:
            if len(self.sched.incoming) + len(self.sched.waiting) >= self.config.max_waiting:
                raise CapacityExceeded(
                    f"worker queue is full ({self.config.max_waiting} waiting)",
                    reason="WORKER_QUEUE_FULL",
                    retry_after_s=0.5,
                )
            handle = RequestHandle(req.request_id, self._wake, deadline)
            seq = Sequence(id=next(self._ids), prep=prep, sink=sink, handle=handle)
            self.sched.incoming.append(seq)
            self._wake.notify_all()
        return handle

    def generate(self, request: WorkRequest, timeout: float = 120.0) -> tuple[list[str], GenerationResult]:
        """Blocking convenience (tests, tools): runs one request, returns (deltas, result)."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(self.prepare(request), events.put)
        deltas = []
        while True:
            ev = events.get(timeout=timeout)
            if isinstance(ev, TextDelta):
                deltas.append(ev.text)
            elif isinstance(ev, Finished):
                return deltas, ev.result
            else:
                raise ev.error

    @property
    def running_count(self) -> int:
        """Sequences admitted and not finished, as of the last step (never waits on the loop)."""
        with self._stats_lock:
            return self._running_count

    @property
    def kv_usage(self) -> float:
        """Share of the KV pool's usable blocks in use as of the last step, 0 to 1 (never waits on
        the loop; adapters' runs in the pool count as in use)."""
        with self._stats_lock:
            used = self._kv_bytes
        return used / max(1, self.kv.usable_blocks * self.kv_pool.block_bytes)

    def stats(self) -> EngineStats:
        waiting = self.sched.queued()
        with self._stats_lock:
            running, kv_bytes, last_step_ms = self._running_count, self._kv_bytes, self._last_step_ms
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_cache_bytes=kv_bytes,
            max_batch_size=self.config.max_batch_size,
            mode=self.adapters.mode,
            merged_adapter=self.lora.merged or "",
            resident_adapters=self.pool.resident_names(),
            host_adapters=self.pool.host_names(),
            device=str(self.device),
            alive=self.alive,
            last_step_ms=last_step_ms,
            image_cache=self.vision.cache.stats(),
        )

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            if self.tp is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this thread's collectives (NCCL) on the rank's device
            with torch.inference_mode():
                while not self.inbox.stopping:
                    self.beat = time.monotonic()
                    self._step()
                self.decoder.flush()  # the last launched step's tokens reach their requests before the rest fail
        except BaseException as exc:  # the engine is dead; health must say so
            self._error = exc
            log.error("engine_died", error=repr(exc))
            raise
        finally:
            err = WorkerUnavailable("the worker engine stopped", reason="ENGINE_DOWN")
            for s in self.sched.take_everyone():
                self.sched.release_adapter(s)
                self.kv.close(s.id)
                self.outputs.emit(s, Failed(err))
            self.graphs.release()
            self.trace.close()
            self._update_stats()

    def _step(self) -> None:
        self.trace.begin(self.sched)
        if self.tp is not None:
            self.inbox.sync()
        # a command runs between fully processed steps, as without pipelining
        self.inbox.run_commands(self.adapters.run, before=self.decoder.flush)
        if self.tp is not None:
            self.outputs.agree()  # rows failed on one rank since the last step's agreements: on every rank
        now = self.inbox.step_time()
        self.sched.admit(lambda s: self.inbox.halted(s, now), self._fail_waiting, now, take_incoming=self.tp is None)
        self._drop_cancelled()
        if not self.sched.active():
            self._update_stats()
            if not self.leader:
                return  # a follower idles in the next step's broadcast, until rank 0's events
            self.inbox.idle()
            return
        t0 = time.perf_counter()
        batch = self.sched.take_prefills(now)
        tokens = sum(s.prefill_to - s.prefilled for s in batch)  # this step's prefill pieces (before they run)
        self.trace.taken(batch)
        decoding = len(self.sched.running)
        decoded = list(self.sched.running)
        if batch and self.mixed is not None and self._ride(batch, decoded):
            self.trace.mark("prefill")  # one forward: prefill and decode
        else:
            if batch:  # a pending decode step stays pending (overlapping this host work) until the decode below
                self.outputs.guard(batch, self.prefiller.run, batch)
                self.outputs.agree()  # tensor parallel: rows the hand-off failed on one rank decode on none
            self.trace.mark("prefill")
            decoded = list(self.sched.running)
            if decoded:
                self.outputs.guard(decoded, self.decoder.step)
        self.trace.mark("decode")
        if self.device.type == "cuda" and not self.decoder.pending:
            torch.cuda.synchronize(self.device)  # step time is GPU time too (the logits' .item() syncs anyway)
        self.trace.mark("sync")
        self.trace.end(len(decoded))
        # step_log / last_step_ms: a step that leaves a decode step pending does not wait for it;
        # its time ends once it has launched it (and taken the previous step's tokens), the rest
        # counts in the next step's. In steady pipelined decoding a step's time is thus the interval
        # between consecutive steps' tokens reaching the host (the decode rate, not one forward's
        # latency); consecutive step times still add up to wall time.
        ms = (time.perf_counter() - t0) * 1e3
        self.step_log.append((len(batch), decoding, ms))
        self.step_tokens.append(tokens + len(decoded))
        self.steps += 1
        self._update_stats(step_ms=ms)

    def _ride(self, batch: list[Sequence], decoded: list[Sequence]) -> bool:
        """Whether the step's prefill and decode ran as one forward (mixed_step.py). An error
        outside that forward (a failed forward falls back by itself) fails the step's rows."""
        rode: list[bool] = []
        return not self.outputs.guard(batch + decoded, lambda: rode.append(self.mixed.run(batch))) or rode[0]

    def _fail_waiting(self, s: Sequence, error: ValoraError | None) -> None:
        """A waiting request that will not run: `error`, or (None) why it was halted."""
        self.outputs.emit(s, Failed(error or self.inbox.halt_error(s)))

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for s in [s for s in self.sched.active() if self.inbox.halted(s, now)]:
            self.sched.finish(s)
            self.outputs.emit(s, Failed(self.inbox.halt_error(s)))

    def _update_stats(self, step_ms: float | None = None) -> None:
        with self._stats_lock:
            self._running_count = len(self.sched.active())
            self._kv_bytes = self.kv.used_blocks * self.kv_pool.block_bytes
            if step_ms is not None:
                self._last_step_ms = step_ms
