"""Private directories and files: the flight recorder's dumps, written without trusting the
file system (a root job must not be made to overwrite a file through a planted link).

A directory must be a real directory owned by this user and writable by nobody else (a
missing one is created 0700); a file is created through the directory's descriptor with
``O_EXCL|O_NOFOLLOW``, mode 0600, and renamed into place; old subdirectories are removed
through descriptors, never following a link. The rules and why:
docs/reliability.md, section 3. Imports nothing of mpidist. POSIX only (as MPI jobs are).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time

__all__ = ["UnsafeDirectory", "fresh_name", "open_private_dir", "remove_oldest", "write_private_file"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeDirectory(OSError):
    """A directory that is a link, not a directory, or not private to this user."""


def fresh_name(prefix: str) -> str:
    """``<prefix><YYYYmmdd-HHMMSS>-<16 hex digits from secrets>``: sortable by time, unguessable."""
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(8)}"


def open_private_dir(path: str) -> int:
    """A read-only descriptor of the private directory ``path``, created with mode 0700 (its
    missing parents with the default mode) if it does not exist.

    Raises:
        UnsafeDirectory: ``path`` is a symbolic link or not a directory, is owned by another
            user, or is writable by group or others.
        OSError: it cannot be created or opened.
    """
    created = False
    for attempt in range(2):
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            if attempt:
                raise
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # the parents: default mode
            continue
        break
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if os.path.islink(path) or not os.path.isdir(path):
            raise UnsafeDirectory(f"{path} is a symbolic link or not a directory") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDirectory(f"{path} is not a directory")
        if st.st_uid != os.geteuid():
            raise UnsafeDirectory(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
        if created:
            os.fchmod(fd, 0o700)  # whatever the umask took away
        elif st.st_mode & 0o022:
            raise UnsafeDirectory(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private_file(directory: str, name: str, data: bytes) -> str:
    """Write ``data`` to ``<directory>/<name>`` (mode 0600) atomically; return the path.
    Raises UnsafeDirectory or OSError (the temporary file is removed)."""
    dir_fd = open_private_dir(directory)
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(dir_fd)
    return os.path.join(directory, name)


def remove_oldest(directory: str, keep: int, dirs: str, files: str) -> None:
    """In the private ``directory``, of the subdirectories named as the regex ``dirs``, remove
    all but the ``keep`` newest (by mtime) that hold only files named as the regex ``files``;
    links and anything else are left alone. Errors are ignored (another process may prune)."""
    fd = open_private_dir(directory)
    try:
        found = []
        for name in filter(re.compile(dirs).fullmatch, os.listdir(fd)):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    found.append((st.st_mtime_ns, name))
        for _, name in sorted(found, reverse=True)[keep:]:
            with contextlib.suppress(OSError):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=fd)
                try:
                    inside = os.listdir(sub)
                    if all(re.fullmatch(files, n) for n in inside):
                        for n in inside:
                            os.unlink(n, dir_fd=sub)
                        os.rmdir(name, dir_fd=fd)
                finally:
                    os.close(sub)
    finally:
        os.close(fd)
