"""The native API's bodies, which live in ``tvcache.api.models`` (importable without the server's starlette);
re-exported here, where the server's modules and older code import them from."""

from ..api.models import *  # noqa: F403
from ..api.models import __all__ as __all__
