"""``transformers serve`` on gpumemd: transformers' own ``serve`` command (made from its
``Serve`` by typer, as its CLI makes it), run in this process after ``enable()``.

    python -m gpumem.integrations.transformers_serve [--gpumem-name NAME] [--gpumem-expect N] \\
        MODEL --continuous-batching [transformers serve's own options]

Refused before a model loads (``Unsupported``), what serve would do otherwise than on
gpumemd: no ``--continuous-batching`` (it would generate with ``model.generate()`` and a
cache of its own); no MODEL (it would load models per request and unload them when idle:
one model per engine here); ``--cb-max-memory-percent`` (not read: the daemon's round
sizes the KV cache, ``--cb-num-blocks`` is its ceiling); a ``--device`` other than one
CUDA device (``cuda``, the default here, ``cuda:N`` or ``N``: transformers' ``auto`` may
spread a model over several devices or the host). Then the daemon, the engine's name
(default ``transformers-serve-PORT``) and CUDA are checked (gpumem.port.cli.preflight).
transformers makes its manager at the server's first request: the engine joins its KV
round then, so with ``--gpumem-expect 2`` each server's first request waits for the
other's (at most the daemon's ``--round-timeout``).

A folder of its own beside integrations/transformers/ (whose 250 code lines of glue over
the port, tests/unit/test_integration_sizes.py, were spent): a front-end to transformers'
server over that glue, with gpumem.port.cli's engine-agnostic parts under it.
"""

from __future__ import annotations

import sys
from typing import Any

from gpumem.integrations.transformers import WRITTEN_FOR, enable
from gpumem.port import SeamMissing, Settings, Unsupported, require_seams
from gpumem.port.cli import cuda_ordinal, run_command, split

PROG = "python -m gpumem.integrations.transformers_serve"
READ = ["force_model", "continuous_batching", "device", "cb_max_memory_percent", "port"]  # the options of serve read here


def serve_command() -> Any:
    """transformers' ``serve`` (a click command, as its CLI makes it), its options checked
    against ``READ``; serve's own first line refuses when its server's packages are missing."""
    try:
        import typer
        from transformers.cli.serve import Serve
    except ImportError as e:
        raise SeamMissing(f"transformers serve cannot be imported ({e}); gpumem's serve was written for transformers {WRITTEN_FOR}") from e
    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    command = typer.main.get_command(app)
    require_seams("transformers", type("transformers serve", (), {p.name: p for p in command.params}), READ, written_for=WRITTEN_FOR)
    return command


def settings(p: dict[str, Any], name: str, expect: int) -> Settings:
    """The engine's settings from serve's parsed options ``p``, refusing what gpumem
    cannot honour (module docstring)."""
    if not p["continuous_batching"] or not p["force_model"] or p["cb_max_memory_percent"] is not None:
        raise Unsupported("transformers serve on gpumemd takes --continuous-batching (its paged KV cache) and a MODEL (one model per "
                          "engine), and no --cb-max-memory-percent (the daemon's round sizes the KV cache; --cb-num-blocks caps it)")
    return Settings(name or f"transformers-serve-{p['port']}", device=cuda_ordinal(p["device"]), expect=expect)


def main(argv: list[str] | None = None) -> int:
    args, rest = split(PROG, sys.argv[1:] if argv is None else argv)
    rest += [] if any(a.split("=")[0] == "--device" for a in rest) else ["--device", "cuda"]  # serve's own default, auto: see above
    return run_command(PROG, serve_command, rest, lambda p: settings(p, args.gpumem_name, args.gpumem_expect), enable)
