"""The transformers engine (the default, and the exactness reference): engine.py and its helpers."""
