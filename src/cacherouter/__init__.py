"""cacherouter: cache-preserving dual-path tool routing for serving agents.

The main model sees a fixed, canonically serialised tool view (core packages + ``INTERNAL_ROUTER``); every other
tool is reached through a router channel. Tools are argparse scripts in a package/skill/script repository whose
schemas are read statically and hot-reloaded, and MCP servers (``cacherouter.upstreams``) whose tools join the
long tail. The user's guide is the README's "cacherouter" section; the MCP gateway and its upstreams config are
described in ``docs/cacherouter-mcp.md``.

Names that tvcache also uses mean other things here, so they are spelled apart: ``ChatToolCall`` is a tool call a
chat model asked for, ``ScriptResult`` what a script run produced, ``RegisteredTool`` one entry of the tool
registry, ``ChatSession`` a persisted conversation.
"""

from .accounting import Ledger, RecordingModel, Summary
from .agent import Agent, AgentConfig, Answer
from .argparse_ast import Extraction, extract_static
from .cachemodel import AnthropicCacheModel, DeepSeekCacheModel, OpenAICacheModel, PrefixCacheModel, cache_model
from .endpoint import EndpointConfig, OpenAICompatibleModel
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
from .executor import ScriptResult, build_argv, run_script
from .gateway import Gateway, GatewayConfig, ReloadOutcome
from .mainview import MainView
from .models import (
    ChatRequest,
    ChatResponse,
    ChatToolCall,
    ScriptedModel,
    SimulatedProvider,
)
from .registry import Limits, Problem, RegisteredTool, Registry, build_registry, script_schema
from .relevance import BM25, KeywordHitRatio, evaluate_ranker
from .router import Router, RouterConfig, compress_task, filter_candidates
from .schema import ArgumentSpec, ScriptSchema
from .session import ChatSession
from .skills import SkillParam, build_skill
from .upstreams import UpstreamConfig, load_upstreams, namespaced_name, parse_upstreams
from .usage import Usage, parse_usage

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
