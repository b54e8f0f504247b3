import sys

from llm_otel.export.offload.writer import main

sys.exit(main())
