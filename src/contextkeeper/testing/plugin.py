"""The contextkeeper pytest plugin (being written)."""
