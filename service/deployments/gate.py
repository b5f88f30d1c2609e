"""The ingress' front door: API-key authentication and per-key limits, as one ASGI middleware plus one
call the handlers make once a request is tokenized (`RequestGate.admit`).

Every `/v1/*` request must carry a configured key (401 `invalid_api_key` otherwise); other paths
(`/health`) stay open. A generation request (`POST /v1/completions`, `/v1/chat/completions`) then
takes a concurrency slot and a request credit (429 `rate_limit_exceeded` with `Retry-After`), holds
the slot until its response body is fully sent or the client leaves, and settles its token
reservation with the real count at that moment. Metrics carry key ids (hash prefixes), never keys.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.deployments.auth import ApiKeys
from service.deployments.counter_batch import CounterBatch
from service.deployments.limits import KeyLimiter, LimitArgs, Refusal, RequestShape, cap_violation
from service.deployments.metric_defs import INGRESS_METRICS
from service.deployments.metrics import make_metric
from service.engine import SamplingParams
from service.openai.protocol import ErrorResponse

logger = logging.getLogger("ray.serve")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TICKET_STATE_KEY = "hybrid_serve_ticket"
UNAUTHENTICATED = "unauthenticated"  # metrics' key label for requests without a valid key

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


@dataclass
class Ticket:
    """One authenticated /v1 request, kept in the ASGI scope's state for the handler."""

    key_id: str  # hash prefix of the caller's key (or "anonymous")
    reserved_tokens: int = 0  # reserved by `admit`
    used_tokens: Callable[[], int] | None = None  # the real count so far (prompt + generated), set by `admit`
    retry_after_s: int | None = None  # set when `admit` refused with 429
    status: int | None = field(default=None)  # HTTP status sent


@dataclass
class GateMetrics:
    """Per-key request, refusal and token counters (Ray Serve metrics of the ingress replica)."""

    live: dict[str, Any] = field(default_factory=lambda: {d.name: make_metric(d) for d in INGRESS_METRICS})
    counts: CounterBatch = field(init=False)

    def __post_init__(self) -> None:
        self.counts = CounterBatch(self.live)

    def request(self, key_id: str, status: int) -> None:
        self.counts.inc("hybrid_serve_api_requests_total", 1, (("key", key_id), ("status", str(status))))

    def refused(self, key_id: str, limit: str) -> None:
        self.counts.inc("hybrid_serve_api_limit_refusals_total", 1, (("key", key_id), ("limit", limit)))

    def tokens(self, key_id: str, tokens: int) -> None:
        if tokens > 0:
            self.counts.inc("hybrid_serve_api_tokens_total", tokens, (("key", key_id),))


def request_shape(n: int, prompts: Sequence[tuple[Sequence[int], Sequence[SamplingParams]]]) -> RequestShape:
    """The shape of a request from its prompts' token ids and their choices' sampling parameters."""
    params = [p for _, ps in prompts for p in ps]
    return RequestShape(
        max_tokens=max(p.max_tokens for p in params),
        n=n,
        num_stop_strings=max(len(p.stop) for p in params),
        top_logprobs=max(p.top_logprobs for p in params),
        prompt_tokens=tuple(len(ids) for ids, _ in prompts),
        num_choices=len(params),
    )


def _route_path(scope: dict) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def _authorization(scope: dict) -> str | None:
    """The request's `Authorization` header value, if any."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            return value.decode("latin-1")
    return None


def _error(err: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.model_dump(mode="json"), status_code=err.status_code, headers=headers)


async def _http_exception_as_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ErrorResponse.make(
        f"{exc.detail}: {request.method} {_route_path(request.scope)}", status=exc.status_code, code=code
    )
    return _error(err, dict(exc.headers or {}))


def _rate_limited(refusal: Refusal) -> ErrorResponse:
    kind = "tokens" if refusal.limit == "tokens_per_minute" else "requests"
    return ErrorResponse.make(
        refusal.message,
        type=kind,
        status=refusal.status,
        code="rate_limit_exceeded",
        param=None if refusal.status == 429 else "max_tokens",
    )


class RequestGate:
    """Keys + limits of one ingress replica. `install(app)` adds the middleware; handlers call `admit`."""

    def __init__(
        self, keys: ApiKeys, limits: LimitArgs, metrics: GateMetrics | None = None, limiter: KeyLimiter | None = None
    ):
        self.keys = keys
        self.limits = limits
        self._limiter = limiter or KeyLimiter(limits)
        self._metrics = metrics

    @classmethod
    def from_args(cls, api_keys_file: str | None, limits: LimitArgs) -> RequestGate:
        keys = ApiKeys.load(api_keys_file)
        if not keys.enabled:
            logger.warning(
                "No API keys configured (api_keys_file / HYBRID_SERVE_API_KEYS): /v1/* is open to "
                "anyone who can reach this endpoint."
            )
        return cls(keys, limits, GateMetrics())

    def wrap(self, app: ASGIApp, fastapi_app: FastAPI) -> ASGIApp:
        """`app` behind the gate's middleware; OpenAI error objects for the FastAPI router's own errors (unknown
        path, wrong method) of `fastapi_app` (which `app` holds)."""
        fastapi_app.add_exception_handler(StarletteHTTPException, _http_exception_as_openai_error)
        return _GateMiddleware(app, self)

    def default_max_tokens(self, room_tokens: int) -> int:
        """max_tokens of a request that sets none: the context room left, at most the max_tokens cap."""
        return min(room_tokens, self.limits.max_tokens or room_tokens)

    def admit(self, request: Request, shape: RequestShape, used_tokens: Callable[[], int]) -> ErrorResponse | None:
        """Per-request caps (400) and the token reservation (429, or 400 when it can never fit); None: go on.
        `used_tokens()` gives the request's real token count when it ends (for the settlement)."""
        ticket: Ticket = request.scope["state"][TICKET_STATE_KEY]
        violation = cap_violation(self.limits, shape)
        if violation is not None:
            param, limit, message = violation
            self._count_refusal(ticket.key_id, limit)
            return ErrorResponse.make(message, param=param, status=400, code="limit_exceeded")
        refusal = self._limiter.reserve_tokens(ticket.key_id, shape.reserved_tokens)
        if refusal is not None:
            self._count_refusal(ticket.key_id, refusal.limit)
            ticket.retry_after_s = refusal.retry_after_s if refusal.status == 429 else None
            return _rate_limited(refusal)
        ticket.reserved_tokens, ticket.used_tokens = shape.reserved_tokens, used_tokens
        return None

    def _count_refusal(self, key_id: str, limit: str) -> None:
        if self._metrics is not None:
            self._metrics.refused(key_id, limit)

    # ---- the middleware's steps ----
    async def handle(self, app: ASGIApp, scope: dict, receive: Callable, send: Callable) -> None:
        path = _route_path(scope)
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await app(scope, receive, send)
            return
        key_id = self.keys.authenticate(_authorization(scope))
        if key_id is None:
            self._count(UNAUTHENTICATED, 401)
            err = ErrorResponse.make(
                "Incorrect or missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                status=401,
                code="invalid_api_key",
            )
            await _error(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        ticket = Ticket(key_id)
        scope.setdefault("state", {})[TICKET_STATE_KEY] = ticket
        if scope.get("method") != "POST" or path not in GENERATION_PATHS:
            await app(scope, receive, self._recording(ticket, send))
            self._count(key_id, ticket.status or 500)
            return
        refusal = self._limiter.start(key_id)
        if refusal is not None:
            self._count_refusal(key_id, refusal.limit)
            self._count(key_id, 429)
            await _error(_rate_limited(refusal), {"Retry-After": str(refusal.retry_after_s)})(scope, receive, send)
            return
        try:
            await app(scope, receive, self._recording(ticket, send))
        finally:
            self._limiter.finish(key_id)
            self._settle(ticket)
            self._count(key_id, ticket.status or 499)  # 499: the client left before any response

    def _recording(self, ticket: Ticket, send: Callable) -> Callable:
        """`send` that records the status and adds Retry-After to a 429 the handler returned."""

        async def wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                ticket.status = int(message["status"])
                if ticket.status == 429 and ticket.retry_after_s:
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"retry-after", str(ticket.retry_after_s).encode())],
                    }
            await send(message)

        return wrapped

    def _settle(self, ticket: Ticket) -> None:
        if ticket.used_tokens is None:
            return
        try:
            used = int(ticket.used_tokens())
        except Exception:  # a failed count must not leak the reservation: settle at the reserved amount
            logger.exception("counting a request's tokens failed")
            used = ticket.reserved_tokens
        self._limiter.settle_tokens(ticket.key_id, ticket.reserved_tokens, used)
        if self._metrics is not None:
            self._metrics.tokens(ticket.key_id, used)

    def _count(self, key_id: str, status: int) -> None:
        if self._metrics is not None:
            self._metrics.request(key_id, status)


class _GateMiddleware:
    """Pure ASGI middleware (streaming bodies pass through untouched)."""

    def __init__(self, app: ASGIApp, gate: RequestGate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.gate.handle(self.app, scope, receive, send)


class HotRoutes:
    """ASGI app: a `POST` to one of `handlers`' paths calls that handler directly (a Starlette `Request` in, the
    response it returns sent), not through FastAPI's middleware stack, routing and endpoint wrappers, which cost
    more per request and per streamed event than the handler itself; every other request goes to `app`."""

    def __init__(self, handlers: dict[str, Callable[[Request], Awaitable[Any]]], app: ASGIApp):
        self._handlers = handlers
        self._app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        handler = self._handlers.get(_route_path(scope)) if scope["type"] == "http" else None
        if handler is None or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)
