"""Serving-engine profiles of the emulation, the real-kernel oracle harness and the engine bundle."""
