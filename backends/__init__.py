"""Engines behind the gateway: one module per library, loaded lazily by name (registry.py);
the contract they implement is engine.py."""
