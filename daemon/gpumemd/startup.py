"""The daemon's start, timed: one INFO line at READY with each phase from the process's
exec to READY, so a restart's cost shows where it goes (a failover waits for it).

The line starts with ``startup phases:`` and says each phase as ``NAME N.N ms``;
bench/restart.py reads it back from the log. Every mark is on CLOCK_BOOTTIME, the clock
the kernel gives a process's start time on (/proc/self/stat, in ticks of 1/CLK_TCK s:
the first phase is as coarse as a tick).
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("gpumemd.startup")

PREFIX = "startup phases:"
# Python starts in tens of milliseconds, a few hundred cold on a loaded machine. A process
# created longer than this before the daemon's first import ran something else before it
# exec'd Python (scripts/daemon.sh exec's gpumemd after its first install, 30 s or more):
# that time is no interpreter's, and no part of the daemon's start.
INTERPRETER_MAX_S = 5.0


def _exec_time() -> float | None:
    """When this process was created (fork, or exec's caller), on CLOCK_BOOTTIME."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its last ")".
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


class StartupClock:
    """Phases in the order they end: ``mark("driver")`` ends the phase named driver."""

    def __init__(self, began: float) -> None:
        self.began = began  # when the daemon's first module was imported, on CLOCK_BOOTTIME
        self.created = _exec_time()
        self.phases: list[tuple[str, float]] = []
        self._last = began
        self.notes: list[str] = []  # what a phase did (how many chunks it restored)

    def mark(self, phase: str) -> None:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        self.phases.append((phase, now - self._last))
        self._last = now

    def note(self, text: str) -> None:
        self.notes.append(text)

    def line(self) -> tuple[str, dict[str, float]]:
        figures: dict[str, float] = {}
        notes = list(self.notes)
        before = max(self.began - self.created, 0.0) if self.created is not None else None
        if before is not None and before <= INTERPRETER_MAX_S:
            figures["interpreter"] = before * 1e3
        elif before is not None:
            notes.insert(0, f"the process ran {before:.1f} s before it started Python, e.g. an install by the script that "
                            "exec'd gpumemd: not counted")
        for phase, seconds in self.phases:
            figures[phase] = seconds * 1e3
        figures["total"] = sum(figures.values())
        text = ", ".join(f"{name} {ms:.1f} ms" for name, ms in figures.items())
        return f"{PREFIX} {text}" + (f" ({'; '.join(notes)})" if notes else ""), figures

    def log_ready(self) -> None:
        self.mark("ready")
        text, figures = self.line()
        log.info("%s", text, extra={"figures": {f"{name}_ms": round(ms, 3) for name, ms in figures.items()}})
