"""ATMM tile tables in the store: one `kernels.tile_table.TileTable` JSON per GPU name, arch and
dtype. `python -m valora.tile_tables push` puts them (what kernels.tile_search wrote); CUDA
workers get theirs at start-up. A put replaces the key's table (the latest wins) and reports its
sha256. Blocking; the servicer runs it in its executor. Imports no torch (kernels.tile_table is
plain Python)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import NotFound, invalid_field

from services.adapter_store.models import TileTableRow, utcnow

MAX_TILE_TABLE_BYTES = 8 << 20
_KEY_LIMITS = {"gpu_name": 128, "gpu_arch": 32, "dtype": 16}


@dataclass(frozen=True)
class StoredTileTable:
    gpu_name: str
    gpu_arch: str
    dtype: str
    table_json: str
    sha256: str
    created_at: datetime
    updated_at: datetime


def _stored(row: TileTableRow) -> StoredTileTable:
    return StoredTileTable(
        row.gpu_name, row.gpu_arch, row.dtype, row.table_json, row.sha256, row.created_at, row.updated_at
    )


def check_key(gpu_name: str, gpu_arch: str, dtype: str) -> None:
    for field_path, value in (("gpu_name", gpu_name), ("gpu_arch", gpu_arch), ("dtype", dtype)):
        if not value:
            raise invalid_field(field_path, "required")
        if len(value) > _KEY_LIMITS[field_path]:
            raise invalid_field(field_path, f"at most {_KEY_LIMITS[field_path]} characters")


def check_table(gpu_name: str, gpu_arch: str, dtype: str, table_json: str) -> None:
    """INVALID_ARGUMENT unless `table_json` is a tile table (within the size bound) for this key."""
    from kernels.tile_table import TileTable  # plain Python, no torch

    check_key(gpu_name, gpu_arch, dtype)
    size = len(table_json.encode())
    if size > MAX_TILE_TABLE_BYTES:
        raise invalid_field("table_json", f"{size} bytes; at most {MAX_TILE_TABLE_BYTES}")
    try:
        table = TileTable.from_json(json.loads(table_json))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise invalid_field("table_json", f"not a tile table: {type(exc).__name__}: {exc}") from None
    got = (table.gpu, table.arch, table.dtype)
    if got != (gpu_name, gpu_arch, dtype):
        raise invalid_field("table_json", f"the table is for {got}, not {(gpu_name, gpu_arch, dtype)}")


class TileTables:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def put(self, gpu_name: str, gpu_arch: str, dtype: str, table_json: str) -> StoredTileTable:
        check_table(gpu_name, gpu_arch, dtype, table_json)
        sha = hashlib.sha256(table_json.encode()).hexdigest()
        for attempt in range(2):  # two first puts of one key race: the loser updates
            try:
                with self.sessions.begin() as s:
                    row = s.get(TileTableRow, (gpu_name, gpu_arch, dtype))
                    now = utcnow()
                    if row is None:
                        row = TileTableRow(
                            gpu_name=gpu_name,
                            gpu_arch=gpu_arch,
                            dtype=dtype,
                            table_json=table_json,
                            sha256=sha,
                            created_at=now,
                            updated_at=now,
                        )
                        s.add(row)
                    else:
                        row.table_json, row.sha256, row.updated_at = table_json, sha, now
                    s.flush()
                    return _stored(row)
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, gpu_name: str, gpu_arch: str, dtype: str) -> StoredTileTable:
        check_key(gpu_name, gpu_arch, dtype)
        with self.sessions() as s:
            row = s.get(TileTableRow, (gpu_name, gpu_arch, dtype))
            if row is None:
                raise NotFound(f"no tile table for {gpu_name!r} {gpu_arch} {dtype}", reason="TILE_TABLE_NOT_FOUND")
            return _stored(row)
