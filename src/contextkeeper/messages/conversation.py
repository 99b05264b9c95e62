"""A conversation and its atomic units: a system message, a user message, or an assistant message with all its tool
results (strategies never split a unit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from contextkeeper._exceptions import InvalidMessage, MessageError, MissingToolResult, OrphanToolResult

from .base import UnitKind
from .models import Message, MessageLike, ToolCall, _InputFormat, _parse_message

__all__ = ["Conversation", "Unit", "group_units", "restore_conversation"]


@dataclasses.dataclass(frozen=True)
class Unit:
    """Messages that must be kept or dropped together.

    A system/developer message, a user message, or an assistant message with all of its tool results.
    ``start``/``stop`` are the message index range in the conversation.
    """

    kind: UnitKind
    start: int
    stop: int
    messages: tuple[Message, ...]

    @property
    def indices(self) -> range:
        """The message indices of this unit."""
        return range(self.start, self.stop)


def _describe_call(call: ToolCall, position: int) -> str:
    ident = f" id {call.id!r}" if call.id is not None else ""
    return f"tool_calls[{position}] ({call.function.name!r}{ident})"


def group_units(messages: Sequence[Message], start: int = 0) -> tuple[Unit, ...]:
    """Check the tool call / tool result structure and group ``messages[start:]`` into units (``start`` must
    begin a unit)."""
    units: list[Unit] = []
    count = len(messages)
    i = start
    while i < count:
        message = messages[i]
        if message.role == "tool":
            raise OrphanToolResult(
                f"tool result (tool_call_id={message.tool_call_id!r}) does not follow an assistant message "
                "with tool_calls",
                index=i,
                fix="put it right after the assistant message that made the call (and that call's other "
                "results), or drop it",
            )
        if message.role != "assistant":
            kind: UnitKind = "user" if message.role == "user" else "system"
            units.append(Unit(kind, i, i + 1, (message,)))
            i += 1
            continue
        calls = message.tool_calls or []
        by_id = {call.id: position for position, call in enumerate(calls) if call.id is not None}
        answered = [False] * len(calls)
        j = i + 1
        while j < count and messages[j].role == "tool":
            result_id = messages[j].tool_call_id
            position = j - i - 1  # the n-th result answers the n-th call when calls have no ids
            if not calls:
                raise OrphanToolResult(
                    f"tool result (tool_call_id={result_id!r}) follows assistant message {i}, which made no tool calls",
                    index=j,
                    fix="add the matching call to that assistant message's tool_calls, or drop this result",
                )
            if result_id is not None and result_id in by_id:
                target = by_id[result_id]
            elif position < len(calls) and calls[position].id is None:
                target = position
            elif result_id is not None and by_id:
                known = ", ".join(repr(call_id) for call_id in by_id)
                raise OrphanToolResult(
                    f"tool result's tool_call_id {result_id!r} matches no call of assistant message {i} "
                    f"(its call ids: {known})",
                    index=j,
                    fix="use the id of the call this result answers, or drop the result",
                )
            elif position >= len(calls):
                raise OrphanToolResult(
                    f"tool result (tool_call_id={result_id!r}) has no call to answer: assistant message {i} "
                    f"made {len(calls)} call(s) and this is result {position + 1}",
                    index=j,
                    fix="drop the extra tool result, or add its call to the assistant message",
                )
            else:
                expected = calls[position].id
                raise InvalidMessage(
                    "tool result has no tool_call_id (missing id), but the call it answers, "
                    f"{_describe_call(calls[position], position)} of assistant message {i}, has one",
                    index=j,
                    fix=f"set tool_call_id to {expected!r}",
                )
            if answered[target]:
                raise InvalidMessage(
                    f"second tool result for {_describe_call(calls[target], target)} of assistant message {i}",
                    index=j,
                    fix="keep one result per tool call",
                )
            answered[target] = True
            j += 1
        if j < count and not all(answered):
            missing = ", ".join(
                _describe_call(call, position)
                for position, (call, done) in enumerate(zip(calls, answered, strict=True))
                if not done
            )
            raise MissingToolResult(
                f"assistant message's tool calls {missing} have no result before message {j} ({messages[j].role})",
                index=i,
                fix="add a role='tool' message answering each call right after the assistant message "
                "(its other results), or remove the unanswered calls",
            )
        units.append(Unit("assistant", i, j, tuple(messages[i:j])))
        i = j
    return tuple(units)


class Conversation(Sequence[Message]):
    """An immutable, validated list of messages that remembers each message's input format.

    Build it with :meth:`from_messages`. Validation covers each message and the tool call structure: every
    tool result answers a call of the assistant message before it, and every call is answered before the
    conversation moves on (pending calls are allowed only in the final unit).
    """

    __slots__ = ("_checks", "_formats", "_messages", "_sources", "_units")

    _messages: tuple[Message, ...]
    _formats: tuple[_InputFormat, ...]
    _sources: tuple[object, ...]
    _units: tuple[Unit, ...] | None  # None: not grouped yet (messages assembled from units already checked)
    _checks: tuple[object, ...] | None

    def __init__(
        self, messages: Sequence[MessageLike] | Conversation = (), *, previous: Conversation | None = None
    ) -> None:
        """Same as :meth:`from_messages`."""
        if isinstance(messages, Conversation):
            self._set(messages._messages, messages._formats, messages._sources, messages._grouped(), messages._checks)
            return
        if not isinstance(messages, (list, tuple)):
            raise MessageError(
                f"expected a list of messages, got {type(messages).__name__}",
                index=None,
                fix="pass a list such as [{'role': 'user', 'content': '...'}] (a single message in a list)",
            )
        start = _unchanged_prefix(messages, previous)
        parsed: list[Message] = []
        formats: list[_InputFormat] = []
        checks: list[object] = []
        for index in range(start, len(messages)):
            message, fmt, check = _parse_message(messages[index], index)
            parsed.append(message)
            formats.append(fmt)
            checks.append(check)
        if start and previous is not None and previous._checks is not None:
            # The previous last unit may grow (more tool results) or now need its results: group it again.
            grouped = previous._grouped()
            regroup_from = grouped[-1].start
            built = previous._messages + tuple(parsed)
            units = grouped[:-1] + group_units(built, regroup_from)
            all_formats = previous._formats + tuple(formats)
            complete = None if None in checks else previous._checks + tuple(checks)
        else:
            built = tuple(parsed)
            units = group_units(built)
            all_formats = tuple(formats)
            complete = None if None in checks else tuple(checks)
        self._set(built, all_formats, tuple(messages), units, complete)

    def _set(
        self,
        messages: tuple[Message, ...],
        formats: tuple[_InputFormat, ...],
        sources: tuple[object, ...],
        units: tuple[Unit, ...] | None,
        checks: tuple[object, ...] | None = None,
    ) -> None:
        object.__setattr__(self, "_messages", messages)
        object.__setattr__(self, "_formats", formats)
        # Kept only to hand foreign objects (e.g. openai SDK messages) back as themselves.
        if "object" in formats:
            kept = tuple(src if fmt == "object" else None for src, fmt in zip(sources, formats, strict=True))
        else:
            kept = (None,) * len(formats)
        object.__setattr__(self, "_sources", kept)
        object.__setattr__(self, "_units", units)
        # What each input compares equal to while unchanged (copies of dicts), for from_messages(previous=...).
        object.__setattr__(self, "_checks", checks)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Conversation is immutable")

    def __copy__(self) -> Conversation:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Conversation:
        return self  # immutable, and the messages are deep copies of the caller's already

    def __reduce__(self) -> tuple[Any, ...]:
        return (restore_conversation, (self._messages, self._formats, self._sources, self._grouped()))

    @classmethod
    def from_messages(
        cls, messages: Sequence[MessageLike] | Conversation, *, previous: Conversation | None = None
    ) -> Conversation:
        """Validate a list of messages (dicts, :class:`Message` objects, objects with ``model_dump()``).

        The caller's list and dicts are never changed. Raises :class:`MessageError` (``index`` None) for a
        non-list, and :class:`InvalidMessage`, :class:`OrphanToolResult` or :class:`MissingToolResult` with
        the offending message's ``index``.

        ``previous``: the conversation built from an earlier state of the same chat. When ``messages`` starts
        with exactly what it was built from (compared by value, so edits in place are noticed), only the rest
        is validated.
        """
        if isinstance(messages, Conversation):
            return messages
        return cls(messages, previous=previous)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...

    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        # A slice may cut a unit in half, so it is a plain tuple; select() gives a validated sub-conversation.
        return self._messages[index]

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Conversation):
            return NotImplemented
        return self._messages == other._messages

    def __repr__(self) -> str:
        return f"Conversation({len(self._messages)} messages, {len(self._grouped())} units)"

    @property
    def messages(self) -> tuple[Message, ...]:
        """The validated messages."""
        return self._messages

    def units(self) -> tuple[Unit, ...]:
        """The atomic units, in order; together they cover every message exactly once."""
        return self._grouped()

    def _grouped(self) -> tuple[Unit, ...]:
        units = self._units
        if units is None:
            units = group_units(self._messages)
            object.__setattr__(self, "_units", units)
        return units

    def to_dicts(self) -> list[dict[str, Any]]:
        """Every message as a new plain dict, equal to what was given."""
        return [message.to_dict() for message in self._messages]

    def to_caller_format(self) -> list[Any]:
        """The messages in the format each came in: dicts as new dicts, Messages and other objects as is."""
        out: list[Any] = []
        for message, fmt, source in zip(self._messages, self._formats, self._sources, strict=True):
            if fmt == "dict":
                out.append(message.to_dict())
            elif fmt == "object":
                out.append(source)
            else:
                out.append(message)
        return out

    def select(self, indices: Iterable[int]) -> Conversation:
        """A new conversation of the messages at ``indices`` (in the given order), re-validated.

        Each message keeps its input format. Raises the usual errors if the selection breaks tool call pairs.
        """
        chosen = list(indices)
        for index in chosen:
            if not -len(self._messages) <= index < len(self._messages):
                raise IndexError(f"message index {index} out of range for {len(self._messages)} messages")
        messages = tuple(self._messages[index] for index in chosen)
        return restore_conversation(
            messages,
            tuple(self._formats[index] for index in chosen),
            tuple(self._sources[index] for index in chosen),
            group_units(messages),
        )


def _unchanged_prefix(messages: Sequence[MessageLike], previous: Conversation | None) -> int:
    """len(previous) when ``messages`` begins with the very inputs ``previous`` was validated from, else 0."""
    if previous is None or previous._checks is None or not previous._messages:
        return 0
    size = len(previous._messages)
    if len(messages) < size:
        return 0
    # One C-level comparison: identical strings inside make it cheap, and a dict changed in place fails it.
    return size if tuple(messages[:size]) == previous._checks else 0


def restore_conversation(
    messages: tuple[Message, ...],
    formats: tuple[_InputFormat, ...],
    sources: tuple[object, ...],
    units: tuple[Unit, ...] | None = None,
) -> Conversation:
    """A Conversation of messages already checked together; ``units`` None groups them when first asked."""
    conversation = Conversation.__new__(Conversation)
    conversation._set(messages, formats, sources, units)
    return conversation
