"""Chat models and what their requests cost.

``base`` is the one request/response shape, the ``ChatModel`` protocol and the scripted stand-ins; ``endpoint``
the OpenAI-compatible HTTP client. ``prompt_cache`` is an offline model of providers' prompt caches (over
``tokens``), ``usage`` reads each provider's usage fields, ``accounting`` turns both into per-request figures.
Nothing here knows about tools, channels or front ends.
"""
