"""Shared plumbing for the benchmarks in bench/: a private gpumemd in a temp runtime
directory, helper processes that cannot outlive the benchmark, percentile math and
the final JSON line.

Every benchmark prints human-readable lines and then, as its last line, exactly one
JSON object: {"bench", "backend", "device", "figures", "targets", "ok"} (plus "error"
when it could not measure). Timings are never asserted; ``ok`` only says whether the
figures meet their targets. "device" names what it ran on: the GPU's name and memory on
CUDA, "host" on the host backend.

Sizes default to what the device has (``fit``): a benchmark written for a 141 GB H200
still runs on an 80 GB H100, at the size that fits there; explicit size flags win.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent

# Each top-level folder holds one package under its import name (client/gpumem, ...).
_PACKAGES = {"gpumem": "client", "gpumemd": "daemon", "gpumem_shared": "shared"}


def ensure_importable() -> None:
    """Make gpumem, gpumemd and gpumem_shared importable, here and in children.

    Normally the package is installed (``pip install -e .``, or built on a GPU machine
    with ``pip install --target``). Where it is not, link the checkout's folders under
    their package names in a temp dir and put that first on sys.path and PYTHONPATH, so
    ``python -m gpumemd`` runs this checkout too (the native allocator, which torch
    benchmarks need, exists only in an installed copy)."""
    if all(importlib.util.find_spec(name) is not None for name in _PACKAGES):
        return
    _sweep_orphans("gmb-src-*")
    shim = Path(tempfile.mkdtemp(prefix="gmb-src-", dir="/tmp"))
    atexit.register(shutil.rmtree, shim, ignore_errors=True)
    (shim / _OWNER_FILE).write_text(f"{os.getpid()}\n")
    for name, folder in _PACKAGES.items():
        (shim / name).symlink_to(REPO / folder / name, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH", "")]))
    print(f"note: gpumem is not installed from this checkout; importing it from {REPO} through {shim}", flush=True)


def say(line: str = "") -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------

# Runs in the child before it becomes the real program: ask the kernel to SIGTERM it
# when the benchmark dies (even by SIGKILL), pin it to CPUs if asked (before any
# thread exists, so its threads inherit the set), then exec. PR_SET_PDEATHSIG survives
# execve of a normal binary. argv: <parent pid> <cpu list or "-"> <python args...>
_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "if sys.argv[2] != '-':\n"
    "    os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(',')])\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[3:])\n"
)


def parse_cpus(text: str | None) -> tuple[set[int], set[int]] | None:
    """``--cpus A:B``: the benchmark (client) on CPU list A, its servers on B; lists
    are comma-separated, e.g. "0:1" or "2,3:4,5". None when not pinning."""
    if not text:
        return None
    try:
        left, right = text.split(":")
        sets = tuple({int(x) for x in part.split(",") if x.strip()} for part in (left, right))
    except ValueError:
        raise ValueError(f"--cpus {text!r}: expected CLIENT:SERVER CPU lists such as 0:1 or 2,3:4,5") from None
    allowed = os.sched_getaffinity(0)
    for cpus in sets:
        if not cpus or not cpus <= allowed:
            raise ValueError(f"--cpus {text!r}: each side needs CPUs among those allowed here, {sorted(allowed)}")
    return sets[0], sets[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(name, None)  # the private daemon must not talk to our systemd
    env.update(extra)
    return env


class Child:
    """A Python helper process, its output in a log file, stopped by SIGTERM."""

    # CPUs every helper is pinned to (set_server_cpus), or None to let the scheduler choose.
    server_cpus: set[int] | None = None

    def __init__(self, name: str, python_args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._log_shown = False
        cpus = ",".join(map(str, sorted(self.server_cpus))) if self.server_cpus else "-"
        cmd = [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), cpus, *python_args]
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env or child_env(), close_fds=True
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """The child's output so far (shown at most once: later calls say so instead)."""
        if self._log_shown:
            return f"(see its log above, {self.log_path})"
        self._log_shown = True
        try:
            if not self._log.closed:
                self._log.flush()
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` until it holds; fail with the child's log if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            if ready():
                return
            code = self.proc.poll()
            if code is not None:
                if ready():  # what it waited for came with its exit, between the two looks
                    return
                raise RuntimeError(f"{self.name} exited with status {code} before {what}; its log:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not get to {what} within {timeout:g}s; its log:\n{self.log()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait (bounded), then SIGKILL. Returns the exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    say(f"warning: {self.name} (pid {self.pid}) ignored SIGTERM for {timeout:g}s; killing it")
                    self.proc.kill()
                    self.proc.wait(5)
            return self.proc.returncode
        finally:
            self._log.close()


def exit_on_error(body: Callable[[], Any]) -> Any:
    """``body()``'s result; if it raises, its traceback and the process's end (status 1).
    For an engine process: transformers' generation thread is no daemon thread, and
    would keep a process whose main thread failed alive until its parent's timeout."""
    try:
        return body()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def pin(cpus: tuple[set[int], set[int]] | None) -> None:
    """Pin this process to the client CPUs and every helper started from now on to the
    server CPUs. Call before any thread starts (zmq contexts, CUDA) so all inherit it."""
    if cpus is None:
        return
    os.sched_setaffinity(0, cpus[0])
    Child.server_cpus = cpus[1]
    say(f"pinned: benchmark on CPUs {sorted(cpus[0])}, daemon and helpers on CPUs {sorted(cpus[1])}")


def spawn_clients(
    script: str, names: Sequence[str], args: Sequence[str], env: dict[str, str], cleanup: contextlib.ExitStack
) -> list[subprocess.Popen[str]]:
    """``python SCRIPT --client NAME ARGS...`` per name, talking line by line on stdio;
    killed with the benchmark's cleanup."""
    procs = []
    for name in names:
        proc = subprocess.Popen(
            [sys.executable, script, "--client", name, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        cleanup.callback(proc.kill)
        procs.append(proc)
    return procs


class Daemon(Child):
    """``python -m gpumemd`` for one device in a runtime directory of its own."""

    def __init__(self, runtime_dir: Path, backend: str, device: int = 0, args: Sequence[str] = ()) -> None:
        self.runtime_dir = runtime_dir
        self.backend = backend
        self.device = device
        self.info_path = runtime_dir / f"gpu{device}.json"
        argv = ["-m", "gpumemd", "--device", str(device), "--backend", backend, "--runtime-dir", str(runtime_dir), *args]
        say(f"starting: {sys.executable} {' '.join(argv)}")
        super().__init__(f"gpumemd (device {device}, {backend})", argv, runtime_dir / f"gpumemd{device}.log")

    def wait_ready(self, timeout: float) -> Daemon:
        started = time.monotonic()
        self.wait_for(self.info_path.exists, timeout, f"announcing itself in {self.info_path}")
        say(f"gpumemd pid {self.pid} ready in {time.monotonic() - started:.2f}s")
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        code = super().stop(timeout)
        if code not in (0, None):
            say(f"warning: gpumemd exited with status {code}; its log:\n{self.log()}")
        return code


_OWNER_FILE = "bench-owner.pid"


def _sweep_orphans(pattern: str) -> None:
    """Remove runtime dirs of earlier benchmark runs that were SIGKILLed (their helper
    processes died with them through PDEATHSIG; only the directory stays behind)."""
    for path in Path("/tmp").glob(pattern):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / _OWNER_FILE).read_text().strip())
            os.kill(pid, 0)
        except ProcessLookupError:
            say(f"removing {path}, left by benchmark run pid {pid}, which is gone")
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours, still being created, or its owner lives


@contextlib.contextmanager
def runtime_dir(prefix: str = "gmb-") -> Iterator[Path]:
    """A fresh private directory with a short path (AF_UNIX paths are limited to 108 bytes)."""
    _sweep_orphans(f"{prefix}*")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        (path / _OWNER_FILE).write_text(f"{os.getpid()}\n")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------
# The device, and sizes that fit it
# ---------------------------------------------------------------------------

_MiB, _GiB = 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    """What a benchmark runs on, read once at its start: on CUDA the GPU; on the host
    backend this machine's memory (the backend's memfds are RAM)."""

    name: str
    total_bytes: int
    free_bytes: int


def _cuda_device(ordinal: int) -> Device:
    """Through the driver API, with no torch: cuMemGetInfo needs a context, so the
    primary one is retained around it and released (gone again unless this process
    already held it; a daemon or torch started later makes its own)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise RuntimeError(f"cuda-bindings is not installed ({exc.name} missing)") from None

    def ck(result: Any, what: str) -> Any:
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {result[0]!r}")
        return result[1:]

    try:
        ck(cu.cuInit(0), "cuInit")
    except RuntimeError as exc:  # also cuda.pathfinder's: no libcuda at all
        raise RuntimeError(f"no usable NVIDIA driver ({_summary(str(exc))})") from None
    (dev,) = ck(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    (raw,) = ck(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    (total,) = ck(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
    (ctx,) = ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        ck(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            free, _total = ck(cu.cuMemGetInfo(), "cuMemGetInfo")
        finally:
            ck(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
    finally:
        ck(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
    return Device(raw.split(b"\0", 1)[0].decode(), int(total), int(free))


def _host_memory() -> Device:
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[2:] == ["kB"]}
    return Device("host", fields["MemTotal"], fields["MemAvailable"])


@functools.cache
def device(backend: str, ordinal: int = 0) -> Device:
    """The device ``backend`` serves, as it was when first asked (``run`` asks before the
    body starts, so sizes fit the memory the benchmark found, not what it took since)."""
    return _cuda_device(ordinal) if backend == "cuda" else _host_memory()


def _described(backend: str, ordinal: int) -> Any:
    """The final JSON's "device": "host", the GPU's name and memory, or why unknown."""
    if backend != "cuda":
        return "host"
    try:
        gpu = device(backend, ordinal)
    except Exception as exc:  # the body's own failure says more; the line still says this
        return f"cuda device {ordinal}: unknown ({type(exc).__name__}: {_summary(str(exc))})"
    return {"name": gpu.name, "ordinal": ordinal, "total_bytes": gpu.total_bytes, "free_bytes_at_start": gpu.free_bytes}


def fit(nominal: int, backend: str, fraction: float, what: str, ordinal: int = 0) -> int:
    """A default size that fits the device: ``nominal`` bytes, or ``fraction`` of its free
    memory at the start (whole 2 MiB) where that is less, which is said. Where the device
    cannot be read, ``nominal``: the body's first use of the device fails and says why."""
    try:
        found = device(backend, ordinal)
    except Exception:
        return nominal
    room = int(fraction * found.free_bytes) // (2 * _MiB) * (2 * _MiB)
    if room >= nominal:
        return nominal
    say(f"{what}: {room / _GiB:.1f} GiB, {fraction:g} of the {found.free_bytes / _GiB:.1f} GiB free on {found.name} "
        f"(the default {nominal / _GiB:g} GiB does not fit)")
    return room


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def rounded(value: Any, digits: int = 5) -> Any:
    """Floats to ``digits`` significant digits (None if not finite), for the JSON line."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


# ---------------------------------------------------------------------------
# Running a benchmark
# ---------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse that, on a usage error, still ends with the JSON line (ok: false)."""

    def __init__(self, bench: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bench = bench

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.stderr.flush()
        argv = sys.argv[1:]
        backend = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--backend"), None)
        backend = backend or next((a.split("=", 1)[1] for a in argv if a.startswith("--backend=")), None)
        backend = backend or str(self.get_default("backend"))
        print(Result(self.bench, backend).line(f"usage: {message}"), flush=True)
        sys.exit(2)


class Result:
    """What a benchmark body fills in; printed as the final JSON line."""

    def __init__(self, bench: str, backend: str, labels: dict[str, str] | None = None) -> None:
        self.bench = bench
        self.labels = labels or {}  # what the line is about beside the bench's name (bench/engine.py: "engine")
        self.backend = backend
        self.device: Any = "host" if backend == "host" else None  # run() names the GPU
        self.figures: dict[str, Any] = {}
        self.targets: dict[str, Any] = {}
        self.ok = False

    def line(self, error: str | None = None) -> str:
        out: dict[str, Any] = {
            "bench": self.bench,
            **self.labels,
            "backend": self.backend,
            "device": self.device,
            "figures": rounded(self.figures),
            "targets": rounded(self.targets),
            "ok": bool(self.ok and error is None),
        }
        if error is not None:
            out["error"] = error
        return json.dumps(out, sort_keys=False)


def _summary(message: str) -> str:
    """One line for the JSON: the message's first line, and its last (a child's log ends
    with the reason it died) when there are more."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


class _Terminated(BaseException):
    pass


def _on_signal(signum: int, _frame: Any) -> None:
    # Once: the cleanup that follows (bounded waits only) must not be cut short.
    for other in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(other, signal.SIG_IGN)
    raise _Terminated(signal.Signals(signum).name)


def run(
    bench: str, backend: str, body: Callable[[Result, contextlib.ExitStack], None], ordinal: int = 0, labels: dict[str, str] | None = None
) -> int:
    """Run ``body(result, cleanup)``, undo everything pushed on ``cleanup`` (also on error
    or SIGTERM/SIGINT/SIGHUP), then print the JSON line last. Returns the exit status:
    0 when the benchmark measured (whatever ``ok`` says), 1 when it could not.
    ``ordinal``: the device the benchmark's daemon serves, named in the JSON line;
    ``labels``: keys that follow "bench" in it (what the line is about)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    result = Result(bench, backend, labels)
    result.device = _described(backend, ordinal)
    error: str | None = None
    try:
        with contextlib.ExitStack() as cleanup:
            body(result, cleanup)
    except _Terminated as exc:
        error = f"interrupted by {exc}"
    except Exception as exc:  # report, never a bare traceback as the last line
        traceback.print_exc(file=sys.stdout)
        error = f"{type(exc).__name__}: {_summary(str(exc))}"
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
    if error is not None:
        say(f"FAILED: {error}")
    sys.stdout.flush()
    print(result.line(error), flush=True)
    return 0 if error is None else 1
