"""What crosses the wire: the one error body shape, and msgpack frames.

Every HTTP error anywhere in shardgrid is
`{"error": {"code": ..., "message": ..., <context such as shard, term, leader>}}`.
"""
from __future__ import annotations

import reprlib
from typing import Any, Callable, Iterable, Iterator

import msgpack
import orjson
from aiohttp import web

# HTTP status for each error code; a code not listed here is a server bug (500).
STATUS_FOR_CODE: dict[str, int] = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "request_timeout": 408,
    "method_not_allowed": 405,
    "conflict": 409,
    "payload_too_large": 413,
    "not_leader": 503,
    "unavailable": 503,
    "overloaded": 503,
    "over_budget": 503,  # a layers route that cannot finish within x-deadline-ms (refused at once)
    "quorum_timeout": 504,
    "deadline_exceeded": 504,
    "not_implemented": 501,
    "internal": 500,
}
# The code of an HTTP status that came without an error body (a proxy, a
# server too broken to answer in shape): the most general code of that status.
CODE_FOR_STATUS: dict[int, str] = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                                   413: "payload_too_large", 501: "not_implemented", 503: "unavailable",
                                   504: "deadline_exceeded"}

# The `reason` of a worker's 409 `conflict` answer to `POST /v1/assignments`
# (meta's controller placing a replica on it): why it cannot take one.
REFUSAL_REASONS = ("insufficient_disk", "insufficient_ram", "draining")


# Containers are shown a few levels deep: repr() of a client's value nested
# ~1000 levels (JSON and msgpack both decode that deep) raises RecursionError.
_SHALLOW = reprlib.Repr()
_SHALLOW.maxlevel = 3


def short_repr(value: Any, limit: int = 40) -> str:
    """repr of a client's value for an error message: at most `limit` characters,
    and safe for any value a decoder produced (however deeply nested)."""
    r = repr(value) if isinstance(value, (str, int, float, bool, type(None), bytes)) else _SHALLOW.repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


class ApiError(Exception):
    """Raised by handlers; rendered by the error middleware as the error body."""

    def __init__(self, code: str, message: str, **context: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.context = context

    @property
    def status(self) -> int:
        return STATUS_FOR_CODE.get(self.code, 500)

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, **self.context)


def error_body(code: str, message: str, **context: Any) -> dict[str, Any]:
    inner: dict[str, Any] = {"code": code, "message": message}
    inner.update({k: v for k, v in context.items() if v is not None})
    return {"error": inner}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(err.body(), status=err.status, headers=headers)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    """The one msgpack value `data` holds. Raises ValueError for anything else."""
    # strict_map_key=False: group ids are ints used as map keys.
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError as exc:
        # A map keyed by an array or a map (unhashable in Python): callers
        # handle ValueError as "malformed", and a TypeError became a 500.
        raise ValueError(f"malformed msgpack: {exc}") from None


# A stream frame (worker/transport.py, gateway/calls.py) is msgpack values
# back to back, cut at about this many bytes, so that one frame never holds
# up a stream's pings for long nor hits a receiver's message limit.
FRAME_BYTES = 1 << 20


# What msgpack raises for a value it cannot pack: an unknown type
# (TypeError), an int beyond 64 bits (OverflowError), nesting past its limit
# (ValueError).
PACK_ERRORS = (TypeError, OverflowError, ValueError)


class ItemTooLarge(ValueError):
    """An item whose encoding is over a stream's `max_item` (`pack_frames`)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes encoded, over the stream's limit of {limit}")
        self.size = size
        self.limit = limit


def pack_frames(items: Iterable[Any], limit: int = FRAME_BYTES,
                on_error: Callable[[Any, Exception], Any] | None = None,
                max_item: int | None = None) -> Iterator[bytes]:
    """`items` as frames of at most about `limit` bytes (a larger item gets a frame to itself).

    An item msgpack cannot pack raises, unless `on_error` is given: then it
    is called with the item and the error and returns what goes in the
    item's place (None: nothing). A stream's items are independent answers
    or messages, so one bad item must not stop its neighbours, nor the
    stream's writer task. With `max_item`, an item encoded larger than that
    is such an error too (ItemTooLarge): the receiver's message limit would
    close the stream, and every call in flight on it would fail with it.
    """
    chunk: list[bytes] = []
    size = 0
    for item in items:
        try:
            raw = packb(item)
            if max_item is not None and len(raw) > max_item:
                raise ItemTooLarge(len(raw), max_item)
        except PACK_ERRORS as exc:
            if on_error is None:
                raise
            instead = on_error(item, exc)
            if instead is None:
                continue
            raw = packb(instead)  # the caller's stand-in is plain data; a failure here is a bug
        if chunk and size + len(raw) > limit:
            yield b"".join(chunk)
            chunk, size = [], 0
        chunk.append(raw)
        size += len(raw)
    if chunk:
        yield b"".join(chunk)


# What unpacking a frame raises on bad bytes: msgpack's own errors and
# ValueError (a length beyond the buffer), and TypeError for a map whose key
# is a list or a map (unhashable).
_UNPACK_ERRORS = (msgpack.UnpackException, msgpack.ExtraData, ValueError, TypeError)


def unpack_frame(data: bytes) -> list[Any]:
    """The items of one frame written by `pack_frames`. Raises ValueError if it is malformed."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    items: list[Any] = []
    end = 0
    try:
        for item in unpacker:
            items.append(item)
            end = unpacker.tell()
    except _UNPACK_ERRORS as exc:
        raise ValueError(f"malformed frame: {exc}") from None
    _whole(end, data)
    return items


def _whole(end: int, data: bytes) -> None:
    """A frame holds whole items: the Unpacker stops silently at a cut-off last one."""
    if end != len(data):
        raise ValueError(f"malformed frame: a truncated item in its last {len(data) - end} bytes")


def unpack_frame_sized(data: bytes) -> list[tuple[Any, int]]:
    """Like `unpack_frame`, with each item's encoded size in bytes: a
    receiver bounds what one item may carry without encoding it again."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    out: list[tuple[Any, int]] = []
    at = 0
    try:
        for item in unpacker:
            end = unpacker.tell()
            out.append((item, end - at))
            at = end
    except _UNPACK_ERRORS as exc:
        raise ValueError(f"malformed frame: {exc}") from None
    _whole(at, data)
    return out


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn ApiError and aiohttp's HTTP exceptions into the one error shape (see `error_for`)."""
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - error_for answers or re-raises
        return error_for(exc, request)


def error_for(exc: Exception, request: web.Request) -> web.Response:
    """The error response for an exception a handler raised; re-raises a non-error HTTPException.

    Unexpected exceptions become a 500 with a generic message (never a stack
    trace on the wire); the trace goes to the log.
    """
    if isinstance(exc, ApiError):
        return error_response(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        code = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large"}.get(exc.status, "internal")
        return json_response(error_body(code, exc.reason or code), status=exc.status)
    log = request.app.get(LOGGER_KEY)
    if log is not None:
        log.error("unhandled_error", path=request.path, method=request.method, exc_info=exc)
    return json_response(error_body("internal", "internal error; see the server log"), status=500)


LOGGER_KEY: web.AppKey[Any] = web.AppKey("shardgrid_logger", object)
