"""The systemd unit's sandbox applied to a gpumemd under test, as far as the machine allows.

- With systemd as PID 1 (and root): ``systemd_run_command`` runs the daemon as a
  transient service with the unit's own sandbox lines as properties.
- Without it (a container, a CI runner) but as root: ``emulated_command`` execs this file
  under ``unshare --mount``; it rebuilds what ProtectSystem=strict, ReadWritePaths
  (RuntimeDirectory=), PrivateTmp= and ProtectHome= mean with mounts, then execs the
  daemon through ``setpriv`` with NoNewPrivileges=, CapabilityBoundingSet= and
  SupplementaryGroups=. An install under /tmp (a checkout cloned there) stays visible
  through the private /tmp, bound back into it read-only, where systemd would hide it
  (the test skips under systemd then; ``gpumemctl unit`` refuses such an install).
  The seccomp lines (SystemCallFilter=, RestrictAddressFamilies=,
  RestrictNamespaces=, ...) and DevicePolicy= need systemd: not applied then.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The unit's sandbox: what systemd_run_command passes on, and what the tests require.
SANDBOX_KEYS = (
    "NoNewPrivileges", "CapabilityBoundingSet", "SupplementaryGroups", "ProtectSystem", "ProtectHome", "PrivateTmp",
    "PrivateMounts", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectClock", "ProtectHostname", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
    "RestrictAddressFamilies", "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber", "DevicePolicy",
    "DeviceAllow",
)
HOMES = (Path("/home"), Path("/root"), Path("/run/user"))
_API_TREES = (Path("/dev"), Path("/proc"), Path("/sys"))
_TMP = (Path("/tmp"), Path("/var/tmp"))
_MS_BIND = 4096  # <sys/mount.h>


def systemd_is_pid1() -> bool:
    """sd_booted(): what systemd-run needs to start a service."""
    return Path("/run/systemd/system").is_dir()


def under_a_home(*paths: Path) -> bool:
    """ProtectHome= would hide the daemon's own code (a venv in /root, a checkout in /home)."""
    return any(p.resolve().is_relative_to(home) for p in paths for home in HOMES)


def under_tmp(*paths: Path) -> list[Path]:
    """Those of ``paths`` (resolved) that PrivateTmp= would hide: the daemon's own code
    where a checkout lives in /tmp."""
    hidden = {p.resolve() for p in paths if any(p.resolve().is_relative_to(tmp) for tmp in _TMP)}
    return sorted(p for p in hidden if not any(p != q and p.is_relative_to(q) for q in hidden))


def systemd_run_command(unit: str, settings: list[tuple[str, str]], runtime_dir_name: str, argv: list[str]) -> list[str]:
    """A transient notify service with the unit's sandbox; ``runtime_dir_name`` is the
    test's own RuntimeDirectory= (the device lock directory is the unit's)."""
    props = [f"--property={key}={value}" for key, value in settings]
    props += [
        f"--property=RuntimeDirectory={runtime_dir_name} gpumemd-devices", "--property=RuntimeDirectoryMode=0755",
        "--property=RuntimeDirectoryPreserve=yes", "--property=NotifyAccess=main", "--property=UnsetEnvironment=CUDA_VISIBLE_DEVICES",
        "--property=Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID", "--property=LimitNOFILE=1048576",
    ]
    return ["systemd-run", f"--unit={unit}", "--service-type=notify", "--collect", "--quiet", *props, "--", *argv]


def emulated_command(settings: dict[str, str], writable: list[Path], argv: list[str], visible: tuple[Path, ...] = ()) -> list[str]:
    """``visible``: paths under /tmp that stay there (read-only) behind PrivateTmp=."""
    spec = {"settings": settings, "writable": [str(p) for p in writable], "argv": argv, "visible": [str(p) for p in visible]}
    return ["unshare", "--mount", "--propagation", "private", "--", sys.executable, __file__, json.dumps(spec)]


def emulation_tools() -> str | None:
    """What is missing to emulate the sandbox here, or None."""
    if os.geteuid() != 0:
        return "mount namespaces and capability bounds need root"
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    # Root in a container may still lack CAP_SYS_ADMIN or CAP_SETPCAP: try each step once.
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         "mount -t tmpfs tmpfs /tmp && mount -o remount,bind,ro / && "
         "exec setpriv --no-new-privs --bounding-set=-all --inh-caps=-all --clear-groups -- true"],
        capture_output=True, text=True, timeout=60,
    )
    return None if probe.returncode == 0 else f"this root may not make the sandbox: {probe.stderr.strip()}"


def _mount_points() -> list[Path]:
    points = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            # mountinfo writes a blank, tab, newline or backslash as an octal escape (\040)
            points.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])))
    return points


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _bind(source: str, target: Path) -> None:
    """mount --bind by the system call, the source taken as the kernel resolves it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), str(target).encode(), None, _MS_BIND, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"bind {source} on {target}: {os.strerror(errno)}")


def _apply(settings: dict[str, str], writable: list[Path], visible: list[Path]) -> None:
    private_tmp = settings.get("PrivateTmp") == "yes"
    if private_tmp:
        for tmp in _TMP:
            if not tmp.is_dir():
                continue
            # The old tree stays reachable through a descriptor on it. mount(8) would resolve
            # /proc/self/fd/N/... to the path's name, under the new tmpfs: mount(2) follows it.
            old = os.open(tmp, os.O_PATH | os.O_DIRECTORY)
            _mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", str(tmp))
            for path in (p for p in visible if p.is_relative_to(tmp)):
                path.mkdir(parents=True, exist_ok=True)
                _bind(f"/proc/self/fd/{old}/{path.relative_to(tmp)}", path)
            os.close(old)
    if settings.get("ProtectHome") == "yes":
        for home in HOMES:
            if home.is_dir():
                _mount("-t", "tmpfs", "-o", "ro,mode=000,nosuid,nodev,noexec", "tmpfs", str(home))
    for path in writable:
        _mount("--bind", str(path), str(path))
    if settings.get("ProtectSystem") == "strict":
        keep = [*writable, *(_TMP if private_tmp else ())]
        for point in _mount_points():
            if any(point.is_relative_to(tree) for tree in _API_TREES) or point in keep:
                continue
            _mount("-o", "remount,bind,ro", str(point))
        if settings.get("ProtectKernelTunables") == "yes":
            for tree in (Path("/proc/sys"), Path("/sys")):
                _mount("--bind", str(tree), str(tree))
                _mount("-o", "remount,bind,ro", str(tree))


def _setpriv(settings: dict[str, str]) -> list[str]:
    cmd = ["setpriv"]
    if settings.get("NoNewPrivileges") == "yes":
        cmd.append("--no-new-privs")
    if "CapabilityBoundingSet" in settings:
        kept = [f"+{cap.lower().removeprefix('cap_')}" for cap in settings["CapabilityBoundingSet"].split()]
        cmd += [f"--bounding-set=-all{''.join(',' + k for k in kept)}", "--inh-caps=-all"]
    groups = settings.get("SupplementaryGroups", "").split()
    cmd += [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
    return [*cmd, "--"]


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    _apply(spec["settings"], [Path(p) for p in spec["writable"]], [Path(p) for p in spec["visible"]])
    argv = [*_setpriv(spec["settings"]), *spec["argv"]]
    os.execvp(argv[0], argv)
