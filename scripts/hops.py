"""How many files and calls lie between contextkeeper's public API and the work it hands off (a maintainer's tool).

    python scripts/hops.py            # the table, then each entry point's chain
    python scripts/hops.py --json     # the same as one JSON object

Measured, not read from the code: each entry point is called under ``sys.setprofile`` on the real qwen2
tokenizer with the Qwen3-0.6B chat template (the test assets: ``python scripts/fetch_assets.py``). Every time
a call leaves contextkeeper for its target, the stack is walked back to the public call, and the shortest such
chain is reported.

Entry points and their targets:

* ``ContextKeeper.fit`` and ``load_counter(...).count`` / ``breakdown``: a call into the Rust ``tokenizers``
  library that produces token ids (``Tokenizer.encode`` / ``encode_batch`` / ``encode_batch_fast``, or the
  model's ``tokenize`` for the pre-tokens contextkeeper cuts itself), reached from contextkeeper directly or
  through transformers' tokenizer.
* ``keeper.wrap(fn)`` then ``wrapped(messages)``: the call of ``fn``, a plain Python callable standing in for
  the HTTP send (and, in its own row, the tokenizer as above).

``first`` rows are the first call a new keeper or counter gets; ``steady`` rows come after a warm-up. Every call
gets messages nothing has seen yet (cached pieces would otherwise hide the tokenizer).

Columns: ``files`` is the number of distinct contextkeeper files on the chain, counting ``__init__.py``, which
exports the public name; ``calls`` the contextkeeper frames from the public call (included) to the one that calls
out; ``via`` the frames of other code in between (transformers' tokenizer, functools, contextlib, ...). List,
dict and set comprehensions are not counted as calls (Python 3.12 inlines them). ``seen`` is how many times the
call reached its target in all. Only the calling thread is traced, which is where these sync entry points do
their work. The exit status is 1 when an entry never reached its target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import contextkeeper as ck  # noqa: E402
from assets import require_assets, template, tokenizer_dir  # noqa: E402

PACKAGE = Path(ck.__file__).resolve().parent
TOKENIZING = frozenset({"encode", "encode_batch", "encode_batch_fast", "tokenize"})
INLINED = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})
# Names the call being made (a string) when it is the one sought: (frame, profiler event, its argument).
Target = Callable[[types.FrameType, str, Any], str | None]


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame on a chain: where it runs, the function, and whether it is contextkeeper's own."""

    file: str
    line: int
    function: str
    ours: bool

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


@dataclasses.dataclass(frozen=True)
class Chain:
    """The frames from the public call down to the one that calls ``target``."""

    frames: tuple[Frame, ...]
    target: str

    @property
    def calls(self) -> int:
        return sum(frame.ours and frame.function not in INLINED for frame in self.frames)

    @property
    def via(self) -> int:
        return sum(not frame.ours for frame in self.frames)

    def files(self) -> list[str]:
        """The distinct contextkeeper files, in the order the chain first reaches them, ``__init__.py`` first."""
        seen = ["__init__.py"]
        for frame in self.frames:
            if frame.ours and frame.file not in seen:
                seen.append(frame.file)
        return seen


@dataclasses.dataclass(frozen=True)
class Row:
    entry: str
    state: str
    chain: Chain | None
    targets_seen: int


def _frame(frame: types.FrameType) -> Frame:
    path = Path(frame.f_code.co_filename).resolve()
    ours = path.is_relative_to(PACKAGE)
    if ours:
        name = str(path.relative_to(PACKAGE))
    else:
        parts = path.parts
        site = next((i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")), None)
        name = "/".join(parts[site + 1 :]) if site is not None else path.name
    return Frame(name, frame.f_lineno, frame.f_code.co_name, ours)


def _chain(caller: types.FrameType, stop: types.FrameType, target: str) -> Chain | None:
    """The chain from the public call to ``caller``; None unless ``caller`` runs under ``stop``'s call and the
    call out leaves contextkeeper code (or a transformers tokenizer that contextkeeper called)."""
    frames: list[Frame] = []
    frame: types.FrameType | None = caller
    while frame is not None and frame is not stop:
        frames.append(_frame(frame))
        frame = frame.f_back
    if frame is None or not frames:
        return None
    frames.reverse()
    while frames and not frames[0].ours:  # the measuring lambda: above the public call
        frames.pop(0)
    deepest = max((i for i, f in enumerate(frames) if f.ours), default=None)
    if deepest is None or not all(f.file.startswith("transformers/") for f in frames[deepest + 1 :]):
        return None  # e.g. a tokenizer call made by a loader, not for the prompt
    return Chain(tuple(frames), target)


def trace(run: Callable[[], object], is_target: Target) -> list[Chain]:
    """Call ``run`` under the profiler; a chain each time ``is_target`` names the call being made."""
    chains: list[Chain] = []
    stop = sys._getframe()  # chains end here: the frames above belong to this script

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        target = is_target(frame, event, arg)
        caller = frame if event == "c_call" else frame.f_back
        if target is not None and caller is not None:
            chain = _chain(caller, stop, target)
            if chain is not None:
                chains.append(chain)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return chains


def tokenizer_call(frame: types.FrameType, event: str, arg: Any) -> str | None:
    """``tokenizers.<Type>.<method>`` for a call into the Rust tokenizers library that produces ids."""
    if event != "c_call" or getattr(arg, "__name__", None) not in TOKENIZING:
        return None
    owner = getattr(arg, "__self__", None)
    kind = type(owner)
    return f"{kind.__module__}.{kind.__qualname__}.{arg.__name__}" if kind.__module__.startswith("tokenizers") else None


def call_of(fn: Callable[..., Any]) -> Target:
    code = fn.__code__

    def is_target(frame: types.FrameType, event: str, arg: Any) -> str | None:
        return f"{fn.__module__}.{fn.__qualname__}" if event == "call" and frame.f_code is code else None

    return is_target


def measure(entry: str, state: str, run: Callable[[], object], is_target: Target) -> Row:
    chains = trace(run, is_target)
    best = min(chains, key=lambda chain: (chain.calls, len(chain.files())), default=None)
    return Row(entry, state, best, len(chains))


def conversation(topic: str) -> list[dict[str, Any]]:
    """A short chat about ``topic``, with non-ASCII text so both of the tokenizer's paths run."""
    return [
        {"role": "system", "content": "You are a concise assistant. Answer in one paragraph."},
        {"role": "user", "content": f"What should I know about {topic}? I read « {topic} » in a café menu."},
        {"role": "assistant", "content": f"{topic.capitalize()} comes up often; here is the short version."},
        {"role": "user", "content": f"Give me three facts about {topic}, naïvely put."},
    ]


def rows() -> list[Row]:
    require_assets()
    spec, chat_template = str(tokenizer_dir("qwen2")), template("Qwen-Qwen3-0.6B")
    keeper = ck.ContextKeeper(tokenizer=spec, chat_template=chat_template, context_window=8192)
    counter = ck.load_counter(spec, chat_template=chat_template)

    def send(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return f"{len(messages)} messages"

    wrapped = keeper.fresh().wrap(send)
    # In order: each "first" is the first call its keeper or counter gets; every call sees new topics.
    steps: list[tuple[str, str, Callable[[], object], Target]] = [
        ("ContextKeeper.fit", "first", lambda: keeper.fit(conversation("tides"), max_tokens=512), tokenizer_call),
        ("ContextKeeper.fit", "steady", lambda: keeper.fit(conversation("comets"), max_tokens=512), tokenizer_call),
        ("load_counter().count", "first", lambda: counter.count(conversation("glaciers")), tokenizer_call),
        ("load_counter().count", "steady", lambda: counter.count(conversation("volcanoes")), tokenizer_call),
        ("breakdown", "steady", lambda: ck.breakdown(counter, conversation("deserts")), tokenizer_call),
        ("wrap(fn)(...) -> fn", "first", lambda: wrapped(conversation("rivers"), max_tokens=256), call_of(send)),
        ("wrap(fn)(...) -> fn", "steady", lambda: wrapped(conversation("forests"), max_tokens=256), call_of(send)),
        (
            "wrap(fn)(...) -> tokenizer",
            "steady",
            lambda: wrapped(conversation("caves"), max_tokens=256),
            tokenizer_call,
        ),
    ]
    return [measure(*step) for step in steps]


def table(found: list[Row]) -> str:
    header = ("entry", "state", "files", "calls", "via", "target", "seen")
    lines = [header]
    for row in found:
        chain = row.chain
        if chain is None:
            lines.append((row.entry, row.state, "-", "-", "-", "not reached", str(row.targets_seen)))
        else:
            cells = (str(len(chain.files())), str(chain.calls), str(chain.via), chain.target, str(row.targets_seen))
            lines.append((row.entry, row.state, *cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def chains(found: list[Row]) -> str:
    text = []
    for row in found:
        if row.chain is None or row.state != "steady":
            continue
        text.append(f"\n{row.entry} ({row.state}): {' -> '.join(row.chain.files())}")
        text += [f"  {'' if frame.ours else '(via) '}{frame}" for frame in row.chain.frames]
        text.append(f"  -> {row.chain.target}")
    return "\n".join(text)


def as_json(found: list[Row]) -> dict[str, Any]:
    return {
        "rows": [
            {
                "entry": row.entry,
                "state": row.state,
                "targets_seen": row.targets_seen,
                "files": None if row.chain is None else row.chain.files(),
                "calls": None if row.chain is None else row.chain.calls,
                "via": None if row.chain is None else row.chain.via,
                "target": None if row.chain is None else row.chain.target,
                "frames": [] if row.chain is None else [dataclasses.asdict(f) for f in row.chain.frames],
            }
            for row in found
        ]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    found = rows()
    if args.json:
        print(json.dumps(as_json(found), indent=2))
    else:
        print(table(found))
        print(chains(found))
    return 0 if all(row.chain is not None for row in found) else 1


if __name__ == "__main__":
    raise SystemExit(main())
