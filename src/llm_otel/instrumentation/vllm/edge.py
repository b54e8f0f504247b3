"""The OpenAI server's HTTP edge: requests refused before vLLM's handler runs still get their span.

vLLM answers some requests before its OpenAI handler (the one :func:`.inbound.traced_handler`
wraps) is called: FastAPI's body validation (``RequestValidationError``: ``"max_tokens": "abc"``,
a body that is not JSON; vLLM answers 400), vLLM's own request validators (an empty prompt),
``--api-key`` (``AuthenticationMiddleware``: 401), elastic scaling (``ScalingMiddleware``: 503),
and a route whose handler the model does not have (501). :class:`RefusalEdge`, a pure ASGI
middleware put outermost on the app ``build_app`` returns (``vllm/entrypoints/launchers/app.py``,
vLLM 0.32), sees each POST to a request route (:data:`ROUTE_OPERATIONS`) end; when the response
is an error and no handler hook traced the request (:attr:`Exchange.traced`), it hands the
:class:`Exchange` to the adapter, which records the one SERVER span and the count. The exception
handlers vLLM registered are wrapped to note the exception's class (``error.type``) and, for a
body that parsed as JSON, the ``model`` it named.

Every value a client sends is bounded before it becomes a span name or a metric dimension
(:func:`bounded_model`; docs/semconv.md, "Values a client chooses").
"""

from __future__ import annotations

import contextvars
import inspect
import time
from collections.abc import Callable
from typing import Any

from llm_otel.errors import guard

# POST routes of vLLM 0.32's OpenAI server whose handlers llm-otel traces -> gen_ai.operation.name
# (vllm/entrypoints/openai/*/api_router.py, vllm/entrypoints/pooling/*/api_router.py)
ROUTE_OPERATIONS = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
    "/v2/embed": "embeddings",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "score",
    "/v1/rerank": "score",
    "/v2/rerank": "score",
    "/pooling": "encode",
}
OTHER = "_OTHER"  # gen_ai.request.model of a refused request that named no model this server serves
# Exchange.requested when the body was never parsed (authentication, a body that is not JSON)
UNKNOWN: Any = object()


class Exchange:
    """One POST to a request route, from the edge's point of view.

    Attributes:
        operation: ``gen_ai.operation.name`` of the route (:data:`ROUTE_OPERATIONS`).
        arrival_s: wall-clock seconds when the edge saw the request.
        status: the HTTP status of the response (``http.response.start``), None before it.
        error_type: class name of the exception vLLM's exception handler got, None without one.
        requested: the body's ``model`` value when FastAPI parsed the body (None: the body named
            none), :data:`UNKNOWN` when the body was never parsed.
        inbound: the handler hook's :class:`.inbound.Inbound` when vLLM's handler ran.
    """

    __slots__ = ("operation", "arrival_s", "status", "error_type", "requested", "inbound")

    def __init__(self, operation: str, arrival_s: float) -> None:
        self.operation = operation
        self.arrival_s = arrival_s
        self.status: int | None = None
        self.error_type: str | None = None
        self.requested: Any = UNKNOWN
        self.inbound: Any = None

    @property
    def traced(self) -> bool:
        """Whether a handler hook already traced this request: it started an engine request (its
        span ends with it) or recorded the refusal itself."""
        inbound = self.inbound
        return inbound is not None and bool(inbound.started or inbound.rejected)

    def note(self, exc: BaseException) -> None:
        """What an exception handler of vLLM got: its class, and the ``model`` of a parsed body
        (FastAPI's ``RequestValidationError.body``)."""
        if self.error_type is None:
            self.error_type = type(exc).__qualname__
        body = getattr(exc, "body", UNKNOWN)
        if isinstance(body, dict):
            self.requested = body.get("model")


#: the exchange of the HTTP request this task serves (set by :class:`RefusalEdge`; the handler's
#: task and the tasks vLLM starts for it inherit it)
EXCHANGE: contextvars.ContextVar[Exchange | None] = contextvars.ContextVar("llm_otel_vllm_exchange", default=None)


class RefusalEdge:
    """Pure ASGI middleware: a POST to one of ``routes`` (path -> operation) that ends with an
    HTTP error (>= 400, or an exception: 500) and that no handler hook traced goes to
    ``on_refused(exchange, scope)`` once the response is sent. Other requests pass through
    untouched (one dict lookup)."""

    def __init__(self, app: Any, routes: dict[str, str], on_refused: Callable[[Exchange, dict], None]) -> None:
        self.app = app
        self.routes = routes
        self.on_refused = on_refused

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        operation = None
        if scope.get("type") == "http" and scope.get("method") == "POST":
            path = scope.get("path", "")
            root = scope.get("root_path") or ""
            operation = self.routes.get(path[len(root) :] if root and path.startswith(root) else path)
        if operation is None:
            await self.app(scope, receive, send)
            return
        exchange = Exchange(operation, time.time())
        token = EXCHANGE.set(exchange)

        async def send_noting_status(message: dict) -> None:
            if message.get("type") == "http.response.start":
                exchange.status = message.get("status")
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception as error:  # noqa: BLE001 - noted and raised again, unchanged
            if exchange.error_type is None:
                exchange.error_type = type(error).__qualname__
            if exchange.status is None:
                exchange.status = 500  # Starlette's ServerErrorMiddleware, outside us, answers 500
            raise
        finally:
            EXCHANGE.reset(token)
            status = exchange.status
            if status is not None and status >= 400 and not exchange.traced:
                self.on_refused(exchange, scope)


def noting_handler(handler: Callable) -> Callable:
    """An exception handler of the app that first notes the exception on the current
    :class:`Exchange` (:meth:`Exchange.note`), then calls ``handler`` as Starlette would (async or
    not, the same arguments, its response returned)."""

    def note(exc: BaseException) -> None:
        exchange = EXCHANGE.get()
        if exchange is not None:
            with guard("vllm.http_edge.note"):
                exchange.note(exc)

    if _is_async(handler):

        async def async_noting(request: Any, exc: BaseException) -> Any:
            note(exc)
            return await handler(request, exc)

        async_noting.__wrapped__ = handler  # type: ignore[attr-defined]
        return async_noting

    def noting(request: Any, exc: BaseException) -> Any:
        note(exc)
        return handler(request, exc)

    noting.__wrapped__ = handler  # type: ignore[attr-defined]
    return noting


def _is_async(handler: Callable) -> bool:
    try:  # Starlette's own test (functools.partial, objects with an async __call__)
        from starlette._utils import is_async_callable

        return bool(is_async_callable(handler))
    except ImportError:  # silent: Starlette without it; the plain test below
        return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
        )


EDGE_MARK = "llm_otel_refusal_edge"


def install_edge(app: Any, on_refused: Callable[[Exchange, dict], None]) -> bool:
    """Put :class:`RefusalEdge` outermost on vLLM's FastAPI ``app`` (inside Starlette's
    ``ServerErrorMiddleware``, outside vLLM's authentication, CORS, scaling and SageMaker
    middleware) for the request routes the app has, and wrap its exception handlers
    (:func:`noting_handler`). Once per app (the function that builds it may be wrapped under two
    names); returns whether it did now. Raises what Starlette raises for an app it cannot change
    (the caller's guard reports it; the app then serves untraced refusals, as before)."""
    state = getattr(app, "state", None)
    if state is None or getattr(state, EDGE_MARK, False):
        return False
    routes = {}
    for route in getattr(app, "routes", ()):
        path = getattr(route, "path", None)
        if path in ROUTE_OPERATIONS and "POST" in (getattr(route, "methods", None) or ()):
            routes[path] = ROUTE_OPERATIONS[path]
    from starlette.middleware import Middleware

    handlers = getattr(app, "exception_handlers", None)
    if isinstance(handlers, dict):
        for key, handler in list(handlers.items()):
            handlers[key] = noting_handler(handler)
    app.user_middleware.insert(0, Middleware(RefusalEdge, routes=routes, on_refused=on_refused))
    if app.middleware_stack is not None:
        # built already (vLLM's SageMaker bootstrap builds it inside build_app): rebuilt the way that
        # bootstrap does, so the stack has the edge and the exception handlers noting their exception
        app.middleware_stack = app.build_middleware_stack()
    setattr(state, EDGE_MARK, True)
    return True


def served_models(scope: dict) -> Any:
    """vLLM's ``OpenAIServingModels`` of the app serving ``scope`` (``app.state.openai_serving_models``,
    set by ``init_app_state``), or None."""
    app = scope.get("app")
    return getattr(getattr(app, "state", None), "openai_serving_models", None)


def bounded_model(models: Any, requested: Any, lora_bound: Callable[[str], str]) -> str:
    """``gen_ai.request.model`` (metric dimension and span name) of a request vLLM refused, from
    the ``model`` the client sent (``requested``) and vLLM's ``OpenAIServingModels`` (``models``):

    * a served model name (``is_base_model``: ``--served-model-name``) -> that name;
    * a loaded LoRA adapter (``lora_requests``) -> ``lora_bound(name)`` (the adapter, or ``_OTHER``
      past the per-process adapter bound);
    * no model (None or ``""``: vLLM serves its first served name) -> that name (``model_name()``);
    * anything else, and a body never parsed (:data:`UNKNOWN`) -> ``_OTHER``.

    A client string never becomes a dimension value by itself: the values are the names the
    operator serves, plus ``_OTHER``. Never raises (``_OTHER`` when ``models`` cannot say)."""
    try:
        if requested is UNKNOWN or models is None:
            return OTHER
        if requested is None or requested == "":
            name = models.model_name() if hasattr(models, "model_name") else models.base_model_paths[0].name
            return str(name) if isinstance(name, str) and name else OTHER
        if not isinstance(requested, str):
            return OTHER
        if models.is_base_model(requested):
            return requested
        loras = getattr(models, "lora_requests", None)
        if isinstance(loras, dict) and requested in loras:
            return lora_bound(requested)
    except Exception:  # noqa: BLE001 - silent: a vLLM layout without these: the bounded fallback
        return OTHER
    return OTHER
