"""Every gpumemd flag also from the environment (GPUMEMD_<FLAG>), as the systemd unit's
per-instance environment file gives them: the variable applies, the command line wins,
and a bad value is one line naming the variable, exit 78."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env
from gpumemd_testkit import status

EX_CONFIG = 78


def _gpumemd(runtime_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumemd", "--runtime-dir", str(runtime_dir), "--backend", "host", *args],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir, **env),
    )


def test_a_flag_from_the_environment_applies(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host", args=["--host-capacity", "1GiB"], GPUMEMD_RESERVE="4MiB")
    assert status(runtime_dir)["device"]["reserve_bytes"] == 4 << 20


def test_the_command_line_wins_over_the_environment(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host", args=["--host-capacity", "1GiB", "--reserve", "8MiB"], GPUMEMD_RESERVE="4MiB", GPUMEMD_HOST_CAPACITY="2GiB")
    reply = status(runtime_dir)
    assert reply["device"]["reserve_bytes"] == 8 << 20 and reply["device"]["total_bytes"] == 1 << 30


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"GPUMEMD_METRICS_PORT": "nine"}, "$GPUMEMD_METRICS_PORT='nine'"),
        ({"GPUMEMD_ROUND_TIMEOUT": "-1"}, "$GPUMEMD_ROUND_TIMEOUT='-1'"),
        ({"GPUMEMD_CHUNK_SIZE": "3MiB"}, "--chunk-size ($GPUMEMD_CHUNK_SIZE) 3MiB is not a positive multiple"),
    ],
)
def test_a_bad_value_in_the_environment_is_one_line_naming_the_variable(runtime_dir, env, says) -> None:  # type: ignore[no-untyped-def]
    result = _gpumemd(runtime_dir, **env)
    assert result.returncode == EX_CONFIG, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpumemd: ") and says in lines[0], result.stderr


def test_help_names_each_flags_variable(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    result = _gpumemd(runtime_dir, "--help")
    assert result.returncode == 0, result
    text = " ".join(result.stdout.split())
    for variable in ("GPUMEMD_METRICS_PORT", "GPUMEMD_DEVICE", "GPUMEMD_SOCKET_GROUP", "GPUMEMD_RUNTIME_DIR", "GPUMEMD_LOG_FORMAT"):
        assert variable in text, variable
