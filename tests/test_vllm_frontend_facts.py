"""What a user reads adds up (issue 28, item 7), on the real vLLM engine (the session ``engine``):
the request span carries the id the caller got back (``gen_ai.response.id`` = the offline
``RequestOutput.request_id``), and the console tree (what ``llm-otel demo`` prints) shows the
phases of ``llm.prompt`` - frontend, engine-input wait, queue, prefill - which add up to the TTFT
it prints."""

from __future__ import annotations

import re

import pytest

from llm_otel.export.console import format_tree

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "for key, value in sorted("]


@pytest.fixture
def eng(engine):
    engine.clear()
    yield engine


def generate(eng, prompts=PROMPTS, **params):
    from vllm import SamplingParams

    defaults = dict(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    defaults.update(params)
    return eng.llm.generate(prompts, SamplingParams(**defaults), use_tqdm=False)


def roots(eng):
    return [s for s in eng.captured.finished() if s.name == f"text_completion {eng.model}"]


def test_offline_request_span_carries_the_request_output_id(eng):
    outputs = generate(eng)
    spans = roots(eng)
    assert len(spans) == len(outputs)
    assert sorted(s.attributes["gen_ai.response.id"] for s in spans) == sorted(o.request_id for o in outputs)
    for s in spans:  # vLLM's internal id is the response id plus a suffix of its own
        assert s.attributes["llm.request.id"].startswith(s.attributes["gen_ai.response.id"] + "-")


def test_every_choice_of_an_n2_request_carries_the_one_response_id(eng):
    (out,) = generate(eng, PROMPTS[:1], n=2)
    spans = roots(eng)
    assert len(spans) == 2 == len(out.outputs)
    assert {s.attributes["gen_ai.response.id"] for s in spans} == {out.request_id}


def _printed_ms(line: str, label: str) -> tuple[float, float]:
    """The value of ``label=...ms`` in a printed tree line, and its rounding half-step (the tree
    prints 3 significant digits, whole milliseconds from 100 ms)."""
    text = re.search(rf"\b{label}=([0-9.e+-]+)ms", line).group(1)
    value = float(text)
    if "e" in text:
        mantissa, exponent = text.split("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return value, 0.5 * 10 ** (int(exponent) - decimals)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return value, 0.5 * 10**-decimals


def test_console_tree_prints_phases_that_add_up_to_the_ttft(eng):
    outputs = generate(eng)
    spans = eng.captured.finished()
    request_roots = roots(eng)
    assert len(request_roots) == len(outputs) == len(PROMPTS)  # the loop below checks every request
    for root in request_roots:
        tree = format_tree([s for s in spans if s.context.trace_id == root.context.trace_id])
        lines = tree.splitlines()
        (prompt_line,) = [ln for ln in lines if "llm.prompt" in ln]
        ttft, ttft_step = _printed_ms(lines[0], "ttft")
        total, steps = 0.0, ttft_step
        for label in ("frontend", "input_wait", "queue", "prefill"):
            value, step = _printed_ms(prompt_line, label)
            total, steps = total + value, steps + step
        assert total == pytest.approx(ttft, abs=steps + 1e-3), tree  # 1 us: the engine stamps' clamps
        # and the unrounded attributes sum exactly
        (prompt,) = [s for s in spans if s.name == "llm.prompt" and s.parent.span_id == root.context.span_id]
        a = prompt.attributes
        phases = (
            a["llm.request.frontend.duration"]
            + a["llm.request.engine_input_wait.duration"]
            + a["llm.request.queue.duration"]
            + a["llm.request.prefill.duration"]
        )
        assert phases == pytest.approx(root.attributes["llm.time_to_first_token"], abs=2e-6)
