"""The HTTP server's ASGI middleware: a request body limit, and a count of every response. Plain
ASGI, so streamed responses pass through untouched."""

from __future__ import annotations

from collections.abc import Callable


class LimitBody:
    """Refuses bodies over `limit` bytes: at once if their Content-Length says so (answered by
    `refused(too_large())`), else as soon as the route has read more (`too_large()` is raised
    there, for the route's error handling to answer)."""

    def __init__(self, app, limit: int, too_large: Callable[[], Exception], refused: Callable):
        self.app, self.limit, self.too_large, self.refused = app, limit, too_large, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await self.refused(self.too_large())(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise self.too_large()
            return message

        await self.app(scope, limited, send)


class CountRequests:
    """Counts every response in `metrics.requests` by route (one of `routes`, else "other": unknown
    paths cannot grow the label set) and status."""

    def __init__(self, app, metrics, routes: tuple[str, ...]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
