"""Thresholds from measurements and the results file format."""

from __future__ import annotations

import json

from services.generator.pipeline import StrategyResult, measured_thresholds, write_results


def test_thresholds_are_single_task_val_accuracy_minus_margin():
    single = {"digit": {"val": 0.95, "test": 0.9}, "count": {"val": 0.02, "test": 0.5}}
    assert measured_thresholds(single, 0.03) == {"digit": 0.92, "count": 0.0}


def test_results_file_is_a_list_of_strategies_and_appends(tmp_path):
    path = tmp_path / "generation-x.json"
    r1 = StrategyResult("greedy-fusion", [["a", "b"]], {"a": {"threshold": 0.9, "accuracy": 0.95, "adapter": "fused-0"},
                                                       "b": {"threshold": 0.8, "accuracy": 0.79, "adapter": "fused-0"}})
    r0 = StrategyResult("base-head-only", [], {"a": {"threshold": 0.9, "accuracy": 0.5, "adapter": None},
                                              "b": {"threshold": 0.8, "accuracy": 0.5, "adapter": None}})
    write_results([r0, r1], path, {"rank": 8})
    write_results([r1], path, {"rank": 2}, append=True)
    doc = json.loads(path.read_text())
    assert [d["strategy"] for d in doc] == ["base-head-only", "greedy-fusion", "greedy-fusion"]
    assert [d["n_adapters"] for d in doc] == [0, 1, 1]
    assert doc[1]["tasks"]["a"] == {"threshold": 0.9, "accuracy": 0.95, "adapter": "fused-0"}
    assert [d["setup"]["rank"] for d in doc] == [8, 8, 2]
    assert not r1.meets_thresholds() and not r0.meets_thresholds()
    write_results([r1], path)  # without append the file is replaced
    assert len(json.loads(path.read_text())) == 1
