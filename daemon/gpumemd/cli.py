"""``gpumemd``: run the memory daemon for one GPU."""

from __future__ import annotations

import logging
import sys

import click

from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverUnavailable
from gpumem_shared.paths import Endpoints, resolve_runtime_dir
from gpumem_shared.units import parse_size
from gpumemd.config import VA_PLAN_SLICES, StateConfig, plan_range
from gpumemd.notify import SystemdNotifier
from gpumemd.server import Server, StartupError
from gpumemd.state import DaemonState

# sysexits EX_CONFIG: the unit file's RestartPreventExitStatus keeps systemd from
# restarting a daemon that can never start as configured.
EXIT_CONFIG = 78


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _fail(message: str) -> None:
    click.echo(f"gpumemd: {message}", err=True)
    sys.exit(EXIT_CONFIG)


def _driver(backend: str | None, device: int, host_capacity: int) -> Driver:
    if backend == "host":
        from gpumem_shared.driver.host import HostDriver

        return HostDriver(device, host_capacity)
    from gpumem_shared.driver.cuda import CudaDriver

    try:
        return CudaDriver(device)
    except DriverUnavailable as exc:
        _fail(f"cannot use the CUDA backend: {exc}; on a machine without a GPU, run with --backend host")
        raise


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=int, default=0, show_default=True, help="GPU index (nvidia-smi order) this daemon owns.")
@click.option("--backend", type=click.Choice(["cuda", "host"]), default=None, help="Driver backend [default: cuda].")
@click.option("--host-capacity", default="8GiB", show_default=True, callback=_size, help="Memory the host backend offers.")
@click.option("--runtime-dir", default=None, help="Socket directory [default: $GPUMEMD_RUNTIME_DIR, /run/gpumemd for root, else $XDG_RUNTIME_DIR/gpumemd].")
@click.option("--socket-group", default=None, help="Group that owns the sockets (mode 0660); its members may connect.")
@click.option("--chunk-size", default="512MiB", show_default=True, callback=_size, help="Size of bulk chunks; tails use smaller ones.")
@click.option(
    "--kv-chunk-size",
    default="1GiB",
    show_default=True,
    callback=_size,
    help="KV buffers are committed in chunks this large: larger means faster rounds, coarser shrinks.",
)
@click.option("--reserve", default=None, callback=_size, help="Memory never committed [default: 1GiB on CUDA, 0 on host].")
@click.option("--hello-timeout", type=float, default=5.0, show_default=True, help="Seconds a new connection has to say HELLO.")
@click.option("--round-timeout", type=float, default=300.0, show_default=True, help="Seconds from a KV commit round's first join to its deadline.")
@click.option(
    "--round-policy",
    type=click.Choice(["partial", "fail"]),
    default="partial",
    show_default=True,
    help="At a round's deadline: commit for the members that reported, or fail the round.",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def main(
    device: int,
    backend: str | None,
    host_capacity: int,
    runtime_dir: str | None,
    socket_group: str | None,
    chunk_size: int,
    kv_chunk_size: int,
    reserve: int | None,
    hello_timeout: float,
    round_timeout: float,
    round_policy: str,
    log_level: str,
) -> None:
    """Own GPU DEVICE's VMM memory and serve it to co-located engine processes."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not 0 <= device < VA_PLAN_SLICES:
        _fail(f"--device {device}: gpumemd serves devices 0-{VA_PLAN_SLICES - 1} (each plans arenas in its own address slice)")
    driver = _driver(backend, device, host_capacity)
    for flag, value in (("--chunk-size", chunk_size), ("--kv-chunk-size", kv_chunk_size)):
        if value <= 0 or value % driver.granularity:
            _fail(f"{flag} {value} is not a positive multiple of the device granularity {driver.granularity}")
    endpoints = Endpoints(resolve_runtime_dir(runtime_dir), device)
    va_base, va_limit = plan_range(device)
    config = StateConfig(
        index=device,
        va_base=va_base,
        va_limit=va_limit,
        runtime_dir=str(endpoints.runtime_dir),
        bulk_chunk=chunk_size,
        kv_chunk=kv_chunk_size,
        reserve_bytes=reserve if reserve is not None else (1 << 30 if driver.kind == "cuda" else 0),
        round_timeout=round_timeout,
        round_policy=p.RoundPolicy(round_policy),
    )
    server = Server(DaemonState(driver, config), endpoints, socket_group=socket_group, hello_timeout=hello_timeout, notifier=SystemdNotifier())
    try:
        server.bind()
    except StartupError as exc:
        _fail(str(exc))
    server.serve_forever()
