"""Where a call sits in a call chain: the ``retryd.lineage`` baggage member (docs/lineage.md).

A fleet is call chains, and if every layer retries a failure deep in the
chain, the attempts multiply per hop. retryd lets the layer nearest the
failure retry it and denies the layers above, which needs two facts on
each Decide: the lineage of the request being served (``edge:2/middle:1``,
outermost first) and whether the failed response says it was already
retried below (``retryd-retried: <layer>``).

This module holds both ends of that:

- the lineage of the request being served lives in a
  :class:`contextvars.ContextVar`, set by the inbound middleware
  (:class:`retryd.asgi.LineageMiddleware`, the gRPC server interceptors in
  :mod:`retryd.grpc`) or by :func:`serving` for any other framework;
- the outbound adapters read it with no code from the caller: each attempt
  carries ``<lineage>/<layer>:<attempt>`` in its ``baggage``, each Decide
  the lineage and the failed response's ``retryd-retried``, and a call that
  ends in failure after retryd's decision is recorded in the same context,
  so that the middleware marks the handler's failed response.

The state is one mutable object per inbound request: a context copied into
a task or a thread (``asyncio.to_thread``, Starlette's threadpool) shares
it, so a failure recorded there is seen by the middleware.
"""

from __future__ import annotations

import contextvars
import os
import re
import sys
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

#: The W3C baggage member carrying the lineage.
MEMBER = "retryd.lineage"
#: The HTTP response header and gRPC trailer saying "this layer already retried (or was denied)".
RETRIED_HEADER = "retryd-retried"
#: The gRPC trailer sent beside it, so that a plain gRPC client (gRFC A6) does not retry either.
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"
#: The limits of a lineage (docs/lineage.md); retryd rejects a Decide beyond them.
MAX_ENTRIES = 32
MAX_BYTES = 1024
MAX_ATTEMPT = 1000
#: The layer name of the first entry standing for outermost entries dropped to fit the limits.
ELIDED = "..."

_LAYER = re.compile(r"[A-Za-z0-9._-]{1,64}")
_INVALID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")

Entry = tuple[str, int]


def valid_layer(name: object) -> bool:
    """Whether ``name`` is a layer name: 1 to 64 bytes of ``[A-Za-z0-9._-]``."""
    return isinstance(name, str) and _LAYER.fullmatch(name) is not None


def _fits(entries: list[Entry]) -> bool:
    return len(entries) <= MAX_ENTRIES and len(format_lineage(entries)) <= MAX_BYTES


def format_lineage(entries: Iterable[Entry]) -> str:
    """``[("edge", 2), ("middle", 1)]`` as ``edge:2/middle:1``."""
    return "/".join(f"{layer}:{attempt}" for layer, attempt in entries)


def shorten(entries: Iterable[Entry]) -> list[Entry]:
    """The entries within the limits: the outermost dropped first.

    If a dropped entry had an attempt above 1, ``...:<the largest>`` comes
    first, so that the enclosing retry it stood for is still seen.
    """
    kept = list(entries)
    dropped_max = 1
    while kept and not _fits(([(ELIDED, dropped_max)] if dropped_max > 1 else []) + kept):
        dropped_max = max(dropped_max, kept.pop(0)[1])
    return ([(ELIDED, dropped_max)] if dropped_max > 1 else []) + kept


def parse_lineage(value: str) -> list[Entry]:
    """The entries of a lineage value, shortened to the limits; ``[]`` if it is not valid.

    A value with any malformed entry is ignored as a whole: it came from a
    caller we do not control, and a partial reading could drop exactly the
    entry that says an enclosing layer is retrying.
    """
    text = value.strip()
    if not text:
        return []
    entries: list[Entry] = []
    for part in text.split("/"):
        layer, colon, number = part.rpartition(":")
        if not colon or not valid_layer(layer) or not number.isascii() or not number.isdigit():
            return []
        attempt = int(number)
        if not 1 <= attempt <= MAX_ATTEMPT:
            return []
        entries.append((layer, attempt))
    return shorten(entries)


def normalize_lineage(value: str) -> str:
    """A lineage as retryd accepts it: canonical, within the limits, ``""`` if invalid."""
    return format_lineage(parse_lineage(value))


def enclosing_retry(lineage: str) -> bool:
    """Whether a lineage holds an attempt above 1: the call is made inside an enclosing retry."""
    return any(attempt > 1 for _, attempt in parse_lineage(lineage))


def _members(headers: Iterable[str]) -> Iterator[str]:
    for header in headers:
        for member in header.split(","):
            if member.strip():
                yield member.strip()


def _key(member: str) -> str:
    return member.split("=", 1)[0].strip()


def lineage_from_baggage(headers: Iterable[str]) -> str:
    """The normalized ``retryd.lineage`` of ``baggage`` header values (``""`` when absent or invalid).

    The value is percent-decoded, as W3C baggage values are (an
    OpenTelemetry propagator encodes ``:`` and may encode ``/``).
    """
    for member in _members(headers):
        if _key(member) == MEMBER and "=" in member:
            value = member.split("=", 1)[1].split(";", 1)[0]
            return normalize_lineage(urllib.parse.unquote(value.strip()))
    return ""


def baggage_with_lineage(headers: Iterable[str], lineage: str) -> str:
    """One ``baggage`` value: the other members of ``headers`` untouched, ``retryd.lineage`` replaced.

    The lineage's characters are all baggage-octets, so it is sent as is.
    """
    kept = [member for member in _members(headers) if _key(member) != MEMBER]
    return ",".join(kept + [f"{MEMBER}={lineage}"])


def retried_below_of(value: Optional[str]) -> str:
    """A failed response's ``retryd-retried`` value if it is a layer name, else ``""`` (ignored)."""
    if value is None:
        return ""
    value = value.strip()
    return value if valid_layer(value) else ""


def default_layer() -> str:
    """``OTEL_SERVICE_NAME`` if it is a valid layer name, else the program's name made one, else ``service``."""
    service = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if valid_layer(service):
        return service
    program = sys.argv[0] if sys.argv else ""
    if program in ("", "-c", "-m", "-"):  # python -c, an interactive or piped interpreter: no name
        return "service"
    name = os.path.basename(program)
    if name.endswith(".py"):
        name = name[:-3]
    if name == "__main__":  # python -m package: the package names the program
        name = os.path.basename(os.path.dirname(program))
    name = _INVALID_CHARS.sub("-", name).strip("-")[:64]
    return name if valid_layer(name) else "service"


def check_layer(layer: Optional[str]) -> str:
    """``layer`` checked (ValueError if it is not a layer name), or :func:`default_layer` for None."""
    if layer is None:
        return default_layer()
    if not valid_layer(layer):
        raise ValueError(f"layer: must be 1 to 64 bytes of [A-Za-z0-9._-], got {layer!r}")
    return layer


@dataclass
class Inbound:
    """The state of one inbound request, shared by everything running in its context."""

    #: The request's lineage, normalized (``""`` at the edge).
    lineage: str = ""
    #: Set by the adapters when an outbound call ended in failure after retryd's decision.
    failed_after_decision: bool = False


_current: contextvars.ContextVar[Optional[Inbound]] = contextvars.ContextVar("retryd.lineage", default=None)


def current() -> Optional[Inbound]:
    """The inbound request being served in this context, if a middleware (or :func:`serving`) set one."""
    return _current.get()


def current_lineage() -> str:
    """The lineage of the request being served, ``""`` with none (the edge)."""
    state = _current.get()
    return state.lineage if state is not None else ""


@contextmanager
def serving(lineage: str = "", *, baggage: Iterable[str] = ()) -> Iterator[Inbound]:
    """Serves one inbound request in this context: the lineage, or the one in ``baggage`` header values.

    The middleware and interceptors use this; call it yourself in a
    framework they do not cover. The yielded :class:`Inbound` says on exit
    whether the handler's outbound calls ended in failure after retryd's
    decision (then add ``retryd-retried: <layer>`` to a failed response).
    """
    state = Inbound(normalize_lineage(lineage) if lineage else lineage_from_baggage(baggage))
    token = _current.set(state)
    try:
        yield state
    finally:
        try:
            _current.reset(token)
        except ValueError:  # a generator finished in another context than it started in
            pass


def outbound(layer: str, attempt: int) -> str:
    """The lineage an outbound attempt carries: the inbound one plus ``layer:attempt``, within the limits."""
    entries = parse_lineage(current_lineage()) + [(layer, min(max(attempt, 1), MAX_ATTEMPT))]
    return format_lineage(entries)


def record_failure_after_decision() -> None:
    """Records that an outbound call ended in failure after retryd's decision (the adapters call this)."""
    state = _current.get()
    if state is not None:
        state.failed_after_decision = True


__all__ = [
    "ELIDED",
    "Inbound",
    "MAX_ATTEMPT",
    "MAX_BYTES",
    "MAX_ENTRIES",
    "MEMBER",
    "PUSHBACK_TRAILER",
    "RETRIED_HEADER",
    "baggage_with_lineage",
    "check_layer",
    "current",
    "current_lineage",
    "default_layer",
    "enclosing_retry",
    "format_lineage",
    "lineage_from_baggage",
    "normalize_lineage",
    "outbound",
    "parse_lineage",
    "record_failure_after_decision",
    "retried_below_of",
    "serving",
    "shorten",
    "valid_layer",
]
