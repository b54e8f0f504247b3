"""Settings come from the environment once, with loud errors naming the variable."""

from __future__ import annotations

import pytest

from llm_otel.config import ConfigError, Settings


def test_defaults():
    s = Settings.from_env({})
    assert s.capture_content is False and s.token_events == 16 and s.logprobs_top_k == 5
    assert s.vllm_engine_events is True and s.console == "auto"


@pytest.mark.parametrize("raw, expected", [("true", True), ("False", False), ("SPAN_ONLY", True),
                                           ("SPAN_AND_EVENT", True), ("NO_CONTENT", False), ("EVENT_ONLY", False)])
def test_content_capture_accepts_legacy_and_latest_values(raw, expected):
    env = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": raw}
    assert Settings.from_env(env).capture_content is expected


@pytest.mark.parametrize("name, raw", [
    ("LLM_OTEL_TOKEN_EVENTS", "many"),
    ("LLM_OTEL_TOKEN_EVENTS", "-1"),
    ("LLM_OTEL_LOGPROBS_TOP_K", "21"),
    ("LLM_OTEL_STALL_FACTOR", "0.5"),
    ("LLM_OTEL_STALL_FACTOR", "nan"),
    ("LLM_OTEL_LOGIT_DIST_RATIO", "1.5"),
    ("LLM_OTEL_VLLM_ENGINE_EVENTS", "maybe"),
    ("LLM_OTEL_CONSOLE", "fancy"),
    ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "sometimes"),
])
def test_invalid_values_raise_config_error_naming_the_variable(name, raw):
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: raw})


def test_settings_are_frozen():
    with pytest.raises(Exception):
        Settings().token_events = 3
