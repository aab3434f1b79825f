"""Which daemon serves a device, for ``gpumem.connect()`` and gpumemctl alike.

A device is named by an index or by its UUID (or a unique prefix of it, such as
"GPU-8932f937"). Every daemon announces its index, UUID and backend in
``gpu<N>.json`` in the runtime directory; only daemons that hold their lock count, so
a file a killed daemon left behind never matches.

Without a runtime directory named (argument or $GPUMEMD_RUNTIME_DIR), a process that is
not root looks in the system directory first, where systemd's daemons (running as root)
live, then in its own: engines run as ordinary users, daemons as root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpumem_shared.driver import DriverUnavailable
from gpumem_shared.paths import Endpoints, daemon_alive, discover, runtime_dir_candidates
from gpumem.errors import DaemonUnavailable, DeviceAmbiguous


# How to point a client at a daemon whose runtime directory is not a default one.
ELSEWHERE = "give its runtime directory: $GPUMEMD_RUNTIME_DIR, connect(runtime_dir=...) or gpumemctl --runtime-dir"
# Read at the moment a hint is written, not at import: what this machine offers decides how
# a missing daemon is started.
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
UNIT_FOLDERS = (Path("/etc/systemd/system"), Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def start_hint(index: str) -> str:
    """How to start the missing daemon on this machine: the host backend where there is no
    NVIDIA driver, the unit where one is installed, else by hand."""
    if not NVIDIA_DRIVER.exists():
        start = f"no NVIDIA GPU here, so start one on host memory: gpumemd --device {index} --backend host --host-capacity 8GiB"
    elif any((folder / "gpumemd@.service").exists() for folder in UNIT_FOLDERS):
        start = f"start it: systemctl start gpumemd@{index}"
    else:
        start = f"start it: gpumemd --device {index} (or install the unit: gpumemctl unit)"
    return f"{start}; for a daemon serving elsewhere, {ELSEWHERE}"


def live_daemons(runtime_dir: Path) -> list[dict[str, Any]]:
    """Identity records of the daemons running in ``runtime_dir``, by index."""
    return [d for d in discover(runtime_dir) if daemon_alive(Endpoints(runtime_dir, d["index"]))]


def runtime_dirs(explicit: str | os.PathLike[str] | None) -> list[Path]:
    """Where to look: the directory given, else the candidates in order."""
    return [Path(explicit)] if explicit else runtime_dir_candidates()


def resolve_device(
    device: int | str, runtime_dir: str | os.PathLike[str] | None = None, *, cuda_ordinal: bool = True
) -> Endpoints:
    """The daemon for ``device``: a UUID (or unique prefix), or an index.

    With ``cuda_ordinal`` (``connect()``), an index is this process's CUDA ordinal,
    matched to its daemon by UUID, so CUDA_VISIBLE_DEVICES remapping is honoured;
    without it (gpumemctl, which loads no CUDA), an index is the daemon's own.
    Raises DaemonUnavailable when no live daemon has that UUID, DeviceAmbiguous (a
    DaemonUnavailable too) when several do. With several directories to look in, the
    first with a live daemon for the device wins; with none, DaemonUnavailable names
    every place looked."""
    dirs = runtime_dirs(runtime_dir)
    if len(dirs) == 1:
        return _resolve_in(device, dirs[0], cuda_ordinal)
    for directory in dirs:
        try:
            endpoints = _resolve_in(device, directory, cuda_ordinal)
        except DeviceAmbiguous:
            raise
        except DaemonUnavailable:
            continue
        if daemon_alive(endpoints):
            return endpoints
    index = str(device) if isinstance(device, int) or device.isdigit() else "<index>"
    raise DaemonUnavailable(
        f"no gpumemd serves device {device!r}: looked in {' and '.join(str(d) for d in dirs)}; {start_hint(index)}"
    )


def _resolve_in(device: int | str, runtime_dir: Path, cuda_ordinal: bool) -> Endpoints:
    if isinstance(device, str) and not device.isdigit():
        return _by_uuid(device, runtime_dir)
    index = int(device)
    if not cuda_ordinal:
        return Endpoints(runtime_dir, index)
    daemons = live_daemons(runtime_dir)
    if any(d.get("backend") == "cuda" for d in daemons):
        from gpumem_shared.driver.cuda import visible_device_uuids

        try:
            uuids = visible_device_uuids()
        except DriverUnavailable:
            uuids = []
        if index < len(uuids):
            for d in daemons:
                if d.get("uuid") == uuids[index]:
                    return Endpoints(runtime_dir, d["index"])
    return Endpoints(runtime_dir, index)


def _by_uuid(prefix: str, runtime_dir: Path) -> Endpoints:
    daemons = live_daemons(runtime_dir)
    wanted = prefix.lower()
    matches = [d for d in daemons if str(d.get("uuid", "")).lower().startswith(wanted)]
    if len(matches) == 1:
        return Endpoints(runtime_dir, matches[0]["index"])
    known = ", ".join(f"{d['index']}={d.get('uuid')}" for d in daemons) or "none"
    if not matches:
        raise DaemonUnavailable(f"no daemon serves device {prefix!r} in {runtime_dir} (daemons there: {known})")
    raise DeviceAmbiguous(f"several daemons match device {prefix!r} in {runtime_dir} (daemons there: {known}); give more of the UUID")
