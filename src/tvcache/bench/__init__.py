"""Benchmarks, run as ``tvcache bench NAME``. Each prints figures measured side by side in one run and can
write them as JSON (``--json PATH``). They are commands, never test assertions."""
