"""The tritonclient versions this instrumentation supports."""

_instruments = ("tritonclient >= 2.30",)
