"""Request body size limit for every route (a pure ASGI middleware), and the 422 answer.

A declared ``Content-Length`` over the limit is refused before a byte is read; a body without one
(chunked) is counted as it streams in and refused as soon as it passes the limit. Either way the
answer is 413 naming the limit, and the route never sees the body (so nothing is stored).
"""

from __future__ import annotations

from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit.

    An HTTPException, so that FastAPI passes it through its body parsing unchanged (it turns other
    exceptions raised while reading into a 400) and its exception handler answers 413.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, detail=body_limit_detail(limit))


def body_limit_detail(limit: int) -> str:
    return f"request body exceeds the limit of {limit} bytes"


class BodySizeLimit:
    """Refuse request bodies larger than ``max_bytes`` with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_max_bytes = max_bytes
        self.per_path = dict(per_path or {})
        """Exact paths with a limit of their own (the code package upload)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.default_max_bytes)
        await _Limited(self.app, limit)(scope, receive, send)


class _Limited:
    """One request under one limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await JSONResponse({"detail": "Content-Length is not a number"}, 400)(scope, receive, send)
                    return
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, receive, send)
            return

        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError:
            # Reached only when something below did not turn it into a response (a mounted app).
            if not started:
                await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": body_limit_detail(self.max_bytes)}, status.HTTP_413_CONTENT_TOO_LARGE,
                                headers={"Connection": "close"})
        await response(scope, receive, send)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each field and its rule, without echoing the input back.

    FastAPI's default answer includes every offending value: a NaN cannot be written as JSON (the
    answer would become a 500), and a refused 10,000-sample batch would be sent back whole.
    """
    errors = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
    return JSONResponse({"detail": errors}, status.HTTP_422_UNPROCESSABLE_CONTENT)
