"""gpumem.integrations.transformers_serve against the installed transformers serve (its
command line only: nothing here loads a model or needs a GPU): the seam checked, serve's
options parsed by serve's own command and those gpumem cannot honour refused in one line.
Skipped where transformers or typer is not installed."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "typer")), reason="needs transformers (and its typer)"
)

from gpumem.integrations import transformers_serve as ts  # noqa: E402
from gpumem.port import SeamMissing, Unsupported  # noqa: E402


def parsed(*argv: str) -> dict[str, Any]:
    command = ts.serve_command()
    return dict(command.make_context(ts.PROG, list(argv)).params)


def test_serve_command_is_transformers_own_with_the_options_read_here() -> None:
    p = parsed("/models/a", "--continuous-batching", "--port", "8001", "--cb-num-blocks", "64")
    assert (p["force_model"], p["continuous_batching"], p["port"], p["cb_num_blocks"], p["device"]) == ("/models/a", True, 8001, 64, "auto")


def test_a_moved_option_is_a_missing_seam_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts, "READ", [*ts.READ, "gpu_memory_fraction"])
    with pytest.raises(SeamMissing, match=r"transformers 5\.\d+.*transformers serve has no gpu_memory_fraction.*written for transformers 5\.17"):
        ts.serve_command()


@pytest.mark.parametrize("argv", [["/models/a"], ["--continuous-batching"], ["/models/a", "--continuous-batching", "--cb-max-memory-percent", "0.5"]],
                         ids=["no-continuous-batching", "no-model", "max-memory-percent"])
def test_what_gpumem_cannot_honour_is_refused(argv: list[str]) -> None:
    with pytest.raises(Unsupported, match="--continuous-batching .* a MODEL .* no --cb-max-memory-percent"):
        ts.settings(parsed(*argv), "", 0)


def test_settings_name_device_and_expect() -> None:
    s = ts.settings(parsed("/models/a", "--continuous-batching", "--port", "8001", "--device", "cuda:1"), "", 2)
    assert (s.name, s.device, s.expect) == ("transformers-serve-8001", 1, 2)
    assert ts.settings(parsed("/models/a", "--continuous-batching", "--device", "0"), "mine", 0).name == "mine"
    with pytest.raises(Unsupported, match="device 'auto'"):
        ts.settings(parsed("/models/a", "--continuous-batching"), "", 0)  # serve's own default: main() passes cuda instead


def test_main_refuses_in_one_line_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert ts.main(["/no/such/model", "--device", "auto", "--continuous-batching"]) == 2
    assert capsys.readouterr().err == f"{ts.PROG}: device 'auto': an engine on gpumemd holds its model on one CUDA device (cuda, cuda:N or N)\n"
    assert ts.main(["/no/such/model"]) == 2
    assert "takes --continuous-batching" in capsys.readouterr().err


def test_help_shows_gpumems_options_then_serves(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ts.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.index("--gpumem-expect") < out.index("OpenAI compatible API"), out
