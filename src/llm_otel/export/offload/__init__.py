"""The exporter process (being split into one module per concept)."""

from llm_otel.export.offload.writer import *  # noqa: F401,F403
from llm_otel.export.offload.writer import _RemoteInstrument, _span_count  # noqa: F401
