# mirrors vllm/tracing/otel.py (present in 0.32 and 0.33 alike; llm-otel does not hook it)
def init_tracer(name, endpoint):
    return None
