"""How the HTTP API answers a request it does not serve: a status, OpenAI's error body and the
reason it is counted under, for refusals (4xx, a full queue) and failures (500, 504) alike."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from jaxllm.serve.generation import RequestError, RequestFailed, Unavailable
from jaxllm.serve.shapes import error

ERROR_TYPES = {
    401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable", 504: "server_error",
}  # fmt: skip
FAILURES = (500, 504)  # the server's fault, not the request's: counted apart from refusals


class ApiError(Exception):
    """A request not served: its status, OpenAI's error fields, and the reason it is counted under."""

    def __init__(self, status: int, message: str, reason: str, code=None, param=None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.code, self.param = status, message, reason, code, param
        self.headers = {} if retry_after is None else {"Retry-After": str(retry_after)}

    @classmethod
    def of(cls, e: Exception) -> ApiError:
        """The answer to what the engine said of a request."""
        if isinstance(e, RequestError):
            status, reason = {
                "context_length_exceeded": (422, "context_length"),
                "perplexity_alarm": (400, "perplexity"),
                "unsupported_field": (422, "unsupported_field"),
                **dict.fromkeys(("invalid_schema", "invalid_regex", "invalid_grammar"), (400, "invalid_grammar")),
            }.get(e.code, (422, "invalid"))
            return cls(status, str(e), reason, e.code or "invalid_value", e.param)
        if isinstance(e, RequestFailed):
            return cls(504, str(e), "timeout", "timeout") if e.code == "timeout" else cls(500, str(e), e.code, e.code)
        if isinstance(e, TimeoutError):  # the engine thread itself did not answer in time
            return cls(504, f"{e}; the server is overloaded or stuck: retry, and tell its operator", "timeout",
                       "timeout")  # fmt: skip
        if isinstance(e, Unavailable):
            return cls(503, f"{e}; restart the server", "unavailable")
        raise TypeError(f"not an engine's answer: {e!r}") from e

    def about(self, request_id: str) -> ApiError:
        self.headers["X-Request-Id"] = request_id
        return self

    def body(self) -> dict:
        return error(self.message, ERROR_TYPES.get(self.status, "invalid_request_error"), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, self.headers)
