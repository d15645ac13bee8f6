"""A small real C project for shell-sandbox tests: a library with a bug, its tests, a Makefile."""

from __future__ import annotations

from pathlib import Path

CALC_C = """\
#include "calc.h"

int add(int a, int b) { return a + b; }
int mul(int a, int b) { return a + b; }  /* bug: should multiply */
int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
"""
CALC_H = "int add(int a, int b);\nint mul(int a, int b);\nint clamp(int v, int lo, int hi);\n"
TEST_C = """\
#include <stdio.h>
#include "calc.h"

static int failures = 0;
#define CHECK(expr) do { if (!(expr)) { printf("FAIL %s\\n", #expr); failures++; } } while (0)

int main(void) {
    CHECK(add(2, 3) == 5);
    CHECK(mul(2, 3) == 6);
    CHECK(mul(4, 5) == 20);
    CHECK(clamp(12, 0, 10) == 10);
    printf("%d failures\\n", failures);
    return failures != 0;
}
"""
MAKEFILE = """\
CFLAGS = -O1 -Wall
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

# Actions an agent takes on this repository: inspect, build, patch (right and wrong), rebuild, test.
ACTIONS = [
    "ls",
    "cat calc.c",
    "grep -n mul calc.c",
    "make 2>&1",
    "make check 2>&1",
    "sed -i 's/return a + b; }  \\/\\* bug/return a * b; }  \\/* bug/' calc.c",
    "sed -i 's/return a + b; }  \\/\\* bug/return a - b; }  \\/* bug/' calc.c",
    "make clean",
    "./test_calc",
    "wc -c calc.c",
    "rm -f test_calc.c",
    "git status 2>&1 | head -1",
]


def make_project(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "calc.c").write_text(CALC_C)
    (path / "calc.h").write_text(CALC_H)
    (path / "test_calc.c").write_text(TEST_C)
    (path / "Makefile").write_text(MAKEFILE)
    return path
