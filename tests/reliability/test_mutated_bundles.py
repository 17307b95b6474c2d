"""Every mutated bundle the store accepts, the worker loads and serves: 300 seeded mutations of a
valid adapter bundle (byte flips anywhere, in the header's JSON or in the tensors' bytes,
truncations, trailing bytes, a wrong header length, a mutated adapter_config_json) go through the
store's check (services/common/adapter_format.validate_bundle, what UploadAdapterVersion runs);
each it accepts is loaded by the worker's loader (services/worker/adapter_weights.parse_bundle) into a
real engine and answers a request. Nothing raises anything but InvalidAdapter on the way in.

Figure: mutations, accepted, accepted that served, crashes (any other exception)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

from services.common.adapter_format import BaseModelShapes, make_random_bundle, validate_bundle
from services.common.errors import InvalidAdapter
from services.worker.engine import Engine, EngineConfig
from services.worker.requests import WorkRequest
from services.worker.testing import TEST_KV_BYTES
from tests.reliability.conftest import record

MUTATIONS = 300


def mutate(rng: random.Random, data: bytes, cfg: str) -> tuple[str, bytes, str]:
    """One seeded mutation: (kind, bundle, config)."""
    header_len = struct.unpack("<Q", data[:8])[0]
    kind = rng.choice(["flip_header", "flip_tensor", "flip_any", "truncate", "append", "header_len", "config"])
    b = bytearray(data)
    if kind == "flip_header":
        i = rng.randrange(8, 8 + header_len)
        b[i] = rng.choice(b'0123456789,:[]{}" abcxyz\n\x00\xff')
    elif kind == "flip_tensor":
        i = rng.randrange(8 + header_len, len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "flip_any":
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
    elif kind == "truncate":
        b = b[: rng.randrange(len(b))]
    elif kind == "append":
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "header_len":
        b[:8] = struct.pack("<Q", max(0, header_len + rng.choice([-8, -1, 1, 8, 1 << 20])))
    else:
        c = json.loads(cfg)
        key = rng.choice(["r", "lora_alpha", "target_modules"])
        c[key] = rng.choice([0, -1, 1e12, "16", None, [], 3.5, True, ["q_proj", "nope"]])
        cfg = json.dumps(c)
    return kind, bytes(b), cfg


def test_every_mutated_bundle_the_store_accepts_serves(model_path):
    shapes = BaseModelShapes.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    good, cfg = make_random_bundle(shapes, rank=4, seed=7)
    rng = random.Random(0)
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            max_batch_size=4,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=2,
            device_slots=2,
        )
    )
    eng.start()
    kinds: dict[str, list[int]] = {}
    accepted = served = 0
    crashes, not_served = [], []
    try:
        for i in range(MUTATIONS):
            kind, data, config = mutate(rng, good, cfg)
            counts = kinds.setdefault(kind, [0, 0])
            counts[0] += 1
            try:
                validate_bundle(data, config, shapes, max_rank=256)
            except InvalidAdapter:
                continue
            except Exception as exc:  # what the figure counts
                crashes.append((kind, repr(exc)[:200]))
                continue
            accepted += 1
            counts[1] += 1
            name = f"adapters/m{i}/versions/1"
            try:
                eng.load_adapter_bytes(name, f"{i:064x}", data, config)
                _, result = eng.generate(WorkRequest(f"m{i}", "Hi.", adapter=name, max_new_tokens=2), timeout=60)
                served += result.output_tokens == 2
                eng.offload_adapter(name)
            except Exception as exc:  # an accepted bundle that does not serve
                not_served.append((kind, repr(exc)[:200]))
    finally:
        eng.stop()
    ok = not crashes and not not_served and served == accepted and accepted > 0
    record(
        "mutated-bundles",
        f"{MUTATIONS} seeded mutations of a valid bundle: accepted by the store's check; of "
        "those, loaded and served by a worker; other exceptions than InvalidAdapter",
        {
            "mutations": MUTATIONS,
            "accepted": accepted,
            "served": served,
            "crashes": len(crashes),
            "not_served": len(not_served),
            "by_kind": {k: {"tried": v[0], "accepted": v[1]} for k, v in kinds.items()},
        },
        "every accepted bundle serves; 0 crashes",
        ok,
        crash_sample=crashes[:5],
        not_served_sample=not_served[:5],
    )
    assert ok, (crashes[:5], not_served[:5], accepted, served)
