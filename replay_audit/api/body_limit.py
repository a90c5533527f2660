"""A request-body size limit for every endpoint (`Settings.max_request_bytes`).

A declared Content-Length over the limit is answered 413 at once, without reading the body.
A body without one (chunked) is counted as it arrives and the read fails with PayloadTooLarge
past the limit: endpoints that read their body raw (`deps.read_body`) answer 413; bodies parsed
by FastAPI itself answer 4xx too (FastAPI reports any failure to read a body as 400). Either
way no more than the limit is ever held in memory.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replay_audit.api.errors import error_response
from replay_audit.exceptions import PayloadTooLarge


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                error = PayloadTooLarge(f"request body over {limit} bytes", field="body")
                await error_response(error)(scope, receive, send)
                return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"request body over {limit} bytes", field="body")
            return message

        await self.app(scope, limited_receive, send)
