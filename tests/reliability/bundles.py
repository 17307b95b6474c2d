"""The hostile adapter-bundle corpus: every entry must be refused by UploadAdapterVersion."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from pathlib import Path

from services.common.adapter_format import BaseModelShapes, lora_key, make_random_bundle


class SideEffect:
    """Unpickling this creates `path` (proof that something unpickled the upload)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _header(tensors: dict, body: bytes = b"") -> bytes:
    h = json.dumps(tensors).encode()
    return struct.pack("<Q", len(h)) + h + body


def corpus(shapes: BaseModelShapes, marker: str) -> list[tuple[str, bytes, str, str]]:
    """(name, bundle bytes, adapter_config_json, sha256 override or "") for every hostile case."""
    good, cfg = make_random_bundle(shapes, rank=4, seed=1)
    cfg_obj = json.loads(cfg)
    out: list[tuple[str, bytes, str, str]] = []
    for proto in (0, 2, 4, 5):
        out.append(
            (
                f"pickle protocol {proto} with a side effect",
                pickle.dumps({"w": SideEffect(marker)}, protocol=proto),
                cfg,
                "",
            )
        )
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:  # the layout of torch.save
        z.writestr("archive/data.pkl", pickle.dumps(SideEffect(marker), protocol=2))
    out.append(("torch.save zip with a side-effect pickle", zbuf.getvalue(), cfg, ""))
    # A safetensors length prefix followed by a pickle instead of JSON.
    p = pickle.dumps(SideEffect(marker), protocol=2)
    out.append(("length prefix then pickle", struct.pack("<Q", len(p)) + p, cfg, ""))

    fin, fout = shapes.features["q_proj"]
    key_a, key_b = lora_key(0, "q_proj", "A"), lora_key(0, "q_proj", "B")

    def st(entries: dict[str, tuple[list[int], str]]) -> bytes:
        header, off, body = {}, 0, b""
        for k, (shape, dtype) in entries.items():
            n = 4
            for d in shape:
                n *= d
            header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            body += b"\0" * n
        return _header(header, body)

    out.append(("wrong shape (A has fin+1)", st({key_a: ([4, fin + 1], "F32"), key_b: ([fout, 4], "F32")}), cfg, ""))
    out.append(("wrong shape (3-d tensor)", st({key_a: ([4, fin, 1], "F32"), key_b: ([fout, 4], "F32")}), cfg, ""))
    out.append(("mixed ranks", st({key_a: ([4, fin], "F32"), key_b: ([fout, 8], "F32")}), cfg, ""))
    out.append(("unknown tensor", st({"evil.weight": ([1, 1], "F32")}), cfg, ""))
    out.append(
        (
            "layer past the model",
            st({lora_key(999, "q_proj", "A"): ([4, fin], "F32"), lora_key(999, "q_proj", "B"): ([fout, 4], "F32")}),
            cfg,
            "",
        )
    )
    out.append(("lora_A without lora_B", st({key_a: ([4, fin], "F32")}), cfg, ""))
    out.append(("bad dtype", st({key_a: ([4, fin], "I64"), key_b: ([fout, 4], "I64")}), cfg, ""))
    big = make_random_bundle(shapes, rank=256, seed=2)
    out.append(("rank 256 over the maximum", big[0], big[1], ""))
    out.append(("header length 2**63", struct.pack("<Q", 1 << 63) + b"{}", cfg, ""))
    out.append(("header 2 MiB (over the limit)", _header({"__metadata__": {"pad": "x" * (2 << 20)}}), cfg, ""))
    out.append(("truncated bundle", good[: len(good) - 1000], cfg, ""))
    out.append(("truncated header", good[:20], cfg, ""))
    out.append(("shorter than 8 bytes", b"\x01\x02", cfg, ""))
    out.append(("empty", b"", cfg, ""))
    out.append(("checksum mismatch", good, cfg, "0" * 64))
    out.append(("checksum not hex", good, cfg, "zz" * 32))
    out.append(
        (
            "data_offsets past the end",
            _header({key_a: {"dtype": "F32", "shape": [4, fin], "data_offsets": [0, 10**12]}}),
            cfg,
            "",
        )
    )
    out.append(
        ("data_offsets not a pair", _header({key_a: {"dtype": "F32", "shape": [4, fin], "data_offsets": 5}}), cfg, "")
    )
    out.append(
        (
            "data_offsets strings",
            _header({key_a: {"dtype": "F32", "shape": [4, fin], "data_offsets": ["a", "b"]}}),
            cfg,
            "",
        )
    )
    out.append(("shape not a list", _header({key_a: {"dtype": "F32", "shape": 7, "data_offsets": [0, 0]}}), cfg, ""))
    out.append(("header is a list", _header([1, 2, 3]), cfg, ""))  # type: ignore[arg-type]
    out.append(("config not JSON", good, "{not json", ""))
    out.append(("config is a list", good, "[]", ""))
    out.append(("config r is text", good, json.dumps({**cfg_obj, "r": "four"}), ""))
    out.append(("config r disagrees", good, json.dumps({**cfg_obj, "r": 8}), ""))
    return out
