import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("export_rows", Path(__file__).parents[2] / "bench" / "export_rows.py")
export_rows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(export_rows)


def test_atmm_run_becomes_one_row_per_case_and_impl(tmp_path):
    run = {
        "methods": ["atmm", "loop"],
        "cases": [
            {
                "h_in": 4096,
                "h_out": 4096,
                "rank": "16",
                "N": 8,
                "T": 16,
                "mix": "uniform",
                "floor_us": 0.56,
                "atmm": {"amortized_us": 6.0, "graph1_us": 10.0, "eager_us": 19.0, "rel_err_delta": 0.002},
                "loop": {"amortized_us": 70.0, "graph1_us": 75.0, "eager_us": 90.0, "rel_err_delta": 0.003},
            }
        ],
    }
    src = tmp_path / "atmm_headline_abc123.json"
    src.write_text(json.dumps(run))
    rows = json.loads(export_rows.export(src).read_text())
    assert [r["impl"] for r in rows] == ["atmm", "loop"]
    assert rows[0] == {
        "op": "lora",
        "h_in": 4096,
        "h_out": 4096,
        "rank": "16",
        "n_adapters": 8,
        "tokens": 16,
        "mix": "uniform",
        "impl": "atmm",
        "graph_us": 6.0,
        "graph1_us": 10.0,
        "eager_us": 19.0,
        "floor_us": 0.56,
        "relerr": 0.002,
    }
    assert (tmp_path / "atmm-abc123.json").exists()


def test_switch_run_keeps_our_best_config_and_the_torch_peers(tmp_path):
    run = {
        "floor_ms": 6.1,
        "ours": {"a": {"switch_ms": 11.0, "merge_ms": 10.5}, "b": {"switch_ms": 12.0, "merge_ms": 9.0}},
        "torch_addmm_merge_ms": 11.9,
        "torch_two_pass_ms": 23.7,
        "torch_one_pass_ms": 11.4,
    }
    src = tmp_path / "switch_abc123.json"
    src.write_text(json.dumps(run))
    rows = json.loads(export_rows.export(src).read_text())
    assert {"op": "switch", "impl": "valora", "ms": 11.0, "floor_ms": 6.1} in rows
    assert {"op": "merge", "impl": "valora", "ms": 10.5, "floor_ms": 6.1} in rows
    assert {r["impl"] for r in rows} == {"valora", "torch_addmm", "torch_two_pass", "torch_one_pass"}


def test_failed_methods_have_no_row(tmp_path):
    run = {
        "methods": ["atmm", "triton_sgmv", "atmm_fused"],
        "cases": [
            {
                "h_in": 4096,
                "h_out": 4096,
                "rank": "128",
                "N": 8,
                "T": 16,
                "mix": "uniform",
                "floor_us": 0.56,
                "atmm": {"amortized_us": 6.0, "graph1_us": 10.0, "eager_us": 19.0, "rel_err_delta": 0.002},
                "triton_sgmv": {"error": "RuntimeError: triton is not installed"},
                "atmm_fused": {"error": "no fused kernel for rank stride 128 (> 64)"},
            }
        ],
    }
    assert [r["impl"] for r in export_rows.atmm_rows(run)] == ["atmm"]
    assert export_rows.run_id(tmp_path / "atmm_headline_abc123.json") == "abc123"
    assert export_rows.rows_name("atmm", "abc123") == "atmm-abc123"


def test_atmm_bench_writes_the_flat_rows_next_to_its_detailed_file(tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("torch")
    import sys

    import kernels.results
    from bench import atmm_bench

    def fake_case(spec, methods, **kw):
        return {
            **spec,
            "h_in": 4096,
            "h_out": 4096,
            "floor_us": 0.5,
            "goal_us": 4.5,
            **{
                m: {"amortized_us": 5.0, "graph1_us": 9.0, "eager_us": 20.0, "rel_err_y": 1e-3, "rel_err_delta": 2e-3}
                for m in methods
                if m != "loop"
            },
            "loop": {"error": "RuntimeError: boom"},
        }

    monkeypatch.setattr(atmm_bench, "run_case", fake_case)
    monkeypatch.setattr(kernels.results, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(
        sys,
        "argv",
        ["atmm_bench", "--suite", "quick", "--methods", "atmm,atmm_fused,loop", "--name", "atmm_quick_run42"],
    )
    atmm_bench.main()
    detailed = json.loads((tmp_path / "atmm_quick_run42.json").read_text())
    rows = json.loads((tmp_path / "atmm-run42.json").read_text())
    assert rows == export_rows.atmm_rows(detailed)  # one schema: export_rows derives the same rows
    assert len(rows) == 2 * len(detailed["cases"]) == 8
    assert {r["impl"] for r in rows} == {"atmm", "atmm_fused"}
    assert set(rows[0]) == {
        "op",
        "h_in",
        "h_out",
        "rank",
        "n_adapters",
        "tokens",
        "mix",
        "impl",
        "graph_us",
        "graph1_us",
        "eager_us",
        "floor_us",
        "relerr",
    }
    monkeypatch.setattr(sys, "argv", ["atmm_bench", "--suite", "quick", "--methods", "atmm", "--suffix", "x1"])
    atmm_bench.main()
    assert (tmp_path / "atmm_quick_x1.json").exists() and (tmp_path / "atmm-x1.json").exists()
