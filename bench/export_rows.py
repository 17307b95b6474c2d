"""Flat result rows in the schema of issue #5 — the one place that defines them:

    atmm-<run>.json:   [{"op": "lora", "h_in", "h_out", "rank", "n_adapters", "tokens", "mix", "impl",
                         "graph_us", "graph1_us", "eager_us", "floor_us", "relerr"}, ...]
    switch-<run>.json: [{"op": "switch"|"merge", "impl", "ms", "floor_ms"}, ...]

`bench.atmm_bench` writes its atmm-<run>.json with `atmm_rows` next to its detailed file; this
script derives the rows from files measured earlier (no re-measuring):

    python bench/export_rows.py bench/results/atmm_headline_1e0ba3c.json bench/results/switch_d918641.json

`graph_us` is per op amortized over 20 ops in one CUDA graph (rotating inputs), `graph1_us` one op
per graph replay; `impl` is "atmm" (the table-dispatched op), one of its forced variants
("atmm_nopdl", "atmm_cutlass") or a peer's name. A method that failed on a case (an "error"
entry) has no row. The run id is the source file's suffix (the commit it was measured at).
Torch-free so it runs anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def atmm_rows(run: dict) -> list[dict]:
    rows = []
    for case in run["cases"]:
        for impl in run["methods"]:
            m = case.get(impl)
            if not isinstance(m, dict) or "amortized_us" not in m:
                continue
            rows.append(
                {
                    "op": "lora",
                    "h_in": case["h_in"],
                    "h_out": case["h_out"],
                    "rank": case["rank"],
                    "n_adapters": case["N"],
                    "tokens": case["T"],
                    "mix": case["mix"],
                    "impl": impl,
                    "graph_us": m["amortized_us"],
                    "graph1_us": m["graph1_us"],
                    "eager_us": m["eager_us"],
                    "floor_us": case["floor_us"],
                    "relerr": m["rel_err_delta"],
                }
            )
    return rows


def switch_rows(run: dict) -> list[dict]:
    floor = run["floor_ms"]
    best = min(run["ours"].values(), key=lambda v: v["switch_ms"])
    return [
        {"op": "switch", "impl": "valora", "ms": best["switch_ms"], "floor_ms": floor},
        {"op": "merge", "impl": "valora", "ms": best["merge_ms"], "floor_ms": floor},
        {"op": "merge", "impl": "torch_addmm", "ms": run["torch_addmm_merge_ms"], "floor_ms": floor},
        {"op": "switch", "impl": "torch_two_pass", "ms": run["torch_two_pass_ms"], "floor_ms": floor},
        {"op": "switch", "impl": "torch_one_pass", "ms": run["torch_one_pass_ms"], "floor_ms": floor},
    ]


def run_id(path: Path) -> str:
    """The run id of a detailed results file: its name's suffix after the last "_"."""
    return Path(path).stem.rsplit("_", 1)[-1]


def rows_name(kind: str, rid: str) -> str:
    """File stem of the flat rows: "atmm-<run>" / "switch-<run>"."""
    return f"{kind}-{rid}"


def dumps(rows: list[dict]) -> str:
    return json.dumps(rows, indent=1) + "\n"


def export(path: Path) -> Path:
    run = json.loads(path.read_text())
    rid = run_id(path)
    if "cases" in run:
        out, rows = path.with_name(f"{rows_name('atmm', rid)}.json"), atmm_rows(run)
    elif "ours" in run and "floor_ms" in run:
        out, rows = path.with_name(f"{rows_name('switch', rid)}.json"), switch_rows(run)
    else:
        raise SystemExit(f"{path}: neither an ATMM nor a switch run")
    out.write_text(dumps(rows))
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(export(Path(arg)))
