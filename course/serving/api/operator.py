"""What an operator puts around the routes of :mod:`course.serving.api.server`: the API key,
request ids, the access log, the limits on a request's body and on the waiting queue, and client
disconnects logged as one line.

* ``api_key``: ``Authorization: Bearer <key>`` required on the ``/v1`` routes, as vLLM's ``--api-key``
  (one key, or several: one per tenant, any of them accepted, as vLLM 0.32 accepts a list); the key a
  request used is its tenant (:func:`tenant_of`, recorded in the scope's state), which per-key prefix-cache
  isolation salts its blocks with (:func:`tenant_salt`); a request with more than one ``Authorization``
  header is refused (which one counts would be a guess);
* ``metrics_api_key``: ``GET /metrics`` then needs ``Authorization: Bearer <that key>`` (a tenant's key
  does not open it): vLLM leaves ``/metrics`` open, and its prefix-cache counters tell anyone who can read
  them how many prompt tokens hit the cache;
* ``X-Request-Id`` taken from the request (visible ASCII, at most 128 characters) or made up, and
  echoed on the response;
* one access-log line per request (``access_log=True``, logger ``course.serving.access``), every
  field a client chose escaped with :func:`printable`;
* a request body larger than ``max_request_bytes`` gets 413 (:func:`read_body`), refused from the
  ``Content-Length`` header before anything is read when the client sends one;
* with ``max_waiting_requests`` requests already waiting, a new one gets 503 and ``Retry-After``
  (:func:`overload_refusal`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
import unicodedata
import uuid
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from course.serving.api.protocol import BadRequest, error_body

access_logger = logging.getLogger("course.serving.access")
logger = logging.getLogger("course.serving.server")  # the server's own lines, under the name operators know

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII: safe in a header and a log line


class ClientDisconnected(ConnectionError):
    """The client went away: while its request body was read, or a write to it failed.

    A ``ConnectionError`` (an ``OSError``), so that the stream's writer treats it as the client
    vanishing. :class:`OperatorMiddleware` logs it as one INFO line; it never reaches uvicorn
    (whose "Exception in ASGI application" traceback any client could otherwise write at will).
    """


def printable(text: str, limit: int = 2048) -> str:
    """``text`` safe for one log line: control, format and line/paragraph-separator characters
    (CR, LF, ESC, C1, bidirectional overrides, ...), backslash and double quote escaped as
    ``\\xNN`` / ``\\uNNNN`` (nginx's way), and cut at ``limit`` characters."""
    out = []
    for char in text[:limit]:
        code = ord(char)
        if char in '"\\' or code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02X}")
        elif code > 0x7F and unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}")
        else:
            out.append(char)
    if len(text) > limit:
        out.append(f"...({len(text) - limit} more)")
    return "".join(out)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or BadRequest 413 as soon as it is known to exceed ``limit`` bytes."""

    def too_large(size: str) -> BadRequest:
        return BadRequest(
            f"The request body is {size}, over this server's limit of {limit} bytes; send a shorter prompt.",
            status=413,
            err_type="RequestTooLargeError",
        )

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared)} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected(f"while sending its request body ({size} bytes received)") from None
    return b"".join(chunks)


def tenant_of(key: str) -> str:
    """A tenant's identity: the SHA-256 of its API key, in hex (the key itself is never kept or logged)."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The prefix-cache salt of a request of ``tenant`` under per-key isolation: its tenant, then its own
    ``cache_salt`` (if any) after an ``@``. A client's salt cannot contain ``@`` (vLLM refuses it), so no
    salt a client sends, and no other tenant's, can equal this one."""
    return f"key-{tenant}@{cache_salt or ''}"


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys, from one key, several, or None (no key needed); ValueError for an empty key."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if any(not key for key in keys):
        raise ValueError("an API key must not be empty")
    return keys


def overload_refusal(waiting: int, limit: int | None) -> JSONResponse | None:
    """503 with ``Retry-After`` when ``waiting`` requests wait already and ``limit`` is reached (None: room)."""
    if limit is None or waiting < limit:
        return None
    body = error_body(
        f"The server is overloaded: {waiting} requests are waiting already (the limit is {limit}). Retry later.",
        "ServiceUnavailableError",
        code=503,
    )
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


class OperatorMiddleware:
    """Pure ASGI (streams pass through untouched): API key, X-Request-Id, the access log, disconnects.

    Every field of an access-log line that a client chose (the path, the method, the request id)
    is escaped with :func:`printable`, so that a percent-encoded CR LF or ESC in a path cannot forge
    log lines or terminal escapes. A client that goes away is logged as one INFO line on
    ``course.serving.server``; a failed write to it never becomes a traceback.
    """

    def __init__(
        self,
        app,
        api_key: str | Sequence[str] | None,
        access_log: bool,
        metrics_api_key: str | None = None,
    ) -> None:
        self.app, self.access_log = app, access_log
        # (digest of "Bearer <key>", tenant) per key: every key is compared, in constant time, as vLLM does
        self.api_keys = [(_digest(f"Bearer {key}".encode()), tenant_of(key)) for key in api_keys(api_key)]
        self.metrics_key = _digest(f"Bearer {metrics_api_key}".encode()) if metrics_api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw_headers = scope.get("headers") or []
        headers = dict(raw_headers)
        request_id = _request_id(headers)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        start, status = time.perf_counter(), [0]
        send_with_id = _sender_with_id(send, request_id, status)
        try:
            refusal = self._refusal(scope["path"], raw_headers, headers, state)
            if refusal is not None:
                await refusal(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except (ClientDisconnected, ClientDisconnect) as err:
            state.setdefault("client_gone", str(err) or "while its request was read")
        finally:
            self._log(scope, state, request_id, status[0], start)

    def _refusal(self, path: str, raw_headers: list, headers: dict, state: dict) -> JSONResponse | None:
        """The answer to a request the routes must not see (400: several Authorization headers;
        401: a wrong or missing API key on a ``/v1`` route, or a wrong or missing metrics key on
        ``/metrics``), or None; an accepted API key's tenant goes into ``state["tenant"]``."""
        authorizations = sum(1 for name, _ in raw_headers if name == b"authorization")
        if authorizations > 1:  # which one counts would be a guess: refuse (RFC 9110 allows one)
            message = f"The request has {authorizations} Authorization headers; send exactly one."
            return JSONResponse(error_body(message, "BadRequestError"), status_code=400)
        given = headers.get(b"authorization")
        if self.metrics_key is not None and path == "/metrics" and not _same(given, self.metrics_key):
            message = "Invalid or missing metrics key: send 'Authorization: Bearer <metrics key>'."
            return JSONResponse(error_body(message, "AuthenticationError", code=401), status_code=401)
        if self.api_keys and path.startswith("/v1"):
            tenant = self._tenant(given)
            if tenant is None:
                message = "Invalid or missing API key: send 'Authorization: Bearer <key>'."
                return JSONResponse(error_body(message, "AuthenticationError", code=401), status_code=401)
            state["tenant"] = tenant
        return None

    def _tenant(self, given: bytes | None) -> str | None:
        """The tenant whose key ``given`` (an Authorization header's value) is, or None; every key is
        compared, so the time taken does not tell which key came close."""
        if given is None:
            return None
        digest, found = _digest(given), None
        for key, tenant in self.api_keys:
            if secrets.compare_digest(digest, key):
                found = tenant
        return found

    def _log(self, scope, state: dict, request_id: str, status: int, start: float) -> None:
        """The request's log lines: that its client went away (if it did), its access-log line (if on)."""
        client = scope.get("client") or ("-", 0)
        line = (printable(str(client[0]), 64), printable(scope["method"], 32), printable(scope["path"]))
        if "client_gone" in state:
            logger.info(
                '%s "%s %s" request_id=%s: the client went away %s',
                *line,
                request_id,
                printable(state["client_gone"], 200),
            )
        if self.access_log:
            prompt, completion = state.get("usage", ("-", "-"))
            access_logger.info(
                '%s "%s %s" %s %.1f ms request_id=%s prompt_tokens=%s completion_tokens=%s',
                *line,
                status or "-",
                1e3 * (time.perf_counter() - start),
                request_id,
                prompt,
                completion,
            )


def _request_id(headers: dict[bytes, bytes]) -> str:
    """The client's ``X-Request-Id`` if it is safe to echo and log, else a fresh one."""
    given_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128]
    return given_id if _REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex


def _sender_with_id(send, request_id: str, status: list[int]):
    """``send`` that adds ``X-Request-Id`` to the response's headers, keeps its status in ``status[0]``,
    and turns a write to a client that is gone into :class:`ClientDisconnected`."""

    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
        try:
            await send(message)
        except Exception as err:  # the transport is gone (uvloop: RuntimeError "the handler is closed")
            raise ClientDisconnected(f"while its response was written ({type(err).__name__}: {err})") from None

    return send_with_id


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _same(given: bytes | None, expected: bytes) -> bool:
    """Whether an Authorization value matches a key's digest (:func:`_digest`), in constant time."""
    return given is not None and secrets.compare_digest(_digest(given), expected)
