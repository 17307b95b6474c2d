"""The engine driving a tensor-parallel group (EngineConfig.tp) on CPU: 2 processes, gloo on loopback.

Rank 0 runs one scenario through its Engine — requests with images and mixed adapters (unmerged),
a sampled request with a random seed, requests arriving while others decode, a mode switch to
merged then mixture in the middle, a cancellation, a request past its deadline, an adapter made
resident ahead of its requests and one offloaded at the end, and (CPU) a request whose third
decode step raises on every rank, batched and then alone (decoder.py: the step's rows decoded one
by one in lockstep, that row failed) — while rank 1 runs its Engine as a follower. The same
scenario on a single-process engine is the reference: the greedy tokens and finish reasons must
agree. Followers have no sinks; what each would have emitted (recorded under its _emit) must equal
rank 0's events, and both ranks must have run the same steps. Then, on the same group, forwards
that raise on rank 1 only (`_local_failures`): their requests fail on both ranks, the others go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import exit_rank
from services.common.errors import FailedPrecondition, WorkerUnavailable
from services.worker import tensor_parallel as tpm
from services.worker.engine import Engine, EngineConfig
from services.worker.requests import Failed, Finished, TextDelta, WorkRequest
from services.common.modes import Mode
from services.worker.sampling import SamplingParams
from services.worker.testing import random_adapter_bundle, random_image
from tests.unit.test_engine_decode_failure import failing_decode

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2
A, B, C = "adapters/alpha/versions/1", "adapters/beta/versions/2", "adapters/gamma/versions/1"
SAMPLED = "s0"  # seed 0: a random seed, so only the TP ranks agree with each other
CANCELLED = "long"
EXPIRED = "late"
POISONED = "p0"  # its decode steps raise from the third on, on every rank (CPU: hooks do not run in a replay)
BAD_PREFILL, BAD_DECODE = "bad-prefill", "bad-decode"  # their forwards raise on rank 1 only
BAD_ACCEPT = "bad-accept"  # taking its second token raises on rank 1 only
BAD_VISION = "bad-vision"  # the vision tower raises on rank 1 only for its image's grid (84 px: 6x6 patches)
# making the LoRA plan of a forward holding it raises on rank 1 only: any forward (BAD_PLAN), its decode steps
# (BAD_DECODE_PLAN) — host work before the forward, which every rank must still agree on
BAD_PLAN, BAD_DECODE_PLAN = "bad-plan", "bad-decode-plan"
# the last command: making A resident (it is: nothing changes on rank 0) raises on rank 1 only
FAILING_COMMAND = ("to_device", (A,))


def _config(model_path, tp=None, device: str = "cpu") -> EngineConfig:
    # CPU: "static" decode, so the pipelined decode path runs too (no graph capture); CUDA: decode
    # steps captured as CUDA graphs, the ranks' NCCL all-reduces inside them.
    return EngineConfig(
        model_path=Path(model_path),
        max_batch_size=8,
        device_slots=3,
        default_max_new_tokens=8,
        decode_graphs="static" if device == "cpu" else "auto",
        tp=tp,
        device=device,
    )


def _outcome(event) -> list:
    if isinstance(event, Finished):
        r = event.result
        return ["finished", r.token_ids, r.finish_reason.value, r.mode.value]
    return ["failed", event.error.reason]


def _poisoned(eng: Engine, device: str):
    """On CPU: POISONED's decode steps raise from the third on (the same steps on every rank)."""
    if device != "cpu":
        return contextlib.nullcontext()
    return failing_decode(eng, "layer", lambda ids: POISONED in ids, after=2)


def _scenario(eng: Engine, model_path, device: str = "cpu") -> dict[str, list]:
    """Drives `eng` (rank 0 or a single process); returns each request's outcome."""
    for i, (name, modules) in enumerate(((A, None), (B, None), (C, ("q_proj", "v_proj")))):
        kw = {"target_modules": modules} if modules else {}
        b = random_adapter_bundle(model_path, rank=4 * (i + 1), lora_alpha=8, seed=i + 1, **kw)
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
    assert eng.adapter_to_device(C) is not None
    sinks: dict[str, queue.Queue] = {}
    handles = {}

    def submit(rid, adapter, image, max_new=0, sampling=None, deadline=None):
        req = WorkRequest(
            request_id=rid,
            prompt=f"describe {rid}",
            images=[random_image(image)],
            adapter=adapter,
            max_new_tokens=max_new,
            sampling=sampling or SamplingParams(),
        )
        sinks[rid] = q = queue.Queue()
        handles[rid] = eng.submit(eng.prepare(req), q.put, deadline)

    def first_delta(rid):
        ev = sinks[rid].get(timeout=60)
        assert isinstance(ev, TextDelta), ev
        sinks[rid].put(ev)  # back for the final wait (order among its events does not matter there)

    with eng._wake:  # one step admits the whole first batch
        submit("a0", A, 0)
        submit("b0", B, 1)
        submit("base0", None, 2)
        submit(SAMPLED, A, 3, sampling=SamplingParams(temperature=0.9, top_k=20))
        submit(CANCELLED, B, 4, max_new=200)
        if device == "cpu":
            submit(POISONED, B, 11)
    first_delta("a0")
    submit("c1", C, 5)  # arrive while the first batch decodes
    submit("a1", A, 6)
    eng.set_mode(Mode.MERGED, A)
    submit("b2", B, 7)  # mixture entries (x - m) and the merged adapter's rows
    submit("base2", None, 8)
    first_delta(CANCELLED)
    handles[CANCELLED].cancel()
    eng.set_mode(Mode.MIXTURE, B)
    submit(EXPIRED, C, 9, deadline=time.monotonic() - 1)
    submit("a3", A, 10)
    out = {}
    for rid, q in sinks.items():
        while True:
            ev = q.get(timeout=120)
            if not isinstance(ev, TextDelta):
                out[rid] = _outcome(ev)
                break
    eng.offload_adapter(C)
    return out


@contextlib.contextmanager
def _failing_on_rank_1(eng: Engine, rank: int):
    """Rank 1's forwards raise from a middle decoder layer (the layers before it ran their
    all-reduces; rank 0 then waits in the next one): every prefill forward holding BAD_PREFILL,
    every decode step holding BAD_DECODE; taking BAD_ACCEPT's second token raises (the output
    code's guard fails that row, on rank 1); so does the vision tower over BAD_VISION's image, the
    LoRA plan of every forward holding BAD_PLAN and of every decode step holding BAD_DECODE_PLAN,
    and FAILING_COMMAND. Rank 0's run as usual."""
    if rank != 1:
        yield
        return
    current: list[str] = []
    runner = eng.runner
    saved = {name: runner.__dict__.get(name) for name in ("prefill", "decode")}
    accept = eng.outputs.accept

    def accepting(s, token, logprobs=None):
        if s.req.request_id == BAD_ACCEPT and len(s.tokens) == 1:
            raise RuntimeError("injected accept failure on rank 1 only")
        return accept(s, token, logprobs)

    encode_items = eng.vision.tower.encode_items

    def encoding(items):
        if any(tuple(grid) == (1, 6, 6) for _, grid in items):
            raise RuntimeError("injected vision tower failure on rank 1 only")
        return encode_items(items)

    plan = eng.lora.plan

    def planning(seqs, tokens_per_row, pad_rows=0):
        ids = {s.req.request_id for s in seqs}
        if BAD_PLAN in ids or (BAD_DECODE_PLAN in ids and tokens_per_row == 1):
            raise RuntimeError("injected LoRA plan failure on rank 1 only")
        return plan(seqs, tokens_per_row, pad_rows)

    run_command = eng.adapters.apply

    def commanding(command):
        if (command.name, command.args) == FAILING_COMMAND:
            raise RuntimeError("injected command failure on rank 1 only")
        return run_command(command)

    def tracked(name):
        inner = getattr(runner, name)

        def run(rows, *args, **kwargs):
            current[:] = [f"{name}:{s.req.request_id}" for s in rows]
            try:
                return inner(rows, *args, **kwargs)
            finally:
                current.clear()

        return run

    def boom(module, args):
        for phase, rid in (("prefill", BAD_PREFILL), ("decode", BAD_DECODE)):
            if f"{phase}:{rid}" in current:
                raise RuntimeError(f"injected {phase} failure on rank 1 only")

    layers = eng.model.model.language_model.layers
    runner.prefill, runner.decode = tracked("prefill"), tracked("decode")
    eng.outputs.accept = accepting
    eng.adapters.apply = commanding
    eng.vision.tower.encode_items = encoding
    eng.lora.plan = planning
    hook = layers[len(layers) // 2].register_forward_pre_hook(boom)
    try:
        yield
    finally:
        hook.remove()
        del eng.outputs.accept, eng.adapters.apply, eng.vision.tower.encode_items, eng.lora.plan
        for name, fn in saved.items():
            if fn is None:
                runner.__dict__.pop(name, None)
            else:
                setattr(runner, name, fn)


LOCAL = {
    "ref-base": ("base", None, 0),
    "ref-lora": ("lora", A, 1),
    "base": ("base", None, 0),
    "lora": ("lora", A, 1),
    BAD_PREFILL: (BAD_PREFILL, A, 2),
    BAD_DECODE: (BAD_DECODE, None, 3),
    BAD_ACCEPT: (BAD_ACCEPT, None, 4),
    "after": ("lora", A, 1),
    "vision": ("vision", A, 5),
    BAD_VISION: (BAD_VISION, None, (6, 84)),
    "vision-again": ("vision", A, 5),
    "plan-ok": ("lora", A, 1),
    BAD_PLAN: (BAD_PLAN, A, 7),
    BAD_DECODE_PLAN: (BAD_DECODE_PLAN, A, 8),
}
# request id -> (prompt, adapter, image: random_image's seed, or (seed, size))


def _local_failures(eng: Engine) -> dict[str, list]:
    """Rank 0, after the scenario: two requests alone (the reference), the same two batched with
    the bad ones, then one more; each request's outcome (a failure's with its error)."""

    def together(ids: list[str]) -> dict[str, list]:
        sinks = {}
        with eng._wake:  # one step admits them all: they prefill and decode together
            for rid in ids:
                prompt, adapter, image = LOCAL[rid]
                image = random_image(*image) if isinstance(image, tuple) else random_image(image)
                req = WorkRequest(
                    request_id=rid, prompt=f"describe {prompt}", images=[image], adapter=adapter, max_new_tokens=5
                )
                sinks[rid] = q = queue.Queue()
                eng.submit(eng.prepare(req), q.put)
        out = {}
        for rid, q in sinks.items():
            while not isinstance(ev := q.get(timeout=60), (Finished, Failed)):
                pass
            out[rid] = _outcome(ev) + ([str(ev.error)] if isinstance(ev, Failed) else [])
        return out

    return (
        together(["ref-base", "ref-lora"])
        | together(["base", "lora", BAD_PREFILL, BAD_DECODE, BAD_ACCEPT])
        | together(["after"])
        | together(["vision", BAD_VISION])
        | together(["vision-again"])
        | together(["plan-ok", BAD_PLAN, BAD_DECODE_PLAN])
    )


def _rank(rank: int, world: int, port: int, model_path: str, out_dir: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    if device == "cpu":
        tp = tpm.init_tp_group(rank, world, port, backend="gloo", timeout_s=60)
        # The step events on a group of their own, as init_tp_group sets up beside an NCCL group.
        tp = dataclasses.replace(tp, object_group=dist.new_group(backend="gloo"))
    else:  # NCCL on cuda:<rank>, gloo beside it for the step events
        device = f"cuda:{rank}"
        tp = tpm.init_tp_group(rank, world, port, device=torch.device(device), timeout_s=120)
    try:
        eng = Engine(_config(model_path, tp, device))
        # The fused layers' projection groups concatenate this rank's column-parallel shards.
        attn = eng.model.model.language_model.layers[0].self_attn
        assert attn.qkv_proj.sizes == [p.base.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        full = sum(eng.shapes.features[m][1] for m in ("q_proj", "k_proj", "v_proj"))
        assert sum(attn.qkv_proj.sizes) == full // world
        would_emit: dict[str, list] = {}
        if rank:
            emit = eng.outputs.emit

            def record(s, event):
                assert s.sink is None
                if isinstance(event, (Finished, Failed)):
                    would_emit[s.req.request_id] = _outcome(event)
                emit(s, event)

            eng.outputs.emit = record
        eng.start()
        local = device == "cpu"  # rank-local failures: CPU (hooks do not run in a replay)
        with _poisoned(eng, device), _failing_on_rank_1(eng, rank if local else 0):
            if rank == 0:
                got = _scenario(eng, model_path, device)
                if local:
                    got_local = _local_failures(eng)
                    # a command that fails on rank 1 only: the ranks' adapters would differ from
                    # then on (no step can undo it): both engines stop, its caller hears at once
                    with pytest.raises(WorkerUnavailable, match="engine stopped"):
                        eng.adapter_to_device(A)
                eng.stop()
            else:
                with pytest.raises(FailedPrecondition, match="follower"):
                    eng.submit(None, print)
                eng.stop(timeout=300)  # returns once rank 0's stop reached this rank's loop
                got = {rid: o for rid, o in would_emit.items() if rid not in LOCAL}
                got_local = {rid: o for rid, o in would_emit.items() if rid in LOCAL}
        assert not eng._thread.is_alive()
        if local:  # the failed command ended both engines (the worker then goes NOT_SERVING)
            assert isinstance(eng._error, tpm.GroupBroken), eng._error
            assert "command to_device failed on tensor-parallel rank(s) [1] only" in str(eng._error)
        else:
            assert eng._error is None
        s = eng.stats()
        summary = {
            "outcomes": got,
            "steps": [list(x[:2]) for x in eng.step_log],
            "mode": s.mode.value,
            "merged": s.merged_adapter,
            "host": s.host_adapters,
            "resident": s.resident_adapters,
            "pipelined": eng.decoder.pipelined_steps,
            "isolated": [eng.decoder.isolated_steps, eng.decoder.failed_rows],
            "prefill_isolated": [eng.prefiller.isolated_batches, eng.prefiller.failed_rows],
        }
        if local:  # the follower's outcomes have no error text (Failed's reason only)
            summary["local"] = {rid: o[:2] if o[0] == "failed" else o for rid, o in got_local.items()}
            if rank == 0:
                summary["local_errors"] = {rid: o[2] for rid, o in got_local.items() if o[0] == "failed"}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()
    exit_rank()  # results written: skip the teardown, where a finished rank once died (SIGABRT in gloo)


def test_tp2_engine_matches_single_process_engine(model_path, tmp_path):
    check_tp2_against_single_process(model_path, tmp_path, "cpu")


def check_tp2_against_single_process(model_path, tmp_path, device: str) -> None:
    """The scenario on 2 ranks (gloo on CPU; NCCL on cuda:0 and cuda:1) against one process on
    `device` (cuda: cuda:0)."""
    mp.spawn(
        _rank, args=(WORLD, tpm.free_loopback_port(), str(model_path), str(tmp_path), device), nprocs=WORLD, join=True
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    lead, follower = ranks
    errors = lead.pop("local_errors", {})
    # Lockstep: the same steps (prefill rows, decode rows), the same final state, and every event
    # the follower computed (but did not emit) equal to rank 0's, the sampled request's included.
    assert follower == lead
    assert lead["mode"] == Mode.MIXTURE.value and lead["merged"] == B
    assert lead["host"] == sorted([A, B]) and lead["resident"] == sorted([A, B])
    assert lead["outcomes"][CANCELLED] == ["failed", "CANCELLED"]
    assert lead["outcomes"][EXPIRED] == ["failed", "DEADLINE_EXCEEDED"]
    if device == "cpu":  # CUDA fp32: LoRA steps run eager (the torch reference is not capturable)
        assert lead["pipelined"] > 0
        # one step raised for the poisoned row: every rank decoded its rows alone, failed that row only
        assert lead["outcomes"][POISONED] == ["failed", "ENGINE_STEP_FAILED"]
        # Then forwards that raised on rank 1 only, in the middle of the model: rank 0 did not wait
        # in the all-reduce rank 1 left (the run ended), each failed request failed on both ranks
        # with rank 1's error, the requests batched with them got the tokens they get without them,
        # the next request ran. Before, rank 0 waited there until the group's timeout while rank 1
        # retried the rows alone in collectives that no longer matched.
        local = lead["local"]
        assert set(errors) == {BAD_PREFILL, BAD_DECODE, BAD_ACCEPT, BAD_VISION, BAD_PLAN, BAD_DECODE_PLAN}, local
        for rid, phase in ((BAD_PREFILL, "prefill"), (BAD_DECODE, "decode")):
            assert local[rid] == ["failed", "ENGINE_STEP_FAILED"]
            assert "tensor-parallel rank 1 of 2" in errors[rid], errors[rid]
            assert f"injected {phase} failure on rank 1 only" in errors[rid], errors[rid]
        # a row the output code failed on rank 1 only is failed on rank 0 too, before the next
        # step's rows are chosen (else the ranks' batches differ: the collectives mismatch)
        assert local[BAD_ACCEPT] == ["failed", "ENGINE_STEP_FAILED"], local
        assert "failed on tensor-parallel rank 1" in errors[BAD_ACCEPT], errors[BAD_ACCEPT]
        assert "injected accept failure on rank 1 only" in errors[BAD_ACCEPT], errors[BAD_ACCEPT]
        assert local["base"] == local["ref-base"] and local["lora"] == local["ref-lora"], local
        assert local["after"] == local["ref-lora"] and local["base"][0] == "finished", local
        # the tower raised on rank 1 for a batch of two fresh images: no rank cached that batch's
        # features (else their hits, deciding what rank 0 broadcasts, would differ: the retries
        # alone would hang); the good image's request ran, and its features were cached on both
        assert local[BAD_VISION] == ["failed", "ENGINE_STEP_FAILED"], local
        assert "injected vision tower failure on rank 1 only" in errors[BAD_VISION], errors[BAD_VISION]
        assert local["vision"][0] == "finished" and local["vision-again"] == local["vision"], local
        # a LoRA plan that raised on rank 1 only, before any device work: rank 0 did not go on
        # into the forward (it would wait in an all-reduce rank 1 never joins, or pair its
        # collectives with the retries'); the plan's row failed on both ranks, the others ran
        for rid in (BAD_PLAN, BAD_DECODE_PLAN):
            assert local[rid] == ["failed", "ENGINE_STEP_FAILED"], local
            assert "injected LoRA plan failure on rank 1 only" in errors[rid], errors[rid]
        assert local["plan-ok"] == local["ref-lora"], local
        # each raised batched, then alone: every rank ran the same rows alone, failed the same one
        assert lead["isolated"] == [3, 3] and lead["prefill_isolated"] == [3, 3]

    single = Engine(_config(model_path, device=device))
    single.start()
    try:
        with _poisoned(single, device):
            ref = _scenario(single, model_path, device)
    finally:
        single.stop()
    assert set(ref) == set(lead["outcomes"])
    for rid, want in ref.items():
        if rid == SAMPLED:
            assert lead["outcomes"][rid][0] == "finished"
            continue
        got = lead["outcomes"][rid]
        # Tokens and finish reason; the mode a request reports depends on when the switch landed.
        assert got[:3] == want[:3], rid


def test_a_follower_orders_requests_by_rank_0s_clock():
    """Requests with latency objectives are ordered by which ones are already late at the step's
    time (step_scheduler.earliest_due_first): a follower takes rank 0's broadcast clock, never its
    own, so every rank builds the same prefill batches."""
    import collections
    import threading
    from types import SimpleNamespace

    from services.worker.inbox import Inbox

    class FollowerGroup:
        rank, world_size = 1, 2

        def broadcast_object(self, msg):
            assert msg is None  # a follower sends nothing
            return ([], [], {}, False, 123.5)  # new requests, commands, halts, stop, rank 0's clock

    sched = SimpleNamespace(waiting=collections.deque(), incoming=collections.deque())
    inbox = Inbox(sched, threading.Condition(), FollowerGroup())
    inbox.sync()
    assert inbox.step_time() == 123.5
