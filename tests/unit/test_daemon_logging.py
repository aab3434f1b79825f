"""gpumemd's log lines: stamped with the time, except when stderr is the journal (which
stamps every line itself; systemd says so through JOURNAL_STREAM); as JSON, always
stamped, with the figures a line carries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

LOG_ONE_LINE = "from gpumemd.logs import configure; import logging; configure('info'); logging.getLogger('gpumemd.x').info('hello')"
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gpumemd.x: hello$")


def _run(log: Path, journal_stream: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal_stream is not None:
        env["JOURNAL_STREAM"] = journal_stream
    with log.open("w") as stderr:
        subprocess.run([sys.executable, "-c", LOG_ONE_LINE], stderr=stderr, env=env, check=True, timeout=60)
    return log.read_text().strip()


def test_lines_are_stamped_outside_the_journal(tmp_path: Path) -> None:
    assert STAMP.match(_run(tmp_path / "log", None))


def test_lines_are_not_stamped_when_stderr_is_the_journal(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("")
    st = log.stat()
    assert _run(log, f"{st.st_dev}:{st.st_ino}") == "INFO gpumemd.x: hello"
    # A JOURNAL_STREAM inherited from elsewhere names another stream: still stamped.
    assert STAMP.match(_run(log, f"{st.st_dev}:{st.st_ino + 1}"))


def test_json_lines_are_stamped_even_in_the_journal_and_carry_figures(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("")
    st = log.stat()
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    program = (
        "from gpumemd.logs import configure; import logging; configure('info', 'json'); "
        "logging.getLogger('gpumemd.x').warning('refused: %d bytes', 5, extra={'figures': {'requested': 5, 'available': 2}})"
    )
    with log.open("w") as stderr:
        subprocess.run([sys.executable, "-c", program], stderr=stderr, env=env, check=True, timeout=60)
    entry = json.loads(log.read_text())
    assert re.match(r"\d{4}-\d\d-\d\dT", entry.pop("time"))
    assert entry == {"level": "WARNING", "logger": "gpumemd.x", "message": "refused: 5 bytes", "figures": {"requested": 5, "available": 2}}
