"""The openai SDK: ``OpenAI``, ``AsyncOpenAI`` and any OpenAI-compatible ``base_url`` (vLLM, SGLang, llama.cpp's
server, Ollama).

``keeper.wrap(client)`` returns an object with the client's call shape: ``chat.completions.create(...)`` is
fitted first (and awaited for the async client); ``stream=True`` returns the SDK's stream, passed through chunk by
chunk; every other attribute is the client's own. The client is never patched.

The wrapper's requests go through ``client.with_options(max_retries=0)``, a copy that shares the caller's
connection pool: the keeper's ``attempts`` is the one retry policy, instead of the SDK's retries inside each
attempt. Calls made through the client's other attributes keep the client's own retries.

Streams. The first chunk is read before ``create`` returns, so a stream that breaks before it is retried like any
other transport error. One that breaks later raises :class:`~contextkeeper.StreamInterrupted` (with the text so
far) while it is read, and its call is recorded as failed. A stream ends its call, and gives back its admission,
when it is read to the end, closed, or garbage collected unread (its lease in the ledger covers one that is kept
but never read).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import queue
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..calls.base import Reply, Request, reply_from, usage_of
from ..calls.loop import Call, cached_tokens_of, call_async, call_sync, options
from ..calls.redis_client import safe_url
from ..servers.kinds import kind_of_reply, kind_of_url
from .registry import register_wrapper

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["OpenAIBackend"]

_NOTHING = object()  # no chunk was read ahead (an empty stream)

log = logging.getLogger("contextkeeper")

# Streams dropped unread are ended here, off the garbage collector: a collection may run while this very thread
# holds the ledger's or the transcript's lock, so the finalizer only queues (SimpleQueue is safe to call there).
_DROPPED: queue.SimpleQueue[tuple[_Collector, Any]] = queue.SimpleQueue()
_REAPER: list[threading.Thread] = []
_REAPER_LOCK = threading.Lock()


def _end_dropped(block: bool) -> None:
    while True:
        try:
            collector, stream = _DROPPED.get(block=block)
        except queue.Empty:
            return
        try:
            collector.end_dropped(stream)
        except Exception:  # a closed transcript at exit, for one: nothing to raise to
            log.exception("could not end a dropped stream's call")


def _start_reaper() -> None:
    with _REAPER_LOCK:
        if not _REAPER or not _REAPER[0].is_alive():
            thread = threading.Thread(target=_end_dropped, args=(True,), name="contextkeeper-streams", daemon=True)
            thread.start()
            _REAPER[:] = [thread]


# Registered before any stream's finalizer, so it runs after them at exit (atexit is last in, first out).
atexit.register(_end_dropped, False)


@dataclass(frozen=True, kw_only=True)
class _StreamReply(Reply):
    """A stream's reply, at its end: with the prefix-cache hit its usage chunk reported (the wrapped call's report
    reads it; a plain reply's is read from the response itself)."""

    cached_tokens: int | None = None


class _Collector:
    """Rebuilds the assistant's message and the usage from stream chunks, as they pass through, and ends the call
    once (normally, closed early, dropped unread, or broken)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None  # the usage chunk's prompt_tokens_details.cached_tokens
        self.chunks = 0  # passed on to the caller
        self.kind: str | None = None
        self.finished = False
        self.dropping = False  # the wrapper was collected: the reaper ends the call

    def add(self, chunk: Any) -> None:
        self.chunks += 1
        if self.chunks == 1:
            self.kind = kind_of_reply(chunk)
        self.request.renew()
        prompt, completion = usage_of(chunk)
        if prompt is not None:
            self.prompt_tokens, self.completion_tokens = prompt, completion
            self.cached_tokens = cached_tokens_of(chunk)
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

    def finish(self, error: BaseException | str | None = None) -> BaseException | None:
        """End the call (once): ``error`` None for a stream read to its end, else why it ended early. Returns the
        error to raise instead of ``error`` (a broken stream's StreamInterrupted), if any."""
        if self.finished:
            return None
        self.finished = True
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for _, c in sorted(self.calls.items())
            ]
        return self.request.finish(
            _StreamReply(
                cached_tokens=self.cached_tokens,
                result=None,
                message=message,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                server_kind=self.kind,
                error=error,
                chunks=self.chunks,
            )
        )

    def closed(self) -> None:
        if not self.finished and not self.dropping:
            self.finish(f"closed by the caller after {self.chunks} chunk(s), before the end of the stream")

    def dropped(self, stream: Any) -> None:
        """The wrapper's finalizer: only queue the call's end (see _DROPPED)."""
        self.dropping = True
        _DROPPED.put((self, stream))

    def end_dropped(self, stream: Any) -> None:
        """End the call of a stream dropped unread, and let its connection go."""
        if not self.finished:
            self.finish(f"the stream was dropped after {self.chunks} chunk(s), before its end")
        close = getattr(stream, "close", None)
        if close is not None and not inspect.iscoroutinefunction(close):
            with contextlib.suppress(Exception):
                close()


def _chunks(collector: _Collector, first: Any, rest: Iterator[Any]) -> Generator[Any, None, None]:
    """The chunks, passed through the collector. A function, not a method: it must not keep the wrapper alive."""
    try:
        if first is not _NOTHING:
            collector.add(first)
            yield first
        for chunk in rest:
            collector.add(chunk)
            yield chunk
    except GeneratorExit:
        collector.closed()
        raise
    except BaseException as exc:
        mapped = collector.finish(exc)
        if mapped is not None and mapped is not exc:
            raise mapped from exc
        raise
    collector.finish()


async def _achunks(collector: _Collector, first: Any, rest: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
    """:func:`_chunks` for async streams."""
    try:
        if first is not _NOTHING:
            collector.add(first)
            yield first
        async for chunk in rest:
            collector.add(chunk)
            yield chunk
    except GeneratorExit:
        collector.closed()
        raise
    except BaseException as exc:
        mapped = collector.finish(exc)
        if mapped is not None and mapped is not exc:
            raise mapped from exc
        raise
    collector.finish()


class _Stream:
    """The SDK's stream, passed through; the call ends when the stream ends, is closed or is collected."""

    def __init__(self, stream: Any, first: Any, rest: Iterator[Any], collector: _Collector) -> None:
        self._stream = stream
        self._collector = collector
        self._iterator = _chunks(collector, first, rest)
        _start_reaper()
        weakref.finalize(self, collector.dropped, stream)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._iterator.close()
            self._stream.close()
        finally:
            self._collector.closed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _AsyncStream:
    """The async SDK stream, passed through (see :class:`_Stream`)."""

    def __init__(self, stream: Any, first: Any, rest: AsyncIterator[Any], collector: _Collector) -> None:
        self._stream = stream
        self._collector = collector
        self._iterator = _achunks(collector, first, rest)
        _start_reaper()
        weakref.finalize(self, collector.dropped, stream)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        return await self._iterator.__anext__()

    async def __aenter__(self) -> _AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self._iterator.aclose()
            await self._stream.close()
        finally:
            self._collector.closed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class OpenAIBackend:
    """Sends the fitted prompt with ``chat.completions.create``, the SDK's own retries off."""

    def __init__(self, client: Any, *, create: Callable[..., Any] | None = None) -> None:
        """``create`` replaces ``chat.completions.create`` (the proxy posts bodies that are already wire JSON)."""
        with_options = getattr(client, "with_options", None)
        sender = with_options(max_retries=0) if callable(with_options) else client
        self.create = create or sender.chat.completions.create
        # The server's name in reports, logs and shared keys: its URL without a password (a userinfo URL's).
        self.server = safe_url(str(getattr(client, "base_url", "openai")))
        self.kind = kind_of_url(self.server)

    def complete(self, request: Request) -> Reply | Awaitable[Reply]:
        result = self.create(**request.params)
        if inspect.isawaitable(result):
            return self._later(result, request)
        if not request.stream:
            return reply_from(result)
        rest = iter(result)
        try:
            first = next(rest, _NOTHING)  # a break before the first chunk is retried by the call
        except BaseException:
            with contextlib.suppress(Exception):
                result.close()
            raise
        return Reply(result=_Stream(result, first, rest, _Collector(request)), pending=True)

    async def _later(self, result: Awaitable[Any], request: Request) -> Reply:
        response = await result
        if not request.stream:
            return reply_from(response)
        rest = response.__aiter__()
        try:
            first = await anext(rest, _NOTHING)
        except BaseException:
            with contextlib.suppress(Exception):
                await response.close()
            raise
        return Reply(result=_AsyncStream(response, first, rest, _Collector(request)), pending=True)


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

    def __init__(self, keeper: ContextKeeper, client: Any, **given: Any) -> None:
        self._client = client
        self._keeper = keeper
        settings = options(**given)
        backend = OpenAIBackend(client)
        calls = keeper.calls
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
