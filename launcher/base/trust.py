"""Whose files dtrain obeys (DESIGN rule 14, issue 33): one rule for what it finds by itself.

A project file found by the upward search and a job root steer a run: a ``dtrain.toml``
sets ``python``, ``ssh_config`` and ``env`` (``LD_PRELOAD``); a job root names the pids
``dtrain stop`` signals.  Found in a place another user can write, they are that user's
choice, not ours (git's CVE-2022-24765).  As git's ``safe.directory`` and OpenSSH's
StrictModes decide, such a path is trusted when

* it is owned by the user or by root, and neither group nor others may write it;
* so is every folder above it, up to ``/``, but that a folder others may write is fine
  when it has the sticky bit (``/tmp``: nobody may rename or remove what is not theirs).

Group write is harmless when the group is its owner's own (the user's private group of a
``umask 002`` system, with no other member), as Debian's OpenSSH allows.  A team folder
(group-writable, the team in its group) is not trusted by default; listing it in the
user's own config trusts it and what is under it, whoever owns them and whoever in the
group may write them (git's ``safe.directory``)::

    # ~/.config/dtrain/config.toml ($XDG_CONFIG_HOME/dtrain/config.toml)
    trusted = ["/proj/team"]

What everyone may write (mode ``o+w`` without the sticky bit) is trusted nowhere, and the
config itself must pass the rule.  The config is read only when a path fails without it,
so a launch in the user's own folders reads nothing more.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.base.errors import UsageError

LOOSE_MODE = 0o022  # group or others may write
OTHERS_WRITE = 0o002
CONFIG_PATH = os.path.join("dtrain", "config.toml")  # under $XDG_CONFIG_HOME or ~/.config
CONFIG_SHOWN = "~/.config/dtrain/config.toml"
CONFIG_KEYS = ("trusted",)


@dataclass(frozen=True)
class Doubt:
    """Why a path dtrain found is not trusted: ``at`` (the path itself, or a folder above it)
    is owned by another user (``owner``), or others may write it (``mode``)."""

    path: str  # the path that was checked
    at: str  # the entry at fault
    owner: int | None = None  # owned by this uid (not the user's, not root's)
    mode: int = 0  # else: writable by group or others (its permission bits)

    def why(self, names: bool = False) -> str:
        """``owned by nobody``, ``writable by group or others (mode 0777)``; ``names``: with
        the uid (``nobody (uid 65534)``)."""
        if self.owner is not None:
            return f"owned by {user_name(self.owner) if names else owner_name(self.owner)}"
        return f"writable by group or others (mode {self.mode:04o})"

    def said(self) -> str:
        """``owned by nobody`` of the path itself, ``/tmp/x is writable by ...`` of a folder."""
        return self.why() if self.at == self.path else f"{self.at} is {self.why()}"

    def fix(self) -> str:
        """What may be done about others' write (an owner is the caller's to say)."""
        mine = os.geteuid() in (0, owner_of(self.at))
        chmod = f"chmod go-w {self.at}" if mine else f"its owner may chmod go-w {self.at}"
        if self.mode & OTHERS_WRITE:
            return chmod  # (everyone's: no list trusts it)
        folder = self.at if self.at != self.path else os.path.dirname(self.at)
        try:
            everyones = os.stat(folder).st_mode & OTHERS_WRITE
        except (OSError, ValueError):
            everyones = 0
        if everyones:  # (/tmp listed would trust whatever anyone puts there)
            return chmod
        return f"{chmod}, or list {folder} in {CONFIG_SHOWN}'s trusted"


def owner_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def user_name(uid: int) -> str:
    """``nobody (uid 65534)``, or ``uid 1234`` for a uid without a name."""
    name = owner_name(uid)
    return name if name.startswith("uid ") else f"{name} (uid {uid})"


def owner_of(path: str) -> int | None:
    try:
        return os.stat(path).st_uid
    except (OSError, ValueError):
        return None


def doubt_of(
    path: str, trusted: Sequence[str] = (), parents_only: bool = False, me: int | None = None
) -> Doubt | None:
    """The first reason not to trust ``path`` (None: trusted): the path itself (unless
    ``parents_only``), then each folder above it up to ``/``.  A missing entry is passed
    over (a job root made later).  A link is checked where it leads too."""
    me = os.geteuid() if me is None else me
    absolute = os.path.abspath(path)
    chains = [absolute]
    real = os.path.realpath(absolute)
    if real != absolute:
        chains.append(real)
    for chain in chains:
        entries = [chain, *parents(chain)]
        for place, entry in enumerate(entries):
            if place == 0 and parents_only:
                continue
            doubt = link_doubt(path, entry, trusted, me) if chain == absolute else None
            doubt = doubt or entry_doubt(path, entry, place > 0, trusted, me)
            if doubt is not None:
                return doubt
    return None


def parents(path: str) -> list[str]:
    found: list[str] = []
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return found
        found.append(parent)
        path = parent


def link_doubt(path: str, entry: str, trusted: Sequence[str], me: int) -> Doubt | None:
    """A link on the way is its owner's choice of where the path leads: another user's
    link (``/tmp/dtrain.toml -> ~/theirs-or-yours.toml``) is doubted wherever it leads."""
    try:
        found = os.lstat(entry)
    except (OSError, ValueError):
        return None
    foreign = found.st_uid not in (me, 0) and not is_inside(entry, trusted)
    return (
        Doubt(path, entry, owner=found.st_uid) if stat.S_ISLNK(found.st_mode) and foreign else None
    )


def entry_doubt(
    path: str, entry: str, above: bool, trusted: Sequence[str], me: int
) -> Doubt | None:
    """One entry of the chain: its owner, then who may write it (``above``: a folder above
    the path, where the sticky bit makes others' writing harmless)."""
    try:
        found = os.stat(entry)
    except (OSError, ValueError):
        return None  # not there (yet), or not ours to see: nothing to doubt
    mode = found.st_mode
    inside = is_inside(entry, trusted)
    if found.st_uid not in (me, 0) and not inside:
        return Doubt(path, entry, owner=found.st_uid)
    loose = mode & (OTHERS_WRITE if inside else LOOSE_MODE)
    if above and mode & stat.S_ISVTX:
        loose = 0
    if loose == stat.S_IWGRP and own_group(found):
        loose = 0
    return Doubt(path, entry, mode=stat.S_IMODE(mode)) if loose else None


def own_group(found: os.stat_result) -> bool:
    """Whether the entry's group is its owner's own: the owner's primary group, with no other
    member (a user private group, where ``umask 002`` makes files group-writable).  Members
    are its ``gr_mem`` and every user whose primary group it is (a shared ``users`` group
    lists none in ``gr_mem``), as Debian's OpenSSH counts them."""
    import grp
    import pwd

    try:
        owner = pwd.getpwuid(found.st_uid)
        group = grp.getgrgid(found.st_gid)
    except KeyError:
        return False
    if owner.pw_gid != found.st_gid or any(m != owner.pw_name for m in group.gr_mem):
        return False
    return all(p.pw_uid == owner.pw_uid for p in pwd.getpwall() if p.pw_gid == found.st_gid)


def is_inside(path: str, folders: Sequence[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def config_path(environ: Mapping[str, str]) -> str | None:
    """The user's own config: ``$XDG_CONFIG_HOME/dtrain/config.toml`` (an absolute
    ``XDG_CONFIG_HOME``, as the XDG spec says), else ``~/.config/dtrain/config.toml``."""
    xdg = environ.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, CONFIG_PATH)
    home = environ.get("HOME") or home_of_user()
    return os.path.join(home, ".config", CONFIG_PATH) if home else None


def home_of_user() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None


def trusted_folders(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The folders the user's config trusts (none without a config).  A config others could
    write, or a mistake in it, is one ``UsageError``: it widens what dtrain obeys."""
    path = config_path(environ)
    if path is None or not os.path.lexists(path):
        return ()
    doubt = doubt_of(path)
    if doubt is not None:
        fix = f"chmod go-w {doubt.at}" if doubt.owner is None else "make it yours"
        raise UsageError(f"{path}: {doubt.said()}: dtrain trusts no list there", fix)
    from launcher.base.userfiles import read_user_text

    table = parse_toml(read_user_text(path, "dtrain's config"), path)
    return checked_folders(table, path, environ.get("HOME") or home_of_user() or "/")


def parse_toml(text: str, path: str) -> dict[str, Any]:
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover (Python 3.10: tomli, which became tomllib)
        import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
    try:
        table: dict[str, Any] = tomllib.loads(text)
        return table
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: {exc}", "fix the TOML syntax") from None


def checked_folders(table: Mapping[str, Any], path: str, home: str) -> tuple[str, ...]:
    """``trusted = ["/proj/team", "~/shared"]``: absolute folders (``~`` is the home folder),
    each as given and as its links lead."""
    for key in table:
        if key not in CONFIG_KEYS:
            raise UsageError(
                f"{path}: no setting {key!r}", "the config has: trusted = [FOLDER, ...]"
            )
    folders = table.get("trusted", [])
    if not isinstance(folders, list) or not all(isinstance(f, str) for f in folders):
        raise UsageError(
            f"{path}: trusted must be a list of folders", 'write trusted = ["/proj/team"]'
        )
    found: list[str] = []
    for folder in folders:
        expanded = home + folder[1:] if folder == "~" or folder.startswith("~/") else folder
        if not os.path.isabs(expanded):
            raise UsageError(
                f"{path}: trusted {folder!r} is not an absolute path", 'write e.g. "/proj/team"'
            )
        found += [os.path.normpath(expanded), os.path.realpath(expanded)]
    return tuple(dict.fromkeys(found))


def trust_doubt(path: str, environ: Mapping[str, str], parents_only: bool = False) -> Doubt | None:
    """``doubt_of`` with the user's trusted folders, read only when the path fails without."""
    doubt = doubt_of(path, parents_only=parents_only)
    if doubt is None:
        return None
    trusted = trusted_folders(environ)
    return doubt_of(path, trusted, parents_only) if trusted else doubt


def foreign_folder(folder: str, environ: Mapping[str, str]) -> int | None:
    """The owner of ``folder`` when it is another user's (not root's) and no trusted folder
    holds it: where the upward search for a project file stops (None: go on)."""
    owner = owner_of(folder)
    if owner is None or owner in (os.geteuid(), 0):
        return None
    return None if is_inside(folder, trusted_folders(environ)) else owner


def others_may_write(path: str, environ: Mapping[str, str]) -> Doubt | None:
    """A file the user names (``--config FILE``) is read whoever owns it, but not when group
    or others may write it (group write is fine where the group is its owner's own, or the
    file is in a trusted folder; a missing file is the reader's to say)."""
    doubt = writable_doubt(path, ())
    if doubt is None or doubt.mode & OTHERS_WRITE:
        return doubt
    return writable_doubt(path, trusted_folders(environ))


def writable_doubt(path: str, trusted: Sequence[str]) -> Doubt | None:
    """``entry_doubt`` of ``path`` itself as if the user owned it: who may write it."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(found.st_mode):
        return None  # (a device, a FIFO, a folder: the reader refuses it by what it is)
    return entry_doubt(path, os.path.abspath(path), False, trusted, found.st_uid)
