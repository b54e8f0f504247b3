"""The bounds on what a client chooses (case C26, docs/semconv.md "Values a client chooses"), unit
by unit: the model of a refused OpenAI request, the HTTP edge's pass-through and its one call per
untraced refusal, ids cut on spans, per-process bounds on model dimensions. The same through the
real server: tests/test_vllm_refusals.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
from opentelemetry.trace import SpanKind

from llm_otel.instrumentation.vllm.edge import OTHER, UNKNOWN, Exchange, RefusalEdge, bounded_model, noting_handler
from llm_otel.instrumentation.vllm.inbound import Inbound
from llm_otel.telemetry.bounds import MAX_ID_CHARS
from llm_otel.telemetry.metrics import BoundedValues


class ServedModels:
    """Stand-in for vLLM's ``OpenAIServingModels`` (vllm/entrypoints/openai/models/serving.py:83):
    ``is_base_model(name)`` (line 141), ``model_name()`` = ``base_model_paths[0].name`` (line 144),
    ``lora_requests`` (name -> LoRARequest, line 110)."""

    def __init__(self, names: list[str], loras: tuple[str, ...] = ()) -> None:
        self.names = names
        self.lora_requests = {name: object() for name in loras}

    def is_base_model(self, name: str) -> bool:
        return name in self.names

    def model_name(self, lora_request=None) -> str:
        return self.names[0]


@pytest.mark.parametrize(
    "requested, expected",
    [
        ("tiny", "tiny"),  # a served name
        ("tiny-alias", "tiny-alias"),  # another --served-model-name
        ("sql-lora", "sql-lora"),  # a loaded LoRA adapter
        (None, "tiny"),  # omitted: vLLM serves its first served name
        ("", "tiny"),
        ("not-served", OTHER),
        ("x" * 10_000, OTHER),
        (123, OTHER),  # a JSON body with a number for the model
        (["tiny"], OTHER),
        (UNKNOWN, OTHER),  # the body was never parsed (401, not JSON)
    ],
)
def test_a_refused_requests_model_is_a_served_name_or_other(requested, expected):
    models = ServedModels(["tiny", "tiny-alias"], loras=("sql-lora",))
    assert bounded_model(models, requested, lambda name: name) == expected


def test_lora_names_of_refusals_share_the_per_process_adapter_bound():
    bound = BoundedValues(1, "LoRA adapters served")
    models = ServedModels(["tiny"], loras=("a", "b"))
    assert [bounded_model(models, name, bound) for name in ("a", "b", "a")] == ["a", OTHER, "a"]


def test_without_vllms_served_models_every_refusal_is_other():
    class Broken:
        def is_base_model(self, name):
            raise RuntimeError("layout changed")

    assert bounded_model(None, "tiny", lambda n: n) == OTHER
    assert bounded_model(Broken(), "tiny", lambda n: n) == OTHER


def _run(edge, scope, body_messages=()):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(edge(scope, receive, send))
    return sent


def _scope(path="/v1/completions", method="POST", root_path=""):
    return {"type": "http", "method": method, "path": root_path + path, "root_path": root_path, "headers": []}


class App:
    """An ASGI app answering ``status``; ``inbound`` set on the exchange as the handler hook does."""

    def __init__(self, status=400, inbound=None, raises=None):
        self.status, self.inbound, self.raises = status, inbound, raises
        self.exchanges = []

    async def __call__(self, scope, receive, send):
        from llm_otel.instrumentation.vllm.edge import EXCHANGE

        exchange = EXCHANGE.get()
        self.exchanges.append(exchange)
        if exchange is not None and self.inbound is not None:
            exchange.inbound = self.inbound
        if self.raises is not None:
            raise self.raises
        await send({"type": "http.response.start", "status": self.status, "headers": [(b"x-a", b"1")]})
        await send({"type": "http.response.body", "body": b'{"error": 1}'})


def test_the_edge_passes_every_message_through_and_reports_an_untraced_refusal_once():
    refused = []
    app = App(status=400)
    edge = RefusalEdge(app, {"/v1/completions": "text_completion"}, lambda ex, scope: refused.append(ex))
    sent = _run(edge, _scope())
    assert sent == [
        {"type": "http.response.start", "status": 400, "headers": [(b"x-a", b"1")]},
        {"type": "http.response.body", "body": b'{"error": 1}'},
    ]
    (exchange,) = refused
    assert (exchange.operation, exchange.status, exchange.error_type, exchange.requested) == (
        "text_completion",
        400,
        None,
        UNKNOWN,
    )


@pytest.mark.parametrize(
    "status, started, rejected, reported",
    [
        (200, 1, False, False),  # served
        (400, 0, True, False),  # the handler hook traced the refusal itself
        (500, 1, False, False),  # failed after an engine request started: its span ends with it
        (404, 0, False, True),  # the handler ran but traced nothing: the edge does
    ],
)
def test_the_edge_leaves_requests_a_handler_hook_traced_alone(status, started, rejected, reported):
    refused = []
    inbound = Inbound(None, "chat")
    inbound.started, inbound.rejected = started, rejected
    edge = RefusalEdge(App(status, inbound), {"/v1/chat/completions": "chat"}, lambda ex, s: refused.append(ex))
    _run(edge, _scope("/v1/chat/completions"))
    assert bool(refused) == reported


def test_an_exception_out_of_the_app_is_a_500_refusal_with_its_class_and_is_raised_unchanged():
    refused = []
    error = KeyError("x")
    edge = RefusalEdge(App(raises=error), {"/v1/completions": "text_completion"}, lambda ex, s: refused.append(ex))
    with pytest.raises(KeyError) as raised:
        _run(edge, _scope())
    assert raised.value is error
    assert (refused[0].status, refused[0].error_type) == (500, "KeyError")


@pytest.mark.parametrize(
    "scope",
    [
        _scope("/v1/models"),  # not a request route
        _scope(method="GET"),
        {"type": "lifespan"},
        {"type": "websocket", "path": "/v1/completions"},
    ],
)
def test_other_requests_pass_with_no_exchange(scope):
    app = App(status=404)
    edge = RefusalEdge(app, {"/v1/completions": "text_completion"}, lambda ex, s: pytest.fail("traced"))
    _run(edge, scope)
    assert app.exchanges == [None]


def test_a_root_path_is_taken_off_before_the_route_lookup():
    refused = []
    edge = RefusalEdge(App(401), {"/v1/completions": "text_completion"}, lambda ex, s: refused.append(ex))
    _run(edge, _scope(root_path="/llm"))
    assert refused and refused[0].status == 401


class RequestValidationError(Exception):
    """Stand-in for FastAPI's (fastapi/exceptions.py), which keeps the parsed body as ``.body``."""

    def __init__(self, body):
        self.body = body


def test_exception_handlers_note_the_class_and_the_parsed_bodys_model():
    from llm_otel.instrumentation.vllm.edge import EXCHANGE

    async def handler(request, exc):
        return "answer"

    def sync_handler(request, exc):
        return "sync answer"

    exchange = Exchange("chat", 0.0)
    token = EXCHANGE.set(exchange)
    try:
        noting = noting_handler(handler)
        assert asyncio.iscoroutinefunction(noting)
        assert asyncio.run(noting(None, RequestValidationError({"model": "m", "messages": "x"}))) == "answer"
        assert noting_handler(sync_handler)(None, ValueError()) == "sync answer"
    finally:
        EXCHANGE.reset(token)
    assert (exchange.error_type, exchange.requested) == ("RequestValidationError", "m")  # the first one noted
    assert noting_handler(sync_handler)(None, ValueError()) == "sync answer"  # no exchange: just the handler


def test_ids_a_client_chooses_are_cut_on_the_request_span(captured):
    long_id = "cmpl-" + "r" * 5000
    rec = captured.telemetry.start_request(
        long_id,
        operation="text_completion",
        provider="vllm",
        model="tiny",
        arrival_s=1.0,
        input_tokens=1,
        kind=SpanKind.SERVER,
        request_attributes={"gen_ai.response.id": long_id},
    )
    captured.telemetry.finish(rec)
    (span,) = [s for s in captured.finished() if s.name == "text_completion tiny"]
    assert span.attributes["llm.request.id"] == long_id[:MAX_ID_CHARS]
    assert span.attributes["gen_ai.response.id"] == long_id[:MAX_ID_CHARS]
    assert rec.request_id == long_id  # the engine's id itself is kept whole for correlation


def test_the_models_an_application_calls_are_bounded_on_client_metrics(captured):
    from llm_otel.telemetry.client import MAX_CLIENT_MODELS

    calls = captured.telemetry.client_calls("triton")
    for i in range(MAX_CLIENT_MODELS + 10):
        call = calls.start(operation="infer", model=f"m{i}", server={}, attributes={})
        calls.finish(call)
    models = {p.attributes["gen_ai.request.model"] for p in captured.metric_points("gen_ai.client.operation.duration")}
    assert len(models) == MAX_CLIENT_MODELS + 1 and "_OTHER" in models


def test_bounded_values_hold_their_limit_under_threads():
    bound = BoundedValues(8, "values")
    out: list[str] = []

    def worker(k: int) -> None:
        out.extend(bound(f"v{k}-{i}") for i in range(200))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out) - {"_OTHER"}) == 8
