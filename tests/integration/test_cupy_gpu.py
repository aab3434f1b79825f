"""CuPy on a daemon arena, on the CUDA backend: a CuPy process takes its memory from
gpumemd through gpumem.integrations.cupy, the daemon's status shows it, a torch process
reads and writes the same bytes through the shared arena (DLPack), and kill -9 of the
CuPy process gives everything back."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env
from gpumemd_testkit import read_line, status, wait_status

WORKER = Path(__file__).resolve().parents[1] / "cupy_worker.py"

READER = """
import sys, torch, gpumem
offset, nbytes = int(sys.argv[1]), int(sys.argv[2])
with gpumem.connect(0, name="torch-reader") as s:
    arena = s.attach_arena("cupy")
    t = torch.from_dlpack(arena.view(offset, nbytes)).view(torch.float32)
    assert torch.equal(t, torch.arange(nbytes // 4, dtype=torch.float32, device="cuda")), "torch saw other bytes"
    t.mul_(2)
    torch.cuda.synchronize()
    del t
    print("READER OK")
"""


@pytest.mark.gpu
@pytest.mark.timeout(420)  # CuPy compiles its kernels (arange, ones, ==) at first use: NVRTC, tens of seconds cold
def test_cupy_takes_memory_from_the_daemon_shares_it_with_torch_and_gives_it_back_when_killed(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    for module in ("cupy", "torch"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    daemon = daemon_factory("cuda")
    before = status(runtime_dir)["device"]["accounted_bytes"]
    env = child_env(runtime_dir)
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        offset, nbytes = (int(v) for v in read_line(worker, "READY ", timeout=180).split())
        s = status(runtime_dir)
        (arena,) = [a for a in s["arenas"] if a["name"] == "cupy"]
        assert arena["owner"] == "cupy-worker" and arena["owner_pid"] == worker.pid, arena
        assert arena["committed"] >= nbytes and s["device"]["accounted_bytes"] >= before + nbytes, s["device"]

        reader = subprocess.run(
            [sys.executable, "-c", READER, str(offset), str(nbytes)], capture_output=True, text=True, timeout=180, env=env
        )
        assert reader.returncode == 0 and "READER OK" in reader.stdout, f"{reader.stdout}\n{reader.stderr}\n{daemon.log()}"
        assert worker.stdin is not None
        worker.stdin.write("CHECK\n")
        worker.stdin.flush()
        read_line(worker, "DOUBLED", timeout=60)

        worker.kill()  # SIGKILL: no goodbye; the daemon reclaims a dead client's arena
        worker.wait(timeout=30)
        wait_status(
            runtime_dir,
            lambda s: not any(a["name"] == "cupy" for a in s["arenas"]) and s["device"]["accounted_bytes"] == before,
            timeout=60,
            what="the killed CuPy process's arena returned",
        )
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        for stream in (worker.stdin, worker.stdout, worker.stderr):
            if stream is not None:
                stream.close()
