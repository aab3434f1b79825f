"""gpumem.port.cli without an engine: gpumem's options split from the engine's, the device
option's CUDA ordinal, and an engine's server command run over a stand-in for a click
command: the order of settings, checks, ``enable`` and the command's own callback, and
refusals said in one line (exit status 2) before the command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumem.port import Settings, Unsupported
from gpumem.port import cli


class Command:
    """What run_command uses of a click command: ``callback`` and ``main``, which parses
    ``--k=v`` pairs into the callback's keywords."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.callback = lambda **params: calls.append(f"serve {sorted(params.items())}")

    def main(self, argv: list[str], prog_name: str) -> int:
        self.callback(**dict(a.removeprefix("--").split("=", 1) for a in argv))
        return 0


def test_split_leaves_the_engine_its_own_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args, rest = cli.split("prog", ["MODEL", "--gpumem-name", "a", "--port", "8001", "--gpumem-expect=2"])
    assert (args.gpumem_name, args.gpumem_expect, rest) == ("a", 2, ["MODEL", "--port", "8001"])
    args, rest = cli.split("prog", ["--help"])
    assert rest == ["--help"] and "--gpumem-expect" in capsys.readouterr().out  # gpumem's help first; the engine's follows


@pytest.mark.parametrize(("device", "ordinal"), [("cuda", 0), ("cuda:1", 1), ("3", 3)])
def test_cuda_ordinal(device: str, ordinal: int) -> None:
    assert cli.cuda_ordinal(device) == ordinal


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda:x", "mps"])
def test_cuda_ordinal_refuses_anything_but_one_cuda_device(device: str) -> None:
    with pytest.raises(Unsupported, match=f"device '{device}'.*one CUDA device"):
        cli.cuda_ordinal(device)


def test_run_command_checks_and_enables_before_the_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cli, "preflight", lambda s: calls.append(f"preflight {s.name}"))

    def settings(params: dict[str, Any]) -> Settings:
        calls.append("settings")
        return Settings(f"engine-{params['port']}", device=1, expect=2)

    def enable(name: str, **options: Any) -> None:
        calls.append(f"enable {name} {sorted(options.items())}")

    assert cli.run_command("prog", lambda: Command(calls), ["--port=8001"], settings, enable) == 0
    assert calls == ["settings", "preflight engine-8001", "enable engine-8001 [('device', 1), ('expect', 2)]", "serve [('port', '8001')]"]


def test_a_refused_option_is_one_line_and_the_command_never_runs(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def settings(params: dict[str, Any]) -> Settings:
        raise Unsupported("--x: not on gpumemd")

    assert cli.run_command("prog", lambda: Command(calls), ["--x=1"], settings, lambda name, **o: calls.append("enable")) == 2
    assert calls == [] and capsys.readouterr().err == "prog: --x: not on gpumemd\n"


def test_no_daemon_is_refused_before_enable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real preflight against an empty runtime directory: DaemonUnavailable, said in
    one line with how to start one; nothing enabled, the command never runs."""
    calls: list[str] = []
    status = cli.run_command("prog", lambda: Command(calls), ["--port=1"], lambda p: Settings("e", runtime_dir=str(tmp_path)),
                             lambda name, **o: calls.append("enable"))
    err = capsys.readouterr().err
    assert status == 2 and calls == [], err
    assert err.startswith("prog: no gpumemd serves device 0") and "start" in err and err.count("\n") == 1, err


def test_a_missing_engine_dependency_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def command() -> Any:
        raise ImportError("Missing dependencies for serving. Install with `pip install transformers[serving]`")

    assert cli.run_command("prog", command, [], lambda p: Settings("e"), lambda name, **o: None) == 2
    assert capsys.readouterr().err == "prog: Missing dependencies for serving. Install with `pip install transformers[serving]`\n"
