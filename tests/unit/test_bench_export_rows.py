import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("export_rows", Path(__file__).parents[2] / "bench" / "export_rows.py")
export_rows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(export_rows)


def test_atmm_run_becomes_one_row_per_case_and_impl(tmp_path):
    run = {"methods": ["atmm", "loop"], "cases": [{
        "h_in": 4096, "h_out": 4096, "rank": "16", "N": 8, "T": 16, "mix": "uniform", "floor_us": 0.56,
        "atmm": {"amortized_us": 6.0, "graph1_us": 10.0, "eager_us": 19.0, "rel_err_delta": 0.002},
        "loop": {"amortized_us": 70.0, "graph1_us": 75.0, "eager_us": 90.0, "rel_err_delta": 0.003}}]}
    src = tmp_path / "atmm_headline_abc123.json"
    src.write_text(json.dumps(run))
    rows = json.loads(export_rows.export(src).read_text())
    assert [r["impl"] for r in rows] == ["atmm", "loop"]
    assert rows[0] == {"op": "lora", "h_in": 4096, "h_out": 4096, "rank": "16", "n_adapters": 8, "tokens": 16,
                       "mix": "uniform", "impl": "atmm", "graph_us": 6.0, "graph1_us": 10.0, "eager_us": 19.0,
                       "floor_us": 0.56, "relerr": 0.002}
    assert (tmp_path / "atmm-abc123.json").exists()


def test_switch_run_keeps_our_best_config_and_the_torch_peers(tmp_path):
    run = {"floor_ms": 6.1, "ours": {"a": {"switch_ms": 11.0, "merge_ms": 10.5}, "b": {"switch_ms": 12.0, "merge_ms": 9.0}},
           "torch_addmm_merge_ms": 11.9, "torch_two_pass_ms": 23.7, "torch_one_pass_ms": 11.4}
    src = tmp_path / "switch_abc123.json"
    src.write_text(json.dumps(run))
    rows = json.loads(export_rows.export(src).read_text())
    assert {"op": "switch", "impl": "valora", "ms": 11.0, "floor_ms": 6.1} in rows
    assert {"op": "merge", "impl": "valora", "ms": 10.5, "floor_ms": 6.1} in rows
    assert {r["impl"] for r in rows} == {"valora", "torch_addmm", "torch_two_pass", "torch_one_pass"}
