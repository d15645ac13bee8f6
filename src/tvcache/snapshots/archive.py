"""Directory trees as canonical archives: equal trees give equal bytes, different trees different bytes.

A published folder snapshot and a published shell layer are each one tree packed into one blob, addressed by
its BLAKE2b-256 digest, so the archive must keep everything a sandbox can observe (else two different trees
share one address and one forks as the other) and nothing it cannot (else equal trees get different addresses).

The archive is a POSIX (PAX) tar made by GNU tar (``--xattrs``; Python's ``tarfile`` neither reads nor restores
extended attributes, keeps modification times to the microsecond only, and is 5x slower on trees of many small
files), in one canonical form: entries sorted by name, numeric owners only, no access or change times, fixed
extended-header names (GNU tar's default names hold its pid), modification times to the nanosecond (``make``
compares them). Every extended attribute is kept (``SCHILY.xattr.<name>`` records) but those the caller
excludes, so symlinks, modes (setuid included), owners, ACLs, hard links, FIFOs, device nodes and empty
directories come through. Inode numbers and change times are not in the archive.

GNU tar runs tied to the process that starts it (``tvcache.children``): when that process is killed, tar dies
with it instead of writing on into a node cache's ``.partial`` entry or a layer store.

Unpacking restores owners when running as root (as GNU tar does by default; an unprivileged process cannot) and
exact modes always, checks nothing but lets GNU tar refuse what would land outside the tree (``..`` in names,
writing through a symlink): the blob's digest is verified before. An attribute it cannot restore (a
``trusted.*`` extended attribute without root) fails the unpack: a fork refuses rather than differ.

Standard library only (it runs GNU tar); ``tvcache.sandboxes.shell.layer_archive`` adds what is particular to overlay
layers.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from ..children import run
from ..errors import SandboxError

__all__ = ["FIXED_PATH", "pack_tree", "require_gnu_tar", "unpack_tree"]

FIXED_PATH = "/usr/local/bin:/usr/bin:/bin"
"""Where GNU tar is looked for: the sandboxes' fixed ``PATH`` (``tvcache.sandboxes.commands``), repeated here so
the core does not import the sandboxes."""
_ENVIRONMENT = {"PATH": FIXED_PATH, "LC_ALL": "C"}  # byte order for --sort=name, untranslated errors
_PAX_OPTIONS = "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime"
_EXTRACT = ("--extract", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--same-permissions")


@functools.cache
def require_gnu_tar() -> str:
    """The path of GNU tar (1.28 or later, for ``--sort``); SandboxError naming the fix when there is none."""
    tar = shutil.which("tar", path=FIXED_PATH)
    version = ""
    if tar is not None:
        result = run([tar, "--version"], capture_output=True, text=True, env=_ENVIRONMENT, check=False)
        version = result.stdout.partition("\n")[0]
    if tar is None or "GNU tar" not in version:
        raise SandboxError(
            f"publishing folder trees and shell layers needs GNU tar wherever they are forked (found "
            f"{version or 'no tar'} in {FIXED_PATH}); install it (apt-get install tar) or keep such snapshots "
            "process-local"
        )
    return tar


def pack_tree(path: Path, *, exclude_xattrs: Sequence[str] = ()) -> bytes:
    """The tree at ``path`` as a canonical PAX tar (module docstring), without the extended attributes named in
    ``exclude_xattrs`` (GNU tar patterns)."""
    create = (
        "--create",
        "--format=posix",
        "--sort=name",
        "--numeric-owner",
        "--xattrs",
        "--xattrs-include=*",
        *(f"--xattrs-exclude={name}" for name in exclude_xattrs),
        _PAX_OPTIONS,
    )
    result = run(
        [require_gnu_tar(), *create, "--file=-", f"--directory={path}", "."],
        capture_output=True,
        env=_ENVIRONMENT,
        check=False,
    )
    if result.returncode != 0:  # 1 is "a file changed while read": never right for a frozen tree
        raise SandboxError(f"cannot pack {path}: {_errors(result.stderr)}")
    archive: bytes = result.stdout
    return archive


def unpack_tree(data: bytes, dest: Path, *, what: str = "a published tree") -> None:
    """Unpack an archive made by ``pack_tree`` into ``dest`` (which must not exist): modes, times, extended
    attributes, and owners when root. On failure ``dest`` is removed and SandboxError names ``what``."""
    same_owner = "--same-owner" if os.geteuid() == 0 else "--no-same-owner"
    dest.mkdir()
    result = run(
        [require_gnu_tar(), *_EXTRACT, same_owner, "--file=-", f"--directory={dest}"],
        input=data,
        capture_output=True,
        env=_ENVIRONMENT,
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)
        raise SandboxError(f"cannot unpack {what} into {dest}: {_errors(result.stderr)}")


def _errors(stderr: bytes) -> str:
    return stderr.decode(errors="replace").strip()[-500:] or "GNU tar failed without a message"
