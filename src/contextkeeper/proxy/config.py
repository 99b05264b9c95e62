"""The proxy's settings: a TOML file of ``[[models]]`` entries (or one entry from command-line flags), validated
like policy files.

```toml
upstream = "http://127.0.0.1:8000/v1"     # the server's OpenAI base URL (--upstream wins)
api_key = "..."                           # the proxy's own key: clients must send "Authorization: Bearer ..."
upstream_api_key = "..."                  # then the upstream gets this one instead of the client's
attempts = 4                              # calls per request, the first included (as keeper.wrap(attempts=))
backoff = 0.5                             # seconds before the first transport retry; doubles each time
admin_key = "..."                         # reads every tenant's debug views and the metrics
forward = ["GET /slots"]                  # upstream paths passed on besides the OpenAI-compatible ones

[api_keys]                                # named proxy keys: each name is a tenant (instead of api_key)
team-a = "..."

[limits]                                  # what one request may hold (docs/proxy.md, "Security")
body_bytes = 16777216

[connections]                             # how long and how much the HTTP server waits for one client
header_timeout = 10.0

[[models]]
match = "qwen*"                           # the request's "model": a name or glob, or a list of them
tokenizer = "Qwen/Qwen2.5-7B-Instruct"    # as ContextKeeper(tokenizer=...)
context_window = 32768
policy = "default"
server = "vllm"                           # the dialect whose preprocessing counts follow
model = "Qwen/Qwen2.5-7B-Instruct"        # with gpu: the memory plan (limit per sequence, KV capacity)
gpu = "H100"
concurrency = 8
```

Every key is checked when the file is read: an unknown key, a value of the wrong type or out of range is a
:class:`ProxyConfigError` naming the file, the entry (``models[1] (match 'qwen*')``), the key and what is allowed,
with every problem of the file at once. Relative paths (tokenizer folders, chat templates, policy files, SQLite
transcripts) are read from the config file's folder. A keeper is built per entry when the proxy starts, so a
tokenizer that cannot be loaded fails then, not at the first request.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .._exceptions import ConfigurationError, ContextKeeperError, ProxyConfigError
from ..strategies.settings import Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from ..keeper import ContextKeeper
    from ._protocol import ServerLimits
    from .access import Access
    from .limits import InputLimits

__all__ = ["ModelEntry", "ProxyConfig", "ProxyConfigError", "Route", "build_routes", "default_config", "load_config"]

_SERVERS = "vllm, sglang, llama.cpp, lmstudio, ollama, transformers, openai or auto"


class ModelEntry(Settings):
    """One ``[[models]]`` entry: which requests it takes (``match``) and the keeper that fits them."""

    subject: ClassVar[str] = "proxy model entry"
    error_type: ClassVar[type[ConfigurationError]] = ProxyConfigError

    match: str | tuple[str, ...] = Field(json_schema_extra={"allowed": "a model name or glob, or a list of them"})
    tokenizer: str = Field(
        min_length=1, json_schema_extra={"allowed": "a tokenizer folder, .gguf file, hub id or mistral:<name>"}
    )
    context_window: int | None = Field(default=None, gt=0)
    chat_template: str | None = Field(default=None, json_schema_extra={"allowed": "a Jinja file (path)"})
    policy: str = Field(default="default", min_length=1)
    server: str | None = Field(default=None, json_schema_extra={"allowed": f"one of {_SERVERS}"})
    model: str | None = Field(
        default=None, json_schema_extra={"allowed": "a config.json file or folder, hub id or catalog name"}
    )
    gpu: str | None = None
    concurrency: int = Field(default=1, ge=1)
    runtime: Literal["transformers", "vllm", "sglang", "llama.cpp"] = "vllm"
    kv_dtype: str = "auto"
    kv_capacity: int | None = Field(default=None, gt=0)
    admission: Literal["wait", "shrink"] = "wait"
    admission_timeout: float = Field(default=30.0, gt=0)
    conversations: int = Field(default=1024, ge=1)
    ledger: str | None = Field(default=None, json_schema_extra={"allowed": "a Redis URL (redis://...)"})
    ledger_pool: str = Field(default="default", min_length=1)
    ledger_unavailable: Literal["fail", "local"] = "fail"
    shared: str | bool | None = Field(
        default=None, json_schema_extra={"allowed": "a Redis URL, or false (learn per process)"}
    )
    shared_unavailable: Literal["fail", "local"] = "fail"
    transcript: str | None = Field(
        default=None, json_schema_extra={"allowed": "a SQLite file path or a postgresql:// URL"}
    )

    @field_validator("match")
    @classmethod
    def _globs(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        globs = (value,) if isinstance(value, str) else value
        if not globs or not all(glob.strip() for glob in globs):
            raise ValueError("an empty name; a model name or glob such as 'qwen*' (or '*' for every model) is needed")
        return value

    @field_validator("server")
    @classmethod
    def _server(cls, value: str | None) -> str | None:
        from ..servers.dialects import DIALECTS

        if value is not None and value not in DIALECTS and value != "auto":
            raise ValueError("an unknown dialect")
        return value

    @field_validator("shared")
    @classmethod
    def _shared(cls, value: str | bool | None) -> str | bool | None:
        if value is True:
            raise ValueError("true is not a place: give the Redis URL, or false to learn per process")
        return value

    @property
    def globs(self) -> tuple[str, ...]:
        return (self.match,) if isinstance(self.match, str) else self.match

    def matches(self, model: str) -> bool:
        """Whether this entry takes requests for ``model`` (globs compared without case)."""
        name = model.lower()
        return any(fnmatch.fnmatchcase(name, glob.lower()) for glob in self.globs)

    def label(self, index: int) -> str:
        return f"models[{index}] (match {', '.join(map(repr, self.globs))})"


class ProxyConfig(Settings):
    """The whole proxy: where to forward, keys, retry bounds and the model entries, first match wins."""

    subject: ClassVar[str] = "proxy config"
    error_type: ClassVar[type[ConfigurationError]] = ProxyConfigError

    upstream: str | None = Field(default=None, json_schema_extra={"allowed": "an http(s):// URL"})
    api_key: str | None = Field(default=None, min_length=1)
    upstream_api_key: str | None = Field(default=None, min_length=1)
    attempts: int = Field(default=4, ge=1)
    backoff: float = Field(default=0.5, ge=0)
    max_backoff: float = Field(default=8.0, ge=0)
    timeout: float = Field(default=600.0, gt=0)
    debug_conversations: int = Field(default=1024, ge=1)
    api_keys: dict[str, str] | None = Field(
        default=None, json_schema_extra={"allowed": "a table of tenant name = key (names without '/')"}
    )
    admin_key: str | None = Field(default=None, min_length=1)
    tenant_header: str | None = Field(default=None, min_length=1)
    allowed_hosts: tuple[str, ...] | None = Field(
        default=None, json_schema_extra={"allowed": "host names or globs this proxy is called by ('*': any)"}
    )
    cors_origins: tuple[str, ...] = Field(
        default=(), json_schema_extra={"allowed": "web origins (https://app.example) allowed to call the proxy"}
    )
    metrics: Literal["loopback", "admin", "any", "off"] = "loopback"
    debug: Literal["tenant", "admin", "off"] = "tenant"
    forward: tuple[str, ...] = Field(
        default=(), json_schema_extra={"allowed": "'METHOD /path' globs (or '/path', '*') forwarded upstream"}
    )
    allow_unauthenticated: bool = False
    limits: dict[str, int] | None = Field(
        default=None, json_schema_extra={"allowed": "a [limits] table: body_bytes, messages, message_chars, ..."}
    )
    connections: dict[str, float] | None = Field(
        default=None,
        json_schema_extra={"allowed": "a [connections] table: header_timeout, body_timeout, max_connections, ..."},
    )
    models: tuple[ModelEntry, ...] = Field(min_length=1, json_schema_extra={"allowed": "a list of [[models]] tables"})
    # Where the settings came from (a file, or "flags"), and the folder relative paths are read from.
    _source: str = PrivateAttr(default="flags")
    _folder: str = PrivateAttr(default=".")

    @property
    def source(self) -> str:
        return self._source

    @property
    def folder(self) -> str:
        return self._folder

    @field_validator("upstream")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("not an http:// or https:// URL")
        return value

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        from .access import tenant_name

        for name, key in (value or {}).items():
            tenant_name(name, f"the tenant name {name[:40]!r}")
            if not key:
                raise ValueError(f"the key of {name!r} is empty")
        if value is not None and len(set(value.values())) != len(value):
            raise ValueError("two tenants share one key")
        return value

    @field_validator("limits")
    @classmethod
    def _limits(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        from .limits import InputLimits

        if value is not None:
            _known(value, InputLimits.__dataclass_fields__, "limit")
            InputLimits(**value)  # a value out of range is a ValueError here
        return value

    @field_validator("connections")
    @classmethod
    def _connections(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        from ._protocol import ServerLimits

        if value is not None:
            _known(value, ServerLimits.__dataclass_fields__, "setting")
            try:
                _server_limits(value)
            except ConfigurationError as exc:
                raise ValueError(str(exc).partition(". Fix:")[0]) from None
        return value

    @model_validator(mode="after")
    def _one_kind_of_key(self) -> ProxyConfig:
        if self.api_key is not None and self.api_keys:
            raise ValueError("api_key and [api_keys] are both set: give one key, or named keys per tenant")
        return self

    def access(self, host: str = "127.0.0.1") -> Access:
        """Who may call the proxy (see :class:`~.access.Access`), for a proxy listening on ``host``: without
        ``allowed_hosts``, the loopback names when it listens on loopback, any name otherwise."""
        from .access import Access, loopback_host

        keys = dict(self.api_keys or {})
        if self.api_key is not None:
            keys["default"] = self.api_key
        hosts = self.allowed_hosts
        if hosts is None:
            hosts = ("localhost", "127.0.0.1", "::1") if loopback_host(host) else ("*",)
        return Access(
            keys=keys,
            admin_key=self.admin_key,
            tenant_header=self.tenant_header.lower() if self.tenant_header else None,
            allowed_hosts=hosts,
            cors_origins=self.cors_origins,
            metrics=self.metrics,
            debug=self.debug,
        )

    def input_limits(self) -> InputLimits:
        from .limits import InputLimits

        return InputLimits(**(self.limits or {}))

    def server_limits(self) -> ServerLimits:
        return _server_limits(self.connections or {})

    def __repr__(self) -> str:  # never show keys
        from ..calls.redis_client import safe_url

        hidden = {"api_key", "upstream_api_key", "admin_key"}  # never shown, in logs or errors
        shown: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in hidden and value:
                value = "***"
            elif name == "api_keys" and value:
                value = dict.fromkeys(value, "***")
            elif name == "upstream" and value:
                value = safe_url(value)
            shown[name] = value
        return f"ProxyConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    __str__ = __repr__


def _known(given: Mapping[str, Any], names: Mapping[str, Any], what: str) -> None:
    """A ValueError naming the keys of a table (``[limits]``, ``[connections]``) that are not among ``names``."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; the {what}s are {', '.join(names)}")


def _server_limits(values: Mapping[str, float]) -> ServerLimits:
    """:class:`ServerLimits` from a ``[connections]`` table (TOML numbers; the whole-number settings must be whole)."""
    from ._protocol import ServerLimits

    kinds = {field.name: field.type for field in ServerLimits.__dataclass_fields__.values()}
    given: dict[str, Any] = {}
    for key, value in values.items():
        whole = kinds.get(key) in (int, "int")
        given[key] = int(value) if whole and float(value).is_integer() else value
    return ServerLimits(**given)


# ------------------------------------------------------------------------------------------------ files


def _read(file: Path) -> dict[str, Any]:
    what = f"proxy config file {file}"
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise ProxyConfigError(f"{what} does not exist. Fix: check the path given to --config") from None
    except IsADirectoryError:
        raise ProxyConfigError(f"{what} is a folder. Fix: pass --config a .toml file") from None
    except OSError as exc:
        raise ProxyConfigError(f"cannot read {what}: {exc.strerror or exc}. Fix: check the path") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProxyConfigError(
            f"{file}: not a text file (byte {exc.start} is not UTF-8). Fix: a proxy config is UTF-8 TOML"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ProxyConfigError(f"{file}: not valid TOML: {exc}. Fix: correct the TOML syntax at that line") from None


def load_config(path: str | Path, **overrides: Any) -> ProxyConfig:
    """Read and validate a proxy config file; ``overrides`` (from flags: ``upstream``, ``api_key``...) replace
    the file's values where not None. Every problem of the file is reported at once."""
    file = Path(path)
    data = _read(file)
    raw_models = data.get("models")
    problems: list[str] = []
    fixes: list[str] = []

    def problem(exc: ConfigurationError) -> None:
        text, _, fix = str(exc).removeprefix(f"{file}: ").partition(". Fix: ")
        problems.append(text)
        if fix:
            fixes.append(fix)

    entries: list[ModelEntry] = []
    if raw_models is None:
        problems.append("no [[models]] entry")
        fixes.append('add at least one [[models]] table with match = "*" and tokenizer = "..."')
    elif not isinstance(raw_models, list):
        problems.append(f"models = {raw_models!r:.60}: expected a list of [[models]] tables")
        fixes.append('write each entry as its own [[models]] block (double brackets) with match = "..."')
    else:
        for index, raw in enumerate(raw_models):
            where = f"models[{index}]"
            if not isinstance(raw, Mapping):
                problems.append(f"{where} = {raw!r:.60}: expected a table")
                fixes.append("write the entry as a [[models]] block")
                continue
            match = raw.get("match")
            if isinstance(match, str):
                where += f" (match {match!r})"
            try:
                entries.append(ModelEntry.checked(raw, where=where))
            except ConfigurationError as exc:
                problem(exc)
    fields = {key: value for key, value in data.items() if key != "models"}
    fields.update({key: value for key, value in overrides.items() if value is not None})
    try:
        config = ProxyConfig.checked({**fields, "models": tuple(entries) or (_PLACEHOLDER,)}, where="top level")
        config._source, config._folder = str(file), str(file.parent)
    except ConfigurationError as exc:
        problem(exc)
    if problems:
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        fix = "; ".join(dict.fromkeys(fixes)) or "correct the file"
        raise ProxyConfigError(f"{file}: {count}{' | '.join(problems)}. Fix: {fix}")
    return config


_PLACEHOLDER = ModelEntry(match="*", tokenizer="-")  # stands in while the entries themselves had problems


def default_config(
    *,
    tokenizer: str | None,
    context_window: int | None,
    chat_template: str | None = None,
    policy: str | None = None,
    server: str | None = None,
    kv_capacity: int | None = None,
    **top: Any,
) -> ProxyConfig:
    """One catch-all entry from command-line flags (``serve --tokenizer T --context-window N``)."""
    if tokenizer is None or context_window is None:
        missing = " and ".join(
            flag for flag, value in (("--tokenizer", tokenizer), ("--context-window", context_window)) if value is None
        )
        raise ProxyConfigError(
            f"serve needs a model entry: {missing} missing. Fix: pass --config proxy.toml, or --tokenizer T and "
            "--context-window N for one entry that takes every model"
        )
    entry: dict[str, Any] = {"match": "*", "tokenizer": tokenizer, "context_window": context_window}
    for key, value in (("chat_template", chat_template), ("policy", policy), ("server", server)):
        if value is not None:
            entry[key] = value
    if kv_capacity is not None:
        entry["kv_capacity"] = kv_capacity
    model = ModelEntry.checked(entry, where="flags")
    fields = {key: value for key, value in top.items() if value is not None}
    return ProxyConfig.checked({**fields, "models": (model,)}, where="flags")


# ------------------------------------------------------------------------------------------------ keepers


@dataclass(frozen=True)
class Route:
    """A model entry with its keeper, built once."""

    name: str  # "models[0] (match 'qwen*')"
    entry: ModelEntry
    keeper: ContextKeeper

    def matches(self, model: str) -> bool:
        return self.entry.matches(model)


def _local(folder: Path, value: str) -> str:
    """``value`` as a path under ``folder`` when that exists there; else as given (a hub id, a name, a URL)."""
    if "://" in value or value.startswith("mistral:"):
        return value
    candidate = Path(value).expanduser()
    if not candidate.is_absolute() and (folder / candidate).exists():
        return str(folder / candidate)
    return str(candidate) if candidate.exists() else value


def build_routes(config: ProxyConfig) -> list[Route]:
    """A keeper per entry, in order. One that cannot be built is a ProxyConfigError naming the entry."""
    from ..keeper import ContextKeeper

    folder = Path(config.folder)
    routes = []
    for index, entry in enumerate(config.models):
        where = f"{config.source}: {entry.label(index)}"
        try:
            template = None
            if entry.chat_template is not None:
                file = Path(_local(folder, entry.chat_template))
                try:
                    template = file.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    raise ConfigurationError(
                        f"chat_template = {entry.chat_template!r}: cannot read {file} "
                        f"({getattr(exc, 'strerror', None) or exc}). Fix: give chat_template a UTF-8 Jinja file"
                    ) from None
            transcript = entry.transcript
            if transcript is not None and "://" not in transcript and not Path(transcript).is_absolute():
                transcript = str(folder / transcript)
            keeper = ContextKeeper(
                _local(folder, entry.tokenizer),
                context_window=entry.context_window,
                chat_template=template,
                policy=_local(folder, entry.policy) if entry.policy.endswith(".toml") else entry.policy,
                model=_local(folder, entry.model) if entry.model is not None else None,
                gpu=entry.gpu,
                concurrency=entry.concurrency,
                runtime=entry.runtime,
                kv_dtype=entry.kv_dtype,
                conversations=entry.conversations,
                transcript=transcript,
                admission=entry.admission,
                admission_timeout=entry.admission_timeout,
                kv_capacity=entry.kv_capacity,
                server=entry.server,
                ledger=entry.ledger,
                ledger_pool=entry.ledger_pool,
                ledger_unavailable=entry.ledger_unavailable,
                shared=entry.shared,
                shared_unavailable=entry.shared_unavailable,
            )
        except ContextKeeperError as exc:
            text = " ".join(str(exc).split())
            error = ProxyConfigError(f"{where}: {text}")
            error.fix = exc.fix_text()
            raise error from exc
        routes.append(Route(name=entry.label(index), entry=entry, keeper=keeper))
    return routes
