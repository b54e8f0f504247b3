"""A small prefill/decode proxy in front of two vLLM OpenAI servers (the shape of vLLM's
disaggregated-serving examples and of llm-d's P/D sidecar): each ``/v1/completions`` request goes
to the prefill instance with ``max_tokens=1``, then to the decode instance, whose answer the
client gets.

    python examples/disaggregated/proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--nixl-params] [--traceparent-to both|prefill|none]

``--nixl-params``: the proxy does what NIXL-style proxies do with ``kv_transfer_params``: it asks
the prefill instance for ``{"do_remote_decode": true}``, copies the ``kv_transfer_params`` of the
prefill response into the decode request with ``do_remote_prefill: true`` and the prefill side's
cached prompt tokens (``remote_prefill_cached_tokens``), as vLLM's NIXL scheduler does - read from
the prefill response's ``usage.prompt_tokens_details.cached_tokens``, which vLLM fills only when
the prefill server runs with ``--enable-prompt-tokens-details`` (otherwise 0 is passed on). llm-otel on
the prefill instance puts the request's trace context into those parameters, so the decode
instance joins the trace even when the proxy forwards no ``traceparent`` to it
(``--traceparent-to prefill``: only the prefill instance gets the client's trace headers;
``none``: neither does, the prefill instance starts the trace).

Only ``/v1/completions`` (JSON or ``stream: true``) and ``/health``; no retries, no load balancing.
Uses only what vLLM already installs (starlette, uvicorn, httpx).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FORWARDED = ("traceparent", "tracestate", "baggage", "authorization", "x-request-id")


def build_app(prefill: str, decode: str, *, nixl_params: bool = False, traceparent_to: str = "both") -> Starlette:
    """The proxy as an ASGI app: ``prefill`` / ``decode`` are the two servers' base URLs;
    ``traceparent_to``: ``both`` | ``prefill`` | ``none`` - who gets the client's trace headers.
    Raises ValueError for another ``traceparent_to``."""
    if traceparent_to not in ("both", "prefill", "none"):
        raise ValueError(f"traceparent_to must be both, prefill or none, got {traceparent_to!r}")
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))

    def headers_of(request: Request, trace: bool) -> dict[str, str]:
        names = FORWARDED if trace else tuple(n for n in FORWARDED if n not in ("traceparent", "tracestate"))
        return {n: request.headers[n] for n in names if n in request.headers}

    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        headers = headers_of(request, traceparent_to != "none")
        first = {**body, "max_tokens": 1, "stream": False}
        first.pop("stream_options", None)
        if nixl_params:
            first["kv_transfer_params"] = {"do_remote_decode": True}
        r = await client.post(prefill + "/v1/completions", json=first, headers=headers)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        prefilled = r.json()
        headers = headers_of(request, traceparent_to == "both")
        second = dict(body)
        params = prefilled.get("kv_transfer_params")
        if params is not None or nixl_params:
            params = dict(params or {})
            if nixl_params:
                params["do_remote_prefill"] = True
                params.pop("do_remote_decode", None)
                cached = ((prefilled.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                params["remote_prefill_cached_tokens"] = int(cached or 0)
            second["kv_transfer_params"] = params
        if body.get("stream"):
            req = client.build_request("POST", decode + "/v1/completions", json=second, headers=headers)
            upstream = await client.send(req, stream=True)

            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream")
        r = await client.post(decode + "/v1/completions", json=second, headers=headers)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"prefill": prefill, "decode": decode})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await client.aclose()

    return Starlette(
        routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, help="base URL of the kv_producer vLLM server")
    parser.add_argument("--decode", required=True, help="base URL of the kv_consumer vLLM server")
    parser.add_argument("--nixl-params", action="store_true", help="carry kv_transfer_params as NIXL-style proxies do")
    parser.add_argument(
        "--traceparent-to", choices=("both", "prefill", "none"), default="both", help="who gets the trace headers"
    )
    args = parser.parse_args()
    app = build_app(args.prefill, args.decode, nixl_params=args.nixl_params, traceparent_to=args.traceparent_to)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
