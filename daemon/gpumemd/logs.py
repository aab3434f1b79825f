"""gpumemd's log lines, as text or as one JSON object per line.

Text lines carry a timestamp unless stderr is the journal, which stamps every line
itself. JSON lines always do: whoever parses them wants the time as a field. A line
whose call passed ``extra={"figures": {...}}`` (refusals, reclaims, rounds, each
request at debug) carries those figures as a JSON object; in text, the message says
them already.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        figures = getattr(record, "figures", None)
        if figures:
            entry["figures"] = figures
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def under_journald() -> bool:
    """Whether stderr is the journal (systemd sets JOURNAL_STREAM to its device:inode)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def configure(level: str, fmt: LogFormat = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        text = "%(levelname)s %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter(text if under_journald() else "%(asctime)s " + text))
    logging.basicConfig(level=level.upper(), handlers=[handler])
