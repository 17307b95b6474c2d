"""bench/pyspy_summary.py on a hand-written collapsed-stack profile."""

from bench.pyspy_summary import parse, summary

RAW = """\
thread (1): valora-engine;_loop (/r/services/worker/engine.py:520);_step (/r/services/worker/engine.py:600);\
forward (/t/module.py:10) 30
thread (1): valora-engine;_loop (/r/services/worker/engine.py:520);_step (/r/services/worker/engine.py:610) 10
thread (2): asyncio_0;run (/u/threading.py:1) 50
thread (3): asyncio_1;run (/u/threading.py:1) 45
not a sample line
"""


def test_engine_thread_broken_down_even_when_not_busiest():
    threads = parse(RAW.splitlines(keepends=True))
    assert sum(c for _, c in threads["thread (1): valora-engine"]) == 40
    text = summary(threads, n_threads=2, top=5, match="valora-engine")
    broken_down = [line for line in text.splitlines() if line.endswith("samples")]
    assert broken_down == ["thread (1): valora-engine: 40 samples", "thread (2): asyncio_0: 50 samples"]
    engine = text.split("valora-engine: 40 samples")[1].split("asyncio_0: 50 samples")[0]
    assert "100.0%  _step (engine.py)" in engine  # inclusive: both lines of _step, file without its path
    assert " 75.0%  forward (module.py:10)" in engine and " 25.0%  _step (engine.py:610)" in engine  # self
