"""What a shell sandbox's commands see of the host, decided once per factory and printable (``host_view``).

A command does not see the host's filesystem. Its mount namespace gets a new root, a small read-only tmpfs
holding only mount points and symlinks, with the host paths bound in (built once per zygote and cloned per
command: ``zygote_process.HostRoot``); the host's root is detached (``pivot_root``). In it:

* the system directories programs need (``SYSTEM_DIRS``): ``/usr``, and ``/bin``, ``/sbin``, ``/lib*``, recreated
  as the symlinks into ``/usr`` they are on merged-``/usr`` systems, bound where they are directories;
* an allowlist of ``/etc`` (``ETC_ALLOWED``): what programs read to run (users and groups, name service and
  dynamic linker configuration, certificates, time zone, shell start-up files, interpreters' configuration),
  never secrets (``shadow``, ``gshadow``, ``sudoers``, ``ssh`` host keys, ``ssl/private``) nor the host's
  identity (``machine-id``, ``hostname``) nor its network configuration (the sandbox has none);
* the sandbox's own tree at the base path, a private ``/proc``, a minimal ``/dev``, private tmpfs ``/tmp``,
  ``/var/tmp``, ``/run`` and ``/dev/shm``;
* the host paths the factory declares (``visible=``), files or directories, anywhere outside the tree.

Every host path is bound read-only, ``nosuid``, ``nodev``, with the mounts below it. Not there: ``/root``,
``/home``, ``/var`` (but its private ``/tmp``), ``/srv``, ``/mnt``, ``/media``, ``/sys``, other trees (the
cache directory, layer stores, snapshot and CRIU images among them) and so any host socket. Nor ``/opt``: it
holds add-on software of any kind (here, package mirrors), which a factory that needs a tool from it names
in ``visible=``. Image-based sandboxes (``rootfs=True``) see only their image: their namespace's root is an
empty tmpfs they are chrooted from into the image's tree (a chroot from the host's root would leave every
host mount in the namespace).

A CRIU restore rebuilds the same root: the dump records the confinement, and the restore's keeper makes its
mount points for CRIU's ``--root`` (``_criu_keeper``); CRIU binds the host paths back as external mounts.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ...errors import SandboxError
from .zygote import Confinement
from .zygote_process import HIDDEN_MEMORY

__all__ = ["ETC_ALLOWED", "SYSTEM_DIRS", "HostView", "ViewEntry", "build_confinement", "describe"]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Entries of /etc shown, as fnmatch patterns relative to /etc (what each is for, in groups).
ETC_ALLOWED = (
    # users, groups, name service, hosts (loopback only), port and protocol names
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "networks",
    "services",
    "protocols",
    "rpc",
    "ethertypes",
    # the dynamic linker, and Debian's alternatives (/usr/bin/awk and others are symlinks into it)
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    # certificates (Debian's and Red Hat's layouts) and OpenSSL's configuration, never ssl/private
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "pki/tls/certs",
    "pki/ca-trust",
    # time zone, locale, the system's name and version
    "localtime",
    "timezone",
    "locale.alias",
    "locale.conf",
    "os-release",
    "lsb-release",
    "debian_version",
    # shells and terminals
    "bash.bashrc",
    "profile",
    "profile.d",
    "inputrc",
    "shells",
    "terminfo",
    "environment",
    # files and their types (file(1), mimetypes, cp -a's extended attributes), fonts, XML catalogs, editors
    "mime.types",
    "magic",
    "magic.mime",
    "xattr.conf",
    "fonts",
    "xml",
    "vim",
    "wgetrc",
    # interpreters' configuration: Python, Perl, Java (the JDK's conf/ links into it)
    "python3",
    "python3.*",
    "perl",
    "java-*",
    # the sandbox's own mount table (a symlink into its /proc)
    "mtab",
)
_DEVICES_WHY = "a harmless device of the host (read-only mount; reads and writes work)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewEntry:
    """One path a command sees: ``kind`` is ``"read-only"`` (a host path, bound), ``"symlink"`` (``source`` is
    its target), ``"private tmpfs"``, ``"tree"`` (the sandbox's own files), ``"proc"``, ``"devices"`` or
    ``"root"``; ``mounted``: whether a mount sits at ``path`` (it shows in ``/proc/self/mountinfo``)."""

    path: str
    kind: str
    why: str
    source: str | None = None
    mounted: bool = True

    def __str__(self) -> str:
        shown = f"{self.path} -> {self.source}" if self.kind == "symlink" else self.path
        return f"{shown:<34} {self.kind:<14} {self.why}"


@dataclass(frozen=True, kw_only=True, slots=True)
class HostView:
    """What a factory's commands see of the host, path by path (``ShellSandboxFactory.host_view``)."""

    base: str
    rootfs: bool
    entries: tuple[ViewEntry, ...]

    def mount_points(self) -> frozenset[str]:
        """The paths a mount sits at, as ``/proc/self/mountinfo`` shows them inside the sandbox."""
        return frozenset(entry.path for entry in self.entries if entry.mounted)

    def host_paths(self) -> tuple[str, ...]:
        """The host paths shown (read-only)."""
        return tuple(entry.path for entry in self.entries if entry.kind == "read-only" and entry.source is None)

    def __str__(self) -> str:
        if self.rootfs:
            head = f"Commands over the root filesystem {self.base} see only it, and:"
            tail = "Nothing of the host is there but the devices above."
        else:
            head = f"Commands over {self.base} see of the host only these paths:"
            tail = (
                "Everything else is not there: /root, /home, /var, /srv, /mnt, /media, /opt, /sys, other trees "
                "(cache directories, layer stores, snapshots), host sockets; add a path with visible=."
            )
        return "\n".join([head, *(f"  {entry}" for entry in self.entries), tail])


def build_confinement(
    base: Path, *, rootfs: bool, devices: tuple[str, ...], visible: tuple[str, ...] = ()
) -> Confinement:
    """The confinement of a factory over ``base``: the host's system paths and allowed /etc entries looked up
    now, and the declared ``visible`` paths checked (SandboxError for one the sandbox cannot show)."""
    if rootfs:
        if visible:
            raise SandboxError("visible= is not for rootfs sandboxes: they see only their root filesystem")
        return Confinement(base=str(base), rootfs=True, private_dirs=("/tmp", "/run"), devices=devices)
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for path in (*SYSTEM_DIRS, *_etc_entries()):
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode):
            links.append((path, os.readlink(path)))
        elif stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
            binds.append(path)
    shown = tuple(_checked_visible(path, base, binds) for path in visible)
    return Confinement(
        base=str(base),
        rootfs=False,
        private_dirs=("/tmp", "/var/tmp", "/run"),
        devices=devices,
        system=tuple(binds),
        links=tuple(links),
        visible=tuple(sorted({path for path in shown if path is not None}, key=_depth)),
    )


def describe(confinement: Confinement, *, visible: tuple[str, ...] = ()) -> HostView:
    """The view ``confinement`` gives; ``visible``: what the factory declared (some of it may be shown through
    a system path already)."""
    entries = [ViewEntry(path="/", kind="tree" if confinement.rootfs else "root", why=_root_why(confinement))]
    if not confinement.rootfs:
        below = _mounts_below([*confinement.system, *confinement.visible])
        for path in confinement.system:
            why = "system programs and libraries" if path in SYSTEM_DIRS else "allowed /etc entry"
            entries.append(ViewEntry(path=path, kind="read-only", why=why))
        for path, target in confinement.links:
            entries.append(ViewEntry(path=path, kind="symlink", source=target, why="as on the host", mounted=False))
        for path in visible:
            shown = os.path.abspath(path)
            if shown in confinement.visible:
                entries.append(ViewEntry(path=shown, kind="read-only", why="declared visible= by the factory"))
            else:
                cover = _covering(shown, confinement.system)
                why = f"declared visible=, shown through {cover} already"
                entries.append(ViewEntry(path=shown, kind="read-only", why=why, mounted=False))
        for path, parent in below:
            entries.append(ViewEntry(path=path, kind="read-only", source=parent, why=f"mounted below {parent}"))
        entries.append(ViewEntry(path=confinement.base, kind="tree", why="the sandbox's own files (its overlay)"))
    entries.append(ViewEntry(path="/proc", kind="proc", why="the command's own processes only (read-only)"))
    entries += [
        ViewEntry(path=path, kind="read-only", why="hidden: the shell's memory, which the driver reads (its environ)")
        for path in HIDDEN_MEMORY
    ]
    entries.append(ViewEntry(path="/dev", kind="devices", why="a tmpfs with a few harmless devices"))
    entries += [ViewEntry(path=f"/dev/{name}", kind="read-only", why=_DEVICES_WHY) for name in confinement.devices]
    size = f", size {confinement.tmpfs_size}" if confinement.tmpfs_size else ""
    for path in (*confinement.private_dirs, "/dev/shm"):
        mounted = not confinement.rootfs or path == "/dev/shm" or os.path.isdir(confinement.base + path)
        if mounted:
            why = f"empty at each start; one tmpfs with the other private dirs{size}"
            entries.append(ViewEntry(path=path, kind="private tmpfs", why=why))
    return HostView(base=confinement.base, rootfs=confinement.rootfs, entries=tuple(entries))


def _root_why(confinement: Confinement) -> str:
    if confinement.rootfs:
        return "the sandbox's own root filesystem (its overlay), chrooted into from an empty root"
    return "a new tmpfs, read-only: only the mount points and symlinks below; the host's root is detached"


def _etc_entries() -> list[str]:
    found: list[str] = []
    try:
        names = sorted(os.listdir("/etc"))
    except OSError:
        return found
    for pattern in ETC_ALLOWED:
        if "/" in pattern:
            found.append(f"/etc/{pattern}")
        else:
            found += [f"/etc/{name}" for name in names if fnmatch.fnmatchcase(name, pattern)]
    return list(dict.fromkeys(found))


def _depth(path: str) -> tuple[int, str]:
    return path.count("/"), path  # parents mount before the paths below them


def _covering(path: str, binds: list[str] | tuple[str, ...]) -> str | None:
    return next((bind for bind in binds if path == bind or path.startswith(bind.rstrip("/") + "/")), None)


def _checked_visible(path: str, base: Path, binds: list[str]) -> str | None:
    """``path`` made absolute when it needs a mount of its own; None when a system path shows it already."""
    shown = os.path.abspath(os.fspath(path))
    if not os.path.lexists(shown):
        raise SandboxError(f"visible path {shown} does not exist on the host")
    if shown == "/":
        raise SandboxError("visible=['/'] would show the whole host; name the paths the sandbox needs")
    for special in ("/proc", "/dev"):
        if _covering(shown, [special]):
            raise SandboxError(f"visible path {shown} is under {special}, which the sandbox has its own of")
    if _covering(shown, [str(base)]) or _covering(str(base), [shown]):
        raise SandboxError(
            f"visible path {shown} overlaps the sandbox tree {base}: the tree is shown at its own path already"
        )
    return None if _covering(shown, binds) else shown


def _mounts_below(paths: list[str]) -> list[tuple[str, str]]:
    """Host mounts strictly below ``paths`` (bound along with them, recursively), with the path each is below."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[4])
        for path in paths:
            if point != path and _covering(point, [path]):
                found.append((point, path))
                break
    return found
