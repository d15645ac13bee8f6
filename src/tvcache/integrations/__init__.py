"""Adapters that put tvcache under the trainers and tool servers people already run.

One module per framework, each behind its own optional extra and imported lazily:

- ``tvcache.integrations.original`` — the original TVCache release's ``ToolCallEnv`` / ``ToolCall`` classes as a
  sandbox factory, with an executor of the released executors' shape (no extra needed);
- ``tvcache.integrations.mcp_proxy`` — ``tvcache mcp-proxy -- CMD``: a caching MCP server in front of any MCP
  server (``pip install 'tvcache[mcp]'``);
- ``tvcache.integrations.skyrl`` — SkyRL-gym ``BaseTextEnv`` wrapper, text2sql preset (``tvcache[skyrl]``);
- ``tvcache.integrations.tinker`` — a tinker-cookbook ``SandboxFactory`` of caching sandboxes (``tvcache[tinker]``);
- ``tvcache.integrations.verl`` — a veRL ``BaseTool`` wrapper and agent loop (``tvcache[verl]``);
- ``tvcache.integrations.harbor`` — a caching Harbor ``BaseEnvironment`` over any environment type, and one on
  overlay shell sandboxes with no engine (``tvcache[harbor]``, Python >= 3.12);
- ``tvcache.integrations.mini_swe_agent`` — a caching mini-swe-agent ``Environment`` (``tvcache[mini-swe-agent]``);
- ``tvcache.integrations.swerex`` — a SWE-ReX deployment and runtime whose bash sessions go through the cache
  (``tvcache[swe-rex]``);
- ``tvcache.integrations.verifiers`` — a verifiers v0 ``StatefulToolEnv``/``SandboxEnv`` (and mixin) whose rollout
  sandbox is a tvcache session, and a v1 ``Toolset`` cached through the MCP proxy (``tvcache[verifiers-v0]``,
  ``tvcache[verifiers]``);
- ``tvcache.integrations.trl`` — an ``environment_factory`` class for TRL's ``GRPOTrainer`` (``tvcache[trl]``);
- ``tvcache.integrations.openhands`` — an OpenHands SDK workspace on persistent shell sandboxes
  (``tvcache[openhands]``, Python >= 3.12);
- ``tvcache.integrations.nemo_gym`` — a NeMo-Gym resources-server helper keyed by the rollout's session
  (``tvcache[nemo-gym]``).

Each adapter takes one ``cache`` setting (``tvcache.integrations.open_cache``): None or a directory for an embedded
cache, a URL for ``tvcache serve``, a list of URLs for sharded servers.

What the adapters share: ``cache_location`` (that setting and ``open_cache``), ``external_sandboxes`` (sandboxes
over state tvcache cannot snapshot), ``background_loop`` (a loop for synchronous frameworks) and
``optional_imports`` (``require``: imports that name the extra to install).
"""

from .cache_location import CacheLike, CacheLocation, open_cache
from .external_sandboxes import ExternalSandboxFactory

__all__ = ["CacheLike", "CacheLocation", "ExternalSandboxFactory", "open_cache"]
