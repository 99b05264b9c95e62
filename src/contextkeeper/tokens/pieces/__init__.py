"""Exact, cached token counts of rendered prompts, by rules each proved against the tokenizer.

Hugging Face tokenizers cut the input at added tokens (the special tokens a chat template writes) before
anything else, then normalise, pre-tokenise and encode each piece on its own. So the length of
``encode(text)`` is the number of added-token matches plus the sum of each piece's own length, where a piece
is encoded the way it is encoded after an added token — except the piece at the very start of the text, which
some SentencePiece tokenizers prefix with a space. We count every distinct piece once and remember it, so a
long conversation costs its new pieces only.

Each rule that makes this fast is an object (``_rules``): it says from the tokenizer's settings whether it
applies, proves itself against the tokenizer on probe texts, and does the counting it allows —

- ``pieces``: a text counts as its pieces between added tokens (the base of every other rule but ``bound``);
- ``segments``: a text cut before an added token counts as its two sides, so segment lists and prompts that
  share a prefix with the previous one are counted from what is new;
- ``blocks``: for byte-level BPE with the Llama 3, Qwen2/Qwen3, Qwen3.5 or DeepSeek V3 split pattern, a long
  piece counts as its blocks cut at line starts (every line start is a pre-token border there);
- ``words``: for the first three of those, an ASCII piece counts as its pre-tokens, cut by our own regex and
  each distinct one encoded once by the BPE model (the tokenizer's own work per pre-token, without its per-call
  overhead);
- ``unicode``: the same for pieces in other scripts (Latin with diacritics, Greek, Cyrillic, Arabic, the Indic
  scripts, CJK, Hangul and their punctuation), with the pattern's classes written out from the Unicode tables
  and proved against the tokenizer's own pre-tokenizer for every covered character; pieces with other
  characters, or not in the normaliser's form, go to the tokenizer;
- ``deepseek``: the same for DeepSeek V3's pre-tokenizer, three splits in a row (runs of up to three numbers,
  runs of CJK ideographs and kana, then its word pattern), cut by one regex of ours proved against the
  tokenizer's own three splits;
- ``spaces``: for BPE that writes each space as one symbol and cuts nothing before its merges (Gemma's), a piece
  counts as its words cut before spaces, each distinct one encoded once by the BPE model; no cut is made where a
  token of the vocabulary runs across the space, which the rule reads from the vocabulary;
- ``bound``: byte-level BPE has at most one token per UTF-8 byte (an upper bound without tokenizing).

``PieceCounter`` holds the rules that applied and verified and composes them; ``PieceCounter.full`` is the
reference (the whole text encoded at once), and ``PieceCounter.rules`` says which rules are on and why each
other one is off. A tokenizer that breaks a rule (for example added tokens matched on normalised text) is
counted without it — slower, never wrong.
"""

from __future__ import annotations

from ._counter import PieceCounter
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
    UnicodeWords,
)
from ._split import common_prefix

__all__ = [
    "RULES",
    "AsciiWords",
    "ByteBound",
    "DeepSeekWords",
    "LineBlocks",
    "PieceCounter",
    "Pieces",
    "Rule",
    "RuleReport",
    "Segments",
    "SpaceWords",
    "UnicodeWords",
    "common_prefix",
]
