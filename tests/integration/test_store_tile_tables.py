"""AdapterStoreService.PutTileTable / GetTileTable on both backends (SQLite, PostgreSQL), and the
upload tool (`python -m valora.tile_tables push`)."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb

from kernels.tile_table import TileConfig, TileTable
from services.adapter_store.testing import RunningStore
from services.adapter_store.tile_tables import MAX_TILE_TABLE_BYTES

GPU, ARCH, DTYPE = "NVIDIA H200", "sm90", "bfloat16"


def make_table(split_k: int = 4, gpu: str = GPU, arch: str = ARCH, dtype: str = DTYPE) -> TileTable:
    return TileTable(
        gpu, arch, dtype, {"3584x3584/r16/t16/s16": TileConfig(16, 64, 4, split_k, 16, 256)}, {"source": "test"}
    )


def table_text(t: TileTable) -> str:
    return json.dumps(t.to_json(), indent=1) + "\n"


def put(rs, text: str, gpu: str = GPU, arch: str = ARCH, dtype: str = DTYPE):
    return rs.store.PutTileTable(
        store_pb.PutTileTableRequest(gpu_name=gpu, gpu_arch=arch, dtype=dtype, table_json=text)
    ).table


def get(rs, gpu: str = GPU, arch: str = ARCH, dtype: str = DTYPE):
    return rs.store.GetTileTable(store_pb.GetTileTableRequest(gpu_name=gpu, gpu_arch=arch, dtype=dtype)).table


def error_of(fn, *args, **kw):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    err = info.value
    status = rpc_status.from_call(err)
    fields = []
    for d in status.details if status else []:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            fields = [v.field for v in br.field_violations]
    return err.code(), fields


@pytest.fixture
def store(store_env):
    with RunningStore(store_env.settings()) as rs:
        yield rs


def test_put_get_round_trip_latest_wins(store):
    assert error_of(get, store)[0] == grpc.StatusCode.NOT_FOUND
    text = table_text(make_table())
    first = put(store, text)
    assert first.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert (first.gpu_name, first.gpu_arch, first.dtype, first.table_json) == (GPU, ARCH, DTYPE, text)
    got = get(store)
    assert got.table_json == text and got.sha256 == first.sha256
    assert TileTable.from_json(json.loads(got.table_json)).lookup(3584, 3584, 16, 16, 16).split_k == 4

    text2 = table_text(make_table(split_k=8))
    second = put(store, text2)
    assert second.sha256 != first.sha256
    assert second.create_time == first.create_time
    assert second.update_time.ToDatetime() >= first.update_time.ToDatetime()
    got = get(store)
    assert (got.sha256, got.table_json) == (second.sha256, text2)
    # other keys are separate
    assert error_of(get, store, dtype="float16")[0] == grpc.StatusCode.NOT_FOUND
    put(store, table_text(make_table(dtype="float16")), dtype="float16")
    assert get(store).sha256 == second.sha256


@pytest.mark.parametrize("case", ["not_json", "not_table", "bad_entry", "key_mismatch", "too_large", "no_key"])
def test_put_rejects_invalid(store, case):
    good = table_text(make_table())
    kw = {}
    if case == "not_json":
        text = "{not json"
    elif case == "not_table":
        text = json.dumps({"gpu": GPU})
    elif case == "bad_entry":
        d = make_table().to_json()
        d["entries"]["3584x3584/r16/t16/s16"]["backend"] = "nope"
        text = json.dumps(d)
    elif case == "key_mismatch":
        text, kw = good, {"arch": "sm80"}
    elif case == "too_large":
        d = make_table().to_json()
        d["meta"]["pad"] = "x" * MAX_TILE_TABLE_BYTES
        text = json.dumps(d)
    else:
        text, kw = good, {"gpu": ""}
    code, fields = error_of(put, store, text, **kw)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fields == (["gpu_name"] if case == "no_key" else ["table_json"])
    assert error_of(get, store)[0] == grpc.StatusCode.NOT_FOUND  # nothing stored


def test_push_cli(store, tmp_path, capsys):
    from valora.tile_tables import main, push_table

    path = tmp_path / "t.json"
    make_table().save(path)
    assert main(["push", str(path), "--store", store.address]) == 0
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha in capsys.readouterr().out
    assert get(store).sha256 == sha

    make_table(split_k=16).save(path)
    assert push_table(store.address, path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert get(store).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["push", str(bad), "--store", store.address]) == 2


def test_worker_fetcher_against_the_store(store, tmp_path):
    """The worker's store client (AdapterFetcher.get_tile_table): NOT_FOUND is None, a stored
    table comes back, an unreachable store is a ValoraError (not a raw grpc.RpcError)."""
    import asyncio

    from services.common.errors import ValoraError
    from services.worker.store_client import AdapterFetcher

    async def fetch(address):
        f = AdapterFetcher(address, tmp_path / "cache")
        try:
            return await f.get_tile_table(GPU, ARCH, DTYPE, timeout_s=5)
        finally:
            await f.close()

    assert asyncio.run(fetch(store.address)) is None
    text = table_text(make_table())
    put(store, text)
    got = asyncio.run(fetch(store.address))
    assert got.table_json == text and got.sha256 == hashlib.sha256(text.encode()).hexdigest()
    with pytest.raises(ValoraError):
        asyncio.run(fetch("127.0.0.1:1"))
