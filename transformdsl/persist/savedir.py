"""Reading a saved directory through one open descriptor.

A save is opened once (``O_DIRECTORY``); every file in it is opened relative to that
descriptor, by a single name, without following symbolic links (``O_NOFOLLOW``), and is
checked on the opened descriptor (``fstat``: a regular file, under a size bound) before a
byte is read.  Nothing is re-resolved by name afterwards: libraries that take a path are
given ``/proc/self/fd/N``, which names the opened file or folder itself.  So a symbolic
link swapped in, a FIFO, a device or a directory replaced by a concurrent ``save`` cannot
redirect a read, and every file comes from the same directory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import LoadError

_PROC_FD = Path("/proc/self/fd")


class Vanished(LoadError):
    """The directory was replaced (by a concurrent save) while it was being read."""


class SaveDir:
    """An open directory of a save; use as a context manager (closes its descriptor)."""

    def __init__(self, path: Path, fd: int, root: SaveDir | None = None):
        self.path = path
        self.fd = fd
        self.root = root or self
        self._children: list[SaveDir] = []

    @classmethod
    def open(cls, path: str | os.PathLike) -> SaveDir:
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LoadError(f"{path}: no such directory") from None
        except NotADirectoryError:
            raise LoadError(f"{path}: not a directory") from None
        except OSError as exc:
            raise LoadError(f"{path}: cannot open the directory: {exc.strerror or exc}") from None
        return cls(path, fd)

    def close(self) -> None:
        for child in self._children:
            child.close()
        self._children.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SaveDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ names

    def _name(self, name: str) -> str:
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\x00" in name
                or "\\" in name):
            raise LoadError(f"{self.path}: refusing file name {name!r} (a plain name inside the directory)")
        return name

    def _error(self, name: str, exc: OSError, what: str = "file") -> LoadError:
        path = self.path / name
        if isinstance(exc, FileNotFoundError) and self.replaced():
            return Vanished(f"{self.root.path}: replaced by another save while loading")
        if isinstance(exc, FileNotFoundError):
            return LoadError(f"{path}: missing {what}")
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a symbolic link
            return LoadError(f"{path}: is a symbolic link or not what the save lists; refusing to read it")
        return LoadError(f"{path}: cannot open: {exc.strerror or exc}")

    def replaced(self) -> bool:
        """Whether the root path now names another directory than the one opened."""
        try:
            now = os.stat(self.root.path)
        except OSError:
            return True
        opened = os.fstat(self.root.fd)
        return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)

    # ------------------------------------------------------------------ opening

    def subdir(self, name: str) -> SaveDir:
        """A folder of the save (not a symbolic link), opened relative to this one."""
        name = self._name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise self._error(name, exc, "folder") from None
        child = SaveDir(self.path / name, fd, self.root)
        self._children.append(child)
        return child

    def open_file(self, name: str, max_bytes: int | None = None, what: str = "file") -> int:
        """A descriptor of a regular file of the save (the caller closes it).

        Refuses symbolic links, FIFOs, devices and directories (checked on the opened
        descriptor; opening does not block on a FIFO) and files over ``max_bytes``.
        """
        name = self._name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise self._error(name, exc, what) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise LoadError(f"{self.path / name}: the {what} is not a regular file")
            if max_bytes is not None and info.st_size > max_bytes:
                raise LoadError(f"{self.path / name}: the {what} is {info.st_size} bytes, over the {max_bytes} limit")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str, max_bytes: int, what: str = "file") -> bytes:
        fd = self.open_file(name, max_bytes, what)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise LoadError(f"{self.path / name}: cannot read the {what}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if len(data) > max_bytes:  # grew since fstat
            raise LoadError(f"{self.path / name}: the {what} is over the {max_bytes} limit")
        return data

    def descend(self, relative: str) -> tuple[SaveDir, str]:
        """The folder holding ``a/b/name`` (opened folder by folder, links refused) and ``name``."""
        *folders, name = relative.split("/")
        here = self
        for folder in folders:
            here = here.subdir(folder)
        return here, name

    def exists(self, name: str) -> bool:
        """Whether ``name`` is an entry of the directory (any kind; links not followed)."""
        try:
            os.stat(self._name(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return True

    def entries(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def walk(self) -> list[tuple[str, os.stat_result]]:
        """Every entry below this folder (``a/b`` names), links not followed, by descriptor."""
        out = []
        stack: list[tuple[str, int]] = [("", self.fd)]
        opened: list[int] = []
        try:
            while stack:
                prefix, fd = stack.pop()
                for name in sorted(os.listdir(fd)):
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    out.append((prefix + name, info))
                    if stat.S_ISDIR(info.st_mode):
                        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        opened.append(child)
                        stack.append((prefix + name + "/", child))
        except OSError as exc:
            raise LoadError(f"{self.path}: cannot list the folder: {exc.strerror or exc}") from None
        finally:
            for fd in opened:
                os.close(fd)
        return out

    # ------------------------------------------------------------------ handing paths to libraries

    def fd_path(self, fd: int | None = None, name: str | None = None) -> str:
        """A path naming the opened file ``fd`` (``name`` in this folder), or this folder,
        for libraries that take paths.

        ``/proc/self/fd/N`` where available (Linux): it does not re-resolve any name.
        Elsewhere, the path by name (checked, but open to a swap between check and use).
        """
        if _PROC_FD.is_dir():
            return str(_PROC_FD / str(self.fd if fd is None else fd))
        return str(self.path if name is None else self.path / name)  # pragma: no cover - not Linux
