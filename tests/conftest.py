"""Fixtures shared by every test directory (a directory's own conftest or module may override them)."""

import pytest

from services.worker.model import ensure_tiny_model


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    """The tiny Qwen2-VL, built once per test session (read-only for every user)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
