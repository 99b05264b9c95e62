"""Adapters for the frameworks people build agents with (LangChain, Pydantic AI, the OpenAI Agents SDK, LiteLLM,
LlamaIndex, Agent Framework), one module each, importing their framework only when used."""
