"""Image payloads for the hostile-input and fuzz tests."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def png(seed: int = 0, size: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(width: int, height: int, rows: int = 4) -> bytes:
    """A PNG whose header claims width x height (RGB, 8-bit) but whose IDAT holds a few rows of
    zeros: a decompression bomb's header, kilobytes on the wire."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"\0" * min(rows * (1 + 3 * width), 1 << 20), 9)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", raw) + _chunk(b"IEND", b"")


def png_bomb(side: int) -> bytes:
    """A real, complete side x side all-zero PNG: tiny compressed, side*side*3 bytes decoded."""
    row = b"\0" + b"\0" * (3 * side)
    comp = zlib.compressobj(9)
    body = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")
