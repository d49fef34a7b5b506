"""Where the undo log keeps originals past its memory budget: on disk, or in their own file.

:class:`~transformdsl.edit.Edit` keeps every module and tensor a transform replaces, so that a
failure can put them back.  Kept in memory, they double the memory a transform needs (a model
cast to fp8 holds its bf16 originals until the script ends).  An :class:`UndoStore` bounds that:
once the originals held by the log alone exceed ``budget`` bytes, their bytes leave memory:

- a tensor memory-mapped from a file (``from_pretrained`` of a safetensors checkpoint in its own
  dtype) whose pages are still the file's (not written to since: checked page by page in
  ``/proc/self/pagemap``) just gives its pages back (``madvise(MADV_DONTNEED)``); the kernel reads
  them from the file again if the transform is rolled back (the file's identity, size and
  modification time are checked then);
- any other tensor is written to a private temporary file (created unlinked with
  ``tempfile.TemporaryFile``: it has no name, and the system frees it when it is closed, or when
  the process ends however it ends), then its storage is resized to 0 bytes; a rollback reads
  the bytes back into the same storage, so every tensor, ``Parameter`` and module object is the
  one the model had, bit for bit (only the address of a restored storage differs).

Only what the log alone holds leaves memory: a module or tensor that anything else refers to
(the live model, a tied weight, a view, the caller's own variable) stays where it is.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass

import torch
from torch import nn

#: ``undo=`` choices of :func:`transformdsl.transform`.
UNDO_MODES = ("auto", "memory", "disk")
#: The ``auto`` budget: this share of the model's parameter bytes, within the bounds below.
AUTO_SHARE = 0.05
AUTO_MIN = 64 << 20
AUTO_MAX = 1 << 30
#: Writes and reads of the undo file go in pieces of at most this many bytes (Linux caps one at 2 GiB).
CHUNK = 1 << 30
#: Edits after which an original still referred to elsewhere waits for the end of its statement.
RETRIES = 2
PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def auto_budget(model_bytes: int) -> int:
    """The ``undo="auto"`` budget for a model of ``model_bytes`` parameter bytes."""
    return int(min(AUTO_MAX, max(AUTO_MIN, AUTO_SHARE * model_bytes)))


def check_undo_options(undo: str, budget: int | None) -> None:
    """Raise ``ValueError`` naming the fix for an unknown mode or a negative budget."""
    if undo not in UNDO_MODES:
        raise ValueError(f"transform(undo={undo!r}): expected one of {', '.join(map(repr, UNDO_MODES))}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"transform(undo_budget={budget!r}): expected a number of bytes >= 0, or None")


@dataclass
class _OnDisk:
    storage: torch.UntypedStorage
    offset: int
    nbytes: int


@dataclass
class _InFile:
    path: str
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


class UndoStore:
    """Takes the originals an :class:`~transformdsl.edit.Edit` alone holds out of memory past ``budget`` bytes.

    ``offer(obj)`` is called with each original (module or tensor) the edit has just detached from
    the model; :meth:`settle` when nothing outside the log should refer to them any more (after
    each statement); :meth:`restore` on rollback, :meth:`close` at the end (always).
    """

    def __init__(self, budget: int, directory: str | os.PathLike | None = None) -> None:
        self.budget = budget
        self.directory = directory
        self.spilled_bytes = 0   # written to the undo file
        self.dropped_bytes = 0   # memory-mapped pages given back
        self._file = None
        self._end = 0
        self._on_disk: list[_OnDisk] = []
        self._in_files: dict[str, _InFile] = {}
        self._pending: list[list] = []            # [object, tries]: detached, maybe still referred to
        self._later: list[list] = []              # still referred to after RETRIES edits: at settle()
        self._kept: list[tuple[torch.Tensor, int]] = []   # held by the log alone, in memory (auto budget)
        self._kept_bytes = 0
        self._seen: set[int] = set()               # storages already handled
        self._maps: list[tuple[int, int, str]] | None = None   # file mappings: start, end, their line
        self._pagemap: int | None = None                          # /proc/self/pagemap, opened once
        self._broken = False

    # ------------------------------------------------------------------ taking originals

    def offer(self, obj: object) -> None:
        """``obj`` was just detached from the model by the edit (an original it keeps for rollback)."""
        if isinstance(obj, (nn.Module, torch.Tensor)):
            self._pending.append([obj, 0])
            self._retry(final=False)

    def settle(self) -> None:
        """Last look at every pending original (a statement is done: its locals are gone)."""
        self._pending += self._later
        self._later = []
        self._retry(final=True)

    def _retry(self, final: bool) -> None:
        """Take what the log alone holds now; what is still held elsewhere waits for the next
        edits (a pass's local variable), then for :meth:`settle`."""
        still = []
        for entry in self._pending:
            obj, tries = entry
            # references: this entry's list, ``obj``, getrefcount's argument, and whoever holds it
            holders = sys.getrefcount(obj) - 3
            tensors = self._exclusive_tensors(obj, holders)
            if tensors is None and not final:
                entry[1] = tries + 1
                (still if tries + 1 < RETRIES else self._later).append(entry)
                continue
            for tensor in tensors or ():
                self._take(tensor)
        self._pending = still
        obj = entry = None  # noqa: F841 - not held past the loop
        self._fit_budget()

    def _exclusive_tensors(self, obj, holders: int) -> list[torch.Tensor] | None:
        """The tensors only ``obj`` holds, if the log (one holder) is all that holds ``obj``; else None."""
        if holders != 1:
            return None
        if isinstance(obj, torch.Tensor):
            return [obj]
        out: list[torch.Tensor] = []
        stack = [obj]
        while stack:
            module = stack.pop()
            for container in ("_parameters", "_buffers"):
                for value in vars(module).get(container, {}).values():
                    # the container's reference, getrefcount's argument, the loop variable
                    if isinstance(value, torch.Tensor) and sys.getrefcount(value) == 3:
                        out.append(value)
            for child in vars(module).get("_modules", {}).values():
                if child is not None and sys.getrefcount(child) == 3:  # the parent's dict alone
                    stack.append(child)
        return out

    def _take(self, tensor: torch.Tensor) -> None:
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.device.type != "cpu" or not tensor.numel():
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        if not storage.resizable():  # not the allocator's memory: perhaps a mapped file's
            self._drop_mapped_pages(tensor)
            return
        # one tensor on this storage (+ the wrapper above): no view or other tensor shares the bytes
        if torch._C._storage_Use_Count(storage._cdata) != 2 or not storage.resizable():
            return
        self._seen.add(key)
        self._kept.append((storage, storage.nbytes()))
        self._kept_bytes += storage.nbytes()

    def _fit_budget(self) -> None:
        if self._kept_bytes <= self.budget:
            return
        target = self.budget // 2
        while self._kept and self._kept_bytes > target and not self._broken:
            storage, nbytes = self._kept.pop(0)
            self._kept_bytes -= nbytes
            self._spill(storage, nbytes)

    def _spill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=self.directory, prefix="transformdsl-undo-")
            _pwrite_all(self._file.fileno(), _bytes_of(storage), self._end)
        except OSError as exc:  # disk full, no such directory: keep the rest in memory, as before
            self._broken = True
            warnings.warn(f"transform: cannot keep originals on disk ({exc}); keeping them in memory",
                          ResourceWarning, stacklevel=4)
            return
        # recorded before the bytes go: an interrupt in between leaves a record a rollback can replay
        self._on_disk.append(_OnDisk(storage, self._end, nbytes))
        self._end += nbytes
        storage.resize_(0)
        self.spilled_bytes += nbytes

    # ------------------------------------------------------------------ memory-mapped originals

    def _mapping(self, address: int) -> tuple[int, int, int, str, int, int] | None:
        """The file mapping (start, end, offset, path, dev, inode) holding ``address``, if any."""
        if self._maps is None:
            self._maps = _file_mappings()
        i = bisect.bisect_right(self._maps, (address, float("inf"))) - 1
        if i >= 0 and self._maps[i][0] <= address < self._maps[i][1]:
            return _parsed_mapping(self._maps[i])
        return None

    def _drop_mapped_pages(self, tensor: torch.Tensor) -> bool:
        """Give back the pages of a tensor that still reads its file's bytes; whether it gave any back."""
        start = tensor.data_ptr()
        span = page_span(tensor)
        first, last = -(-start // PAGE) * PAGE, (start + span) // PAGE * PAGE
        if last <= first:
            # less than a page of its own: nothing to give back (and no need to read the process's
            # mappings, a millisecond of the kernel's time, for a model of small layers)
            return False
        mapping = self._mapping(start)
        if mapping is None or start + span > mapping[1]:
            return False
        if self._pagemap is None:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
            except OSError:
                return False
        if not pages_are_the_files(first, last, self._pagemap):
            return False
        _, _, _, path, dev, inode = mapping
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if stat.st_ino != inode:
            return False  # the path now names another file (device numbers differ on overlays: not compared)
        if madvise_dontneed(first, last - first) != 0:
            return False
        self._in_files.setdefault(path, _InFile(path, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)))
        self.dropped_bytes += last - first
        return True

    # ------------------------------------------------------------------ rollback and end

    def restore(self) -> None:
        """Put every spilled byte back (rollback); raise if a mapped file changed meanwhile."""
        problems = []
        for record in self._on_disk:
            if record.storage.nbytes() != record.nbytes:
                record.storage.resize_(record.nbytes)
            _pread_all(self._file.fileno(), _bytes_of(record.storage), record.offset)
        self._on_disk.clear()
        for record in self._in_files.values():
            try:
                stat = os.stat(record.path)
                now = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            except OSError as exc:
                now = str(exc)
            if now != record.identity:
                problems.append(record.path)
        self._in_files.clear()
        if problems:
            from .errors import TransformError

            raise TransformError("rollback: the model's weights are memory-mapped from " + ", ".join(problems) +
                                 ", which changed during the transform; reload the model from its files "
                                 "(or use transform(..., undo='memory') while they may change)")

    def close(self) -> None:
        """Free the undo file and forget everything (after commit or rollback)."""
        self._pending.clear()
        self._later.clear()
        self._kept.clear()
        self._on_disk.clear()
        self._seen.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._pagemap is not None:
            os.close(self._pagemap)
            self._pagemap = None


# ---------------------------------------------------------------------- helpers

def page_span(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to the end of its last."""
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


def _bytes_of(storage: torch.UntypedStorage):
    """A writable byte view (no copy) of ``storage``; not through numpy, which makes a storage fixed-size."""
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + CHUNK], offset + done)


def _pread_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + CHUNK]], offset + done)
        if n <= 0:
            raise OSError(f"the undo file ended early ({done} of {len(view)} bytes read)")
        done += n


def _file_mappings() -> list[tuple[int, int, str]]:
    """This process's mappings of regular files, sorted by address (empty off Linux): the address
    range of each, and its line of ``/proc/self/maps`` (parsed when a tensor falls in it)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            text = f.read()
    except OSError:
        return []
    for line in text.splitlines():
        if " /" not in line:  # anonymous, [heap], [stack]...: only regular files have a path
            continue
        dash = line.index("-")
        out.append((int(line[:dash], 16), int(line[dash + 1:line.index(" ", dash)], 16), line))
    out.sort()
    return out


def _parsed_mapping(entry: tuple[int, int, str]) -> tuple[int, int, int, str, int, int] | None:
    """(start, end, offset, path, dev, inode) of one mapping found by :func:`_file_mappings`."""
    start, end, line = entry
    parts = line.split(maxsplit=5)
    if len(parts) < 6 or not parts[5].startswith("/"):
        return None
    major, minor = (int(x, 16) for x in parts[3].split(":"))
    return start, end, int(parts[2], 16), parts[5], os.makedev(major, minor), int(parts[4])


def pages_are_the_files(first: int, last: int, pagemap: int | None = None) -> bool:
    """Whether no page in [first, last) was written to (copied on write) or swapped out;
    ``pagemap``: an open descriptor of ``/proc/self/pagemap`` (else opened for this call)."""
    import numpy as np

    pages = (last - first) // PAGE
    try:
        if pagemap is None:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                data = os.pread(f.fileno(), pages * 8, first // PAGE * 8)
        else:
            data = os.pread(pagemap, pages * 8, first // PAGE * 8)
    except OSError:
        return False
    if len(data) != pages * 8:
        return False
    # bits 63, 62, 61 of an entry: present, swapped, file page (or shared).  A page is the file's
    # if it is not present and not swapped (0b000, 0b001) or present as a file page (0b101);
    # anything else was written to (present and anonymous: copied on write) or swapped out.
    flags = np.frombuffer(data, dtype=np.uint64) >> np.uint64(61)
    return not bool(((flags > 1) & (flags != 5)).any())


_LIBC_MADVISE = None


def madvise_dontneed(address: int, length: int) -> int:
    global _LIBC_MADVISE
    try:
        if _LIBC_MADVISE is None:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _LIBC_MADVISE = madvise
        return _LIBC_MADVISE(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_DONTNEED)
    except (OSError, AttributeError):
        return -1
