"""The README's first screen gets a newcomer going, and the docs say one thing: the
first five minutes stay short and name what a fresh shell needs; every status sample
shows the protocol the code speaks and the version it is; every daemon flag is
documented; every page the README sends to exists."""

from __future__ import annotations

import re
from pathlib import Path

from gpumem_shared import _version
from gpumem_shared import protocol as p
from gpumemd.cli import command

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in (ROOT / "docs").glob("*.md")}


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_first_five_minutes_lead_and_fit_a_screen() -> None:
    assert re.findall(r"^## (.*)$", README, re.M)[0] == "The first five minutes", "it comes first"
    first = _section(README, "The first five minutes")
    assert len(first.strip().splitlines()) <= 45, "the first five minutes outgrew a screen"
    for needed in ("scripts/daemon.sh", "scripts/test.sh", ". .venv/bin/activate", ".venv/bin/gpumemctl", "examples/host_quickstart.py"):
        assert needed in first, needed
    for page in re.findall(r"docs/[\w-]+\.md", first):
        assert (ROOT / page).is_file(), page


def test_every_status_sample_shows_the_protocol_and_version_the_code_has() -> None:
    """The README's sample said protocol 1.9 while the daemon spoke 1.11."""
    major, minor = p.PROTOCOL_VERSION
    samples = [(name, m) for name, text in [("README.md", README), *DOCS.items()] for m in re.finditer(r"gpumemd (\S+) \(protocol (\d+)\.(\d+)\)", text)]
    assert any(name == "README.md" for name, _ in samples), "the README shows no status sample"
    for name, m in samples:
        assert (m.group(1), int(m.group(2)), int(m.group(3))) == (_version.__version__, major, minor), f"{name}: {m.group(0)}"


def test_every_daemon_flag_is_documented() -> None:
    flags = [opt for param in command.params for opt in param.opts if opt.startswith("--") and opt not in ("--help", "--version")]
    docs = README + "".join(DOCS.values())
    assert [flag for flag in flags if flag not in docs] == []
    assert "--kv-chunk-size" in _section(DOCS["running.md"], "Running it"), "runtime KV moves need it: in the flag list"
