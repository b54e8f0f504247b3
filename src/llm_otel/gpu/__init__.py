"""GPU-side telemetry: utilisation signals (NVML) for the adaptive sampler."""
