"""What a client is told when no daemon serves its device: the device's own index in the
commands to run (not a literal N), a way to start one that fits the machine (the host
backend where there is no NVIDIA driver, the unit where it is installed), and how to name
a runtime directory elsewhere in the terms the user has (not a parameter name alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpumem
import gpumem.discovery
from gpumem.discovery import resolve_device


def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, driver: bool, unit: bool) -> None:
    """Make the hint see a machine with or without an NVIDIA driver and an installed unit."""
    (tmp_path / "driver").write_text("NVRM version\n")
    units = tmp_path / "units"
    units.mkdir(exist_ok=True)
    if unit:
        (units / "gpumemd@.service").write_text("[Service]\n")
    monkeypatch.setattr(gpumem.discovery, "NVIDIA_DRIVER", tmp_path / ("driver" if driver else "no-driver"))
    monkeypatch.setattr(gpumem.discovery, "UNIT_FOLDERS", (units,))


@pytest.mark.parametrize(
    ("driver", "unit", "hint"),
    [
        (False, False, "gpumemd --device 2 --backend host --host-capacity 8GiB"),
        (True, True, "systemctl start gpumemd@2"),
        (True, False, "start it: gpumemd --device 2 (or install the unit: gpumemctl unit)"),
    ],
)
def test_connect_without_a_daemon_says_how_to_start_one_on_this_machine(
    runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: bool, unit: bool, hint: str
) -> None:
    machine(monkeypatch, tmp_path, driver=driver, unit=unit)
    with pytest.raises(gpumem.DaemonUnavailable) as caught:
        gpumem.connect(2, name="newcomer", runtime_dir=runtime_dir, timeout=2.0)
    message = caught.value.message
    assert hint in message, message
    assert ("systemctl" in message) == unit, message  # no unit to start where none is installed
    assert "$GPUMEMD_RUNTIME_DIR, connect(runtime_dir=...) or gpumemctl --runtime-dir" in message, message


def test_no_daemon_in_any_default_directory_names_the_device_not_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine(monkeypatch, tmp_path, driver=True, unit=True)
    dirs = [tmp_path / "run", tmp_path / "xdg"]
    monkeypatch.setattr(gpumem.discovery, "runtime_dir_candidates", lambda: dirs)
    with pytest.raises(gpumem.DaemonUnavailable) as caught:
        resolve_device(5, None, cuda_ordinal=False)
    message = caught.value.message
    assert "gpumemd@N" not in message and "systemctl start gpumemd@5" in message, message
    assert "connect(runtime_dir=...)" in message, message
    with pytest.raises(gpumem.DaemonUnavailable) as by_uuid:
        resolve_device("GPU-1234", None, cuda_ordinal=False)
    assert "systemctl start gpumemd@<index>" in by_uuid.value.message, by_uuid.value.message
