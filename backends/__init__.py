"""Engines behind the gateway: one module per library, loaded lazily by name (see base.py)."""
