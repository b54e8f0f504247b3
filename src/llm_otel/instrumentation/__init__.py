"""Engine adapters: which functions to wrap, how to read the engine's objects, how to call the core."""
