"""cacherouter: cache-preserving tool routing for serving agents (not built yet; see the issues)."""

__all__: list[str] = []
