"""docs/protocol.md must agree with gpumem_shared/protocol.py: a renamed, renumbered or new
message type or error code, or a version bump, fails here until the page follows."""

from __future__ import annotations

import re
from pathlib import Path

from gpumem_shared import protocol as p

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def _table_rows(heading: str) -> dict[int, str]:
    section = DOC.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| ([A-Z_]+) \|", section, re.M)}


def test_version_is_documented() -> None:
    major, minor = p.PROTOCOL_VERSION
    assert f"Current version: **{major}.{minor}**" in DOC
    assert f'"v": [{major}, {minor}]' in DOC


def test_every_message_type_is_documented() -> None:
    assert _table_rows("Message types") == {int(t): t.name for t in p.MsgType}


def test_every_error_code_is_documented() -> None:
    assert _table_rows("Error codes") == {int(c): c.name for c in p.ErrorCode}
