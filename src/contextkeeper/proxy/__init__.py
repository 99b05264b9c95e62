"""``contextkeeper serve``: an OpenAI-compatible proxy that fits every chat request before it reaches the server.

Any client in any language gets exact reserve-then-budget fitting, admission against the GPU's KV pool, recovery
from refusals and a transcript by changing its base URL. Needs the ``proxy`` extra (Starlette, uvicorn, httpx2,
openai). See docs/proxy.md.

```python
from contextkeeper.proxy import Proxy, ProxyServer, load_config

with ProxyServer(Proxy.from_config(load_config("proxy.toml", upstream="http://127.0.0.1:8000/v1")), port=0) as s:
    print(s.base_url)
```
"""

from .access import Access
from .app import Proxy
from .config import ModelEntry, ProxyConfig, ProxyConfigError, Route, build_routes, default_config, load_config
from .identity import Identity, identify
from .limits import InputLimits
from .observe import DebugStore, Exchange, Observer
from .server import ProxyServer, ServerLimits

__all__ = [
    "Access",
    "DebugStore",
    "Exchange",
    "Identity",
    "InputLimits",
    "ModelEntry",
    "Observer",
    "Proxy",
    "ProxyConfig",
    "ProxyConfigError",
    "ProxyServer",
    "Route",
    "ServerLimits",
    "build_routes",
    "default_config",
    "identify",
    "load_config",
]
