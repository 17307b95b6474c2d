"""The server code the `valora` command runs (`bench sched`, `demo`, `up`'s settings checks,
`generate --dataset`), reached through the entry points of group `valora.server` that the server's
distribution declares (pyproject.toml's [project.entry-points."valora.server"]), never by importing
services/ from the client package (tests/unit/test_import_rules.py). An install without the server
code, or without the extra its modules import, gets a one-line ServerCodeMissing that names it."""

from __future__ import annotations

import importlib.metadata

GROUP = "valora.server"


class ServerCodeMissing(RuntimeError):
    """An entry point of GROUP is not installed, or its module does not import here."""


def load(name: str, extra: str = "server"):
    """The object (or module) entry point `name` of GROUP names, imported now. `extra`: the
    pyproject extra its code needs, for the message when it does not import."""
    found = importlib.metadata.entry_points(group=GROUP, name=name)
    if not found:
        raise ServerCodeMissing(
            f"no {GROUP} entry point {name!r}: this command runs server code; install it with "
            f"pip install 'valora[{extra}]' (an editable install older than the entry point: rerun "
            "scripts/install.sh)"
        )
    entry = next(iter(found))
    try:
        return entry.load()
    except ImportError as e:
        raise ServerCodeMissing(
            f"{entry.value} (entry point {name!r}) does not import: {e}; it needs pip install 'valora[{extra}]'"
        ) from e
