"""What a client is told when no daemon serves its device: the device's own index in the
commands to run (not a literal N), and how to name a runtime directory elsewhere in the
terms the user has (not a parameter name alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpumem
import gpumem.discovery
from gpumem.discovery import resolve_device


def test_connect_without_a_daemon_names_the_device_and_where_to_point(runtime_dir: Path) -> None:
    with pytest.raises(gpumem.DaemonUnavailable) as caught:
        gpumem.connect(2, name="newcomer", runtime_dir=runtime_dir, timeout=2.0)
    message = caught.value.message
    assert "'systemctl start gpumemd@2' (or 'gpumemd --device 2')" in message, message
    assert "$GPUMEMD_RUNTIME_DIR, connect(runtime_dir=...) or gpumemctl --runtime-dir" in message, message


def test_no_daemon_in_any_default_directory_names_the_device_not_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = [tmp_path / "run", tmp_path / "xdg"]
    monkeypatch.setattr(gpumem.discovery, "runtime_dir_candidates", lambda: dirs)
    with pytest.raises(gpumem.DaemonUnavailable) as caught:
        resolve_device(5, None, cuda_ordinal=False)
    message = caught.value.message
    assert "gpumemd@N" not in message and "'systemctl start gpumemd@5' (or 'gpumemd --device 5')" in message, message
    assert "connect(runtime_dir=...)" in message, message
    with pytest.raises(gpumem.DaemonUnavailable) as by_uuid:
        resolve_device("GPU-1234", None, cuda_ordinal=False)
    assert "'systemctl start gpumemd@<index>'" in by_uuid.value.message, by_uuid.value.message
