"""Contract tests: the engine functions llm-otel hooks, held to the engines' real source."""
