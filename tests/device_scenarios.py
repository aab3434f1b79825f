"""One daemon per GPU, scenario by scenario, each in its own process (CUDA only).

    python tests/device_scenarios.py SCENARIO [ARGS...]

The daemons are found through $GPUMEMD_RUNTIME_DIR; which GPUs a scenario sees is up to
the test's CUDA_VISIBLE_DEVICES. A scenario prints "PASS <name>" and exits 0, or fails
with a traceback. Used by tests/integration/test_two_devices.py.
"""

from __future__ import annotations

import sys

import torch

import gpumem
from gpumem_shared.driver.cuda import visible_device_uuids

MiB = 1 << 20
GiB = 1 << 30


def peers_on_one_gpu() -> None:
    count = len(visible_device_uuids())
    with gpumem.connect(0, name="own-device", peers=[0]) as s:  # its own device: nothing to add
        assert s.driver.peers == [], s.driver.peers
        arena = s.create_arena("a", GiB)
        arena.commit(64 * MiB)
        t = arena.tensor(0, (1024,), torch.int32)
        t.copy_(torch.arange(1024, dtype=torch.int32, device="cuda"))
        assert int(t.sum()) == 1023 * 1024 // 2
    try:
        gpumem.connect(0, name="no-such-peer", peers=[count])
    except gpumem.InvalidArgument as exc:
        assert f"peer access from CUDA device {count}" in str(exc) and f"sees {count} device(s)" in str(exc), exc
    else:
        raise AssertionError(f"peer access from a device this process does not have ({count}) was accepted")
    print("PASS peers_on_one_gpu")


def remapped_client(expected_index: str) -> None:
    """Run under CUDA_VISIBLE_DEVICES=<one GPU>: its device 0 is the machine's GPU N, and
    connect(0) must reach gpumemd@N (matched by UUID), then map with ordinal 0."""
    with gpumem.connect(0, name="remapped") as s:
        assert s.device.index == int(expected_index), (s.device.index, expected_index)
        assert s.device_ordinal == 0 and s.device.uuid == visible_device_uuids()[0]
        arena = s.create_arena("remapped", GiB)
        arena.commit(64 * MiB)
        t = arena.tensor(0, (1 << 20,), torch.float32)
        assert t.device == torch.device("cuda", 0)
        t.fill_(2.0)
        assert float(t.sum()) == 2.0 * (1 << 20)
    print("PASS remapped_client")


def owner_on_gpu1() -> None:
    """Sees both GPUs: writes a pattern on GPU 1 through gpumemd@1 and shares it, then
    waits for the reader to finish."""
    with gpumem.connect(1, name="rank1") as s:
        assert s.device.index == 1 and s.device_ordinal == 1
        arena = s.create_arena("tp-shard", GiB)
        arena.commit(64 * MiB)
        t = arena.tensor(0, (1 << 20,), torch.int32)
        t.copy_(torch.arange(1 << 20, dtype=torch.int32, device="cuda:1") * 3)
        torch.cuda.synchronize(1)
        arena.share("rank0")
        print("READY", flush=True)
        assert sys.stdin.readline().strip() == "done"
    print("PASS owner_on_gpu1")


def reader_on_gpu0() -> None:
    """A rank on GPU 0 maps GPU 1's chunk with an access descriptor for device 0 and
    reads it with a kernel running on GPU 0."""
    with gpumem.connect(1, name="rank0", peers=[0]) as s:
        assert s.driver.peers == [0]
        arena = s.attach_arena("tp-shard")
        raw = gpumem.RawView(arena.address, 4 << 20, "cuda", 0)  # the same bytes, as a device-0 tensor
        t = torch.from_dlpack(raw).view(torch.int32)
        assert t.device == torch.device("cuda", 0)
        want = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0") * 3
        assert torch.equal(t, want), "GPU 0 read other bytes than GPU 1 wrote"
        arena.release()
    print("PASS reader_on_gpu0")


SCENARIOS = {f.__name__: f for f in (peers_on_one_gpu, remapped_client, owner_on_gpu1, reader_on_gpu0)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
