"""Early adapter release as a task's policy, on a real cluster (four processes on loopback): a
request through a task whose adapter_release_fraction is 0.5 has its adapter released halfway
(the worker's valora:adapter_releases_total / adapter_released_tokens_total), a request naming
the adapter itself is not, and an UpdateTask of the policy shows on the next request."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.adapter_format import BaseModelShapes, make_random_bundle
from valora.client import ValoraClient

pytestmark = pytest.mark.e2e
MAX_NEW = 8


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The e2e suite's shared cluster (tests/e2e/conftest.py), on the session's `model_path`:
    this test reads the worker's release counters as deltas."""
    return shared_cluster


def released(cluster) -> tuple[float, float]:
    """(requests released, tokens generated after release) the worker counted so far."""
    with urllib.request.urlopen(cluster.by_service("worker")[0].metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    totals = {"valora:adapter_releases_total": 0.0, "valora:adapter_released_tokens_total": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in totals:
                totals[s.name] += s.value
    return totals["valora:adapter_releases_total"], totals["valora:adapter_released_tokens_total"]


def test_a_task_release_policy_releases_its_requests_adapter(cluster, model_path, no_eos):
    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    bundle, cfg = make_random_bundle(shapes, rank=4, seed=11, lora_alpha=8)
    with ValoraClient(cluster.gateway) as client:
        version = client.upload_adapter_version("rel", bundle, cfg, request_id="rel-upload")
        task = client.create_task("rel-describe", version.name, adapter_release_fraction=0.5)
        assert client.get_task("rel-describe").adapter_release_fraction == 0.5 == task.adapter_release_fraction

        def ask(**target):
            r = client.infer("Describe it.", max_new_tokens=MAX_NEW, logit_bias=no_eos, **target)
            assert r.output_tokens == MAX_NEW and r.adapter_version == version.name
            return released(cluster)

        before = released(cluster)
        assert ask(adapter=version.name) == before  # the adapter named itself: no task, no policy
        # through the task: released after 4 of its 8 tokens, the other 4 on the base path
        assert ask(task="tasks/rel-describe") == (before[0] + 1, before[1] + MAX_NEW / 2)
        client.update_task("rel-describe", adapter_release_fraction=0.25)
        assert ask(task="tasks/rel-describe") == (before[0] + 2, before[1] + MAX_NEW / 2 + 6)
        client.update_task("rel-describe", adapter_release_fraction=0.0)  # off
        assert ask(task="tasks/rel-describe") == (before[0] + 2, before[1] + MAX_NEW / 2 + 6)
