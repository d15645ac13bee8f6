"""The native ``/v1`` API as data, shared by the server, the HTTP store and the Ray shards without importing the
server (no starlette): the request and response bodies (``models``), the one route table (``routes``) and the one
table between errors and HTTP answers (``errors``). Needs pydantic (the ``server`` extra)."""
