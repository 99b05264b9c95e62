"""Where the proxy reports what each chat request did: one :class:`Exchange` per request, handed to every
observer once the request is over (a stream: when it ended, broke or was closed).

This is the one place a fit and a call are observed: the debug endpoint's store is an observer, and so are
metrics and traces (they register with :meth:`Proxy.observe`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..calls.loop import CallReport
    from ..fit.report import Fit

__all__ = ["DebugStore", "Exchange", "Observer"]

#: Called with every finished exchange; must not raise (an observer's error is logged, not the client's).
Observer = Callable[["Exchange"], None]


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """One chat request through the proxy: what was asked, what the keeper did, what came back."""

    conversation: str | None  # None: the request failed before its conversation was known
    conversation_source: str | None  # header, user, prompt_cache_key, derived
    tenant: str | None = None  # whose conversation (None: refused before the caller was known)
    model: str | None  # the request's "model"
    route: str | None  # the config entry that took it ("models[0] (match '*')")
    stream: bool
    status: int  # the HTTP status answered (a stream that broke after its headers: 200)
    fit: Fit | None  # the fit sent last (None: no fit was made)
    call: CallReport | None  # attempts, recoveries, admission, the upstream's counts (None: no call was made)
    error: str | None  # why it failed ("request_too_large: ..."), None when it succeeded
    seconds: float  # from the request's arrival to its end (a stream: its last chunk)
    chunks: int = 0  # stream chunks passed to the client
    fit_seconds: tuple[float, ...] = ()  # every fit of the request (a refusal's refit too), in order
    upstream_seconds: float | None = None  # time spent upstream, attempts together (a stream: to its end)
    sent: int = 0  # requests sent upstream (retries included; attempts refused by our own checks are not)

    def to_dict(self) -> dict[str, Any]:
        """The exchange as JSON-ready data (the debug endpoint's answer)."""
        fit = self.fit
        return {
            "conversation": self.conversation,
            "conversation_source": self.conversation_source,
            "tenant": self.tenant,
            "model": self.model,
            "route": self.route,
            "stream": self.stream,
            "status": self.status,
            "error": self.error,
            "seconds": round(self.seconds, 6),
            "chunks": self.chunks,
            "fit_seconds": [round(seconds, 6) for seconds in self.fit_seconds],
            "upstream_seconds": None if self.upstream_seconds is None else round(self.upstream_seconds, 6),
            "sent": self.sent,
            "prompt_tokens": fit.tokens if fit is not None else None,
            "messages_sent": len(fit.messages) if fit is not None else None,
            "report": fit.report.to_dict() if fit is not None else None,
            "call": self.call.to_dict() if self.call is not None else None,
        }


class DebugStore:
    """The latest exchange of each conversation, by ``(tenant, conversation)``, the least recently seen dropped
    beyond ``size``."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._latest: OrderedDict[tuple[str, str], Exchange] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, exchange: Exchange) -> None:
        if exchange.conversation is None:
            return
        key = (exchange.tenant or "", exchange.conversation)
        with self._lock:
            self._latest[key] = exchange
            self._latest.move_to_end(key)
            while len(self._latest) > self.size:
                self._latest.popitem(last=False)

    def get(self, tenant: str, conversation: str) -> Exchange | None:
        with self._lock:
            return self._latest.get((tenant, conversation))

    def conversations(self, tenant: str | None = None) -> list[str] | list[dict[str, str]]:
        """The ids of ``tenant``'s conversations; every tenant's (``{"tenant", "conversation"}``) for None."""
        with self._lock:
            if tenant is None:
                return [{"tenant": owner, "conversation": name} for owner, name in self._latest]
            return [name for owner, name in self._latest if owner == tenant]
