"""``gpumemctl``: look at a running gpumemd.

Exit status follows the LSB status convention: 0 ok, 1 error, 3 no daemon answers,
4 the daemon speaks another protocol major.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints, daemon_alive, resolve_runtime_dir
from gpumem_shared.units import format_size
from gpumem.channel import ControlChannel
from gpumem.errors import DaemonUnavailable, GpuMemError, ProtocolMismatch

EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_MISMATCH = 1, 3, 4


def _target(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.option("--device", "-d", type=int, default=None, help="Device index [default: 0]."),
            click.option("--runtime-dir", default=None, help="Daemon socket directory [default: as gpumemd]."),
            click.option("--timeout", type=float, default=None, help="Seconds to wait for the daemon [default: 5]."),
        ]
    ):
        command = option(command)
    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_target
@click.pass_context
def main(ctx: click.Context, device: int | None, runtime_dir: str | None, timeout: float | None) -> None:
    """Inspect gpumemd: clients, arenas, graph-pool extents and leases."""
    ctx.obj = {"device": device, "runtime_dir": runtime_dir, "timeout": timeout}


def _query(ctx: click.Context, device: int | None, runtime_dir: str | None, timeout: float | None, message: Any) -> Any:
    group = ctx.obj
    index = device if device is not None else (group["device"] if group["device"] is not None else 0)
    endpoints = Endpoints(resolve_runtime_dir(runtime_dir or group["runtime_dir"]), index)
    wait = timeout if timeout is not None else (group["timeout"] if group["timeout"] is not None else 5.0)
    if not endpoints.zmq_path.exists() or not daemon_alive(endpoints):
        _die(
            EXIT_NOT_RUNNING,
            f"no gpumemd serves device {index}: no live daemon behind {endpoints.zmq_path} "
            f"(start it with 'systemctl start gpumemd@{index}' or 'gpumemd --device {index}', "
            "or give --runtime-dir)",
        )
    channel = ControlChannel(endpoints)
    try:
        return channel.call(message, wait)[1]
    except ProtocolMismatch as exc:
        _die(EXIT_MISMATCH, exc.message)
    except DaemonUnavailable as exc:
        _die(EXIT_NOT_RUNNING, exc.message)
    except GpuMemError as exc:
        _die(EXIT_ERROR, exc.message)
    finally:
        channel.close()


def _die(code: int, message: str) -> None:
    click.echo(f"gpumemctl: {message}", err=True)
    sys.exit(code)


@main.command()
@_target
@click.option("--json", "as_json", is_flag=True, help="One JSON object: daemon, device, clients, arenas, extents, leases.")
@click.pass_context
def status(ctx: click.Context, device: int | None, runtime_dir: str | None, timeout: float | None, as_json: bool) -> None:
    """Daemon, device, clients, arenas, extents and leases."""
    reply: p.StatusReply = _query(ctx, device, runtime_dir, timeout, p.Status())
    if as_json:
        click.echo(json.dumps(p.to_wire(reply), indent=2))
        return
    click.echo(render_status(reply))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    parts += [f"{minutes}m", f"{seconds}s"] if not days else [f"{minutes}m"]
    return "".join(parts)


def render_status(s: p.StatusReply) -> str:
    d, dev = s.daemon, s.device
    lines = [
        f"gpumemd {d.version} (protocol {d.protocol})  pid {d.pid}  backend {d.backend}  {d.state}, up {_duration(d.uptime_s)}",
        f"  runtime dir {d.runtime_dir}",
        f"device {dev.index}: {dev.name}  {dev.uuid}",
        f"  total {format_size(dev.total_bytes)}  free {format_size(dev.free_bytes)}  gpumemd holds "
        f"{format_size(dev.accounted_bytes)}  reserve {format_size(dev.reserve_bytes)}  granularity {format_size(dev.granularity)}",
        "",
        "CLIENTS",
    ]
    lines += _table(
        ["ID", "NAME", "PID", "UID", "SINCE", "ARENAS"],
        [
            [
                str(c.session_id),
                c.name,
                str(c.pid),
                str(c.uid),
                datetime.datetime.fromtimestamp(c.since).strftime("%Y-%m-%d %H:%M:%S"),
                ",".join(c.arenas) or "-",
            ]
            for c in s.clients
        ],
    )
    lines += ["", "ARENAS"]
    lines += _table(
        ["NAME", "OWNER", "RESERVED", "COMMITTED", "CHUNKS", "ADDRESS", "SHARED WITH", "ATTACHED", "RETIRING"],
        [
            [
                a.name,
                a.owner if a.owner_alive else f"{a.owner} (gone)",
                format_size(a.reserved),
                format_size(a.committed),
                str(a.chunks),
                f"{a.address:#x}",
                ",".join(a.shared_with) or "-",
                ",".join(a.attached) or "-",
                format_size(a.retiring_bytes) if a.retiring_bytes else "-",
            ]
            for a in s.arenas
        ],
    )
    lines += ["", "EXTENTS"] + _table([], []) if not s.extents else ["", "EXTENTS"] + [f"  {e}" for e in s.extents]
    lines += ["", "LEASES"] + _table([], []) if not s.leases else ["", "LEASES"] + [f"  {e}" for e in s.leases]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
