"""The contextkeeper error tree, warnings included.

Every error says what went wrong, by how much where a number applies, and which setting fixes it.

```
ContextKeeperError
├── ConfigurationError
│   ├── TokenizerNotFound          the tokenizer spec names nothing we can load
│   ├── ModelConfigError           a model config that is malformed, incomplete or has an unknown layer kind
│   ├── UnknownModel               a model name that is no file, folder, cached hub id or catalog entry
│   ├── UnknownGPU                 a GPU name not in the catalog (.matches: the closest names)
│   ├── UnknownSymptom             a doctor symptom that does not exist
│   ├── PolicyError                a policy file with an unknown key or value, a file that is no policy
│   ├── ProxyConfigError           a proxy config file with an unknown key, a bad value or an unbuildable entry
│   └── SettingsError              a pytest-plugin setting with an unknown key or a value of the wrong type
├── RequestTooLarge                the never-trimmed parts and the answer exceed the limit that binds (.needed, .limit)
├── RequestRejected                refused before it is fitted: over an input limit, not JSON (.status, .code, .param)
├── InvalidConversation            a conversation id the proxy cannot use (empty, too long, not text)
├── InvariantViolation             a fit broke one of its guarantees (a bug in a strategy): refused, not returned
├── UnknownCall                    a transcript call number that was never recorded
├── AdmissionTimeout               a call waited admission_timeout for KV room in the ledger
├── ExceedsCapacity                one call needs more KV tokens than the whole capacity
├── MessageError                   .index: the offending message's position (None: the list itself)
│   ├── InvalidMessage             unknown role, bad content type, missing id, malformed tool call
│   ├── OrphanToolResult           a tool result whose call id no earlier assistant message made
│   └── MissingToolResult          an assistant's tool calls without results before the next turn
├── CountingError
│   ├── ChatTemplateError          no template, or the template raised (its own message is kept)
│   │   └── TemplateLimitExceeded  the template ran past a sandbox bound (time, loop steps, output, nesting)
│   └── UnsupportedContent         a content part we cannot count and no per-part cost was set
└── ProviderError                  a model call failed (mapped from the backend's own error in calls/errors.py)
    ├── ContextLengthExceeded      the server kept refusing the prompt as too long after every recovery
    ├── OutOfMemory                the local model ran out of memory after every recovery
    └── TransportError             timeouts, connection drops, 429/5xx or malformed replies after every retry
        ├── StreamInterrupted      a stream that broke after it had yielded chunks (.partial: the text so far)
        ├── LedgerUnavailable      the shared KV ledger's Redis cannot be reached
        ├── SharedUnavailable      the shared learned state's Redis cannot be reached
        └── TranscriptUnavailable  the transcript's Postgres cannot be reached
```

Warnings say something went other than planned while the call went on:

```
ContextKeeperWarning               a UserWarning
├── DriftWarning                   the server counted the prompt differently from the keeper (once per server)
└── DetectionWarning               server="auto" could not tell the server: counts follow vLLM's rules
```

Every error may carry ``fix``: the setting or change that resolves it (the CLI prints it as its own field).
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "AdmissionTimeout",
    "ChatTemplateError",
    "ConfigurationError",
    "ContextKeeperError",
    "ContextKeeperWarning",
    "ContextLengthExceeded",
    "CountingError",
    "DetectionWarning",
    "DriftWarning",
    "ExceedsCapacity",
    "InvalidConversation",
    "InvalidMessage",
    "InvariantViolation",
    "LedgerUnavailable",
    "MessageError",
    "MissingToolResult",
    "ModelConfigError",
    "OrphanToolResult",
    "OutOfMemory",
    "PolicyError",
    "ProviderError",
    "ProxyConfigError",
    "RequestRejected",
    "RequestTooLarge",
    "SettingsError",
    "SharedUnavailable",
    "StreamInterrupted",
    "TemplateLimitExceeded",
    "TokenizerNotFound",
    "TranscriptUnavailable",
    "TransportError",
    "UnknownCall",
    "UnknownGPU",
    "UnknownModel",
    "UnknownSymptom",
    "UnsupportedContent",
]


class ContextKeeperError(Exception):
    """Base of every error contextkeeper raises. ``fix``: what resolves it, when one setting or change does
    (also the text after "Fix:" in the message, where the message has one)."""

    fix: str | None = None

    def fix_text(self) -> str | None:
        """``fix``, or else the part of the message after its last "Fix:" (None when there is neither)."""
        if self.fix:
            return self.fix
        text = str(self)
        marker = text.rfind("Fix:")
        return text[marker + 4 :].strip() or None if marker >= 0 else None


class ConfigurationError(ContextKeeperError):
    """A setting is missing, contradictory or names something that does not exist."""


class TokenizerNotFound(ConfigurationError):
    """The tokenizer spec (folder, .gguf file, hub id or ``mistral:<name>``) could not be loaded."""


class ModelConfigError(ConfigurationError, ValueError):
    """A model config we cannot use: malformed JSON, a missing or non-positive size, an unknown layer kind."""


class _WithMatches(ConfigurationError, LookupError):
    """A name that matched nothing; ``matches`` holds the closest known names (possibly empty)."""

    def __init__(self, message: str, *, matches: tuple[str, ...] = (), fix: str | None = None) -> None:
        self.matches = tuple(matches)
        if self.matches:
            message = f"{message.rstrip('.')}. Did you mean: {', '.join(self.matches)}?"
        if fix:
            message = f"{message if message.endswith(('.', '?')) else message + '.'} Fix: {fix}"
        self.fix = fix
        super().__init__(message)


class UnknownModel(_WithMatches):
    """A model name that is no config file or folder, no reachable or cached hub id and no catalog entry."""


class UnknownGPU(_WithMatches):
    """A GPU name that is not in the catalog."""


class UnknownSymptom(_WithMatches):
    """A symptom name the decision tree does not know; the message lists the valid ones."""


class PolicyError(ConfigurationError):
    """A policy that cannot be used: a file that is missing, a folder, not text or not TOML; an unknown key,
    strategy or trigger; a setting of the wrong type or out of range."""


class ProxyConfigError(ConfigurationError):
    """A proxy config file (or the flags standing for one) with an unknown key, a bad value, or an entry whose
    keeper cannot be built; the message names the file, the entry and the key."""


class SettingsError(ConfigurationError, ValueError):
    """A setting that cannot be used: an unknown key or a value of the wrong type."""


class RequestTooLarge(ContextKeeperError, ValueError):
    """The parts that are never trimmed (system prompt, tools, the new request) plus the answer do not fit.

    ``needed`` is what they take with the answer, ``limit`` the limit that binds (the keeper's, less what a
    wrapped call withheld for the server), ``withheld`` those tokens, ``fix`` what to change."""

    def __init__(self, message: str, *, needed: int, limit: int, withheld: int = 0, fix: str | None = None) -> None:
        self.needed = needed
        self.limit = limit
        self.withheld = withheld
        self.fix = fix
        super().__init__(message)


class RequestRejected(ContextKeeperError, ValueError):
    """A request refused before it is fitted: larger than an input limit (body bytes, messages, characters of a
    message, tool schemas), not JSON, nested too deep, text that is no Unicode, a field of the wrong type.

    ``status`` is the HTTP status a server answers with (400, 413, 415, ...), ``code`` the machine-readable reason
    (``body_too_large``, ``invalid_json``, ...) and ``param`` the field it concerns, when one does."""

    def __init__(
        self, message: str, *, status: int = 400, code: str, param: str | None = None, fix: str | None = None
    ) -> None:
        self.status = status
        self.code = code
        self.param = param
        self.fix = fix
        super().__init__(message if fix is None or "Fix:" in message else f"{message.rstrip('.')}. Fix: {fix}")


class InvalidConversation(ContextKeeperError, ValueError):
    """A conversation id that cannot be used (empty after trimming, too long, not text)."""


class InvariantViolation(ContextKeeperError, AssertionError):
    """A fit broke one of its guarantees (a bug in a strategy): the fit is refused rather than returned."""


class UnknownCall(ContextKeeperError, LookupError):
    """A call number that the transcript does not hold."""


# Where a ledger's capacity came from, and what raises it (the wording of the two admission errors).
_MORE_ROOM = {
    "planned": "store the KV cache in a smaller dtype (kv_dtype='fp8' or 'q8_0') so the GPU holds more tokens, or "
    "use a bigger GPU",
    "kv_capacity": "raise kv_capacity if the server's KV cache holds more (vLLM logs 'GPU KV cache size: N tokens')",
}
_HOLDER = {"planned": "the GPU holds (planned from the model and GPU)", "kv_capacity": "set by kv_capacity"}


def _more_room(source: str | None) -> str:
    return _MORE_ROOM.get(
        source or "",
        "give the ledger more capacity_tokens: store the KV cache in a smaller dtype (kv_dtype='fp8' or 'q8_0') or "
        "use a bigger GPU",
    )


class AdmissionTimeout(ContextKeeperError, TimeoutError):
    """A call waited ``timeout`` seconds for room in the KV ledger and got none."""

    def __init__(
        self,
        *,
        requested: int,
        active: int,
        capacity: int,
        waited: float,
        in_flight: int,
        label: str | None,
        source: str | None = None,
        mode: Literal["wait", "shrink"] = "wait",
    ) -> None:
        self.requested = requested
        self.active = active
        self.capacity = capacity
        self.waited = waited
        self.in_flight = in_flight
        what = f" for {label}" if label else ""
        shrink = ", use admission='shrink' (the call is fitted into what is free)" if mode == "wait" else ""
        self.fix = (
            f"lower concurrency= (fewer calls in flight), raise admission_timeout=, read streams to the end or close "
            f"them (an open stream holds its tokens){shrink}, or {_more_room(source)}"
        )
        super().__init__(
            f"waited {waited:.1f} s to admit {requested:,} KV tokens{what}, but {active:,} of the capacity of "
            f"{capacity:,} stayed in use by {in_flight} call(s) in flight (free: {capacity - active:,}, short by "
            f"{requested - (capacity - active):,}). Fix: {self.fix}"
        )


class ExceedsCapacity(ContextKeeperError, ValueError):
    """A call needs more KV tokens on its own than the whole capacity: no amount of waiting admits it."""

    def __init__(
        self,
        *,
        requested: int,
        capacity: int,
        label: str | None,
        what: str = "requested",
        source: str | None = None,
        shrinkable: bool = False,
    ) -> None:
        self.requested = requested
        self.capacity = capacity
        name = f" ({label})" if label else ""
        holder = _HOLDER.get(source or "", "of the ledger")
        # Shrinking helps only a call whose never-trimmed part fits: then it is fitted into the capacity.
        shrink = ", use admission='shrink' so it is fitted into the capacity" if shrinkable else ""
        self.fix = f"lower max_tokens or context_window so one call fits{shrink}, or {_more_room(source)}"
        super().__init__(
            f"a call{name} {what} {requested:,} KV tokens, {requested - capacity:,} more than the capacity of "
            f"{capacity:,} {holder} for all calls together. Fix: {self.fix}"
        )


class MessageError(ContextKeeperError, ValueError):
    """A message list that is not a valid chat. ``index`` is the offending message's position."""

    def __init__(self, message: str, *, index: int | None = None, fix: str | None = None) -> None:
        self.index = index
        self.fix = fix
        where = f"message {index}: " if index is not None else ""
        text = f"{where}{message}"
        if fix:
            text = f"{text.rstrip('.')}. Fix: {fix}"
        super().__init__(text)


class InvalidMessage(MessageError):
    """A single message is malformed (role, content, tool call shape, ids)."""


class OrphanToolResult(MessageError):
    """A tool result refers to a call that no earlier assistant message made."""


class MissingToolResult(MessageError):
    """An assistant's tool calls lack results before the conversation moves on."""


class CountingError(ContextKeeperError):
    """Tokens could not be counted."""


class ChatTemplateError(CountingError):
    """The tokenizer has no chat template, or the template raised while rendering.

    ``template_message`` is the template's own error text, unchanged.
    """

    def __init__(self, message: str, *, template_message: str | None = None) -> None:
        self.template_message = template_message
        super().__init__(message)


class TemplateLimitExceeded(ChatTemplateError):
    """A chat template ran past one of the sandbox's bounds. ``bound`` names it ("time", "steps", "output",
    "nesting", "size"), ``limit`` is its value and ``setting`` the keyword that raises it."""

    def __init__(
        self, message: str, *, bound: str, limit: float, setting: str, template_message: str | None = None
    ) -> None:
        self.bound = bound
        self.limit = limit
        self.setting = setting
        self.fix = f"raise {setting} (now {limit:,}) if this template is trusted, or use another template"
        super().__init__(message, template_message=template_message)


class UnsupportedContent(CountingError):
    """A content part whose token cost is unknown for this model and was not configured."""


class ProviderError(ContextKeeperError):
    """A model call failed. ``report`` is the last fit's report (None when no fit was made), ``attempts`` the
    number of calls made, ``cause`` the backend's own exception (also chained as ``__cause__``)."""

    def __init__(
        self, message: str, *, report: Any = None, attempts: int = 1, cause: BaseException | None = None
    ) -> None:
        self.report = report
        self.attempts = attempts
        self.cause = cause
        super().__init__(message)


class ContextLengthExceeded(ProviderError, ValueError):
    """The server refused the prompt as longer than its context, and every shrink-and-retry was refused too.

    ``limit`` and ``prompt_tokens`` are the numbers the server reported last (None where it gave none)."""

    def __init__(
        self,
        message: str,
        *,
        limit: int | None = None,
        prompt_tokens: int | None = None,
        report: Any = None,
        attempts: int = 1,
        cause: BaseException | None = None,
    ) -> None:
        self.limit = limit
        self.prompt_tokens = prompt_tokens
        super().__init__(message, report=report, attempts=attempts, cause=cause)


class OutOfMemory(ProviderError, MemoryError):
    """The local model ran out of (GPU) memory on the fitted prompt, and smaller prompts failed too."""


class TransportError(ProviderError, ConnectionError):
    """The server could not be reached or answered with a timeout, 429, 5xx or a malformed body, after every
    retry."""


class StreamInterrupted(TransportError):
    """A streamed reply broke after some chunks reached the caller, so it was not retried. ``partial`` is the
    assistant's text received so far and ``chunks`` how many chunks were passed on."""

    def __init__(
        self,
        message: str,
        *,
        partial: str = "",
        chunks: int = 0,
        report: Any = None,
        attempts: int = 1,
        cause: BaseException | None = None,
    ) -> None:
        self.partial = partial
        self.chunks = chunks
        super().__init__(message, report=report, attempts=attempts, cause=cause)


class TranscriptUnavailable(TransportError):
    """The transcript's database could not be reached, at open or during a call (a restart, a network cut). The
    message names the database (its URL without the password); the next call connects again."""


class LedgerUnavailable(TransportError):
    """The shared ledger's Redis could not be reached (at start, or during an admission)."""


class SharedUnavailable(TransportError):
    """The shared state's Redis could not be reached (``shared_unavailable="local"`` goes on without it)."""


class ContextKeeperWarning(UserWarning):
    """Base of every warning contextkeeper gives: something to know, not an error (the call went on)."""


class DriftWarning(ContextKeeperWarning):
    """The server counted the prompt differently from the keeper (warned once per server)."""


class DetectionWarning(ContextKeeperWarning):
    """``server="auto"`` could not tell the server, or cannot count its way: the keeper counts as before."""
