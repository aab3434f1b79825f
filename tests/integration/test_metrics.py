"""``gpumemd --metrics-port``: a real daemon scraped over HTTP while two clients hold
memory and a lease, its figures checked against ``gpumemctl status --json``; and the
configuration errors (no prometheus-client, an address in use) as one line, exit 78."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env
from gpumemd_testkit import GiB, MiB, do

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

EXIT_CONFIG = 78

# Every family the daemon exposes, with its Prometheus type (docs/running.md lists them).
FAMILIES = {
    "gpumemd_info": "gauge",
    "gpumemd_tenant_cap_bytes": "gauge",
    "gpumemd_tenant_min_bytes": "gauge",
    "gpumemd_tenant_used_bytes": "gauge",
    "gpumemd_daemon_generation": "gauge",
    "gpumemd_start_time_seconds": "gauge",
    "gpumemd_device_total_bytes": "gauge",
    "gpumemd_device_free_bytes": "gauge",
    "gpumemd_device_held_bytes": "gauge",
    "gpumemd_device_reserve_bytes": "gauge",
    "gpumemd_device_retiring_bytes": "gauge",
    "gpumemd_sessions": "gauge",
    "gpumemd_sessions_opened": "counter",
    "gpumemd_sessions_reclaimed": "counter",
    "gpumemd_reclaimed_bytes": "counter",
    "gpumemd_reclaim_seconds": "histogram",
    "gpumemd_client_committed_bytes": "gauge",
    "gpumemd_arena_committed_bytes": "gauge",
    "gpumemd_arena_reserved_bytes": "gauge",
    "gpumemd_arena_placeholder_bytes": "gauge",
    "gpumemd_arena_retiring_bytes": "gauge",
    "gpumemd_requests": "counter",
    "gpumemd_commits": "counter",
    "gpumemd_commits_refused": "counter",
    "gpumemd_decommits": "counter",
    "gpumemd_kv_rounds": "counter",
    "gpumemd_kv_rounds_active": "gauge",
    "gpumemd_kv_round_duration_seconds": "histogram",
    "gpumemd_kv_round_budget_bytes": "gauge",
    "gpumemd_kv_round_committed_bytes": "gauge",
    "gpumemd_kv_moves": "counter",
    "gpumemd_kv_moved_bytes": "counter",
    "gpumemd_kv_move_seconds": "histogram",
    "gpumemd_kv_pool_tokens": "gauge",
    "gpumemd_arenas_asleep": "gauge",
    "gpumemd_sleep_host_bytes": "gauge",
    "gpumemd_graph_pool_free_bytes": "gauge",
    "gpumemd_lease_held": "gauge",
    "gpumemd_lease_releases": "counter",
    "gpumemd_lease_waiters": "gauge",
    "gpumemd_lease_conflicts": "counter",
    "gpumemd_lease_wait_seconds": "histogram",
    "gpumemd_lease_escapes": "counter",
    "gpumemd_lease_escaped_clients": "gauge",
    "gpumemd_lease_ordering": "gauge",
    "gpumemd_lease_ordering_lanes": "gauge",
    "gpumemd_lease_ordering_lanes_in_use": "gauge",
}


def metrics_url(daemon: Any, timeout: float = 10.0) -> str:
    """The URL the daemon logs once its endpoint serves (port 0: it picked one)."""
    deadline = time.monotonic() + timeout
    while (match := re.search(r"serving metrics at (http://\S+)", daemon.log())) is None:
        assert time.monotonic() < deadline, f"no metrics URL in the daemon's log:\n{daemon.log()}"
        time.sleep(0.05)
    return match.group(1)


def scrape(url: str) -> dict[str, Any]:
    """The families of one scrape, by name; each sample as (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8", response.headers["Content-Type"]
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, name: str | None = None, **labels: str) -> float:
    found = [s.value for s in families[family].samples if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name or family}{labels}: {len(found)} samples in {families[family].samples}"
    return float(found[0])


def ctl_status(runtime_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "status", "--json"], capture_output=True, text=True, timeout=30, env=child_env(runtime_dir)
    )
    assert out.returncode == 0, out
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def settled(url: str, runtime_dir: Path, ready: Any, timeout: float = 10.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A scrape and a status that agree on ``ready``: the snapshot trails the state by a tick."""
    deadline = time.monotonic() + timeout
    while True:
        status = ctl_status(runtime_dir)
        families = scrape(url)
        if ready(families, status):
            return families, status
        assert time.monotonic() < deadline, f"the scrape never caught up with the status: {status}"
        time.sleep(0.1)


def test_a_scrape_says_what_status_says(daemon_factory, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--metrics-port", "0"])
    url = metrics_url(daemon)
    a, b = run_client("shell", "engine-a"), run_client("shell", "engine-b")
    a.expect("CONNECTED")
    b.expect("CONNECTED")
    do(a, f"create kv {8 * GiB}")
    do(a, f"commit kv {64 * MiB}")
    do(a, "share kv engine-b")
    do(b, "attach kv")
    do(b, f"create scratch {8 * GiB}")
    do(b, f"commit scratch {6 * MiB}")
    assert json.loads(do(b, f"errinfo commit scratch {16 * GiB}"))["error"] == "InvalidArgument"  # past its reservation
    assert json.loads(do(b, f"errinfo commit scratch {6 * GiB}"))["error"] == "OutOfMemory"  # the host backend has 4 GiB
    pool = json.loads(do(a, f"gpregister kv decode 0 {4 * MiB}"))
    for _ in range(3):
        do(a, f"lease replay {pool['id']} 0 step")
        do(a, f"unlease {pool['id']}")
    do(a, f"lease capture {pool['id']} 0 recapture")  # held while scraped

    def ready(families: dict[str, Any], status: dict[str, Any]) -> bool:
        return sample(families, "gpumemd_sessions") == len(status["clients"]) == 2 and bool(status["leases"]) and any(
            s.value == 1 for s in families["gpumemd_lease_held"].samples
        )

    families, status = settled(url, runtime_dir, ready)
    assert {name: f.type for name, f in families.items() if name.startswith("gpumemd_")} == FAMILIES
    assert "process_open_fds" in families, "the daemon's process figures come with every scrape"

    device = status["device"]
    assert sample(families, "gpumemd_device_total_bytes", gpu="0", UUID=status["device"]["uuid"]) == device["total_bytes"]
    assert sample(families, "gpumemd_device_free_bytes") == device["free_bytes"]
    assert sample(families, "gpumemd_device_held_bytes") == device["accounted_bytes"] == 70 * MiB
    assert sample(families, "gpumemd_device_reserve_bytes") == device["reserve_bytes"]
    assert sample(families, "gpumemd_daemon_generation") == status["daemon"]["generation"] == 0  # one number for both
    assert sample(families, "gpumemd_info", version=status["daemon"]["version"], backend="host", UUID=device["uuid"]) == 1

    for arena in status["arenas"]:
        labels = {"arena": arena["name"], "client": arena["owner"]}
        assert sample(families, "gpumemd_arena_committed_bytes", **labels) == arena["committed"]
        assert sample(families, "gpumemd_arena_reserved_bytes", **labels) == arena["reserved"]
    for client in status["clients"]:
        owned = sum(x["committed"] for x in status["arenas"] if x["owner"] == client["name"])
        assert sample(families, "gpumemd_client_committed_bytes", client=client["name"]) == owned
    assert sample(families, "gpumemd_client_committed_bytes", client="engine-a") == 64 * MiB

    assert sample(families, "gpumemd_commits", "gpumemd_commits_total") == 2
    assert sample(families, "gpumemd_commits_refused", "gpumemd_commits_refused_total", reason="invalid_argument") == 1
    assert sample(families, "gpumemd_commits_refused", "gpumemd_commits_refused_total", reason="out_of_memory") == 1
    assert sample(families, "gpumemd_sessions_opened", "gpumemd_sessions_opened_total") == 2

    (graph_pool,) = status["graph_pools"]
    (lease,) = status["leases"]
    labels = {"pool_id": str(graph_pool["id"]), "pool": "decode", "arena": "kv", "client": "engine-a"}
    assert lease["holder"] == "engine-a" and lease["kind"] == "capture"
    assert sample(families, "gpumemd_lease_held", kind="capture", **labels) == 1
    assert sample(families, "gpumemd_lease_held", kind="replay", **labels) == 0
    assert sample(families, "gpumemd_lease_releases", "gpumemd_lease_releases_total", **labels) == 3
    assert sample(families, "gpumemd_graph_pool_free_bytes", **labels) == graph_pool["free_bytes"]

    # engine-b dies attached to two arenas: one is its own (its 6 MiB come back), the
    # other engine-a's (which stays).
    b.kill()

    def reclaimed(families: dict[str, Any], status: dict[str, Any]) -> bool:
        return len(status["clients"]) == 1 and sample(families, "gpumemd_sessions_reclaimed", "gpumemd_sessions_reclaimed_total") == 1

    families, status = settled(url, runtime_dir, reclaimed)
    assert sample(families, "gpumemd_reclaimed_bytes", "gpumemd_reclaimed_bytes_total") == 6 * MiB
    assert sample(families, "gpumemd_reclaim_seconds", "gpumemd_reclaim_seconds_count") == 1
    assert sample(families, "gpumemd_device_held_bytes") == status["device"]["accounted_bytes"] == 64 * MiB


def test_memops_ordering_and_its_lanes_in_use_in_a_scrape_and_in_gpumemctl_status(daemon_factory, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--metrics-port", "0", "--lease-ordering", "memops"])
    url = metrics_url(daemon)
    a = run_client("shell", "engine-a")
    a.expect("CONNECTED")
    do(a, f"create graphs {GiB}")
    do(a, f"commit graphs {16 * MiB}")
    do(a, f"gpregister graphs decode 0 {4 * MiB} shared")
    do(a, f"gpregister graphs prefill {4 * MiB} {4 * MiB} shared")

    def ready(families: dict[str, Any], status: dict[str, Any]) -> bool:
        return bool(families["gpumemd_lease_ordering_lanes_in_use"].samples) and sample(families, "gpumemd_lease_ordering_lanes_in_use") == 2

    families, status = settled(url, runtime_dir, ready)
    d = status["daemon"]
    assert (d["lease_ordering"], d["lease_lanes_in_use"]) == ("memops", 2) and d["lease_lanes"] > 2
    assert sample(families, "gpumemd_lease_ordering_lanes") == d["lease_lanes"]
    assert sample(families, "gpumemd_lease_ordering", mode="memops") == 1
    assert sample(families, "gpumemd_lease_ordering", mode="ipc-events") == 0
    text = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "status"], capture_output=True, text=True, timeout=30, env=child_env(runtime_dir)
    ).stdout
    assert f"  lease ordering memops: 2 of {d['lease_lanes']} lanes in use" in text.splitlines(), text
    a.send("exit")
    a.finish()


def test_hidden_names_leave_no_tenant_name_in_a_scrape(daemon_factory, run_client) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--metrics-port", "0", "--metrics-hide-names"])
    url = metrics_url(daemon)
    a = run_client("shell", "engine-alpha")
    a.expect("CONNECTED")
    do(a, f"create alpha-weights {GiB}")
    do(a, f"commit alpha-weights {64 * MiB}")
    do(a, f"gpregister alpha-weights alpha-decode 0 {4 * MiB}")
    deadline = time.monotonic() + 10
    while not (families := scrape(url))["gpumemd_graph_pool_free_bytes"].samples:
        assert time.monotonic() < deadline, "the scrape never showed the graph pool"
        time.sleep(0.1)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert "gpumemd_arena_committed_bytes" in text and not re.search("engine|alpha", text), text
    (owner,) = [s.labels["client"] for s in families["gpumemd_client_committed_bytes"].samples]
    assert sample(families, "gpumemd_client_committed_bytes", client=owner) == 64 * MiB
    assert sample(families, "gpumemd_arena_committed_bytes", client=owner) == 64 * MiB


def _config_error(runtime_dir: Path, python_args: list[str], daemon_args: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *python_args, "--backend", "host", "--runtime-dir", str(runtime_dir), *daemon_args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(runtime_dir),
    )
    assert result.returncode == EXIT_CONFIG, result
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (runtime_dir / "gpu0.json").exists(), "the daemon took its device before refusing"
    return result


def test_asking_for_metrics_without_prometheus_client_is_a_configuration_error(runtime_dir: Path) -> None:
    # The import fails as it does where the extra is not installed.
    without = "import sys; sys.modules['prometheus_client'] = None; from gpumemd.cli import main; sys.argv[0] = 'gpumemd'; main()"
    result = _config_error(runtime_dir, ["-c", without], ["--metrics-port", "0"])
    assert "pip install 'gpumemd[metrics]'" in result.stderr, result.stderr
    # Without --metrics-port, the same daemon starts.
    proc = subprocess.Popen([sys.executable, "-c", without, "--backend", "host", "--runtime-dir", str(runtime_dir)], env=child_env(runtime_dir))
    try:
        deadline = time.monotonic() + 20
        while not (runtime_dir / "gpu0.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "gpumemd without metrics did not start"
            time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_metrics_address_without_a_port_is_a_configuration_error(runtime_dir: Path) -> None:
    result = _config_error(runtime_dir, ["-m", "gpumemd"], ["--metrics-address", "0.0.0.0"])
    assert "--metrics-address 0.0.0.0 serves nothing without --metrics-port" in result.stderr, result.stderr


def test_hiding_names_without_a_port_is_a_configuration_error(runtime_dir: Path) -> None:
    result = _config_error(runtime_dir, ["-m", "gpumemd"], ["--metrics-hide-names"])
    assert "--metrics-hide-names hides nothing without --metrics-port" in result.stderr, result.stderr


def test_a_metrics_port_in_use_is_a_configuration_error(runtime_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _config_error(runtime_dir, ["-m", "gpumemd"], ["--metrics-port", str(port)])
    assert f"cannot serve metrics on 127.0.0.1 port {port}" in result.stderr, result.stderr


def _connect(url: str) -> socket.socket:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_the_daemon(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_idle_trickling_and_piled_up_connections_hold_up_no_scrape(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Anyone who reaches the port may connect: connections that say nothing, or trickle
    their request a byte at a time, or pile up past the limit delay no scrape, and each
    is closed by its deadline."""
    from gpumemd.exporter import MAX_CONNECTIONS, SCRAPE_TIMEOUT

    daemon = daemon_factory("host", args=["--metrics-port", "0"])
    url = metrics_url(daemon)
    idle = [_connect(url) for _ in range(5)]
    trickler = _connect(url)
    opened = time.monotonic()
    try:
        for byte in b"GET":
            trickler.send(bytes([byte]))
            started = time.monotonic()
            with urllib.request.urlopen(url, timeout=5) as response:  # a blocked scrape is past this
                assert response.status == 200 and b"gpumemd_sessions" in response.read()
            assert time.monotonic() - started < 5
        assert _closed_by_the_daemon(trickler, SCRAPE_TIMEOUT + 10 - (time.monotonic() - opened)), "a trickling connection outlived its deadline"
        assert time.monotonic() - opened >= SCRAPE_TIMEOUT - 1, "closed before its deadline"
        assert all(_closed_by_the_daemon(sock, 1) for sock in idle), "an idle connection outlived its deadline"
        # Past the limit the oldest go: a flood of connections does not keep a scrape out.
        flood = [_connect(url) for _ in range(MAX_CONNECTIONS + 8)]
        try:
            scrape(url)
            assert _closed_by_the_daemon(flood[0], 5), "the oldest connection stayed open past the limit"
        finally:
            for sock in flood:
                sock.close()
    finally:
        trickler.close()
        for sock in idle:
            sock.close()
