"""The openai SDK: ``OpenAI``, ``AsyncOpenAI`` and any OpenAI-compatible ``base_url`` (vLLM, SGLang, llama.cpp's
server, Ollama).

``keeper.wrap(client)`` returns an object with the client's call shape: ``chat.completions.create(...)`` is
fitted first (and awaited for the async client); ``stream=True`` returns the SDK's stream, passed through chunk by
chunk; every other attribute is the client's own. The client is never patched.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TYPE_CHECKING, Any

from .base import Reply, Request, register_wrapper, reply_from, usage_of
from .calls import Call, Options, call_async, call_sync, calls_of

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["OpenAIBackend"]


class _Collector:
    """Rebuilds the assistant's message and the usage from stream chunks, as they pass through."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.finished = False

    def add(self, chunk: Any) -> None:
        prompt, completion = usage_of(chunk)
        if prompt is not None:
            self.prompt_tokens, self.completion_tokens = prompt, completion
        for choice in getattr(chunk, "choices", None) or ():
            if getattr(choice, "index", 0):
                continue  # n > 1: the transcript keeps the first choice
            delta = choice.delta
            if getattr(delta, "content", None):
                self.content.append(delta.content)
            for part in getattr(delta, "tool_calls", None) or ():
                call = self.calls.setdefault(part.index, {"id": None, "type": "function", "name": "", "args": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["args"] += part.function.arguments or ""

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for _, c in sorted(self.calls.items())
            ]
        self.request.finish(
            Reply(
                result=None,
                message=message,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
            )
        )


class _Stream:
    """The SDK's stream, passed through; the call is recorded when the stream ends or is closed."""

    def __init__(self, stream: Any, collector: _Collector) -> None:
        self._stream = stream
        self._collector = collector

    def __iter__(self) -> Iterator[Any]:
        try:
            for chunk in self._stream:
                self._collector.add(chunk)
                yield chunk
        finally:
            self._collector.finish()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._collector.finish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _AsyncStream:
    """The async SDK stream, passed through (see :class:`_Stream`)."""

    def __init__(self, stream: Any, collector: _Collector) -> None:
        self._stream = stream
        self._collector = collector

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for chunk in self._stream:
                self._collector.add(chunk)
                yield chunk
        finally:
            self._collector.finish()

    async def __aenter__(self) -> _AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self._stream.close()
        finally:
            self._collector.finish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class OpenAIBackend:
    """Sends the fitted prompt with ``chat.completions.create``."""

    def __init__(self, client: Any) -> None:
        self.create = client.chat.completions.create
        self.server = str(getattr(client, "base_url", "openai"))

    def complete(self, request: Request) -> Reply | Awaitable[Reply]:
        result = self.create(**request.params)
        if inspect.isawaitable(result):
            return self._later(result, request)
        return self._reply(result, request, _Stream)

    async def _later(self, result: Awaitable[Any], request: Request) -> Reply:
        return self._reply(await result, request, _AsyncStream)

    @staticmethod
    def _reply(result: Any, request: Request, stream: type[_Stream] | type[_AsyncStream]) -> Reply:
        if request.stream:
            return Reply(result=stream(result, _Collector(request)), pending=True)
        return reply_from(result)


class _Completions:
    def __init__(self, inner: Any, run: Any) -> None:
        self._inner = inner
        self._run = run

    def create(self, **kwargs: Any) -> Any:
        """``chat.completions.create`` with ``messages`` fitted first (awaitable for the async client)."""
        return self._run(kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Chat:
    def __init__(self, inner: Any, run: Any) -> None:
        self._inner = inner
        self.completions = _Completions(inner.completions, run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class WrappedOpenAI:
    """An openai client whose chat completions are fitted by a keeper; everything else is the client's own."""

    def __init__(self, keeper: ContextKeeper, client: Any, **options: Any) -> None:
        self._client = client
        self._keeper = keeper
        backend = OpenAIBackend(client)
        settings = Options(**options)
        calls = calls_of(keeper)
        is_async = inspect.iscoroutinefunction(inspect.unwrap(client.chat.completions.create))

        def run(kwargs: dict[str, Any]) -> Any:
            if "messages" not in kwargs:
                raise TypeError("chat.completions.create() needs messages=[...]")
            params = {k: v for k, v in kwargs.items() if k not in ("messages",)}
            call = Call(calls, backend, settings, kwargs["messages"], kwargs.get("tools"), params)
            return call_async(call) if is_async else call_sync(call)

        self.chat = _Chat(client.chat, run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def __repr__(self) -> str:
        return f"<wrapped {self._client!r}>"


def _is_openai(client: Any) -> bool:
    chat = getattr(client, "chat", None)
    return callable(getattr(getattr(chat, "completions", None), "create", None)) and hasattr(client, "base_url")


register_wrapper(_is_openai)(WrappedOpenAI)
