"""The copy of a synced workspace on a host: where it lives, how files land in it, what it holds.

The copy sits in `<MONARCH_WORKSPACE_DIR>/<hostname>/<name>`; both directories this module makes must be
this user's and writable by nobody else (others could otherwise plant links or code in them). Inside it,
nothing already there is followed: a link or file where a directory belongs is replaced, part files are
opened with O_NOFOLLOW and O_EXCL, and a finished file is renamed over whatever held its name. Files
keep their source's permission bits; part files have short names of their own, so a name of up to 255
bytes (or one that is not UTF-8) syncs like any other.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
from contextlib import suppress
from pathlib import Path, PurePosixPath
from typing import Any

from monarch import config
from monarch.errors import MonarchError

MANIFEST = ".monarch-manifest.json"  # in the copy: {relpath: [size, sha256, mode]} of what it holds
PART = ".monarch-part"  # suffix of a file being written; replaced onto its name when complete

Manifest = dict[str, tuple[int, str, int]]  # relpath -> (size, sha256, permission bits)
Piece = tuple[str, int, bytes, int, str, int]  # relpath, offset, data, file size, file sha256, permission bits


class WorkspaceError(MonarchError, ValueError):
    """sync_workspace got a path it cannot copy, or a copy went wrong (a file changed while it was sent)."""


def own_dir(path: Path) -> Path:
    """`path` as a directory of this user that no one else can write (made 0700 when missing)."""
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(st.st_mode) else \
            f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else \
            f"writable by others ({oct(st.st_mode & 0o777)})"
        raise WorkspaceError(f"refusing to keep a workspace copy in {path}: it is {what}; it must be a directory of "
                             f"uid {os.geteuid()} that only its owner can write. Remove it, or point "
                             "MONARCH_WORKSPACE_DIR elsewhere")
    return path


def copy_dir(name: str) -> Path:
    """Where this host keeps copy `name`, checked (and made) as `own_dir` says."""
    root = Path(config.workspace_dir()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return own_dir(own_dir(root / socket.gethostname()) / name)


def read_manifest(copy: Path) -> Manifest:
    raw = json.loads((copy / MANIFEST).read_text()) if is_file(copy / MANIFEST) else {}
    return {rel: (int(e[0]), str(e[1]), int(e[2]) if len(e) > 2 else -1) for rel, e in raw.items()}


def is_file(path: Path, size: int | None = None) -> bool:
    """Whether `path` itself (not what a link names) is a regular file, of `size` bytes when given."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)


def is_dir(path: Path) -> bool:
    """Whether `path` itself (not what a link names) is a directory."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def target(copy: Path, rel: str) -> Path:
    """The path of `rel` in the copy; refuses one that would leave it."""
    p = PurePosixPath(rel)
    if p.is_absolute() or not p.parts or ".." in p.parts:
        raise WorkspaceError(f"refusing to write {rel!r}: it is not a path inside the copy {copy}")
    return copy.joinpath(*p.parts)


def make_parents(copy: Path, dest: Path) -> None:
    """The directories of `dest` inside `copy`, each replacing a link or file in its way (never followed)."""
    d = copy
    for part in dest.relative_to(copy).parts[:-1]:
        d = d / part
        if is_dir(d):
            continue
        with suppress(FileNotFoundError):  # a link or a file in the directory's place goes
            os.unlink(d)
        os.mkdir(d)


def part_of(dest: Path) -> Path:
    """The part file of `dest`: a short name of its own beside it (dest's name may be 255 bytes long)."""
    return dest.with_name(f".{hashlib.sha256(os.fsencode(dest.name)).hexdigest()[:16]}{PART}")


def create(path: Path) -> int:
    """A descriptor of `path` made afresh for writing (whatever held the name is removed first), never
    following a link."""
    with suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_at(path: Path, data: bytes, offset: int, mode: int | None = None) -> None:
    """Write `data` at `offset` of `path` without following a link: offset 0 starts a new file (`create`);
    `mode`, when given, is set as the last write lands."""
    fd = create(path) if offset == 0 else os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
        if mode is not None:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def begin(copy: Path, rel: str) -> tuple[Path, Path]:
    """(the path of `rel` in the copy, its part file), the directories it needs made."""
    dest = target(copy, rel)
    make_parents(copy, dest)
    return dest, part_of(dest)


def land(part: Path, dest: Path) -> None:
    """A complete part file takes its name, and the name's stale bytecode goes."""
    os.replace(part, dest)
    drop_bytecode(dest)


def drop_bytecode(path: Path) -> None:
    """Remove the cached bytecode of a replaced or deleted source: a pyc records the source's mtime in whole
    seconds and its size, so an edit within the same second of the same size would be taken as unchanged."""
    if path.suffix == ".py":
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


def write_piece(copy: Path, piece: Piece, hashers: dict[str, Any]) -> None:
    """Write one piece of a file to its part file (pieces of a file come in order; `hashers` holds the hash
    of each file begun); the last piece checks the hash, sets the mode and replaces the file."""
    rel, offset, data, size, sha, mode = piece
    dest, part = begin(copy, rel)
    last = offset + len(data) >= size
    write_at(part, data, offset, mode & 0o777 if last else None)
    hasher = hashers[rel] = hashlib.sha256() if offset == 0 else hashers[rel]
    hasher.update(data)
    if not last:
        return
    if hashers.pop(rel).hexdigest() != sha:
        part.unlink()
        raise WorkspaceError(f"{rel} arrived with another sha256 than it was sent with (the source changed "
                             "while it was being sent); sync again")
    land(part, dest)


def write_manifest(copy: Path, files: Manifest) -> None:
    part = part_of(copy / MANIFEST)
    write_at(part, json.dumps(files, sort_keys=True).encode(), 0, 0o600)
    os.replace(part, copy / MANIFEST)


def delete(copy: Path, rel: str) -> None:
    """Remove `rel` from the copy, with its bytecode and the directories it leaves empty."""
    path = target(copy, rel)
    path.unlink(missing_ok=True)
    drop_bytecode(path)
    for parent in path.parents:
        if parent == copy or not parent.is_relative_to(copy):
            break
        with suppress(OSError):  # removed only when empty
            (parent / "__pycache__").rmdir()
        if any(parent.iterdir()):
            break
        parent.rmdir()
