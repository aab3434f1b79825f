"""Fixtures shared by every tier.

- ``runtime_dir``: a short private directory (AF_UNIX paths are limited to 108 bytes).
- ``daemon_factory`` / ``daemon``: a real gpumemd process (``python -m gpumemd``).
- ``backend``: "host" always; "cuda" only on a machine with an NVIDIA GPU, marked
  ``gpu``. Integration tests that take ``backend`` run the same scenario on both.
- ``run_client``: a client scenario from tests/clients.py in its own process.

The test process itself never initialises CUDA: every CUDA user is a child.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).resolve().parent / "clients.py"
START_TIMEOUT = 20.0


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    probe = "from gpumem_shared.driver.cuda import visible_device_uuids as v; import sys; sys.exit(0 if v() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    probe = "from gpumem_shared.driver.cuda import visible_device_uuids as v; print(len(v()))"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver (run 'pytest -m gpu' on a GPU machine)")
        for item in gpu_items:
            item.add_marker(skip)
    two = [item for item in items if item.get_closest_marker("gpu2")]
    if two and cuda_device_count() < 2:
        skip = pytest.mark.skip(reason="needs two NVIDIA GPUs (run 'pytest -m gpu' on a machine with two)")
        for item in two:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Why tests skipped, counted by reason: "153 skipped" alone leaves a newcomer to guess
    whether something is broken or merely absent (a GPU, a tool)."""
    reasons: collections.Counter[str] = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[str(reason).removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", f"{sum(reasons.values())} skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")


# tmp_path directories go in a directory of this run's own, removed when it ends: pytest's
# default keeps the last three runs' under /tmp/pytest-of-<user> for good.
_OWN_BASETEMP = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp is None:
        config.option.basetemp = config.stash[_OWN_BASETEMP] = Path(tempfile.mkdtemp(prefix="gpumemd-pytest-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


# pytest-timeout stops its timer as soon as a test fails (its pytest_exception_interact
# hook, meant for pdb, runs for every failure), so a failed test's teardown would have no
# bound: a fixture that closes a session a stuck call still holds, or waits for a process,
# could hold the suite for minutes. Such a teardown gets this long, then fails.
TEARDOWN_TIMEOUT_S = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield  # pytest-timeout's timer still runs, and covers the teardown
        return

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{item.nodeid}: its teardown still runs after {TEARDOWN_TIMEOUT_S}s (a fixture waits on something stuck)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEARDOWN_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpumemd-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def child_env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUMEMD_RUNTIME_DIR"] = str(runtime_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.update(extra)
    return env


# Runs as the daemon's parent for a moment: sets both open-file limits, then execs argv.
_NOFILE_EXEC = "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"


class Daemon:
    """A gpumemd process under test; ``nofile`` caps its open-file limit (soft and hard)."""

    def __init__(
        self, runtime_dir: Path, backend: str, device: int, args: list[str], env: dict[str, str], nofile: int | None = None
    ) -> None:
        self.runtime_dir = runtime_dir
        self.backend = backend
        self.device = device
        self.log_path = runtime_dir / f"gpumemd{device}.log"
        cmd = [sys.executable, "-m", "gpumemd", "--device", str(device), "--backend", backend, "--runtime-dir", str(runtime_dir)]
        if nofile is not None:
            cmd = [sys.executable, "-c", _NOFILE_EXEC, str(nofile), *cmd]
        if backend == "host" and not any(a.startswith("--host-capacity") for a in args):
            cmd += ["--host-capacity", "4GiB"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd + args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def info_path(self) -> Path:
        return self.runtime_dir / f"gpu{self.device}.json"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gpumemd exited with {self.proc.returncode}:\n{self.log()}")
            if self.info_path.exists():
                return self
            time.sleep(0.02)
        raise AssertionError(f"gpumemd did not become ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"gpumemd ignored SIGTERM for {timeout}s:\n{self.log()}") from None
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def daemon_factory(runtime_dir: Path) -> Iterator[object]:
    started: list[Daemon] = []

    def start(
        backend: str = "host", device: int = 0, args: list[str] | None = None, wait: bool = True, nofile: int | None = None, **env: str
    ) -> Daemon:
        d = Daemon(runtime_dir, backend, device, list(args or []), child_env(runtime_dir, **env), nofile)
        started.append(d)
        return d.wait_ready() if wait else d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        d._log.close()


@pytest.fixture
def daemon(daemon_factory: object, backend: str) -> Daemon:
    return daemon_factory(backend)  # type: ignore[operator]


class Client:
    """A client scenario running in its own process; talks line by line on stdio."""

    def __init__(self, runtime_dir: Path, scenario: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CLIENTS), scenario, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or child_env(runtime_dir),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def end(self) -> None:
        """Kill it if it still runs, and close its pipes: a test's teardown."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """Read stdout until a line starting with ``prefix``; returns the rest of it."""
        import selectors

        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        # What it printed instead (an ERR line, say) is usually the real failure.
        skipped: collections.deque[str] = collections.deque(maxlen=20)

        def seen() -> str:
            return "".join(f"  {x}" for x in skipped) or "  (nothing)\n"

        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise AssertionError(
                        f"client did not print {prefix!r} within {timeout}s; stdout it printed instead (last {skipped.maxlen}):\n"
                        f"{seen()}stderr:\n{self.stderr()}"
                    )
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError(
                        f"client exited ({self.proc.wait()}) before {prefix!r}; stdout it printed instead (last {skipped.maxlen}):\n"
                        f"{seen()}stderr:\n{self.stderr()}"
                    )
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
                skipped.append(line if line.endswith("\n") else line + "\n")
        finally:
            sel.close()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def finish(self, timeout: float = 60.0) -> int:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"client hung; stderr:\n{err}") from None
        if self.proc.returncode != 0:
            raise AssertionError(f"client failed ({self.proc.returncode}):\nstdout:\n{out}\nstderr:\n{err}")
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def run_client(runtime_dir: Path) -> Iterator[object]:
    clients: list[Client] = []

    def start(scenario: str, *args: str, env: dict[str, str] | None = None) -> Client:
        c = Client(runtime_dir, scenario, [str(a) for a in args], env)
        clients.append(c)
        return c

    yield start
    for c in clients:
        c.end()
