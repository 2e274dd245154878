"""W3C trace context (`traceparent`), parsed without OpenTelemetry: the access log names a request's
trace whether or not tracing is on, and a message carries its context as this one short string."""

from __future__ import annotations

import re
from typing import Optional

# version-traceid-parentid-flags; all-zero ids are invalid (W3C Trace Context, section 3.2)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def trace_id_of(traceparent: Optional[str]) -> Optional[str]:
    """The trace id of a valid `traceparent`, else None."""
    if not traceparent:
        return None
    match = _TRACEPARENT.match(traceparent.strip().lower())
    if match is None or match[1] == "ff":
        return None
    version, trace_id, parent_id, _ = match.groups()
    if set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return trace_id
