"""Tile tables into the adapter store (AdapterStoreService.PutTileTable), blocking: what
`kernels.tile_search` wrote, for the workers of that GPU/arch/dtype to fetch at start-up.

    python -m valora.tile_tables push kernels/tile_tables/nvidia_h200-sm90-bfloat16.json --store HOST:PORT

Plaintext gRPC (the store's internal port); imports no torch. It lives here, not in `kernels/`,
which imports no service API.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernels.tile_table import TileTable

MAX_MESSAGE_BYTES = 64 << 20


def _stub(address: str):
    import grpc
    from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc

    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    return channel, store_grpc.AdapterStoreServiceStub(channel)


def push_table_json(address: str, table_json: str, timeout_s: float = 30.0):
    """Uploads a table's JSON text as is (its gpu/arch/dtype are the key); the stored
    valora.internal.v1.TileTable (with its sha256)."""
    from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb

    d = json.loads(table_json)
    channel, stub = _stub(address)
    try:
        return stub.PutTileTable(
            store_pb.PutTileTableRequest(
                gpu_name=d.get("gpu", ""), gpu_arch=d.get("arch", ""), dtype=d.get("dtype", ""), table_json=table_json
            ),
            timeout=timeout_s,
        ).table
    finally:
        channel.close()


def push_table(address: str, table: TileTable | str | Path, timeout_s: float = 30.0):
    """Uploads `table` (a TileTable or a JSON file's path); the stored table message."""
    text = json.dumps(table.to_json(), indent=1) + "\n" if isinstance(table, TileTable) else Path(table).read_text()
    return push_table_json(address, text, timeout_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m valora.tile_tables", description="Tile tables in the adapter store.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    push = sub.add_parser("push", help="upload a tile-table JSON file (its gpu/arch/dtype are the key)")
    push.add_argument("file", type=Path)
    push.add_argument("--store", required=True, help="adapter store address, host:port")
    push.add_argument("--timeout-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    import grpc

    try:
        TileTable.load(args.file)  # fail here on a bad file, before the network
        t = push_table(args.store, args.file, args.timeout_s)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{args.file}: not a tile table: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"store {args.store}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(f"stored {t.gpu_name} {t.gpu_arch} {t.dtype}: sha256 {t.sha256}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
