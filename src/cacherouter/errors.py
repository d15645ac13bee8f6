"""Errors raised by cacherouter.

Every error derives from :class:`CacheRouterError`, so callers can catch one class::

    CacheRouterError
    ├── SchemaError        a script's argparse definition could not be turned into a schema
    ├── RegistryError      the tool repository could not be scanned into a consistent registry
    ├── ArgumentError      arguments for a tool call do not fit the tool's schema
    ├── ToolExecutionError a tool could not be started (a tool that runs and fails is a result, not an error)
    ├── ModelError         a chat model endpoint failed or answered something unusable
    ├── SessionError       a persisted session is missing or unreadable
    └── ConfigError        settings (environment variables, options) are invalid

Each message says what went wrong and, where there is one, what to do about it.
"""

from __future__ import annotations


class CacheRouterError(Exception):
    """Base class of every error raised by cacherouter."""


class SchemaError(CacheRouterError):
    """A script's argparse definition could not be turned into a schema."""


class RegistryError(CacheRouterError):
    """The tool repository could not be scanned into a consistent registry."""


class ArgumentError(CacheRouterError):
    """Arguments given for a tool call do not fit the tool's schema."""


class ToolExecutionError(CacheRouterError):
    """A tool script could not be started at all."""


class ModelError(CacheRouterError):
    """A chat model endpoint failed or returned an unusable answer."""


class SessionError(CacheRouterError):
    """A persisted session is missing or unreadable."""


class ConfigError(CacheRouterError):
    """Settings are missing or invalid."""
