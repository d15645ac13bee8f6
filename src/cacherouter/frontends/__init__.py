"""Front ends over the agent: ``cacherouter chat`` in a terminal (``chat``, which also holds the setup both share)
and ``cacherouter web`` in a browser (``web``, serving ``web_static/``)."""
