"""pytest support for prompt budgets (the plugin registers itself through the ``pytest11`` entry point)."""
