"""The two channels: the main model's fixed view and tool loop, and the router behind ``INTERNAL_ROUTER``.

``mainview`` renders the main channel's fixed tool view, ``agent`` runs the main channel (triage, the tool loop,
the fallback) and ``conversation`` persists its two history streams (``ChatSession``). ``router`` is the router
channel, ranking the long tail with ``relevance``. Built on ``tools`` and ``models``.
"""
