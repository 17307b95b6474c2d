"""The step's multi-LoRA term on the ATMM CUDA kernel (kernels.atmm), when it can run it.

One `AtmmPlan` (device segment metadata) is written per step and one `LoraWeights` table per
projection holds the step's LoRA entries in kernel slots. An entry (an adapter, or a mixture
term) keeps its kernel slot across steps, so weights are (re)registered only when a new entry
appears; slots are recycled least-recently-used. A projection an entry does not target gets a
shared zero term of rank 8 (the kernel reads one plan for every layer).

A LoraGroup (q/k/v, gate/up: one input, one concatenated output) runs as ONE call over each
entry's block-diagonal factors (`lora.group_tensors`) on a plan per group name, whose workspace
stride is that group's summed rank; when some entry's summed rank is over the kernel's limit the
group runs per part, into column views of its output, on the projections' own tables.

Folded projections (`enable_fold`, EngineConfig.lora_fold_rows): a projection's weight sits in a
buffer with spare rows below it (`reserve_lora_rows`), which hold the step's entries' A^T, each
slot at a column offset shared by every layer of that projection kind. One GEMM over
[W; A_1^T; ...; A_n^T] then gives y and every entry's x·A together, and only the expand runs
(`kernels.atmm.atmm_expand_xa_`): one launch and one read of x fewer per projection. Used where
the tile table picks our own shrink + expand for the step's shape (decode steps; the Triton
kernels win prefill, which keeps the unfolded path), when the entries' rows fit the spare rows.

`begin(step)` returns False when the kernel cannot take the step (fp32 model, a rank that is not
a multiple of 8 or is over the kernel's limit, a permuted batch, too many segments or tokens):
the layers then use the torch reference for that step, with the same semantics.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F

from kernels.tile_table import segment_bucket
from services.worker.lora import LayerModule, LoraEntry, StepLora, group_tensors

_OWN_EXPAND = ("", "cuda")  # tile-table backends whose expand is our kernel (the fold keeps the table's tiles)


class AtmmBackend:
    def __init__(
        self,
        features: dict[LayerModule, tuple[int, int]],
        device: torch.device,
        dtype: torch.dtype,
        max_entries: int = 32,
        max_segments: int = 64,
        max_tokens: int = 16384,
        groups: dict[LayerModule, tuple[LayerModule, ...]] | None = None,
    ) -> None:
        from kernels import atmm

        self._atmm = atmm
        self.max_entries = max_entries
        self.plan = atmm.AtmmPlan(max_segments, max_tokens, device)
        # LoraGroups (group key -> part keys): one call over block-diagonal factors (lora.group_tensors),
        # on a plan per group name (same segments; the workspace strided by that group's summed ranks)
        self.groups = dict(groups or {})
        self.group_plans = {
            name: atmm.AtmmPlan(max_segments, max_tokens, device) for name in sorted({g[1] for g in self.groups})
        }
        self.grouped: set[str] = set()  # group names run as one call this step (summed ranks fit the kernel)
        features = dict(features)
        for g, parts in self.groups.items():
            features[g] = (features[parts[0]][0], sum(features[k][1] for k in parts))
        self._sizes = {g: [features[k][1] for k in parts] for g, parts in self.groups.items()}
        self.weights = {
            k: atmm.LoraWeights(max_entries, fin, fout, dtype, device) for k, (fin, fout) in features.items()
        }
        self._zeros = {
            k: (torch.zeros(fin, 8, dtype=dtype, device=device), torch.zeros(8, fout, dtype=dtype, device=device))
            for k, (fin, fout) in features.items()
        }
        self._slots: OrderedDict[int, tuple[LoraEntry, int]] = OrderedDict()  # id(entry) -> (entry, slot); LRU
        self._slot_entries: dict[int, LoraEntry] = {}  # slot -> the entry whose tensors every table holds there
        self._entry_group_ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # folding (enable_fold): modules by key, their keys by kind, spare rows per module
        self.device = torch.device(device)
        self.fold_rows = 0
        self._fold_modules: dict[LayerModule, object] = {}
        self._fold_kinds: dict[str, list[LayerModule]] = {}
        self._fold_alloc: dict[str, dict[int, tuple[int, int]]] = {}  # kind -> slot -> (column, rows)
        self._fold_cols: dict[str, torch.Tensor] = {}  # kind -> int32 column per slot, on the device
        self._fold_host: dict[str, list[int]] = {}
        self._fold_written: dict[LayerModule, dict[int, tuple[torch.Tensor, int]]] = {}  # slot -> (A, column)
        self._fold_sig: dict[str, tuple] = {}
        self._fold_rank_cache: dict[str, tuple[int, list[int]]] = {}
        self._sync_version = 0  # bumped whenever _sync_weights changes a table
        self.folded: dict[str, tuple[int, object, object]] = {}  # this step: kind -> (rows used, config, plan)
        self.folded_calls = 0

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return False
        try:
            from kernels.atmm import extension
        except ImportError:
            return False
        return extension() is not None

    def _slot_for(self, entry: LoraEntry, busy: set[int]) -> int | None:
        got = self._slots.get(id(entry))
        if got is not None and got[0] is entry:
            self._slots.move_to_end(id(entry))
            return got[1]
        used = {s for _, s in self._slots.values()}
        free = next((s for s in range(self.max_entries) if s not in used), None)
        if free is None:
            victim = next((k for k, (_, s) in self._slots.items() if s not in busy), None)
            if victim is None:
                return None
            free = self._slots.pop(victim)[1]
        self._slots[id(entry)] = (entry, free)
        return free

    def begin(self, step: StepLora) -> bool:
        """Maps the step's entries to kernel slots and writes its plan; False: use the reference."""
        plan = step.plan
        if step.perm is not None or len(plan.seg_slots) > self.plan.seg_cap or plan.num_tokens > self.plan.max_tokens:
            return False
        ranks = [e.rank for e in step.entries]
        if any(r <= 0 or r % 8 or r > self._atmm.MAX_RANK for r in ranks):
            return False
        busy: set[int] = set()
        slots = []
        for e in step.entries:
            s = self._slot_for(e, busy)
            if s is None:
                return False
            busy.add(s)
            slots.append(s)
        seg_slots = [slots[k] if k >= 0 else -1 for k in plan.seg_slots]
        table = [0] * self.max_entries
        for s, r in zip(slots, ranks):
            table[s] = r
        per_entry = [self._group_ranks(e) for e in step.entries]
        group_ranks = {name: [ranks[name] for ranks in per_entry] for name in self.group_plans}
        grouped = {name for name, rs in group_ranks.items() if all(r <= self._atmm.MAX_RANK for r in rs)}
        if grouped != self.grouped:
            self._slot_entries = {}  # group tables to fill (or skip) anew
        self.grouped = grouped
        self._sync_weights(step.entries, slots)
        self.plan.update(plan.seg_starts, seg_slots, table)
        for name in grouped:
            for s, r in zip(slots, group_ranks[name]):
                table[s] = max(r, 8)  # 0: the entry targets no part, its slot holds the rank-8 zero term
            self.group_plans[name].update(plan.seg_starts, seg_slots, table)
        self._fold_step(slots)
        return True

    def enable_fold(self, modules: dict[LayerModule, object], rows: int) -> None:
        """Fold the shrink of these modules (LoraLinear / LoraGroup, each `reserve_lora_rows(rows)`
        already) into their base GEMM from the next `begin` on."""
        self.fold_rows = rows
        self._fold_modules = dict(modules)
        self._fold_kinds = {}
        for key in sorted(modules):
            self._fold_kinds.setdefault(key[1], []).append(key)
        self._fold_written = {key: {} for key in modules}
        for kind in self._fold_kinds:
            self._fold_alloc[kind] = {}
            self._fold_host[kind] = [0] * self.max_entries
            self._fold_cols[kind] = torch.zeros(self.max_entries, dtype=torch.int32, device=self.device)

    def _fold_step(self, slots: list[int]) -> None:
        """Decides which kinds run folded this step and writes their rows (see module doc)."""
        self.folded = {}
        if not self.fold_rows or not slots:
            return
        for kind, keys in self._fold_kinds.items():
            plan = self.group_plans.get(kind, self.plan)
            if kind in self.group_plans and kind not in self.grouped:
                continue  # this group runs per part this step
            w0 = self.weights[keys[0]]
            config = None
            if self.device.type == "cuda":
                config = self._atmm.default_table(self.device, w0.dtype).lookup(
                    w0.h_in, w0.h_out, plan.rank_stride, plan.num_tokens, plan.active_segments
                )
                if config.backend not in _OWN_EXPAND:
                    continue
            need = {s: self._fold_ranks(kind)[s] for s in slots}
            cols = self._fold_allocate(kind, need)
            if cols is None:
                continue  # the step's entries do not fit the spare rows: unfolded
            # GEMM width: the step's rows rounded up to a multiple of 64 (at most the spare rows),
            # so another mix of the same entries mostly keeps the width (and the decode graph);
            # the extra rows' x·A is unused
            rows = max(cols[s] + need[s] for s in slots)
            self.folded[kind] = (min(self.fold_rows, -(-rows // 64) * 64), config, plan)
            sig = (self._sync_version, tuple((s, cols[s]) for s in slots))
            if self._fold_sig.get(kind) == sig:
                continue  # same entries in the same rows as the last step that wrote them
            self._fold_sig[kind] = sig
            for key in keys:
                module, w, written = self._fold_modules[key], self.weights[key], self._fold_written[key]
                base = module.out_features
                for s in slots:
                    a, col = w.a[s], cols[s]
                    prev = written.get(s)
                    if prev is None or prev[0] is not a or prev[1] != col:
                        module.w_ext[base + col : base + col + a.shape[1]].copy_(a.t())
                        written[s] = (a, col)

    def _fold_ranks(self, kind: str) -> list[int]:
        """Rows each slot needs in this kind: its largest rank over the kind's layers (an adapter
        may target some layers only). Recomputed only after the tables changed."""
        got = self._fold_rank_cache.get(kind)
        if got is None or got[0] != self._sync_version:
            tables = [self.weights[k].ranks for k in self._fold_kinds[kind]]
            got = self._fold_rank_cache[kind] = (self._sync_version, [max(r) for r in zip(*tables)])
        return got[1]

    def _fold_allocate(self, kind: str, need: dict[int, int]) -> dict[int, int] | None:
        """Column (spare-row offset) per slot for this step: kept where the slot already has
        enough rows, else first fit; slots not in the step give way when space runs out."""
        alloc = self._fold_alloc[kind]
        for s, r in need.items():
            if s in alloc and alloc[s][1] < r:
                del alloc[s]

        def place(s: int) -> bool:
            col = 0
            for c, n in sorted(alloc.values()):
                if c - col >= need[s]:
                    break
                col = max(col, c + n)
            if col + need[s] > self.fold_rows:
                return False
            alloc[s] = (col, need[s])
            for key in self._fold_kinds[kind]:  # rows of other slots that this placement overwrites
                written = self._fold_written[key]
                for o in [o for o, (a, c) in written.items() if o != s and c < col + need[s] and col < c + a.shape[1]]:
                    del written[o]
            return True

        for s in sorted(set(need) - set(alloc), key=lambda s: -need[s]):
            if place(s):
                continue
            for other in [o for o in alloc if o not in need]:
                del alloc[other]
            if not place(s):
                alloc.clear()
                if sum(need.values()) > self.fold_rows:
                    return None
                for t in sorted(need, key=lambda s: -need[s]):
                    place(t)
                break
        host = self._fold_host[kind]
        cols = {s: alloc[s][0] for s in need}
        if any(host[s] != c for s, c in cols.items()):
            for s, c in cols.items():
                host[s] = c
            staged = torch.tensor(host, dtype=torch.int32)
            self._fold_cols[kind].copy_(
                staged.pin_memory() if self.device.type == "cuda" else staged, non_blocking=True
            )
        return cols

    def folded_linear(self, key: LayerModule, x: torch.Tensor, module) -> torch.Tensor | None:
        """y = module's projection of x plus the step's multi-LoRA term, with the shrink folded
        into the base GEMM; None when this projection is not folded this step. y is a view (row
        stride out + rows) of the GEMM's output."""
        got = self.folded.get(key[1])
        if got is None or key not in self._fold_modules:
            return None
        rows, config, plan = got
        n = module.out_features
        xf = x.reshape(-1, x.shape[-1])
        y_ext = F.linear(xf, module.w_ext[: n + rows], None if module.b_ext is None else module.b_ext[: n + rows])
        y = y_ext[:, :n]
        self._atmm.atmm_expand_xa_(
            y,
            y_ext[:, n:],
            self._fold_cols[key[1]],
            plan,
            self.weights[key],
            host_cols=self._fold_host[key[1]],
            config=config,
        )
        self.folded_calls += 1
        return y.view(*x.shape[:-1], n)

    def _group_ranks(self, entry: LoraEntry) -> dict[str, int]:
        """Group name -> the entry's largest summed rank over that group's layers. Kept per entry
        (an entry's tensors never change): walking every layer's parts cost ~2% of a served
        worker's engine thread when done at every step."""
        ranks = self._entry_group_ranks.get(entry)
        if ranks is None:
            ranks = {
                name: max(
                    sum(t[0].shape[1] for k in parts if (t := entry.tensors(k)) is not None)
                    for g, parts in self.groups.items()
                    if g[1] == name
                )
                for name in self.group_plans
            }
            self._entry_group_ranks[entry] = ranks
        return ranks

    def _sync_weights(self, entries: list[LoraEntry], slots: list[int]) -> None:
        """Puts every entry's tensors in its slot of every projection's table — here, before the
        forward, so `run` only launches (a captured decode graph replays launches, not Python).
        Only slots whose entry changed are written: a served step's entries are mostly those of
        the previous steps, in the slots they had (a full pass over the ~200 tables x entries
        took ~5 ms of a 7B worker's step)."""
        todo = [(e, s) for e, s in zip(entries, slots) if self._slot_entries.get(s) is not e]
        if not todo:
            return
        for key, w in self.weights.items():
            parts = self.groups.get(key)
            if parts is not None and key[1] not in self.grouped:
                continue  # synced on the first step that runs this group as one call
            for e, s in todo:
                t = e.tensors(key) if parts is None else group_tensors(e, parts, self._sizes[key])
                a, b, scale = (*self._zeros[key], 0.0) if t is None else t
                if w.a[s] is not a or w.b[s] is not b or w.scales[s] != scale:
                    w.set(s, a, b, scale, flush=False)
            w.flush()  # one async copy per table, before the forward (and outside any graph capture)
        self._slot_entries.update((s, e) for e, s in todo)
        self._sync_version += 1

    def launch_key(self) -> tuple:
        """What a CUDA graph of the step's launches must match for a later plan: tokens and rank
        strides (tensor shapes, workspace layout, the shrink's rank block), the folded kinds with
        their GEMM widths and tiles, and the segment bucket that the tile table is keyed by.
        Every backend's kernels read segments and tile offsets from the plan's device metadata and
        walk their items grid-stride, so a graph captured for one adapter mix stays correct for any
        other (`test_atmm_cuda_graph_replays_new_plans`); exact segment and tile counts only sized
        the grids, and keying on them made every new mix an eager warm-up step and a capture
        (16-17 new keys per ~235 decode steps of a served 7B worker, scale-7b-h200x2-27fd175.json)."""
        p = self.plan
        # active > 0: without LoRA rows atmm_ launches nothing (and segment_bucket(0) == segment_bucket(1))
        return (
            p.num_tokens,
            p.active_segments > 0,
            segment_bucket(p.active_segments),
            p.rank_stride,
            tuple((name, self.group_plans[name].rank_stride) for name in sorted(self.grouped)),
            tuple((kind, f[0], f[1]) for kind, f in sorted(self.folded.items())),
        )

    def run(self, key: LayerModule, y: torch.Tensor, x: torch.Tensor, step: StepLora) -> None:
        self._atmm.atmm_(y, x if x.is_contiguous() else x.contiguous(), self.plan, self.weights[key])

    def run_group(
        self, group: LayerModule, parts: tuple[LayerModule, ...], y: torch.Tensor, x: torch.Tensor, step: StepLora
    ) -> None:
        """A LoraGroup's term into its concatenated output y: one call, or one per part (into
        column views of y) when some entry's summed rank is over the kernel's limit."""
        x = x if x.is_contiguous() else x.contiguous()
        if group[1] in self.grouped:
            self._atmm.atmm_(y, x, self.group_plans[group[1]], self.weights[group])
            return
        for key, col in zip(parts, y.split(self._sizes[group], dim=1)):
            self._atmm.atmm_(col, x, self.plan, self.weights[key])
