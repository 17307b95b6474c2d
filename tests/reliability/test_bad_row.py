"""One bad row among co-batched streams (issue 20): 8 streams through the gateway, scheduler and
worker (in this process, real gRPC hops, so the test can hold the engine until all 8 are queued
and make one row's forward raise), prefilled in one forward. The forward raises for one row (a
pre-hook on the last decoder layer, as a row whose input breaks the model would): that row fails
alone, a clear INTERNAL naming the engine's error, and the 7 others stream to the end the tokens
they get alone (services/worker/prefiller.py: a failed batched forward is prefilled again row by
row). Nothing stays held in the engine or the scheduler. The same 8 once more, the bad row's third
decode step raising instead (batched, then alone: services/worker/decoder.py decodes a failed
step's rows one by one): it fails after its first tokens, the 7 others stream what they get alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.reliability.conftest import InProcessStack, record
from tests.reliability.images import png
from tests.unit.test_engine_decode_failure import failing_decode
from tests.unit.test_engine_prefill import failing_prefill
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e
ROWS, BAD, MAX_NEW = 8, "poisoned-3", 12


@pytest.fixture(scope="module")
def stack(model_path):
    s = InProcessStack(
        model_path,
        max_batch_size=ROWS,
        worker_overrides={"max_prefills_per_step": ROWS},
        scheduler_overrides={"max_queue": 64},
    )
    yield s
    s.close()


def requests() -> list[inf.InferStreamRequest]:
    """8 different streams: text only and with one or two images, prompts of different lengths."""
    prompts = [
        "Hi.",
        "Describe it.",
        "What colour is the square?",
        "Count the shapes.",
        "Tell a story about digits and colours, with every detail.",
        "Which digit?",
        "Why?",
        "Name three things in the picture and where they are.",
    ]
    out = []
    for i, prompt in enumerate(prompts):
        images = [types_pb2.Image(data=png(10 + i + k)) for k in range(i % 3)]
        rid = BAD if i == 3 else f"row-{i}"
        out.append(
            inf.InferStreamRequest(
                request_id=rid,
                input=inf.InferenceInput(
                    prompt=prompt,
                    images=images,
                    params=types_pb2.GenerationParams(max_new_tokens=MAX_NEW, logprobs=True),
                ),
            )
        )
    return out


def stream(stub, req) -> dict:
    """What the client saw: code, text deltas, the result's token ids, error reason/details."""
    deltas, t0 = [], time.monotonic()
    try:
        for resp in stub.InferStream(req, timeout=120):
            if resp.text_delta:
                deltas.append(resp.text_delta)
            if resp.HasField("result"):
                r = resp.result
                return {
                    "code": "OK",
                    "text": r.text,
                    "deltas": "".join(deltas),
                    "tokens": [t.token_id for t in r.logprobs],
                    "finish": r.finish_reason,
                    "s": time.monotonic() - t0,
                }
        return {"code": "NO_RESULT", "deltas": "".join(deltas)}
    except grpc.RpcError as err:
        info = error_details_pb2.ErrorInfo()
        status = rpc_status.from_call(err)
        reason = next((info.reason for d in (status.details if status else ()) if d.Unpack(info)), "")
        return {
            "code": err.code().name,
            "reason": reason,
            "details": err.details(),
            "deltas": "".join(deltas),
            "s": time.monotonic() - t0,
        }


def together(stack, stub, reqs) -> list[dict]:
    """The streams sent at once while the engine loop is held, released once the worker's engine
    has all of them queued: its next step admits and prefills them together."""
    engine, gate = stack.engine, threading.Event()
    step = engine._step

    def held():
        gate.wait(60)
        step()

    engine._step = held
    try:
        with ThreadPoolExecutor(len(reqs)) as ex:
            futures = [ex.submit(stream, stub, r) for r in reqs]
            deadline = time.monotonic() + 60
            while engine.stats().waiting < len(reqs) and time.monotonic() < deadline:
                time.sleep(0.01)
            queued = engine.stats().waiting
            del engine._step
            gate.set()
            out = [f.result() for f in futures]
    finally:
        engine.__dict__.pop("_step", None)
        gate.set()
    assert queued == len(reqs), f"only {queued} of {len(reqs)} reached the engine together"
    return out


def settle(stack, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = stack.engine.stats()
        held = {
            "running": st.running,
            "waiting": st.waiting,
            "kv_cache_bytes": st.kv_cache_bytes,
            **stack.run(_scheduler_state(stack)),
        }
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def p50(rows: list[dict]) -> float:
    return round(sorted(r["s"] for r in rows)[len(rows) // 2], 3)


async def _scheduler_state(stack):
    return stack.scheduler_state()


def test_one_bad_row_leaves_its_seven_co_batched_streams_finishing(stack):
    engine, reqs = stack.engine, requests()
    with grpc.insecure_channel(stack.address) as ch:
        stub = inf_grpc.InferenceServiceStub(ch)
        alone = {r.request_id: stream(stub, r) for r in reqs}  # the reference: each stream by itself
        assert all(a["code"] == "OK" and a["tokens"] for a in alone.values()), alone
        clean = together(stack, stub, reqs)  # the control: the same 8 together, nothing failing
        engine.prefiller.isolated_batches = engine.prefiller.failed_rows = 0
        layer = engine.model.model.language_model.layers[-1]
        with failing_prefill(engine, layer, lambda ids: BAD in ids) as calls:
            got = together(stack, stub, reqs)
        held = settle(stack)
        after = stream(stub, reqs[3])  # the poisoned request, without the fault: served
    by_id = dict(zip((r.request_id for r in reqs), got))
    bad = by_id.pop(BAD)
    same = {
        rid: g["code"] == "OK"
        and g["tokens"] == alone[rid]["tokens"]
        and g["deltas"] == g["text"] == alone[rid]["text"]
        for rid, g in by_id.items()
    }
    clean_same = sum(c["code"] == "OK" and c["tokens"] == alone[r.request_id]["tokens"] for r, c in zip(reqs, clean))
    batched = [sorted(c) for c in calls]
    passed = (
        sum(same.values()) == ROWS - 1
        and bad["code"] == "INTERNAL"
        and bad["reason"] == "ENGINE_STEP_FAILED"
        and not bad["deltas"]
        and not any(held.values())
        and engine.alive
        and after["code"] == "OK"
    )
    record(
        "bad-row",
        "co-batched streams that finish with the tokens they get alone when one row's forward fails",
        sum(same.values()),
        f"{ROWS - 1} of {ROWS - 1}; the bad row INTERNAL, alone",
        passed,
        rows=ROWS,
        bad_status=bad["code"],
        bad_reason=bad["reason"],
        bad_details=bad["details"][:200],
        forwards_that_raised=batched,
        isolated_batches=engine.prefiller.isolated_batches,
        failed_rows=engine.prefiller.failed_rows,
        control_same_tokens=clean_same,
        stream_p50_s={"together": p50(clean), "together_one_failing": p50(list(by_id.values()))},
        held_after=held,
        tokens_each=MAX_NEW,
    )
    assert batched == [sorted(r.request_id for r in reqs), [BAD]], batched  # one forward of 8, then the row alone
    assert clean_same == ROWS, clean
    assert all(same.values()), {rid: (g, alone[rid]) for rid, g in by_id.items() if not same[rid]}
    assert bad["code"] == "INTERNAL" and bad["reason"] == "ENGINE_STEP_FAILED", bad
    assert "injected prefill failure" in bad["details"] and not bad["deltas"], bad
    assert (engine.prefiller.isolated_batches, engine.prefiller.failed_rows) == (1, 1)
    assert not any(held.values()), held
    assert engine.alive and after["code"] == "OK" and after["tokens"] == alone[BAD]["tokens"], after


def test_one_row_whose_decode_step_fails_leaves_its_seven_co_batched_streams_finishing(stack):
    engine, reqs = stack.engine, requests()
    with grpc.insecure_channel(stack.address) as ch:
        stub = inf_grpc.InferenceServiceStub(ch)
        alone = {r.request_id: stream(stub, r) for r in reqs}
        assert all(a["code"] == "OK" and a["tokens"] for a in alone.values()), alone
        assert len(alone[BAD]["tokens"]) > 4, alone[BAD]  # alone it decodes past the step that fails below
        engine.decoder.isolated_steps = engine.decoder.failed_rows = 0
        with failing_decode(engine, "layer", lambda ids: BAD in ids, after=2) as calls:
            got = together(stack, stub, reqs)
        held = settle(stack)
        after = stream(stub, reqs[3])
    by_id = dict(zip((r.request_id for r in reqs), got))
    bad = by_id.pop(BAD)
    same = {
        rid: g["code"] == "OK"
        and g["tokens"] == alone[rid]["tokens"]
        and g["deltas"] == g["text"] == alone[rid]["text"]
        for rid, g in by_id.items()
    }
    stepped = [sorted(c) for c in calls]
    passed = (
        sum(same.values()) == ROWS - 1
        and bad["code"] == "INTERNAL"
        and bad["reason"] == "ENGINE_STEP_FAILED"
        and alone[BAD]["text"].startswith(bad["deltas"])
        and not any(held.values())
        and engine.alive
        and after["code"] == "OK"
    )
    record(
        "bad-row-decode",
        "co-batched streams that finish with the tokens they get alone when one row's decode step fails",
        sum(same.values()),
        f"{ROWS - 1} of {ROWS - 1}; the bad row INTERNAL, alone",
        passed,
        rows=ROWS,
        bad_status=bad["code"],
        bad_reason=bad["reason"],
        bad_details=bad["details"][:200],
        bad_streamed_chars=len(bad["deltas"]),
        steps_that_raised=stepped,
        isolated_steps=engine.decoder.isolated_steps,
        failed_rows=engine.decoder.failed_rows,
        stream_p50_s=p50(list(by_id.values())),
        held_after=held,
        tokens_each=MAX_NEW,
    )
    assert stepped == [sorted(r.request_id for r in reqs), [BAD]], stepped  # one step of 8, then the row alone
    assert all(same.values()), {rid: (g, alone[rid]) for rid, g in by_id.items() if not same[rid]}
    assert bad["code"] == "INTERNAL" and bad["reason"] == "ENGINE_STEP_FAILED", bad
    assert "injected decode failure" in bad["details"] and alone[BAD]["text"].startswith(bad["deltas"]), bad
    assert (engine.decoder.isolated_steps, engine.decoder.failed_rows) == (1, 1)
    assert not any(held.values()), held
    assert engine.alive and after["code"] == "OK" and after["tokens"] == alone[BAD]["tokens"], after
