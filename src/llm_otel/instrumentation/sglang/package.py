"""The SGLang distribution this instrumentation supports (contract goldens: tests/contracts/sglang-*.json)."""

_instruments: tuple[str, ...] = ("sglang >= 0.5.22",)
