"""``gpumemd``: run the memory daemon for one GPU.

Every configuration error (an unknown flag, a size that is not one, a directory the
daemon cannot use, figures that contradict each other, an address slice that is not
free in the daemon's process) ends the process with exit status 78 and one line on
stderr: the unit's RestartPreventExitStatus=78 then keeps systemd from restarting a
daemon that can never start as configured.

Every flag may also come from the environment as GPUMEMD_<FLAG> (GPUMEMD_METRICS_PORT
for --metrics-port), read when the command starts; the command line wins, and an error
in a value from the environment names the variable.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import click
from click.core import ParameterSource

from gpumem_shared import protocol as p
from gpumem_shared.address_plan import VA_PLAN_SLICES, plan_range
from gpumem_shared.driver import Driver, DriverUnavailable
from gpumem_shared.lease_order import LeaseOrdering
from gpumem_shared.paths import Endpoints, UnsafeRuntimeDir, resolve_runtime_dir
from gpumem_shared.units import Size, format_size, parse

# What the options and the checks before the driver need, and no more: the serving code
# is imported in ``command``, beside the driver's start (_DriverStart).
import gpumemd
from gpumemd import logs
from gpumemd.config import StateConfig, TenantLimits
from gpumemd.fencing import Fence, fence_for, process_gone
from gpumemd.notify import PassedFdsError, SystemdNotifier, inherited_fds
from gpumemd.startup import StartupClock

if TYPE_CHECKING:
    from gpumemd.exporter import Exporter
    from gpumemd.metrics import Metrics

# sysexits EX_CONFIG.
EXIT_CONFIG = 78
# A driver that has not started in this long is hung (systemd's TimeoutStartSec= is 120 s).
DRIVER_START_TIMEOUT = 110.0
# Every flag may come from the environment instead (--metrics-port: GPUMEMD_METRICS_PORT),
# as the systemd unit's per-instance EnvironmentFile sets them; the command line wins.
ENV_PREFIX = "GPUMEMD"
_option = functools.partial(click.option, show_envvar=True)


class ConfigError(Exception):
    """The daemon cannot start as configured; the message is the one line shown."""


class DriverHung(Exception):
    """The driver did not start in time: not the configuration's fault (exit status 1, so
    systemd tries again)."""


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> Size | None:
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _positive(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not value > 0:
        raise click.BadParameter(f"must be a positive number of seconds, not {value}")
    return value


def _share(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 0 < value <= 1:
        raise click.BadParameter(f"must be a fraction in (0, 1], not {value}")
    return value


def _named(flag: str) -> str:
    """``flag`` as the user gave it: with the variable's name when it came from the environment."""
    ctx = click.get_current_context(silent=True)
    name = flag.lstrip("-").replace("-", "_")
    if ctx is not None and ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT:
        return f"{flag} (${ENV_PREFIX}_{name.upper()})"
    return flag


def _granular(flag: str, size: Size, granularity: int) -> int:
    if size.bytes <= 0 or size.bytes % granularity:
        iec = size.as_iec()
        meant = f"; did you mean {iec}?" if iec is not None and iec.bytes > 0 and iec.bytes % granularity == 0 else ""
        raise ConfigError(
            f"{_named(flag)} {size} is not a positive multiple of the device granularity "
            f"{format_size(granularity)}; nearest valid: {size.nearest_multiples(granularity)}{meant}"
        )
    return size.bytes


def _driver(backend: str | None, device: int, host_capacity: Size) -> Callable[[], Driver]:
    """What makes the driver; the host capacity is checked here, on the thread that knows
    where the flag came from."""
    if backend == "host":
        from gpumem_shared.driver.host import HOST_GRANULARITY, HostDriver

        _granular("--host-capacity", host_capacity, HOST_GRANULARITY)
        return functools.partial(HostDriver, device, host_capacity.bytes)

    def cuda() -> Driver:
        from gpumem_shared.driver.cuda import CudaDriver

        return CudaDriver(device)

    return cuda


class _DriverStart:
    """The driver and its fence, made on a thread of their own. On CUDA, cuInit, the
    primary context and NVML's init spend a tenth of a second or more inside the driver
    with the GIL released: the serving code's imports run meanwhile, and a restart (a
    failover waits for it) is that much shorter."""

    def __init__(self, make: Callable[[], Driver]) -> None:
        self._make = make
        self._made: tuple[Driver, Fence] | None = None
        self._failed: BaseException | None = None
        self.seconds = 0.0  # the start's own time, on its thread
        self._thread = threading.Thread(target=self._run, name="gpumemd-driver-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            driver = self._make()
            self._made = driver, fence_for(driver.kind, driver.device_uuid())
        except BaseException as exc:  # raised again on the main thread, by wait()
            self._failed = exc
        self.seconds = time.monotonic() - started

    def wait(self) -> tuple[Driver, Fence]:
        self._thread.join(DRIVER_START_TIMEOUT)
        if self._thread.is_alive():
            raise DriverHung(
                f"the CUDA driver did not start within {DRIVER_START_TIMEOUT:g}s (cuInit, the primary context, NVML); "
                "check nvidia-smi and the kernel log (dmesg) for the driver's state"
            )
        if isinstance(self._failed, DriverUnavailable):
            raise ConfigError(f"cannot use the CUDA backend: {self._failed}; on a machine without a GPU, run with --backend host")
        if self._failed is not None:
            raise self._failed
        assert self._made is not None
        return self._made


def _exporter(address: str, port: int) -> Exporter:
    """The metrics endpoint, bound: a missing extra or an address in use is a
    configuration error, found before the daemon takes its device."""
    try:
        from gpumemd.exporter import Exporter
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "prometheus_client":
            raise
        raise ConfigError("--metrics-port needs prometheus-client, which is not installed: pip install 'gpumemd[metrics]'") from None
    try:
        return Exporter(address, port)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {address} port {port}: {exc.strerror or exc}") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": ENV_PREFIX})
@click.version_option(package_name="gpumemd", prog_name="gpumemd")
@_option("--device", type=int, default=0, show_default=True, help="GPU index (nvidia-smi order) this daemon owns.")
@_option("--backend", type=click.Choice(["cuda", "host"]), default=None, help="Driver backend [default: cuda].")
@_option("--host-capacity", default="8GiB", show_default=True, callback=_size, help="Memory the host backend offers.")
@_option(
    "--runtime-dir",
    default=None,
    help="Socket directory [default: $GPUMEMD_RUNTIME_DIR, /run/gpumemd for root, else $XDG_RUNTIME_DIR/gpumemd].",
)
@_option("--socket-group", default=None, help="Group (name or number) that owns the sockets (mode 0660); its members may connect.")
@_option("--chunk-size", default="512MiB", show_default=True, callback=_size, help="Size of bulk chunks; tails use smaller ones.")
@_option(
    "--kv-chunk-size",
    default="1GiB",
    show_default=True,
    callback=_size,
    help="KV buffers are committed in chunks this large: larger means faster rounds, coarser shrinks.",
)
@_option("--reserve", default=None, callback=_size, help="Memory never committed [default: 1GiB on CUDA, 0 on host].")
@_option(
    "--capacity",
    default=None,
    callback=_size,
    help="The most gpumemd commits in all, however much the device has free: emulates a smaller GPU [default: no cap].",
)
@_option(
    "--sleep-host-limit",
    default=None,
    callback=_size,
    help="The most host memory sleeping engines' buffers may take in all [default: half the machine's memory].",
)
@_option(
    "--hello-timeout", type=float, default=5.0, show_default=True, callback=_positive, help="Seconds a new connection has to say HELLO."
)
@_option(
    "--round-timeout",
    type=float,
    default=300.0,
    show_default=True,
    callback=_positive,
    help="Seconds from a KV commit round's first join to its deadline.",
)
@_option(
    "--move-timeout",
    type=float,
    default=2.0,
    show_default=True,
    callback=_positive,
    help="Seconds a KV grow waits for other pools to give back before it is answered with what could be got.",
)
@_option(
    "--round-policy",
    type=click.Choice([policy.value for policy in p.RoundPolicy]),
    default=p.RoundPolicy.PARTIAL.value,
    show_default=True,
    help="At a round's deadline: commit for the members that reported, or fail the round.",
)
@_option(
    "--restart-grace",
    type=float,
    default=30.0,
    show_default=True,
    callback=_positive,
    help="After a restart with the state kept (systemd's fd store): seconds clients have to resume before what they held is released.",
)
@_option(
    "--retain-grace",
    type=float,
    default=StateConfig.retain_grace,
    show_default=True,
    callback=_positive,
    help="Seconds a retain group's arenas and KV pools stay orphaned (kept for an adopter) after their engine died.",
)
@_option(
    "--tenant-sessions",
    type=click.IntRange(1),
    default=TenantLimits.sessions,
    show_default=True,
    help="Live sessions one uid may hold: no user locks the others out of the daemon's connections.",
)
@_option(
    "--tenant-arenas",
    type=click.IntRange(1),
    default=TenantLimits.arenas,
    show_default=True,
    help="Arenas (KV pools included) one uid may own at once.",
)
@_option(
    "--tenant-address-share",
    type=float,
    default=TenantLimits.address_share,
    show_default=True,
    callback=_share,
    help="Fraction of the device's address plan one uid's arena windows may take (each arena also costs a guard step).",
)
@_option(
    "--tenant-graph-pool-share",
    type=float,
    default=TenantLimits.graph_pool_share,
    show_default=True,
    callback=_share,
    help="Fraction of the daemon's graph-pool slots one uid's sessions may keep.",
)
@_option(
    "--tenant-sleep-host-share",
    type=float,
    default=TenantLimits.sleep_host_share,
    show_default=True,
    callback=_share,
    help="Fraction of --sleep-host-limit one uid's sleep host buffers may take.",
)
@_option(
    "--tenant-requests",
    type=click.IntRange(1),
    default=TenantLimits.requests,
    show_default=True,
    help="Control requests one session may have waiting for service; more are refused at once (a client has one call out).",
)
@_option(
    "--tenant-policy",
    type=click.Path(dir_okay=False),
    default="",
    help="A TOML or JSON file of device-memory caps per tenant (uid, gid or tenant token: a maximum and a guaranteed minimum); "
    "read again on SIGHUP. See docs/architecture.md, Tenant caps.",
)
@_option(
    "--tenant-claims",
    type=click.Path(file_okay=False),
    default="",
    help="A directory a Kubernetes DRA driver writes, one subdirectory per ResourceClaim with a tenant.json "
    "(the tenant and the bytes it consumed): each is a cap, read again when a claim comes, changes or goes (and on SIGHUP). "
    "See docs/architecture.md, Kubernetes DRA.",
)
@_option(
    "--lease-ordering",
    type=click.Choice([o.value for o in LeaseOrdering]),
    default=LeaseOrdering.IPC_EVENTS.value,
    show_default=True,
    help="How a lease handoff on a shared graph pool orders the taker's GPU work after the releaser's: CUDA IPC events "
    "(engine pods need hostIPC), or stream memory operations on a sequence chunk the daemon shares (no IPC namespace; "
    "refused on a device without 64-bit stream memory operations). The default stays until memops is measured on the H200.",
)
@_option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics at http://ADDRESS:PORT/metrics (needs: pip install 'gpumemd[metrics]'); 0 picks a free port, logged. "
    "No access control: whoever reaches it reads client names, arena names and pool labels (see --metrics-hide-names).",
)
@_option(
    "--metrics-address",
    default=None,
    help="Address the metrics endpoint listens on [default: 127.0.0.1, where every local user can read it, socket group or not].",
)
@_option(
    "--metrics-hide-names",
    is_flag=True,
    help="Label metrics with a keyed digest of each client name, arena name and pool label (the same while the daemon runs) "
    "instead of the names: for an endpoint that users outside the socket group can reach.",
)
@_option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="debug adds a line per control request: type, client, size, outcome, time in µs.",
)
@_option(
    "--log-format",
    type=click.Choice(logs.FORMATS),
    default="text",
    show_default=True,
    help="text: timestamped lines (not under journald, which stamps them); json: one object per line, with figures.",
)
def command(
    device: int,
    backend: str | None,
    host_capacity: Size,
    runtime_dir: str | None,
    socket_group: str | None,
    chunk_size: Size,
    kv_chunk_size: Size,
    reserve: Size | None,
    capacity: Size | None,
    sleep_host_limit: Size | None,
    hello_timeout: float,
    round_timeout: float,
    move_timeout: float,
    round_policy: str,
    restart_grace: float,
    retain_grace: float,
    tenant_sessions: int,
    tenant_arenas: int,
    tenant_address_share: float,
    tenant_graph_pool_share: float,
    tenant_sleep_host_share: float,
    tenant_requests: int,
    tenant_policy: str,
    tenant_claims: str,
    lease_ordering: str,
    metrics_port: int | None,
    metrics_address: str | None,
    metrics_hide_names: bool,
    log_level: str,
    log_format: logs.LogFormat,
) -> None:
    """Own GPU DEVICE's VMM memory and serve it to co-located engine processes."""
    clock = StartupClock(gpumemd.IMPORT_STARTED)
    clock.mark("imports")  # this module's, and the options' parsing (a fraction of a millisecond)
    logs.configure(log_level, log_format)
    try:  # before the daemon opens a descriptor of its own: those passed are below any
        inherited = inherited_fds(os.environ)
    except PassedFdsError as exc:
        raise ConfigError(str(exc)) from None
    if metrics_address is not None and metrics_port is None:
        raise ConfigError(f"--metrics-address {metrics_address} serves nothing without --metrics-port")
    if metrics_hide_names and metrics_port is None:
        raise ConfigError("--metrics-hide-names hides nothing without --metrics-port")
    if not 0 <= device < VA_PLAN_SLICES:
        raise ConfigError(f"--device {device}: gpumemd serves devices 0-{VA_PLAN_SLICES - 1} (each plans arenas in its own address slice)")
    starting = _DriverStart(_driver(backend, device, host_capacity))
    from gpumemd.window_plan import SliceUnavailable
    from gpumemd.memory_caps import PolicyError, read_policy
    from gpumemd.durable import Durable
    from gpumemd.outbox import Outbox
    from gpumemd.runtime import StartupError, check_runtime_dir
    from gpumemd.server import Server
    from gpumemd.state import DaemonState

    clock.mark("server_imports")
    driver, fence = starting.wait()
    clock.mark("driver")  # what the driver's start took beyond the imports it ran beside
    clock.note(f"driver start {starting.seconds * 1e3:.1f} ms on its thread")
    ordering = LeaseOrdering(lease_ordering)
    problem = driver.memops_problem() if ordering is LeaseOrdering.MEMOPS else None
    if problem:
        raise ConfigError(f"--lease-ordering memops: {problem}")
    bulk = _granular("--chunk-size", chunk_size, driver.granularity)
    kv_chunk = _granular("--kv-chunk-size", kv_chunk_size, driver.granularity)
    reserve_bytes = reserve.bytes if reserve is not None else (1 << 30 if driver.kind == "cuda" else 0)
    if reserve_bytes >= driver.total_bytes():
        raise ConfigError(
            f"--reserve {format_size(reserve_bytes)} leaves nothing to serve: the device has {format_size(driver.total_bytes())}"
        )
    capacity_bytes = capacity.bytes if capacity is not None else 0
    if capacity is not None and capacity_bytes <= reserve_bytes:
        raise ConfigError(f"--capacity {format_size(capacity_bytes)} leaves nothing to serve above the {format_size(reserve_bytes)} reserve")
    try:
        endpoints = Endpoints(resolve_runtime_dir(runtime_dir), device)
        check_runtime_dir(endpoints.runtime_dir)
    except (UnsafeRuntimeDir, StartupError) as exc:
        raise ConfigError(str(exc)) from None
    try:  # here, so a bad policy stops the start with its reason; a bad reload keeps the old one
        read_policy(tenant_policy, tenant_claims)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    va_base, va_limit = plan_range(device)
    config = StateConfig(
        index=device,
        va_base=va_base,
        va_limit=va_limit,
        runtime_dir=str(endpoints.runtime_dir),
        bulk_chunk=bulk,
        kv_chunk=kv_chunk,
        reserve_bytes=reserve_bytes,
        capacity_bytes=capacity_bytes,
        round_timeout=round_timeout,
        round_policy=p.RoundPolicy(round_policy),
        move_timeout=move_timeout,
        restart_grace=restart_grace,
        retain_grace=retain_grace,
        tenants=TenantLimits(
            tenant_sessions, tenant_arenas, tenant_address_share, tenant_graph_pool_share, tenant_requests, tenant_sleep_host_share
        ),
        tenant_policy=tenant_policy,
        tenant_claims=tenant_claims,
        lease_ordering=ordering,
    )
    if sleep_host_limit is not None:
        config.sleep_host_limit = sleep_host_limit.bytes
    exporter = _exporter(metrics_address or "127.0.0.1", metrics_port) if metrics_port is not None else None
    notifier = SystemdNotifier()
    if ordering is LeaseOrdering.MEMOPS and notifier.store_max > 0:
        raise ConfigError(
            "--lease-ordering memops does not survive a restart yet (its sequence chunk is not in the durable record): "
            "run it without systemd's fd store (FileDescriptorStoreMax=0), or use --lease-ordering ipc-events"
        )
    try:
        state = DaemonState(driver, config, fence=fence, gone=process_gone)
    except SliceUnavailable as exc:
        raise ConfigError(str(exc)) from None
    clock.mark("state")
    metrics: Metrics | None = None
    if exporter is not None:  # imported here: a start without the endpoint does without it
        from gpumemd.metrics import Metrics

        metrics = Metrics(state, hide_names=metrics_hide_names)
    durable = Durable(notifier) if notifier.store_max > 0 else None
    if durable is None and inherited:
        logging.getLogger("gpumemd.cli").warning("descriptors passed (%s) but no fd store to keep them in ($FDSTORE unset): closed", ", ".join(sorted(inherited)))
        for group in inherited.values():
            for fd in group:
                os.close(fd)
    server = Server(
        state,
        endpoints,
        socket_group=socket_group,
        hello_timeout=hello_timeout,
        notifier=notifier,
        on_tick=metrics.refresh if metrics is not None else None,
        outbox=Outbox(state, durable),
    )
    try:
        server.bind()
    except StartupError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot use runtime directory {endpoints.runtime_dir}: {exc.strerror or exc}; "
            "give gpumemd a directory it may write and nobody else may (--runtime-dir)"
        ) from None
    clock.mark("sockets")
    if durable is not None:  # once the lock is held: only the device's one daemon rebuilds
        durable.start(state, inherited)
        arenas = state.arenas.by_name.values()
        clock.note(
            f"{sum(len(g) for g in inherited.values())} stored fds passed; {len(state.sessions)} sessions, {len(arenas)} arenas, "
            f"{sum(len(a.chunks) + len(a.placeholders) for a in arenas)} chunks restored"
        )
        clock.mark("restore")
    if exporter is not None and metrics is not None:
        exporter.start(metrics)
        clock.mark("metrics")
    try:
        server.serve_forever(on_ready=clock.log_ready)
    finally:
        if exporter is not None:
            exporter.close()


def _fail(message: str) -> NoReturn:
    click.echo(f"gpumemd: {message}", err=True)
    sys.exit(EXIT_CONFIG)


def _from_where(exc: click.BadParameter) -> str:
    """Name the variable a bad value came from: the command line shows no flag for it."""
    param = exc.param
    if exc.ctx is None or param is None or param.name is None:
        return ""
    if exc.ctx.get_parameter_source(param.name) is not ParameterSource.ENVIRONMENT:
        return ""
    return f"${ENV_PREFIX}_{param.name.upper()}={os.environ.get(f'{ENV_PREFIX}_{param.name.upper()}', '')!r}: "


def main() -> None:
    try:
        command.main(standalone_mode=False)
    except click.BadParameter as exc:
        _fail(_from_where(exc) + exc.format_message().replace("\n", " "))
    except click.UsageError as exc:  # unknown flags, bad values: one line, not click's usage block
        _fail(exc.format_message().replace("\n", " ").rstrip(".") + "; gpumemd --help lists the flags")
    except ConfigError as exc:
        _fail(str(exc))
    except DriverHung as exc:
        click.echo(f"gpumemd: {exc}", err=True)
        sys.exit(1)
    except click.Abort:
        sys.exit(1)
