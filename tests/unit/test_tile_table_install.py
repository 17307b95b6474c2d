"""The tile table a CUDA worker uses: `kernels.atmm.use_table` replaces the cached default, and
the worker installs the store's table at start-up (store client faked to steer its answers, CUDA checks
mocked; CPU only). The client against a real store: tests/integration/test_store_tile_tables.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb

from kernels import atmm
from kernels.tile_table import TileConfig, TileTable, find_table
from services.common.errors import WorkerUnavailable
from services.worker.config import WorkerSettings
from services.worker.startup import install_tile_table

H200 = ("NVIDIA H200", "sm90")
SHAPE = (3584, 3584, 16, 16, 16)  # h_in, h_out, rank stride, tokens, segments: a committed bucket
CFG = TileConfig(16, 64, 4, 32, 16, 64)


def store_table(dtype: str = "bfloat16") -> TileTable:
    return TileTable(*H200, dtype, {"3584x3584/r16/t16/s16": CFG}, {"source": "store"})


@pytest.fixture(autouse=True)
def clean_tables(monkeypatch):
    monkeypatch.setattr(atmm, "_tables", {})
    props = SimpleNamespace(name=H200[0], major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


def test_use_table_replaces_the_default():
    committed = atmm.default_table(torch.device("cuda:0"), torch.bfloat16)
    assert committed.entries == find_table(*H200, "bfloat16").entries
    assert committed.lookup(*SHAPE) != CFG
    atmm.use_table("cuda:0", torch.bfloat16, store_table())
    assert atmm.default_table(torch.device("cuda:0"), torch.bfloat16).lookup(*SHAPE) == CFG
    # other devices and dtypes keep theirs
    assert atmm.default_table(torch.device("cuda:1"), torch.bfloat16).lookup(*SHAPE) == committed.lookup(*SHAPE)
    assert atmm.default_table(torch.device("cuda:0"), torch.float16).meta["source"].startswith("empty")


def test_use_table_checks_dtype():
    with pytest.raises(ValueError):
        atmm.use_table("cuda:0", torch.float16, store_table("bfloat16"))
    with pytest.raises(ValueError):
        atmm.use_table("cuda:0", torch.float32, store_table("bfloat16"))


def test_gpu_key():
    assert atmm.gpu_key("cuda:0") == H200


class FakeStore:
    def __init__(self, table: TileTable | None = None, error: Exception | None = None, text: str | None = None):
        self.store_address = "store:1"
        self.calls = []
        self.error = error
        self.text = text if text is not None else (json.dumps(table.to_json()) if table else None)

    async def get_tile_table(self, gpu, arch, dtype, timeout_s=None):
        self.calls.append((gpu, arch, dtype))
        if self.error:
            raise self.error
        if self.text is None:
            return None
        return store_pb.TileTable(gpu_name=gpu, gpu_arch=arch, dtype=dtype, table_json=self.text, sha256="ab")


def install(settings, fake):
    return asyncio.run(install_tile_table(settings, fake))


def lookup():
    return atmm.default_table(torch.device("cuda:0"), torch.bfloat16).lookup(*SHAPE)


def test_worker_installs_the_store_table():
    fake = FakeStore(store_table())
    assert install(WorkerSettings(device="cuda:0", dtype="bfloat16"), fake) == "store"
    assert fake.calls == [("NVIDIA H200", "sm90", "bfloat16")]
    assert lookup() == CFG


@pytest.mark.parametrize(
    "fake, source",
    [
        (FakeStore(None), "committed"),
        (FakeStore(error=WorkerUnavailable("down")), "committed"),
        (FakeStore(text="{bad"), "committed"),
        (FakeStore(store_table("float16")), "committed"),  # wrong dtype: refused, committed stays
    ],
)
def test_worker_keeps_the_committed_table(fake, source):
    assert install(WorkerSettings(device="cuda", dtype="bfloat16"), fake) == source
    assert lookup() == find_table(*H200, "bfloat16").lookup(*SHAPE)


def test_worker_without_store_or_committed_table(monkeypatch):
    fake = FakeStore(store_table())
    fake.store_address = ""
    assert install(WorkerSettings(device="cuda", dtype="bfloat16"), fake) == "committed"
    assert fake.calls == []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="Other", major=8, minor=0))
    assert install(WorkerSettings(device="cuda", dtype="float16"), FakeStore(None)) == "heuristics"


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "float32")])
def test_cpu_and_fp32_workers_do_nothing(monkeypatch, device, dtype):
    monkeypatch.setattr(atmm, "gpu_key", lambda d: pytest.fail("asked for the GPU"))
    fake = FakeStore(store_table())
    assert install(WorkerSettings(device=device, dtype=dtype), fake) is None
    assert fake.calls == []


def test_tensor_parallel_followers_install_the_table_rank_0_got_from_the_store():
    """Rank 0 fetches once; each follower installs that table for its own device (cuda:N + rank)."""
    from services.worker.startup import store_table_json
    from services.worker.tp_ranks import install_leader_table

    settings = WorkerSettings(device="cuda:2", dtype="bfloat16")
    assert install(settings, FakeStore(store_table())) == "store"
    table_json = store_table_json(settings)  # what the worker hands to Followers
    assert TileTable.from_json(table_json).lookup(*SHAPE) == CFG
    install_leader_table(settings, 1, table_json)
    assert atmm.default_table(torch.device("cuda:3"), torch.bfloat16).lookup(*SHAPE) == CFG
    install_leader_table(settings, 2, None)  # rank 0 had no store table: the committed one stays
    assert atmm.default_table(torch.device("cuda:4"), torch.bfloat16).lookup(*SHAPE) == find_table(
        *H200, "bfloat16"
    ).lookup(*SHAPE)
