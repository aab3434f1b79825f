"""The integration tests' own helpers, where a mistake would make tests flaky rather
than wrong."""

from __future__ import annotations

import subprocess
import sys

from gpumemd_testkit import lines_until, read_line


def _printing(text: str) -> subprocess.Popen[str]:
    """A process that prints ``text`` in one write, then waits to be killed."""
    code = f"import sys, time; sys.stdout.write({text!r}); sys.stdout.flush(); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_line_that_came_in_one_write_with_others_is_found_at_once() -> None:
    """Lines printed together reach the text wrapper's buffer together: the one asked for
    must be found there, not after the timeout (a server printing its start lines)."""
    proc = _printing("starting\nREADY 7\nserving\n")
    try:
        assert lines_until(proc, lambda line: line.startswith("READY"), "READY", timeout=10) == ["starting\n", "READY 7\n"]
        assert read_line(proc, "serv", timeout=10) == "ing"  # the rest is left to the next reader
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
