"""Mixed steps (EngineConfig.mixed_steps): the running rows' decode step rides in the step's
prefill forward, one token each beside the prefill pieces, instead of a decode forward of its own.

A served 7B step that prefills runs ~2000 packed tokens (~75 ms on an H200) and then a decode
forward of ~100 rows (~15 ms: mostly one more pass over the weights, its LoRA launches and the
sampler; bench/results/h200-serve-29169e2-*/steps-summary.json). Riding, the rows cost what ~100
more tokens of the big forward cost (a few ms), and their tokens are sampled with the prefill's
first tokens in one call.

Nothing else changes: a rider is a piece of one token (its last token embedded, at its next
position and pool slot: ModelRunner.prefill with `Riders`), rows are ordered by LoRA entry as in
any prefill, the attention is the paged prefill kernel's (a rider's query attends to its whole
cached context), and the riders' tokens are handled as a decode step's (decoder.py): held on the
device for the next step when it pipelines — the riders then run from the previous step's pending
tokens, taken on the host once this forward is launched — else taken at once.

A step does not ride (the engine runs the prefill forward, then the decode step, as without mixed
steps) when nobody is running, when a row has penalties (their token counts would have to see
the pending tokens), or when the mixed forward raises: every row is then put back where the step
found it, the pending tokens are taken, and the two forwards run apart — with their own
row-by-row isolation (prefiller.py, decoder.py), so a poisoned row still fails alone.
"""

from __future__ import annotations

import structlog

from services.worker.decoder import Decoder
from services.worker.lora_plans import LoraPlanner
from services.worker.model_runner import ModelRunner, Riders
from services.worker.outputs import OutputProcessor
from services.worker.prefiller import Prefiller
from services.worker.sequence import Sequence
from services.worker.step_scheduler import StepScheduler

log = structlog.get_logger()


class MixedStep:
    def __init__(
        self,
        sched: StepScheduler,
        lora: LoraPlanner,
        runner: ModelRunner,
        outputs: OutputProcessor,
        decoder: Decoder,
        prefiller: Prefiller,
    ) -> None:
        self.sched, self.lora, self.runner, self.outputs = sched, lora, runner, outputs
        self.decoder, self.prefiller = decoder, prefiller
        self.steps = 0  # forwards that prefilled and decoded
        self.fallbacks = 0  # mixed forwards that raised (their rows then ran apart)

    def run(self, batch: list[Sequence]) -> bool:
        """Prefills `batch` (StepScheduler.take_prefills) and decodes every running row in one
        forward; False when the step does not ride (see the module doc): the caller then runs the
        prefill and the decode step apart."""
        dec = self.decoder
        if not self.sched.running or any(s.req.sampling.penalized for s in [*batch, *self.sched.running]):
            return False
        running = sorted(self.sched.running, key=self.lora.sort_key)
        ids, taken = dec.pending_inputs(running), []
        if ids is not None:
            taken, dec.pending = dec.pending, []
        else:
            dec.flush()
            self.outputs.agree()  # tensor parallel: rows the flush failed on one rank leave every rank's batch
            self.sched.reserve_decode()  # may preempt (the youngest rows wait to be prefilled again)
            running = sorted(self.sched.running, key=self.lora.sort_key)
            if not running:
                return False
        rows = sorted([*batch, *running], key=self.lora.sort_key)
        riders = Riders(running, ids)
        ride = set(running)
        counts = [1 if s in ride else s.prefill_to - s.prefilled for s in rows]
        # the forward's padding tokens (prefill_graphs.py) extend the last row's LoRA segment
        counts[-1] += self.runner.prefill_tokens(sum(counts)) - sum(counts)
        lengths = [s.length for s in running]
        before = [(s.prefilled, s.chunk_inputs) for s in batch]
        self.prefiller.starting(batch)
        try:
            done, out = self.runner.prefill(rows, lambda: self.lora.plan(rows, counts), riders)
        except Exception as exc:  # the two forwards apart, each with its row isolation
            for s, n in zip(running, lengths):
                s.length = n
            for s, (prefilled, inputs) in zip(batch, before):
                s.prefilled = prefilled
                s.chunk_inputs = inputs if prefilled else None
            for p in taken:
                dec.take(p)
            self.fallbacks += 1
            log.warning("mixed_step_failed", error=repr(exc)[:500], retry="prefill and decode apart")
            return False
        self.steps += 1
        plan = self.lora.last
        dec.observe(len(running), len({plan.row_entries[i] for i, s in enumerate(rows) if s in ride} - {-1}))
        dec.pending.append(dec.hold(running, riders.tokens, riders.logprobs))
        for p in taken:
            dec.take(p)
        if not dec.holdable(running):
            dec.flush()
        if done:
            self.prefiller.hand_off(done, out)
        return True
