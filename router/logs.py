"""Structured logs: every line logged while a request is being served carries its request id.

The id lives in a context variable set by the frontend (gRPC or HTTP) for the request's task;
asyncio copies context into tasks the request starts, so background calls made for it log the id
too. `configure_logging` installs the filter and a text or JSON-lines format on the root logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="-")


@dataclass
class AccessEntry:
    """What a request's access-log line says beyond method, path, status and latency
    (router/access_log.py); filled in while the request is served."""

    request_id: str = "-"
    trace_id: str = "-"


# set by the access log's hooks for the request served on this task; None with the log off
access_entry: contextvars.ContextVar[Optional[AccessEntry]] = contextvars.ContextVar(
    "pdserve_access_entry", default=None
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    token = _request_id.set(request_id)
    entry = access_entry.get()
    if entry is not None:
        entry.request_id = request_id
    try:
        yield
    finally:
        _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
