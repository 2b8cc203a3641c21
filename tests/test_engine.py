"""The engine under `kvbench run` as a library call (issue 27): kvbench.runtime.engine.run
returns a run's records without typer, printing or a file; what a caller sees goes through
its hooks, and a stop asked by the caller ends the run after the step in progress with
every record marked partial."""

from __future__ import annotations

import contextlib

import pytest

from kvbench.errors import KvbenchError
from kvbench.models import MODELS, ModelSpec
from kvbench.runtime import bound
from kvbench.runtime.breakdown import Metric
from kvbench.runtime.engine import Hooks, RunResult, run
from kvbench.runtime.run import RunConfig
from kvbench.strategies.full import Full

TINY = ModelSpec("tiny-engine", "llama", 2, 4, 2, 64, 128, 256, 128)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, TINY.name, TINY)
    known = bound.Bandwidth({"host": 10.0, "accel": 10.0, "h2d": 10.0, "d2h": 10.0}, True,
                            "probe", {"host": "handed to the test"})
    monkeypatch.setattr(bound, "probe", lambda cuda, threads: known)


CFG = RunConfig(model=TINY.name, weights="random", prompt_len=8, gen_len=4, threads=1)


def test_a_run_returns_its_records_and_prints_nothing(tiny: None, capsys) -> None:
    seen: list[tuple] = []

    @contextlib.contextmanager
    def status(text: str):
        seen.append(("status", text))
        yield

    def progress(what: str, total: int):
        seen.append(("progress", what, total))
        return lambda: seen.append(("step",))

    result = run(Full, Full.params(), CFG, Hooks(status=status, progress=progress,
                                                say=lambda k, t: seen.append((k, t))))
    assert isinstance(result, RunResult) and result.interrupted == ""
    assert capsys.readouterr() == ("", "")
    assert seen[0] == ("status", "loading tiny-engine (random weights, 2 layers)")
    assert ("progress", "full: decode", 4) in seen and seen.count(("step",)) == 4
    tbt = next(r for r in result.records if r.metric == "tbt")
    assert len(tbt.samples) == 4 and tbt.params == result.params
    assert {r.version for r in result.records} == {Full.version}
    assert all("backend" in r.method for r in result.records)
    assert result.fit["kv_bytes"] > 0 and result.accuracy.startswith("random weights")


def test_a_stop_asked_by_the_caller_ends_the_run_after_that_step(tiny: None) -> None:
    steps = iter(range(10))
    result = run(Full, Full.params(), CFG,
                 Hooks(stop=lambda: "a test's stop" if next(steps) == 1 else None))
    why = "interrupted by a test's stop after 2 of 4 decode steps"
    assert result.interrupted == why
    assert {r.method["partial"] for r in result.records} == {why}
    assert result.params["steps_completed"] == 2
    tbt = next(r for r in result.records if r.metric == "tbt")
    assert len(tbt.samples) == 2


def test_bad_input_is_refused_before_anything_runs(tiny: None) -> None:
    with pytest.raises(KvbenchError, match="--threads -1: 0"):
        run(Full, Full.params(), RunConfig(model=TINY.name, threads=-1))


class _Hits(Full):
    """Full attention that counts 2 "hits" per decode layer: a figure it declares."""

    name = "hits"
    metrics = (Metric("hits_per_step", "tokens", "higher", "step", of="hits",
                      per="decode step: hits summed over layers"),)

    def decode(self, layer, q, k, v):
        self.ctx.counters.add("hits", "accel", 2.0)
        return super().decode(layer, q, k, v)


def test_a_declared_metric_reaches_the_records_as_declared(tiny: None) -> None:
    """The strategy's own figure carries its declared unit, direction and reduction (summed
    over the 2 layers per decode step), and its counter's trace records the declared unit."""
    recs = run(_Hits, Full.params(), CFG, Hooks()).records
    (fig,) = [r for r in recs if r.metric == "hits_per_step"]
    assert (fig.unit, fig.direction, fig.samples) == ("tokens", "higher", [4.0] * 4)
    assert (fig.method["per"], fig.method["statistic"]) == (
        "decode step: hits summed over layers", "median")
    trace = [r for r in recs if r.metric == "trace.hits"]
    assert len(trace) == 2 * 2 and {(r.unit, r.direction) for r in trace} == {("tokens", "none")}


def test_an_undeclared_counter_fails_the_run_naming_it(tiny: None) -> None:
    """No figure reaches the records without a declared unit and direction."""

    class Undeclared(_Hits):
        metrics = ()

    with pytest.raises(ValueError, match=r"'hits' is undeclared: add a Metric"):
        run(Undeclared, Full.params(), CFG, Hooks())


def test_a_metric_declaration_is_checked() -> None:
    with pytest.raises(ValueError, match="metric 'x': reduction one of"):
        Metric("x", "s", reduction="mean")
    with pytest.raises(ValueError, match="derive given exactly for 'own'"):
        Metric("x", "s", reduction="own")
    with pytest.raises(ValueError, match="direction lower, higher or none"):
        Metric("x", "s", "up")
