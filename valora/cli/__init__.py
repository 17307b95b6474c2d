"""`valora` command line: run a local cluster, register adapters, send requests, run the demo.

    common.py    the root `app` (--version), the console, the shared options and helpers
    up.py        up, down: the local cluster
    infer.py     infer: one request
    status.py    status: workers, their mode and adapters
    generate.py  generate: queue a generation job
    demo.py      demo: generated adapters served and measured (--quick: random ones)
    adapters.py  adapters register / list / get / delete / versions / alias / unalias
    tasks.py     tasks list / get / create / update / delete
    jobs.py      jobs list / get / cancel
    bench.py     bench sched (the scheduling simulator), bench scale (bench/scale_bench.py)
    __main__.py  `python -m valora.cli`

`main` is the `valora` command (pyproject's entry point `run` calls it).
"""

from __future__ import annotations

import sys

# Importing a command module registers its commands on `app`: `valora --help` lists them in the
# order imported here, then the groups in the order added below.
from valora.cli import up, infer, status, generate, demo
from valora.cli import adapters, bench, jobs, tasks
from valora.cli.common import app, console

COMMAND_MODULES = (up, infer, status, generate, demo)
app.add_typer(adapters.adapters_app, name="adapters")
app.add_typer(tasks.tasks_app, name="tasks")
app.add_typer(jobs.jobs_app, name="jobs")
app.add_typer(bench.bench_app, name="bench")

RPC_EXIT_BASE = 10  # a failed call exits 10 + its gRPC status code (INVALID_ARGUMENT 13, NOT_FOUND 15, UNAVAILABLE 24)


def main(argv: list[str] | None = None) -> int:
    """The `valora` command: the CLI, with a failed RPC printed as `CODE: message (reason)` and
    field violations, exiting RPC_EXIT_BASE + its status code, instead of a traceback."""
    import grpc

    from valora import errors

    try:
        app(args=argv)  # standalone: ends in SystemExit (0, or a usage error's 2) unless an RPC failed
    except grpc.RpcError as raw:
        err = errors.from_rpc_error(raw)
        console.print(
            f"[red]{err.code().name}[/red]: {err.message}" + (f" ({err.reason})" if err.reason else ""),
            markup=True,
            highlight=False,
        )
        for field_path, why in err.field_violations:
            console.print(f"  {field_path}: {why}", markup=False, highlight=False)
        return RPC_EXIT_BASE + err.code().value[0]
    return 0


def run() -> None:
    """Entry point of the `valora` script."""
    sys.exit(main())
