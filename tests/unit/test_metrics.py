"""The metrics snapshot, built on the daemon's thread from a DaemonState on the host
driver: what the counters count, when a new snapshot is published, and what the
daemon reads from the lease table (releases, waiters, conflicts, waits, escapes).
The rendering to the Prometheus format and the scrape are the integration tier's."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_order import LeaseOrdering
from gpumem_shared.lease_table import LeaseKind, LeaseSegment, LeaseStatus
from gpumemd.metrics import DEVICE_LABELS, HistogramValue, Metrics, Snapshot
from gpumemd.records import SessionRecord as Session

from .harness import BULK, CAPACITY, GiB, Harness, MiB
from .lease_kit import Waiter, wait_until_sleeping


def value(snapshot: Snapshot, name: str, **labels: str) -> float | HistogramValue:
    """The one sample of ``name`` whose labels include ``labels`` (device 0 implied)."""
    (family,) = [f for f in snapshot.families if f.name == name]
    wanted = {"gpu": "0", **labels}
    found = [v for values, v in family.samples if all(dict(zip(family.labels, values)).get(k) == x for k, x in wanted.items())]
    assert len(found) == 1, f"{name}{wanted}: {len(found)} samples in {family.samples}"
    return found[0]


def number(snapshot: Snapshot, name: str, **labels: str) -> float:
    v = value(snapshot, name, **labels)
    assert not isinstance(v, HistogramValue)
    return v


def histogram(snapshot: Snapshot, name: str, **labels: str) -> HistogramValue:
    v = value(snapshot, name, **labels)
    assert isinstance(v, HistogramValue)
    return v


def labelled(snapshot: Snapshot, name: str) -> dict[tuple[str, ...], float | HistogramValue]:
    (family,) = [f for f in snapshot.families if f.name == name]
    return {values[len(DEVICE_LABELS):]: v for values, v in family.samples}


def fresh(m: Metrics) -> Snapshot:
    m.refresh()
    return m.snapshot


def test_memory_requests_and_refusals_are_counted(h: Harness) -> None:
    m = Metrics(h.state)
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv", GiB)
    h.commit(a, "kv", 2 * BULK)
    h.create(b, "spare", GiB)
    h.commit(b, "spare", BULK)
    h.refused(a, p.CommitArena(name="kv", nbytes=CAPACITY + BULK), p.ErrorCode.OUT_OF_MEMORY)
    h.refused(b, p.CommitArena(name="kv", nbytes=4 * BULK), p.ErrorCode.PERMISSION_DENIED)
    h.refused(a, p.CommitArena(name="kv", nbytes=BULK + 1), p.ErrorCode.INVALID_ARGUMENT)
    h.decommit(a, "kv", BULK)
    s = fresh(m)
    assert number(s, "gpumemd_commits_total") == 2 and number(s, "gpumemd_decommits_total") == 1
    assert labelled(s, "gpumemd_commits_refused_total") == {("out_of_memory",): 1, ("permission_denied",): 1, ("invalid_argument",): 1}
    assert number(s, "gpumemd_requests_total", type="arena_commit", outcome="ok") == 2
    assert number(s, "gpumemd_requests_total", type="arena_create", outcome="ok") == 2
    assert labelled(s, "gpumemd_client_committed_bytes") == {("engine-a",): BULK, ("engine-b",): BULK}
    assert labelled(s, "gpumemd_arena_committed_bytes") == {("kv", "engine-a"): BULK, ("spare", "engine-b"): BULK}
    assert number(s, "gpumemd_arena_reserved_bytes", arena="kv") == GiB
    # engine-a still maps the chunk its decommit took out until it reports the unmap.
    assert number(s, "gpumemd_arena_retiring_bytes", arena="kv") == number(s, "gpumemd_device_retiring_bytes") == BULK
    status = h.state.status()
    assert number(s, "gpumemd_device_held_bytes") == status.device.accounted_bytes == 3 * BULK
    assert number(s, "gpumemd_device_free_bytes") == status.device.free_bytes == CAPACITY - 3 * BULK
    assert number(s, "gpumemd_device_total_bytes") == CAPACITY
    assert number(s, "gpumemd_sessions") == 2 and number(s, "gpumemd_sessions_opened_total") == 2


def test_a_client_that_dies_attached_is_a_reclaim_with_its_bytes(h: Harness) -> None:
    m = Metrics(h.state)
    dies, quits = h.connect("dies"), h.connect("quits")
    h.create(dies, "a", GiB)
    h.commit(dies, "a", 2 * BULK)
    h.create(quits, "b", GiB)
    h.commit(quits, "b", BULK)
    h.release(quits, "b")
    h.state.close_session(quits.id)  # released everything first: a clean close
    h.state.close_session(dies.id)
    s = fresh(m)
    assert number(s, "gpumemd_sessions_reclaimed_total") == 1
    assert number(s, "gpumemd_reclaimed_bytes_total") == 2 * BULK
    reclaim = histogram(s, "gpumemd_reclaim_seconds")
    assert sum(reclaim.counts) == 1 and reclaim.sum > 0
    assert number(s, "gpumemd_sessions") == 0 and number(s, "gpumemd_device_held_bytes") == 0


def test_a_new_snapshot_only_when_something_changed(h: Harness) -> None:
    m = Metrics(h.state)
    first = fresh(m)
    assert fresh(m) is first, "nothing happened: the exporter keeps serving the same snapshot"
    h.ok(None, p.Ping())
    second = fresh(m)
    assert second is not first and number(second, "gpumemd_requests_total", type="ping", outcome="ok") == 1
    h.connect("engine-a")
    third = fresh(m)
    assert third is not second and number(third, "gpumemd_sessions") == 1
    assert fresh(m) is third
    # Published whole: the one an exporter took earlier still says what it said.
    assert number(first, "gpumemd_sessions") == 0


def test_a_family_that_did_not_change_is_the_same_object(h: Harness) -> None:
    """What lets the exporter render only what changed."""
    m = Metrics(h.state)
    h.connect("engine-a")
    first = fresh(m)
    h.ok(None, p.Ping())
    second = fresh(m)
    assert [f.name for f in second.families if not any(f is g for g in first.families)] == ["gpumemd_requests_total"]


def _scrape(url: str) -> bytes:
    """The daemon's families of a scrape (the process's own figures come after them)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().split(b"# HELP process_")[0]  # type: ignore[no-any-return]


def test_the_exporter_serves_a_changed_snapshot_as_a_whole_new_one(h: Harness) -> None:
    """It renders only the families that changed; what it serves is what rendering them
    all gives."""
    pytest.importorskip("prometheus_client")
    from gpumemd.exporter import Exporter

    m = Metrics(h.state)
    s = h.connect("engine-a")
    served, fresh_one = Exporter("127.0.0.1", 0), Exporter("127.0.0.1", 0)
    try:
        served.start(m)
        first = _scrape(served.url)
        h.create(s, "kv", GiB)
        h.commit(s, "kv", BULK)
        m.refresh()
        fresh_one.start(m)
        after = _scrape(served.url)
        assert after == _scrape(fresh_one.url) and after != first
        assert b'gpumemd_arena_committed_bytes{UUID="%s",arena="kv",client="engine-a",gpu="0"} 1.6777216e+07' % h.state.device.uuid.encode() in after
    finally:
        served.close()
        fresh_one.close()


def test_a_scraper_that_asks_for_openmetrics_gets_it_and_others_text_0_0_4(h: Harness) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
    from prometheus_client.parser import text_string_to_metric_families

    from gpumemd.exporter import Exporter

    owned_pool(h)
    m = Metrics(h.state)
    exporter = Exporter("127.0.0.1", 0)
    prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    try:
        exporter.start(m)
        replies = {}
        for accept in (prometheus, "text/plain", None):
            request = urllib.request.Request(exporter.url, headers={"Accept": accept} if accept else {})
            with urllib.request.urlopen(request, timeout=10) as response:
                replies[accept] = response.headers["Content-Type"], response.read().decode()
        for _ in range(2):  # the second time from what the first rendered
            with urllib.request.urlopen(urllib.request.Request(exporter.url, headers={"Accept": prometheus}), timeout=10) as response:
                again = response.read().decode()
            assert again.split("# HELP process_")[0] == replies[prometheus][1].split("# HELP process_")[0]
    finally:
        exporter.close()
    content_type, body = replies[prometheus]
    assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert body.endswith("\n# EOF\n") and body.count("# EOF") == 1, body[-200:]
    families = {f.name: f for f in openmetrics_families(body)}  # the strict parser: it refuses a malformed exposition
    assert families["gpumemd_lease_releases"].type == "counter" and "process_open_fds" in families
    for accept in ("text/plain", None):
        content_type, body = replies[accept]
        assert content_type == "text/plain; version=0.0.4; charset=utf-8" and "# EOF" not in body
        assert {f.name for f in text_string_to_metric_families(body)} >= {"gpumemd_lease_releases", "gpumemd_device_free_bytes"}


def test_kv_rounds_by_outcome_with_duration_and_budget(h: Harness) -> None:
    m = Metrics(h.state)
    s = h.connect("engine-a")
    h.ok(s, p.KvDeclare(name="pool", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    h.ok(s, p.RoundJoin(pool="pool", expect=1))
    assert number(fresh(m), "gpumemd_kv_rounds_active") == 1
    h.clock.now += 7.0  # the engine captures its graphs
    h.state.handle(s, p.CaptureDone(pool="pool", max_tokens=4096), 5)
    (done,) = h.state.take_completions()
    assert isinstance(done.reply, p.KvCommitReply)
    snap = fresh(m)
    assert labelled(snap, "gpumemd_kv_rounds_total") == {("committed",): 1, ("failed",): 0}
    assert number(snap, "gpumemd_kv_rounds_active") == 0
    duration = histogram(snap, "gpumemd_kv_round_duration_seconds")
    assert duration.sum == pytest.approx(7.0) and duration.counts[duration.bounds.index(10.0)] == 1
    assert number(snap, "gpumemd_kv_round_committed_bytes") == done.reply.budget.committed == 16 * MiB
    assert number(snap, "gpumemd_kv_round_budget_bytes") == done.reply.budget.budget > 16 * MiB
    assert number(snap, "gpumemd_kv_pool_tokens", pool="pool", client="engine-a") == 4096

    h.ok(s, p.KvDeclare(name="late", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    h.ok(s, p.RoundJoin(pool="late", expect=2))
    h.clock.now += h.config.round_timeout + 1  # nobody reports: the deadline fails it
    h.state.tick()
    assert labelled(fresh(m), "gpumemd_kv_rounds_total") == {("committed",): 1, ("failed",): 1}


def test_a_client_that_owns_several_arenas_counts_them_all(h: Harness) -> None:
    """Committed bytes per client: every arena it owns, KV pools included (whatever the
    order they come in), and none it only attached."""
    m = Metrics(h.state)
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "weights", GiB)
    h.commit(a, "weights", 4 * BULK)
    h.ok(a, p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    h.ok(a, p.RoundJoin(pool="kv", expect=1))
    h.state.handle(a, p.CaptureDone(pool="kv", max_tokens=4096), 5)
    (done,) = h.state.take_completions()
    assert isinstance(done.reply, p.KvCommitReply) and done.reply.budget.committed == BULK
    h.create(a, "scratch", GiB)
    h.commit(a, "scratch", 2 * BULK)
    h.create(b, "theirs", GiB)
    h.commit(b, "theirs", BULK)
    h.share(b, "theirs", "engine-a")
    h.attach(a, "theirs")
    h.create(b, "spare", GiB)  # owned, nothing committed
    assert labelled(fresh(m), "gpumemd_client_committed_bytes") == {("engine-a",): 7 * BULK, ("engine-b",): BULK}


def test_a_histogram_bucket_counts_an_observation_equal_to_its_bound(h: Harness) -> None:
    """Prometheus buckets are ``le``: a round that lasted exactly 5 s is in the 5 s bucket,
    in the snapshot and in what the exporter renders from it."""
    m = Metrics(h.state)
    s = h.connect("engine-a")
    h.ok(s, p.KvDeclare(name="pool", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    h.ok(s, p.RoundJoin(pool="pool", expect=1))
    h.clock.now += 5.0
    h.state.handle(s, p.CaptureDone(pool="pool", max_tokens=4096), 5)
    (done,) = h.state.take_completions()
    assert isinstance(done.reply, p.KvCommitReply)
    duration = histogram(fresh(m), "gpumemd_kv_round_duration_seconds")
    assert duration.sum == 5.0 and duration.counts[duration.bounds.index(5.0)] == 1 and sum(duration.counts) == 1
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from gpumemd.exporter import Exporter

    exporter = Exporter("127.0.0.1", 0)
    try:
        exporter.start(m)
        text = _scrape(exporter.url).decode()
    finally:
        exporter.close()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "gpumemd_kv_round_duration_seconds"]
    buckets = {x.labels["le"]: x.value for x in family.samples if x.name.endswith("_bucket")}
    assert (buckets["1.0"], buckets["5.0"], buckets["10.0"], buckets["+Inf"]) == (0, 1, 1, 1)


# --------------------------------------------------------------------------- leases


def owned_pool(h: Harness) -> tuple[Session, p.GraphPoolStatus]:
    s = h.connect("engine")
    h.create(s, "graphs", GiB)
    h.commit(s, "graphs", BULK)
    m = p.RegisterGraphPool(arena="graphs", label="decode bs=8", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[p.Extent(offset=MiB, size=2 * MiB)])
    return s, h.ok(s, m).reply.pool


def lease_labels(pool: p.GraphPoolStatus) -> dict[str, str]:
    return {"pool_id": str(pool.id), "pool": pool.label, "arena": pool.arena, "client": pool.owner}


def segment(h: Harness, pool: p.GraphPoolStatus) -> LeaseSegment:
    """The pool's lease segment as the daemon maps it."""
    return h.state.graph_pools.by_id[pool.id].segment


def take_and_give_back(h: Harness, s: Session, pool: p.GraphPoolStatus, times: int) -> None:
    table, w = segment(h, pool), lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    for _ in range(times):
        assert table.try_acquire(w, lease_table.lease_epoch(pool.id, pool.epoch), b"replay") == LeaseStatus.OK
        assert table.release(w) == LeaseStatus.OK


def test_leases_are_counted_from_the_registration_on(make_harness) -> None:  # type: ignore[no-untyped-def]
    h = make_harness()
    m = Metrics(h.state)
    s, pool = owned_pool(h)
    # Before any tick saw the pool: nothing is lost.
    take_and_give_back(h, s, pool, 3)
    snap = fresh(m)
    labels = lease_labels(pool)
    assert number(snap, "gpumemd_lease_releases_total", **labels) == 3
    assert number(snap, "gpumemd_graph_pool_free_bytes", **labels) == 2 * MiB
    take_and_give_back(h, s, pool, 4)
    assert number(fresh(m), "gpumemd_lease_releases_total", **labels) == 7
    h.ok(s, p.RetireGraphPool(pool_id=pool.id))
    h.state.tick()
    assert labelled(fresh(m), "gpumemd_lease_releases_total") == {}
    # A pool registered after it has a new segment: its count starts afresh, not at 7.
    again = h.ok(s, p.RegisterGraphPool(arena="graphs", label="again", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[])).reply.pool
    take_and_give_back(h, s, again, 2)
    assert number(fresh(m), "gpumemd_lease_releases_total", **lease_labels(again)) == 2


def test_a_holder_with_a_sleeper_behind_it_is_one_conflict_and_one_wait(h: Harness) -> None:
    m = Metrics(h.state)
    s, pool = owned_pool(h)
    labels = lease_labels(pool)
    table, epoch = segment(h, pool), lease_table.lease_epoch(pool.id, pool.epoch)
    held = lease_table.encode(LeaseKind.CAPTURE, s.id, s.pid)
    assert table.try_acquire(held, epoch, b"capture") == LeaseStatus.OK
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_held", kind="capture", **labels) == 1
    assert number(snap, "gpumemd_lease_held", kind="replay", **labels) == 0
    assert number(snap, "gpumemd_lease_conflicts_total", **labels) == 0, "held, but nobody waits"
    waiter = Waiter(table, lease_table.encode(LeaseKind.REPLAY, s.id, s.pid + 1), epoch, 10.0)
    waiter.start()
    wait_until_sleeping(table)
    time.sleep(0.05)  # the holder has held for a while when the tick sees the sleeper
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_waiters", **labels) == 1
    assert number(snap, "gpumemd_lease_conflicts_total", **labels) == 1
    assert number(fresh(m), "gpumemd_lease_conflicts_total", **labels) == 1, "the same holder is one conflict, however many ticks see it"
    assert table.release(held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_waiters", **labels) == 0
    assert number(snap, "gpumemd_lease_held", kind="replay", **labels) == 1
    wait = histogram(snap, "gpumemd_lease_wait_seconds", **labels)
    assert sum(wait.counts) == 1 and 0.05 <= wait.sum < 10.0
    assert number(snap, "gpumemd_lease_releases_total", **labels) == 1, "the capture ended; the replay is still held"


def test_each_holder_that_keeps_sleepers_waiting_is_its_own_conflict(h: Harness) -> None:
    m = Metrics(h.state)
    s, pool = owned_pool(h)
    labels = lease_labels(pool)
    table, epoch = segment(h, pool), lease_table.lease_epoch(pool.id, pool.epoch)
    first = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert table.try_acquire(first, epoch, b"a") == LeaseStatus.OK
    waiters = [Waiter(table, lease_table.encode(LeaseKind.REPLAY, s.id, s.pid + k), epoch, 10.0) for k in (1, 2)]
    for w in waiters:
        w.start()
    wait_until_sleeping(table, waiters=2)
    assert number(fresh(m), "gpumemd_lease_conflicts_total", **labels) == 1
    assert table.release(first) == LeaseStatus.OK
    deadline = time.monotonic() + 10
    while not any(w.result for w in waiters):  # one of them holds it now, the other sleeps behind it
        assert time.monotonic() < deadline
        time.sleep(0.001)
    wait_until_sleeping(table)
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_conflicts_total", **labels) == 2, "a new holder with a sleeper behind it"
    assert sum(histogram(snap, "gpumemd_lease_wait_seconds", **labels).counts) == 1, "the first conflict ended"
    assert sum(1 for w in waiters if w.result) == 1
    assert table.release(table.peek()) == LeaseStatus.OK
    for w in waiters:
        w.finish()
    assert table.release(table.peek()) == LeaseStatus.OK
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_releases_total", **labels) == 3
    assert sum(histogram(snap, "gpumemd_lease_wait_seconds", **labels).counts) == 2


def test_escapes_are_counted_and_the_escaped_clients_shown(h: Harness) -> None:
    m = Metrics(h.state)
    s, pool = owned_pool(h)
    labels = lease_labels(pool)
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=True))
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_escapes_total", **labels) == 1
    assert number(snap, "gpumemd_lease_escaped_clients", **labels) == 1
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=False))
    snap = fresh(m)
    assert number(snap, "gpumemd_lease_escapes_total", **labels) == 1
    assert number(snap, "gpumemd_lease_escaped_clients", **labels) == 0


def test_hidden_names_name_no_tenant_and_keep_series_apart_and_joined(h: Harness) -> None:
    """--metrics-hide-names: no label carries a client name, arena name or pool label;
    each name is one digest throughout (the owner's series join its arenas'), two names
    two digests, and the digest is keyed (another daemon's differs: no guess at a name
    can be checked against it)."""
    s, pool = owned_pool(h)  # client "engine", arena "graphs", pool "decode bs=8"
    h.ok(s, p.KvDeclare(name="kv-of-tenant", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    other = h.connect("tenant-b")
    h.create(other, "arena-of-b", GiB)
    h.commit(other, "arena-of-b", 2 * BULK)
    shown, hidden = fresh(Metrics(h.state)), fresh(Metrics(h.state, hide_names=True))
    names = {"engine", "graphs", "decode bs=8", "kv-of-tenant", "tenant-b", "arena-of-b"}
    values = {v for f in hidden.families for labels, _ in f.samples for v in labels}
    assert not {v for v in values if any(name in v for name in names)}, "a tenant's name in a label"
    assert {v for f in shown.families for labels, _ in f.samples for v in labels} >= names, "shown by default"
    for before, after in zip(shown.families, hidden.families):
        assert (after.name, after.labels, [v for _, v in after.samples]) == (before.name, before.labels, [v for _, v in before.samples])
    owners = {n: name for (name,), n in labelled(hidden, "gpumemd_client_committed_bytes").items()}
    assert len(owners) == 2 and owners.keys() == {BULK, 2 * BULK}
    arenas = {n: labels for labels, n in labelled(hidden, "gpumemd_arena_committed_bytes").items()}
    assert arenas[BULK][1] == owners[BULK] and arenas[2 * BULK][1] == owners[2 * BULK], "an arena's client is its owner's digest"
    (kv_pool,) = labelled(hidden, "gpumemd_kv_pool_tokens")
    assert kv_pool[1] == owners[BULK] and kv_pool[0] in {arena for arena, _ in labelled(hidden, "gpumemd_arena_reserved_bytes")}
    again = fresh(Metrics(h.state, hide_names=True))
    assert {name for (name,) in labelled(again, "gpumemd_client_committed_bytes")}.isdisjoint(owners.values()), "the digest is not keyed"


def test_every_family_is_named_for_prometheus(h: Harness) -> None:
    """gpumemd_ prefix, base units in the name (_bytes, _seconds), counters in _total,
    the device on every sample and only the documented labels."""
    owned_pool(h)
    names = set()
    for family in Metrics(h.state).snapshot.families:
        names.add(family.name)
        assert family.name.startswith("gpumemd_") and family.name == family.name.lower(), family.name
        assert family.name.endswith("_total") == (family.kind == "counter"), family.name
        assert family.kind != "histogram" or family.name.endswith("_seconds"), family.name
        assert "bytes" not in family.name or family.name.endswith(("_bytes", "_bytes_total")), family.name
        assert family.labels[:2] == ("gpu", "UUID"), family.name  # DCGM exporter's names: series join on either
        assert set(family.labels) <= {"gpu", "UUID", "client", "arena", "pool", "pool_id", "kind", "type", "outcome", "reason",
                                      "version", "backend", "modelName", "tenant", "mode"}, family.name
    assert len(names) == len(Metrics(h.state).snapshot.families), "a family appears twice"


def test_the_readme_lists_every_family_with_its_type(h: Harness) -> None:
    owned_pool(h)
    readme = (Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
    section = readme.split("\n## Monitoring\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(gpumemd_\w+)` \| (\w+) \|", section, re.M))
    assert listed == {(f.name, f.kind) for f in Metrics(h.state).snapshot.families}


def test_the_lease_ordering_and_memops_lanes_in_use_are_in_status_and_metrics(make_harness) -> None:  # type: ignore[no-untyped-def]
    h = make_harness(lease_ordering=LeaseOrdering.MEMOPS)
    m = Metrics(h.state)
    lanes = h.state.graph_pools.order.lanes.lanes
    s = h.connect("engine")
    h.create(s, "graphs", GiB)
    h.commit(s, "graphs", BULK)
    for n, offset in enumerate((0, 4 * MiB), start=1):  # each shared pool its owner uses takes a lane
        h.ok(s, p.RegisterGraphPool(arena="graphs", label=f"decode-{n}", extents=[p.Extent(offset=offset, size=4 * MiB)], free_runs=[], shared=True))
        daemon = h.state.status().daemon
        assert (daemon.lease_ordering, daemon.lease_lanes, daemon.lease_lanes_in_use) == ("memops", lanes, n)
        snap = fresh(m)
        assert number(snap, "gpumemd_lease_ordering_lanes_in_use") == n
    assert number(snap, "gpumemd_lease_ordering_lanes") == lanes
    assert labelled(snap, "gpumemd_lease_ordering") == {("memops",): 1, ("ipc-events",): 0}
    h.ok(s, p.RegisterGraphPool(arena="graphs", label="private", extents=[p.Extent(offset=8 * MiB, size=4 * MiB)], free_runs=[]))
    assert h.state.status().daemon.lease_lanes_in_use == 2, "a private pool orders nothing: no lane"


def test_under_ipc_events_there_are_no_lanes_to_show(h: Harness) -> None:
    daemon = h.state.status().daemon
    assert (daemon.lease_ordering, daemon.lease_lanes, daemon.lease_lanes_in_use) == ("ipc-events", 0, 0)
    snap = Metrics(h.state).snapshot
    assert labelled(snap, "gpumemd_lease_ordering") == {("memops",): 0, ("ipc-events",): 1}
    assert labelled(snap, "gpumemd_lease_ordering_lanes") == {} and labelled(snap, "gpumemd_lease_ordering_lanes_in_use") == {}
