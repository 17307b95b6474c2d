"""What reaches the engine loop from other threads, taken between steps: new sequences
(StepScheduler.incoming), commands (adapter loads, mode switches: lora_manager.py), cancellations
and deadlines, and the stop. Tensor parallel: at each step's start rank 0 broadcasts what arrived
since the last one (`sync`), and every rank, rank 0 included, steps on exactly that, whatever else
reaches rank 0 meanwhile, so the ranks stay in lockstep."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from services.common.errors import Cancelled, DeadlineExceeded, ValoraError, WorkerUnavailable
from services.worker.requests import RequestHandle
from services.worker.sequence import Sequence
from services.worker.step_scheduler import StepScheduler
from services.worker.tensor_parallel import TPGroup
from services.worker.vision import without_pixels


class Inbox:
    def __init__(self, sched: StepScheduler, wake: threading.Condition, tp: TPGroup | None) -> None:
        self.sched, self.wake, self.tp = sched, wake, tp
        self.leader = tp is None or tp.rank == 0
        self.stop = threading.Event()
        self._commands: collections.deque = collections.deque()  # (command, done, box) from callers
        # Tensor parallelism: this step's commands and stopped requests (id -> cancelled, else past
        # its deadline), as rank 0 broadcast them; and whether it said stop.
        self._step_commands: collections.deque = collections.deque()
        self._halts: dict[int, bool] = {}
        self._tp_stop = False
        self._tp_clock = 0.0  # rank 0's time.monotonic() at this step's start

    def step_time(self) -> float:
        """The step's time (time.monotonic()): what orders requests by their objectives (tensor
        parallel: rank 0's at the step's start, so every rank takes the same order)."""
        return self._tp_clock if self.tp is not None else time.monotonic()

    @property
    def stopping(self) -> bool:
        """Whether the loop ends (tensor parallel: once rank 0's stop has been broadcast)."""
        return self._tp_stop if self.tp is not None else self.stop.is_set()

    def call(self, command, timeout: float):
        """Queues `command` for the engine thread's next step boundary; its result, or its error raised."""
        done = threading.Event()
        box: dict = {}
        with self.wake:
            self._commands.append((command, done, box))
            self.wake.notify_all()
        if not done.wait(timeout):
            raise WorkerUnavailable("the engine did not apply the command in time", reason="ENGINE_BUSY")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def run_commands(self, run, before) -> None:
        """The step's commands in order, each `run(command)` after `before()`, its result or error
        handed back to its caller."""
        commands = self._commands if self.tp is None else self._step_commands
        while True:
            with self.wake:
                if not commands:
                    return
                command, done, box = commands.popleft()
            before()
            try:
                box["result"] = run(command)
            except Exception as exc:  # handed back to the caller
                box["error"] = exc
            except BaseException:  # the engine stops (tensor parallel: GroupBroken): its caller hears now
                box["error"] = WorkerUnavailable("the worker engine stopped", reason="ENGINE_DOWN")
                raise
            finally:
                if done is not None:  # None: a follower's copy of rank 0's command
                    done.set()

    def idle(self) -> None:
        """Nothing to run: waits up to 0.1 s for a request, a command or the stop."""
        with self.wake:
            if not self.sched.incoming and not self._commands and not self.stop.is_set():
                self.wake.wait(timeout=0.1)

    def sync(self) -> None:
        """Tensor parallelism, at the start of every step: rank 0's new requests, commands, stops
        decided on its handles and its clock, and the engine's stop, broadcast to every rank."""
        msg = None
        if self.leader:
            with self.wake:
                new, commands = list(self.sched.incoming), list(self._commands)
                self.sched.incoming.clear()
                self._commands.clear()
            now = time.monotonic()
            halts = {
                s.id: s.handle.cancelled
                for s in (*new, *self.sched.waiting, *self.sched.active())
                if s.handle.cancelled or s.handle.expired(now)
            }
            # Followers need no raw images, no pixels (the vision encoder broadcasts those it
            # encodes) and no sinks.
            msg = (
                [
                    (
                        s.id,
                        dataclasses.replace(
                            s.prep,
                            request=dataclasses.replace(s.req, images=[], videos=[]),
                            inputs=without_pixels(s.prep.inputs),
                        ),
                    )
                    for s in new
                ],
                [command for command, _, _ in commands],
                halts,
                self.stop.is_set(),
                now,
            )
        got = self.tp.broadcast_object(msg)
        if not self.leader:
            new = []
            for sid, prep in got[0]:
                handle = RequestHandle(prep.request.request_id, self.wake)  # never cancelled: halts say
                new.append(Sequence(id=sid, prep=prep, sink=None, handle=handle))
            commands = [(command, None, {}) for command in got[1]]
        _, _, self._halts, self._tp_stop, self._tp_clock = got
        with self.wake:
            self.sched.waiting.extend(new)
        self._step_commands.extend(commands)

    def halted(self, s: Sequence, now: float) -> bool:
        """Cancelled or past its deadline (tensor parallel: as rank 0 saw it at this step's start)."""
        if self.tp is not None:
            return s.id in self._halts
        return s.handle.cancelled or s.handle.expired(now)

    def halt_error(self, s: Sequence) -> ValoraError:
        """Why a halted sequence stops: CANCELLED or DEADLINE_EXCEEDED."""
        cancelled = self._halts[s.id] if self.tp is not None else s.handle.cancelled
        if cancelled:
            return Cancelled("request cancelled", reason="CANCELLED")
        return DeadlineExceeded(f"request {s.req.request_id} ran past its deadline", reason="DEADLINE_EXCEEDED")
