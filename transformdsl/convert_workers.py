"""The processes of ``convert --workers N``: units handed out to a pool, their tensors handed back in order.

``convert`` with ``workers=N`` converts its repeated blocks in ``N`` worker processes while it reads,
converts and writes the rest itself, in order.  Each worker opens the source and plans the script
once, exactly as ``convert`` did (the plan is deterministic), then, per unit it is given, reads that
unit's tensors, runs the statements on it with the same code, and writes the result to a part file
(a safetensors file, tensors in the order ``convert`` would add them) beside the output.  The parent
adds each part's tensors to the output's shards in unit order and deletes the part, so the shards,
their boundaries and the metadata are those of one process, byte for byte.

Why processes, and files between them: the statements' Python (and much of their torch work) holds
one core per process, and a block of a 13B model is hundreds of MB, more than a pipe should carry
and more than ``/dev/shm`` of a container may hold; a part file costs one write and one read of
bytes the page cache usually still holds.  At most ``2 × N`` parts wait on disk at once.

This module is the parent's side (:class:`WorkerPool`) and the part files' format; the worker's own
work (opening, planning, converting one unit) is :mod:`transformdsl.streaming`'s, passed in as
functions.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import dataclasses
import datetime
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch

from .errors import LoadError, TransformError
from .persist.safetensors_io import StreamingWriter

#: The folder, inside the output's temporary directory, the workers write their parts to.
PARTS = ".workers"


@dataclasses.dataclass
class Part:
    """A unit converted by a worker: where its tensors are, and what ``convert`` records of it."""

    index: int
    path: str
    keys: list[str]  # in the order convert adds them to the shards
    records: list[tuple[int, int, dict]]  # (statement index, order among its targets, record)
    layout: dict  # collect_tensors' layout of the unit's part
    stats: dict[int, list[float]]  # statement index -> modules, bytes before, bytes after, seconds
    read: int  # source bytes read


@dataclasses.dataclass
class Failure:
    """An exception in a worker, as text (nothing is unpickled that a worker's error could shape)."""

    module: str
    name: str
    message: str
    trace: str

    def exception(self) -> BaseException:
        """The error to raise in the parent: transformdsl's own errors and Python's built-in ones keep
        their class and message (the worker's traceback as a note); any other is a TransformError."""
        if self.module == "transformdsl.errors" and self.name in ("TransformError", "LoadError"):
            error: BaseException = LoadError(self.message) if self.name == "LoadError" else TransformError(self.message)
        elif self.module.startswith("transformdsl"):
            error = TransformError(self.message)  # a ScriptError's message is whole; its spans stay behind
        elif self.module == "builtins" and isinstance(getattr(builtins, self.name, None), type) \
                and issubclass(getattr(builtins, self.name), Exception):
            try:
                error = getattr(builtins, self.name)(self.message)
            except Exception:  # noqa: BLE001 - a built-in that wants other arguments
                error = RuntimeError(f"{self.name}: {self.message}")
        else:
            error = TransformError(f"{self.name}: {self.message}")
        error.add_note(f"in a convert worker process:\n{self.trace}")
        return error


def failure(exc: BaseException) -> Failure:
    """``exc`` as a :class:`Failure` to hand back."""
    import traceback

    return Failure(type(exc).__module__, type(exc).__qualname__, str(exc), "".join(traceback.format_exception(exc)))


def write_part(path: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write a unit's tensors to ``path`` (streamed, as the shards are); their names, in order."""
    writer = StreamingWriter(path)
    try:
        for key, tensor in tensors.items():
            writer.add(key, tensor)
        writer.close()
    except BaseException:
        writer.discard()
        raise
    return list(tensors)


def read_part(part: Part) -> Iterator[tuple[str, torch.Tensor]]:
    """The part's tensors in its order, one at a time (each a copy out of the mapped file); the file is
    deleted once they are read."""
    from safetensors import safe_open

    with safe_open(part.path, framework="pt") as handle:
        for key in part.keys:
            yield key, handle.get_tensor(key)
    os.unlink(part.path)


class WorkerPool:
    """``count`` spawned processes converting the units at ``indices``, at most ``window`` ahead of
    the one the parent asks for.

    ``start(*start_args)`` runs once in each process (opening the source, planning), ``work(index)`` per
    unit: it returns a :class:`Part` or a :class:`Failure`.  :meth:`result` returns unit ``index``'s
    part (waiting for it), raising the worker's error as the parent's own.  :meth:`close` cancels what
    has not started and waits for what has (no worker writes into a directory being removed).
    """

    def __init__(self, count: int, start: Callable, start_args: tuple, work: Callable[[int], Any],
                 indices: list[int], window: int):
        self.work = work
        self.pending = list(indices)
        self.window = window
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=count, mp_context=multiprocessing.get_context("spawn"), initializer=start,
            initargs=start_args)
        self._fill()

    def __contains__(self, index: int) -> bool:
        return index in self.futures or index in self.pending

    def _fill(self) -> None:
        while self.pending and len(self.futures) < self.window:
            index = self.pending.pop(0)
            self.futures[index] = self.executor.submit(self.work, index)

    def result(self, index: int) -> Part:
        if index not in self.futures:  # asked ahead of the window: hand it out now
            self.pending.remove(index)
            self.futures[index] = self.executor.submit(self.work, index)
        future = self.futures.pop(index)
        try:
            answer = future.result()
        except BrokenProcessPool:
            raise TransformError("a convert worker process ended without an answer: killed, out of memory (convert "
                                 "with fewer workers), or it could not start (a script calling convert(workers=N) "
                                 "must do so under 'if __name__ == \"__main__\":', as for any spawned process); "
                                 "nothing was written") from None
        self._fill()
        if isinstance(answer, Failure):
            raise answer.exception()
        return answer

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        self.pending.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def pool(count: int, start: Callable, start_args: tuple, work: Callable[[int], Any], indices: list[int]
         ) -> Iterator[WorkerPool]:
    """A :class:`WorkerPool` closed on the way out, whatever happened."""
    workers = WorkerPool(count, start, start_args, work, indices, window=2 * count)
    try:
        yield workers
    finally:
        workers.close()


def threads_per_worker(count: int) -> int:
    """Each worker's share of this process's torch threads (at least one)."""
    return max(1, torch.get_num_threads() // count)


# --------------------------------------------------------------------------- samples shared between processes

#: How long a process sharing calibration samples waits for the others at one exchange (they do the
#: same work between exchanges, so a long wait means a process is stuck or gone).
TIMEOUT = datetime.timedelta(minutes=30)


def _gloo(store, rank: int, size: int):
    """A gloo process group of our own over loopback: not torch.distributed's default group, so a
    caller's own process group (or none) is left as it is."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, options)


def join_group(port: int, rank: int, size: int):
    """In a helper process: the group the parent (rank 0) made, listening on ``port``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    return _gloo(store, rank, size)


class SampleGroup:
    """The processes sharing a calibrated statement's samples with this one (``convert --workers N``).

    This process is rank 0; ranks 1.. are spawned running ``target(rank, size, port, share, *args,
    pipe)``, where ``share`` is the rank's ``(first sample, count)``.  Each says ``"ready"`` on its
    pipe before joining the group, then ``"done"`` when its work is done, or a :class:`Failure`.
    :attr:`group` is the gloo group the shares sum their statistics over.
    """

    def __init__(self, shares: list[tuple[int, int]], target: Callable, args: tuple):
        import torch.distributed as dist

        self.size = len(shares)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=TIMEOUT,
                                   wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list[Any] = []
        for rank in range(1, self.size):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=target, args=(rank, self.size, self.store.port, shares[rank], *args,
                                                           send), daemon=True)
            process.start()
            send.close()
            self.processes.append(process)
            self.pipes.append(receive)
        for process, pipe in zip(self.processes, self.pipes):
            if self._answer(process, pipe) != "ready":
                raise self.failure()
        self.group = _gloo(self.store, 0, self.size)

    @staticmethod
    def _answer(process, pipe, wait: float | None = None) -> Any:
        """The process's next message (waiting while it lives, at most ``wait`` seconds), or None if it
        ended without one."""
        waited = 0.0
        while not pipe.poll(0.2):
            waited += 0.2
            if not process.is_alive() or (wait is not None and waited >= wait):
                return pipe.recv() if pipe.poll(0) else None
        try:
            return pipe.recv()
        except EOFError:
            return None

    def failure(self) -> BaseException:
        """The error to raise after an exchange failed: the first helper's own, or one saying a helper
        ended without an answer."""
        failures = [answer for answer in (self._answer(process, pipe, wait=30.0)
                                          for process, pipe in zip(self.processes, self.pipes))
                    if isinstance(answer, Failure)]
        # a helper's own error before another's "connection closed" (which only says it saw one end)
        failures.sort(key=lambda failure: "gloo" in failure.trace.lower() or "connection closed" in failure.message.lower())
        if failures:
            return failures[0].exception()
        return TransformError("a convert worker process sharing the calibration samples ended without an answer: "
                              "killed, out of memory (convert with fewer workers), or it could not start (a script "
                              "calling convert(workers=N) must do so under 'if __name__ == \"__main__\":', as for "
                              "any spawned process); nothing was written")

    def finish(self) -> None:
        """Wait for every helper's end, raising the first one's error."""
        for process, pipe in zip(self.processes, self.pipes):
            answer = self._answer(process, pipe)
            if answer != "done":
                raise answer.exception() if isinstance(answer, Failure) else self.failure()
            process.join()

    def close(self) -> None:
        """End the helpers that are still running (after a failure here) and forget the group."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        for pipe in self.pipes:
            pipe.close()
        self.group = None
