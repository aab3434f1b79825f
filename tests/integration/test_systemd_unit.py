"""The systemd unit: one file, shipped beside gpumemctl and linked from systemd/; what
``gpumemctl unit`` prints (ExecStart naming the installed gpumemd) systemd itself
accepts; and it says what the daemon relies on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

UNIT = ROOT / "systemd" / "gpumemd@.service"
PACKAGED = ROOT / "client" / "gpumem" / "gpumemd@.service"


def _installed_gpumemd() -> str:
    beside = Path(sys.executable).parent / "gpumemd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("gpumemd")
    if found is None:
        pytest.skip("the gpumemd console script is not installed (pip install -e .)")
    return found


def _sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"setting outside a section: {raw!r}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _one(entries: list[tuple[str, str]], key: str) -> str:
    values = [v for k, v in entries if k == key]
    assert len(values) == 1, f"{key}= appears {len(values)} times"
    return values[0]


def _printed_unit(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpumemctl unit`` as installed in this environment (the script beside the Python)."""
    gpumemctl = Path(sys.executable).parent / "gpumemctl"
    if not gpumemctl.is_file():
        pytest.skip("the gpumemctl console script is not installed (pip install -e .)")
    return subprocess.run([str(gpumemctl), "unit", *args], capture_output=True, text=True, timeout=60)


def test_the_source_tree_links_to_the_packaged_unit() -> None:
    assert UNIT.is_symlink() and UNIT.resolve() == PACKAGED.resolve(), "one unit file, not two copies"


def test_gpumemctl_unit_prints_the_unit_with_the_installed_gpumemd() -> None:
    result = _printed_unit()
    assert result.returncode == 0 and result.stderr == "", result
    printed, packaged = result.stdout.splitlines(), PACKAGED.read_text().splitlines()
    changed = [(a, b) for a, b in zip(printed, packaged) if a != b]
    assert len(printed) == len(packaged) and len(changed) == 1, changed
    ((line, _),) = changed
    assert line == f"ExecStart={_installed_gpumemd()} --device %i --socket-group gpumem"
    quoted = _printed_unit("--gpumemd", "/opt/gpu mem/50%/gpumemd").stdout
    assert 'ExecStart="/opt/gpu mem/50%%/gpumemd" --device %i' in quoted, "blanks quoted, % escaped for systemd"
    relative = _printed_unit("--gpumemd", "gpumemd")
    assert relative.returncode == 1 and "absolute path" in relative.stderr


def test_unit_declares_what_the_daemon_relies_on() -> None:
    service = _sections(UNIT.read_text())["Service"]
    assert _one(service, "Type") == "notify"  # READY=1 is sent once the sockets serve
    assert int(_one(service, "WatchdogSec").rstrip("s")) > 0
    assert _one(service, "RuntimeDirectory") == "gpumemd"
    assert _one(service, "RuntimeDirectoryPreserve") == "yes"
    assert _one(service, "Restart") == "on-failure"
    assert "78" in _one(service, "RestartPreventExitStatus").split()  # EX_CONFIG: no point restarting
    # Per-instance flags (GPUMEMD_METRICS_PORT=9400) in an optional file: "-" lets an instance have none.
    assert _one(service, "EnvironmentFile") == "-/etc/gpumemd/gpumemd-%i.env"
    nofile = _one(service, "LimitNOFILE")
    assert nofile == "infinity" or int(nofile) >= 65536
    exec_start = _one(service, "ExecStart").split()
    assert Path(exec_start[0]).name == "gpumemd"
    assert exec_start[exec_start.index("--device") + 1] == "%i"
    assert "--socket-group" in exec_start and exec_start[exec_start.index("--socket-group") + 1]
    assert "--backend" not in exec_start  # CUDA, or a clear refusal
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: the unit must unset it, never set it.
    assert "CUDA_VISIBLE_DEVICES" in _one(service, "UnsetEnvironment").split()
    assert not any(v.startswith("CUDA_VISIBLE_DEVICES") for k, v in service if k == "Environment")


def _unit_environment(service: list[tuple[str, str]], inherited: dict[str, str]) -> dict[str, str]:
    """The environment systemd gives ExecStart: the manager's, less UnsetEnvironment=,
    plus Environment= (assignments of the form KEY=VALUE, unquoted in this unit)."""
    env = dict(inherited)
    for key, value in service:
        if key == "UnsetEnvironment":
            for name in value.split():
                env.pop(name, None)
        elif key == "Environment":
            for assignment in value.split():
                name, _, setting = assignment.partition("=")
                env[name] = setting
    return env


@pytest.mark.gpu
def test_the_daemon_serves_the_gpu_with_the_units_environment_and_arguments(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The unit's own environment and ExecStart arguments (instance 0), as systemd would
    run them; only the runtime directory and the socket group point at test-owned ones.
    The manager's environment here carries an empty CUDA_VISIBLE_DEVICES on purpose."""
    import grp

    from gpumem_shared.paths import Endpoints
    from gpumemd_testkit import status

    service = _sections(UNIT.read_text())["Service"]
    inherited = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    env = _unit_environment(service, inherited)
    assert "CUDA_VISIBLE_DEVICES" not in env
    args = [a.replace("%i", "0") for a in _one(service, "ExecStart").split()[1:]]
    args[args.index("--socket-group") + 1] = grp.getgrgid(os.getgid()).gr_name
    runtime_dir = tmp_path / "run"
    log = tmp_path / "gpumemd.log"
    with log.open("w") as stderr, subprocess.Popen([_installed_gpumemd(), *args, "--runtime-dir", str(runtime_dir)], env=env, stderr=stderr) as proc:
        try:
            info = Endpoints(runtime_dir, 0).info_path
            deadline = time.monotonic() + 120
            while not info.exists():
                assert proc.poll() is None, f"gpumemd@0 exited {proc.returncode}: {log.read_text()}"
                assert time.monotonic() < deadline, "gpumemd@0 did not start serving within 120 s"
                time.sleep(0.1)
            reply = status(runtime_dir)
            assert reply["daemon"]["backend"] == "cuda" and reply["device"]["uuid"].startswith("GPU-"), reply["device"]
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0, log.read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_passes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    printed = _printed_unit()
    assert printed.returncode == 0, printed
    unit = tmp_path / UNIT.name
    unit.write_text(printed.stdout)
    text = UNIT.read_text()
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result
    assert result.stderr == "", result.stderr

    # The check is real: a unit whose ExecStart does not exist is refused.
    broken = tmp_path / "broken" / UNIT.name
    broken.parent.mkdir()
    broken.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={tmp_path}/no-such-gpumemd", text, flags=re.MULTILINE))
    result = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode != 0 or result.stderr, result
