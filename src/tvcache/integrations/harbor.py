"""Harbor: a caching environment over any Harbor environment, and a Harbor environment on tvcache's overlay shell
sandboxes (no container engine needed).

Harbor (terminal-bench 2, SkyRL's and the Tinker cookbook's terminal tasks) drives its sandbox through
``BaseEnvironment``: ``start``, ``exec(command, cwd, env, timeout_sec, user) -> ExecResult``, ``upload_file`` /
``upload_dir``, ``download_file`` / ``download_dir``, ``stop``. Each ``exec`` is its own process, so a state is
the history of calls that changed the environment's files.

``CachingEnvironment`` wraps the environment type you run today (``inner="docker"``, an import path, or a class)
and keeps one tvcache graph per task (the task's name, or ``task_id``). Harbor builds it like any environment,
from the trial config::

    "environment": {"import_path": "tvcache.integrations.harbor:CachingEnvironment",
                    "kwargs": {"inner": "docker", "cache": "/data/tvcache"}}

``start`` starts nothing; the real environment is started on the first miss (a trial whose calls all hit never
starts one), and on a miss after hits a fresh one is started and the cached calls of the path replayed into it,
each result checked. Keys: ``exec`` by command, working directory, the environment variables it really gets
(persistent, per-call and scoped ones merged, as Harbor merges them), timeout and user; uploads by the target
and a digest of the content (file modes included); downloads are reads, their content cached. Nothing the
inner environment returns is changed: results are its own ``ExecResult`` rebuilt from JSON, and exceptions are
cached only when they can be rebuilt exactly (else they pass uncached). A shell command is not known to be
deterministic: by default the first hit of each tool per task is checked by executing it once more
(``deterministic=None``); declare ``deterministic=True`` when your commands are. A call that timed out is never
cached. Calls this adapter does not key (a sidecar service, streaming, SSH) pass through to the real environment
uncached, counted in ``pass_throughs`` and logged once.

``OverlayEnvironment`` runs a task on ``ShellSandbox`` over a root filesystem tree (``rootfs``: an unpacked
image) with no engine: commands run as root in their own namespaces with no network; stdout, stderr and the
exit code are kept apart as Harbor expects. Use it alone, or as ``inner`` of ``CachingEnvironment``. Harbor's
``exec`` is one process per command, so by default each runs confined on its own and everything it started ends
with it (its ``/tmp`` too). ``persistent=True`` runs every ``exec`` from one long-lived shell of the sandbox
(``ShellSandbox.factory(..., persistent=True)``) instead, for agents that keep processes between calls
(Terminus's tmux session, a server started in one step and queried in the next): each ``exec`` is still its own
``bash -c`` with its own working directory and environment, but background processes and ``/tmp`` live on
until ``stop``.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import shlex
import shutil
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..calls import ToolCall, ToolSpec
from ..errors import InvalidToolCall, SandboxError
from ..protocol import Outcome
from ..sandboxes import ShellSandbox
from ._file_trees import keep_copy, pack, upload_digest
from ._harness import PASS_THROUGH_TOOLS, HarnessSandbox, PassThroughs, shared_cache
from ._recorded_errors import UnrecordedErrors
from .cache_location import CacheLocation
from .external_sandboxes import ExternalSandboxFactory
from .optional_imports import require

_base = require("harbor.environments.base", "harbor")
_capabilities = require("harbor.environments.capabilities", "harbor")
BaseEnvironment: Any = _base.BaseEnvironment

__all__ = ["CachingEnvironment", "OverlayEnvironment", "tool_specs"]

KIND = "harbor"
_STATEFUL = ("exec", "upload_file", "upload_dir")
_READS = ("download_file", "download_dir")
_counter = itertools.count()


def tool_specs(deterministic: bool | None = None) -> dict[str, ToolSpec]:
    """Harbor's environment calls as cached tools. Copying bytes in or out is deterministic; ``exec`` is what
    ``deterministic`` declares (None: checked on its first hit per task)."""
    specs = {"exec": ToolSpec(name="exec", deterministic=deterministic)}
    specs |= {name: ToolSpec(name=name, deterministic=True) for name in _STATEFUL[1:]}
    specs |= {name: ToolSpec(name=name, read_only=True, deterministic=True) for name in _READS}
    return {**specs, **PASS_THROUGH_TOOLS}


def content_digest(path: Path) -> str:
    """A digest of a file or tree as an upload sees it: names, kinds, modes, link targets and contents. A file
    alone is hashed with its permission bits only, a link by its target as pathlib spells it: Harbor's rules
    (``upload_digest``), kept since its digests are cached keys."""
    return upload_digest(path, whole_file_mode=False, pathlib_links=True)


def _pack(path: Path) -> bytes:
    """The files under ``path`` as a tar archive, links as links (for downloads: what a hit writes back)."""
    return pack(path, follow_links=False)


def _unpack(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
        archive.extractall(target, filter="data")


class CachingEnvironment(BaseEnvironment):  # type: ignore[misc]
    """A Harbor environment over one tvcache session (one trial of one task). See the module docstring."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        inner: str | type = "docker",
        inner_kwargs: Mapping[str, Any] | None = None,
        cache: CacheLocation = None,
        task_id: str | None = None,
        deterministic: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self._inner_spec = inner
        self._inner_args = dict(
            environment_dir=environment_dir,
            environment_name=environment_name,
            task_env_config=task_env_config,
            trial_paths=trial_paths,
            **kwargs,
            **dict(inner_kwargs or {}),
        )
        self._session_base = session_id
        self._builds = itertools.count()
        # Built now (cheap: nothing starts before ``start``), since Harbor asks for capabilities while building us.
        self._first: Any = self._build()
        self._first_used = False
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args, **kwargs)
        self.task_id = task_id or f"harbor:{environment_name}"
        self.pass_throughs = PassThroughs(KIND)
        self.environments_started = 0
        self._uploads = Path(tempfile.mkdtemp(prefix="tvcache-harbor-uploads-"))
        self._unrecorded = UnrecordedErrors()
        factory = ExternalSandboxFactory(kind=KIND, tools=tool_specs(deterministic), start=self._start)
        self.session = shared_cache(cache).session(self.task_id, sandbox=factory)

    # ------------------------------------------------------------ identity

    @staticmethod
    def type() -> str:
        return "tvcache"

    @property
    def capabilities(self) -> Any:
        """The inner environment's, except host mounts and streaming: every file must come through the cache."""
        inner = self._first.capabilities.model_copy(update={"mounted": False, "stream": False})
        return inner

    def _validate_definition(self) -> None:
        """The inner environment validated the task's definition when it was built."""

    # ---------------------------------------------------------- lifecycle

    async def start(self, force_build: bool) -> None:
        self._force_build = force_build  # used when a miss starts the real environment

    async def stop(self, delete: bool) -> None:
        try:
            await self.session.close()
        finally:
            shutil.rmtree(self._uploads, ignore_errors=True)

    # --------------------------------------------------------------- calls

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> Any:
        arguments = {
            "command": command,
            "cwd": cwd,
            "env": self._merge_env(env),
            "timeout_sec": timeout_sec,
            "user": self._resolve_user(user),
        }
        if self._output_callback() is not None:  # a streaming caller wants chunks as they come: run it live
            return await self._pass_exec("streamed exec", "output callbacks need a live process", arguments)
        try:
            ToolCall("exec", arguments)
        except InvalidToolCall as error:
            return await self._pass_exec("exec", str(error), arguments)
        return await self._call("exec", arguments)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._upload("upload_file", Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._upload("upload_dir", Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._call("download_file", {"source": source_path})
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        _unpack(await self._call("download_dir", {"source": source_dir}), Path(target_dir))

    # ----------------------------------------------------------- internals

    async def _upload(self, tool: str, source: Path, target: str) -> None:
        digest = content_digest(source)
        keep_copy(source, self._uploads / digest / "content")  # what replays upload
        await self._call(tool, {"digest": digest, "target": target})

    async def _call(self, tool: str, arguments: dict[str, Any]) -> Any:
        result = await self.session.call(tool, arguments)
        payload = json.loads(result.output)
        self._unrecorded.raise_any(payload)
        if tool == "exec":
            return _base.ExecResult.model_validate(payload["result"])
        if tool in _READS:
            return base64.b64decode(payload["base64"])
        return None

    async def _pass_exec(self, kind: str, why: str, arguments: dict[str, Any]) -> Any:
        async def run(real: Any) -> Any:
            return await real.exec(**arguments)

        return await self.pass_throughs.run(self.session, kind, why, run)

    def _build(self) -> Any:
        args = {**self._inner_args, "session_id": f"{self._session_base}__tvcache{next(self._builds)}"}
        spec: Any = self._inner_spec
        if isinstance(spec, str) and ":" not in spec:
            factory = require("harbor.environments.factory", "harbor").EnvironmentFactory
            environment_type = require("harbor.models.environment_type", "harbor").EnvironmentType
            return factory.create_environment(environment_type(spec), **args)
        if isinstance(spec, str):
            spec = require("harbor.utils.import_path", "harbor").import_symbol(spec)
        return spec(**args)

    async def _start(self) -> HarnessSandbox:
        real = self._first if not self._first_used else self._build()
        self._first_used = True
        await real.start(force_build=getattr(self, "_force_build", False))
        self.environments_started += 1
        return HarnessSandbox(real, self._run, _stop, self.pass_throughs)

    async def _run(self, real: Any, call: ToolCall) -> Outcome:
        arguments = call.arguments
        try:
            if call.name == "exec":
                result = await real.exec(**arguments)
                return Outcome(output=json.dumps({"result": result.model_dump(mode="json")}))
            if call.name in ("upload_file", "upload_dir"):
                source = self._uploads / arguments["digest"] / "content"
                await getattr(real, call.name)(source, arguments["target"])
                return Outcome(output="{}")
            with tempfile.TemporaryDirectory(prefix="tvcache-harbor-download-") as scratch:
                target = Path(scratch) / "content"
                await getattr(real, call.name)(arguments["source"], target)
                data = target.read_bytes() if call.name == "download_file" else _pack(target)
            return Outcome(output=json.dumps({"base64": base64.b64encode(data).decode()}))
        except Exception as error:
            return self._unrecorded.outcome(error, timeouts=(TimeoutError,))  # a timeout's effects depend on timing


async def _stop(real: Any) -> None:
    await real.stop(delete=True)


# ---------------------------------------------------------------------------------------------- overlay


_FRAME = "\n@@tvcache-frame@@\n"  # what a transfer prints before its payload (bash may warn before it)
# In a subshell, with its temporary files removed: a persistent shell keeps neither its variables nor its files.
_EXEC = """( out=$(mktemp) err=$(mktemp); trap 'rm -f -- "$out" "$err"' EXIT
( {cd}exec env {env} bash -c {command} ) >"$out" 2>"$err" </dev/null
rc=$?; printf '\\n@@tvcache-frame@@\\n%s\\n' "$rc"; base64 -w0 "$out"; printf '\\n'; base64 -w0 "$err" )
"""
_CHUNK = 64 * 1024  # bytes per upload command: well under Linux's 128 KiB limit on one argument


class OverlayEnvironment(BaseEnvironment):  # type: ignore[misc]
    """A Harbor environment on one ``ShellSandbox`` over ``rootfs`` (a root filesystem tree). See the module
    docstring. ``timeout_sec``: the limit of a command that gives none; ``environment``: every command's whole
    environment (default: ``ShellSandbox``'s fixed one); ``persistent``: every ``exec`` runs from one long-lived
    shell, so background processes (a tmux server, a local service) and ``/tmp`` live on between calls."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        rootfs: str | Path,
        timeout_sec: float = 3600.0,
        environment: Mapping[str, str] | None = None,
        persistent: bool = False,
        **kwargs: Any,
    ) -> None:
        self._rootfs = Path(rootfs)
        self._timeout = timeout_sec
        self._environment = environment
        self.persistent = persistent
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args, **kwargs)
        self._factory: Any = None
        self._sandbox: Any = None

    @staticmethod
    def type() -> str:
        return "tvcache-overlay"

    @property
    def capabilities(self) -> Any:
        return _capabilities.EnvironmentCapabilities(disable_internet=True)  # commands get a loopback of their own

    def _validate_definition(self) -> None:
        if not (self._rootfs / "bin" / "bash").exists():
            raise FileNotFoundError(f"OverlayEnvironment needs a root filesystem with bin/bash at {self._rootfs}")

    async def start(self, force_build: bool) -> None:
        self._factory = ShellSandbox.factory(
            self._rootfs,
            rootfs=True,
            fallback=False,
            timeout=self._timeout,
            environment=self._environment,
            persistent=self.persistent,
        )
        self._sandbox = await self._factory.start()
        # Harbor's own paths, which container providers mount or create at start.
        paths = require("harbor.models.trial.paths", "harbor").EnvironmentPaths.for_os(self.os)
        workdir = [self.task_env_config.workdir] if self.task_env_config.workdir else []
        wanted = [*self._mount_targets(writable_only=True), paths.agent_dir, paths.verifier_dir, paths.artifacts_dir]
        await self.ensure_dirs(list(dict.fromkeys(str(path) for path in [*wanted, *workdir])))

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await sandbox.stop()
        if self._factory is not None:
            self._factory.close()

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> Any:
        user = self._resolve_user(user)
        if user not in (None, "root", 0, "0"):
            raise SandboxError(f"OverlayEnvironment runs commands as root only, not as {user!r}")
        merged = self._merge_env(env) or {}
        assignments = " ".join(shlex.quote(f"{key}={value}") for key, value in merged.items())
        cd = f"cd {shlex.quote(cwd)} && " if cwd else ""
        script = _EXEC.format(cd=cd, env=assignments, command=shlex.quote(command))
        output = await self._sh(script, timeout_sec, framed=True)
        code, out, err = output.split("\n", 2)[:3]
        return _base.ExecResult(
            stdout=base64.b64decode(out).decode(errors="replace"),
            stderr=base64.b64decode(err.split("\n", 1)[0]).decode(errors="replace"),
            return_code=int(code),
        )

    async def _sh(self, script: str, timeout: float | None = None, *, framed: bool = False) -> str:
        if self._sandbox is None:
            raise SandboxError("this OverlayEnvironment is not started (call start first)")
        arguments: dict[str, Any] = {"cmd": script}
        if timeout is not None:
            arguments["timeout"] = timeout
        outcome = await self._sandbox.execute(ToolCall("sh", arguments))
        if not outcome.deterministic and "[timed out" in outcome.output:
            raise TimeoutError(f"command timed out after {timeout} s")
        if outcome.is_error:
            raise SandboxError(f"OverlayEnvironment: a transfer command failed: {outcome.output[-500:]}")
        text: str = outcome.output
        return text.rpartition(_FRAME)[2] if framed else text

    async def _put(self, data: bytes, target: str, unpack: str) -> None:
        """Send ``data`` in chunks appended to a file beside ``target``, then ``unpack`` it there."""
        part = shlex.quote(f"{target}.tvcache-part")
        await self._sh(f"mkdir -p {shlex.quote(str(Path(target).parent))} && : > {part}")
        encoded = base64.b64encode(data).decode()
        for start in range(0, len(encoded), _CHUNK):
            await self._sh(f"printf %s {encoded[start : start + _CHUNK]} >> {part}")
        # In a subshell: `exit` (and anything `unpack` sets) must not reach a persistent shell.
        await self._sh(f"( base64 -d {part} | {{ {unpack}; }}; rc=$?; rm -f {part}; exit $rc )")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        mode = source.stat().st_mode & 0o7777
        quoted = shlex.quote(target_path)
        await self._put(source.read_bytes(), target_path, f"cat > {quoted} && chmod {mode:o} {quoted}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        quoted = shlex.quote(target_dir)
        await self._put(_pack(Path(source_dir)), target_dir, f"mkdir -p {quoted} && tar -xf - -C {quoted}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        encoded = await self._sh(f"printf {shlex.quote(_FRAME)}; base64 -w0 {shlex.quote(source_path)}", framed=True)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(encoded))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        pack = f"tar -cf - -C {shlex.quote(source_dir)} . | base64 -w0"
        encoded = await self._sh(f"printf {shlex.quote(_FRAME)}; ( set -o pipefail; {pack} )", framed=True)
        _unpack(base64.b64decode(encoded), Path(target_dir))
