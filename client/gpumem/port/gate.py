"""The step gate of an engine that steps on a thread of its own (transformers' manager
runs its loop on one; nano-vllm steps on its caller's, between whose calls the port's
sleep() runs anyway): ``EnginePort.sleep`` comes from another thread and must find the
engine between two steps and keep it there until its memory is asleep.

The loop runs each step inside ``step()`` and steps nothing while ``paused()``;
``closed()`` raises the pause first, then waits for the step under way. A lock alone
starved the sleeper: the loop took it again at once (Python's lock is not fair), and on
the H100 transformers' sleep() waited its whole 30 s for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from gpumem.errors import GpuMemError

STEP_WAIT_S = 30.0  # closed() waits this long for the step under way


class StepTimeout(GpuMemError, TimeoutError):
    """The engine's step under way did not end within the gate's wait."""


class StepGate:
    def __init__(self, name: str, *, wait_s: float = STEP_WAIT_S) -> None:
        self.name = name
        self.wait_s = wait_s
        self._stepping = threading.Lock()
        self._pausing = threading.Event()
        self._stepper = ""  # the thread of the step under way, for the timeout's message

    def paused(self) -> bool:
        """The loop steps nothing while this holds (the gate is being closed, or closed)."""
        return self._pausing.is_set()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step of the engine's loop."""
        with self._stepping:
            self._stepper = threading.current_thread().name
            yield

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """No step runs inside: the pause raised, then the step under way waited for."""
        self._pausing.set()
        try:
            if not self._stepping.acquire(timeout=self.wait_s):
                raise StepTimeout(
                    f"engine '{self.name}': its step on thread '{self._stepper}' did not end within {self.wait_s:g}s; the engine's "
                    "memory sleeps only between steps: check what holds that step (a request it waits on, a device that hangs)"
                )
            try:
                yield
            finally:
                self._stepping.release()
        finally:
            self._pausing.clear()
