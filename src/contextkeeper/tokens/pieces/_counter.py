"""The piece counter: the rules that hold for a tokenizer, composed, beside the reference (whole-text encoding)."""

from __future__ import annotations

import bisect
import copy
import operator
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

from ..._memo import Memo, shared_prefix, shared_suffix, text_key_size
from ._rules import (
    RULES,
    AsciiWords,
    ByteBound,
    DeepSeekWords,
    LineBlocks,
    Pieces,
    Rule,
    RuleReport,
    Segments,
    SpaceWords,
    Tokenizer,
    UnicodeWords,
)

__all__ = ["PieceCounter"]

R = TypeVar("R", bound=Rule)
# count_segments' previous call: its non-empty segments, where each chunk starts, the tokens before it, the total.
_Segmented = tuple[list[str], list[int], list[int], int]
_NO_SEGMENTS: _Segmented = ([], [], [], 0)


class PieceCounter:
    """Counts ``len(tokenizer.encode(text, add_special_tokens=False))`` piece by piece, with a cache.

    Built with the rules the tokenizer's settings allow; :meth:`verify` proves each against the tokenizer and
    switches off the ones it disproves (:attr:`rules` says which are on, and why the others are off). Every count
    has a reference of the same signature that encodes whole texts: :meth:`full`."""

    candidates: ClassVar[tuple[type[Rule], ...]] = RULES  # the rules tried, in build order

    def __init__(self, backend: Any) -> None:
        self._tokenizer = tokenizer = Tokenizer(backend)  # a tokenizers.Tokenizer
        self._on: dict[str, Rule] = {}
        self._off: dict[str, str] = {}
        for rule in self.candidates:
            why = self._missing(rule) or rule.refusal(tokenizer)
            if why is None:
                self._on[rule.name] = rule(tokenizer)
            else:
                self._off[rule.name] = why
        self._verified = False
        self._take_rules()
        # Every cache is a Memo: bounded, with all of contextkeeper's caches, by the shared byte budget.
        self._after: Memo[str, int] = Memo("pieces.after", sizer=text_key_size)  # a piece after an added token
        self._alone: Memo[str, int] = Memo("pieces.alone", sizer=text_key_size)
        # Segment counting (see count_segments): counts of whole chunks (the head's apart, its first piece being
        # counted without the anchor).
        self._chunks: Memo[str, int] = Memo("pieces.chunks", sizer=text_key_size)
        self._heads: Memo[str, int] = Memo("pieces.heads", sizer=text_key_size)
        # The previous text and its checkpoints (offsets of its added tokens, tokens before each), for resuming.
        self._last = ""
        self._bounds: list[int] = []
        self._totals: list[int] = []
        self._segmented: _Segmented = _NO_SEGMENTS

    # -- the rules -------------------------------------------------------------------------------------------
    def _missing(self, rule: type[Rule]) -> str | None:
        off = [name for name in rule.needs if name not in self._on]
        return f"needs the {off[0]} rule, which is off" if off else None

    def _rule(self, kind: type[R]) -> R | None:
        rule = self._on.get(kind.name)
        return rule if isinstance(rule, kind) else None

    def _take_rules(self) -> None:
        self._pieces = self._rule(Pieces)
        self._segments = self._rule(Segments)
        self._blocks = self._rule(LineBlocks)
        self._words = self._rule(AsciiWords)
        self._unicode = self._rule(UnicodeWords)
        self._deepseek = self._rule(DeepSeekWords)
        self._spaces = self._rule(SpaceWords)
        self._bound = self._rule(ByteBound)
        # The pre-token rules on, in the order they take pieces (ASCII first: its regex is the smaller). DeepSeek's
        # rule is on only where the other two are off (they need another pre-tokenizer), the space rule only where
        # all three are (it needs a tokenizer that cuts nothing).
        word_rules = (self._words, self._unicode, self._deepseek, self._spaces)
        self._word_rules: list[AsciiWords] = [rule for rule in word_rules if rule is not None]
        # Byte-level BPE without a prefix space (what blocks and words need), or BPE that only replaces spaces (what
        # the space rule needs, and proves): a text's first piece counts as any piece after an added token, so a
        # text alone is its pieces.
        self._alone_as_pieces = self._pieces is not None and (self._blocks is not None or bool(self._word_rules))

    @property
    def rules(self) -> RuleReport:
        """The rules on for this tokenizer, and why each other one is off."""
        return RuleReport(on=tuple(self._on), off=tuple(self._off.items()), verified=self._verified)

    @property
    def fast(self) -> bool:
        """Whether counts go by pieces (else every count encodes the whole text)."""
        return self._pieces is not None

    @property
    def in_blocks(self) -> bool:
        """Whether long pieces are counted in line blocks."""
        return self._blocks is not None

    def verify(self) -> bool:
        """Prove each rule against whole-text encoding on its probe texts, in build order; switch off the ones
        that fail and the ones that need them. True when counts go by pieces."""
        tokenizer = self._tokenizer
        for name, rule in list(self._on.items()):
            why = self._missing(type(rule))
            if why is None and not rule.verify(tokenizer):
                why = f"disagreed with the tokenizer on its probe texts ({rule.claim})"
            if why is not None:
                del self._on[name]
                self._off[name] = why
        self._verified = True
        self._take_rules()
        self.clear()
        return self.fast

    # -- counting --------------------------------------------------------------------------------------------
    def full(self, text: str) -> int:
        """The reference: encode the whole text at once."""
        return self._tokenizer.full(text)

    def count(self, text: str) -> int:
        """Exact token count of ``text`` (no special tokens added); resumes from the previous text's checkpoints
        inside the prefix the two share."""
        pieces = self._pieces
        if pieces is None:
            return self.full(text)
        segments = self._segments
        start, base, kept = (
            segments.resume_point(text, self._last, self._bounds, self._totals) if segments else (0, 0, 0)
        )
        parts = pieces.split(text[start:] if start else text)
        counts = self._part_counts(parts, pieces)
        if segments is not None:
            self._checkpoint(text, parts, counts, start, base, kept)
        return base + sum(counts)

    def _part_counts(self, parts: list[str], pieces: Pieces) -> list[int]:
        """Tokens of each part of a cut text: one per added-token match, each piece's count."""
        counts = [0] * len(parts)
        counts[1::2] = [1] * (len(parts) // 2)
        if parts[0]:  # only at offset 0: a resumed suffix starts on an added token, so its first part is ""
            counts[0] = pieces.first(parts[0], self._tokenizer)
        missing: list[int] = []
        after = self._after
        for index in range(2, len(parts), 2):
            piece = parts[index]
            if piece:
                cached = after.get(piece)
                if cached is None:
                    missing.append(index)
                else:
                    counts[index] = cached
        if missing:
            lengths = self._encode_new([parts[i] for i in missing])
            for index in missing:
                counts[index] = lengths[parts[index]]
        return counts

    def _checkpoint(self, text: str, parts: list[str], counts: list[int], start: int, base: int, kept: int) -> None:
        """Remember ``text`` with a checkpoint at every added token (offset, tokens before it), for the next
        count to resume from."""
        bounds, totals = self._bounds[:kept], self._totals[:kept]
        offset, total = start, base
        for index, part in enumerate(parts):
            if index % 2:
                bounds.append(offset)
                totals.append(total)
            offset += len(part)
            total += counts[index]
        self._last, self._bounds, self._totals = text, bounds, totals

    def count_segments(self, segments: Sequence[str]) -> int:
        """``count("".join(segments))``, from counts cached per segment.

        Exact: when a segment starts with an added token and the segment before it cannot end inside one (no
        suffix of it is a proper prefix of an added token), no added token of the whole text runs across their
        border, so the whole text's pieces are the two segments' pieces and the counts add up. Other segments are
        joined with the one before them and counted together.

        The chunks of the previous call are remembered with the tokens before each: the runs of segments this
        call shares with it at either end are taken whole, so only the segments in between are looked at."""
        rule = self._segments
        if rule is None:
            return self.count("".join(segments))
        texts = [segment for segment in segments if segment]
        old = self._segmented
        shared = shared_prefix(texts, old[0], operator.eq)
        if old[0] and shared == len(texts) == len(old[0]):
            return old[3]
        resume, starts, before, total = self._kept_head(old, shared)
        stop, first = self._kept_tail(texts, old, shared, resume)
        found = rule.chunks(texts, resume, stop)
        for (start, _), tokens in zip(found, self._count_chunks([(s == 0, c) for s, c in found]), strict=True):
            starts.append(start)
            before.append(total)
            total += tokens
        if stop < len(texts):  # the old chunks from ``first`` on, shifted to where they sit now
            _, old_starts, old_before, old_total = old
            shift = len(texts) - len(old[0])
            starts += [start + shift for start in old_starts[first:]]
            before += [total + tokens - old_before[first] for tokens in old_before[first:]]
            total += old_total - old_before[first]
        self._segmented = (texts, starts, before, total)
        return total

    @staticmethod
    def _kept_head(old: _Segmented, shared: int) -> tuple[int, list[int], list[int], int]:
        """The previous call's chunks kept at the start, given how many segments the two calls share there: (the
        first segment to look at, their starts, the tokens before each, their total). A chunk border depends only
        on the two segments beside it, so one inside a shared run is a border here too; the last chunk starting
        inside the run is looked at again."""
        _, old_starts, old_before, _ = old
        kept = bisect.bisect_left(old_starts, shared) - 1
        if kept < 1:
            return 0, [], [], 0
        return old_starts[kept], old_starts[: kept + 1], old_before[: kept + 1], old_before[kept]

    @staticmethod
    def _kept_tail(texts: list[str], old: _Segmented, shared: int, resume: int) -> tuple[int, int]:
        """The previous call's chunks kept at the end: (the segment where they start now, the first of them in
        the previous call), or (len(texts), 0) when none is kept."""
        old_texts, old_starts, _, _ = old
        if not old_texts or shared >= len(texts):
            return len(texts), 0
        ended = shared_suffix(texts, old_texts, operator.eq)
        first = bisect.bisect_left(old_starts, len(old_texts) - ended + 1)  # its segment before is shared too
        shift = len(texts) - len(old_texts)
        if first < len(old_starts) and old_starts[first] + shift > resume:
            return old_starts[first] + shift, first
        return len(texts), 0

    def _count_chunks(self, chunks: list[tuple[bool, str]]) -> list[int]:
        """Tokens of each chunk (see :meth:`count_segments`), from the caches or with every new piece tokenized in
        one batch. A head chunk's first piece is counted without the anchor."""
        pieces = self._pieces
        assert pieces is not None
        counts: list[int] = []
        misses: list[tuple[int, bool, str, list[str]]] = []
        for head, chunk in chunks:
            known = (self._heads if head else self._chunks).get(chunk)
            counts.append(known or 0)
            if known is None:
                misses.append((len(counts) - 1, head, chunk, pieces.split(chunk)))
        found = self._cut_tokens([parts for _, _, _, parts in misses], first=False)
        new_chunks: list[tuple[str, int]] = []
        for (position, head, chunk, parts), tokens in zip(misses, found, strict=True):
            if head:
                if parts[0]:  # text before the head's first added token
                    tokens += pieces.first(parts[0], self._tokenizer)
                self._heads.put(chunk, tokens)
            else:
                new_chunks.append((chunk, tokens))
            counts[position] = tokens
        if new_chunks:
            self._chunks.put_many(new_chunks)
        return counts

    def _cut_tokens(self, cuts: list[list[str]], *, first: bool) -> list[int]:
        """Tokens of texts already cut at added tokens (``re.split`` shape): one per match plus each piece's count
        after an added token, the new pieces tokenized in one batch. The text before the first match is counted
        too when ``first``, which is right only where it counts as it would after an added token."""
        start = 0 if first else 2
        pieces: dict[str, int | None] = {}  # the pieces, with their cached counts
        for parts in cuts:
            for piece in parts[start::2]:
                if piece and piece not in pieces:
                    pieces[piece] = self._after.get(piece)
        new = [piece for piece, n in pieces.items() if n is None]
        if new:
            pieces.update(self._encode_new(new))
        return [len(parts) // 2 + sum(pieces[piece] or 0 for piece in parts[start::2] if piece) for parts in cuts]

    def _encode_new(self, pieces: list[str]) -> dict[str, int]:
        """Tokens of pieces not in the cache, each after an added token, by the rules that are on: ASCII pieces by
        their pre-tokens, long other pieces by their line blocks (whose ASCII blocks go by pre-tokens again), the
        rest by the tokenizer in one batch. All are remembered."""
        unique = list(dict.fromkeys(pieces))
        blocks_of = self._long_pieces(unique)
        todo = unique
        known: dict[str, int | None] = {}  # the blocks' cached counts, read once (the cache may turn over below)
        if blocks_of:
            known = {block: self._after.get(block) for blocks in blocks_of.values() for block in blocks}
            todo = [piece for piece in unique if piece not in blocks_of]
            todo.extend(block for block, n in known.items() if n is None)
        lengths = self._encode_pieces(todo)
        for piece, blocks in blocks_of.items():
            lengths[piece] = sum(lengths[block] if block in lengths else known[block] or 0 for block in blocks)
        self._after.put_many(lengths.items())
        return lengths

    def _long_pieces(self, pieces: list[str]) -> dict[str, list[str]]:
        """The pieces counted in line blocks (long, and not counted by pre-tokens), cut."""
        blocks = self._blocks
        if blocks is None:
            return {}
        return {piece: blocks.cut(piece) for piece in pieces if len(piece) >= blocks.size and not self._by_words(piece)}

    def _by_words(self, piece: str) -> bool:
        """Whether a pre-token rule counts ``piece``."""
        return any(rule.takes(piece) for rule in self._word_rules)

    def _encode_pieces(self, todo: list[str]) -> dict[str, int]:
        """Tokens of each piece after an added token: by pre-tokens where a rule takes the piece (ASCII ones,
        then those of the covered scripts), the rest by the tokenizer."""
        lengths: dict[str, int] = {}
        for rule in self._word_rules:
            taken = [piece for piece in todo if rule.takes(piece)]
            if taken:
                lengths.update(zip(taken, rule.count(taken, self._tokenizer), strict=True))
                todo = [piece for piece in todo if piece not in lengths]
        if todo:
            assert self._pieces is not None
            lengths.update(zip(todo, self._pieces.after(todo, self._tokenizer), strict=True))
        return lengths

    # -- texts on their own ----------------------------------------------------------------------------------
    def alone(self, text: str) -> int:
        """Tokens of ``text`` encoded on its own, from a cache keyed by the text; the resume state of
        :meth:`count` is left alone, so counting snippets between prompts costs the prompts nothing."""
        cached = self._alone.get(text)
        if cached is None:
            by_rules = (self._blocks is not None and len(text) >= self._blocks.size) or self._by_words(text)
            if self._alone_as_pieces and by_rules:
                return self.alone_many([text])[0]
            cached = self.full(text)
            self._alone.put(text, cached)
        return int(cached)

    def alone_many(self, texts: list[str]) -> list[int]:
        """:meth:`alone` of each text; the ones not cached are encoded in one batch (in parallel)."""
        cache = self._alone
        missing = list(dict.fromkeys(t for t in texts if cache.get(t) is None))
        if missing and self._alone_as_pieces:
            assert self._pieces is not None
            found = self._cut_tokens([self._pieces.split(text) for text in missing], first=True)
            cache.put_many(zip(missing, found, strict=True))
        elif missing:
            cache.put_many(zip(missing, self._tokenizer.batch(missing), strict=True))
        return [self.alone(t) for t in texts]

    def bound(self, text: str) -> int | None:
        """An upper bound on :meth:`alone` without tokenizing (UTF-8 bytes, see ``ByteBound``), or None."""
        return self.bound_many((text,))

    def bound_many(self, texts: Sequence[str]) -> int | None:
        """:meth:`bound` of the texts' concatenation."""
        return self._bound.bound(texts) if self._bound is not None else None

    # -- state -----------------------------------------------------------------------------------------------
    @property
    def encoded_chars(self) -> int:
        """Characters sent to the tokenizer so far (for text under a pre-token rule: the new pre-tokens handed to
        its BPE model): what caching saves is visible here."""
        return self._tokenizer.chars

    def fork(self) -> PieceCounter:
        """A counter sharing this one's piece caches (counts depend only on the piece text) with resume state of
        its own. The caches are thread-safe memos; an entry dropped between two threads' reads costs a re-encode,
        never a wrong count."""
        clone = copy.copy(self)
        clone._tokenizer = self._tokenizer.fork()
        clone._last, clone._bounds, clone._totals = "", [], []
        clone._segmented = _NO_SEGMENTS
        return clone

    def forget(self) -> None:
        """Drop the resume points (the last text and segments counted), keeping every cache."""
        self._last, self._bounds, self._totals = "", [], []
        self._segmented = _NO_SEGMENTS

    def clear(self) -> None:
        for rule in self._on.values():
            rule.clear()
        self._chunks.clear()
        self._heads.clear()
        self._after.clear()
        self._alone.clear()
        self._tokenizer.chars = 0
        self._last, self._bounds, self._totals = "", [], []
        self._segmented = _NO_SEGMENTS

    @property
    def cached_pieces(self) -> int:
        return len(self._after) + (self._pieces.cached if self._pieces is not None else 0)
