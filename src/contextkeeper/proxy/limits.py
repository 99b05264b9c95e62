"""What the proxy takes in before it fits anything: bounded bytes, shapes and text, each refusal a typed 4xx.

A chat body is read with a running count (a ``Content-Length`` over the limit is refused before a byte of the body
is read), parsed strictly (no ``NaN``/``Infinity``, no lone surrogates, bounded nesting) and its shape checked
(messages, characters per message, tool schemas, ``n``/``best_of``, booleans that are booleans) before the keeper
sees it. The refusal is :class:`~contextkeeper.RequestRejected` with the status, the code and the setting that
raises the limit; nothing refused here is written to a transcript or kept in a session.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .._exceptions import RequestRejected

__all__ = ["InputLimits", "check_chat", "parse_json", "raw_depth", "read_body"]

# A JSON escape of a UTF-16 surrogate: only a body holding one can decode to a lone surrogate (raw UTF-8 cannot
# encode them, and a valid escaped pair decodes to one character).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Above this many bytes, parsing and checking run on a worker thread.
OFF_LOOP_BYTES = 64 * 1024
# JSON values walked between two voluntary releases of the GIL: a large body's checks run on a worker thread, and
# let the event loop (and other requests) have the GIL now and then, not only at the 5 ms switch interval.
_YIELD_EVERY = 4096


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """Bounds on one request (``[limits]`` in the proxy's config; every one a positive whole number).

    ``body_bytes``: a request body (chat or forwarded); ``messages``: messages in one chat request;
    ``message_chars``: characters of text in one message (its content, parts and tool-call arguments together);
    ``tools_bytes``: the tool schemas as JSON; ``depth``: JSON nesting; ``answers``: ``n`` and ``best_of``;
    ``path_bytes``: a forwarded request's path and query."""

    body_bytes: int = 16 * 2**20
    messages: int = 10_000
    message_chars: int = 4_000_000
    tools_bytes: int = 2**20
    depth: int = 64
    answers: int = 16
    path_bytes: int = 8192

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{field.name} must be a whole number >= 1, got {value!r}")


def _setting(name: str) -> str:
    return f"raise limits.{name} in the proxy's config ([limits] {name} = ...)"


def _too_large(what: str, size: int, limit: int, name: str, unit: str = "bytes") -> RequestRejected:
    return RequestRejected(
        f"{what} is {size:,} {unit}; this proxy takes at most {limit:,}",
        status=413,
        code="body_too_large" if name == "body_bytes" else f"{name}_exceeded",
        fix=f"send less (fewer or shorter messages), or {_setting(name)}",
    )


async def read_body(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limits: InputLimits) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed ``limits.body_bytes`` (from its
    ``Content-Length`` before reading, else while reading)."""
    limit = limits.body_bytes
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestRejected(
                f"Content-Length {declared[:40]!r} is not a byte count", code="invalid_content_length"
            )
        if int(declared) > limit:
            raise _too_large("the request body", int(declared), limit, "body_bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large("the request body", size, limit, "body_bytes")
        parts.append(chunk)
    return b"".join(parts)


def _constant(name: str) -> Any:
    raise RequestRejected(
        f"the body holds {name}, which is not JSON (RFC 8259 has no NaN or Infinity)",
        code="invalid_json",
        fix="send finite numbers (or null)",
    )


# What an opening or closing bracket adds to the depth; the bytes that are neither a bracket nor a quote.
_STEP = [0] * 256
for _open in b"[{":
    _STEP[_open] = 1
for _close in b"]}":
    _STEP[_close] = -1
_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'[]{}"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def raw_depth(raw: bytes) -> int:
    """How deep the JSON text ``raw`` nests (a valid document), read from its bytes in C (replace, translate,
    split, accumulate) so a large body costs a few milliseconds: escaped backslashes and quotes are taken out (left
    to right, as JSON reads escapes), then everything but brackets and quotes; the brackets between every other
    pair of quotes are outside strings. :func:`_depth` on the parsed value is the reference (a property test holds
    them equal)."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(None, _NOT_STRUCTURE)
    outside = b"".join(structure.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, outside)), default=0)


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests, counted without recursion; stops as soon as it passes ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    walked = 0
    while stack:
        walked += 1
        if walked % _YIELD_EVERY == 0:
            time.sleep(0)
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(raw: bytes, limits: InputLimits) -> Any:
    """``raw`` as JSON, strictly: UTF-8 text, no NaN/Infinity, at most ``limits.depth`` levels, no lone
    surrogate in any string (a request field that holds one is named)."""
    if not raw.strip():
        raise RequestRejected("the request body is empty; a JSON object is expected", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_constant)
    except RequestRejected:  # a NaN or Infinity (a ValueError too, but worded already)
        raise
    except RecursionError:
        raise RequestRejected(
            f"the request body nests deeper than JSON can be read here; at most {limits.depth} levels are taken",
            code="nested_too_deep",
        ) from None
    except UnicodeDecodeError as exc:
        raise RequestRejected(
            f"the request body is not UTF-8 text (byte {exc.start} is invalid)", code="invalid_json"
        ) from None
    except ValueError as exc:
        raise RequestRejected(f"the request body is not JSON ({exc})", code="invalid_json") from None
    # (UTF-16 and UTF-32 bodies, which json reads too, have NULs among their first bytes: walked instead.)
    deepest = raw_depth(raw) if b"\x00" not in raw[:4] else _depth(data, limits.depth)
    if deepest > limits.depth:
        raise RequestRejected(
            f"the request body nests more than {limits.depth} levels deep",
            code="nested_too_deep",
            fix=_setting("depth"),
        )
    if _SURROGATE_ESCAPE.search(raw) and _lone_surrogate(data):
        where = "the request body"
        if isinstance(data, dict):
            field = next((key for key, value in data.items() if _lone_surrogate(key) or _lone_surrogate(value)), None)
            if field is not None:
                where = f"the field {field.encode('utf-8', 'backslashreplace').decode('ascii', 'replace')!r}"
        raise RequestRejected(
            f"{where} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is no Unicode "
            "text",
            code="invalid_unicode",
            fix="escape characters outside the BMP as a surrogate pair, or send them as UTF-8",
        )
    return data


def _text_chars(value: Any, budget: int) -> int:
    """Characters of text in a message (strings at any depth), counted without recursion; stops past ``budget``."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
            if total > budget:
                return total
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _whole(body: Mapping[str, Any], key: str, low: int, high: int | None, setting: str | None = None) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestRejected(
            f"{key} must be a whole number >= {low}, got {value!r:.60}", code=f"invalid_{key}", param=key
        )
    if high is not None and value > high:
        raise RequestRejected(
            f"{key} = {value:,} asks for more answers than this proxy admits per request ({high:,})",
            code=f"invalid_{key}",
            param=key,
            fix=_setting(setting) if setting else None,
        )


def _check_messages(messages: Any, limits: InputLimits, size: int | None) -> None:
    if not isinstance(messages, list):
        raise RequestRejected("messages must be a list of chat messages", code="invalid_messages", param="messages")
    if len(messages) > limits.messages:
        raise RequestRejected(
            f"the request has {len(messages):,} messages; this proxy takes at most {limits.messages:,} per request",
            status=413,
            code="messages_exceeded",
            param="messages",
            fix=f"send fewer messages, or {_setting('messages')}",
        )
    if size is not None and size <= limits.message_chars:
        return  # a body of no more bytes than the limit has no message with more characters: nothing to walk
    for index, message in enumerate(messages):
        if index % 64 == 63:
            time.sleep(0)  # (see _YIELD_EVERY)
        if _text_chars(message, limits.message_chars) > limits.message_chars:
            raise RequestRejected(
                f"message {index} holds more than {limits.message_chars:,} characters of text",
                status=413,
                code="message_chars_exceeded",
                param=f"messages[{index}]",
                fix=f"send a shorter message (or a file reference), or {_setting('message_chars')}",
            )


def _check_tools(tools: Any, limits: InputLimits) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestRejected("tools must be a list of tool schemas", code="invalid_tools", param="tools")
    size = len(json.dumps(tools, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > limits.tools_bytes:
        raise RequestRejected(
            f"the tool schemas take {size:,} bytes of JSON; this proxy takes at most {limits.tools_bytes:,}",
            status=413,
            code="tools_bytes_exceeded",
            param="tools",
            fix=f"send fewer or smaller tool schemas, or {_setting('tools_bytes')}",
        )


# The fields the proxy reads besides messages and tools, each with the type it must have (None: absent).
_BOOLEANS = ("stream", "logprobs", "echo", "parallel_tool_calls")
_TYPED: tuple[tuple[str, type, str], ...] = (("model", str, "a string"), ("stream_options", dict, "an object"))


def _check_fields(body: dict[str, Any], limits: InputLimits) -> None:
    for key in ("max_completion_tokens", "max_tokens"):
        _whole(body, key, 1, None)
    _whole(body, "n", 1, limits.answers, "answers")
    _whole(body, "best_of", 1, limits.answers, "answers")
    for key in _BOOLEANS:
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise RequestRejected(
                f"{key} must be true or false, got {json.dumps(value)[:40]}", code=f"invalid_{key}", param=key
            )
    for key, kind, what in _TYPED:
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise RequestRejected(f"{key} must be {what}, got {type(value).__name__}", code=f"invalid_{key}", param=key)
    for key, value in body.items():
        if isinstance(value, float) and not math.isfinite(value):  # (parse_json refuses these; a caller may not)
            raise RequestRejected(f"{key} must be a finite number", code=f"invalid_{key}", param=key)


def check_chat(body: Any, limits: InputLimits, size: int | None = None) -> dict[str, Any]:
    """The checks a chat-completions body passes before the keeper reads it; returns it (a dict). ``size``: the
    body's bytes, when known."""
    if not isinstance(body, dict):
        raise RequestRejected("the request body must be a JSON object", code="invalid_json")
    _check_messages(body.get("messages"), limits, size)
    _check_tools(body.get("tools"), limits)
    _check_fields(body, limits)
    return body
