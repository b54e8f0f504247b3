"""Settings come from the environment once, with loud errors naming the variable."""

from __future__ import annotations

import pytest

from llm_otel.config import ConfigError, Settings


def test_settings_without_environment_have_the_documented_defaults():
    s = Settings.from_env({})
    assert s.capture_content is False and s.token_events == 4 and s.logprobs_top_k == 5
    assert s.vllm_engine_events is True and s.console == "auto"
    assert s.logit_dist_ratio == 0.05 and s.traces_per_s == 10.0  # issue 19: derivations in Settings


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("true", True),
        ("False", False),
        ("SPAN_ONLY", True),
        ("SPAN_AND_EVENT", True),
        ("NO_CONTENT", False),
        ("EVENT_ONLY", False),
    ],
)
def test_content_capture_accepts_legacy_and_latest_values(raw, expected):
    env = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": raw}
    assert Settings.from_env(env).capture_content is expected


@pytest.mark.parametrize(
    "name, raw",
    [
        ("LLM_OTEL_TOKEN_EVENTS", "many"),
        ("LLM_OTEL_TOKEN_EVENTS", "-1"),
        ("LLM_OTEL_LOGPROBS_TOP_K", "21"),
        ("LLM_OTEL_STALL_FACTOR", "0.5"),
        ("LLM_OTEL_STALL_FACTOR", "nan"),
        ("LLM_OTEL_LOGIT_DIST_RATIO", "1.5"),
        ("LLM_OTEL_TRACES_PER_S", "-1"),
        ("LLM_OTEL_VLLM_ENGINE_EVENTS", "maybe"),
        ("LLM_OTEL_CONSOLE", "fancy"),
        ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "sometimes"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_variable(name, raw):
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: raw})


def test_settings_are_frozen():
    with pytest.raises(Exception):
        Settings().token_events = 3


# --- exporter variables (checked when llm-otel builds the providers, and by `llm-otel doctor`) ----


@pytest.mark.parametrize(
    "name, raw, accepted",
    [
        ("OTEL_METRICS_EXPORTER", "prometeus", "otlp, prometheus, console, none"),
        ("OTEL_METRICS_EXPORTER", "foo", "otlp, prometheus, console, none"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "otlp, console, none"),
        ("OTEL_TRACES_EXPORTER", "prometheus", "otlp, console, none"),  # metrics only
        ("OTEL_TRACES_EXPORTER", "otlp,zipkin", "otlp, console, none"),
        ("OTEL_METRICS_EXPORTER", "otlp,prometheus", "otlp, prometheus, console, none"),  # one per signal
    ],
)
def test_unknown_exporter_names_raise_naming_the_variable_and_the_accepted_values(name, raw, accepted):
    from llm_otel.config import validate_exporter_env
    from llm_otel.export.providers import exporter_choice
    from llm_otel.process.providers import build_providers

    signal = name.split("_")[1]
    for check in (
        lambda: exporter_choice({name: raw}, signal),
        lambda: validate_exporter_env({name: raw}),
        lambda: build_providers(Settings.from_env({}), {name: raw}),
    ):
        with pytest.raises(ConfigError) as err:
            check()
        assert name in str(err.value) and accepted in str(err.value)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, "otlp"),
        ("", "otlp"),
        ("none", "none"),
        (" Console ", "console"),
        ("prometheus", "prometheus"),
        ("otlp,", "otlp"),
        ("none,none", "none"),
    ],
)
def test_exporter_choice_accepts_the_known_names_and_single_exporter_lists(raw, expected):
    from llm_otel.export.providers import exporter_choice

    env = {} if raw is None else {"OTEL_METRICS_EXPORTER": raw}
    assert exporter_choice(env, "METRICS") == expected


@pytest.mark.parametrize(
    "name", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"]
)
@pytest.mark.parametrize("endpoint", [{}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}])
def test_invalid_otlp_protocol_raises_with_or_without_an_endpoint(name, endpoint):
    from llm_otel.config import otlp_protocol, validate_exporter_env
    from llm_otel.process.providers import build_providers

    env = {**endpoint, name: "grpcc"}
    with pytest.raises(ConfigError, match=name):
        validate_exporter_env(env)
    with pytest.raises(ConfigError, match=name):
        build_providers(Settings.from_env({}), env)
    assert otlp_protocol({name: "http/protobuf"}, "TRACES") in ("http/protobuf", "grpc")
    assert (
        otlp_protocol(
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "TRACES"
        )
        == "grpc"
    )


def test_the_config_package_imports_nothing_else_of_llm_otel():
    """``llm_otel.config`` is the leaf every part may import (function-level imports included): an
    import of another llm-otel module from it would bring back the config <-> signals circle."""
    import ast
    import pathlib

    import llm_otel.config as config

    outside = []
    for path in sorted(pathlib.Path(config.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else ["llm_otel.config"]
                if isinstance(node, ast.ImportFrom) and node.level == 1
                else ["llm_otel"]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            outside += [
                f"{path.name}:{node.lineno} {m}"
                for m in modules
                if m.split(".")[0] == "llm_otel" and not (m + ".").startswith("llm_otel.config.")
            ]
    assert outside == []
    assert config.__all__ and all(hasattr(config, name) for name in config.__all__)
