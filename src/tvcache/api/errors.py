"""The one table between errors and the native API's answers, both ways.

Every refusal travels as ``{"error": {"type": ..., "message": ..., "detail"?: ...}}`` with an HTTP status. The
server (``tvcache.server``), the Ray shard actors and the clients (``tvcache.store.http``, ``RemoteCache``) all
read the table below: the server to answer an exception (``code_of``), a client to raise from an answer
(``client_error``). Statuses and types are those of every release so far (docs/wire-compat.md): changing one
breaks clients in the field.

    type              status  raised on the server by                    raised in a client as
    validation        422     a body or query that does not fit          InvalidInput
    invalid_input     400     InvalidInput                               InvalidInput
    bad_request       400     (the HTTP runner: a malformed request)     InvalidInput
    not_found         404     NotFound, or no such route                 ServerError(404)
    unauthorized      401     (a missing or wrong bearer token)          ServerError(401)
    instance_changed  409     (ids of another server instance)           ReplicaDropped
    too_large         413/414 (a body or query string over the limit)    ServerError
    method_not_allowed 405    (no such method on the route)              ServerError(405)
    shard_down        503     (the Ray dashboard: the task's shard is down) ServerError(503)
    <class name>      503     any other TVCacheError (JournalError, ServerBusy, ...)  ServerError(503)

Standard library only: the clients import it without the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInput, NotFound, ReplicaDropped, ServerError, TVCacheError

__all__ = [
    "BAD_REQUEST",
    "BODY_TOO_LARGE",
    "ERRORS",
    "INSTANCE_CHANGED",
    "INVALID_INPUT",
    "METHOD_NOT_ALLOWED",
    "NOT_FOUND",
    "QUERY_TOO_LARGE",
    "SHARD_DOWN",
    "UNAUTHORIZED",
    "UNAVAILABLE",
    "VALIDATION",
    "ErrorCode",
    "client_error",
    "code_of",
    "error_body",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorCode:
    """One kind of refusal. ``kind``: the body's error type (None: the exception's class name, for 503s).
    ``raises``: the exception a client raises for it. ``description``: what it means (the OpenAPI document)."""

    status: int
    kind: str | None
    raises: type[TVCacheError]
    description: str

    def type_of(self, error: BaseException | None = None) -> str:
        """The body's error type (for a 503, the class name of ``error``)."""
        if self.kind is not None:
            return self.kind
        return "TVCacheError" if error is None else type(error).__name__


VALIDATION = ErrorCode(status=422, kind="validation", raises=InvalidInput, description="body does not fit the schema")
INVALID_INPUT = ErrorCode(
    status=400, kind="invalid_input", raises=InvalidInput, description="a value the cache cannot accept"
)
BAD_REQUEST = ErrorCode(status=400, kind="bad_request", raises=InvalidInput, description="not a valid HTTP request")
NOT_FOUND = ErrorCode(
    status=404, kind="not_found", raises=ServerError, description="unknown task, node, claim or lease"
)
UNAUTHORIZED = ErrorCode(
    status=401, kind="unauthorized", raises=ServerError, description="missing or wrong bearer token"
)
INSTANCE_CHANGED = ErrorCode(
    status=409,
    kind="instance_changed",
    raises=ReplicaDropped,
    description="the node ids belong to another server instance (it restarted)",
)
BODY_TOO_LARGE = ErrorCode(status=413, kind="too_large", raises=ServerError, description="body too large")
QUERY_TOO_LARGE = ErrorCode(status=414, kind="too_large", raises=ServerError, description="query string too large")
METHOD_NOT_ALLOWED = ErrorCode(
    status=405, kind="method_not_allowed", raises=ServerError, description="no such method on the route"
)
SHARD_DOWN = ErrorCode(
    status=503, kind="shard_down", raises=ServerError, description="the Ray shard that holds the task is down"
)
UNAVAILABLE = ErrorCode(
    status=503, kind=None, raises=ServerError, description="the cache cannot serve the request now (journal, limits)"
)

ERRORS: tuple[ErrorCode, ...] = (
    VALIDATION,
    INVALID_INPUT,
    BAD_REQUEST,
    NOT_FOUND,
    UNAUTHORIZED,
    INSTANCE_CHANGED,
    BODY_TOO_LARGE,
    QUERY_TOO_LARGE,
    METHOD_NOT_ALLOWED,
    SHARD_DOWN,
    UNAVAILABLE,
)

# The exceptions the server answers, most specific first (matched along the exception's class hierarchy).
_RAISED: dict[type[BaseException], ErrorCode] = {
    NotFound: NOT_FOUND,
    InvalidInput: INVALID_INPUT,
    TVCacheError: UNAVAILABLE,
}


def code_of(error: BaseException) -> ErrorCode | None:
    """How the server answers ``error`` (None: it is no tvcache error, and a bug)."""
    for cls in type(error).__mro__:
        code = _RAISED.get(cls)
        if code is not None:
            return code
    return None


def error_body(code: ErrorCode, message: str, detail: Any = None, *, error: BaseException | None = None) -> bytes:
    """The JSON body of a refusal."""
    body: dict[str, Any] = {"type": code.type_of(error), "message": message}
    if detail is not None:
        body["detail"] = detail
    return json.dumps({"error": body}, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def client_error(status: int, kind: str | None, message: str) -> TVCacheError:
    """The exception a client raises for a refusal with ``status`` and error type ``kind`` (None: the body
    named none). A status the table does not list raises ``ServerError``; one it lists under another type
    raises what that status raises elsewhere (400 and 422: ``InvalidInput``)."""
    by_status = [code for code in ERRORS if code.status == status]
    exact = [code for code in by_status if code.kind == kind]
    chosen = exact[0] if exact else (by_status[0] if by_status else None)
    raises = ServerError if chosen is None else chosen.raises
    if raises is ReplicaDropped:
        return ReplicaDropped(message) if exact else ServerError(status, message)  # a 409 not about the instance
    if raises is InvalidInput:
        return InvalidInput(message)
    return ServerError(status, message)
