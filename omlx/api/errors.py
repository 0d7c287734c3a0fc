"""Mapping exceptions to HTTP error responses, in the shape of the protocol the route speaks.

The one place where an exception becomes a status code. Routes under ``/v1/messages`` answer in
Anthropic's shape; everything else in OpenAI's. A client's mistake is a 4xx naming the problem;
anything unexpected is logged and becomes a 500 with a JSON body, and the server keeps serving.
"""

from __future__ import annotations

import logging

from sanic import Request as HttpRequest
from sanic import json as json_response
from sanic.exceptions import RequestCancelled, SanicException
from sanic.handlers import ErrorHandler
from sanic.response import HTTPResponse

from omlx.errors import (
    AuthenticationError,
    HubUnreachableError,
    InsufficientDiskError,
    InvalidRequestError,
    NotFoundError,
    OmlxError,
    PayloadTooLargeError,
)

logger = logging.getLogger(__name__)

#: 5xx errors that name a failure outside omlx (the hub, a full disk): logged as one line.
UPSTREAM_ERRORS = (HubUnreachableError, InsufficientDiskError)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def to_omlx_error(exc: BaseException) -> OmlxError:
    """Wrap any exception as an OmlxError (Sanic's own 4xx keep their status)."""
    if isinstance(exc, OmlxError):
        return exc
    if isinstance(exc, SanicException):
        status = getattr(exc, "status_code", 500) or 500
        msg = str(exc) or type(exc).__name__
        if status == 413 and "header" in msg.lower():  # Sanic reports oversized headers as 413
            err = InvalidRequestError(f"request headers too large: {msg} (at most 16384 bytes)")
            err.status = 431
            return err
        if status == 413:
            return PayloadTooLargeError(f"request body too large: {msg}")
        if status == 404:
            return NotFoundError(f"no such route: {msg}")
        if status == 401:
            return AuthenticationError(msg)
        if status == 405:
            err = InvalidRequestError(f"method not allowed: {msg}")
            err.status = 405
            return err
        if 400 <= status < 500:
            err = InvalidRequestError(msg)
            err.status = status
            return err
    return OmlxError(f"internal error: {type(exc).__name__}")


def error_response(path: str, exc: BaseException) -> HTTPResponse:
    """The JSON error response for ``exc`` on a route at ``path``."""
    err = to_omlx_error(exc)
    body = err.anthropic_body() if is_anthropic_path(path) else err.openai_body()
    return json_response(body, status=err.status, headers=err.headers())


class OmlxErrorHandler(ErrorHandler):
    """Sanic error handler: every error, including Sanic's own, gets the API's JSON shape."""

    def default(self, request: HttpRequest, exception: Exception) -> HTTPResponse:
        if isinstance(exception, RequestCancelled):  # the client went away: routine, not an error
            logger.info("client disconnected from %s %s before the response; request aborted", request.method, request.path)
            return json_response({"error": {"message": "client disconnected", "type": "client_closed"}}, status=499)
        if isinstance(exception, UPSTREAM_ERRORS):  # the hub or the disk, not omlx: no traceback
            logger.warning("%s %s: %s", request.method, request.path, exception.message)
        elif not isinstance(exception, (OmlxError, SanicException)) or getattr(exception, "status_code", 500) >= 500:
            if not isinstance(exception, OmlxError) or exception.status >= 500:
                logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=exception)
        return error_response(request.path, exception)
