"""A differential fuzzer of the persistent shells: random sequences of state-changing bash, run through a plain
interactive bash on a pty (the reference), an uncached persistent sandbox, and the cache with forks under each
snapshot route; every answer compared, call for call.

    python -m tvcache.shell_fuzz --seed 1 --commands 500 --route shell-state

The parts, each usable alone:

* ``generate(seed, count)``: commands drawn from a grammar of state-changing bash (``GRAMMAR``): cd/pushd/
  popd through symlinks, variables and their attributes, arrays with odd keys, functions and aliases with
  newlines, traps, options, umask, ulimit, IFS, getopts, ``enable -n``, ``complete``, background jobs,
  heredocs, ``exec`` redirections, files, observations that print the state, and hostile commands (forged
  statuses and protocol-looking lines, builtins shadowed or disabled, ``set -x``/``-v``, ``exec >file``,
  ``IFS=0``, ``unset LINENO``, multi-line traps, directory names with newlines, marker-like function bodies).
  Every command is safe (files only under the tree, no signal to the shell but a trapped USR1, under 1 s),
  parses, and depends on no timing: background jobs are waited for within the command that starts them.
  Commands name the tree as ``@T@`` (``TREE``), replaced by each runner with its own tree's path.
* ``ReferenceShell``: ``bash --norc --noprofile --noediting -i`` on a real pty, in a directory of its own, with
  the sandbox's environment, umask and limits and empty prompts. Each command is typed as
  ``<restore>{ <command>\\n} </dev/null`` (stdin at end of file), then a follow-up line of its own (an expansion
  error ends the rest of its line) that prints a fresh random marker with ``$?``, ``$LINENO``, ``$_``,
  ``PIPESTATUS`` and the prompts through ``/usr/bin/printf`` to ``/dev/tty`` (no builtin, function, alias,
  descriptor or option a generated command can change is involved) and empties the prompts; ``<restore>``
  puts back the prompts, ``$_``, ``PIPESTATUS`` and ``$?`` with plain assignments and external commands. What
  the reference cannot hide is corrected exactly, never normalised: the two lines it types more per command
  (``LINENO=<n>`` as the generator's observations print it is renumbered as a terminal counts lines), the
  prompt and echo (``set -v``) of the follow-up line, and the echo of the wrapper. ``tests/test_shell_fuzz.py``
  checks it against a bash typed straight at a terminal, on whole generated sequences. Known limits: a
  command holding several complete commands on separate lines runs as one group (the answer carries a
  ``note``; the grammar has none); while a command runs, descriptor 10 holds the group's saved stdin (as in
  the sandbox's own group), so ``{fd}>`` gets 11 where a terminal gives 10; ``history`` shows the wrapper.
* ``fuzz(...)``: one flavour (``overlay``, or ``docker`` where an engine runs), sequences of commands run
  through the reference, an uncached persistent sandbox and, per route (``shell-state``, ``criu``,
  ``declined``), the embedded cache: several rollouts of growing prefixes of the sequence, each forking from
  the snapshot the last one left (or replaying it where snapshots are declined). ``RouteReport`` counts what
  ran and what differed; ``NORMALISATIONS`` is everything normalised before comparing, each with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import os
import random
import re
import resource
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
import tty
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .calls import ToolCall
from .errors import TVCacheError
from .protocol import route_counts

__all__ = [
    "GRAMMAR",
    "NORMALISATIONS",
    "ROUTES",
    "TREE",
    "Answer",
    "Difference",
    "FuzzError",
    "Normalisation",
    "ReferenceShell",
    "RouteReport",
    "Rule",
    "ShellLimits",
    "Step",
    "fuzz",
    "generate",
    "main",
]

TREE = "@T@"  # the tree's path in a generated command (always followed by "/")
ROUTES = ("uncached", "shell-state", "criu", "declined")
COMMAND_SECONDS = 10.0  # per command in the reference: generated commands take well under 1 s
SANDBOX_SECONDS = 2.0  # per command in a sandbox; after a timeout the sequence stops there (all later answers
TIMED_OUT = "[timed out after "  # would be about a broken shell, not about what the commands did)
WINDOW = (24, 80)  # rows, columns: the persistent shells' fixed window


class FuzzError(TVCacheError):
    """The fuzzer itself could not go on (the reference shell did not answer, a flavour cannot start)."""


# ----------------------------------------------------------------------------------------------- generator


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One generated command and the rule it came from (differences are counted by rule)."""

    command: str
    production: str


@dataclass(kw_only=True)
class _Model:
    """What the generator tracks so that what it emits stays meaningful and safe."""

    redirected: bool = False  # stdout goes to out.log, the terminal saved in $FZOUT
    fd3: bool = False
    nofile: int = 1 << 20  # ulimit: soft limits only ever lowered
    stack: int = 1 << 30
    readonly: set[str] = field(default_factory=set)
    xtrace: bool = False  # set -x: the traces of a pipeline's parts or a job and its parent interleave by timing


Production = Callable[[random.Random, _Model], tuple[str, ...]]
Alternative = str | tuple[str, ...] | Production  # a command, commands in a row, or one made from the model


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """A production of the grammar: its name, how often it is drawn, and its alternatives (drawn uniformly)."""

    name: str
    weight: int
    alternatives: tuple[Alternative, ...]


def _readonly(rng: random.Random, model: _Model) -> tuple[str, ...]:
    name = rng.choice(["R1", "R2"])
    if name in model.readonly:
        return (f"{name}=again",)  # an error, as in any bash
    model.readonly.add(name)
    return (rng.choice([f"readonly {name}=frozen", f"declare -r {name}=$'multi\\nline'"]),)


def _ulimit(rng: random.Random, model: _Model) -> tuple[str, ...]:
    if rng.random() < 0.5:
        model.nofile = min(model.nofile, rng.choice([512, 256, 200]))
        return (f"ulimit -Sn {model.nofile}",)
    model.stack = min(model.stack, rng.choice([6144, 4096, 2048]))
    return (f"ulimit -Ss {model.stack}",)


def _redirection(rng: random.Random, model: _Model) -> tuple[str, ...]:
    """An ``exec`` redirection, or its undoing: stdout to a file in the tree and back, a descriptor 3."""
    if model.redirected:
        model.redirected = False
        return ('exec >&"$FZOUT" {FZOUT}>&-; cat @T@/out.log',)
    if model.fd3:
        model.fd3 = False
        return ("exec 3>&-; cat @T@/three.log",)
    if rng.random() < 0.5:
        model.redirected = True
        return ("exec {FZOUT}>&1 >>@T@/out.log; echo into-file",)
    model.fd3 = True
    return ("exec 3>>@T@/three.log; echo three >&3",)


JOBS = (
    "sleep 0.1 & wait",
    "(sleep 0.05; echo bg-out) & wait",
    "sleep 0.1 & jobs; wait",
    'sleep 0.05 & wait "$!"; echo "st=$?"',
    "(sleep 0.05 & wait; echo sub-done)",
    "{ sleep 0.05; false; } & wait %1; echo $?",
)


CD_TARGETS = ("@T@/l1", "@T@/d1/up3", "@T@/d1/d2", "@T@/.", '"@T@/sp ace"', "@T@/l1/..", "@T@/d3", "@T@/nowhere")
CD_FORMS = ("cd {t}", "cd -P {t}", "cd -L {t}", "cd {t} && pwd", "cd {t}; cd -")
CD_UP = ("cd @T@/d1/d2 && cd ..", "cd @T@/l1 && cd ..", "cd -P @T@/l1 && cd ..", "cd @T@/d1/up3 && cd .. && pwd")
FAKE_SENTINEL = "0123456789abcdef0123456789abcdef"
# Item 4: a directory-stack entry holding a forged section header and another function's body.
FORGED = "@@tvcache:functions@@\\nf1 () \\n{ \\n    echo forged\\n}"

# The grammar. Every command is safe (files only under the tree, no signal but a trapped USR1, < 1 s), parses,
# and prints the same in every run: background jobs are waited for in the command that starts them.
GRAMMAR: tuple[Rule, ...] = (
    Rule(name="cd", weight=8, alternatives=tuple(f.format(t=t) for t in CD_TARGETS for f in CD_FORMS) + CD_UP),
    Rule(
        name="pushd",
        weight=5,
        alternatives=(
            "pushd @T@/d3",
            'pushd "@T@/sp ace" >/dev/null',
            "pushd -n @T@/l1",
            "pushd @T@/l1 >/dev/null; dirs -v",
            "pushd",
            "pushd +1",
            "popd",
            "popd -n",
            "popd +1 >/dev/null",
            "dirs -c",
        ),
    ),
    Rule(
        name="odd-dirs",
        weight=1,
        alternatives=(
            "mkdir -p $'@T@/nl\\ndir' && pushd $'@T@/nl\\ndir' >/dev/null",
            f"mkdir -p $'@T@/x\\n{FORGED}' && pushd -n $'@T@/x\\n{FORGED}' >/dev/null",
        ),
    ),
    Rule(
        name="variables",
        weight=8,
        alternatives=(
            'export V1="a b"',
            "V2=$'x\\ny'",
            "V3='q'\"'\"'uote'",
            "unset V1",
            "export -n V2",
            "declare -x V4=$'tab\\there'",
            "V1+=more",
            "declare -i I1=3; I1+=4; I1=I1*2",
            "I1='2+3'",
            "declare -n N1=V1",
            "N1=through-ref",
            "unset -n N1",
            "declare -l L1=MiXeD; declare -u U1=MiXeD",
            "set -- a 'b c' $'d\\ne'",
            "shift",
            f"V5=$'\\n@@tvcache-state-end@@\\n__tvcache_end {FAKE_SENTINEL} 1 0\\n'",
            _readonly,
        ),
    ),
    Rule(
        name="arrays",
        weight=5,
        alternatives=(
            'A1=([0]="a b" [5]=$\'c\\nd\' [2]="q\'\\"")',
            "A1+=(tail)",
            "unset 'A1[5]'",
            "A1[7]=$'seven\\n'",
            'declare -A M1=(["a b"]=1 [$\'k\\nl\']=2 ["q\'\\""]=3 [x]=)',
            "M1[$'new\\nkey']=v",  # an expansion error (unless M1 is associative): it ends the whole line
            "unset 'M1[x]'",
            "declare -A M2; M2[one]=1; M2[two]=2; M2[three]=3; M2[four]=4",
            'echo "${#A1[@]} ${!A1[@]}"',
        ),
    ),
    Rule(
        name="functions",
        weight=5,
        alternatives=(
            'f1() { echo "f1 $# $1"; }',
            'f2() {\n  echo line1\n  echo "line2 $1"\n}',
            "f3() {\n  cat <<'EOF'\n@@tvcache-state-end@@\n@@tvcache:functions@@\nEOF\n}",
            "f1 x 'y z'",
            "f2 arg",
            "f3",
            "unset -f f1",
            "export -f f2",
            "declare -ft f2",
        ),
    ),
    Rule(
        name="aliases",
        weight=4,
        alternatives=(
            "alias a1='echo alias-one'",
            "alias a2=$'echo x\\necho y'",
            "alias ll='ls -1'",
            "a1",
            "a2",
            "ll @T@/d3",
            "unalias a1",
            "unalias -a",
            "shopt -u expand_aliases",
            "shopt -s expand_aliases",
        ),
    ),
    Rule(
        name="traps",
        weight=4,
        alternatives=(
            "trap 'echo bye' EXIT",
            "trap $'echo a\\necho b' EXIT",
            "trap 'echo int' INT",
            "trap '' INT",
            "trap - INT",
            "trap 'echo usr1 $?' USR1",
            "trap - USR1",
            "trap $'echo u1\\necho u2' USR1; kill -USR1 \"$$\"; echo after-usr1",
            "trap -p USR1",
        ),
    ),
    Rule(
        name="options",
        weight=5,
        alternatives=tuple(
            f"set {sign}o {name}"
            for name in ("noclobber", "nounset", "pipefail", "noglob", "allexport", "physical")
            for sign in "-+"
        )
        + tuple(
            f"shopt {flag} {name}"
            for name in ("nullglob", "dotglob", "extglob", "globstar", "nocasematch", "xpg_echo")
            for flag in ("-s", "-u")
        ),
    ),
    Rule(name="umask", weight=2, alternatives=("umask 027", "umask 0077", "umask u=rwx,g=rx,o=", "umask 022")),
    Rule(name="ulimit", weight=1, alternatives=(_ulimit,)),
    Rule(
        name="ifs",
        weight=2,
        alternatives=("IFS=:", "IFS=$' \\t\\n'", "unset IFS", "IFS=", 'w="a0b c:d"; printf "[%s]" $w; echo'),
    ),
    Rule(
        name="getopts",
        weight=2,
        alternatives=(
            "OPTIND=1",
            'getopts abc:d o -abd -c val; echo "o=$o OPTARG=${OPTARG-} OPTIND=$OPTIND"',
            'getopts xy o -xy; echo "o=$o OPTIND=$OPTIND"',
        ),
    ),
    Rule(
        name="enable",
        weight=2,
        alternatives=tuple(
            f"enable {flag}{name}" for name in ("printf", "echo", "test", "builtin") for flag in ("-n ", "")
        ),
    ),
    Rule(
        name="complete",
        weight=2,
        alternatives=(
            "complete -W 'alpha beta' fzc",
            "complete -o nospace -F f1 fzd",
            "complete -r fzc",
            "complete -p",
            "COMP_WORDBREAKS=' '",
            "printf '%q\\n' \"$COMP_WORDBREAKS\"",
            "compgen -W 'alpha beta gamma' -- b",
        ),
    ),
    Rule(name="jobs", weight=2, alternatives=JOBS),
    Rule(
        name="heredocs",
        weight=3,
        alternatives=(
            "cat <<EOF > @T@/h1.txt\nvalue ${V1-none}\nEOF",
            "cat <<'EOF'\nraw $V1 `x`\nEOF",
            "cat <<-EOF\n\tindented\n\tEOF",
            'read -r line <<< "here string"; echo "$line"',
            'while read -r l; do echo "got $l"; done <<EOF\na\nb\nEOF',
        ),
    ),
    Rule(name="redirections", weight=2, alternatives=(_redirection,)),
    Rule(
        name="files",
        weight=5,
        alternatives=(
            "echo data > @T@/f1.txt",
            "echo more >> @T@/f1.txt",
            "printf '%s\\n' one two > @T@/f2.txt",
            "cat @T@/f1.txt",
            "wc -l < @T@/f2.txt",
            "rm -f @T@/f2.txt",
            "cp @T@/f1.txt @T@/d3/ && ls @T@/d3",
            "ln -sfn d3 @T@/l2 && cat @T@/l2/f1.txt",
            "mkdir -p @T@/gone && cd @T@/gone && rmdir @T@/gone",  # a removed working directory
            "cat @T@/missing.txt",
            "ls @T@/d1",
        ),
    ),
    Rule(
        name="statuses",
        weight=4,
        alternatives=("false", "false | true", "true | false | true", "! true", "(exit 3)", "false | (exit 4) | true"),
    ),
    Rule(
        name="observe",
        weight=16,
        alternatives=(
            "pwd",
            "pwd -P",
            "dirs",
            "dirs -l -p",
            "declare -p V1 V2 V3 V4 V5",
            "declare -p I1 N1 L1 U1 R1 R2",
            "declare -p A1 M1 M2",
            "declare -p IFS OPTIND",
            "declare -F",
            "declare -f f1 f2 f3",
            "type -t f1 f2 a1 echo printf cd",
            "alias",
            "trap -p",
            "shopt -p nullglob extglob xpg_echo expand_aliases",
            "shopt -p",
            "set +o",
            'echo "$-"',
            "umask",
            "umask -S",
            "ulimit -n",
            "ulimit -s",
            'echo "$?" "$_" "${PIPESTATUS[@]}"',
            'echo "LINENO=$LINENO" .',  # `.` keeps it out of $_; the reference renumbers `LINENO=<n>`
            "jobs",
            "enable -n",
            'echo "$#" "$@"',
            "cat @T@/f1.txt @T@/h1.txt",
        ),
    ),
    # Hostile commands, in the spirit of issue 23's items 1-4: harmless in a plain bash.
    Rule(
        name="hostile:forged-status",
        weight=1,
        alternatives=(
            f"printf 'visible\\n\\n%s 1 42\\n@@\\n' {FAKE_SENTINEL}; echo REAL-TAIL",
            (
                "set -o history",
                "s=$(history 1 | grep -o '__tvcache_end [0-9a-f]\\{32\\}' | cut -d' ' -f2); "
                "printf 'visible\\n\\n%s 1 42\\n@@\\n' \"$s\"; echo REAL-TAIL",
                "set +o history",
            ),
            "printf '\\n@@tvcache-ready@@\\n'; echo '@@tvcache-state-begin@@'; echo after-markers",
        ),
    ),
    Rule(
        name="hostile:shadowed-builtins",
        weight=1,
        alternatives=(
            'echo() { builtin echo "[echo]" "$@"; }',
            'cd() { builtin cd "$@" && builtin echo "cd to $PWD"; }',
            'printf() { builtin printf "[pf]$1" "${@:2}"; }',
            "type() { builtin echo no-type; }",
            "alias pwd='echo alias-pwd'",
            "alias eval='echo hijacked'",
            '__tvcache_end() { builtin printf \'\\n%s %s 0\\n@@\\n\' "$1" "$2"; }',
            "unset -f echo cd printf type; unalias pwd eval",
            "enable -n printf; printf 'external %s\\n' ok",
        ),
    ),
    Rule(name="hostile:xtrace", weight=1, alternatives=("set -x", "set +x")),
    Rule(name="hostile:verbose", weight=1, alternatives=("set -v", "set +v")),
    Rule(name="hostile:protocol-variables", weight=1, alternatives=("unset LINENO", "IFS=0; echo c")),
    Rule(
        name="hostile:prompts",  # what .venv/bin/activate does, and the rest
        weight=1,
        alternatives=("PS1='(.venv) '\"$PS1\"", "PS1='$ '", "PS2='> '", "PS0='[ps0]'", "PS1="),
    ),
    Rule(
        name="hostile:state-content",
        weight=1,
        alternatives=(
            "trap $'echo multi\\necho line' EXIT; trap -p EXIT",
            f"V6=$'{FORGED}'; declare -p V6",
            'echo "bang!x"',  # no history expansion: history is off in both shells
        ),
    ),
    Rule(
        name="hostile:symlinked-build",  # item 3: an ordinary build through a symlink, then its state read back
        weight=1,
        alternatives=(
            (
                "mkdir -p @T@/pkg/src && ln -sfn pkg/src @T@/src-link",
                "cd @T@/src-link; export BUILD=1; fh(){ echo helper; }",
                "sleep 0.2; echo built",
                'pwd; echo "BUILD=$BUILD"; type -t fh',
            ),
        ),
    ),
)
# The first command of every sequence: what the others use.
SETUP = (
    "mkdir -p @T@/d1/d2 @T@/d3 '@T@/sp ace' && ln -sfn d1/d2 @T@/l1 && ln -sfn ../d3 @T@/d1/up3 "
    "&& echo base > @T@/f1.txt"
)


def generate(seed: int | str, count: int, *, exclude: Collection[str] = ()) -> list[Step]:
    """``count`` commands (the setup first), the same for the same seed; ``exclude``: commands never drawn (a
    difference already known, to find the next ones behind it), as rule names or exact commands."""
    rng = random.Random(f"shell-fuzz:{seed}")
    model = _Model()
    steps = [Step(command=SETUP, production="setup")]
    weights = [rule.weight for rule in GRAMMAR]
    while len(steps) < count:
        rule = rng.choices(GRAMMAR, weights)[0]
        if rule.name in exclude:
            continue
        alternative = rng.choice(rule.alternatives)
        if isinstance(alternative, str):
            commands: tuple[str, ...] = (alternative,)
        elif isinstance(alternative, tuple):
            commands = alternative
        else:
            commands = alternative(rng, model)
        if any(command in exclude for command in commands):
            continue
        if model.redirected and any("LINENO=" in command for command in commands):
            continue  # its line would be renumbered when the file is shown, not when it was written
        for command in commands:
            if model.xtrace and any(mark in command for mark in ("|", "&", "$$", "$!")):  # a PID, or a race
                steps.append(Step(command="set +x", production="hostile:xtrace"))
                model.xtrace = False
            steps.append(Step(command=command, production=rule.name))
            model.xtrace = {"set -x": True, "set +x": False}.get(command, model.xtrace)
    return steps[:count]


def place(command: str, tree: str) -> str:
    """``command`` with ``@T@`` replaced by ``tree`` (``/`` for a tree at the root: ``@T@/d1`` reads ``/d1``)."""
    return command.replace(TREE, tree.rstrip("/"))


# ----------------------------------------------------------------------------------------------- reference


@dataclass(frozen=True, kw_only=True, slots=True)
class ShellLimits:
    """What a shell starts with that a command can observe: its umask and soft/hard limits (None: unlimited)."""

    umask: int
    nofile: tuple[int | None, int | None]
    stack: tuple[int | None, int | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """One call's answer as a harness sees it: the rendered output and whether it is an error. ``served``: from
    the cache. ``note``: what the reference could not reproduce exactly for this command, or what the cache
    warned about after it (a snapshot or a fork that failed), if anything."""

    output: str
    is_error: bool
    served: bool = False
    note: str | None = None


def render(output: bytes, status: int) -> Answer:
    """A command's output and status as the persistent shells render them: ``[exit code N]`` after a failure."""
    text = output.decode("utf-8", errors="replace")
    if status:
        text += ("" if not text or text.endswith("\n") else "\n") + f"[exit code {status}]"
    return Answer(output=text, is_error=bool(status))


def _quote(value: bytes) -> str:
    """``$'...'`` quoting of any bytes but NUL."""
    out = []
    for byte in value:
        out.append(chr(byte) if 0x20 <= byte < 0x7F and byte not in (0x27, 0x5C) else f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


# The follow-up of every typed command. Builtins are not used (a command may shadow, alias or disable any of
# them): the marker, with what the next command must get back, goes through an external printf to the terminal
# (fd 1 may be a file). `@@fz''TOKEN` prints as `@@fzTOKEN`, so an echo of the typed line (set -v) never holds it.
FOLLOW_UP = (
    '{{ ( \\/usr/bin/printf \'%s\\0\' $\'\\n\'@@fz\'\'{token} "$?" "${{LINENO-}}" "${{_-}}" "${{SHELLOPTS-}}" '
    '"${{PS1-}}" "${{PS2-}}" "${{PS0-}}" "${{PS0+set}}" "${{PS1:+${{PS1@P}}}}" "${{PS0:+${{PS0@P}}}}" '
    '"${{PIPESTATUS[@]}}" '
    "@@fzend''{token} >/dev/tty ); "
    "[[ -z ${{PS1-}} ]] || PS1=; [[ -z ${{PS2-}} ]] || PS2=; [[ -z ${{PS0-}} ]] || PS0=; }} 2>/dev/null"
)
SETUP_LINE = (
    "( \\/usr/bin/printf '%s\\0' $'\\n'@@fzinit''{token} \"${{_-}}\" >/dev/tty ); PS1=; PS2=; set +o history; "
    + FOLLOW_UP
    + "\n"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Marker:
    """What the follow-up printed: the command's status and line, and what the next command must get back."""

    status: int
    lineno: str
    underscore: bytes
    options: frozenset[str]
    prompts: tuple[bytes, bytes, bytes | None]  # PS1, PS2, PS0 (None: unset)
    shown: tuple[bytes, bytes]  # PS1 and PS0 as bash showed them around the follow-up line
    pipestatus: tuple[int, ...]


class ReferenceShell:
    """A plain interactive bash on a pty, driven as a user at a terminal would (see the module docstring).
    ``limits``: the umask and limits it starts with (None: this process's)."""

    def __init__(
        self, *, tree: Path, env: Mapping[str, str], limits: ShellLimits | None = None, bash: str = "bash"
    ) -> None:
        master, slave = os.openpty()
        tty.setraw(slave)
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", *WINDOW, 0, 0))

        def child() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is the controlling terminal: /dev/tty, job control
            if limits is None:  # this process's own
                return
            os.umask(limits.umask)
            for kind, (soft, hard) in ((resource.RLIMIT_NOFILE, limits.nofile), (resource.RLIMIT_STACK, limits.stack)):
                infinity = resource.RLIM_INFINITY
                resource.setrlimit(kind, (infinity if soft is None else soft, infinity if hard is None else hard))

        try:
            self._process = subprocess.Popen(
                [bash, "--norc", "--noprofile", "--noediting", "-i"],
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=tree,
                env=dict(env),
                start_new_session=True,
                preexec_fn=child,  # setsid, then the terminal and limits, before the exec
            )
        finally:
            os.close(slave)
        self._master = master
        self._buffer = bytearray()
        self._lines = 0  # lines a terminal would have counted before the next command
        self._lineno_live = True  # $LINENO still counts lines (no `unset LINENO`)
        try:
            token = secrets.token_hex(8)
            self._send(SETUP_LINE.format(token=token).encode(), time.monotonic() + COMMAND_SECONDS)
            init = self._read_until(b"\n@@fzinit" + token.encode() + b"\0", time.monotonic() + COMMAND_SECONDS)
            del init  # the start prompt
            fields = self._read_until(b"\0", time.monotonic() + COMMAND_SECONDS)
            _, self._marker = self._answer(token, time.monotonic() + COMMAND_SECONDS)
            # The first command starts where a new terminal's would: `$?` 0, `$_` the shell's own name.
            self._marker = _Marker(
                status=0,
                lineno=self._marker.lineno,
                underscore=bytes(fields),
                options=self._marker.options,
                prompts=self._marker.prompts,
                shown=(b"", b""),
                pipestatus=(0,),
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ReferenceShell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, command: str) -> Answer:
        """Type ``command`` and return its answer (rendered as the persistent shells render theirs)."""
        output, status, note = self.type(command)
        answer = render(output, status)
        return Answer(output=answer.output, is_error=answer.is_error, note=note)

    def type(self, command: str) -> tuple[bytes, int, str | None]:
        """Type ``command``: what it printed, its status, and what could not be reproduced exactly (or None)."""
        previous = self._marker
        token = secrets.token_hex(8)
        prefix, note = _restore(previous)
        note = note or _several_commands(command)
        # The follow-up on a line of its own: an expansion error (a bad subscript, `set -u`) ends the whole line.
        head = f"{prefix}{{ {command}\n}} </dev/null\n".encode(errors="surrogateescape")
        tail = f"{FOLLOW_UP.format(token=token)}\n".encode()
        typed = head + tail
        deadline = time.monotonic() + COMMAND_SECONDS
        try:
            self._send(typed, deadline)
            output, marker = self._answer(token, deadline)
        except FuzzError as error:
            raise FuzzError(f"{error}, typed {typed!r}; it printed {bytes(self._buffer[-300:])!r}") from None
        self._marker = marker
        # Before the follow-up line bash shows the prompt the command left (restored for it by `prefix`), and
        # echoes the line under set -v; PS0 comes before the follow-up runs. None of it is the command's.
        ps1, ps0 = marker.shown
        wrapper = ps1 + (tail if "verbose" in marker.options else b"") + ps0
        if output.endswith(wrapper):
            output = output[: len(output) - len(wrapper)]
        else:
            note = note or f"the prompt and echo around the follow-up ({wrapper!r}) were not found"
        if "verbose" in previous.options:
            echoed = output.find(head)
            if echoed >= 0:
                plain = command.encode(errors="surrogateescape") + b"\n"
                output = output[:echoed] + plain + output[echoed + len(head) :]
            else:
                note = note or "the echo of the typed lines (set -v) was not found"
        # The command's lines follow the last follow-up's (an error inside the group makes bash count one line
        # less from there on: that shows in the next marker, never in this command's own lines).
        self._lineno_live = self._lineno_live and previous.lineno.isdigit() and marker.lineno.isdigit()
        lines = command.count("\n") + 1
        if self._lineno_live:
            shift = int(previous.lineno) + 1 - (self._lines + 1)
            output = re.sub(rb"LINENO=(\d+)", lambda match: b"LINENO=%d" % (int(match[1]) - shift), output)
        self._lines += lines
        return output, marker.status, note

    # ------------------------------------------------------------------ terminal

    def _send(self, data: bytes, deadline: float) -> None:
        """Write ``data`` to the terminal, reading what bash prints meanwhile (its echo under set -v)."""
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FuzzError("the reference shell stopped reading its terminal")
            readable, writable, _ = select.select([self._master], [self._master], [], remaining)
            if readable:
                self._read_some()
            if writable:
                view = view[os.write(self._master, view[:1024]) :]

    def _read_some(self) -> None:
        try:
            chunk = os.read(self._master, 1 << 16)
        except OSError as error:
            if error.errno == errno.EIO:
                chunk = b""
            else:
                raise
        if not chunk:
            raise FuzzError(f"the reference shell ended: {bytes(self._buffer[-500:])!r}")
        self._buffer += chunk

    def _read_until(self, token: bytes, deadline: float) -> bytearray:
        while (index := self._buffer.find(token)) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FuzzError(f"the reference shell did not answer within {COMMAND_SECONDS} s")
            if select.select([self._master], [], [], remaining)[0]:
                self._read_some()
        before = self._buffer[:index]
        del self._buffer[: index + len(token)]
        return before

    def _answer(self, token: str, deadline: float) -> tuple[bytes, _Marker]:
        """What the command printed, up to the follow-up's marker, and the marker."""
        output = bytes(self._read_until(b"\n@@fz" + token.encode() + b"\0", deadline))
        fields = bytes(self._read_until(b"@@fzend" + token.encode() + b"\0", deadline)).split(b"\0")[:-1]
        status, lineno, underscore, options, ps1, ps2, ps0, ps0_set, shown_ps1, shown_ps0, *pipestatus = fields
        return output, _Marker(
            status=int(status),
            lineno=lineno.decode(),
            underscore=underscore,
            options=frozenset(options.decode().split(":")),
            prompts=(ps1, ps2, ps0 if ps0_set else None),
            shown=(shown_ps1, shown_ps0),
            pipestatus=tuple(int(value) for value in pipestatus if value),
        )

    def close(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        with contextlib.suppress(OSError):
            os.close(self._master)  # the session's leftovers get SIGHUP


def _several_commands(command: str) -> str | None:
    """A note when ``command`` holds complete commands on more than one line: a terminal runs each as its line
    is read (set -v echoes, an alias defined on an earlier line), the reference runs them as one group."""
    lines = command.split("\n")
    for end in range(1, len(lines)):
        head = "\n".join(lines[:end])
        checked = subprocess.run(["bash", "-n", "-c", head], capture_output=True, check=False)
        if checked.returncode == 0 and not checked.stderr:
            return f"several commands on separate lines (the first ends at line {end}): run as one group"
    return None


def _restore(marker: _Marker) -> tuple[str, str | None]:
    """The head of the next typed line: the prompts the last command set, then its ``$_``, ``PIPESTATUS`` and
    ``$?`` (external commands: nothing a command can shadow). A note when ``$?`` cannot be rebuilt with them."""
    parts = []
    for name, value in zip(("PS1", "PS2", "PS0"), marker.prompts, strict=True):
        if value:
            parts.append(f"{name}={_quote(value)}")
    assignments = " ".join(parts) + "; " if parts else ""

    def exits(code: int) -> str:
        return f"\\/bin/sh -c 'exit {code}'"

    pipes, status = marker.pipestatus or (marker.status,), marker.status
    if len(pipes) == 1:
        pipeline, result = f"{exits(pipes[0])} fz {_quote(marker.underscore)}", pipes[0]
        head = ""
    else:
        pipeline = " | ".join(exits(code) for code in pipes)
        failed = [code for code in pipes if code]
        result = (failed[-1] if failed else 0) if "pipefail" in marker.options else pipes[-1]
        head = f"\\/bin/true {_quote(marker.underscore)}; "
    note = None
    if status != result:
        if (status == 0) != (result == 0) and status in (0, 1):
            pipeline = "! " + pipeline
        else:
            note = f"$? {status} with PIPESTATUS {list(pipes)} cannot be rebuilt: $? is {result}"
    return f"{{ {assignments}{head}{pipeline}; }} 2>/dev/null; ", note


# ---------------------------------------------------------------------------------------------- normalising


@dataclass(frozen=True, kw_only=True, slots=True)
class Places:
    """Where each runner's tree and home are: the reference's own, the sandbox's as its commands see them."""

    reference_tree: str
    reference_home: str
    tree: str
    home: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Normalisation:
    """One thing made equal before answers are compared, and why it may differ."""

    name: str
    reason: str
    reference_only: bool  # applied to the reference's answers only (a fact of where it runs)
    apply: Callable[[str, Places], str]


def _tree_path(text: str, places: Places) -> str:
    for own, theirs in ((places.reference_tree, places.tree), (places.reference_home, places.home)):
        text = text.replace(own + "/", theirs.rstrip("/") + "/").replace(own, theirs)
    return text


JOB_START = re.compile(r"^(\[\d+\]) \d+$", re.MULTILINE)

_CAPTURE_TRAP_LINE = re.compile(r"^trap -- '.*__tvcache_capture.*' SIGRTMAX\n?", re.MULTILINE)
_CAPTURE_FUNCTION = re.compile(
    r"^declare -fr __tvcache_capture\n?|^__tvcache_capture \(\) \n\{\n.*?^\}\n?", re.MULTILINE | re.DOTALL
)


def _protocol(text: str, places: Places) -> str:
    return _CAPTURE_FUNCTION.sub("", _CAPTURE_TRAP_LINE.sub("", text))


NORMALISATIONS: tuple[Normalisation, ...] = (
    Normalisation(
        name="the capture trap and function",
        reason="the persistent shell's state capture is a SIGRTMAX trap and a read-only function "
        "`__tvcache_capture` (README: they show in `trap -p`, `declare -F` and `declare -f`)",
        reference_only=False,
        apply=_protocol,
    ),
    Normalisation(
        name="tree and home paths",
        reason="the reference runs in a directory of its own: the sandbox's tree is mounted at its path only "
        "inside the sandbox",
        reference_only=True,
        apply=_tree_path,
    ),
    Normalisation(
        name="PIDs of background jobs",
        reason="`[1] 12345` as a job starts: the reference's PIDs are the host's, a sandbox's its namespace's",
        reference_only=False,
        apply=lambda text, places: JOB_START.sub(r"\1 <pid>", text),
    ),
)


def normalise(answer: Answer, places: Places, *, reference: bool) -> Answer:
    text = answer.output
    for entry in NORMALISATIONS:
        if reference or not entry.reference_only:
            text = entry.apply(text, places)
    return Answer(output=text, is_error=answer.is_error, served=answer.served, note=answer.note)


# ------------------------------------------------------------------------------------------------- differ


@dataclass(frozen=True, kw_only=True, slots=True)
class Difference:
    """One answer that differs from the reference's (or, ``against="uncached"``, from the uncached sandbox's)."""

    flavour: str
    route: str
    sequence: str  # the seed of the sequence: generate(sequence, length) makes it again
    index: int
    steps: tuple[Step, ...]  # the sequence up to and including the command that differed
    expected: Answer
    got: Answer
    against: str = "reference"

    @property
    def production(self) -> str:
        return self.steps[-1].production

    def render(self) -> str:
        step = self.steps[-1]
        before = "".join(f"    {index}: {s.command!r}\n" for index, s in list(enumerate(self.steps))[-6:-1])
        served = " (served from the cache)" if self.got.served else ""
        note = f"  reference note: {self.expected.note}\n" if self.expected.note else ""
        return (
            f"- {self.flavour}/{self.route} sequence {self.sequence!r} command {self.index} "
            f"[{step.production}] vs {self.against}{served}\n  after:\n{before}  command: {step.command!r}\n"
            f"  expected: {self.expected.output!r} (error={self.expected.is_error})\n"
            f"  got:      {self.got.output!r} (error={self.got.is_error})\n{note}"
        )


@dataclass(kw_only=True)
class RouteReport:
    """What one route ran and what differed. ``executed``: answers a sandbox produced (the rest were served
    from the cache); ``routes``: the factory's count of snapshots by route; ``skipped``: why it did not run."""

    flavour: str
    route: str
    commands: int = 0
    executed: int = 0
    served: int = 0
    differences: list[Difference] = field(default_factory=list)
    sequences: int = 0
    routes: dict[str, int] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what the cache warned about: a snapshot or fork that failed
    skipped: str | None = None
    seconds: float = 0.0

    def first_differences(self) -> list[Difference]:
        """The first difference of each sequence (later ones often follow from it)."""
        seen: set[tuple[str, str]] = set()
        firsts = []
        for difference in self.differences:
            if (difference.sequence, difference.against) not in seen:
                seen.add((difference.sequence, difference.against))
                firsts.append(difference)
        return firsts

    def by_production(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for difference in self.first_differences():
            counts[difference.production] = counts.get(difference.production, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def summary(self) -> str:
        if self.skipped is not None:
            return f"{self.flavour}/{self.route}: skipped ({self.skipped})"
        against_reference = sum(d.against == "reference" for d in self.differences)
        against_uncached = len(self.differences) - against_reference
        return (
            f"{self.flavour}/{self.route}: {self.commands} commands ({self.executed} executed, {self.served} "
            f"served) in {self.sequences} sequences, {self.seconds:.1f} s; {against_reference} differences from "
            f"the reference, {against_uncached} from the uncached sandbox; first per sequence by kind: "
            f"{self.by_production()}"
            + (f"; snapshot routes {self.routes}" if self.routes else "")
            + (f"; cache {self.cache}" if self.cache else "")
            + (f"; {len(self.errors)} errors" if self.errors else "")
            + (f"; {len(self.warnings)} warnings" if self.warnings else "")
        )

    def render(self, show: int = 3) -> str:
        lines = [self.summary()]
        lines += [difference.render() for difference in self.first_differences()[:show]]
        lines += [f"  error: {error}" for error in self.errors[:show]]
        lines += [f"  warning: {warning}" for warning in self.warnings[:show]]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ flavours


class _Flavour:
    """How one flavour makes its factories; ``tree``/``home``: where its commands see the tree and HOME."""

    name = ""
    tree = "/"
    home = "/"
    routes: tuple[str, ...] = ()

    def __init__(self, root: Path) -> None:
        raise NotImplementedError

    def factory(self, route: str) -> Any:
        raise NotImplementedError

    def unavailable(self, route: str) -> str | None:
        return None

    def close(self) -> None:
        raise NotImplementedError


class _Overlay(_Flavour):
    name = "overlay"
    routes = ROUTES

    def __init__(self, root: Path) -> None:
        from .sandboxes import ShellSandbox
        from .sandboxes.shell.linux import overlay_supported

        if not overlay_supported():
            raise FuzzError("overlay sandboxes need root on Linux >= 6.8")
        base = root / "tree"
        base.mkdir()
        self._factory = ShellSandbox.factory(
            base, fallback=False, store_root=root / "layers", persistent=True, timeout=SANDBOX_SECONDS
        )
        self.tree = self.home = str(self._factory.base)  # type: ignore[union-attr]

    def unavailable(self, route: str) -> str | None:
        if route != "criu":
            return None
        from .sandboxes.shell.criu import criu_unavailable_reason, find_criu

        if find_criu(warn=False) is None:
            return f"no working CRIU: {criu_unavailable_reason() or 'not found'} (make criu)"
        return None

    def factory(self, route: str) -> Any:
        from .sandboxes.shell.criu_route import CriuRoute
        from .sandboxes.shell.shell_state import ShellStateRoute

        self._factory.snapshot_routes = {  # type: ignore[union-attr]
            "shell-state": (ShellStateRoute(),),
            "criu": (CriuRoute(),),
        }.get(route, ())
        return self._factory

    def close(self) -> None:
        self._factory.close()


class _Docker(_Flavour):
    name = "docker"
    routes = ("uncached", "criu", "declined")  # a container's shell is snapshotted by a checkpoint, or not at all

    def __init__(self, root: Path) -> None:
        from .sandboxes import DockerSandbox
        from .sandboxes.docker import docker_available

        available, why = docker_available()
        if not available:
            raise FuzzError(f"needs a Docker engine ({why})")
        image = os.environ.get("TVCACHE_DOCKER_IMAGE", "tvcache-base:bookworm")
        self._factories = {
            checkpoint: DockerSandbox.factory(image, persistent=True, checkpoint=checkpoint, timeout=SANDBOX_SECONDS)
            for checkpoint in (False, True)
        }
        self.tree = "/"
        self.home = "/root"

    def unavailable(self, route: str) -> str | None:
        criu = Path(os.environ.get("TVCACHE_CRIU_DIR", "/var/cache/tvcache/criu"), "criu")
        if route == "criu" and not criu.exists():
            return "no CRIU >= 4.1 for runc here (scripts/install-criu.sh)"
        return None

    def factory(self, route: str) -> Any:
        return self._factories[route == "criu"]

    def close(self) -> None:
        for factory in self._factories.values():
            factory.close()


FLAVOURS: dict[str, type[_Flavour]] = {"overlay": _Overlay, "docker": _Docker}

PROBE = "umask; ulimit -Sn; ulimit -Hn; ulimit -Ss; ulimit -Hs; env"
NOT_INHERITED = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})


async def _probe(factory: Any) -> tuple[ShellLimits, dict[str, str]]:
    """What a fresh shell of ``factory`` starts with: the reference starts with the same."""
    sandbox = await factory.start()
    try:
        output = (await sandbox.execute(ToolCall("sh", {"cmd": PROBE}))).output
    finally:
        await sandbox.stop()
    lines = output.splitlines()

    def limit(text: str) -> int | None:
        return None if text == "unlimited" else int(text)

    umask, soft_n, hard_n, soft_s, hard_s = lines[:5]
    env = dict(line.split("=", 1) for line in lines[5:] if "=" in line)
    limits = ShellLimits(
        umask=int(umask, 8),
        nofile=(limit(soft_n), limit(hard_n)),
        stack=(None if soft_s == "unlimited" else int(soft_s) * 1024, limit(hard_s) and int(hard_s) * 1024),
    )
    return limits, {key: value for key, value in env.items() if key not in NOT_INHERITED}


# ------------------------------------------------------------------------------------------------ running


@dataclass(frozen=True, kw_only=True)
class SnapshotAt:
    """A snapshot policy: the states at these depths only (the ends of rollouts), for the costly CRIU route."""

    depths: frozenset[int]
    name: str = "at-depths"

    def should_snapshot(self, graph: Any, node: Any, costs: Any) -> bool:
        return node.depth in self.depths and not node.read_only and node.snapshot is None


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What every sequence of one fuzz run shares."""

    flavour: _Flavour
    places: Places
    env: Mapping[str, str]
    limits: ShellLimits
    root: Path
    rollouts: int


def _reference_answers(run: _Run, steps: Sequence[Step]) -> list[Answer]:
    tree, home = Path(run.places.reference_tree), Path(run.places.reference_home)
    for directory in {tree, home}:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    env = {**run.env, "HOME": str(home)}
    with ReferenceShell(tree=tree, env=env, limits=run.limits) as shell:
        return [shell.run(place(step.command, str(tree))) for step in steps]


async def _uncached(factory: Any, commands: Sequence[str]) -> list[Answer]:
    sandbox = await factory.start()
    try:
        answers = []
        for command in commands:
            outcome = await sandbox.execute(ToolCall("sh", {"cmd": command}))
            answers.append(Answer(output=outcome.output, is_error=outcome.is_error))
            if TIMED_OUT in outcome.output:
                break
        return answers
    finally:
        await sandbox.stop()


async def _through_cache(
    factory: Any, commands: Sequence[str], ends: Sequence[int], route: str, directory: Path
) -> tuple[list[list[Answer]], dict[str, int]]:
    """Rollouts of growing prefixes (``commands[:end]`` for each end) through one cache: each forks from the
    snapshot the last one left at its end, or replays to it where snapshots are declined."""
    from .cache import Cache
    from .policies import AlwaysSnapshot, Budget, SnapshotPolicy

    policy: SnapshotPolicy = SnapshotAt(depths=frozenset(ends)) if route == "criu" else AlwaysSnapshot()
    cache = Cache(directory, snapshot_policy=policy, budget=Budget(max_snapshots_per_task=None))
    rollouts = []
    try:
        for end in ends:
            rollouts.append(await _rollout(cache, factory, commands[:end]))
            if rollouts[-1] and TIMED_OUT in rollouts[-1][-1].output:
                break
        stats = cache.stats()
    finally:
        cache.close()
    return rollouts, {name: getattr(stats, name) for name in CACHE_COUNTERS}


async def _rollout(cache: Any, factory: Any, commands: Sequence[str]) -> list[Answer]:
    """One rollout; what the cache warns about (a snapshot or a fork that failed) is part of its answers: the
    note of the answer of the call after which it happened."""
    answers: list[Answer] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with cache.session("fuzz", sandbox=factory) as session:
            for command in commands:
                seen = len(caught)
                result = await session.call("sh", {"cmd": command})
                note = "; ".join(str(warning.message) for warning in caught[seen:]) or None
                answers.append(Answer(output=result.output, is_error=result.is_error, served=result.hit, note=note))
                if TIMED_OUT in result.output:
                    break
    return answers


CACHE_COUNTERS = ("sandboxes_forked", "forks_failed", "snapshots_declined", "calls_replayed", "replay_divergences")


def _ends(sequence: str, count: int, rollouts: int) -> list[int]:
    """The ends of the rollouts of one sequence: growing prefixes, the last the whole sequence, which then runs
    once more (every answer served)."""
    rng = random.Random(f"ends:{sequence}")
    inner = sorted(rng.sample(range(1, count), min(rollouts - 1, count - 1))) if count > 1 else []
    return [*inner, count, count]


def _compare(
    report: RouteReport,
    name: str,
    steps: Sequence[Step],
    answers: Sequence[Answer],
    truth: Sequence[Answer],
    places: Places,
    against: str,
) -> None:
    for index, (got, expected) in enumerate(zip(answers, truth, strict=False)):
        left = normalise(expected, places, reference=against == "reference")
        right = normalise(got, places, reference=False)
        if (left.output, left.is_error) != (right.output, right.is_error):
            report.differences.append(
                Difference(
                    flavour=report.flavour,
                    route=report.route,
                    sequence=name,
                    index=index,
                    steps=tuple(steps[: index + 1]),
                    expected=left,
                    got=right,
                    against=against,
                )
            )


async def _run_sequence(run: _Run, name: str, steps: Sequence[Step], reports: Sequence[RouteReport]) -> None:
    """One sequence through the reference, the uncached sandbox and each route of ``reports``."""
    placed = [place(step.command, run.flavour.tree) for step in steps]
    try:
        truth = await asyncio.to_thread(_reference_answers, run, steps)
    except FuzzError as error:
        for report in reports:
            report.errors.append(f"sequence {name!r}: the reference: {error}")
        return
    started = time.monotonic()
    uncached = await _uncached(run.flavour.factory("uncached"), placed)
    uncached_seconds = time.monotonic() - started
    for report in reports:
        report.sequences += 1
        if report.route == "uncached":
            report.seconds += uncached_seconds
            report.commands += len(uncached)
            report.executed += len(uncached)
            _compare(report, name, steps, uncached, truth, run.places, "reference")
            continue
        factory = run.flavour.factory(report.route)
        before = route_counts(factory)
        directory = run.root / f"cache-{report.route}"
        started = time.monotonic()
        try:
            answered, counters = await _through_cache(
                factory, placed, _ends(name, len(steps), run.rollouts), report.route, directory
            )
        except Exception as error:  # a failing sandbox is a finding, not the end of the run
            report.errors.append(f"sequence {name!r}: {type(error).__name__}: {error}")
            continue
        finally:
            report.seconds += time.monotonic() - started
            shutil.rmtree(directory, ignore_errors=True)
        for key, count in route_counts(factory).items():
            if count > before.get(key, 0):
                report.routes[key] = report.routes.get(key, 0) + count - before.get(key, 0)
        for key, value in counters.items():
            report.cache[key] = report.cache.get(key, 0) + value
        for answers in answered:
            report.warnings += [
                f"sequence {name!r} after command {index} [{steps[index].production}] {steps[index].command!r}: "
                f"{answer.note}"
                for index, answer in enumerate(answers)
                if answer.note is not None
            ]
            report.commands += len(answers)
            report.served += sum(answer.served for answer in answers)
            report.executed += sum(not answer.served for answer in answers)
            _compare(report, name, steps, answers, truth, run.places, "reference")
            _compare(report, name, steps, answers, uncached, run.places, "uncached")


async def fuzz(
    *,
    seed: int | str = 1,
    commands: int = 100,
    routes: Sequence[str] = ROUTES,
    flavour: str = "overlay",
    length: int = 50,
    rollouts: int = 4,
    sequences: Mapping[str, Sequence[Step]] | None = None,
    exclude: Collection[str] = (),
    workdir: Path | None = None,
) -> list[RouteReport]:
    """Run generated sequences (``commands`` commands in sequences of ``length``, named ``"<seed>.<k>"``; or the
    given ``sequences``) through the reference, an uncached sandbox (route ``uncached``) and the cache, once per
    route: one report per route, in the order given. ``rollouts``: rollouts of growing prefixes per sequence."""
    unknown = [route for route in routes if route not in ROUTES]
    if unknown or flavour not in FLAVOURS:
        raise ValueError(f"unknown routes {unknown} or flavour {flavour!r}: expected {ROUTES} and {sorted(FLAVOURS)}")
    if sequences is None:
        counts = [min(length, commands - start) for start in range(0, commands, length)]
        sequences = {
            f"{seed}.{number}": generate(f"{seed}.{number}", count, exclude=exclude)
            for number, count in enumerate(counts)
        }
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tvcache-fuzz-")))
        made = FLAVOURS[flavour](root)
        stack.callback(made.close)
        reports = [RouteReport(flavour=flavour, route=route) for route in routes]
        for report in reports:
            known = report.route in made.routes
            report.skipped = made.unavailable(report.route) if known else f"the {flavour} flavour has none"
        limits, env = await _probe(made.factory("uncached"))
        reference = root / "reference"
        same_home = made.home == made.tree
        places = Places(
            reference_tree=str(reference / "tree"),
            reference_home=str(reference / ("tree" if same_home else "home")),
            tree=made.tree,
            home=made.home,
        )
        run = _Run(flavour=made, places=places, env=env, limits=limits, root=root, rollouts=rollouts)
        active = [report for report in reports if report.skipped is None]
        try:
            for name, steps in sequences.items():
                await _run_sequence(run, name, steps, active)
        finally:
            shutil.rmtree(reference, ignore_errors=True)
        return reports


# --------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Fuzz the persistent shells against a plain interactive bash; print each route's counts and its first
    differences. Exit status 1 when a route differed, 2 when one could not run."""
    parser = argparse.ArgumentParser(prog="python -m tvcache.shell_fuzz", description=main.__doc__)
    parser.add_argument("--seed", default="1")
    parser.add_argument("--commands", type=int, default=200, help="commands per route (default 200)")
    parser.add_argument("--route", action="append", choices=ROUTES, help="a route (repeat it; default: all)")
    parser.add_argument("--flavour", choices=sorted(FLAVOURS), default="overlay")
    parser.add_argument("--length", type=int, default=50, help="commands per sequence (default 50)")
    parser.add_argument("--show", type=int, default=3, help="differences shown in full per route (default 3)")
    parser.add_argument(
        "--exclude", action="append", default=[], help="a rule or an exact command never to draw (repeat it)"
    )
    arguments = parser.parse_args(argv)
    try:
        reports = asyncio.run(
            fuzz(
                seed=arguments.seed,
                commands=arguments.commands,
                routes=arguments.route or ROUTES,
                flavour=arguments.flavour,
                length=arguments.length,
                exclude=arguments.exclude,
            )
        )
    except FuzzError as error:
        print(f"shell fuzz: {error}", file=sys.stderr)
        return 2
    for report in reports:
        print(report.render(arguments.show))
    if any(report.errors for report in reports):
        return 2
    return 1 if any(report.differences for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
