"""``cacherouter serve-mcp``: the two MCP servers (both need the ``mcp`` extra).

``registry_server`` lists the gateway's whole registry and announces every change (``--repo``);
``routing_server`` lists a frozen core and ``INTERNAL_ROUTER`` and routes everything else (``--upstreams``).
``serving`` is what both share: a tool's error result and ending on a signal with no tool left running.
"""
