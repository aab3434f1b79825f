"""docs/protocol.md must agree with the gpumem_shared.protocol package: a renamed,
renumbered or new message type, error code or enum value, another reply type, changed
admission rules or a version bump fail here until the page follows."""

from __future__ import annotations

import re
from pathlib import Path

from gpumem_shared import protocol as p

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


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
