import grpc
import pytest

from services.common.errors import InvalidArgument
from services.common.names import (
    AdapterRefName,
    parse_adapter_name,
    parse_adapter_ref,
    parse_task_name,
    parse_version_name,
)


@pytest.mark.parametrize(
    "value,want",
    [
        ("adapters/cat-detector", AdapterRefName("cat-detector")),
        ("adapters/a1/versions/12", AdapterRefName("a1", version=12)),
        ("adapters/a1@prod", AdapterRefName("a1", alias="prod")),
    ],
)
def test_parse_adapter_ref(value, want):
    assert parse_adapter_ref(value) == want


@pytest.mark.parametrize(
    "value",
    [
        "",
        "adapters/",
        "adapters/Upper",
        "adapters/a/versions/0",
        "adapters/a/versions/x",
        "adapters/a@",
        "adapter/a",
        "tasks/a",
        "adapters/a/versions/1@prod",
        "adapters/" + "a" * 64,
        "adapters/a\n",
        "adapters/a/versions/1\n",
        "adapters/a@prod\n",  # `$` matched before a final newline
    ],
)
def test_bad_adapter_refs_are_invalid_argument_naming_the_field(value):
    with pytest.raises(InvalidArgument) as err:
        parse_adapter_ref(value, "input.adapter")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.field_violations[0].field == "input.adapter"


def test_specific_name_kinds():
    assert parse_version_name("adapters/a/versions/3") == ("a", 3)
    assert parse_adapter_name("adapters/a") == "a"
    assert parse_task_name("tasks/digits") == "digits"
    for bad, fn in [
        ("adapters/a", parse_version_name),
        ("adapters/a@prod", parse_adapter_name),
        ("tasks/", parse_task_name),
    ]:
        with pytest.raises(InvalidArgument):
            fn(bad)
