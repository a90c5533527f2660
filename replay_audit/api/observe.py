"""What every HTTP request leaves behind (`ObserveMiddleware`, the app's outermost middleware):
a request id (a sane incoming `X-Request-ID` or a new one, bound to its log lines, answered in
the header and shown in every 5xx body), the HTTP metrics by route template (never the raw
path: bounded labels), and one access line on the `replay_audit.access` logger."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replay_audit.telemetry.log import bound, sane_request_id
from replay_audit.telemetry.metric import HTTP_DURATION, HTTP_REQUESTS

REQUEST_ID_HEADER: Final = "X-Request-ID"
#: The route label of a request no route matched (a 404): one label, whatever the path.
UNMATCHED: Final = "unmatched"

access_log = logging.getLogger("replay_audit.access")


def route_template(scope: Scope) -> str:
    """The template of the route that answered (`/v1/traces/{trace_id}`), under its mounts."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    # Inside a mount, root_path has grown by the mount's path; the route's path is relative.
    root = str(scope.get("root_path", ""))
    if path is None or isinstance(route, Mount):
        # A mounted app without routes (the UI's static files) answered, or nothing did.
        return f"{root}/{{path}}" if root != scope.get("app_root_path", "") else UNMATCHED
    return root + str(path)


class ObserveMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: bool = True) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = sane_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER)) or (
            uuid.uuid4().hex
        )
        status = 500  # an exception that escapes every handler ends the connection
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = request_id
                # No answer (JSON, an export, a page) is to be sniffed into another type.
                headers["X-Content-Type-Options"] = "nosniff"
            await send(message)

        with bound(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                seconds = time.perf_counter() - started
                method, route = str(scope["method"]), route_template(scope)
                if self.metrics:
                    labels = (method, route, str(status))
                    HTTP_REQUESTS.labels(*labels).inc()
                    HTTP_DURATION.labels(*labels).observe(seconds)
                # With the key's project, if the key check noted one (api.deps).
                access_log.info("%s %s %d %.1f ms", method, route, status, seconds * 1000)
