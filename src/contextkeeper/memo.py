"""Cache tuning: every cache that outlives a call shares one byte budget (``CONTEXTKEEPER_CACHE_BYTES``);
:func:`cache_usage` reports each by name and :func:`set_cache_bytes` changes the budget at run time."""

from __future__ import annotations

from ._memo import CacheUsage, cache_bytes, cache_usage, set_cache_bytes

__all__ = ["CacheUsage", "cache_bytes", "cache_usage", "set_cache_bytes"]
