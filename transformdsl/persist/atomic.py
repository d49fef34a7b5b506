"""Writing a save atomically: a temporary sibling directory, flushed, then swapped into place.

An interrupted write leaves any previous save intact and, once the next save runs, no
temporary directory behind (each is named by the process that wrote it).  A target is
replaced only when it is empty or exactly a complete previous save.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import LoadError, TransformError
from .checks import read_metadata
from .format import META_FILE
from .savedir import SaveDir


@contextlib.contextmanager
def writing(directory: Path, finish: Callable[[Path], None] | None = None) -> Iterator[tuple[Path, str]]:
    """``(temporary directory, save id)`` to write a save into; swapped into place at ``directory``
    when the block ends without error, removed otherwise.  ``finish`` runs on the temporary
    directory once the block has written it, before it is flushed and swapped (the writer lists the
    save's files there: :func:`transformdsl.persist.write.write_manifest`).

    ``directory`` must be new, empty or a complete previous save (:func:`_check_target`).  The
    temporary directory is a sibling named by the writing process, so a kill at any moment
    leaves something the next save recognises and removes.  An ``OSError`` becomes a
    :class:`TransformError` naming ``directory`` and the cause.
    """
    final = directory.resolve()
    _check_target(final)
    save_id = uuid.uuid4().hex
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(final)
        # The writer's identity is in the name itself, so a kill at any moment (even before
        # the marker below is written, or while a finished swap is being removed) leaves a
        # directory that the next save recognises as ours and removes.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}.{_boot_tag()}.", dir=final.parent))
    except OSError as exc:
        raise _save_error(final, exc) from exc
    try:
        # mkdtemp makes 0700 folders; a save is shared like any folder the user makes.
        os.chmod(tmp, 0o777 & ~_umask())
        (tmp / TMP_MARKER).write_text(f"{os.getpid()} {_boot_id()}\n")
        yield tmp, save_id
        if finish is not None:
            finish(tmp)
        _fsync_tree(tmp)
        # The marker goes with the new save and is removed once it is in place: until then a kill
        # leaves a temporary that carries it (the proof that this library made it).
        _swap_into_place(tmp, final)
    except OSError as exc:
        _remove_ours(tmp)
        raise _save_error(final, exc) from exc
    except BaseException:
        _remove_ours(tmp)
        raise
    with contextlib.suppress(OSError):
        (final / TMP_MARKER).unlink()


def _check_target(final: Path) -> None:
    """Refuse a target that is not empty or a complete previous save: saving replaces
    (deletes) what is there, so a directory holding anything a save did not write, or
    missing a file its save listed, is left alone."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise TransformError(f"cannot save to {final}: it exists and is not a directory")
    if not final.is_dir() or not any(final.iterdir()):
        return
    problem = _not_a_complete_save(final)
    if problem:
        raise TransformError(f"cannot save to {final}: {problem}, and saving replaces the whole directory "
                             "(deleting what is there); choose a new or empty directory, or remove it yourself")


def _not_a_complete_save(final: Path) -> str | None:
    """Why ``final`` is not exactly a save's files (``None`` if it is)."""
    from ..interop.gguf_read import is_our_save

    if is_our_save(final):  # a format="gguf" save: its one file
        return None
    try:
        with SaveDir.open(final) as folder:
            meta = read_metadata(folder)
            present = {rel for rel, info in folder.walk() if not stat.S_ISDIR(info.st_mode)}
            links = {rel for rel, info in folder.walk() if stat.S_ISLNK(info.st_mode)}
    except (LoadError, OSError) as exc:
        return f"it is a non-empty directory that holds no transformdsl save ({exc})"
    listed = meta.get("manifest")
    if listed is None:
        return "it holds a transformdsl save without a file list (saved by an older version)"
    listed = set(listed) | {META_FILE}
    present.discard(TMP_MARKER)  # a save killed just after its swap, before removing its marker
    extra, missing = sorted(present - listed), sorted(listed - present)
    if links:
        return f"it holds symbolic links ({', '.join(sorted(links)[:3])})"
    if extra:
        return f"it holds files the save there did not write ({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''})"
    if missing:
        return f"the save there is incomplete (missing {', '.join(missing[:3])})"
    return None


#: Present in a temporary save directory while it is written: ``PID BOOT_ID``.
TMP_MARKER = ".transformdsl-incomplete"


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _boot_tag() -> str:
    """The first field of the boot id: enough to tell this boot's process ids from an earlier one's."""
    return _boot_id().split("-", 1)[0]


#: ``PID.BOOTTAG.random`` after ``.NAME.tmp-``: a temporary directory named by the save that made it.
_TMP_NAME = re.compile(r"(\d{1,10})\.([0-9a-z]{1,16})\.(.*)", re.DOTALL)


#: mkdtemp's random suffix: a temporary directory's whole name is ``.NAME.tmp-PID.BOOTTAG.XXXXXXXX``.
_MKDTEMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")


def _remove_stale_temporaries(final: Path) -> None:
    """Remove ``.NAME.tmp-*`` / ``.NAME.old-*`` siblings left by saves that were killed.

    Only what carries proof that a save made it is removed: a directory holding the marker
    (:data:`TMP_MARKER`, ``PID BOOT_ID``, the process id its name gives, if any), or one
    named exactly as :func:`writing` names its temporaries that is empty or holds a
    partly written marker (a kill while writing it); and only when that process is
    gone (not running on this boot).  A name that merely looks like ours (``.NAME.old-2024``, a
    user's notes in ``.NAME.tmp-1.x``) is left alone, and so is a save still being written.
    """
    for sibling in final.parent.glob(f".{glob.escape(final.name)}.*-*"):
        kind, _, rest = sibling.name[len(final.name) + 2:].partition("-")
        if kind not in ("tmp", "old") or sibling.is_symlink() or not sibling.is_dir():
            continue
        owner = _owner(sibling, kind, rest)
        if owner is None:
            continue  # not ours, or finished and being swapped in: leave it
        pid, boot = owner
        if boot == _boot_id() and _process_alive(pid):
            continue
        _remove_ours(sibling)


def _owner(sibling: Path, kind: str, rest: str) -> tuple[int, str] | None:
    """``(pid, boot id)`` of the save that made ``sibling``, if it carries the proof (see above)."""
    named = _TMP_NAME.fullmatch(rest) if kind == "tmp" else re.fullmatch(r"(\d{1,10})", rest)
    name_pid = int(named.group(1)) if named else None
    try:
        pid_text, boot = (sibling / TMP_MARKER).read_text(encoding="ascii").split()
        pid = int(pid_text)
    except (OSError, ValueError):
        pid = None
    if pid is not None:
        return (pid, boot) if name_pid in (None, pid) else None
    # No readable marker: a save killed between making its directory and writing the marker
    # whole, or while removing a temporary (marker last), or while marking the previous save it
    # had just swapped out.  Ours if named exactly as writing() names it and either empty or
    # holding a partly written marker (no user writes that file).
    if kind != "tmp" or not named or not _MKDTEMP_SUFFIX.fullmatch(named.group(3)):
        return None
    try:
        if not (sibling / TMP_MARKER).is_file() and any(sibling.iterdir()):
            return None
    except OSError:
        return None
    return name_pid, _boot_id() if named.group(2) == _boot_tag() else "other boot"


def _remove_ours(directory: Path) -> None:
    """Remove a temporary directory of ours, its marker last: a kill in the middle leaves what
    carries the marker, or an empty directory, both recognised as ours by the next save."""
    with contextlib.suppress(OSError):
        for entry in list(directory.iterdir()):
            if entry.name == TMP_MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink()
    with contextlib.suppress(OSError):
        (directory / TMP_MARKER).unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _save_error(final: Path, exc: OSError) -> TransformError:
    return TransformError(f"cannot save to {final}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; nothing was written there and a "
                          "previous save there, if any, is intact")



def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2


def _swap_into_place(new: Path, final: Path) -> None:
    """Make ``new`` appear at ``final`` in one step; the previous ``final`` is removed after."""
    if not final.exists():
        os.rename(new, final)
        _fsync_directory(final.parent)
        return
    if not final.is_dir() or final.is_symlink():
        raise TransformError(f"cannot save to {final}: it exists and is not a directory")
    # Mark the previous save before the exchange: at the moment it is swapped out it sits under
    # our temporary's name, and only the marker tells the next save that it may remove it.
    # (Marking it after left a window where a kill stranded a whole unmarked copy.)  A marker
    # in a complete save is ignored by loads and removed by the next save.
    try:
        (final / TMP_MARKER).write_text(f"{os.getpid()} {_boot_id()}\n")
        exchanged = _renameat2_exchange(new, final)
    except BaseException:
        with contextlib.suppress(OSError):
            (final / TMP_MARKER).unlink()  # the previous save stays exactly as it was
        raise
    if exchanged:
        _remove_ours(new)
        _fsync_directory(final.parent)
        return
    # No atomic exchange on this platform: move the old copy aside first, so that at
    # every moment one complete save exists (at `final` or at `old`).
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    try:
        os.rename(final, old)
    except BaseException:
        with contextlib.suppress(OSError):
            (final / TMP_MARKER).unlink()
        raise
    try:
        os.rename(new, final)
    except BaseException:
        os.rename(old, final)  # put the previous save back where it was
        with contextlib.suppress(OSError):
            (final / TMP_MARKER).unlink()
        raise
    _remove_ours(old)
    _fsync_directory(final.parent)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable; best effort once the new save is in place (it is, either way)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


@functools.cache
def _renameat2():
    """libc's ``renameat2``, or ``None``; looked up once (find_library runs ``ldconfig``)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).renameat2
    except (OSError, AttributeError):
        return None


# =========================================================================== load
