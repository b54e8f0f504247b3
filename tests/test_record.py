"""RequestRecord: every field it keeps is one the core reads (the record is the hot path's only
state; a field nobody reads is memory per request and a false promise to readers of the code)."""

from __future__ import annotations

import pathlib
import re

from llm_otel.telemetry.record import RequestRecord

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "llm_otel"


def _read_in(slot: str, text: str) -> bool:
    """``.slot`` other than as the target of a plain assignment, or ``getattr(x, "slot"...)``."""
    return bool(
        re.search(r"\." + slot + r"\b(?!\s*=[^=])", text) or re.search(r"getattr\([^)]*[\"']" + slot + r"[\"']", text)
    )


def test_every_request_record_field_is_read_somewhere_under_src():
    """By name, so a field whose name other objects share (``context``: span contexts) passes
    here however dead it is; the next test names the fields issue 21 found dead."""
    texts = [p.read_text() for p in SRC.rglob("*.py")]
    assert [slot for slot in RequestRecord.__slots__ if not any(_read_in(slot, t) for t in texts)] == []


def test_dead_fields_found_by_issue_21_are_gone():
    """``context``, ``first_token_mono``/``last_token_mono`` were never read; ``engine_version``,
    ``choice_index``, ``user_logprobs`` were write-only copies of what ``Telemetry.start_request``
    puts on the request span."""
    for name in ("context", "first_token_mono", "last_token_mono", "engine_version", "choice_index", "user_logprobs"):
        assert not hasattr(RequestRecord, name), name
