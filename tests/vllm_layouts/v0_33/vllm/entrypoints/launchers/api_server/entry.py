# mirrors vllm/entrypoints/launchers/api_server/entry.py, which calls build_app by this imported name
from ..app import build_app  # noqa: F401
