"""The terminal workload: tasks driven through one persistent shell per rollout, as terminal harnesses do.

Terminus (tmux), SWE-ReX and OpenHands keep one shell per rollout, so ``cd``, ``export``, an activated venv, shell
functions and aliases carry over to every later call. Each task here needs that state to be solved: patch a file
only after ``cd`` into its package, ``export`` a setting that a later ``make`` reads (a plain assignment is not
seen by make, and a stale build must be cleaned), or activate the project's venv so that the build finds
``python``, with helper functions and aliases defined in one call and used in the next. The reward is the
project's own tests, run in the rollout's final shell (its directory, variables and PATH included).

The sandboxes are ``ShellSandbox.factory(..., persistent=True)``; snapshots carry the shell's state by the
cheapest route (counted in the workload's notes). No call can be proved read-only in a live shell (each moves
``$LINENO``), so rollouts share a state only while they share a whole prefix of calls. The builds use make, awk
and Python rather than a compiler, so the workload stays quick: its calls take a few milliseconds, about what
re-creating a shell's state costs, so this workload shows exactness and hit rates more than saved tool time
(the shell workload's compiler calls show that).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..errors import SandboxError
from ..protocol import close_factory, route_counts
from ..sandboxes import ShellSandbox
from ..sandboxes.commands import FIXED_PATH, fixed_environment
from .base import Action, Task, Workload

__all__ = ["TASKS", "terminal_workload"]

STATS_MAKEFILE = """all: build/stats.awk
build/stats.awk: mean.awk
\tmkdir -p build
\tcat mean.awk > build/stats.awk
check: build/stats.awk
\tsh test.sh
clean:
\trm -rf build
"""
STATS_TEST = """failures=0
t() {
  got=$(printf '%s\\n' $2 | awk -f build/stats.awk 2>&1)
  [ "$got" = "$1" ] || { echo "FAIL mean($2) = $got, want $1"; failures=$((failures + 1)); }
}
t 3 "2 4"
t 5 "5"
t 2 "1 2 3"
echo "$failures failures"
[ "$failures" -eq 0 ]
"""
REPORT_MAKEFILE = """PRECISION ?= 0
all: build/report.txt
build/report.txt: data.txt report.awk
\tmkdir -p build
\tawk -v p=$(PRECISION) -f report.awk data.txt > build/report.txt
check: build/report.txt
\tsh test.sh
clean:
\trm -rf build
"""
REPORT_TEST = """got=$(cat build/report.txt)
if [ "$got" = "total 4.25" ]; then echo "0 failures"; else echo "FAIL report: $got"; echo "1 failures"; exit 1; fi
"""
TABLE_MAKEFILE = """.DELETE_ON_ERROR:
all: build/table.txt
build/table.txt: gen.py
\tmkdir -p build
\tpython gen.py > build/table.txt
check: build/table.txt
\tsh test.sh
clean:
\trm -rf build
"""
TABLE_TEST = """want='1 1
2 4
3 9
4 16
5 25'
if [ "$(cat build/table.txt)" = "$want" ]; then echo "0 failures"; else echo "1 failures"; exit 1; fi
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _subdir_repo(path: Path) -> None:
    _write(
        path,
        {
            "README.md": "Packages live in packages/; build and test one from its own directory: make check\n",
            "packages/stats/mean.awk": "{ sum += $1 } END { print sum / (NR + 1) }\n",
            "packages/stats/Makefile": STATS_MAKEFILE,
            "packages/stats/test.sh": STATS_TEST,
            "packages/units/README.md": "Unit conversions (not built yet).\n",
        },
    )


def _flags_repo(path: Path) -> None:
    _write(
        path,
        {
            "README.md": "The release report is built with PRECISION=2 in the environment: make check\n",
            "data.txt": "1.25\n2.5\n0.5\n",
            "report.awk": '{ s += $1 } END { fmt = "total %." p "f\\n"; printf fmt, s }\n',
            "Makefile": REPORT_MAKEFILE,
            "test.sh": REPORT_TEST,
        },
    )


def _venv_repo(path: Path) -> None:
    _write(
        path,
        {
            "README.md": "The build runs gen.py with the project's venv (.venv) active: make check\n",
            "gen.py": "for i in range(1, 5):\n    print(i, i * i)\n",
            "Makefile": TABLE_MAKEFILE,
            "test.sh": TABLE_TEST,
        },
    )
    # The venv's python is the sandbox's own (on the fixed PATH, which has no bare `python`): only an activated
    # venv puts `python` on PATH, as in a real project. --without-pip keeps it to a few files, made in ~50 ms.
    python = shutil.which("python3", path=FIXED_PATH) or "python3"  # checked by unavailable_reason()
    subprocess.run([python, "-m", "venv", "--without-pip", str(path / ".venv")], check=True, capture_output=True)


def _sh(command: str, *, terminal: bool = False) -> Action:
    return Action(name="sh", arguments={"cmd": command}, terminal=terminal)


SUBMIT = _sh("echo submitted", terminal=True)
# id -> (prompt, repository builder, actions, check run in the final shell). The checks name the package by its
# absolute path only where the task is about the working directory; the others run where the shell is.
TASKS: dict[str, tuple[str, Callable[[Path], None], tuple[Action, ...], str]] = {
    "cd-fix-mean": (
        "packages/stats fails its tests: fix mean() in its directory, then submit.",
        _subdir_repo,
        (
            _sh("ls"),
            _sh("cd packages/stats"),
            _sh("cat mean.awk"),
            _sh("sed -i 's|NR + 1|NR|' mean.awk 2>&1"),
            _sh("sed -i 's|sum / (NR + 1)|sum / NR + 1|' mean.awk 2>&1"),
            _sh("make check 2>&1"),
            SUBMIT,
        ),
        "make -s -C {root}/packages/stats check 2>&1 | tail -n 1",
    ),
    "venv-codegen": (
        "The generated table misses a row: fix gen.py, build with the project's venv, then submit.",
        _venv_repo,
        (
            _sh("source .venv/bin/activate"),
            _sh("deactivate"),
            _sh("sed -i 's/range(1, 5)/range(1, 6)/' gen.py"),
            _sh("sed -i 's/i \\* i/i + i/' gen.py"),
            _sh('mk() { make -s "$@" 2>&1; }'),
            _sh("mk check"),
            _sh("alias t='make -s check 2>&1 | tail -n 1'"),
            _sh("t"),
            SUBMIT,
        ),
        "make -s check 2>&1 | tail -n 1",
    ),
    "export-precision": (
        "Build the release report (see README.md) so that its test passes, then submit.",
        _flags_repo,
        (
            _sh("export PRECISION=2"),
            _sh("PRECISION=2"),  # a shell variable only: make never sees it
            _sh("export PRECISION=1"),
            _sh("make 2>&1"),
            _sh("make clean"),
            _sh("make check 2>&1"),
            SUBMIT,
        ),
        "make -s check 2>&1 | tail -n 1",
    ),
}


def _tests_pass(output: str | None) -> float:
    return 1.0 if output is not None and output.strip() == "0 failures" else 0.0


def unavailable_reason() -> str | None:
    """Why the workload cannot run here (persistent shells have no copying fallback), or None."""
    from ..sandboxes.shell.linux import overlay_supported

    if not overlay_supported():
        return "persistent shell sandboxes need overlay mounts (root on Linux >= 6.8)"
    if shutil.which("python3", path=FIXED_PATH) is None:
        return f"its venv task needs python3 in {FIXED_PATH}"
    return None


def terminal_workload(data_dir: Path) -> Workload:
    reason = unavailable_reason()
    if reason is not None:
        raise SandboxError(f"the terminal workload cannot run here: {reason}")
    tasks = []
    for task_id, (prompt, build, actions, check) in TASKS.items():
        root = (data_dir / f"terminal-{task_id}").resolve()
        if not root.exists():
            build(root)
        # As a terminal harness would: no pager waits for a person, and an activated venv does not prefix the
        # prompt (the prompt is not part of a command's output; keep it from the outputs the demo compares).
        environment = fixed_environment(str(root)) | {
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "VIRTUAL_ENV_DISABLE_PROMPT": "1",
        }
        factory = ShellSandbox.factory(root, timeout=60, persistent=True, environment=environment, fallback=False)
        tasks.append(
            Task(
                id=task_id,
                prompt=prompt,
                actions=actions,
                reward=_tests_pass,
                factory=factory,
                check=_sh(check.format(root=root)).call,
                horizon=5,
            )
        )
    notes: list[str] = []

    def close() -> None:
        routes: Counter[str] = Counter()
        for task in tasks:
            routes.update(route_counts(task.factory))
            close_factory(task.factory)
        if routes:
            counted = ", ".join(f"{route} {count}" for route, count in sorted(routes.items()))
            notes.append(f"one persistent shell per rollout; snapshots of live shells by route: {counted}")

    return Workload(
        name="terminal",
        tasks=tasks,
        description="one persistent shell per rollout: cd into a package, export settings, activate a venv, "
        "define helpers, then build and test",
        notes=notes,
        close=close,
    )
