"""The systemd unit: one file, shipped beside gpumemctl and linked from systemd/; what
``gpumemctl unit`` prints (ExecStart naming the installed gpumemd) systemd itself
accepts; and it says what the daemon relies on."""

from __future__ import annotations

import contextlib
import grp
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox_kit
from conftest import ROOT
from gpumem_shared.paths import Endpoints
from gpumemd import runtime
from gpumemd_testkit import MiB, RawSession, status
from sandbox_kit import SANDBOX_KEYS

UNIT = ROOT / "systemd" / "gpumemd@.service"
PACKAGED = ROOT / "client" / "gpumem" / "gpumemd@.service"
NO_ANALYZE = "systemd-analyze is not installed (apt-get install systemd, or dnf install systemd)"


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


def _hidden_install() -> list[Path]:
    """The install's paths the unit's sandbox would hide from its daemon (PrivateTmp=, ProtectHome=)."""
    return [p for p in _install() if sandbox_kit.under_tmp(p) or sandbox_kit.under_a_home(p)]


def _printed_for_this_install() -> subprocess.CompletedProcess[str]:
    """``gpumemctl unit``, naming the installed gpumemd where the install lies in a place the
    unit hides (then it prints with a warning; left to find it, it refuses)."""
    return _printed_unit("--gpumemd", _installed_gpumemd()) if _hidden_install() else _printed_unit()


def test_gpumemctl_unit_refuses_an_install_the_units_sandbox_hides(tmp_path: Path) -> None:
    """A checkout cloned into /tmp deploys a unit whose daemon cannot start (PrivateTmp=
    hides its code): gpumemctl unit says why instead of printing it."""
    if _hidden_install():
        refused = _printed_unit()
        assert refused.returncode == 1 and refused.stdout == "", refused
        assert "which the unit's P" in refused.stderr and "install gpumemd elsewhere" in refused.stderr, refused.stderr
    named = tmp_path / "venv" / "bin" / "gpumemd"
    named.parent.mkdir(parents=True)
    named.write_text("#!/bin/sh\n")
    warned = _printed_unit("--gpumemd", str(named))
    assert warned.returncode == 0 and f"ExecStart={named} --device %i" in warned.stdout, warned
    assert f"gpumemctl: warning: {named} lies in /tmp, which the unit's PrivateTmp= hides from the daemon" in warned.stderr, warned


def test_gpumemctl_unit_prints_the_unit_with_the_installed_gpumemd() -> None:
    result = _printed_for_this_install()
    assert result.returncode == 0 and (result.stderr == "") == (not _hidden_install()), result
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
    assert _one(service, "RuntimeDirectory").split()[0] == "gpumemd"
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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason=NO_ANALYZE)
def test_systemd_analyze_verify_passes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    printed = _printed_for_this_install()
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


def test_the_unit_is_sandboxed() -> None:
    """What the daemon needs and no more: systemd-analyze security says 9.6 UNSAFE without
    these lines and 2.2 OK with them (test_systemd_analyze_security_rates_the_unit_ok)."""
    service = _sections(UNIT.read_text())["Service"]
    for key in SANDBOX_KEYS:
        assert any(k == key for k, _ in service), f"{key}= is missing from the unit's sandbox"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "RestrictNamespaces", "LockPersonality", "RestrictSUIDSGID"):
        assert _one(service, key) == "yes", key
    assert _one(service, "ProtectSystem") == "strict"
    assert _one(service, "CapabilityBoundingSet") == ""  # root, and no capability
    # The sockets go to the group --socket-group names without CAP_CHOWN: as a member.
    exec_start = _one(service, "ExecStart").split()
    assert _one(service, "SupplementaryGroups") == exec_start[exec_start.index("--socket-group") + 1]
    # ProtectSystem=strict: what the daemon writes is the runtime directory and the device lock directory.
    assert set(_one(service, "RuntimeDirectory").split()) == {"gpumemd", "gpumemd-devices"}
    assert Path(runtime.DEVICE_LOCK_DIR).name == "gpumemd-devices" and runtime.DEVICE_LOCK_DIR.parent == Path("/run")
    assert set(_one(service, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert _one(service, "SystemCallFilter") == "@system-service"
    assert _one(service, "DevicePolicy") == "closed"
    assert _one(service, "DeviceAllow") == "char-nvidia* rw"
    # Left out on purpose, with the reason in the unit: CUDA's JIT, clients' /proc entries, the GPUs themselves.
    for key in ("MemoryDenyWriteExecute", "ProtectProc", "ProcSubset", "PrivateDevices"):
        assert not any(k == key for k, _ in service), f"{key}= breaks the daemon: see the unit's comment"


def _systemd_analyze_offline(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", unit.name],
        capture_output=True, text=True, timeout=120, cwd=unit.parent,
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason=NO_ANALYZE)
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path) -> None:  # type: ignore[no-untyped-def]
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text())
    result = _systemd_analyze_offline(unit)
    if "Overall exposure level" not in result.stdout:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline (systemd 250 or later can): {result.stderr.strip()}")
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert score is not None, result
    assert float(score.group(1)) <= 3.0 and score.group(2) == "OK", score.group(0)
    # The rating is real: the unit without its sandbox is UNSAFE.
    bare = tmp_path / "bare" / UNIT.name
    bare.parent.mkdir()
    bare.write_text("\n".join(line for line in unit.read_text().splitlines() if line.partition("=")[0] not in SANDBOX_KEYS))
    unsafe = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", _systemd_analyze_offline(bare).stdout)
    assert unsafe is not None and float(unsafe.group(1)) > 9.0, unsafe


def _sandbox_settings() -> list[tuple[str, str]]:
    return [(k, v) for k, v in _sections(UNIT.read_text())["Service"] if k in SANDBOX_KEYS]


def _outsider_group() -> grp.struct_group:
    """A group this process is not a member of: the daemon gets it as the unit gets
    gpumem, by SupplementaryGroups= alone."""
    mine = {os.getgid(), *os.getgroups()}
    for group in grp.getgrall():
        if group.gr_gid not in mine:
            return group
    pytest.skip("every group on this machine is one of this process's groups")


def _install() -> list[Path]:
    """Where the daemon's code lives: the console script, the venv, its Python, the
    package (the checkout, for an editable install)."""
    return [Path(_installed_gpumemd()), Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable), ROOT]


class _Sandboxed:
    """gpumemd under the unit's sandbox: a transient systemd service, or the emulation."""

    def __init__(self, settings: list[tuple[str, str]], argv: list[str], runtime_dir: Path, log: Path) -> None:
        self.runtime_dir, self.log_path = runtime_dir, log
        self.unit: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._made_lock_dir = False
        in_tmp = sandbox_kit.under_tmp(*_install()) if ("PrivateTmp", "yes") in settings else []
        if sandbox_kit.systemd_is_pid1() and os.geteuid() == 0 and shutil.which("systemd-run"):
            if in_tmp:
                pytest.skip(f"gpumemd is installed in /tmp ({in_tmp[0]}), which the unit's PrivateTmp= hides from the "
                            "service it starts: clone or install elsewhere (gpumemctl unit refuses such an install)")
            self.unit = f"{runtime_dir.name}.service"
            started = subprocess.run(
                sandbox_kit.systemd_run_command(self.unit, settings, runtime_dir.name, argv), capture_output=True, text=True, timeout=150
            )
            assert started.returncode == 0, f"{started.stderr}\n{self.log()}"
            self.pid = int(subprocess.check_output(["systemctl", "show", "-p", "MainPID", "--value", self.unit], text=True))
        else:
            missing = sandbox_kit.emulation_tools()
            if missing is not None:
                pytest.skip(f"no systemd as PID 1 here to run the unit's sandbox, and it cannot be emulated: {missing}")
            runtime_dir.mkdir(mode=0o755)
            self._made_lock_dir = not runtime.DEVICE_LOCK_DIR.exists()
            runtime.DEVICE_LOCK_DIR.mkdir(mode=0o755, exist_ok=True)  # as RuntimeDirectory= makes it
            writable = [runtime_dir, runtime.DEVICE_LOCK_DIR]
            with log.open("wb") as out:
                self.proc = subprocess.Popen(
                    sandbox_kit.emulated_command(dict(settings), writable, argv, tuple(in_tmp)), stdout=out, stderr=subprocess.STDOUT
                )
            self.pid = self.proc.pid  # unshare, the kit and setpriv each exec the next

    def log(self) -> str:
        if self.unit is not None:
            return subprocess.run(["journalctl", "-u", self.unit, "--no-pager", "-o", "cat"], capture_output=True, text=True, timeout=30).stdout
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 120.0) -> None:
        info = Endpoints(self.runtime_dir, 0).info_path
        deadline = time.monotonic() + timeout
        while not info.exists():
            assert self.proc is None or self.proc.poll() is None, f"gpumemd exited {self.proc.returncode}: {self.log()}"
            assert time.monotonic() < deadline, f"gpumemd did not serve within {timeout} s: {self.log()}"
            time.sleep(0.05)

    def wait_exit(self, timeout: float = 120.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"gpumemd still runs after {timeout} s: {self.log()}") from None

    def stop(self) -> None:
        try:
            self._stop()
        finally:
            if self._made_lock_dir:
                with contextlib.suppress(OSError):  # a daemon's lock in it since: it stays
                    runtime.DEVICE_LOCK_DIR.rmdir()

    def _stop(self) -> None:
        if self.unit is not None:
            subprocess.run(["systemctl", "stop", self.unit], capture_output=True, timeout=60)
        elif self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                assert self.proc.wait(30) == 0, self.log()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"gpumemd ignored SIGTERM for 30 s: {self.log()}") from None


def _sandboxed_argv(backend: str, group: str, runtime_dir: Path) -> list[str]:
    argv = [_installed_gpumemd(), "--device", "0", "--socket-group", group, "--runtime-dir", str(runtime_dir)]
    return argv + (["--backend", "host", "--host-capacity", "1GiB"] if backend == "host" else [])


def test_the_daemon_serves_inside_the_units_sandbox(backend: str, tmp_path: Path) -> None:
    """The unit's sandbox as systemd applies it (systemd as PID 1) or as far as mounts and
    setpriv rebuild it; the runtime directory and socket group are the test's own. The
    daemon holds no capability, runs with no_new_privs and a read-only system, and serves
    a client that commits memory."""
    group = _outsider_group()
    settings = [(k, group.gr_name if k == "SupplementaryGroups" else v) for k, v in _sandbox_settings()]
    if sandbox_kit.under_a_home(Path(sys.prefix), Path(sys.base_prefix), ROOT):
        settings = [(k, v) for k, v in settings if k != "ProtectHome"]  # it would hide the daemon's own code
    runtime_dir = Path("/run") / f"gpumemd-sandbox-{os.getpid()}"  # PrivateTmp= hides /tmp
    daemon = _Sandboxed(settings, _sandboxed_argv(backend, group.gr_name, runtime_dir), runtime_dir, tmp_path / "gpumemd.log")
    try:
        daemon.wait_serving()
        # PrivateTmp=: the daemon's /tmp is its own (a checkout in /tmp stays visible under the emulation)
        seen_from_daemon = Path(f"/proc/{daemon.pid}/root") / tmp_path.relative_to("/")
        assert not tmp_path.is_relative_to("/tmp") or not seen_from_daemon.exists(), "the daemon sees this /tmp"
        proc_status = Path(f"/proc/{daemon.pid}/status").read_text()
        fields = dict(line.split(":\t", 1) for line in proc_status.splitlines())
        assert fields["NoNewPrivs"].strip() == "1" and int(fields["CapBnd"], 16) == 0 and int(fields["CapEff"], 16) == 0, fields
        assert str(group.gr_gid) in fields["Groups"].split()
        assert os.readlink(f"/proc/{daemon.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        endpoints = Endpoints(runtime_dir, 0)
        assert os.stat(endpoints.fd_path).st_gid == group.gr_gid and os.stat(endpoints.zmq_path).st_gid == group.gr_gid
        with RawSession(runtime_dir, "sandboxed") as session:
            session.create("weights", 256 * MiB)
            committed = session.commit("weights", 64 * MiB)
            assert committed["ok"], committed
            arenas = status(runtime_dir)["arenas"]
            assert [a["committed"] for a in arenas if a["name"] == "weights"] == [64 * MiB], arenas
    finally:
        daemon.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert not endpoints.info_path.exists(), "a clean stop removes the identity file"


def test_without_supplementary_groups_the_sandboxed_daemon_names_the_line(tmp_path: Path) -> None:
    """With no capability, root gives the sockets to the group only as a member of it: a
    unit that drops SupplementaryGroups= fails at start, saying which line is missing."""
    group = _outsider_group()
    settings = [(k, v) for k, v in _sandbox_settings() if k not in ("SupplementaryGroups", "ProtectHome")]
    runtime_dir = Path("/run") / f"gpumemd-sandbox-{os.getpid()}"
    if sandbox_kit.systemd_is_pid1():
        pytest.skip("checked with the emulation only: a transient service that fails to start leaves its journal behind")
    daemon = _Sandboxed(settings, _sandboxed_argv("host", group.gr_name, runtime_dir), runtime_dir, tmp_path / "gpumemd.log")
    try:
        assert daemon.wait_exit() == 78, daemon.log()  # EX_CONFIG: the unit does not restart it
        assert "SupplementaryGroups= must name the --socket-group" in daemon.log(), daemon.log()
    finally:
        daemon.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)
