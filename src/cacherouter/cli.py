"""The ``cacherouter`` command: inspect tool schemas and registries, run the offline evaluation."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .channels.mainview import MainView
from .channels.relevance import RANKERS, SCORERS, make_ranker
from .channels.router import RouterConfig
from .errors import CacheRouterError, ConfigError
from .models.endpoint import MAIN_PREFIX, ROUTER_PREFIX
from .models.usage import PROVIDERS
from .tools.registry import build_registry, script_schema

if TYPE_CHECKING:
    from .evaluation.runner import RunResult
    from .frontends.chat import ChatSetup
    from .models.tokens import Tokenizer
    from .tools.gateway import Gateway

_N = TypeVar("_N", int, float)  # what a checked number option holds

DEFAULT_PACKAGES = ("base", "geography", "internet")
EVAL_WORKLOADS = ("suite", "dialogue", "longtail", "dialogue-211", "mcp")
ENV_HELP = f"""\
models (ignored with --scripted): OpenAI-compatible endpoints from environment variables
  {MAIN_PREFIX}_BASE_URL   e.g. https://api.deepseek.com (required)
  {MAIN_PREFIX}_MODEL      e.g. deepseek-chat (required)
  {MAIN_PREFIX}_API_KEY    sent as a Bearer token (default: none)
  {MAIN_PREFIX}_PROVIDER   usage fields and prices: {", ".join(PROVIDERS)} (default: detect)
  {MAIN_PREFIX}_TIMEOUT    seconds for a whole request, retries included (default: 120)
  {MAIN_PREFIX}_RETRIES    retries after a 429/5xx answer or a dropped connection (default: 2)
  {ROUTER_PREFIX}_BASE_URL, _MODEL, _API_KEY, _PROVIDER, _TIMEOUT, _RETRIES
      the router sub-model. Unset {ROUTER_PREFIX}_BASE_URL: the router uses all the {MAIN_PREFIX}_*
      settings. Set: only {ROUTER_PREFIX}_* are read (no {ROUTER_PREFIX}_API_KEY = no key sent).
"""


def _cmd_schema(args: argparse.Namespace) -> int:
    out = {}
    failed = False
    for path in args.scripts:
        script = Path(path)
        try:
            schema = script_schema(script, allow_reflection=args.allow_reflection)
        except (CacheRouterError, OSError) as e:
            print(f"{script}: {e}", file=sys.stderr)
            failed = True
            continue
        out[str(script)] = {
            "name": script.stem,
            "description": schema.description,
            "inputSchema": schema.json_schema(),
            "source": schema.source,
            "warnings": list(schema.warnings),
        }
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 1 if failed else 0


def _cmd_list(args: argparse.Namespace) -> int:
    registry = build_registry(Path(args.repo), allow_reflection=args.allow_reflection)
    if args.json:
        print(
            json.dumps(
                {
                    "tools": [
                        {
                            "name": t.name,
                            "package": t.package,
                            "skill": t.skill,
                            "description": t.description,
                            "inputSchema": t.input_schema(),
                        }
                        for t in registry
                    ],
                    "problems": [{"path": p.path, "message": p.message} for p in registry.problems],
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    for package, names in registry.packages.items():
        print(f"{package}:")
        for name in names:
            print(f"  {name:<24} {registry.tools[name].description[:90]}")
    for problem in registry.problems:
        print(f"skipped {problem.path}: {problem.message}", file=sys.stderr)
    return 0


def _pct(value: float | None) -> str:
    return "   n/a" if value is None else f"{value * 100:6.2f}%"


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluation.runner import ARCHITECTURES, results_json, run_all
    from .models.tokens import default_tokenizer

    json_path = _output_path(args.json, "--json") if args.json else None  # before the run, not after it
    # The suite breaks a tool script on purpose; the gateway's warning about it is expected here, not news.
    logging.getLogger("cacherouter.tools.gateway").setLevel(logging.ERROR)
    logging.getLogger("cacherouter.tools.upstream_hub").setLevel(logging.ERROR)
    tokenizer = default_tokenizer()
    ranker = make_ranker(RouterConfig().ranker).name  # what the router's "auto" default resolves to here
    workloads = list(args.workloads or EVAL_WORKLOADS)
    if "mcp" in workloads:
        from .evaluation.mcp_workload import unavailable

        reason = unavailable()
        if reason is not None and args.workloads:
            raise ConfigError(f"the mcp workload cannot run: {reason}")
        if reason is not None:
            print(f"note: skipping the mcp workload (real MCP servers): {reason}", file=sys.stderr)
            workloads.remove("mcp")
    results = run_all(
        architectures=args.architectures or ARCHITECTURES,
        workloads=workloads,
        tokenizer=tokenizer,
    )
    print("Offline evaluation: SCRIPTED models (no LLM API reachable), offline DeepSeek prefix-cache model,")
    print(f"hit tokens priced at 1/30 of miss tokens; tokenizer: {tokenizer.name}; router relevance: {ranker}.")
    header = (
        f"{'workload':<12} {'architecture':<12} {'requests':>8} {'input tok':>10} {'cached tok':>10} "
        f"{'hit rate':>8} {'cost ratio':>10} {'cost (miss-tok eq.)':>20} {'main tool segs':>14}"
    )
    print(header)
    for r in results:
        s = r.summary
        cost = (s.prompt_tokens - s.cached_tokens) + s.cached_tokens / 30
        print(
            f"{r.workload:<12} {r.architecture:<12} {s.requests:>8} {s.prompt_tokens:>10} {s.cached_tokens:>10} "
            f"{_pct(s.hit_rate):>8} {_pct(s.cost_ratio):>10} {cost:>20.0f} {r.main_tool_segments:>14}"
        )
    print("\nWhere the miss tokens go (first request = a cold cache; then each channel's requests):")
    for r in results:
        parts = ", ".join(f"{source} {tokens:,}" for source, tokens in r.misses.items())
        print(f"{r.workload:<12} {r.architecture:<12} {sum(r.misses.values()):>8,}  = {parts}")
    figures = results_json(results, tokenizer.name, ranker=ranker)
    if args.via_proxy:
        figures["via_proxy"] = _print_via_proxy(workloads, results, tokenizer)
    if json_path is not None:
        _write_output(json_path, "--json", json.dumps(figures, indent=2))
    return 0


def _print_via_proxy(
    workloads: list[str], results: Sequence[RunResult], tokenizer: Tokenizer
) -> list[dict[str, object]]:
    """Run the workloads through ``cacherouter proxy`` and print them next to the library path's CacheRouter."""
    from dataclasses import asdict

    from .evaluation.via_proxy import run_all_via_proxy

    runs = run_all_via_proxy(workloads, tokenizer=tokenizer)
    library = {r.workload: r.summary for r in results if r.architecture == "cacherouter"}
    print(
        "\nThrough the proxy: an agent speaking only the chat-completions API, all tools in every request -> "
        "cacherouter proxy\n(--core = the core packages, a scripted router model) -> a local stand-in provider "
        "(the same scripted models and\noffline DeepSeek cache model). No triage requests on this path."
    )
    print(
        f"{'workload':<12} {'requests':>8} {'input tok':>10} {'cached tok':>10} {'hit rate':>8} "
        f"{'cost (proxy)':>13} {'cost (library)':>15} {'tool segs':>9}"
    )
    for run in runs:
        summary = library.get(run.workload)
        lib_cost = f"{summary.cost:>15,.0f}" if summary is not None and summary.cost is not None else f"{'n/a':>15}"
        cost = f"{run.input_cost:>13,.0f}" if run.input_cost is not None else f"{'n/a':>13}"
        print(
            f"{run.workload:<12} {run.requests:>8} {run.prompt_tokens:>10} {run.cached_tokens:>10} "
            f"{_pct(run.hit_rate):>8} {cost} {lib_cost} {run.provider_tool_segments:>9}"
        )
    return [asdict(run) for run in runs]


def _cmd_eval_relevance(args: argparse.Namespace) -> int:
    import tempfile

    from .evaluation.longtail import generate_repository
    from .evaluation.retrieval import QUERIES_FILE, compare_relevance, format_comparison, load_queries
    from .evaluation.runner import EVAL_REPO
    from .evaluation.suite import CORE_PACKAGES

    # Options of the full evaluation given before "relevance" would be ignored silently: refuse them instead.
    misplaced = [
        f"--{option}" for option in ("json", "workloads", "architectures") if getattr(args, option) is not None
    ]
    if misplaced:
        raise ConfigError(
            f"{' and '.join(misplaced)} given before 'relevance' would be ignored: they belong to the full "
            "evaluation. Give the options of 'eval relevance' after the word, e.g. cacherouter eval relevance "
            "--json PATH"
        )
    json_path = _output_path(args.relevance_json, "--json") if args.relevance_json else None
    queries = load_queries(Path(args.queries) if args.queries else QUERIES_FILE)
    with tempfile.TemporaryDirectory(prefix="cacherouter-relevance-") as tmp:
        registry = build_registry(generate_repository(EVAL_REPO, Path(tmp) / "repo"))
        core_tools = frozenset(spec.name for spec in registry.in_packages(CORE_PACKAGES))
        rankers = {name: RANKERS[name] for name in args.rankers}
        comparison = compare_relevance(queries, registry, core_tools=core_tools, rankers=rankers, k=args.top_k)
    for line in format_comparison(comparison):
        print(line)
    if json_path is not None:
        _write_output(json_path, "--json", json.dumps(comparison.to_json(), indent=2))
    return 0


def _output_path(text: str, option: str) -> Path:
    """Check an output file's path before a long run, so a typo never costs the run's figures."""
    path = Path(text)
    if path.is_dir():
        raise ConfigError(f"{option} {text}: is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {text}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{option} {text}: not writable")
    return path


def _write_output(path: Path, option: str, text: str) -> None:
    try:
        path.write_text(text + "\n")
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot write the figures ({e.strerror or e})") from e
    print(f"figures written to {path}")


def _cmd_serve_mcp(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .mcp_servers.registry_server import serve_stdio  # needs the 'mcp' extra; the import says so when it is missing
    from .tools.gateway import Gateway, GatewayConfig

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # stdout carries the protocol
    if args.repo is None and args.upstreams is None:
        raise ConfigError("serve-mcp needs --repo DIR (serve its tools), --upstreams CONFIG (the gateway), or both")
    if args.upstreams is None and args.core:
        raise ConfigError("--core picks the gateway's fixed tools: it needs --upstreams")
    if args.upstreams is None and args.transport != "stdio":
        raise ConfigError("--transport streamable-http serves the gateway: it needs --upstreams")
    config = GatewayConfig(
        root=Path(args.repo) if args.repo else None,
        allow_reflection=args.allow_reflection,
        tool_timeout=args.tool_timeout,
        poll_interval=args.poll_interval,
        upstreams_file=Path(args.upstreams) if args.upstreams else None,
    )
    gateway = Gateway(config)
    try:
        if gateway.last_error is not None:
            raise CacheRouterError(gateway.last_error)
        for problem in gateway.registry.problems:
            print(f"skipped {problem.path}: {problem.message}", file=sys.stderr)
        if args.upstreams is None:
            asyncio.run(serve_stdio(gateway, max_concurrent_calls=args.max_concurrent_calls))
            return 0
        from .mcp_servers.routing_server import (
            RoutingMCPServer,
            router_model_from_env,
            serve_gateway_http,
            serve_gateway_stdio,
        )

        server = RoutingMCPServer(
            gateway,
            core=tuple(args.core),
            router_model=router_model_from_env(),
            router_config=RouterConfig(ranker=args.ranker, top_k=args.top_k, tool_timeout=args.tool_timeout),
            max_concurrent_calls=args.max_concurrent_calls,
            core_wait=args.core_wait,
        )
        _print_upstreams(gateway)
        print(f"cacherouter gateway: INTERNAL_ROUTER by {server.mode}; core: {list(server.core)}", file=sys.stderr)
        if server.pending:
            print(
                f"core tool(s) {list(server.pending)}: their server is not up yet and is being retried; the first "
                f"tools/list waits up to {args.core_wait:g}s for them, then lists the core tools there are",
                file=sys.stderr,
            )
        if args.transport == "stdio":
            asyncio.run(serve_gateway_stdio(server))
        else:
            if args.host not in ("127.0.0.1", "localhost", "::1"):
                print(
                    f"warning: serving on {args.host}: the gateway has no login and runs tools for anyone who "
                    "reaches it",
                    file=sys.stderr,
                )
            print(f"serving MCP over streamable HTTP on http://{args.host}:{args.port}/mcp", file=sys.stderr)
            asyncio.run(serve_gateway_http(server, host=args.host, port=args.port))
    finally:
        gateway.close()
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from .channels.conversation import ChatSession
    from .frontends.chat import run_chat

    sessions_dir = _sessions_dir(args.sessions_dir) if args.sessions_dir else None
    if args.session and sessions_dir is None:
        raise ConfigError("--session needs --sessions-dir, where sessions are kept")
    # A resumed session keeps its own view (core tools included): today's --packages need not even exist.
    resumed = ChatSession.load(sessions_dir, args.session) if args.session and sessions_dir else None
    if resumed is not None and args.packages is not None and tuple(sorted(args.packages)) != resumed.view.packages:
        print(f"note: session {resumed.id} keeps its core packages {list(resumed.view.packages)}", file=sys.stderr)
    with _started_gateway(args) as gateway:
        view = resumed.view if resumed is not None else _new_view(gateway, args)
        setup = _build_setup(args, gateway, view, sessions_dir)
        session = resumed if resumed is not None else setup.agent.new_session(view)
        return run_chat(setup, session, sys.stdin, sys.stdout)


def _cmd_web(args: argparse.Namespace) -> int:
    from .frontends.web import LOOPBACK_NAMES, WebChat, create_app

    try:
        import uvicorn
    except ImportError as e:
        raise CacheRouterError("the web UI needs starlette and uvicorn: pip install 'tvcache[server]'") from e

    if args.host not in LOOPBACK_NAMES:
        print(
            f"warning: serving on {args.host}: the web UI has no login and runs tools for anyone who reaches it",
            file=sys.stderr,
        )
    with _started_gateway(args) as gateway:
        view = _new_view(gateway, args)
        setup = _build_setup(args, gateway, view, None)
        web = WebChat(setup, setup.agent.new_session(view))
        print(f"cacherouter web ({web.label}) on http://{args.host}:{args.port}/", file=sys.stderr)
        uvicorn.run(create_app(web, host=args.host), host=args.host, port=args.port, log_level="warning")
    return 0


def _print_upstreams(gateway: Gateway) -> None:
    for status in gateway.upstreams:
        state = f"{status.tools} tools" if status.state == "up" else f"{status.state}: {status.last_error}"
        print(f"upstream {status.name} ({status.transport}): {state}", file=sys.stderr)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from .proxy import Proxy, ProxyConfig, create_app

    try:
        import uvicorn
    except ImportError as e:
        raise CacheRouterError("the proxy needs starlette, uvicorn and httpx: pip install 'tvcache[proxy]'") from e

    config = ProxyConfig(
        upstream=args.upstream,
        api=args.api,
        core=tuple(args.core),
        router_model=args.router_model,
        router=RouterConfig(ranker=args.ranker, top_k=args.top_k),
        provider=args.provider,
        timeout=args.timeout,
        max_hidden_rounds=args.max_hidden_rounds,
    )
    proxy = Proxy(config)
    mode = f"router model {args.router_model}" if args.router_model else "deterministic retrieval"
    core = f"core {list(config.core)}" if config.core else "core = each session's first request's tools"
    print(
        f"cacherouter proxy ({args.api} API, INTERNAL_ROUTER by {mode}, {core}) on "
        f"http://{args.host}:{args.port}/v1 -> {config.upstream}; figures at /stats and /metrics",
        file=sys.stderr,
    )
    uvicorn.run(create_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0


@contextlib.contextmanager
def _started_gateway(args: argparse.Namespace) -> Iterator[Gateway]:
    """The gateway over --repo (and --upstreams' MCP servers), hot-reloading while the chat runs: their tools
    join the long tail, reached through the router, and a session's main view never changes."""
    from .tools.gateway import Gateway, GatewayConfig

    repo = Path(args.repo) if args.repo else _default_repo()
    upstreams = Path(args.upstreams) if args.upstreams else None
    gateway = Gateway(GatewayConfig(root=repo, poll_interval=args.poll_interval, upstreams_file=upstreams))
    if gateway.last_error is not None:
        gateway.close()
        raise CacheRouterError(gateway.last_error)
    _print_upstreams(gateway)
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.close()


def _new_view(gateway: Gateway, args: argparse.Namespace) -> MainView:
    return MainView.from_registry(gateway.registry, tuple(args.packages or DEFAULT_PACKAGES))


def _build_setup(args: argparse.Namespace, gateway: Gateway, view: MainView, sessions_dir: Path | None) -> ChatSetup:
    from .frontends.chat import build_chat

    if args.top_k < 1 or args.tool_timeout <= 0:
        raise ConfigError("--top-k must be at least 1 and --tool-timeout more than 0 seconds")
    lists = {"blacklist": args.blacklist, "whitelist": args.whitelist, "yellowlist": args.yellowlist}
    for option, names in lists.items():
        unknown = sorted(set(names) - set(gateway.registry.tools))
        if unknown:  # a warning, not an error: the tool may appear at the next hot reload
            print(f"warning: --{option} names no registered tool: {', '.join(unknown)}", file=sys.stderr)
    config = RouterConfig(
        ranker=args.ranker,
        top_k=args.top_k,
        tool_timeout=args.tool_timeout,
        blacklist=frozenset(args.blacklist),
        whitelist=frozenset(args.whitelist),
        yellowlist=frozenset(args.yellowlist),
    )
    return build_chat(gateway, view=view, scripted=args.scripted, sessions_dir=sessions_dir, router_config=config)


def _sessions_dir(text: str) -> Path:
    """Check --sessions-dir before any turn runs, so a bad path never costs a conversation."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--sessions-dir {text}: cannot use it as a directory ({e.strerror or e})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--sessions-dir {text}: the directory is not writable")
    return path


def _default_repo() -> Path:
    from .evaluation.runner import EVAL_REPO

    return EVAL_REPO


def _checked(
    convert: Callable[[str], _N], expected: str, accept: Callable[[_N], bool], must: str
) -> Callable[[str], _N]:
    """An argparse type: ``convert`` the text (else "expected ..."), then ``accept`` the value (else "must be ...")."""

    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return value

    return parse


# Seconds more than 0 (0 would make a poll loop spin, a timeout fire at once); the range check also refuses nan.
_positive_seconds = _checked(
    float, "a number of seconds", lambda value: 0 < value < math.inf, "a finite number of seconds more than 0"
)
_port = _checked(int, "a port number", lambda value: 0 <= value <= 65535, "a port from 0 to 65535")  # 0: any free
_at_least_one = _checked(int, "a whole number", lambda value: value >= 1, "at least 1")


def _add_agent_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``chat`` and ``web``: repository, main view, models, router filters."""
    parser.add_argument("--repo", help="tool repository (default: the bundled evaluation repository)")
    parser.add_argument(
        "--upstreams",
        metavar="CONFIG",
        help="JSON file of MCP servers (as for serve-mcp) whose tools join the long tail, reached through the router",
    )
    parser.add_argument(
        "--packages",
        nargs="+",
        metavar="PACKAGE",
        help=f"core packages of the main view (default: {' '.join(DEFAULT_PACKAGES)})",
    )
    parser.add_argument(
        "--scripted", action="store_true", help="rule-based stand-in models and an offline cache model (no network)"
    )
    parser.add_argument(
        "--poll-interval",
        type=_positive_seconds,
        default=1.0,
        help="seconds between repository polls (default: %(default)s)",
    )
    parser.add_argument(
        "--ranker",
        choices=sorted(RANKERS),
        default="auto",
        help="the router's relevance scorer (default: auto = dense embeddings when the router extra is installed, "
        "else bm25)",
    )
    defaults = RouterConfig()
    for option, what in (
        ("blacklist", "tools the router never offers to its model"),
        ("whitelist", "if given, the only tools the router may offer to its model"),
        ("yellowlist", "tools the router avoids unless nothing else fits (the main view's core tools always are)"),
    ):
        parser.add_argument(f"--{option}", nargs="+", default=[], metavar="TOOL", help=what)
    parser.add_argument(
        "--top-k", type=int, default=defaults.top_k, help="candidates the router model sees (default: %(default)s)"
    )
    parser.add_argument(
        "--tool-timeout",
        type=float,
        default=defaults.tool_timeout,
        help="seconds before a tool run is killed (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacherouter", description="Cache-preserving dual-path tool routing.")
    sub = parser.add_subparsers(dest="command", required=True)
    tools = sub.add_parser("tools", help="inspect tool scripts and registries").add_subparsers(
        dest="tools_command", required=True
    )
    schema = tools.add_parser("schema", help="print the JSON schemas of scripts (static analysis)")
    schema.add_argument("scripts", nargs="+", help="tool scripts")
    schema.add_argument(
        "--allow-reflection",
        action="store_true",
        help="run scripts whose parser is built dynamically, to read it (executes their code)",
    )
    schema.set_defaults(func=_cmd_schema)
    listing = tools.add_parser("list", help="print the registry of a tool repository")
    listing.add_argument("--repo", required=True, help="repository root (package/skill/script)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("--allow-reflection", action="store_true", help="allow reflection fallback")
    listing.set_defaults(func=_cmd_list)
    serve = sub.add_parser(
        "serve-mcp",
        help="serve a tool repository over MCP (stdio), or be a cache-preserving gateway to MCP servers",
        description=(
            "With --repo only: every tool of the repository over MCP on stdio, hot-reloaded. With --upstreams: the\n"
            "gateway -- clients see only the --core tools and INTERNAL_ROUTER, a list that never changes, while the\n"
            "configured MCP servers' tools (and --repo's, if given) are reached through INTERNAL_ROUTER. The router\n"
            "sub-model comes from CACHEROUTER_ROUTER_* when CACHEROUTER_ROUTER_BASE_URL is set; otherwise\n"
            "INTERNAL_ROUTER works by deterministic retrieval (find tools, then run one). The gateway serves on stdio\n"
            "or, with --transport streamable-http, at http://HOST:PORT/mcp. See docs/cacherouter-mcp.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--repo", help="repository root (package/skill/script)")
    serve.add_argument("--upstreams", metavar="CONFIG", help="JSON file of upstream MCP servers: the gateway mode")
    serve.add_argument(
        "--core", nargs="+", default=[], metavar="TOOL", help="tools the gateway lists directly (e.g. git__git_status)"
    )
    serve.add_argument("--ranker", choices=sorted(RANKERS), default="auto", help="the router's relevance scorer")
    serve.add_argument(
        "--top-k", type=_at_least_one, default=RouterConfig().top_k, help="candidates per routed task (default: 5)"
    )
    serve.add_argument(
        "--poll-interval", type=_positive_seconds, default=1.0, help="seconds between repository polls (default: 1)"
    )
    serve.add_argument(
        "--tool-timeout",
        type=_positive_seconds,
        default=60.0,
        help="seconds before a script run of --repo is killed (an upstream call: its server's call_timeout) "
        "(default: 60)",
    )
    serve.add_argument(
        "--core-wait",
        type=_positive_seconds,
        default=30.0,
        help="seconds the first tools/list waits for --core tools whose server is not up yet (default: 30)",
    )
    serve.add_argument(
        "--transport",
        choices=["stdio", "streamable-http"],
        default="stdio",
        help="stdio (default), or streamable HTTP at http://HOST:PORT/mcp (the gateway, with --upstreams)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address for streamable-http (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port for streamable-http (default: %(default)s)")
    serve.add_argument(
        "--max-concurrent-calls",
        type=_at_least_one,
        default=16,  # registry_server.DEFAULT_MAX_CONCURRENT_CALLS, not imported here: the mcp extra is optional
        help="tool runs at once; more calls wait, while the protocol keeps answering (default: 16)",
    )
    serve.add_argument("--allow-reflection", action="store_true", help="allow reflection fallback")
    serve.set_defaults(func=_cmd_serve_mcp)
    proxy = sub.add_parser(
        "proxy",
        help="a drop-in OpenAI/Anthropic API proxy: agents keep their tools, the provider keeps its prompt cache",
        description=(
            "Serve POST /v1/chat/completions (--api openai) or POST /v1/messages (--api anthropic), streamed or\n"
            "not, and GET /v1/models, in front of --upstream. The provider sees a fixed tool view -- the --core\n"
            "tools (default: each session's first request's tools) plus INTERNAL_ROUTER -- whatever tools the\n"
            "client sends; INTERNAL_ROUTER calls come back to the client as calls of its own tools. The client's\n"
            "API key goes to the provider and nowhere else. Usage and input cost: GET /stats, /metrics and /.\n"
            "See docs/cacherouter-proxy.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the provider's API base, /v1 included (https://api.openai.com/v1, https://api.anthropic.com/v1)",
    )
    proxy.add_argument("--port", type=_port, default=8787, help="port to listen on (default: %(default)s)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    proxy.add_argument(
        "--api", choices=["openai", "anthropic"], default="openai", help="the API spoken (default: openai)"
    )
    proxy.add_argument(
        "--core",
        nargs="+",
        default=[],
        metavar="TOOL",
        help="tools the provider always sees (default: all tools of a session's first request)",
    )
    proxy.add_argument(
        "--router-model",
        metavar="MODEL",
        help="resolve INTERNAL_ROUTER with a sub-call of this model on the same upstream (default: deterministic "
        "retrieval -- the main model finds a tool by task, then names it)",
    )
    proxy.add_argument("--ranker", choices=sorted(RANKERS), default="auto", help="the router's relevance scorer")
    proxy.add_argument(
        "--top-k", type=_at_least_one, default=RouterConfig().top_k, help="candidates per routed task (default: 5)"
    )
    proxy.add_argument(
        "--provider", choices=PROVIDERS, help="usage fields and prices for /stats (default: detect from responses)"
    )
    proxy.add_argument(
        "--timeout", type=_positive_seconds, default=600.0, help="seconds per provider request (default: 600)"
    )
    proxy.add_argument(
        "--max-hidden-rounds",
        type=int,
        default=4,
        choices=range(0, 17),
        metavar="N",
        help="provider rounds in a row the proxy may answer itself, 0 to 16 (default: 4)",
    )
    proxy.set_defaults(func=_cmd_proxy)
    chat = sub.add_parser(
        "chat",
        help="talk to the agent in the terminal (models from CACHEROUTER_MAIN_*/CACHEROUTER_ROUTER_*, or --scripted)",
        description=(
            "Talk to the CacheRouter agent in the terminal, one message per line; /quit, /exit, :q or the end of\n"
            "input ends the chat. Each turn prints the answer, where the router sent its calls and, per model\n"
            "request, the prompt and cached tokens and the relative input cost."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_agent_options(chat)
    chat.add_argument("--sessions-dir", help="persist sessions in this directory (default: not persisted)")
    chat.add_argument("--session", help="resume this session id from --sessions-dir, with the core tools it began with")
    chat.set_defaults(func=_cmd_chat)
    web = sub.add_parser(
        "web",
        help="the chat in a browser: messages, tool and router calls, cache hits per request",
        description=(
            "Serve the chat as a web page: messages, every tool and INTERNAL_ROUTER call and, per model request,\n"
            "the prompt and cached tokens and the relative input cost. The page has no login."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_agent_options(web)
    web.add_argument("--host", default="127.0.0.1", help="address to bind; the UI has no login (default: %(default)s)")
    web.add_argument("--port", type=int, default=8765, help="port to listen on (default: %(default)s)")
    web.set_defaults(func=_cmd_web)
    evaluate = sub.add_parser(
        "eval",
        help="run the scripted 55-query suite, 30-turn dialogue and 40-query long-tail workload, three ways",
        description=(
            "Run the scripted workloads three ways side by side (CacheRouter, all tools always exposed, per-query "
            "dynamic disclosure) and account every request under DeepSeek's prefix-cache rules. Workloads: suite "
            "(55 queries, 11-tool repository with restarts, edits and new skills), dialogue (30 turns, 11 tools), "
            "longtail (40 queries, 211 tools), dialogue-211 (the same 30 turns over the 211-tool registry), mcp (24 "
            "queries; the 12 scripts plus the tools of five real MCP servers -- git, time, memory, filesystem, "
            "everything -- joining and leaving mid-run; needs scripts/install-mcp-servers.sh and the dev extra)."
        ),
    )
    evaluate.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    evaluate.add_argument(
        "--workloads", nargs="+", choices=EVAL_WORKLOADS, help="which workloads to run (default: all)"
    )
    evaluate.add_argument("--architectures", nargs="+", choices=["cacherouter", "all-tools", "dynamic"])
    evaluate.add_argument(
        "--via-proxy",
        action="store_true",
        help="also drive each workload through cacherouter proxy (a client speaking only the chat-completions API, "
        "a local stand-in provider) and print its input cost next to the library path's",
    )
    evaluate.set_defaults(func=_cmd_eval)
    eval_modes = evaluate.add_subparsers(dest="eval_command", metavar="{relevance}")
    relevance = eval_modes.add_parser(
        "relevance", help="compare the relevance scorers on the labelled long-tail query set (no models needed)"
    )
    relevance.add_argument("--json", dest="relevance_json", metavar="PATH", help="also write the figures as JSON")
    relevance.add_argument("--queries", metavar="PATH", help="a JSONL query set (default: the bundled one)")
    relevance.add_argument("--rankers", nargs="+", choices=SCORERS, default=list(SCORERS), help="scorers to compare")
    relevance.add_argument(
        "--top-k",
        type=_at_least_one,
        default=RouterConfig().top_k,
        help="the router's top-k, at least 1 (default: %(default)s)",
    )
    relevance.set_defaults(func=_cmd_eval_relevance)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except CacheRouterError as e:
        print(f"cacherouter: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cacherouter: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
    return code


if __name__ == "__main__":
    sys.exit(main())
