"""The server's HTTP plumbing: OpenAI-style error objects, the request body (a size limit, then one
strict parse) and the API key check. Every error a client can get is `{"error": {message, type,
param, code}}`, whatever raised it."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

OPEN_PATHS = frozenset({"/health"})  # the only route answered without the API key (for load balancers)
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}
# (any other 4xx is an "invalid_request_error", any other 5xx an "internal_error")


class BadRequest(Exception):
    """A request the server answers with an error of `status` (a client's mistake unless 5xx)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or BadRequest 413 once it passes `limit` bytes (by its Content-Length
    before anything is read, else while it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body has {int(declared)} bytes; this server takes at most {limit}",
                         status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(f"the request body has more than {limit} bytes; this server takes at most {limit}",
                             status=413)
        parts.append(part)
    return b"".join(parts)


def parse(schema: type[BaseModel], body: bytes) -> BaseModel:
    """body (JSON) as `schema`, strictly (see schemas.py), or BadRequest naming the first bad field.
    Malformed JSON, invalid UTF-8, a lone surrogate escape and nesting past the parser's depth
    limit are all "malformed JSON"."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        why = first["msg"].removeprefix("Invalid JSON: ")
        if "surrogate" in why or "hex escape" in why:
            why += r" (text must be valid Unicode: a \uD800-\uDFFF escape only as half of a surrogate pair)"
        raise BadRequest(f"malformed JSON: {why}") from None
    param = field_path(first["loc"])
    if param is None:
        raise BadRequest(f"body: {first['msg']}") from None
    depth = param.count(".") + 1  # the union member's tag follows the field's path in each error's loc
    alternatives = [err["loc"][depth] for err in errors if field_path(err["loc"]) == param and len(err["loc"]) > depth]
    if len(alternatives) > 1:  # no member of a union took the value: say what the field takes
        shown = ", ".join(dict.fromkeys(str(a) for a in alternatives))
        raise BadRequest(f"{param}: expected one of: {shown}", param) from None
    raise BadRequest(f"{param}: {first['msg']}", param) from None


def field_path(loc) -> str | None:
    """A pydantic error location as the field's dotted path (`messages.0.role`), without the union
    member tags pydantic adds (`str`, `list[int]`); None for the body itself."""
    path = []
    for part in loc:
        if isinstance(part, str) and not part.isidentifier() or part in ("str", "int", "float", "bool"):
            break
        path.append(str(part))
    return ".".join(path) or None


class ApiKeyCheck:
    """ASGI middleware: every HTTP request but those to OPEN_PATHS must carry `Authorization: Bearer
    <key>`, compared in constant time; else 401 in OpenAI's error format. The key is never logged."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._allowed(scope):
            response = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                      "<key>'", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self.expected)
