"""Early adapter release as a task's policy, on a real cluster (four processes on loopback): a
request through a task whose adapter_release_fraction is 0.5 has its adapter released halfway
(the worker's valora:adapter_releases_total / adapter_released_tokens_total), a request naming
the adapter itself is not, and an UpdateTask of the policy shows on the next request; a task
whose rule is sentence_end releases it one token past the first sentence end of the adapter's
own text."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.adapter_format import BaseModelShapes, make_random_bundle
from valora.client import ValoraClient
from valora_protos.v1 import types_pb2

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


def test_a_task_release_rule_releases_after_the_first_sentence(cluster, model_path, no_eos):
    """The tiny model writes no punctuation of its own: a small bias on "." gives its text some.
    The adapter's own answer (no release) says where the first sentence ends (the worker's rule
    on its tokens, tests/unit/test_pipelined_decode.rule_release_point); through the task the
    request is released one token past it, counted by the worker."""
    from services.worker.model import load_processor
    from tests.unit.test_pipelined_decode import rule_release_point

    tokenizer = load_processor(model_path).tokenizer
    n = 16
    bias = {**no_eos, tokenizer.convert_tokens_to_ids("."): 0.7}
    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    bundle, cfg = make_random_bundle(shapes, rank=4, seed=12, lora_alpha=8)
    with ValoraClient(cluster.gateway) as client:
        version = client.upload_adapter_version("rel-rule", bundle, cfg, request_id="rel-rule-upload")
        task = client.create_task("rel-say", version.name, adapter_release_rule="sentence_end")
        assert task.adapter_release_rule == types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END
        ask = dict(max_new_tokens=n, logit_bias=bias, logprobs=True)
        own = [t.token_id for t in client.infer("What is it?", adapter=version.name, **ask).logprobs]
        point = rule_release_point(tokenizer, own, 0)
        assert 0 < point < n, tokenizer.decode(own)  # a sentence ends before the last token
        before = released(cluster)
        got = [t.token_id for t in client.infer("What is it?", task="tasks/rel-say", **ask).logprobs]
        assert len(got) == n and got[:point] == own[:point]  # the adapter's, up to the release
        assert released(cluster) == (before[0] + 1, before[1] + n - point)
