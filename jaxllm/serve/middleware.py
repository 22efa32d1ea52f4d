"""The HTTP server's ASGI middleware: admission (an API key and a rate limit), a request body
limit, and a count of every response. Plain ASGI, so streamed responses pass through untouched."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers


class Admit:
    """Calls `admit(headers, client address)` before a request's body is read, except on the
    `open` paths; what it raises is answered by `refused(error)`."""

    def __init__(self, app, admit: Callable, refused: Callable, open: tuple[str, ...], refusal: type[Exception]):
        self.app, self.admit, self.refused, self.open, self.refusal = app, admit, refused, open, refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open:
            try:
                self.admit(Headers(scope=scope), (scope.get("client") or ("",))[0])
            except self.refusal as e:
                return await self.refused(e)(scope, receive, send)
        await self.app(scope, receive, send)


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
    """Counts every request in `metrics.requests` by route (one of `routes`, else "other": unknown
    paths cannot grow the label set) and status; one that ends unanswered (its client left before
    a response began) as 499, nginx's "client closed request", and one whose error escaped every
    handler as the 500 that the outermost handler answers."""

    def __init__(self, app, metrics, routes: tuple[str, ...]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start" and status is None:
                status = message["status"]
                self.metrics.requests.labels(route, str(status)).inc()
            await send(message)

        unanswered = "499"
        try:
            await self.app(scope, receive, counted)
        except Exception:
            unanswered = "500"  # the error handler outside the middleware answers it
            raise
        finally:
            if status is None:
                self.metrics.requests.labels(route, unanswered).inc()
