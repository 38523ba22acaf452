"""Diagnostics: fault injection and peer liveness (more tools are added by other components)."""
