"""One long request beside 31 short streams at batch 32 (issue 19's 16k-token case, scaled to the
tiny Qwen2-VL's 4096 positions): the long prompt is prefilled in chunks while the streams decode,
the pool (smaller than everyone's need) preempts instead of failing, every request finishes with
the tokens it gets in a roomy pool, and every block comes back."""

from __future__ import annotations

from services.worker.engine import Engine, EngineConfig
from services.worker.requests import WorkRequest
from services.worker.testing import random_image
from tests.unit.test_decode_graphs import A, B, run  # the same engine run: adapters loaded, all queued at once

LONG_TOKENS = 3500
SHORT = 31


def requests(long_prompt: str) -> list[WorkRequest]:
    """The streams first (running when the long request arrives), then the long one."""
    reqs = [
        WorkRequest(
            f"s{i}",
            "Describe the image." + " more" * (i % 5),
            [random_image(i)],
            adapter=(None, A, B)[i % 3],
            max_new_tokens=24 + i % 9,
        )
        for i in range(SHORT)
    ]
    return reqs + [WorkRequest("long", long_prompt, raw_prompt=True, adapter=A, max_new_tokens=24)]


def test_a_long_request_beside_31_streams_finishes_in_a_tight_pool(model_path):
    probe = Engine(EngineConfig(model_path=model_path, max_batch_size=1))
    words = "the quick brown fox jumps over the lazy dog " * (LONG_TOKENS // 8)
    n = probe.prepare(WorkRequest("p", words, raw_prompt=True, max_new_tokens=24)).prompt_tokens
    assert 3000 < n < 4000, n
    block_bytes, block = probe.kv_pool.block_bytes, probe.kv.block_size
    reqs = requests(words)
    roomy, _ = run(model_path, reqs, max_batch_size=32)
    # The long request alone needs ~220 blocks of 16 tokens, the streams ~4 each: 300 blocks hold
    # the long one and a few streams at a time.
    need_long = -(-(n + 24) // block)
    tight, eng = run(
        model_path, reqs, max_batch_size=32, max_prefill_tokens=512, kv_cache_bytes=(need_long + 80) * block_bytes
    )
    assert tight == roomy
    assert {rid: len(t) for rid, t in tight.items()} == {r.request_id: r.max_new_tokens for r in reqs}
    chunks_beside_decode = [d for p, d, _ in eng.step_log if p == 1 and d > 0]
    assert len(chunks_beside_decode) >= 3, eng.step_log  # streams decoded between the chunks
    assert eng.kv.used_blocks == 0
