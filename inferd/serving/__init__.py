"""Serving models: specs (what to load), loading by kind, and the registry of served models
with their lifecycle (load, unload with draining, reload)."""
