"""Files and trees as the harness adapters key and carry them: the digest an upload is keyed by, the copy kept
for replays (the caller's file may change or vanish meanwhile), and a tree as a tar archive.

The digests are parts of cache keys, so each adapter keeps the rules it has always hashed by (see
``upload_digest``); a change would turn every cached upload into a miss.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

__all__ = ["keep_copy", "pack", "upload_digest"]


def upload_digest(path: Path, *, whole_file_mode: bool, pathlib_links: bool) -> str:
    """A digest of a file or directory tree as an upload sees it: relative names, kinds, modes, link targets and
    contents (a file given alone is read through a link, as the runtimes copy it).

    The two rules differ between adapters only because each was written on its own and its digests are already
    cached keys: ``whole_file_mode``, a file given alone is hashed with its whole ``st_mode`` (SWE-ReX) or its
    permission bits only (``& 0o7777``, Harbor); ``pathlib_links``, a link's target as ``Path.readlink`` spells it
    (normalised: no ``./``, no repeated or trailing ``/``; Harbor) or as the link holds it (SWE-ReX)."""
    digest = hashlib.blake2b(digest_size=16)
    if not path.is_dir():
        mode = path.stat().st_mode
        if not whole_file_mode:
            mode &= 0o7777
        digest.update(f"file\0{mode:o}\0".encode() + path.read_bytes())
        return digest.hexdigest()
    for entry in sorted(path.rglob("*")):
        mode = entry.lstat().st_mode
        digest.update(f"{entry.relative_to(path).as_posix()}\0{mode:o}\0".encode())
        if entry.is_symlink():
            digest.update((str(entry.readlink()) if pathlib_links else os.readlink(entry)).encode())
        elif entry.is_file():
            digest.update(entry.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def keep_copy(source: Path, kept: Path) -> None:
    """Copy the file or tree ``source`` to ``kept`` (links in a tree kept as links), unless ``kept``'s folder
    exists: callers name that folder by the content's digest, so what is there already is the same content."""
    if kept.parent.exists():
        return
    kept.parent.mkdir()
    if source.is_dir():
        shutil.copytree(source, kept, symlinks=True)
    else:
        shutil.copy2(source, kept)


def pack(path: Path, *, follow_links: bool) -> bytes:
    """The files under ``path`` as a tar archive, in name order; ``follow_links``: a link is archived as what it
    points to (as ``shutil.copytree`` copies by default), else as a link."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", dereference=follow_links) as archive:
        for entry in sorted(path.rglob("*")):
            archive.add(entry, arcname=entry.relative_to(path).as_posix(), recursive=False)
    return buffer.getvalue()
