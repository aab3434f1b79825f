"""docs/protocol.md must agree with the gpumem_shared.protocol package: a renamed,
renumbered or new message type, error code or enum value, another reply type, changed
admission rules or a version bump fail here until the page follows. docs/architecture.md's
module map must name every module the layering test places (a new, renamed or removed
module fails here until the map follows)."""

from __future__ import annotations

import re
from pathlib import Path

from gpumem_shared import protocol as p

from .test_layering import CLIENT_LAYERS, DAEMON_LAYERS, PACKAGES

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _section(heading: str) -> str:
    return DOC.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]


def _table_rows(heading: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| ([A-Z_]+) \|", _section(heading), re.M)}


def test_version_is_documented() -> None:
    major, minor = p.PROTOCOL_VERSION
    assert f"Current version: **{major}.{minor}**" in DOC
    assert f'"v": [{major}, {minor}]' in DOC
    assert f"Changes in {major}.{minor}:" in DOC


def test_every_message_type_is_documented() -> None:
    assert _table_rows("Message types") == {int(t): t.name for t in p.MsgType}


def test_every_request_row_names_its_reply_type() -> None:
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| [A-Z_]+ \| [^|]+ \| [^|]+ \| `(\w+)`", _section("Message types"), re.M)}
    assert rows == {number: cls.REPLY.__name__ for number, cls in p.REQUESTS.items()}


def test_every_error_code_is_documented() -> None:
    assert _table_rows("Error codes") == {int(c): c.name for c in p.ErrorCode}


def test_every_string_enum_is_documented_with_its_values() -> None:
    rows = {m.group(1): m.group(2).split(", ") for m in re.finditer(r"^\| `(\w+)` \| ([a-z, -]+) \|", _section("String enums"), re.M)}
    enums = [p.Backend, p.RoundState, p.RoundPolicy, p.NoticeKind, p.RetainState]
    assert rows == {e.__name__: [member.value for member in e] for e in enums}


def test_admission_rules_are_documented() -> None:
    def names(chosen: list[int]) -> str:
        listed = [p.MsgType(n).name for n in sorted(chosen)]
        return ", ".join(listed[:-1]) + " and " + listed[-1]

    text = " ".join(DOC.split())
    anonymous = [n for n, cls in p.REQUESTS.items() if not cls.NEEDS_SESSION]
    stopping = [n for n, cls in p.REQUESTS.items() if cls.WHILE_STOPPING]
    assert f"`NEEDS_SESSION` (false only for {names(anonymous)}," in text
    assert f"`WHILE_STOPPING` (true only for {names(stopping)}:" in text


def mapped(package: str) -> set[str]:
    """The modules docs/architecture.md's map of ``package`` gives an entry: the names in
    each top-level item's head (before its dash), ``name.py`` a module and ``name/`` a
    package by its folder."""
    section = ARCHITECTURE.split(f"\n### {package}:", 1)[1].split("\n#", 1)[0]
    heads = [line[2:].split(" — ", 1)[0] for line in section.splitlines() if line.startswith("- `")]
    return {m.group(1) for head in heads for m in re.finditer(r"`(\w+)(?:\.py|/)`", head)}


# Each package's own files, not modules of the map's.
UNMAPPED = {"__init__", "__main__"}


def test_the_module_map_names_every_daemon_module_and_only_those() -> None:
    assert set(DAEMON_LAYERS) - UNMAPPED - mapped("gpumemd") == set(), "in DAEMON_LAYERS but not in docs/architecture.md's map"
    assert {m for m in mapped("gpumemd") if not (PACKAGES["gpumemd"] / f"{m}.py").is_file()} == set(), "mapped, but no such module"


def test_the_module_map_names_every_client_module_and_only_those() -> None:
    assert set(CLIENT_LAYERS) - UNMAPPED - mapped("gpumem") == set(), "in CLIENT_LAYERS but not in docs/architecture.md's map"
    root = PACKAGES["gpumem"]
    missing = {m for m in mapped("gpumem") if not ((root / f"{m}.py").is_file() or (root / m / "__init__.py").is_file())}
    assert missing == set(), "mapped, but no such module"
