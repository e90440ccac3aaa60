"""Grammars on llguidance, shared by every engine: compiled in worker processes, checked once."""
