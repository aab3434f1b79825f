"""The daemon's start: its phases line (startup.py), and the driver started beside the
imports (cli._DriverStart), whose failures and hang come back to the main thread."""

from __future__ import annotations

import re
import threading

import pytest

from gpumem_shared.driver import Driver, DriverUnavailable
from gpumem_shared.driver.host import HostDriver
from gpumemd import cli
from gpumemd.startup import PREFIX, StartupClock


def test_the_line_says_each_phase_in_order_and_their_total() -> None:
    clock = StartupClock(0.0)  # "began" at boot: the interpreter phase is negative, shown as 0
    clock.mark("imports")
    clock.mark("driver")
    clock.note("3 chunks restored")
    text, figures = clock.line()
    assert text.startswith(PREFIX + " interpreter 0.0 ms, imports ")
    assert [name for name, _ in re.findall(r"(\w+) ([\d.]+) ms", text.partition(" (")[0])] == ["interpreter", "imports", "driver", "total"]
    assert figures["total"] == pytest.approx(figures["imports"] + figures["driver"]) and figures["imports"] > 0
    assert text.endswith(" (3 chunks restored)")


def test_time_before_python_started_is_no_interpreters() -> None:
    """scripts/daemon.sh installs (30 s on a first run) in the process that then exec's
    gpumemd: the line named that wait "interpreter 29618.0 ms"."""
    clock = StartupClock(1000.0)
    clock.created = 1000.0 - 29.6  # the process was made 29.6 s before the first import
    clock.mark("imports")
    text, figures = clock.line()
    assert "interpreter" not in figures and figures["total"] == pytest.approx(figures["imports"])
    assert "(the process ran 29.6 s before it started Python, e.g. an install by the script that exec'd gpumemd: not counted)" in text
    clock.created = 1000.0 - 0.08
    assert clock.line()[1]["interpreter"] == pytest.approx(80.0)


def test_the_driver_start_hands_its_driver_and_fence_to_the_main_thread() -> None:
    made: list[str] = []

    def make() -> Driver:
        made.append(threading.current_thread().name)
        return HostDriver(0, 1 << 30)

    driver, fence = cli._DriverStart(make).wait()
    assert isinstance(driver, HostDriver) and made == ["gpumemd-driver-start"]
    assert fence(2**22 + 12345, 0.0) == ""  # the host fence: a pid that never ran is gone


def test_a_driver_that_is_unavailable_is_a_configuration_error() -> None:
    def make() -> Driver:
        raise DriverUnavailable("no NVIDIA driver found")

    with pytest.raises(cli.ConfigError, match="cannot use the CUDA backend: no NVIDIA driver found; .* --backend host"):
        cli._DriverStart(make).wait()


def test_a_driver_that_fails_otherwise_raises_its_error() -> None:
    def make() -> Driver:
        raise OSError("the device node is gone")

    with pytest.raises(OSError, match="the device node is gone"):
        cli._DriverStart(make).wait()


def test_a_hung_driver_start_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "DRIVER_START_TIMEOUT", 0.05)
    release = threading.Event()

    def make() -> Driver:
        release.wait(30)
        return HostDriver(0, 1 << 30)

    starting = cli._DriverStart(make)
    try:
        with pytest.raises(cli.DriverHung, match="did not start within 0.05s .* nvidia-smi"):
            starting.wait()
    finally:
        release.set()
        # Its thread done before the next test counts descriptors (the host driver reads
        # /etc/machine-id).
        monkeypatch.setattr(cli, "DRIVER_START_TIMEOUT", 10.0)
        starting.wait()
