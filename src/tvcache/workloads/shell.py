"""The shell workload: repair tasks on a small real C project in shell sandboxes.

Each task is one bug in the project's library. The policy inspects the code, builds it, applies patches (one
right, others wrong), rebuilds and submits; the reward is whether the project's own tests pass afterwards,
checked by really building and running them (``make check``) in the rollout's final state.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..protocol import close_factory
from ..sandboxes import ShellSandbox
from .base import Action, Task, Workload

__all__ = ["make_project", "shell_workload"]

CALC_H = "int add(int a, int b);\nint mul(int a, int b);\nint clamp(int v, int lo, int hi);\n"
FUNCTIONS = {
    "add": "int add(int a, int b) { return a + b; } /* add */",
    "mul": "int mul(int a, int b) { return a * b; } /* mul */",
    "clamp": "int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; } /* clamp */",
}
BUGS = {  # function -> (buggy line, right patch, wrong patches)
    "mul": (
        "int mul(int a, int b) { return a + b; } /* mul */",
        r"sed -i '/\/\* mul \*\//s/a + b/a * b/' calc.c",
        [r"sed -i '/\/\* mul \*\//s/a + b/a - b/' calc.c", r"sed -i '/\/\* add \*\//s/a + b/a * b/' calc.c"],
    ),
    "add": (
        "int add(int a, int b) { return a - b; } /* add */",
        r"sed -i '/\/\* add \*\//s/a - b/a + b/' calc.c",
        [r"sed -i '/\/\* add \*\//s/a - b/b - a/' calc.c", r"sed -i '/\/\* mul \*\//s/a \* b/a + b/' calc.c"],
    ),
    "clamp": (
        "int clamp(int v, int lo, int hi) { return v < lo ? hi : v > hi ? lo : v; } /* clamp */",
        r"sed -i '/\/\* clamp \*\//s/? hi : v > hi ? lo/? lo : v > hi ? hi/' calc.c",
        [r"sed -i '/\/\* clamp \*\//s/v < lo/v <= lo/' calc.c", r"sed -i '/\/\* clamp \*\//s/? hi :/? v :/' calc.c"],
    ),
}
TEST_C = r"""#include <stdio.h>
#include "calc.h"

static int failures = 0;
#define CHECK(expr) do { if (!(expr)) { printf("FAIL %s\n", #expr); failures++; } } while (0)

int main(void) {
    CHECK(add(2, 3) == 5);
    CHECK(add(-4, 1) == -3);
    CHECK(mul(2, 3) == 6);
    CHECK(mul(4, 5) == 20);
    CHECK(clamp(12, 0, 10) == 10);
    CHECK(clamp(-3, 0, 10) == 0);
    CHECK(clamp(7, 0, 10) == 7);
    printf("%d failures\n", failures);
    return failures != 0;
}
"""
MAKEFILE = """CFLAGS = -O1 -Wall
all: test_calc
calc.o: calc.c calc.h
\t$(CC) $(CFLAGS) -c calc.c -o calc.o
test_calc: test_calc.c calc.o
\t$(CC) $(CFLAGS) test_calc.c calc.o -o test_calc
check: test_calc
\t./test_calc
clean:
\trm -f calc.o test_calc
"""
CHECK = "make -s check 2>&1 | tail -n 1"


def make_project(path: Path, bug: str) -> Path:
    """Write the project with ``bug`` in it (unless it exists already)."""
    if path.exists():
        return path
    path.mkdir(parents=True)
    lines = [BUGS[bug][0] if name == bug else line for name, line in FUNCTIONS.items()]
    (path / "calc.c").write_text('#include "calc.h"\n\n' + "\n".join(lines) + "\n")
    (path / "calc.h").write_text(CALC_H)
    (path / "test_calc.c").write_text(TEST_C)
    (path / "Makefile").write_text(MAKEFILE)
    return path


def _tests_pass(output: str | None) -> float:
    return 1.0 if output is not None and output.strip() == "0 failures" else 0.0


def shell_workload(data_dir: Path) -> Workload:
    tasks = []
    notes: list[str] = []
    for bug, (_, right, wrong) in BUGS.items():
        project = make_project(data_dir / f"calc-{bug}", bug)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            factory = ShellSandbox.factory(project, timeout=60)
        if caught and not notes:
            notes.append("overlay mounts are not permitted here: shell sandboxes copy the project instead")
        commands = [
            "ls",
            "cat calc.c",
            "cat test_calc.c",
            f"grep -n {bug} calc.c",
            "make 2>&1",
            "make check 2>&1",
            right,
            *wrong,
            "make clean",
        ]
        actions = tuple(Action(name="sh", arguments={"cmd": command}) for command in commands)
        actions += (Action(name="sh", arguments={"cmd": "echo submitted"}, terminal=True),)
        tasks.append(
            Task(
                id=f"fix-{bug}",
                prompt=f"The project's tests fail: find and fix the bug in {bug}(), then submit.",
                actions=actions,
                reward=_tests_pass,
                factory=factory,
                check=Action(name="sh", arguments={"cmd": CHECK}).call,
                horizon=6,
            )
        )

    def close() -> None:
        for task in tasks:
            close_factory(task.factory)

    return Workload(
        name="shell",
        tasks=tasks,
        description="repair a small C project: inspect, build, patch, rebuild, run its tests",
        notes=notes,
        close=close,
    )
