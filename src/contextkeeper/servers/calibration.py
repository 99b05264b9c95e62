"""Calibration: compare the keeper's counts with what a running server counts, probe by probe, and say why.

Each probe is a small conversation aimed at one rule where servers differ (see docs/dialects.md). A server that
counts a chat request on request (llama.cpp's ``/apply-template`` and ``/tokenize``; vLLM's and SGLang's
``/tokenize`` with messages) counts every probe without generating anything; each difference is reported with the
rule its probe tests and the dialect setting that follows the server.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .._exceptions import ConfigurationError, ContextKeeperError
from .http import request_json, root_url

__all__ = ["PROBES", "Calibration", "Probe", "ProbeResult", "calibrate"]


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One conversation that shows one rule."""

    name: str
    rule: str  # what a difference on this probe means
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What the keeper and the server counted for one probe."""

    probe: str
    rule: str
    ours: int | None  # None: the keeper refuses the probe
    server: int | None  # None: the server refused it
    same_text: bool | None  # the rendered prompts equal (None where either side has none)
    detail: str = ""  # the refusal, where one side refused
    cause: str = ""  # what the difference points to: the probe's rule, or what every probe shares ("" if none)

    @property
    def agrees(self) -> bool:
        return self.ours == self.server


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Every probe's result against one server, for one dialect."""

    url: str
    dialect: str
    results: tuple[ProbeResult, ...]

    @property
    def differences(self) -> tuple[ProbeResult, ...]:
        return tuple(result for result in self.results if not result.agrees)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "dialect": self.dialect,
            "agree": len(self.results) - len(self.differences),
            "results": [{**result.__dict__, "agrees": result.agrees} for result in self.results],
        }


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


_ASK = {"role": "user", "content": "Is the nightly export done?"}
_LOOKUP = _tool(
    name="lookup",
    description="Look up an order.",
    parameters={"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]},
)
PROBES: tuple[Probe, ...] = (
    Probe(
        name="plain",
        rule="the template, the tokenizer or the BOS: the prompts differ even where no rule applies",
        messages=(_ASK,),
    ),
    Probe(
        name="developer-role",
        rule="roles: developer mapped to system (llama.cpp; vLLM where the template does not name the role) or passed "
        "as is",
        messages=({"role": "developer", "content": "Be brief."}, _ASK),
    ),
    Probe(
        name="tool-without-description",
        rule="tool schemas: description and parameters filled in, keys reordered (llama.cpp)",
        messages=(_ASK,),
        tools=(_tool(name="ping"),),
    ),
    Probe(
        name="tool-strict",
        rule='tool schemas: "strict" and other extra keys dropped (llama.cpp)',
        messages=(_ASK,),
        tools=({**_LOOKUP, "function": {**_LOOKUP["function"], "strict": True}},),
    ),
    Probe(
        name="whole-float-argument",
        rule="tojson of a whole float: 1 (llama.cpp) or 1.0 (Python)",
        messages=(
            _ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"n": 1.0}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
        ),
        tools=(_LOOKUP,),
    ),
    Probe(
        name="decomposed-text",
        rule="Unicode normalisation of the text (NFC applied by the tokenizer, or none: llama.cpp)",
        messages=({"role": "user", "content": unicodedata.normalize("NFD", "Café, 한국어 텍스트, Ångström")},),
    ),
    Probe(
        name="unicode-space-ends",
        rule="trim: every Unicode space (Python) or ASCII only (llama.cpp)",
        messages=({"role": "user", "content": "\u3000Is the export done?\u00a0"},),
    ),
    Probe(
        name="final-assistant",
        rule="a final assistant message answered (vLLM) or continued (llama.cpp)",
        messages=(_ASK, {"role": "assistant", "content": "The export"}),
    ),
)


@dataclass(frozen=True, kw_only=True)
class _Counted:
    """What a server counted for one probe: its tokens and prompt text (None where it gives none), or its refusal."""

    tokens: int | None
    text: str | None = None
    refusal: str = ""


class _NotHere(Exception):
    """The server has no such endpoint (HTTP 404/405): try the next way."""


def _llamacpp(url: str, body: dict[str, Any], timeout: float) -> _Counted:
    # llama-server: /apply-template renders the chat request as /v1/chat/completions would; /tokenize counts it
    status, answer = request_json(f"{url}/apply-template", body, timeout=timeout, purpose="calibrate")
    if status in (404, 405):
        raise _NotHere
    applied = answer if isinstance(answer, dict) else {}
    if status != 200 or not isinstance(applied.get("prompt"), str):
        return _Counted(tokens=None, refusal=str(applied.get("error", applied))[:200])
    text = applied["prompt"]
    status, tokenized = request_json(
        f"{url}/tokenize",
        {"content": text, "add_special": True, "parse_special": True},
        timeout=timeout,
        purpose="calibrate",
    )
    if status != 200 or not isinstance(tokenized, dict) or not isinstance(tokenized.get("tokens"), list):
        raise ConfigurationError(f"{url}/tokenize answered {status}; calibrate needs llama.cpp's /tokenize")
    return _Counted(tokens=len(tokenized["tokens"]), text=text)


def _tokenize_messages(url: str, body: dict[str, Any], timeout: float) -> _Counted:
    # vLLM (vllm/entrypoints/serve/tokenize/protocol.py: TokenizeChatRequest) and SGLang (sglang/srt/entrypoints/
    # openai/protocol.py: TokenizeRequest): /tokenize takes the chat request's messages and tools and prepares them
    # as /v1/chat/completions does while add_generation_prompt is left out (SGLang renders them "as given" with it)
    status, answer = request_json(f"{url}/tokenize", body, timeout=timeout, purpose="calibrate")
    if status in (404, 405):
        raise _NotHere
    tokenized = answer if isinstance(answer, dict) else {}
    if status == 200 and isinstance(tokenized.get("count"), int):
        return _Counted(tokens=tokenized["count"])
    if status == 200 and isinstance(tokenized.get("tokens"), list):
        return _Counted(tokens=len(tokenized["tokens"]))
    if status == 200:  # a /tokenize that does not take messages (llama.cpp's takes "content")
        raise _NotHere
    error = tokenized.get("error", tokenized.get("message", tokenized))
    return _Counted(tokens=None, refusal=str(error)[:200])


# The ways a server counts a chat request on request, tried in order until one is there (no text is generated).
WAYS: tuple[tuple[str, Callable[[str, dict[str, Any], float], _Counted]], ...] = (
    ("llama.cpp /apply-template + /tokenize", _llamacpp),
    ("vLLM or SGLang /tokenize with messages", _tokenize_messages),
)


def calibrate(counter: Any, target: Any, *, timeout: float = 10.0) -> Calibration:
    """Count every probe with ``counter`` and with the server at ``target`` (a URL or an openai client).

    The server must count a chat request on request (:data:`WAYS`: llama.cpp's ``/apply-template`` and
    ``/tokenize``, vLLM's and SGLang's ``/tokenize`` with messages); one that cannot is a ConfigurationError naming
    the endpoints."""
    url = root_url(target, "calibrate")
    ways = list(WAYS)
    results = []
    for probe in PROBES:
        body: dict[str, Any] = {"messages": list(probe.messages)}
        if probe.tools:
            body["tools"] = list(probe.tools)
        counted = None
        while counted is None:
            if not ways:
                raise ConfigurationError(
                    f"{url} counts no chat request on request (asked: {', '.join(name for name, _ in WAYS)}); "
                    "calibrate needs llama.cpp's llama-server, vLLM or SGLang. Fix: calibrate against one of those, or "
                    "rely on the drift the wrapped client learns"
                )
            try:
                counted = ways[0][1](url, body, timeout)
            except _NotHere:
                ways.pop(0)  # the next way, for this probe and the rest
        detail = f"server: {counted.refusal}" if counted.tokens is None else ""
        ours: int | None = None
        ours_text: str | None = None
        try:
            ours = counter.count(list(probe.messages), tools=list(probe.tools) or None)
            render = getattr(counter, "render", None)
            ours_text = render(list(probe.messages), tools=list(probe.tools) or None) if render else None
        except ContextKeeperError as error:
            detail = (detail + "; " if detail else "") + f"keeper: {str(error)[:200]}"
        same = None if counted.text is None or ours_text is None else counted.text == ours_text
        results.append(
            ProbeResult(
                probe=probe.name, rule=probe.rule, ours=ours, server=counted.tokens, same_text=same, detail=detail
            )
        )
    dialect = getattr(getattr(counter, "dialect", None), "name", "vllm")
    return Calibration(url=url, dialect=str(dialect), results=_causes(results))


def _gap(result: ProbeResult) -> int | None:
    return None if result.ours is None or result.server is None else result.server - result.ours


def _causes(results: list[ProbeResult]) -> tuple[ProbeResult, ...]:
    """Each difference's cause: the probe's own rule, unless the plain probe differs by just as much (then what
    every prompt shares, such as a BOS, explains it)."""
    shared = _gap(results[0]) if results and results[0].probe == "plain" else None
    out = []
    for result in results:
        if result.agrees:
            cause = ""
        elif result.probe != "plain" and shared and _gap(result) == shared:
            cause = f"the same difference as the plain probe ({shared:+d}): {results[0].rule}"
        else:
            cause = result.rule
        out.append(replace(result, cause=cause))
    return tuple(out)
