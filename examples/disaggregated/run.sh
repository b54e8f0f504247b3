#!/usr/bin/env bash
# Prefill/decode disaggregation on one machine, traced (docs/disaggregated.md):
#   a kv_producer and a kv_consumer vLLM OpenAI server with ExampleConnector (KV through a shared
#   directory), the proxy in front (port 8000), spans and metrics to an OTLP collector.
#
#   docker compose -f examples/compose/compose.yaml up -d   # collector, Jaeger/Tempo, Prometheus
#   MODEL=/path/to/model examples/disaggregated/run.sh [--nixl-params] [--traceparent-to prefill]
#   curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#        -d '{"model":"'"$MODEL"'","prompt":"...","max_tokens":16}'
#
# On a CPU build of vLLM set VLLM_CPU_KVCACHE_SPACE (GiB). Ctrl-C stops all three.
set -euo pipefail
: "${MODEL:?set MODEL to a model path or name}"
PY=${PYTHON:-python}
STORE=${KV_STORE:-$(mktemp -d /tmp/pd-kv.XXXXXX)}
export OTEL_EXPORTER_OTLP_ENDPOINT=${OTEL_EXPORTER_OTLP_ENDPOINT:-http://127.0.0.1:4317}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
kv() { printf '{"kv_connector":"ExampleConnector","kv_role":"%s","kv_connector_extra_config":{"shared_storage_path":"%s"}}' "$1" "$STORE"; }
serve() {  # name port role
  OTEL_SERVICE_NAME=$1 opentelemetry-instrument "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --port "$2" --kv-transfer-config "$(kv "$3")" --enable-prompt-tokens-details &
}
trap 'kill 0' EXIT INT TERM
serve prefill 8100 kv_producer
serve decode 8200 kv_consumer
for port in 8100 8200; do
  until curl -sf "localhost:$port/health" >/dev/null; do sleep 2; done
done
"$PY" "$(dirname "$0")/proxy.py" --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 "$@"
