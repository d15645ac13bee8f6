"""Sandbox backends. Each implements the protocol in ``tvcache.protocol``."""
