"""``gpumemctl``: look at a running gpumemd.

Exit status follows the LSB status convention: 0 ok, 1 error (this user may not open
the daemon's sockets, among others), 3 no daemon answers, 4 the daemon speaks another
protocol major.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn, TextIO

import click

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints, daemon_alive
from gpumem.control import ControlChannel, check_access
from gpumem.ctl_render import render_arenas, render_graph_pools, render_kv, render_leases, render_rounds, render_status, render_top
from gpumem.discovery import live_daemons, resolve_device, runtime_dirs
from gpumem.errors import DaemonUnavailable, DeviceAmbiguous, GpuMemError, ProtocolMismatch, SocketPermissionDenied

EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_MISMATCH = 1, 3, 4
# Where the NVIDIA kernel driver says it is loaded (gpumemctl loads no CUDA to find out).
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
UNIT_FOLDERS = (Path("/etc/systemd/system"), Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
# What the unit's sandbox hides from the daemon it starts: a gpumemd (or its Python, or
# its package) installed there does not start (status 203/EXEC, or an import error).
HIDDEN_BY_UNIT = {
    Path("/tmp"): "PrivateTmp=", Path("/var/tmp"): "PrivateTmp=",
    Path("/home"): "ProtectHome=", Path("/root"): "ProtectHome=", Path("/run/user"): "ProtectHome=",
}


def _target(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.option(
                "--device", "-d", default=None, help="Device index, or GPU UUID (or a unique prefix of it) [default: 0]."
            ),
            click.option("--runtime-dir", default=None, help="Daemon socket directory [default: as gpumemd]."),
            click.option("--timeout", type=float, default=None, help="Seconds to wait for the daemon [default: 5]."),
        ]
    ):
        command = option(command)
    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpumemd", prog_name="gpumemctl")
@_target
@click.pass_context
def main(ctx: click.Context, device: str | None, runtime_dir: str | None, timeout: float | None) -> None:
    """Inspect gpumemd: clients, arenas, graph pools, leases, KV commit rounds and KV pools."""
    ctx.obj = {"device": device, "runtime_dir": runtime_dir, "timeout": timeout}


def _query(ctx: click.Context, device: str | None, runtime_dir: str | None, timeout: float | None, message: Any) -> Any:
    group = ctx.obj
    chosen = device if device is not None else group["device"]
    try:
        # gpumemctl loads no CUDA: an index is the daemon's own, not a CUDA ordinal.
        endpoints = resolve_device(chosen if chosen is not None else 0, runtime_dir or group["runtime_dir"], cuda_ordinal=False)
    except DeviceAmbiguous as exc:
        _die(EXIT_ERROR, exc.message)
    except DaemonUnavailable as exc:
        # What the library found, with how to start a daemon on this machine in place of
        # its generic advice (written for engines, which cannot look at the machine).
        shown = "0" if chosen is None else str(chosen)
        found = exc.message.split("; start it with", 1)[0]
        _die(EXIT_NOT_RUNNING, f"{found}; {start_hint(shown if shown.isdigit() else '<index>')}")
    index = endpoints.index
    wait = timeout if timeout is not None else (group["timeout"] if group["timeout"] is not None else 5.0)
    try:
        check_access(endpoints.zmq_path)
    except SocketPermissionDenied as exc:
        _die(EXIT_ERROR, exc.message)
    if not endpoints.zmq_path.exists() or not daemon_alive(endpoints):
        _die(EXIT_NOT_RUNNING, f"no gpumemd serves device {index}: no live daemon behind {endpoints.zmq_path}; {start_hint(str(index))}")
    try:
        return _ask(endpoints, message, wait)
    except ProtocolMismatch as exc:
        _die(EXIT_MISMATCH, exc.message)
    except DaemonUnavailable as exc:
        _die(EXIT_NOT_RUNNING, exc.message)
    except GpuMemError as exc:
        _die(EXIT_ERROR, exc.message)


def start_hint(index: str) -> str:
    """How to start the missing daemon on this machine: the host backend where there is no
    NVIDIA driver, the unit where one is installed, else by hand."""
    if not NVIDIA_DRIVER.exists():
        start = f"no NVIDIA GPU here, so start one on host memory: gpumemd --device {index} --backend host --host-capacity 8GiB"
    elif any((folder / "gpumemd@.service").exists() for folder in UNIT_FOLDERS):
        start = f"start it: systemctl start gpumemd@{index}"
    else:
        start = f"start it: gpumemd --device {index} (or install the unit: gpumemctl unit)"
    return f"{start}; for a daemon serving elsewhere, give --runtime-dir or set $GPUMEMD_RUNTIME_DIR"


def _ask(endpoints: Endpoints, message: p.RequestMessage, wait: float) -> Any:
    channel = ControlChannel(endpoints)
    try:
        return channel.call(message, wait)
    finally:
        channel.close()


def _die(code: int, message: str) -> NoReturn:
    click.echo(f"gpumemctl: {message}", err=True)
    sys.exit(code)


@main.command()
@_target
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object: daemon, device, clients, arenas, graph_pools (also as extents, deprecated), leases, rounds, kv.",
)
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Every daemon in the runtime directory, one per device (JSON: a list); those this user may not reach are "
    "named on stderr, and then the exit status is 1.",
)
@click.pass_context
def status(
    ctx: click.Context, device: str | None, runtime_dir: str | None, timeout: float | None, as_json: bool, every: bool
) -> None:
    """Daemon, device, clients, arenas, graph pools, leases, KV commit rounds and KV pools."""
    if not every:
        reply: p.StatusReply = _query(ctx, device, runtime_dir, timeout, p.Status())
        click.echo(json.dumps(p.to_wire(reply), indent=2) if as_json else render_status(reply))
        return
    if device is not None or ctx.obj["device"] is not None:
        _die(EXIT_ERROR, "--all asks every daemon; leave out --device")
    dirs = runtime_dirs(runtime_dir or ctx.obj["runtime_dir"])
    found = [Endpoints(directory, d["index"]) for directory in dirs for d in live_daemons(directory)]
    wait = timeout if timeout is not None else (ctx.obj["timeout"] if ctx.obj["timeout"] is not None else 5.0)
    replies, refused = [], []
    for endpoints in found:
        try:
            replies.append(_ask(endpoints, p.Status(), wait))
        except SocketPermissionDenied as exc:  # named; the daemons this user may reach still answer
            refused.append(f"gpumemctl: device {endpoints.index} ({endpoints.runtime_dir}): {exc.message}")
        except DaemonUnavailable as exc:  # it stopped since: the others still answer
            click.echo(f"gpumemctl: device {endpoints.index} ({endpoints.runtime_dir}): {exc.message}", err=True)
    if not replies and not refused:
        where = " or ".join(str(d) for d in dirs)
        _die(EXIT_NOT_RUNNING, f"no live gpumemd in {where}: one per GPU; {start_hint('<index>')}")
    if as_json:
        click.echo(json.dumps([p.to_wire(r) for r in replies], indent=2))
    elif replies:
        click.echo("\n\n".join(f"=== device {r.device.index} ({r.device.uuid}) ===\n{render_status(r)}" for r in replies))
    for line in refused:
        click.echo(line, err=True)
    if refused:
        sys.exit(EXIT_ERROR)


def _list_view(
    name: str, title: str, select: Callable[[p.StatusReply], list[Any]], render: Callable[[p.StatusReply], list[str]], doc: str
) -> None:
    """``gpumemctl NAME [--json]``: one list of the status, as a table or as JSON."""

    @main.command(name=name, help=doc)
    @_target
    @click.option("--json", "as_json", is_flag=True, help=f"The status's {title.lower()} list as JSON.")
    @click.pass_context
    def view(ctx: click.Context, device: str | None, runtime_dir: str | None, timeout: float | None, as_json: bool) -> None:
        reply: p.StatusReply = _query(ctx, device, runtime_dir, timeout, p.Status())
        if as_json:
            click.echo(json.dumps(p.to_wire(select(reply)), indent=2))
            return
        click.echo("\n".join([title] + render(reply)))


_list_view(
    "rounds", "ROUNDS", lambda s: s.rounds, render_rounds, "KV commit rounds: members, what each reported, and the budget math."
)
_list_view("kv", "KV", lambda s: s.kv, render_kv, "KV pools: layout, committed tokens and bytes, pending shrink requests.")
_list_view(
    "graph-pools",
    "GRAPH POOLS",
    lambda s: s.graph_pools,
    lambda s: render_graph_pools(s, runs=True),
    "Graph pools: owner, extents, free runs, bytes free, epoch, repairs of their lease slots.",
)
# The command's name before graph pools had one name everywhere: scripts keep working.
_list_view(
    "extents",
    "GRAPH POOLS",
    lambda s: s.graph_pools,
    lambda s: render_graph_pools(s, runs=True),
    "The old name of graph-pools, kept so scripts keep working.",
)
_list_view("arenas", "ARENAS", lambda s: s.arenas, render_arenas, "Arenas: owner, sizes, grants (never their tokens), attached clients.")
_list_view("leases", "LEASES", lambda s: s.leases, render_leases, "Leases held on graph pools: kind, holder, pid, label, since.")


# ---------------------------------------------------------------------------- top

# ANSI: cursor home, clear to the end of the line, clear below, hide and show the
# cursor. Any terminal (and tmux, screen, a serial console) knows these; no curses.
_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def _top_loop(fetch: Callable[[], p.StatusReply], interval: float, count: int, out: TextIO) -> None:
    """Redraw a frame in place every ``interval`` seconds (``count`` frames, 0: until
    Ctrl-C). Not on a terminal, frames follow each other, as top's batch mode."""
    tty = out.isatty()
    before: p.StatusReply | None = None
    frames = 0
    if tty:
        out.write(_HIDE_CURSOR)
    try:
        while True:
            try:
                reply = fetch()
                lines = render_top(reply, before, time.time())
                before = reply
            except GpuMemError as exc:  # the daemon stopped or restarted: say so, keep trying
                lines = [f"gpumemctl top: {exc.message}", "", f"trying again every {interval:g}s (Ctrl-C quits)"]
            if tty:
                size = shutil.get_terminal_size()
                shown = [line[: size.columns] for line in lines[: max(size.lines - 1, 1)]]
                out.write(_HOME + "".join(line + _CLEAR_LINE + "\n" for line in shown) + _CLEAR_BELOW)
            else:
                out.write("\n".join(lines) + "\n\n")
            out.flush()
            frames += 1
            if count and frames >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if tty:
            out.write(_SHOW_CURSOR)
            out.flush()


@main.command()
@_target
@click.option("--once", is_flag=True, help="Print one frame, plainly, and exit (for scripts).")
@click.option("--interval", "-n", type=click.FloatRange(min=0.05), default=1.0, show_default=True, help="Seconds between frames.")
@click.option("--count", "-c", type=click.IntRange(min=0), default=0, help="Stop after this many frames [default: 0, until Ctrl-C].")
@click.pass_context
def top(ctx: click.Context, device: str | None, runtime_dir: str | None, timeout: float | None, once: bool, interval: float, count: int) -> None:
    """Live view of clients, arenas, committed bytes, leases and their holders, KV rounds."""
    first: p.StatusReply = _query(ctx, device, runtime_dir, timeout, p.Status())  # no daemon: fail as status does
    if once:
        click.echo("\n".join(render_top(first, None, time.time())))
        return
    # Live: once started, a daemon that goes away is shown in the frame, not an exit.
    chosen = device if device is not None else ctx.obj["device"]
    endpoints = resolve_device(chosen if chosen is not None else 0, runtime_dir or ctx.obj["runtime_dir"], cuda_ordinal=False)
    wait = timeout if timeout is not None else (ctx.obj["timeout"] if ctx.obj["timeout"] is not None else 5.0)
    _top_loop(lambda: _ask(endpoints, p.Status(), wait), interval, count, sys.stdout)


# ---------------------------------------------------------------------------- unit


def _installed_gpumemd() -> str | None:
    """The gpumemd installed with this gpumemctl: beside it, else in its Python's
    scripts directory (``python -m gpumem.ctl``), else on PATH."""
    for folder in (Path(sys.argv[0]).absolute().parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "gpumemd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("gpumemd")
    return str(Path(found).absolute()) if found else None


def _interpreter(script: Path) -> list[Path]:
    """The interpreter a script's #! line names (a console script's Python), if any."""
    try:
        with script.open("rb") as f:
            first = f.readline(4096)
    except OSError:
        return []
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    return [Path(words[0])] if words and os.path.isabs(words[0]) else []


def _hidden_from_unit(paths: list[Path]) -> str | None:
    """Why the unit's daemon would not start from these files (where its sandbox hides
    them), or None."""
    for path in paths:
        real = path.resolve()
        for folder, line in HIDDEN_BY_UNIT.items():
            if real.is_relative_to(folder):
                named = str(path) if real == path else f"{path} ({real})"
                return (f"{named} lies in {folder}, which the unit's {line} hides from the daemon: "
                        f"systemd would not start gpumemd@ from this install")
    return None


def _exec_path(path: str) -> str:
    """``path`` as the first word of ExecStart: % starts a specifier there, and a path
    with blanks or quotes needs quoting."""
    path = path.replace("%", "%%")
    if re.search(r"[\s\"'\\]", path):
        path = '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return path


@main.command()
@click.option("--gpumemd", "executable", default=None, help="The gpumemd ExecStart runs [default: the one installed with gpumemctl].")
def unit(executable: str | None) -> None:
    """Print the systemd template unit gpumemd@.service, its ExecStart naming the
    installed gpumemd: gpumemctl unit > /etc/systemd/system/gpumemd@.service"""
    path = executable or _installed_gpumemd()
    if path is None:
        _die(EXIT_ERROR, f"no gpumemd installed beside {sys.argv[0]}, in {sysconfig.get_path('scripts')} or on PATH; name it with --gpumemd")
    if not os.path.isabs(path):
        _die(EXIT_ERROR, f"--gpumemd {path}: systemd needs an absolute path")
    mine = [Path(sys.prefix), Path(sys.executable), Path(__file__)] if executable is None else []
    hidden = _hidden_from_unit([Path(path), *_interpreter(Path(path)), *mine])
    if hidden and executable is None:
        _die(EXIT_ERROR, f"{hidden}; install gpumemd elsewhere (a venv in /opt, or /usr/local), or name one with --gpumemd")
    if hidden:
        click.echo(f"gpumemctl: warning: {hidden}, unless a drop-in lifts that line", err=True)
    text = importlib.resources.files("gpumem").joinpath("gpumemd@.service").read_text()
    click.echo(re.sub(r"^ExecStart=\S+", lambda _: "ExecStart=" + _exec_path(path), text, count=1, flags=re.MULTILINE), nl=False)


if __name__ == "__main__":
    main()
