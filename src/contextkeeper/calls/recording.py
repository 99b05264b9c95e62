"""A wrapped call's entry in the transcript: its inputs written ahead (nothing leaves before they are durable),
then completed with the prompt, the reply or the error, or as a refusal without its payload."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .._exceptions import (
    ConfigurationError,
    CountingError,
    ExceedsCapacity,
    MessageError,
    RequestRejected,
    RequestTooLarge,
)

if TYPE_CHECKING:
    from ..fit.report import Fit
    from .base import Reply
    from .transcript import Begun, Transcript, TranscriptEntry

__all__ = ["REFUSALS", "CallRecord"]

log = logging.getLogger("contextkeeper")

#: Errors that refuse a request for what it holds (its size, its messages, its settings), raised before it is sent.
REFUSALS = (RequestTooLarge, RequestRejected, MessageError, CountingError, ExceedsCapacity, ConfigurationError)


class CallRecord:
    """One call's transcript entry (no transcript: nothing is kept)."""

    def __init__(self, transcript: Transcript | None, conversation: str, messages: Any, tools: Any) -> None:
        self.transcript = transcript
        self.conversation = conversation
        self.inputs = messages if isinstance(messages, (list, tuple)) else []
        self.tools = tools
        self.begun: Begun | None = None  # the inputs as written ahead
        self.entry: TranscriptEntry | None = None  # their entry, once durable

    def begin(self) -> None:
        """Write the inputs ahead (a store over the network answers while the call fits)."""
        if self.transcript is not None:
            self.begun = self.transcript.begin(self.inputs, conversation=self.conversation, tools=self.tools)

    def durable(self) -> None:
        """Wait until the inputs :meth:`begin` wrote are committed (a failure is the transcript's typed error)."""
        if self.begun is not None and self.entry is None:
            self.entry = self.begun.wait()

    def end(
        self, reply: Reply | None, exc: BaseException | str | None, *, fit: Fit | None, attempts: int, sent: int
    ) -> None:
        """Complete the entry: with the reply or the error, or as a refusal when nothing was sent."""
        transcript = self.transcript
        if transcript is None:
            return
        details: dict[str, Any] = {
            "received": reply.message if reply is not None else None,
            "usage": (
                {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens}
                if reply is not None and reply.prompt_tokens is not None
                else None
            ),
            "error": exc,
            "attempts": attempts,
        }
        try:
            if self.begun is not None:
                if self.begun.error is not None and self.begun.error is exc:
                    return  # the inputs never reached the transcript: that is the error the caller gets
                self.durable()
            if reply is None and sent == 0 and isinstance(exc, REFUSALS):
                # Refused by our own checks before anything left: the refusal is recorded, not its payload (a
                # request too large for the context, say, must not stay in the transcript at every retry).
                transcript.refuse(self.entry, exc, conversation=self.conversation, inputs=self.inputs, tools=self.tools)
            elif self.entry is not None:
                # Not waited for (a store over the network commits it behind; the inputs were durable before the
                # request left): the caller gets its reply without a round trip.
                transcript.end(self.entry, fit, wait=False, **details)
            else:
                transcript.add(self.inputs, fit, conversation=self.conversation, tools=self.tools, **details)
        except Exception:
            # The inputs were written ahead; what failed is the end of the entry. The caller's call stands.
            log.exception("could not complete call %s in the transcript", self.entry.call if self.entry else "?")
