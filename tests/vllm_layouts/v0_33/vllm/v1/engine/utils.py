# mirrors vllm/v1/engine/utils.py, which imports vllm.v1.utils.shutdown by name (engine-core processes)
from vllm.v1.utils import shutdown  # noqa: F401
