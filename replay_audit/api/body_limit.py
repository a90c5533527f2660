"""A request-body size limit for every endpoint (`Settings.max_request_bytes`).

A declared Content-Length over the limit is answered 413 at once, without reading the body.
A body without one (chunked) is counted as it arrives: past the limit the read fails with
PayloadTooLarge and the answer is 413, whatever the endpoint made of the failed read (FastAPI
answers any failure to read a body it parses itself with 400; that answer is replaced). Either
way no more than the limit is ever held in memory.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replay_audit.api.errors import error_response
from replay_audit.exceptions import PayloadTooLarge

logger = logging.getLogger(__name__)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        too_large = PayloadTooLarge(f"request body over {limit} bytes", field="body")
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await error_response(too_large)(scope, receive, send)
                return

        received = 0
        exceeded = started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise too_large
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the endpoint's answer to the failed read; ours follows
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded or started:
                raise
            logger.debug("request body over the limit", exc_info=True)
        if exceeded and not started:
            await error_response(too_large)(scope, receive, send)
