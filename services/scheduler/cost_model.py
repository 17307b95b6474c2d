"""Execution-time estimates for the scheduler: engine step, LoRA term, mode switch, adapter load.

The credit policy (policies/credit.py) and the simulator (sim.py) share one `CostModel` per worker GPU
profile. A step of the iteration-level engine costs

    step_ms = decode_base_ms + decode_row_ms * rows           (weights + KV read)
            + prefill_ms_per_token * prefill_tokens            (new rows' prompt + image tokens)
            + lora_ops_per_step * atmm_us(T, N) / 1000         (unmerged / mixture rows only)

where the LoRA term runs only over the rows whose adapter is not the merged one (T = their
tokens, N = distinct adapters; a mixture row computes the rank-2r term `[A_x | A_m]`, so its
cost is scaled by `mixture_factor`). A request merged into the base weights pays nothing.

`atmm_us(T, N)` comes from the ATMM bench on the target GPU (bench/results/atmm_*.json,
`amortized_us` of the `atmm` method at h=4096, r=16, uniform adapter mix; the newest headline or
full suite), interpolated log-log in T and N; switch
and merge times from bench/results/switch_*.json (best `ours` config), adapter host→GPU copy
from its `h2d_adapter`. Without those files the documented defaults below are used (the same
numbers, measured on the H200 on 2026-11-29). Step base costs are not measured by any bench
yet: they default to 1.5x the 7B weight-read floor (16.6 GB / 4.22 TB/s ≈ 4 ms, docs/benchmarks.md
§3) and the prefill floor (≈125 ms for 4608 tokens with images → 0.03 ms/token).

No torch, no I/O after construction: policies call it on every decision.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

# (T tokens, N adapters) -> µs of one ATMM op (shrink + expand), H200, h=4096, r=16, bf16,
# amortized over 20 ops in one CUDA graph: bench/results/atmm_headline_e9c7a28.json.
H200_ATMM_US: dict[tuple[int, int], float] = {
    (16, 8): 5.2,
    (64, 8): 6.3,
    (256, 8): 8.5,
    (1024, 8): 18.4,
    (4096, 8): 53.2,
    (16, 64): 6.7,
    (64, 64): 10.4,
    (256, 64): 14.2,
    (1024, 64): 26.1,
    (4096, 64): 56.7,
}


@dataclass(frozen=True)
class CostModel:
    """Estimates in milliseconds for one worker GPU profile (all fields documented defaults)."""

    name: str = "h200-7b"
    # Engine step: fixed part (weights read once per step) and per running row (KV read).
    decode_base_ms: float = 6.0
    decode_row_ms: float = 0.1
    # Prompt processing, per prompt/image token of a newly admitted row.
    prefill_ms_per_token: float = 0.03
    # ATMM ops in one forward: 32 layers x 7 projections (q, k, v, o, gate, up, down).
    lora_ops_per_step: int = 224
    # µs of one ATMM op by (tokens, adapters); interpolated log-log, clamped at the edges.
    atmm_us: Mapping[tuple[int, int], float] = field(default_factory=lambda: dict(H200_ATMM_US))
    # A mixture row computes a rank-2r term: memory bound on x/y, so less than 2x a rank-r one.
    mixture_factor: float = 1.3
    # Merge (nothing merged -> a), unmerge (a -> nothing), switch (a -> b, one pass).
    merge_ms: float = 10.03
    unmerge_ms: float = 10.03
    switch_ms: float = 10.98
    # Host pinned pool -> GPU copy of one adapter (all 7 projections, rank 16).
    load_ms: float = 1.46
    # Tokens of one image (448x448 through Qwen2-VL's merger) and a default prompt length.
    image_tokens: int = 256
    default_prompt_tokens: int = 32
    # Tokens a generation request is assumed to produce when it does not say (max_new_tokens 0).
    default_new_tokens: int = 32
    # Decode batch size the credit estimate assumes for a request's remaining steps.
    typical_batch: int = 8

    def __post_init__(self) -> None:
        by_n: dict[int, list[tuple[int, float]]] = {}
        for (t, n), us in self.atmm_us.items():
            by_n.setdefault(n, []).append((t, us))
        if not by_n:
            raise ValueError("atmm_us needs at least one measured (tokens, adapters) point")
        object.__setattr__(self, "_by_n", [(n, sorted(by_n[n])) for n in sorted(by_n)])
        object.__setattr__(self, "_memo", {})

    # -- kernels -------------------------------------------------------------------------------
    def atmm_op_us(self, tokens: int, adapters: int) -> float:
        """µs of one ATMM op over `tokens` rows spread over `adapters` adapters."""
        if tokens <= 0 or adapters <= 0:
            return 0.0
        key = ("atmm", tokens, adapters)
        hit = self._memo.get(key)
        if hit is None:
            per_n = [(n, _interp_loglog(points, tokens)) for n, points in self._by_n]
            hit = self._memo[key] = _interp_loglog(per_n, adapters)
        return hit

    def lora_ms(self, tokens: int, adapters: int, *, mixture: bool = False) -> float:
        """LoRA term of one forward over `tokens` rows of `adapters` distinct adapters."""
        if tokens <= 0 or adapters <= 0:
            return 0.0
        ms = self.lora_ops_per_step * self.atmm_op_us(tokens, adapters) / 1000.0
        return ms * (self.mixture_factor if mixture else 1.0)

    # -- steps and requests -----------------------------------------------------------------------
    def step_ms(
        self, rows: int, prefill_tokens: int, lora_tokens: int, lora_adapters: int, mixture: bool = False
    ) -> float:
        """One engine step: `rows` sequences, `prefill_tokens` new prompt tokens among them, and
        a LoRA term over `lora_tokens` tokens of `lora_adapters` adapters (0 when merged)."""
        if rows <= 0:
            return 0.0
        return (
            self.decode_base_ms
            + self.decode_row_ms * rows
            + self.prefill_ms_per_token * prefill_tokens
            + self.lora_ms(lora_tokens, lora_adapters, mixture=mixture)
        )

    def prompt_tokens(self, prompt_tokens: int, images: int) -> int:
        return (prompt_tokens or self.default_prompt_tokens) + images * self.image_tokens

    def request_ms(
        self,
        prompt_tokens: int,
        images: int,
        new_tokens: int,
        *,
        label: bool = False,
        lora: bool = True,
        batch: int | None = None,
    ) -> float:
        """Estimated execution time of one request run in a batch of `batch` rows: a prefill
        step, then one decode step per generated token after the first (none for a task-head
        request, which answers from one forward)."""
        b = max(1, batch or self.typical_batch)
        key = ("req", prompt_tokens, images, new_tokens, label, lora, b)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        tokens = self.prompt_tokens(prompt_tokens, images)
        first = self.step_ms(b, tokens, tokens if lora else 0, 1)
        if label:
            ms = first
        else:
            steps = max(0, (new_tokens or self.default_new_tokens) - 1)
            ms = first + steps * self.step_ms(b, 0, b if lora else 0, min(b, 8))
        if len(self._memo) < 100_000:
            self._memo[key] = ms
        return ms

    def switch_cost_ms(self, current: str | None, target: str | None, resident: Iterable[str] = ()) -> float:
        """Time to change the merged adapter from `current` to `target` (None = nothing merged),
        plus the host→GPU copy of `target` when it is not resident."""
        if current == target:
            return 0.0
        load = self.load_ms if target is not None and target not in set(resident) else 0.0
        if current is None:
            return self.merge_ms + load
        if target is None:
            return self.unmerge_ms
        return self.switch_ms + load

    # -- loading measured numbers ---------------------------------------------------------------
    @classmethod
    def from_results(cls, results_dir: str | Path, base: CostModel | None = None) -> CostModel:
        """`base` (default: the H200 profile) with kernel and switch numbers replaced by the newest
        bench/results JSON found in `results_dir`; missing or unreadable files keep the defaults."""
        model = base or cls()
        d = Path(results_dir)
        atmm = _newest([*d.glob("atmm_headline_*.json"), *d.glob("atmm_full_*.json")])
        if atmm is not None:
            table = _atmm_table(atmm)
            if table:
                model = replace(model, atmm_us=table)
        sw = _newest(d.glob("switch_*.json"))
        if sw is not None:
            model = _apply_switch(model, sw)
        return model


# A CPU profile for the tiny embedded Qwen2-VL (2 layers, hidden 64): python-dominated steps,
# LoRA through the torch reference. Rough defaults, measured by nothing yet.
CPU_TINY = CostModel(
    name="cpu-tiny",
    decode_base_ms=12.0,
    decode_row_ms=0.5,
    prefill_ms_per_token=0.05,
    lora_ops_per_step=14,
    atmm_us={(16, 8): 60.0, (1024, 8): 400.0, (16, 64): 120.0, (1024, 64): 800.0},
    mixture_factor=1.5,
    merge_ms=2.0,
    unmerge_ms=2.0,
    switch_ms=2.5,
    load_ms=0.5,
    image_tokens=64,
    typical_batch=4,
)

PROFILES: dict[str, CostModel] = {"h200-7b": CostModel(), "cpu-tiny": CPU_TINY}


def load_profile(name: str, results_dir: str | Path | None = None) -> CostModel:
    """A named profile ("h200-7b", "cpu-tiny"); the H200 one takes measured numbers from
    `results_dir` (bench/results) when given."""
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; known: {sorted(PROFILES)}") from None
    if results_dir is not None and name == "h200-7b":
        return CostModel.from_results(results_dir, base)
    return base


def profile_for_device(device: str, models: Mapping[str, CostModel], default: CostModel) -> CostModel:
    """The profile for a worker reporting `device` ("cuda:0 NVIDIA H200", "cpu"): CPU workers
    get the cpu-tiny profile when there is one, everything else `default`."""
    if device.startswith("cpu") and "cpu-tiny" in models:
        return models["cpu-tiny"]
    return default


# -- helpers ---------------------------------------------------------------------------------------
def _interp_loglog(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise log-log interpolation through sorted (x, y) points, clamped at both ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        # Past the largest measured size the op is bandwidth bound: scale linearly in x.
        return points[-1][1] * (x / xs[-1]) if len(points) > 1 and points[-1][0] >= 1024 else points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def _newest(paths: Iterable[Path]) -> Path | None:
    found = sorted(paths, key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _atmm_table(path: Path) -> dict[tuple[int, int], float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    table: dict[tuple[int, int], float] = {}
    for case in data.get("cases", []):
        try:
            if (
                str(case.get("rank")) != "16"
                or int(case.get("h_in", 0)) != 4096
                or int(case.get("h_out", case.get("h_in", 0))) != 4096
                or case.get("mix", "uniform") != "uniform"
            ):
                continue
            table[(int(case["T"]), int(case["N"]))] = float(case["atmm"]["amortized_us"])
        except (KeyError, TypeError, ValueError):
            continue
    return table


def _apply_switch(model: CostModel, path: Path) -> CostModel:
    try:
        data = json.loads(path.read_text())
        ours = data.get("ours", {})
        best = min(ours.values(), key=lambda v: v["switch_ms"]) if ours else None
    except (OSError, ValueError, KeyError, TypeError):
        return model
    if best is None:
        return model
    changes = {
        "switch_ms": float(best["switch_ms"]),
        "merge_ms": float(best["merge_ms"]),
        "unmerge_ms": float(best["merge_ms"]),
    }
    h2d = data.get("h2d_adapter", {})
    if isinstance(h2d, dict) and "ms" in h2d:
        changes["load_ms"] = float(h2d["ms"])
    return replace(model, **changes)
