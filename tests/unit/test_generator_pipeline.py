"""Thresholds from measurements and the results file format."""

from __future__ import annotations

import json

from services.generator.pipeline import StrategyResult, measured_thresholds, write_results


def test_thresholds_are_single_task_val_accuracy_minus_margin():
    single = {"digit": {"val": 0.95, "test": 0.9}, "count": {"val": 0.02, "test": 0.5}}
    assert measured_thresholds(single, 0.03) == {"digit": 0.92, "count": 0.0}


def test_results_file_is_a_list_of_strategies_and_appends(tmp_path):
    path = tmp_path / "generation-x.json"
    r1 = StrategyResult(
        "greedy-fusion",
        [["a", "b"]],
        {
            "a": {"threshold": 0.9, "accuracy": 0.95, "adapter": "fused-0"},
            "b": {"threshold": 0.8, "accuracy": 0.79, "adapter": "fused-0"},
        },
    )
    r0 = StrategyResult(
        "base-head-only",
        [],
        {
            "a": {"threshold": 0.9, "accuracy": 0.5, "adapter": None},
            "b": {"threshold": 0.8, "accuracy": 0.5, "adapter": None},
        },
    )
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


def test_binomial_interval_is_wilsons_and_narrows_with_n():
    from services.generator.pipeline import binomial_interval

    lo, hi = binomial_interval(22, 40)  # the demo's old 40-image sample: about +-0.15
    assert 0.39 < lo < 0.41 and 0.68 < hi < 0.70
    lo, hi = binomial_interval(165, 300)  # a whole count test split: about +-0.06
    assert hi - lo < 0.12
    assert binomial_interval(40, 40)[1] == 1.0 and binomial_interval(0, 40)[0] == 0.0


def test_agreement_compares_served_labels_with_truth_and_the_generators_predictions():
    from services.generator.pipeline import agreement

    row = agreement(["a", "b", "b", "a"], truth=["a", "b", "a", "a"], offline=["a", "b", "b", "b"])
    assert row["n"] == 4 and row["served_accuracy"] == 0.75 and row["offline_accuracy"] == 0.5
    assert row["agree"] == 3
    assert agreement(["a"], ["a"], [])["agree"] is None  # an old manifest without predictions


def test_predictions_stay_out_of_the_results_file(tmp_path):
    r = StrategyResult(
        "greedy-fusion",
        [["a"]],
        {"a": {"threshold": 0.5, "accuracy": 1.0, "adapter": "f-0"}},
        predictions={"a": ["x", "y"]},
    )
    doc = json.loads(write_results([r], tmp_path / "g.json").read_text())
    assert "predictions" not in json.dumps(doc)


def test_agreement_of_text_answers_is_normalised_exact_match():
    from services.generator.pipeline import agreement

    row = agreement(
        ["The red.", "blue", "green"], truth=["red", "Blue", "red"], offline=["red", "blue!", "red"], text=True
    )
    assert row["served_accuracy"] == round(2 / 3, 4) and row["offline_accuracy"] == 1.0 and row["agree"] == 2
    assert agreement(["The red."], ["red"], ["red"])["agree"] == 0  # labels compare exactly
