"""JSON over HTTP for the few places the keeper asks a server directly (calibration, server detection).

The standard library's client, a timeout on every request, and the caller's key sent only as a header: a
connection that fails is a TransportError naming what was being asked; an HTTP error status is an answer.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from .._exceptions import ConfigurationError, TransportError


def root_url(target: Any, purpose: str) -> str:
    """The server's root address from a URL or an openai client (its ``base_url`` without ``/v1``)."""
    url = str(getattr(target, "base_url", target) or "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"{purpose} needs an http(s) URL or an openai client, got {target!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_key(target: Any) -> str | None:
    """An openai client's key (None for a URL, or a placeholder the SDK keeps)."""
    key = getattr(target, "api_key", None)
    return key if isinstance(key, str) and key else None


def request_json(
    url: str, body: dict[str, Any] | None, *, timeout: float, purpose: str, key: str | None = None
) -> tuple[int, Any]:
    """``(status, JSON answer)``: POST ``body``, or GET when it is None; an answer that is not JSON reads as {}."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = int(response.status), response.read()
    except urllib.error.HTTPError as error:
        status, raw = int(error.code), error.read()
    except (urllib.error.URLError, OSError) as error:
        raise TransportError(f"{purpose} could not reach {url}: {error}. Fix: check the server's address") from error
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {}
