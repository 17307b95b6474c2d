"""CUDA graphs of the engine's forwards, keyed by shape: what the decode step (decode_graphs.py)
and the packed prefill (prefill_graphs.py) share.

A forward of a 7B model launches a couple of thousand kernels from Python (HF layers, LoRA,
attention); replayed from a CUDA graph it costs one launch. A `GraphSet` keeps one `GraphEntry`
per key — the shapes the forward's launches depend on — whose input buffers the caller fills
with the step's data (asynchronous copies) before `run`:

- a key's first run is its warm-up, without a graph (lazy initialisation and kernel compilation
  happen outside any capture), its second captures, later ones replay;
- captures are thread-local: the worker's other threads (request preparation, adapter staging
  into pinned memory) keep calling CUDA while the engine thread captures, and a global capture
  fails on such a call — both the capture and the other thread's work (serve-h200-7b9279e.json:
  no capture succeeded in 1334 static steps);
- a capture that fails is retried at the key's next runs; after `MAX_CAPTURE_FAILURES` the key
  runs without a graph for good (each failure logged and counted);
- the most recently used `max_graphs` entries are kept; every set of one runner captures into
  one memory pool (the forwards run one after another on one stream).

`capture=False` (CPU, or graphs off) runs every forward eagerly through the same buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import structlog
import torch

log = structlog.get_logger()
MAX_CAPTURE_FAILURES = 3  # failed captures after which a key runs without a graph


def bucket_rows(n: int) -> int:
    """The smallest bucket >= n: a power of two or 1.5 times one (1, 2, 3, 4, 6, 8, 12, ...)."""
    if n <= 2:
        return max(n, 1)
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 else p


REFERENCE = "reference"  # the LoRA key of a step the torch reference takes: never captured


def lora_launch_key(runtime, step) -> tuple | str | None:
    """The LoRA part of a forward's graph key: None without LoRA rows, the ATMM backend's launch
    key (the host values its launches depend on) when the kernel took the step, else REFERENCE
    (the torch reference slices on the host, so such forwards run without a graph)."""
    if step is None or not step.active:
        return None
    return runtime.backend.launch_key() if step.kernel else REFERENCE


@dataclass(eq=False)
class GraphEntry:
    """One key's graph and what its forward returned (tensors the graph's replays overwrite)."""

    graph: torch.cuda.CUDAGraph | None = None
    out: tuple | None = None
    seen: int = 0
    graphless: bool = False
    failures: int = 0  # failed captures of this key


class GraphSet:
    def __init__(self, name: str, device: torch.device, capture: bool, max_graphs: int, pool_handle=None) -> None:
        """`name`: the forward's, in log lines; `pool_handle`: the memory pool to capture into
        (torch.cuda.graph_pool_handle(); None: a pool of this set's own)."""
        self.name = name
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.max_graphs = max_graphs
        self.pool_handle = (pool_handle or torch.cuda.graph_pool_handle()) if self.capture else None
        self.entries: OrderedDict[tuple, GraphEntry] = OrderedDict()
        # observability + tests
        self.static_steps = 0  # forwards run through an entry
        self.replays = 0
        self.captures = 0
        self.new_keys = 0  # entries made (each costs a warm-up forward without a graph, then a capture)
        self.warmup_steps = 0  # a key's first forward
        self.eager_steps = 0  # forwards after their key's warm-up that ran without a graph while capturing
        self.capture_failures = 0
        self.reference_steps = 0  # LoRA forwards the kernel backend did not take (graph-less by design)

    def entry(self, key: tuple, make: Callable[[], GraphEntry], graphless: bool = False) -> GraphEntry:
        """The key's entry (`make()` when new; `graphless`: it never captures), most recent last."""
        e = self.entries.get(key)
        if e is None:
            e = make()
            e.graphless = not self.capture or graphless
            self.entries[key] = e
            self.new_keys += 1
            while len(self.entries) > self.max_graphs:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return e

    def run(self, e: GraphEntry, forward: Callable[[GraphEntry], tuple]) -> tuple:
        """One forward of the entry (its buffers filled): replayed, captured or eager. Returns
        the forward's outputs, owned by the entry: read them (or queue their copy) before its
        next run.

        A forward that raises (the engine fails or retries its rows: prefiller.py) leaves the
        entry and the counters as they were: a warm-up that failed is not a warm-up (the next run
        warms up again instead of capturing over uninitialised state), and a capture that failed
        because the forward itself fails, run eagerly right after, is not held against the key
        (it would go graph-less for good after three such forwards)."""
        warmup = e.seen == 0
        capture_failed = False
        if not warmup and e.graph is None and not e.graphless:
            capture_failed = not self._capture(e, forward)
        if e.graph is not None:
            e.graph.replay()
            self.replays += 1
        else:
            try:
                e.out = forward(e)
            except BaseException:
                if capture_failed:
                    self._forgive(e)
                raise
            if not warmup and self.capture:
                self.eager_steps += 1
        e.seen += 1
        self.static_steps += 1
        self.warmup_steps += warmup
        return e.out

    def _capture(self, e: GraphEntry, forward: Callable[[GraphEntry], tuple]) -> bool:
        """Captures the entry's graph (its first replay follows); False when the capture failed
        (nothing kept: the caller runs the forward eagerly)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool_handle, capture_error_mode="thread_local"):
                out = forward(e)
        except Exception as exc:  # this forward runs without a graph; the key retries
            e.failures += 1
            e.graphless = e.failures >= MAX_CAPTURE_FAILURES
            self.capture_failures += 1
            log.warning(
                f"{self.name}_graph_capture_failed", error=repr(exc)[:500], failures=e.failures, graphless=e.graphless
            )
            torch.cuda.synchronize(self.device)
            return False
        e.graph, e.out = graph, out
        self.captures += 1
        return True

    def _forgive(self, e: GraphEntry) -> None:
        """Takes back the capture failure just counted: the eager forward after it failed too,
        so the forward failed, not the capture."""
        e.failures -= 1
        e.graphless = e.failures >= MAX_CAPTURE_FAILURES
        self.capture_failures -= 1

    def release(self) -> None:
        """Frees every captured graph (at the engine's stop). A graph that captured NCCL
        collectives keeps the communicator busy: destroy_process_group hangs while one is alive
        (pytorch/pytorch#115388). Entries without graphs are kept (tests read their keys)."""
        if self.capture:
            torch.cuda.synchronize(self.device)
            self.entries.clear()
