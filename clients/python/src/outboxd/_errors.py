"""Exceptions: what a handler raises to say how an intent failed, and what the SDK raises."""

from __future__ import annotations

import datetime as dt
import math
import numbers
from typing import Optional, Union

import grpc

# The longest `retry_after` the server accepts by default (OUTBOX_LIMITS__MAX_DELAY).
MAX_RETRY_AFTER = 366 * 86400.0


def retry_seconds(after: object) -> float:
    """`Retry(after=...)` in seconds: a number or a `datetime.timedelta`, finite and not
    negative (ValueError), at most `MAX_RETRY_AFTER` (longer is cut to it)."""
    if isinstance(after, dt.timedelta):
        seconds = after.total_seconds()
    elif isinstance(after, numbers.Integral) and not isinstance(after, bool):
        # Cut first: an int may be past a float's range.
        seconds = float(max(-1, min(int(after), int(MAX_RETRY_AFTER))))
    elif isinstance(after, numbers.Real):
        seconds = float(after)
    else:
        raise TypeError(f"Retry(after=...) takes seconds or a datetime.timedelta, not {type(after).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"Retry(after=...) must be finite and not negative, not {after!r}")
    return min(seconds, MAX_RETRY_AFTER)


class Retry(Exception):
    """Raised by a handler: the side effect did not happen; try again later.

    `after` (seconds, or a `datetime.timedelta`) overrides the server's exponential backoff
    for this retry; past 366 days (the server's longest delay) it is cut to 366 days, and
    NaN, infinity or a negative delay raise ValueError. After the intent's last attempt the
    server dead-letters it instead.
    """

    def __init__(self, message: str = "retry requested", *, after: Union[float, dt.timedelta, None] = None) -> None:
        super().__init__(message)
        self.after: Optional[float] = None if after is None else retry_seconds(after)


class Permanent(Exception):
    """Raised by a handler: the side effect did not happen and never will. Dead-letters now."""


class Unknown(Exception):
    """Raised by a handler: the side effect may or may not have happened.

    The intent goes to NEEDS_RECONCILE for an operator. Any other exception raised once
    MarkSubmitted succeeded (on entering `intent.submitting()`) means this already; raise
    it to say so explicitly.
    """


class LeaseLost(Exception):
    """The worker's lease on the intent is gone (expired and rescued, or re-leased).

    Raised by `intent.submitting()` when MarkSubmitted is refused, or its answer came after
    the lease was lost or given back at shutdown, so the external call is never started on
    a lease someone else may hold. Nothing is reported for the intent by the handler.
    """


class TransactionRequired(RuntimeError):
    """`Outbox.enqueue(conn, ...)` was called with no open transaction on `conn`.

    Never falls back to direct mode: use `enqueue_direct` for that, explicitly.
    """


class OutboxError(Exception):
    """outboxd refused a call, or no answer came within the call's budget.

    `code` is the gRPC status code, `reason` the stable `google.rpc.ErrorInfo` reason
    (e.g. `TXN_ABORTED`, `IDEMPOTENCY_CONFLICT`; empty for transport errors).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        # No reason: the transport's error, not the server's word (whose UNAVAILABLE
        # reason means nothing was written).
        super().__init__(f"{code.name}/{reason}: {message}" if reason else f"{code.name}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> OutboxError:
        """Wraps a grpc error (sync or asyncio), reading the ErrorInfo reason if any."""
        code, reason, message = describe(error)
        return cls(code, reason, message)


def describe(error: grpc.RpcError) -> tuple[grpc.StatusCode, str, str]:
    """The code, ErrorInfo reason and message of a failed call."""
    code_of = getattr(error, "code", None)
    code = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
    details_of = getattr(error, "details", None)
    message = (details_of() if callable(details_of) else None) or ""
    trailers_of = getattr(error, "trailing_metadata", None)
    trailers = trailers_of() if callable(trailers_of) else None
    reason = ""
    for key, value in trailers or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            reason = error_info_reason(value)
    return code, reason, message


def _fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """Decodes one level of protobuf wire format: (field number, wire type, value)."""
    out: list[tuple[int, int, bytes | int]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, wire, varint()))
        elif wire == 2:
            n = varint()
            out.append((number, wire, data[i : i + n]))
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            break
    return out


def error_info_reason(status_bin: bytes) -> str:
    """The reason of the first google.rpc.ErrorInfo in a serialized google.rpc.Status.

    Decoded by hand so the SDK needs no googleapis-common-protos: Status.details (3) are
    Any {type_url (1), value (2)}, ErrorInfo.reason is field 1.
    """
    try:
        for number, _, value in _fields(status_bin):
            if number != 3 or not isinstance(value, bytes):
                continue
            any_fields = {n: v for n, _, v in _fields(value)}
            type_url = any_fields.get(1, b"")
            if isinstance(type_url, bytes) and type_url.endswith(b"google.rpc.ErrorInfo"):
                for n, _, v in _fields(bytes(any_fields.get(2, b""))):
                    if n == 1 and isinstance(v, bytes):
                        return v.decode()
    except (IndexError, UnicodeDecodeError):
        pass
    return ""
