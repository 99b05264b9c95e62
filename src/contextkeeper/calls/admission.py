"""A wrapped call's admission in the KV ledger across its attempts: what it asks for, the ticket it holds, what a
shrinking admission granted, and how it went (for the call's report)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ledger import Ledger, Ticket
    from .loop import Calls

__all__ = ["Admitting"]


class Admitting:
    """One call's admission. ``lease``: seconds a stream's ticket is held without a sign of life (a stream may be
    kept and never read); a plain call (None) gives its tokens back when it returns or raises."""

    def __init__(self, calls: Calls, server: str, lease: float | None) -> None:
        self.calls = calls
        self.server = server
        self.lease = lease
        self.ticket: Ticket | None = None
        self.granted: int | None = None  # what a shrinking admission granted (prompt plus answers)
        self.status = "unlimited"  # "admitted", "waited 0.42 s", "shrunk to N tokens"

    def ask(self, ask: tuple[int, int]) -> tuple[Ledger, dict[str, Any]]:
        """The ledger to ask for ``ask`` (tokens, minimum), and how: through a facts ledger, the server's shared
        facts come back with the admission."""
        label = f"{self.server} call {self.calls.calls + 1}"
        settings: dict[str, Any] = {"minimum": ask[1], "label": label, "lease": self.lease}
        if self.calls.facts_ledger is not None:
            return self.calls.facts_ledger, {**settings, "facts": self.server}
        assert self.calls.ledger is not None
        return self.calls.ledger, settings

    def release(self) -> None:
        """Give the ticket's tokens back (a shared ledger does it behind the call)."""
        if self.ticket is not None:
            self.ticket.release(wait=False)
            self.ticket = None

    def renew(self) -> None:
        """A sign of life (a stream chunk): the admission's lease starts again."""
        ticket = self.ticket
        if ticket is not None:
            ticket.renew()
