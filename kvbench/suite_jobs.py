"""Running a suite's units on this machine: one after another, or `--jobs N` at a time.

With N > 1, non-exclusive cases run in N worker processes (spawned, each parses the suite
from its text once) and each unit's records come back to the parent, the one writer of the
result file, as the unit finishes, in whatever order. An exclusive case (every speed case
by default, suite_spec) waits until no worker is busy and then runs alone in the parent, so
no other case shares the machine while it is timed. Records of units that ran beside
others are marked `method.concurrent_jobs` by the writer.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from kvbench.schema import Record
from kvbench.suite_spec import Suite, load_suite
from kvbench.suite_units import CaseInterrupted, Unit, execute, has_gpu, units

Result = tuple[Unit, list[Record], dict[str, Any] | None, bool]  # unit, records, env, shared

_SUITES: dict[tuple[str, str], dict[str, Unit]] = {}  # per worker process: parsed suites


def unit_in(path: str, text: str, key: str) -> Unit:
    """The unit with this case id of the suite given by its text (parsed once per process)."""
    if (path, text) not in _SUITES:
        _SUITES[(path, text)] = {u.case_id: u for u in units(load_suite(Path(path), text))}
    return _SUITES[(path, text)][key]


def _work(path: str, text: str, key: str, gpu: bool) -> list[Record]:
    try:
        return execute(unit_in(path, text, key), gpu)
    except CaseInterrupted as e:  # its unit does not pickle: the interrupt goes back alone
        raise e.cause from None


def run_local(suite: Suite, pending: list[Unit], jobs: int) -> Iterator[Result]:
    """Yield (unit, records, None, ran beside others) as each unit finishes."""
    gpu = any(u.case.requires == "gpu" for u in pending) and has_gpu()
    if jobs <= 1 or sum(not u.case.exclusive for u in pending) < 2:
        for unit in pending:
            yield unit, execute(unit, gpu), None, False
        return
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    running: dict[Future, Unit] = {}
    try:
        queue = list(pending)
        while queue or running:
            while queue and len(running) < jobs and not queue[0].case.exclusive:
                unit = queue.pop(0)
                running[pool.submit(_work, str(suite.path), suite.text, unit.case_id,
                                    gpu)] = unit
            if queue and queue[0].case.exclusive and not running:
                unit = queue.pop(0)
                yield unit, execute(unit, gpu), None, False
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                unit = running.pop(fut)
                yield unit, _records(fut, unit), None, True
    finally:  # an interrupt: what finished is written; the rest is dropped, not waited for
        pool.shutdown(wait=not running, cancel_futures=True)


def _records(fut: Future, unit: Unit) -> list[Record]:
    """The unit's records, or its error record when the worker process died under it."""
    from kvbench.schema import not_measured

    try:
        return fut.result()
    except Exception as e:  # BrokenProcessPool: the worker was killed mid-case
        case = unit.case
        return [not_measured(case.kind, case.name, "case", "error",
                             f"worker process lost: {type(e).__name__}: {e}".strip(),
                             unit.params)]
