"""Helpers shared by test areas (importable as `support.<module>`; tests/ is on pytest's pythonpath)."""
