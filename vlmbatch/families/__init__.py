"""Model families: one folder each (adapter, engine model, tiny checkpoint), one record each in `registry.py`."""
