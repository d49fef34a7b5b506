"""Where ``tune`` keeps what it measured: an optuna study (SQLite file, database URL, or in memory).

Each unit of work (one mode measured on every layer; one whole script measured) is a trial whose user
attribute ``key`` names it and whose ``result`` holds the figures.  Before measuring, a worker
*claims* the unit by opening a trial for its key; the claim with the lowest trial number wins, so
two workers sharing a storage measure different units, and each reads the other's results.  A unit
already complete is read back, never measured again: an interrupted tune resumes where it stopped.
An interrupted unit is marked failed (so the next run measures it); a claim left running by a
process that is gone (same host, its pid not alive) or older than ``stale_after`` seconds is ignored.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

#: Seconds after which a claim nobody finished is taken over (the claimant died elsewhere).
STALE_AFTER = 3600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Study:
    """A tune's measurements in an optuna study named ``name`` in ``storage`` (a path or URL; None: in memory)."""

    def __init__(self, storage: str | None, name: str, stale_after: float = STALE_AFTER):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.name = name
        self.stale_after = stale_after
        if storage is not None and "://" not in str(storage):
            storage = f"sqlite:///{os.path.abspath(storage)}"
        self.storage = storage
        self.study = self._open(storage, name)
        #: Units measured by this process, and units read back from the storage.
        self.measured: list[str] = []
        self.reused: list[str] = []

    def _open(self, storage: str | None, name: str, attempts: int = 20):
        """The study, created or loaded.  Workers starting together race to create the database's
        tables (``UNIQUE constraint failed: alembic_version``): the loser tries again.  SQLite waits up
        to a minute for another worker's write lock instead of failing at once."""
        optuna = self._optuna
        for attempt in range(attempts):
            try:
                backend = storage
                if storage is not None:
                    kwargs = {"connect_args": {"timeout": 60}} if storage.startswith("sqlite") else {}
                    backend = optuna.storages.RDBStorage(storage, engine_kwargs=kwargs)
                return optuna.create_study(storage=backend, study_name=name, load_if_exists=True,
                                           direction="minimize")
            except Exception as exc:  # sqlalchemy's IntegrityError/OperationalError while another creates it
                if attempt == attempts - 1 or type(exc).__name__ not in ("IntegrityError", "OperationalError",
                                                                          "DuplicatedStudyError"):
                    raise
                time.sleep(0.2 + 0.1 * attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _trials(self, key: str) -> list:
        return [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("key") == key]

    def _live(self, trial) -> bool:
        State = self._optuna.trial.TrialState
        if trial.state == State.COMPLETE:
            return True
        if trial.state != State.RUNNING:
            return False
        if time.time() - float(trial.user_attrs.get("claimed_at", 0)) > self.stale_after:
            return False
        host, pid = trial.user_attrs.get("host"), trial.user_attrs.get("pid")
        return not (host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and not _alive(pid))

    def done(self, key: str) -> dict | None:
        """The result of ``key`` if some worker completed it (the lowest-numbered), else None."""
        State = self._optuna.trial.TrialState
        complete = [t for t in self._trials(key) if t.state == State.COMPLETE]
        return min(complete, key=lambda t: t.number).user_attrs.get("result") if complete else None

    def claim(self, key: str):
        """A trial to measure ``key`` in, or None when another worker holds it or has done it."""
        trial = self.study.ask()
        for name, value in (("key", key), ("claimed_at", time.time()), ("host", socket.gethostname()),
                            ("pid", os.getpid())):
            trial.set_user_attr(name, value)
        rivals = [t for t in self._trials(key) if t.number != trial.number and self._live(t)]
        State = self._optuna.trial.TrialState
        if any(t.state == State.COMPLETE or t.number < trial.number for t in rivals):
            self.study.tell(trial, state=State.PRUNED)
            return None
        return trial

    def finish(self, trial, result: dict, value: float) -> None:
        trial.set_user_attr("result", result)
        self.study.tell(trial, value if value == value and abs(value) != float("inf") else 1e300)

    def fail(self, trial) -> None:
        try:
            self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        except Exception:  # already told, or the storage is gone: the claim goes stale either way
            pass

    def held_elsewhere(self, key: str) -> bool:
        """Whether another worker's claim on ``key`` is still running."""
        State = self._optuna.trial.TrialState
        return any(t.state == State.RUNNING and self._live(t) for t in self._trials(key))

    def run(self, key: str, measure, value_of, poll: float = 0.5) -> dict:
        """The result of ``key``: read back when done, else measured here by ``measure()`` (a dict;
        ``value_of(result)`` is the trial's value), or waited for while another worker measures it."""
        while True:
            found = self.done(key)
            if found is not None:
                if key not in self.measured:
                    self.reused.append(key)
                return found
            if self.held_elsewhere(key):
                time.sleep(poll)
                continue
            trial = self.claim(key)
            if trial is None:
                continue
            try:
                result = measure()
            except BaseException:
                self.fail(trial)
                raise
            self.finish(trial, result, float(value_of(result)))
            self.measured.append(key)
            return result


def study_name(*parts: Any) -> str:
    """A study name that changes with what was measured (the model, the inputs, the modes' versions)."""
    import hashlib

    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return f"transformdsl-tune-{digest}"
