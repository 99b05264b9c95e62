"""How much of a prompt a server's prefix cache can reuse: the tokens that are a prefix of the previous prompt of
the same conversation, by token ids, exactly.

A server's prefix cache (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's ``cache_prompt``,
hosted prompt caching) reuses the KV cache of the longest run of token ids a new prompt shares with one it has
seen. The previous prompt of a conversation is the one it has surely seen, so the length of the common prefix of
the two prompts' ids is what the next call can reuse at best, and what it must prefill is the rest.

Finding it cheaply, exactly. A Hugging Face tokenizer cuts its input at added tokens (the special tokens a chat
template writes) before anything else, and encodes each piece between them on its own. So the ids of a prompt up
to the start of an added token depend only on the text before it, and the ids of a stretch of text that starts
with an added token and ends with one are the ids the whole prompt has there. The two prompts' texts are
compared at memcmp speed; the last added token that lies wholly inside the text they share (its start at least
the longest added token's length before the first difference: a match there is decided by shared text alone)
splits both prompts in the same place, and its tokens before are counted from the counter's cache. Only the
stretch from there to the first added token after the difference is encoded, in each prompt: usually one
message. :meth:`HFMeter.reference` encodes both whole prompts and compares their ids (the slow, obvious way);
tests hold the two equal, and both equal to ``apply_chat_template(..., tokenize=True)``.

The fast way holds where the counter's piece rules (``pieces``: a text counts as its pieces between added tokens;
``segments``: a text cut before an added token counts as its two sides) were proved for the tokenizer; elsewhere
the meter takes the reference. Counters are measured through a registry by type (:func:`register_meter`); a
counter with none, or a prompt whose media parts are priced by an estimate, has no exact prefix (None).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import HFChatTemplateCounter, TokenCounter
from .pieces import Pieces, Segments, common_prefix

__all__ = ["HFMeter", "Meter", "PrefixOf", "meter_for", "register_meter", "shared_ids"]


class Meter(Protocol):
    """Measures prompts of one counter: their text as the count tokenizes it, and the shared prefix of two."""

    def text(self, messages: Any, tools: list[Any] | None) -> str | None:
        """The prompt text the count tokenizes (None: not measurable by ids, e.g. media priced by estimate)."""
        ...

    def shared(self, new: str, old: str) -> int:
        """Tokens of ``new`` that are a prefix of ``old``'s ids: exact, and as cheap as the counter allows."""
        ...

    def reference(self, new: str, old: str) -> int:
        """The same by encoding both texts whole (slow, obvious)."""
        ...


_METERS: list[tuple[type[Any], Callable[[Any], Meter | None]]] = []


def register_meter(kind: type[Any]) -> Callable[[Callable[[Any], Meter | None]], Callable[[Any], Meter | None]]:
    """Register the meter factory for counters of type ``kind`` (subclasses included, the latest first)."""

    def add(factory: Callable[[Any], Meter | None]) -> Callable[[Any], Meter | None]:
        _METERS.insert(0, (kind, factory))
        return factory

    return add


def meter_for(counter: TokenCounter) -> Meter | None:
    """A meter for ``counter`` (a session keeps the one it gets), or None when no exact measure is known."""
    factory = next((make for kind, make in _METERS if isinstance(counter, kind)), None)
    return factory(counter) if factory is not None else None


def shared_ids(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    limit = min(len(a), len(b))
    if list(a[:limit]) == list(b[:limit]):
        return limit
    low, high = 0, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class HFMeter:
    """The meter of a :class:`~contextkeeper.tokens.HFChatTemplateCounter` (see the module)."""

    def __init__(self, counter: HFChatTemplateCounter) -> None:
        self.counter = counter
        pieces = counter._pieces
        # The piece counter's own added-token cutter (made with the counter: for a vocabulary with hundreds of
        # added tokens that is milliseconds), with a count of its own. A counter without a tokenizers backend has
        # neither.
        self._tokenizer = pieces._tokenizer.fork() if pieces is not None else None
        proved = set(pieces.rules.on) if pieces is not None and pieces.rules.verified else set()
        tokenizer = self._tokenizer
        self.fast = (
            tokenizer is not None
            and {Pieces.name, Segments.name} <= proved
            and Pieces.refusal(tokenizer) is None
            and Segments.refusal(tokenizer) is None
        )
        self._longest = max((len(token.content) for token in tokenizer.added), default=0) if tokenizer else 0

    def text(self, messages: Any, tools: list[Any] | None) -> str | None:
        # The counter's own rendering: the segments its count tokenizes (BOS and continuation rules included).
        segments, media, _ = self.counter._prompt(messages, tools, True)
        return None if media else "".join(segments)

    def ids(self, text: str) -> list[int]:
        """The token ids of a prompt text (no special tokens added: the template wrote them)."""
        if self._tokenizer is None:
            return list(self.counter.tokenizer.encode(text, add_special_tokens=False))
        return list(self._tokenizer.encoder().encode(text, add_special_tokens=False).ids)

    def reference(self, new: str, old: str) -> int:
        return shared_ids(self.ids(new), self.ids(old))

    def shared(self, new: str, old: str) -> int:
        if not self.fast:
            return self.reference(new, old)
        assert self._tokenizer is not None
        assert self._tokenizer.splitter is not None
        split = self._tokenizer.splitter.split
        same = common_prefix(new, old)
        if same == len(new) == len(old):
            return self.counter.count_text(new)
        starts_new, ends_new = _marks(split(new))
        _starts_old, ends_old = _marks(split(old))
        # The last added token decided by shared text alone: both prompts are cut there, with equal parts before.
        at = bisect.bisect_right(starts_new, same - self._longest) - 1
        begin = starts_new[at] if at >= 0 else 0
        before = self.counter.count_text(new[:begin]) if begin else 0
        # Each window runs from ``begin`` to the end of an added token after the first difference (or the text's
        # end); a window whose ids are all a prefix of the other's grows by one added token at a time.
        k_new = bisect.bisect_right(ends_new, same)
        k_old = bisect.bisect_right(ends_old, same)
        while True:
            end_new = ends_new[k_new] if k_new < len(ends_new) else len(new)
            end_old = ends_old[k_old] if k_old < len(ends_old) else len(old)
            ids_new, ids_old = self.ids(new[begin:end_new]), self.ids(old[begin:end_old])
            common = shared_ids(ids_new, ids_old)
            whole_new, whole_old = common == len(ids_new), common == len(ids_old)
            if not (whole_new or whole_old):
                return before + common
            if (whole_new and end_new == len(new)) or (whole_old and end_old == len(old)):
                return before + common
            k_new += whole_new
            k_old += whole_old


def _marks(parts: list[str]) -> tuple[list[int], list[int]]:
    """The start and end offsets of each added-token match of a text cut by ``Splitter.split``."""
    starts: list[int] = []
    ends: list[int] = []
    offset = 0
    for index, part in enumerate(parts):
        if index % 2:
            starts.append(offset)
            ends.append(offset + len(part))
        offset += len(part)
    return starts, ends


@register_meter(HFChatTemplateCounter)
def _hf_meter(counter: HFChatTemplateCounter) -> Meter | None:
    return HFMeter(counter)


class PrefixOf:
    """The shared prefix of a prompt and the previous one, computed from their texts when first asked for (the
    texts are rendered with each fit: a fraction of a millisecond; comparing them costs about as much again)."""

    def __init__(self, meter: Meter | None, new: str | None, old: str | None) -> None:
        self._args = (meter, new, old) if meter is not None and new is not None and old is not None else None
        # The first measurable prompt of a conversation shares nothing with a previous one.
        self._value: int | None = 0 if meter is not None and new is not None and old is None else None
        self._lock = threading.Lock()

    def get(self) -> int | None:
        """Tokens of the prompt that are a prefix of the previous prompt's ids (0: no previous prompt; None: one
        of the two is not measurable by ids)."""
        if self._args is not None:
            with self._lock:
                if self._args is not None:
                    meter, new, old = self._args
                    self._value = meter.shared(new, old)
                    self._args = None  # measured: the texts are no longer needed
        return self._value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_known, (self.get(),))


def _known(value: int | None) -> PrefixOf:
    made = PrefixOf(None, None, None)
    made._value = value
    return made
