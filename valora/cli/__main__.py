"""`python -m valora.cli`: the `valora` command."""

from valora.cli import run

run()
