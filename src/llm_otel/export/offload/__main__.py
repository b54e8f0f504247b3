"""``python -m llm_otel.export.offload``: the exporter process (:func:`llm_otel.export.offload.main.main`),
started by :class:`~llm_otel.export.offload.writer.OffloadBuffer`."""

import sys

from llm_otel.export.offload.main import main

if __name__ == "__main__":
    sys.exit(main())
