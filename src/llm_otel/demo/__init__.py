"""Demo helpers for llm-otel (tiny local models and example workloads)."""
