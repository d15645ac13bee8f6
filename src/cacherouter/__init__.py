"""cacherouter: cache-preserving dual-path tool routing for serving agents.

The main model sees a fixed, canonically serialised tool view (core packages + ``INTERNAL_ROUTER``); every other
tool is reached through a router channel. Tools are argparse scripts in a package/skill/script repository whose
schemas are read statically and hot-reloaded, and MCP servers (``cacherouter.tools.upstreams``) whose tools join the
long tail. The user's guide is the README's "cacherouter" section; the MCP gateway and its upstreams config are
described in ``docs/cacherouter-mcp.md``.

Names that tvcache also uses mean other things here, so they are spelled apart: ``ChatToolCall`` is a tool call a
chat model asked for, ``ScriptResult`` what a script run produced, ``RegisteredTool`` one entry of the tool
registry, ``ChatSession`` a persisted conversation.
"""

from .channels.agent import Agent, AgentConfig, Answer
from .channels.conversation import ChatSession
from .channels.mainview import MainView
from .channels.relevance import BM25, KeywordHitRatio, evaluate_ranker
from .channels.router import Router, RouterConfig, compress_task, filter_candidates
from .errors import (
    ArgumentError,
    CacheRouterError,
    ConfigError,
    ModelError,
    RegistryError,
    SchemaError,
    SessionError,
    ToolExecutionError,
)
from .models.accounting import Ledger, RecordingModel, Summary
from .models.base import (
    ChatRequest,
    ChatResponse,
    ChatToolCall,
    ScriptedModel,
    SimulatedProvider,
)
from .models.endpoint import EndpointConfig, OpenAICompatibleModel
from .models.prompt_cache import (
    AnthropicCacheModel,
    DeepSeekCacheModel,
    OpenAICacheModel,
    PrefixCacheModel,
    cache_model,
)
from .models.usage import Usage, parse_usage
from .tools.argparse_ast import Extraction, extract_static
from .tools.executor import ScriptResult, build_argv, run_script
from .tools.gateway import Gateway, GatewayConfig, ReloadOutcome
from .tools.registry import Limits, Problem, RegisteredTool, Registry, build_registry, script_schema
from .tools.schema import ArgumentSpec, ScriptSchema
from .tools.skills import SkillParam, build_skill
from .tools.upstreams import UpstreamConfig, load_upstreams, namespaced_name, parse_upstreams

__all__ = [
    "BM25",
    "Agent",
    "AgentConfig",
    "Answer",
    "AnthropicCacheModel",
    "ArgumentError",
    "ArgumentSpec",
    "CacheRouterError",
    "ChatRequest",
    "ChatResponse",
    "ChatSession",
    "ChatToolCall",
    "ConfigError",
    "DeepSeekCacheModel",
    "EndpointConfig",
    "Extraction",
    "Gateway",
    "GatewayConfig",
    "KeywordHitRatio",
    "Ledger",
    "Limits",
    "MainView",
    "ModelError",
    "OpenAICacheModel",
    "OpenAICompatibleModel",
    "PrefixCacheModel",
    "Problem",
    "RecordingModel",
    "RegisteredTool",
    "Registry",
    "RegistryError",
    "ReloadOutcome",
    "Router",
    "RouterConfig",
    "SchemaError",
    "ScriptResult",
    "ScriptSchema",
    "ScriptedModel",
    "SessionError",
    "SimulatedProvider",
    "SkillParam",
    "Summary",
    "ToolExecutionError",
    "UpstreamConfig",
    "Usage",
    "build_argv",
    "build_registry",
    "build_skill",
    "cache_model",
    "compress_task",
    "evaluate_ranker",
    "extract_static",
    "filter_candidates",
    "load_upstreams",
    "namespaced_name",
    "parse_upstreams",
    "parse_usage",
    "run_script",
    "script_schema",
]
