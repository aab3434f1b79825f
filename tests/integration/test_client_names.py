"""Client names on a real daemon: one live session per name, a name free again once its
session closed, and default names that stay unique within a process and step past a
name another process holds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import gpumem
from conftest import child_env


def test_a_name_is_free_again_the_moment_its_session_closes(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    for _ in range(20):  # the daemon reads the old session's EOF before the new HELLO
        with gpumem.connect(0, name="restarts", runtime_dir=runtime_dir) as s:
            s.ping()


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
