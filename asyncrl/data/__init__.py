"""Example data shipped with asyncrl (read through importlib.resources)."""
