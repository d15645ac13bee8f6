"""``cacherouter proxy``: a drop-in OpenAI- or Anthropic-compatible API proxy that keeps the provider's prompt cache.

See :mod:`cacherouter.proxy.app` for what it does per request and what is stateless, and
``docs/cacherouter-proxy.md`` for how to run it. The rewrite needs only the standard library; serving it needs the
``proxy`` extra (starlette, uvicorn, httpx).
"""

from .app import APIS, Proxy, ProxyConfig, create_app
from .routing import ROUTED_PREFIX, ToolView, TurnStore, decode_routed_id, encode_routed_id

__all__ = [
    "APIS",
    "ROUTED_PREFIX",
    "Proxy",
    "ProxyConfig",
    "ToolView",
    "TurnStore",
    "create_app",
    "decode_routed_id",
    "encode_routed_id",
]
