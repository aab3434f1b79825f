"""An engine's own server command run in-process on gpumemd (``python -m
gpumem.integrations.transformers_serve ...``): the ``--gpumem-*`` options its
``Settings`` come from, the rest left to the engine's own parser; the device option's
CUDA ordinal; the checks an engine that makes its port late (``transformers serve``
makes its manager at its first request) runs before it takes traffic; and a refusal
said in one line, not a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from gpumem.errors import GpuMemError
from gpumem.port.adapter import Unsupported
from gpumem.port.settings import Settings


def split(prog: str, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """gpumem's options (``gpumem_name``, ``gpumem_expect``) and the engine's arguments;
    with ``--help`` among those, gpumem's help first (the engine's follows)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, description="gpumem's options (the engine's own follow):")
    parser.add_argument("--gpumem-name", default="", metavar="NAME", help="the engine's client name (gpumemctl status; one per daemon)")
    parser.add_argument("--gpumem-expect", type=int, default=0, metavar="N", help="engines its KV round gathers (0: whoever reported by then)")
    args, rest = parser.parse_known_args(argv)
    if "--help" in rest:
        parser.print_help()
    return args, rest


def cuda_ordinal(device: str) -> int:
    """The CUDA ordinal an engine's device option names (``cuda``, ``cuda:N`` or ``N``);
    anything else (``cpu``, ``auto``: a model spread over devices or the host) refused."""
    ordinal = device.removeprefix("cuda").removeprefix(":") or "0"
    if not ordinal.isdigit():
        raise Unsupported(f"device '{device}': an engine on gpumemd holds its model on one CUDA device (cuda, cuda:N or N)")
    return int(ordinal)


def preflight(settings: Settings) -> None:
    """What the engine's port will need, checked now: a daemon answers for its device
    (``DaemonUnavailable`` says how to start one), no live session holds its name
    (``AlreadyExists``), the daemon's backend is CUDA and torch sees a CUDA device."""
    from gpumem.session import connect
    from gpumem.torch_support import import_torch

    session = connect(settings.device, settings.name, runtime_dir=settings.runtime_dir, tenant_token_file=settings.tenant_token_file)
    backend = session.backend
    session.close()
    if backend != "cuda":
        raise Unsupported(f"engine '{settings.name}' needs CUDA: the daemon of device {settings.device} runs the {backend} backend")
    if not import_torch("an engine on gpumemd").cuda.is_available():
        raise Unsupported(f"engine '{settings.name}' needs CUDA: torch sees no CUDA device (CUDA_VISIBLE_DEVICES, the driver)")


def run_command(prog: str, command: Callable[[], Any], argv: list[str], settings: Callable[[dict[str, Any]], Settings],
                enable: Callable[..., None]) -> int:
    """Run an engine's server command (a click command, made by ``command()``) in this
    process on ``argv``, its engine on gpumemd: once the command parsed its options
    (``settings`` refuses those gpumem cannot honour) and before it runs, ``preflight``
    and the integration's ``enable(name, device=, expect=)``. Click says its own usage
    errors and help; a gpumem error (a refusal, no daemon) or the engine's missing
    dependency is said in one line, exit status 2."""
    try:
        cmd = command()
        serve = cmd.callback

        def on_gpumemd(**params: Any) -> Any:
            s = settings(params)
            preflight(s)
            enable(s.name, device=s.device, expect=s.expect)
            return serve(**params)

        cmd.callback = on_gpumemd
        return int(cmd.main(argv, prog_name=prog) or 0)
    except (GpuMemError, ImportError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
