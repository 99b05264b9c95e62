"""``retrieval``: drop the retrieved passages least relevant to the new request.

Results of search/retrieval tools (``tools``) are split into passages: the items of a JSON list (or of the
longest list inside a JSON object, such as ``{"results": [...]}``), the text parts of a content list, or
else blocks of text separated by blank lines. Each passage is scored against the new request, with BM25 by
default (no model, no torch import) or, when the step says ``embeddings = true`` (or names a ``model``), with
sentence embeddings (:func:`~contextkeeper.strategies._embeddings.load_embedder`: the first use loads the model,
which is logged and named in the action with its load time), and the least relevant are dropped across all
results, older results first on ties, until the prompt fits.
Each result keeps its ``min_keep`` best passages, the kept ones keep their exact text (JSON stays valid JSON)
and a ``marker`` says how many were removed. Calls and results stay paired: only the result's content changes.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from .._memo import memoize, text_entry_size
from ..messages import Message, TextPart
from ._embeddings import lexical_scores, load_in_fit
from .base import Action, FitState, Items, StrategySettings, register

__all__ = ["Retrieval"]

logger = logging.getLogger("contextkeeper")

#: ``model`` value that scores with BM25 only (the default; kept for policy files that name it).
LEXICAL = "lexical"

_DEFAULT_TOOLS = ("search", "retrieve", "retrieval", "lookup", "knowledge_base", "file_search")
_MAX_PROBES = 24  # exact counts spent searching for the smallest drop (a bisection over thousands of passages)


@memoize("retrieval.tool_matches", sizer=text_entry_size)
def _tool_matches(folded: str, patterns: tuple[str, ...]) -> bool:
    """Whether a tool name (casefolded) matches any of ``patterns`` (case-insensitive): asked for every tool
    result of every fit that runs this step, about a handful of names."""
    return any(fnmatch.fnmatchcase(folded, pattern.casefold()) for pattern in patterns)


class _Loads(dict[str, Any]):
    """What the embedding model cost to load in this fit (see ``load_in_fit``): retrieval's memory."""


@register("retrieval")
class Retrieval(StrategySettings):
    """Drop the retrieved passages least relevant to the request, only as many as the budget needs.

    ``tools``: names (or ``fnmatch`` patterns, case-insensitive) of the tools whose results hold passages.
    ``min_keep``: passages every result keeps. ``embeddings``: score with a sentence-transformers model instead
    of BM25 (loading one imports torch: seconds, once per process). ``model``: the local folder of that model
    (implies ``embeddings``; unset: the bundled all-MiniLM-L6-v2; ``"lexical"``: BM25). ``marker``: text put
    where passages were removed, ``{n}`` their number (empty: none).
    """

    name: ClassVar[str] = "retrieval"

    tools: tuple[str, ...] = Field(default=_DEFAULT_TOOLS, json_schema_extra={"allowed": "a list of tool names"})
    min_keep: int = Field(default=1, ge=0)
    embeddings: bool = False
    model: str | None = Field(
        default=None, json_schema_extra={"allowed": "the path of a local sentence-transformers folder, or 'lexical'"}
    )
    marker: str = Field(
        default="[{n} less relevant passage(s) removed]", json_schema_extra={"allowed": "a string ({n} optional)"}
    )

    @field_validator("tools", mode="before")
    @classmethod
    def _one_tool(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("marker")
    @classmethod
    def _check_marker(cls, value: str) -> str:
        try:
            value.format(n=1)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a format string with {{n}} only ({exc})") from None
        return value

    @model_validator(mode="after")
    def _check_embeddings(self) -> Retrieval:
        if self.model == LEXICAL and self.embeddings:
            raise ValueError("embeddings = true with model = 'lexical' (BM25): choose one")
        if self.model not in (None, LEXICAL) and not self.embeddings and "embeddings" in self.model_fields_set:
            raise ValueError(f"model = {self.model!r} with embeddings = false: leave embeddings out, or the model")
        return self

    @property
    def uses_embeddings(self) -> bool:
        """Whether passages are scored with an embedding model (else BM25)."""
        return self.embeddings or self.model not in (None, LEXICAL)

    # ------------------------------------------------------------------------------------------- apply

    def apply(self, state: FitState) -> FitState:
        targets = self._targets(state)
        if not targets:
            return state
        before = state.tokens()
        if before <= state.limit:
            return state

        query = _query(state)
        texts = [passage for target in targets for passage in target.split.passages]
        scores, scorer = self._score(state, query, texts)

        # Every droppable passage, least relevant first; ties: older results first, later passages first.
        order: list[tuple[float, int, int, int]] = []
        at = 0
        for number, target in enumerate(targets):
            own = scores[at : at + len(target.split.passages)]
            at += len(own)
            best = sorted(range(len(own)), key=lambda index: (-own[index], index))
            for index in best[self.min_keep :]:
                order.append((own[index], number, -index, index))
        order.sort()
        drops = [(number, index) for _, number, _, index in order]
        if not drops:
            return state

        counts: dict[int, int] = {0: before}
        built: dict[int, tuple[tuple[Items, ...], int]] = {}

        def history(k: int) -> tuple[Items, ...]:
            if k not in built:
                built[k] = self._rebuild(state, targets, drops[:k])
            return built[k][0]

        def count(k: int) -> int:
            if k not in counts:
                counts[k] = state.tokens(history(k))
            return counts[k]

        total = len(drops)
        # When even dropping all we may does not fit, do that and leave the rest to later strategies.
        fits_at_all = count(total) <= state.limit
        chosen = _smallest_fit(drops, targets, count, total, state.limit) if fits_at_all else total
        after = count(chosen)
        if chosen == 0 or after >= before:
            return state
        new_history = history(chosen)
        units = built[chosen][1]
        results = len({number for number, _ in drops[:chosen]})
        detail = (
            f"removed {chosen} of {len(texts)} retrieved passage(s) from {results} result(s), "
            f"least relevant to the request first ({scorer})"
        )
        return state.with_history(
            new_history, Action(strategy=self.name, detail=detail, saved=before - after, units=units)
        )

    # ------------------------------------------------------------------------------------------- parts

    def _matches(self, tool: str | None) -> bool:
        return bool(tool) and _tool_matches(str(tool).casefold(), self.tools)

    def _targets(self, state: FitState) -> list[_Target]:
        """The splittable results of retrieval tools in the history, oldest first."""
        pattern = _marker_pattern(self.marker)
        targets: list[_Target] = []
        for unit_index, unit in enumerate(state.history):
            if not unit or unit[0].role != "assistant" or not unit[0].message.tool_calls:
                continue
            calls = unit[0].message.tool_calls
            by_id = {call.id: call for call in calls if call.id is not None}
            for item_index in range(1, len(unit)):
                message = unit[item_index].message
                if message.role != "tool":
                    continue
                position = item_index - 1
                if message.tool_call_id is not None and message.tool_call_id in by_id:
                    tool: str | None = by_id[message.tool_call_id].function.name
                elif position < len(calls) and calls[position].id is None:
                    tool = calls[position].function.name
                else:
                    tool = message.name
                if not self._matches(tool):
                    continue
                split = _split_content(message.content, pattern)
                if split is not None and split.passages:
                    targets.append(_Target(unit_index, item_index, split))
        return targets

    def _score(self, state: FitState, query: str, texts: list[str]) -> tuple[list[float], str]:
        if not query.strip():
            return [0.0] * len(texts), "no request text: by age and rank"
        if not self.uses_embeddings:
            return lexical_scores(query, texts), "lexical: BM25"
        memory = state.memory.slot(_Loads)
        embedder, note = load_in_fit(None if self.model in (None, LEXICAL) else self.model, memory, state.turn)
        if embedder is None:
            return lexical_scores(query, texts), f"lexical: BM25; no embedding model: {note}"
        try:
            return embedder.similarities(query, texts), f"embeddings: {embedder.name}{note}"
        except Exception as exc:  # a failing model must not fail the fit
            logger.warning("retrieval: embedding failed (%s: %s); using BM25", type(exc).__name__, exc)
            return lexical_scores(query, texts), f"lexical: BM25; the embedding model failed: {type(exc).__name__}"

    def _rebuild(
        self, state: FitState, targets: list[_Target], drops: Sequence[tuple[int, int]]
    ) -> tuple[tuple[Items, ...], int]:
        """The history with ``drops`` (target number, passage index) removed, and how many units changed."""
        removed: dict[int, set[int]] = {}
        for number, index in drops:
            removed.setdefault(number, set()).add(index)
        units = list(state.history)
        changed: set[int] = set()
        for number, gone in sorted(removed.items()):
            target = targets[number]
            unit = units[target.unit]
            message = unit[target.item].message
            kept = tuple(index for index in range(len(target.split.passages)) if index not in gone)
            total = len(gone) + target.split.removed_before
            note = self.marker.format(n=total) if self.marker else ""
            # The same rewrite is the same object in every fit, so the counter's caches keep working.
            build = functools.partial(_rewrite, message, target.split, kept, note)
            items = list(unit)
            items[target.item] = state.reuse(message, (self.name, kept, note), build)
            units[target.unit] = tuple(items)
            changed.add(target.unit)
        return tuple(units), len(changed)


def _rewrite(message: Message, split: _Split, kept: tuple[int, ...], note: str) -> Message:
    """``message`` with only the ``kept`` passages and the marker: same role, tool_call_id, name and extras."""
    data = message.to_dict()
    data["content"] = split.rebuild(list(kept), note)
    return Message.from_dict(data)


# ----------------------------------------------------------------------------------------------- search


def _smallest_fit(
    drops: list[tuple[int, int]],
    targets: list[_Target],
    count: Callable[[int], int],
    total: int,
    limit: int,
) -> int:
    """The fewest drops (a prefix of ``drops``) whose exact count fits, given that all of them fit.

    Counts are interpolated over the passages' sizes between the nearest exact counts known on either side,
    so a guess and its neighbour usually settle it; bisection takes over if guesses keep missing.
    """
    sizes = [0]
    for number, index in drops:
        sizes.append(sizes[-1] + targets[number].split.sizes[index] + 1)
    low, high = 0, total  # count(low) > limit >= count(high)
    probes = 0
    while high - low > 1:
        span = count(low) - count(high)
        need = count(low) - limit
        if probes < 2 and span > 0 and sizes[high] > sizes[low]:
            goal = sizes[low] + (sizes[high] - sizes[low]) * need / span
            guess = next(k for k in range(low + 1, high + 1) if sizes[k] >= goal or k == high)
            guess = min(max(guess, low + 1), high - 1)
        else:
            guess = (low + high) // 2
        probes += 1
        # The guess and its neighbour: when the estimate is right, these two counts settle it.
        if count(guess) <= limit:
            high = guess
            if guess - 1 > low:
                if count(guess - 1) <= limit:
                    high = guess - 1
                else:
                    low = guess - 1
        else:
            low = guess
            if guess + 1 < high:
                if count(guess + 1) <= limit:
                    high = guess + 1
                else:
                    low = guess + 1
        if probes >= _MAX_PROBES:
            break
    return high


# ------------------------------------------------------------------------------------------------ split


@dataclass(frozen=True)
class _Split:
    """A tool result's passages (their text, to score) and how to write the content back with some kept."""

    passages: tuple[str, ...]
    sizes: tuple[int, ...]  # characters each passage takes in the content
    rebuild: Callable[[list[int], str], Any]  # (kept passage indices, marker text or "") -> new content
    removed_before: int = 0  # passages an earlier fit removed (its marker is taken out and counted again)


@dataclass(frozen=True)
class _Target:
    unit: int
    item: int
    split: _Split


def _query(state: FitState) -> str:
    """The request's text, or (a request of tool results only) the last user message of the history."""
    if state.query.strip():
        return state.query
    for unit in reversed(state.history):
        for item in unit:
            if item.role == "user" and item.text().strip():
                return item.text()
    return ""


def _marker_pattern(marker: str) -> re.Pattern[str] | None:
    """A regex matching the marker text (``{n}`` as a number group), to recognise an earlier fit's marker."""
    if "{n}" not in marker:
        return None
    pieces = [re.escape(piece.replace("{{", "{").replace("}}", "}")) for piece in marker.split("{n}")]
    return re.compile(r"\s*" + r"(\d+)".join(pieces) + r"\s*")


def _earlier(texts: list[str], pattern: re.Pattern[str] | None) -> int:
    """How many passages an earlier marker (the last passage) says were removed; 0 when there is none."""
    if pattern is None or not texts:
        return 0
    match = pattern.fullmatch(texts[-1])
    return int(match.group(1)) if match else 0


def _split_content(content: Any, pattern: re.Pattern[str] | None) -> _Split | None:
    """The passages of a tool result's content, or None when it cannot be split (one block, media parts)."""
    if isinstance(content, str):
        return _split_text(content, pattern)
    if not isinstance(content, list) or not content or not all(isinstance(part, TextPart) for part in content):
        return None
    parts = [part.model_dump(exclude_unset=True) for part in content]
    texts = [part.text for part in content]
    if len(parts) == 1:
        inner = _split_text(texts[0], pattern)
        if inner is None:
            return None

        def rebuild_one(kept: list[int], note: str) -> Any:
            return [{**parts[0], "text": inner.rebuild(kept, note)}]

        return _Split(inner.passages, inner.sizes, rebuild_one, inner.removed_before)
    removed = _earlier(texts, pattern)
    if removed:
        parts, texts = parts[:-1], texts[:-1]
    if len(parts) < (1 if removed else 2):
        return None

    def rebuild_parts(kept: list[int], note: str) -> Any:
        out = [parts[index] for index in kept]
        return [*out, {"type": "text", "text": note}] if note else out

    return _Split(tuple(texts), tuple(len(text) for text in texts), rebuild_parts, removed)


def _split_text(text: str, pattern: re.Pattern[str] | None) -> _Split | None:
    start = text.lstrip()[:1]
    if start in ("[", "{"):
        split = _split_json(text, pattern)
        if split is not None:
            return split
    blocks = [block.strip("\n") for block in re.split(r"\n[ \t]*(?:\n[ \t]*)+", text) if block.strip()]
    removed = _earlier(blocks, pattern)
    if removed:
        blocks = blocks[:-1]
    if len(blocks) < (1 if removed else 2):
        return None

    def rebuild(kept: list[int], note: str) -> str:
        return "\n\n".join([blocks[index] for index in kept] + ([note] if note else []))

    return _Split(tuple(blocks), tuple(len(block) for block in blocks), rebuild, removed)


# JSON: the spans of a list's items in the original text, so kept items are written back byte for byte.

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    return match.end() if match else at


def _array(text: str, at: int) -> tuple[list[tuple[int, int, Any]], int]:
    """Items of the JSON array starting at ``text[at] == "["`` as (start, end, value), and the end of the array."""
    items: list[tuple[int, int, Any]] = []
    at = _skip(text, at + 1)
    if text.startswith("]", at):
        return items, at + 1
    while True:
        value, end = _DECODER.raw_decode(text, at)
        items.append((at, end, value))
        at = _skip(text, end)
        if text.startswith(",", at):
            at = _skip(text, at + 1)
        elif text.startswith("]", at):
            return items, at + 1
        else:
            raise ValueError("not a JSON array")


def _object_lists(text: str, at: int) -> tuple[list[int], int]:
    """Start offsets of the list values of the JSON object at ``text[at] == "{"``, and the end of the object."""
    lists: list[int] = []
    at = _skip(text, at + 1)
    if text.startswith("}", at):
        return lists, at + 1
    while True:
        key, end = _DECODER.raw_decode(text, at)
        at = _skip(text, end)
        if not isinstance(key, str) or not text.startswith(":", at):
            raise ValueError("not a JSON object")
        at = _skip(text, at + 1)
        value, end = _DECODER.raw_decode(text, at)
        if isinstance(value, list):
            lists.append(at)
        at = _skip(text, end)
        if text.startswith(",", at):
            at = _skip(text, at + 1)
        elif text.startswith("}", at):
            return lists, at + 1
        else:
            raise ValueError("not a JSON object")


def _split_json(text: str, pattern: re.Pattern[str] | None) -> _Split | None:
    try:
        at = _skip(text, 0)
        if text.startswith("[", at):
            items, end = _array(text, at)
        else:
            lists, end = _object_lists(text, at)
            # The result list of e.g. {"query": ..., "results": [...]}: lists of objects first, then the longest.
            candidates = [_array(text, start)[0] for start in lists]
            items = max(
                candidates, key=lambda found: (all(isinstance(item[2], dict) for item in found), len(found)), default=[]
            )
        if _skip(text, end) != len(text):
            return None
    except ValueError:
        return None
    if not items or not all(isinstance(value, (dict, str)) for _, _, value in items):
        return None
    last = items[-1][2]
    removed = _earlier([last], pattern) if isinstance(last, str) else 0
    real = items[:-1] if removed else items
    if not real:
        return None
    head, tail = text[: items[0][0]], text[items[-1][1] :]
    separator = text[items[0][1] : items[1][0]] if len(items) > 1 else ", "
    spans = [text[start:end] for start, end, _ in real]

    def rebuild(kept: list[int], note: str) -> str:
        pieces = [spans[index] for index in kept]
        if note:
            pieces.append(json.dumps(note, ensure_ascii=False))
        return head + separator.join(pieces) + tail

    return _Split(tuple(_json_text(value) for _, _, value in real), tuple(map(len, spans)), rebuild, removed)


def _json_text(value: Any) -> str:
    """The words of a JSON item, to score: its string values (titles, snippets, urls) joined by newlines."""
    strings: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            strings.append(node)
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(value)
    text = "\n".join(string for string in strings if string.strip())
    return text or json.dumps(value, ensure_ascii=False)
