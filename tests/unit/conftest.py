"""Fixtures of the unit suite.

`sm90a_compiles`: test_kernels_compile.py's nvcc -c of every CUDA source for sm_90a (~100 s of CPU
on a 2-core machine) starts when the session's collection ends, in the background at the lowest
CPU priority (nice 19: it runs on what the tests leave idle), if that test was collected; the test
then waits for the results it would have computed itself, what is left of them back at normal
priority.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

COMPILE_TEST = "test_kernels_compile.py::test_cuda_sources_compile_for_sm90a"
_compiles: dict = {}  # "dir", "pool", "futures" ({source: Future[CompletedProcess]}), "procs"


def nvcc_command(src: Path, out: Path) -> list[str]:
    from kernels.build import CSRC, nvcc_flags, nvcc_path

    return [nvcc_path(), "-c", *nvcc_flags(), f"-I{CSRC}", "-Xptxas", "-warn-spills", "-o", str(out), str(src)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    if _compiles.get("closed"):
        return subprocess.CompletedProcess(cmd, -1, "", "session ended before this compile started")
    nice = shutil.which("nice") if not _compiles.get("urgent") else None
    # its own session: with the kernel's autogroups (sched_autogroup_enabled) nice only ranks
    # processes within one session, and the clusters' services run in sessions of their own
    proc = subprocess.Popen(
        [nice, "-n", "19", *cmd] if nice else cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if nice:
        _autogroup_nice(proc.pid, 19)
    with _compiles["lock"]:
        _compiles["procs"].append(proc)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _autogroup_nice(pid: int, value: int) -> None:
    """Sets the nice value of `pid`'s autogroup (its session's share against other sessions)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(value))
    except OSError:
        pass  # no autogroups, or not allowed: plain nice only


def start_compiles() -> None:
    from kernels.build import cuda_sources, cutlass_include_dir, nvcc_path

    if _compiles or nvcc_path() is None or cutlass_include_dir() is None:
        return  # the test skips on its own
    out = Path(tempfile.mkdtemp(prefix="valora-sm90a-"))
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sm90a-nvcc")
    _compiles.update(dir=out, pool=pool, procs=[], lock=threading.Lock())
    _compiles["futures"] = {
        src: pool.submit(_run, nvcc_command(src, out / (src.stem + ".o"))) for src in cuda_sources()
    }


def pytest_collection_finish(session):
    if any(item.nodeid.endswith(COMPILE_TEST) for item in session.items):
        start_compiles()


def pytest_sessionfinish(session, exitstatus):
    if not _compiles:
        return
    _compiles["closed"] = True
    with _compiles["lock"]:
        for proc in _compiles["procs"]:
            if proc.poll() is None:
                proc.kill()
    _compiles["pool"].shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(_compiles["dir"], ignore_errors=True)


def _hurry() -> None:
    """The test waits now: compiles not started yet run at normal priority, running ones (nvcc and
    the cicc/ptxas it started) are set back to it where this process may (root, RLIMIT_NICE)."""
    import psutil

    _compiles["urgent"] = True
    with _compiles["lock"]:
        procs = [p for p in _compiles["procs"] if p.poll() is None]
    for proc in procs:
        _autogroup_nice(proc.pid, 0)
        try:
            tree = psutil.Process(proc.pid)
            for p in (tree, *tree.children(recursive=True)):
                p.nice(0)
        except (psutil.Error, OSError):
            pass  # stays at nice 19: it still finishes, on what the machine leaves it


@pytest.fixture
def sm90a_compiles() -> tuple[Path, dict[Path, Future]]:
    """(the objects' directory, {source: future of its nvcc run}), started now if the collection
    did not (the test selected some other way)."""
    start_compiles()
    _hurry()
    return _compiles["dir"], _compiles["futures"]
