"""Wire formats <-> messages. Each format turns its request body into :mod:`contextkeeper.messages` and a fitted
list back into its own shape; OpenAI chat completions are spoken natively by the messages layer today, and the
OpenAI Responses and Anthropic Messages formats come here next (one module each)."""
