"""Client names on a real daemon: one live session per name, a name free again once its
session closed, and default names that stay unique within a process and step past a
name another process holds."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import gpumem
from conftest import child_env
from fdstore_kit import Restartable


def test_a_name_is_free_again_the_moment_its_session_closes(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    for _ in range(20):  # the daemon reads the old session's EOF before the new HELLO
        with gpumem.connect(0, name="restarts", runtime_dir=runtime_dir) as s:
            s.ping()


@pytest.mark.parametrize("store", ["without a store", "with an fd store"])
def test_a_name_closed_in_one_process_is_free_at_once_for_another(daemon_factory, runtime_dir, store: str) -> None:  # type: ignore[no-untyped-def]
    """close() returns once the daemon dropped the session: a process told "closed" (a
    supervisor, a restarted engine) may say HELLO under the name at once. With a store
    the session is resumable, and its watcher thread looks at the fd channel meanwhile."""
    script = "import gpumem\nfor _ in range(10):\n    gpumem.connect(0, name='handed-on').close()\n    print('closed', flush=True)\n    input()\n"
    with contextlib.ExitStack() as cleanup:
        if store == "without a store":
            daemon_factory("host")
        else:
            restartable = Restartable(runtime_dir, "host", [], child_env(runtime_dir))
            cleanup.callback(restartable.close)
            restartable.start()
        child = cleanup.enter_context(subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(runtime_dir)
        ))
        cleanup.callback(child.kill)
        assert child.stdin is not None and child.stdout is not None
        for _ in range(10):
            assert child.stdout.readline() == "closed\n"
            gpumem.connect(0, name="handed-on", runtime_dir=runtime_dir).close()
            child.stdin.write("\n")
            child.stdin.flush()
        assert child.wait(30) == 0


def test_close_waits_for_a_hung_daemon_a_bounded_time(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host")
    session = gpumem.connect(0, name="patient", runtime_dir=runtime_dir)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        session.channel.close()  # the fd channel alone: releasing an arena would wait for its own reply
        assert time.monotonic() - started < 3
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def test_default_names_stay_unique_in_one_process_and_step_past_a_taken_one(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    script = textwrap.dedent(
        """
        import json, os, sys, gpumem
        first = f"names-{os.getpid()}"
        squatter = gpumem.connect(0, name=first)  # as a process of another pid namespace would
        sessions = [gpumem.connect(0) for _ in range(3)]
        print(json.dumps([s.name for s in sessions]))
        """
    )
    path = runtime_dir / "names.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60, env=child_env(runtime_dir))
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout)
    pid = names[0].split("-")[1]
    assert names == [f"names-{pid}-2", f"names-{pid}-3", f"names-{pid}-4"]
