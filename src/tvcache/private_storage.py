"""Storage nobody else on the host can read: directories 0700 and files 0600, owned by the cache's user.

Everything tvcache keeps of a sandbox — layer stores and uppers, snapshot directories, CRIU page images (which
hold the memory of a rollout's processes: any secret a shell variable held), the journal (every call and its
output) — is what one rollout must not read of another, and what another host user must neither read nor run
(a setuid binary a sandbox made would run with its owner's privileges from an exec-able directory). The modes
are set explicitly, never left to the umask, and a directory an older version left wider is tightened when it is
opened again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["DIRECTORY_MODE", "FILE_MODE", "PrivateStorageError", "make_private", "private_directory", "private_tree"]

DIRECTORY_MODE = 0o700
FILE_MODE = 0o600


class PrivateStorageError(OSError):
    """A directory tvcache must keep private cannot be: it is a link, not a directory, or another user's."""


def private_directory(path: str | os.PathLike[str], *, parents: bool = True, owned: bool = False) -> Path:
    """``path`` as a directory of mode 0700 (its missing parents with the umask's mode): created so, or
    tightened when it exists wider. With ``owned``, for a directory in a place every user can write (``/dev/shm``,
    ``/tmp``), one that is a symbolic link or belongs to another user is refused (PrivateStorageError): whoever
    owns it could read or swap what is put there."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if owned and (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else f"owned by uid {info.st_uid}"
        if not stat.S_ISLNK(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            what = "not a directory"
        raise PrivateStorageError(
            f"{path} is {what}: tvcache keeps sandbox data there and needs it to be a directory of its own user "
            f"(uid {os.geteuid()}); remove it or choose another directory"
        )
    make_private(path)
    return path


def make_private(path: str | os.PathLike[str]) -> None:
    """Tighten one directory to 0700 or one file to 0600 (links are left alone; a path another user owns is left
    as it is unless this process is root)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        return
    wanted = DIRECTORY_MODE if stat.S_ISDIR(info.st_mode) else FILE_MODE
    if stat.S_IMODE(info.st_mode) != wanted and (info.st_uid == os.geteuid() or os.geteuid() == 0):
        os.chmod(path, wanted)


def private_tree(path: str | os.PathLike[str]) -> None:
    """Tighten ``path`` and everything below it (directories 0700, files 0600): for trees a tool wrote with its
    own umask (CRIU's images)."""
    make_private(path)
    for directory, names, files in os.walk(path):
        for name in (*names, *files):
            make_private(os.path.join(directory, name))
