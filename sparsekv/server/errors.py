"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

User input never yields a 500: ``ValueError``s (whose messages start with the parameter name,
docs/internals.md) and pydantic errors become 400s naming ``param``. Every invalid parameter
value or type has the code ``invalid_value``, a request that does not fit the context (a
prompt of at least its length, or prompt plus ``max_tokens`` over it)
``context_length_exceeded``; a body that is not a JSON object (empty, malformed, not UTF-8
text at all, sent without a JSON ``Content-Type``, or a JSON array, string, number or
``null``) has ``invalid_json``, its message saying which. A method an endpoint does not take
is a 405 ``method_not_allowed`` with an ``Allow`` header listing the methods it does take.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparsekv.compression_config import CompressionConfig
from sparsekv.errors import ContextLengthError

logger = logging.getLogger(__name__)

# "max_tokens must ...", "prompt: ...", "kv_compression.budget (5) must ...", "messages[0]: ..."
_PARAM = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*)*)(?!\w)")
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered as an OpenAI error body.

    Args:
        status: HTTP status code.
        message: human-readable message.
        param: the offending request field, if any.
        code: a short machine-readable code (``None`` = derived from the status).
        type: the OpenAI error type (``None`` = derived from the status).
        headers: extra response headers (a 405's ``Allow``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        """The JSON body (also sent as an SSE ``data:`` event mid-stream)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else _default_code(self.status),
            }
        }

    def response(self) -> JSONResponse:
        """The HTTP response carrying ``body()``."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_code(status: int) -> str:
    if status == 400:
        return "invalid_value"
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "error"


def param_of(message: str) -> str | None:
    """The parameter a ``ValueError`` message names (its leading identifier), if any."""
    match = _PARAM.match(message)
    return match.group(1) if match else None


def invalid_request(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 from an engine/config ``ValueError``; ``renames`` maps engine names to the names
    the client sent (chat: ``prompt`` -> ``messages``, ``max_tokens`` ->
    ``max_completion_tokens``), in ``param`` and at the start of the message. Code
    ``context_length_exceeded`` for a ``ContextLengthError``, else ``invalid_value``."""
    message = str(exc)
    param = param_of(message)
    if param is not None and renames and param in renames:
        message = renames[param] + message[len(param) :]
        param = renames[param]
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
    return APIError(400, message, param=param, code=code)


def method_not_allowed(method: str, path: str, allowed: list[str]) -> APIError:
    """The 405 for ``method`` on ``path``, an endpoint that takes only ``allowed``; its
    ``Allow`` header lists them (RFC 9110) so a client can tell a wrong method from a wrong
    path."""
    methods = ", ".join(allowed)
    return APIError(
        405,
        f"method {method} is not allowed on {path}; allowed: {methods}",
        code="method_not_allowed",
        headers={"Allow": methods} if allowed else None,
    )


LONE_SURROGATE_NAME = "a field name holds a lone surrogate escape (\\ud800-\\udfff), not text"


def _invalid_json(reason: str = "") -> APIError:
    message = "the request body is not valid JSON" + (f": {reason}" if reason else "")
    return APIError(400, message, code="invalid_json")


def _unreadable_json(cause: BaseException) -> APIError:
    """The 400 for a body ``json.loads`` gave up on, saying why (see ``_http`` below)."""
    if isinstance(cause, UnicodeDecodeError):
        return _invalid_json("it is not UTF-8 text")
    if isinstance(cause, RecursionError):
        return _invalid_json("it nests deeper than the parser's recursion limit")
    if "integer string conversion" in str(cause):
        return _invalid_json(f"an integer has more than {sys.get_int_max_str_digits()} digits")
    return _invalid_json()


def _parse_error(error: dict) -> APIError:
    """The 400 for malformed JSON, with the parser's reason and the character it stopped at
    (pydantic's ``json_invalid``: ``loc`` ``("body", position)``, ``ctx["error"]``)."""
    reason = str((error.get("ctx") or {}).get("error", "")).strip()
    loc = tuple(error.get("loc", ()))
    if reason and len(loc) == 2 and isinstance(loc[1], int):
        reason = f"{reason} at character {loc[1]}"
    return _invalid_json(reason)


# How FastAPI reports a body that is not a JSON object at all: empty ("missing"), or read but
# of another type (pydantic's "model_attributes_type", "model_type", "dict_type"). Another
# error located at the whole body (a model-level validator's) keeps its own message.
_BODY_TYPE_ERRORS = ("missing", "model_type", "model_attributes_type", "dict_type")


def _not_an_object(error_type: str | None, body: Any, content_type: str | None) -> APIError:
    """The 400 for a body that FastAPI could not read as a JSON object, saying why.

    FastAPI reports each case as the whole body (``loc`` ``("body",)``) failing to validate:
    an empty body as ``missing``; a body whose ``Content-Type`` is not JSON is handed over
    unparsed, as bytes; any other is JSON of another type than an object.
    """
    if error_type == "missing":
        message = "the request body is empty; send a JSON object"
    elif isinstance(body, bytes):
        media = (content_type or "").split(";")[0].strip()
        given = f"Content-Type {media[:64]!r}" if media else "no Content-Type"
        message = (
            f"the request body must be JSON sent with Content-Type: application/json; got {given}"
        )
    else:
        message = f"the request body must be a JSON object, got {_json_kind(body)}"
    return APIError(400, message, code="invalid_json")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _pydantic_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop the branch labels pydantic inserts for unions and validators ("list[int]", "str",
    # "function-after[...]"): field names and list indices are plain words.
    labels = {"str", "int", "float", "bool"}
    parts = [p for p in parts if re.fullmatch(r"\w+", p) and p not in labels]
    return ".".join(parts) or None


def _unknown_field(param: str | None) -> str:
    """The message for a field the schema does not have; inside ``kv_compression`` it lists
    the policy's fields (the object most often misspelt)."""
    if param is not None and param.startswith("kv_compression."):
        names = ", ".join(f.name for f in dataclasses.fields(CompressionConfig))
        return f"unknown field; kv_compression takes {names}"
    return "unknown field"


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the OpenAI body; invalid JSON and type errors are 400s."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _parse_error(first).response()
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _BODY_TYPE_ERRORS:
            content_type = request.headers.get("content-type")
            return _not_an_object(first.get("type"), exc.body, content_type).response()
        param = _pydantic_param(tuple(first.get("loc", ())))
        if first.get("type") == "string_unicode" and param is None:
            # a field name with a lone surrogate escape: no text a field can be named by
            return _invalid_json(LONE_SURROGATE_NAME).response()
        # pydantic prefixes a validator's ValueError with "Value error, ": the client needs
        # only the validator's own words
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            detail = _unknown_field(param)
        message = f"{param or 'body'}: {detail}"
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            allowed = sorted(m.strip() for m in allow.split(",") if m.strip())
            return method_not_allowed(request.method, request.url.path, allowed).response()
        # FastAPI answers a body json.loads cannot take with a generic 400 whose cause is the
        # error: bytes that are not UTF-8 (UnicodeDecodeError), an integer of more digits
        # than Python converts (ValueError), nesting deeper than the parser's recursion
        # (RecursionError). None of them is JSON the server can read.
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            return _unreadable_json(exc.__cause__).response()
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()
