"""The LoRA plan of each forward: which entry every row adds on top of the current weights.

An entry is what one segment of rows adds (lora.LoraEntry): a resident adapter's factors
(unmerged), or the deLoRA mixture term when another adapter is merged into the base weights.
`LoraPlanner` is the engine's one owner of that mapping: it knows the merged adapter, keeps the
entries built so far (building one again means new concatenated and block-diagonal factors and
kernel table writes), sorts rows by entry and makes the step's StepLora (reusing the last one
while the rows and entries do not change).
"""

from __future__ import annotations

from services.common.errors import FailedPrecondition
from services.worker.adapter_pool import AdapterPool
from services.worker.lora import AdapterEntry, LoraEntry, LoraRuntime, MixtureEntry, StepLora
from services.common.modes import Mode
from services.worker.sequence import Sequence


class LoraPlanner:
    def __init__(self, pool: AdapterPool, runtime: LoraRuntime) -> None:
        self.pool, self.runtime = pool, runtime
        self.merged: str | None = None  # the adapter folded into the base weights (merged/mixture)
        self.entries: dict[tuple, LoraEntry] = {}
        self._last: tuple | None = None  # (key, StepLora, kernel plan version)

    def spec(self, s: Sequence) -> tuple | None:
        """What this request adds on top of the current weights (None: nothing)."""
        x, m = None if s.released else s.req.adapter or None, self.merged
        if m is None:
            return None if x is None else ("lora", x)
        if x == m:
            return None
        return ("mix", x or "", m)

    def mode(self, s: Sequence) -> Mode:
        if self.merged is None:
            return Mode.UNMERGED if s.req.adapter else Mode.BASE
        return Mode.MERGED if s.req.adapter == self.merged else Mode.MIXTURE

    def sort_key(self, s: Sequence) -> str:
        """Sort key grouping rows that share a LoRA entry ('' first: no LoRA)."""
        spec = self.spec(s)
        return "" if spec is None else "\0".join(spec)

    def _adapter_entry(self, name: str) -> AdapterEntry:
        slot = self.pool.slot_of(name)
        dev = self.pool.slot(slot) if slot is not None else None
        if dev is None:
            raise FailedPrecondition(f"adapter {name} is not resident", reason="ADAPTER_NOT_RESIDENT")
        dev.wait()  # the step's stream after the slot's upload (on the device; the host goes on)
        entry = self.entries.get(("lora", name))
        if entry is None or entry.a is not dev.a:  # slot content changed since it was cached
            # a new resident adapter: first forget the entries of those that left their slots (each
            # holds its adapter's device tensors; with adapters churning they piled up, one per
            # adapter ever served: tests/reliability/test_adapter_churn.py)
            self.drop_stale()
            entry = self.entries[("lora", name)] = AdapterEntry(dev.a, dev.b, dev.weights.scale)
        return entry

    def drop_stale(self) -> None:
        """Keeps the cached LoRA entries across a mode switch (building one again means new
        concatenated and block-diagonal factors and kernel table writes on the next step), except
        those whose adapter left its device slot: they would keep its tensors alive."""

        def resident(name: str, entry: AdapterEntry | None) -> bool:
            slot = self.pool.slot_of(name)
            dev = self.pool.slot(slot) if slot is not None else None
            return dev is not None and entry is not None and entry.a is dev.a

        def live(spec: tuple, entry: LoraEntry) -> bool:
            if spec[0] == "lora":
                return resident(spec[1], entry)
            return (not spec[1] or resident(spec[1], entry.x)) and resident(spec[2], entry.m)

        self.entries = {spec: e for spec, e in self.entries.items() if live(spec, e)}

    def entry(self, spec: tuple) -> LoraEntry:
        if spec[0] == "lora":
            return self._adapter_entry(spec[1])
        x = self._adapter_entry(spec[1]) if spec[1] else None
        m = self._adapter_entry(spec[2])
        entry = self.entries.get(spec)
        if entry is None or entry.x is not x or entry.m is not m:
            if len(self.entries) > 256:
                self.entries.clear()
            entry = self.entries[spec] = MixtureEntry(x, m)
        return entry

    @property
    def last(self) -> StepLora | None:
        """The plan `plan` made (or reused) last."""
        return None if self._last is None else self._last[1]

    def plan(self, seqs: list[Sequence], tokens_per_row: int | list[int], pad_rows: int = 0) -> StepLora:
        """The step's LoRA plan; `tokens_per_row`: every row's token count, or each row's (rows
        packed without padding); `pad_rows`: that many rows in all, the ones past `seqs` (padding
        of a static decode step) in the last row's segment — the kernels' launches depend on
        the token count, and extending a segment keeps the rows sorted by entry."""
        if not isinstance(tokens_per_row, int):
            tokens_per_row = tuple(tokens_per_row)
        entries: list[LoraEntry] = []
        index: dict[tuple, int] = {}
        rows = []
        for s in seqs:
            if not s.released:  # a released request reports the mode its adapter ran in
                s.mode = self.mode(s)
            spec = self.spec(s)
            if spec is None:
                rows.append(-1)
                continue
            if spec not in index:
                index[spec] = len(entries)
                entries.append(self.entry(spec))
            rows.append(index[spec])
        if rows and pad_rows > len(rows):
            rows += [rows[-1]] * (pad_rows - len(rows))
        # Decode steps between membership changes plan the same rows and entries: reuse the last
        # plan (and the kernel plan already on the device, unless a prefill wrote another since).
        backend = self.runtime.backend
        key = (tuple(rows), tuple(map(id, entries)), tokens_per_row)  # ids are safe: the kept plan holds its entries
        last = self._last
        if last is not None and last[0] == key and (not last[1].kernel or backend.plan.version == last[2]):
            return last[1]
        step = StepLora(entries, rows, tokens_per_row)
        if backend is not None and step.active:
            step.kernel = backend.begin(step)
        self._last = (key, step, backend.plan.version if step.kernel else None)
        return step
