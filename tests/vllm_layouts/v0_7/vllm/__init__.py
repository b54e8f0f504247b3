"""Stand-in for vLLM 0.7.3 (module layout only)."""
__version__ = "0.7.3"
