"""Stand-in for vLLM 0.33.0 (module layout only)."""
__version__ = "0.33.0"
