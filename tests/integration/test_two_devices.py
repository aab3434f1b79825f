"""One daemon per device, side by side in one runtime directory: discovery by index and by
UUID, separate state, gpumemctl per device and for all of them, and peer access.

The host-backend daemons 0 and 1 stand in for two GPUs in CI. The CUDA scenarios of
tests/device_scenarios.py run the same discovery on real GPUs: the one-GPU checks of
peer access under -m gpu, the two-GPU ones (a client under a remapped
CUDA_VISIBLE_DEVICES, bytes written on GPU 1 read by a kernel on GPU 0) where two GPUs
are visible."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumem_shared.paths import Endpoints, read_info
from gpumemd_testkit import status

GiB = 1 << 30
MiB = 1 << 20
SCRIPT = Path(__file__).resolve().parents[1] / "device_scenarios.py"


def ctl(runtime_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )


@pytest.fixture
def two_host_daemons(daemon_factory: Any, runtime_dir: Path) -> tuple[Any, Any, dict[int, str]]:
    d0 = daemon_factory("host", device=0)
    d1 = daemon_factory("host", device=1, args=["--host-capacity", "2GiB"])
    uuids = {}
    for index in (0, 1):
        info = read_info(Endpoints(runtime_dir, index).info_path)
        assert info is not None
        uuids[index] = info["uuid"]
    assert uuids[0] != uuids[1]
    return d0, d1, uuids


def test_clients_find_each_daemon_by_index_and_by_uuid_and_state_stays_apart(two_host_daemons: Any, runtime_dir: Path) -> None:
    d0, d1, uuids = two_host_daemons
    for index, daemon in ((0, d0), (1, d1)):
        for device in (index, str(index), uuids[index], uuids[index][:13].lower()):
            with gpumem.connect(device, name=f"client-{index}", runtime_dir=runtime_dir) as s:
                assert s.device.index == index and s.device.uuid == uuids[index] and s.daemon_pid == daemon.pid
    with gpumem.connect(0, name="a", runtime_dir=runtime_dir) as a, gpumem.connect(uuids[1], name="b", runtime_dir=runtime_dir) as b:
        x = a.create_arena("kv", GiB)
        x.commit(64 * MiB)
        y = b.create_arena("kv", GiB)  # the same name on the other daemon: its own namespace
        y.commit(32 * MiB)
        assert x.address + x.reserved <= y.address, "each device plans in its own address slice: both map in one process"
        ctypes.memset(x.address, 0xA0, MiB)  # both mappings live side by side in this process, each its own bytes
        ctypes.memset(y.address, 0xB1, MiB)
        assert ctypes.string_at(x.address, MiB) == b"\xa0" * MiB and ctypes.string_at(y.address, MiB) == b"\xb1" * MiB
        s0, s1 = status(runtime_dir, 0), status(runtime_dir, 1)
        assert [(r["name"], r["owner"], r["committed"]) for r in s0["arenas"]] == [("kv", "a", 64 * MiB)]
        assert [(r["name"], r["owner"], r["committed"]) for r in s1["arenas"]] == [("kv", "b", 32 * MiB)]
        assert [c["name"] for c in s0["clients"]] == ["a"] and [c["name"] for c in s1["clients"]] == ["b"]
        assert s0["device"]["total_bytes"] == 4 * GiB and s1["device"]["total_bytes"] == 2 * GiB
    with pytest.raises(gpumem.DaemonUnavailable, match="several daemons match"):
        gpumem.connect("HOST-", runtime_dir=runtime_dir)
    with pytest.raises(gpumem.DaemonUnavailable, match="no daemon serves device 'GPU-0000'"):
        gpumem.connect("GPU-0000", runtime_dir=runtime_dir)


def test_gpumemctl_shows_one_device_or_all(two_host_daemons: Any, runtime_dir: Path) -> None:
    d0, d1, uuids = two_host_daemons
    with gpumem.connect(1, name="engine-on-1", runtime_dir=runtime_dir) as s:
        s.create_arena("weights", GiB).commit(16 * MiB)
        by_uuid = ctl(runtime_dir, "status", "--json", "--device", uuids[1][:12])
        assert by_uuid.returncode == 0, by_uuid
        assert json.loads(by_uuid.stdout)["daemon"]["pid"] == d1.pid
        every = ctl(runtime_dir, "status", "--all", "--json")
        assert every.returncode == 0, every
        listed = json.loads(every.stdout)
        assert [(x["device"]["index"], x["daemon"]["pid"]) for x in listed] == [(0, d0.pid), (1, d1.pid)]
        assert [c["name"] for c in listed[1]["clients"]] == ["engine-on-1"] and listed[0]["clients"] == []
        human = ctl(runtime_dir, "status", "--all")
        assert human.returncode == 0, human
        assert f"=== device 0 ({uuids[0]}) ===" in human.stdout and f"=== device 1 ({uuids[1]}) ===" in human.stdout
        assert human.stdout.index("engine-on-1") > human.stdout.index("=== device 1")
    both = ctl(runtime_dir, "status", "--all", "--device", "1")
    assert both.returncode == 1 and "leave out --device" in both.stderr, both
    ambiguous = ctl(runtime_dir, "status", "--device", "HOST-")
    assert ambiguous.returncode == 1 and "several daemons match" in ambiguous.stderr, ambiguous
    unknown = ctl(runtime_dir, "status", "--device", "GPU-ffff")
    assert unknown.returncode == 3 and "no daemon serves device 'GPU-ffff'" in unknown.stderr, unknown
    d1.stop()
    partial = ctl(runtime_dir, "status", "--all", "--json")  # a stopped daemon is left out, not an error
    assert partial.returncode == 0 and [x["device"]["index"] for x in json.loads(partial.stdout)] == [0], partial
    d0.stop()
    none = ctl(runtime_dir, "status", "--all")
    assert none.returncode == 3 and "no live gpumemd" in none.stderr, none


def test_a_device_index_without_an_address_slice_is_a_config_error(runtime_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpumemd", "--device", "16", "--backend", "host", "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert out.returncode == 78 and "serves devices 0-15" in out.stderr, out


def test_peer_devices_are_checked(two_host_daemons: Any, runtime_dir: Path) -> None:
    with gpumem.connect(1, name="rank0", runtime_dir=runtime_dir, peers=[0, 0]) as s:
        assert s.driver.peers == [0]  # host memory: every device reaches it
        s.create_arena("shard", GiB).commit(8 * MiB)
    with pytest.raises(gpumem.InvalidArgument, match="non-negative ordinals"):
        gpumem.connect(1, name="bad", runtime_dir=runtime_dir, peers=[-1])


def run_scenario(runtime_dir: Path, args: list[str], visible: str | None = None, timeout: float = 300) -> None:
    env = child_env(runtime_dir)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0 and f"PASS {args[0]}" in out.stdout, f"{args[0]} failed:\n{out.stdout}\n{out.stderr}"


@pytest.mark.gpu
def test_peer_access_on_one_gpu(daemon_factory: Any, runtime_dir: Path) -> None:
    daemon_factory("cuda", device=0)
    run_scenario(runtime_dir, ["peers_on_one_gpu"])


@pytest.mark.gpu
@pytest.mark.gpu2
def test_remapped_client_finds_the_daemon_of_its_gpu(daemon_factory: Any, runtime_dir: Path) -> None:
    daemon_factory("cuda", device=0)
    daemon_factory("cuda", device=1)
    run_scenario(runtime_dir, ["remapped_client", "1"], visible="1")
    run_scenario(runtime_dir, ["remapped_client", "0"], visible="0")


@pytest.mark.gpu
@pytest.mark.gpu2
def test_bytes_written_on_gpu1_are_read_by_a_kernel_on_gpu0(daemon_factory: Any, runtime_dir: Path) -> None:
    daemon_factory("cuda", device=0)
    daemon_factory("cuda", device=1)
    owner = subprocess.Popen(
        [sys.executable, str(SCRIPT), "owner_on_gpu1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=child_env(runtime_dir),
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        assert owner.stdout.readline().strip() == "READY"
        run_scenario(runtime_dir, ["reader_on_gpu0"])
        owner.stdin.write("done\n")
        owner.stdin.flush()
        out, _ = owner.communicate(timeout=60)
        assert owner.returncode == 0 and "PASS owner_on_gpu1" in out, out
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
