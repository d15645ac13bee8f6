"""Child processes that die with the process that started them (standard library only).

A process killed with SIGKILL runs no cleanup, so a child it started would live on: GNU tar unpacking a snapshot
into a node cache's ``.partial`` entry kept writing there after its publisher was killed and its claim on the
entry was gone; ``cp -a`` squashing shell layers would keep filling the layer store. ``run`` starts every such
child with its parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux), so the kernel kills it as soon
as the process that started it ends, however it ends.

Why only ``run`` (a child the caller waits for), and no ``Popen``: Linux sends the parent-death signal when the
*thread* that forked the child exits, not when its process does. A thread that forks a child and waits for it to
exit outlives the child by construction, whichever thread it is (an ``asyncio.to_thread`` worker, a pool thread
that is retired later), so the signal fires exactly when the whole process dies. A child meant to outlive the call
that started it must not be tied this way (it would die with a retired pool thread); the shell sandboxes' zygote,
the one such child, ends instead when its control socket reaches end of file, which the kernel also ensures when
the parent dies.

The signal does not reach grandchildren; the programs run here (tar, cp) start none. Where ``prctl`` is not
available (not Linux) children are started untied, as ``subprocess.run`` would.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run", "tie_to_parent"]

_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved once in the parent (the child, between fork and exec, only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    result: Callable[..., int] = prctl
    return result


def tie_to_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with this process (None where that is not possible). Only for
    a child the forking thread waits for (module docstring); prefer ``run``."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def tie() -> None:  # runs in the child, between fork and exec: nothing but system calls
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed: it will never come
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


def run(argv: Sequence[str], **options: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, **options)`` with the child tied to this process: it is killed when this process
    dies, even by SIGKILL (module docstring)."""
    if "preexec_fn" in options:
        raise TypeError("run() sets preexec_fn itself")
    return subprocess.run(argv, preexec_fn=tie_to_parent(), **options)
