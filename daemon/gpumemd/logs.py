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

from gpumem_shared import protocol as p

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


class SessionThrottle:
    """Warnings any client can provoke at will (a refused ADOPT: a wrong secret, another
    uid's group), at most one line per session every ``every`` seconds: the first
    written, the rest counted, and the session's next line says how many went unwritten.
    A log a client fills at will hides what matters and fills the disk."""

    # Sessions remembered before those quiet for a window are summed up and forgotten.
    REMEMBERED = 256

    def __init__(self, log: logging.Logger, every: float = 5.0) -> None:
        self.log = log
        self.every = every
        self._seen: dict[int, list[float]] = {}  # session id -> [when its last line went, lines unwritten since]

    def warning(self, session: int, now: float, msg: str, *args: object) -> None:
        seen = self._seen.get(session)
        if seen is not None and now - seen[0] < self.every:
            seen[1] += 1
            return
        if seen is not None and seen[1]:
            msg += " (%d more like it from session %d in the %.1fs before, not logged)"
            args = (*args, int(seen[1]), session, now - seen[0])
        self.log.warning(msg, *args)
        if len(self._seen) >= self.REMEMBERED:
            self._forget_quiet(now)
        self._seen[session] = [now, 0]

    def _forget_quiet(self, now: float) -> None:
        for session, (when, unwritten) in list(self._seen.items()):
            if now - when >= self.every:
                if unwritten:
                    self.log.warning("%d more like it from session %d, not logged", int(unwritten), session)
                del self._seen[session]


# A request's size, for its debug line: the first of these fields it has.
_SIZE_FIELDS = ("nbytes", "to_nbytes", "reserve_bytes", "slot_bytes", "tokens")


def log_request(log: logging.Logger, frame: bytes | memoryview, reply: bytes | None, client: str, name: str, micros: float) -> None:
    """The debug line of one control request: its type, client, size, outcome, and the
    time the daemon took for it (decode to encoded reply) in µs. Decoding again costs
    only at debug, where the server calls this."""
    size: dict[str, int] = {}
    try:
        request = p.decode_request(frame)
        kind, request_id = request.message.TYPE.name, request.request_id
        field = next((f for f in _SIZE_FIELDS if hasattr(request.message, f)), None)
        if field is not None:
            size[field] = getattr(request.message, field)
    except p.ProtocolError:
        kind, request_id = "undecodable", 0
    if reply is None:
        outcome = "deferred"
    else:
        answer = p.decode_reply(reply)
        outcome = "ok" if answer.ok else answer.code.name
    log.debug(
        "request %d %s from %s%s: %s in %.0f µs",
        request_id, kind, client, "".join(f", {k} {v}" for k, v in size.items()), outcome, micros,
        extra={
            "figures": {
                "request_id": request_id, "type": kind, "client": name, **size,
                "frame_bytes": len(frame), "outcome": outcome, "micros": round(micros, 1),
            }
        },
    )
