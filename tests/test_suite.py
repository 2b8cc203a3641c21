"""Suites: validation with lines, sweeps, errors recorded, resume after a real kill, check."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.compare import compare_sets
from kvbench.errors import KvbenchError
from kvbench.schema import measured
from kvbench.store import ResultWriter, load
from kvbench.suite import load_suite, machine_class, recorded_units, run_suite, units

REPO = Path(__file__).resolve().parent.parent
TIMER = '[[case]]\nprobe = "timer"\nparams = { calls = 200, reps = 3 }\n'


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(f'[suite]\nname = "t"\noutput = "{tmp_path / "out.jsonl"}"\n' + text)
    return path


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_every_problem_reported_with_its_line(tmp_path, capsys):
    path = write(tmp_path, 'bogus = 1\n\n[[case]]\nprobe = "timer"\n'
                           'params = { calls = "lots", nope = 2 }\nsweep = { reps = [3, true] }\n'
                           'requires = "tpu"\n\n[[case]]\nprobe = "nosuch"\n')
    assert run_cli(["suite", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "6 problem(s), nothing was run" in err
    for line, text in [(4, "unknown key 'bogus'"), (8, "timer has no parameter 'nope'"),
                       (8, "timer.calls: expected an integer or a size"),
                       (9, "timer.reps: expected an integer"), (10, "requires must be"),
                       (13, "unknown probe 'nosuch'")]:
        assert f"s.toml:{line}: {text}" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_toml_is_one_line(tmp_path, capsys):
    path = write(tmp_path, "[[case]\n")
    assert_usage_error(cli(["suite", "run", str(path)], capsys), "not valid TOML", "line")


def test_sweep_and_repetitions_expand_with_stable_ids(tmp_path):
    suite = load_suite(write(tmp_path, TIMER + "sweep = { reps = [3, 4] }\nrepetitions = 2\n"))
    us = units(suite)
    assert [u.params["reps"] for u in us] == [3, 3, 4, 4]
    assert len({u.case_id for u in us}) == 4
    assert [u.case_id for u in units(load_suite(suite.path))] == [u.case_id for u in us]
    assert [u.label for u in units(suite, "timer*reps=4*")] == ["timer[calls=200,reps=4]#0",
                                                                "timer[calls=200,reps=4]#1"]
    assert us[0].command() == "kvbench probe timer --calls 200 --reps 3"


def test_round_order_interleaves_repetitions(tmp_path, capsys):
    """order = "round": every case's repetition r before any case's r + 1, the units (and
    their ids) otherwise those of the default order; an unknown order is one line."""
    text = TIMER + "sweep = { reps = [3, 4] }\nrepetitions = 2\n"
    by_case = units(load_suite(write(tmp_path, text)))
    path = write(tmp_path, 'order = "round"\n' + text, "r.toml")
    by_round = units(load_suite(path))
    assert [(u.params["reps"], u.rep) for u in by_round] == [(3, 0), (4, 0), (3, 1), (4, 1)]
    assert sorted(u.case_id for u in by_round) == sorted(u.case_id for u in by_case)
    bad = write(tmp_path, 'order = "random"\n' + TIMER, "b.toml")
    assert_usage_error(cli(["suite", "run", str(bad)], capsys), "b.toml:4:", "order must be")


def test_failing_case_is_recorded_and_suite_goes_on(tmp_path, monkeypatch, capsys):
    from kvbench.probes.timer import TimerProbe

    calls = []

    def flaky(self, config):
        calls.append(config.reps)
        if config.reps == 3:
            raise RuntimeError("boom")
        yield measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0], {"reps": config.reps})

    monkeypatch.setattr(TimerProbe, "run", flaky)
    path = write(tmp_path, TIMER + "sweep = { reps = [3, 4] }\n\n" + TIMER + 'requires = "gpu"\n')
    monkeypatch.setattr("kvbench.suite_jobs.has_gpu", lambda: False)
    assert run_cli(["suite", "run", str(path)]) == 1
    recs = load(tmp_path / "out.jsonl").records
    assert calls == [3, 4]
    assert [(r["status"], r["metric"]) for r in recs] == [("error", "case"), ("ok", "x"),
                                                          ("waived", "case")]
    assert recs[0]["reason"] == "RuntimeError: boom"
    assert "requires a CUDA GPU" in recs[2]["reason"]
    assert "error RuntimeError: boom" in capsys.readouterr().err
    # an existing output is never appended to silently
    assert_usage_error(cli(["suite", "run", str(path)], capsys),
                       "already holds results: pass --resume")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_resume_after_kill_loses_and_repeats_nothing(tmp_path, sig, monkeypatch):
    # ~0.15 s a unit: the signal lands mid-suite even on an idle machine (at 20000 calls all
    # 24 units could finish between the poll that saw 3 and the signal)
    path = write(tmp_path, '[[case]]\nprobe = "timer"\nparams = { calls = 100000, reps = 6 }\n'
                           'repetitions = 24\n\n[[ratio]]\nname = "r"\n'
                           'numerator = "timer.native_clock_overhead"\n'
                           'denominator = "timer.perf_counter_ns_overhead"\n')
    out = tmp_path / "out.jsonl"
    # SIG_DFL in the child: a test run started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "suite", "run", str(path)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(recorded_units(out)) < 3:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    before = recorded_units(out)
    assert 3 <= len(before) < 24, "the suite finished before it could be interrupted"
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and b"interrupted" in err
    if sig == signal.SIGTERM:  # stops the suite: not the unit's error, then the next unit
        assert proc.returncode == 143 and b"terminated" in err
        assert not any(r["status"] == "error" for r in load(out).records)
    suite = load_suite(path)
    # the resumed run's environment differs (here a note; in practice threads or git state):
    # still one machine, so one ratio from all its records
    import kvbench.envinfo

    collect = kvbench.envinfo.collect_env
    def resumed(*a, **k):
        env = collect(*a, **k)
        return {**env, "notes": ["resumed"], "env_id": env["env_id"][::-1]}

    monkeypatch.setattr(kvbench.envinfo, "collect_env", resumed)
    assert run_suite(suite, out, resume=True) == 0
    assert len(load(out).envs) == 2
    recs = load(out).records
    per_unit = Counter(r["method"]["suite_case"] for r in recs if r["name"] == "timer")
    assert set(per_unit) == {u.case_id for u in units(suite)}
    assert len(set(per_unit.values())) == 1  # every unit exactly once, whole
    assert [r["metric"] for r in recs if r["name"] == "ratio"] == ["r"]
    assert run_suite(suite, out, resume=True) == 0  # nothing left: nothing added
    assert len(load(out).records) == len(recs)


def test_machine_class():
    cpu = {"cpu": {"logical_cpus": 2, "arch": "x86_64"}, "gpus": []}
    assert machine_class(cpu) == "cpu-2c-x86_64"
    h100 = {"name": "NVIDIA H100 80GB HBM3"}
    assert machine_class({**cpu, "gpus": [h100]}) == "gpu-h100"
    assert machine_class({**cpu, "gpus": [{"name": "NVIDIA RTX A6000"}] * 2}) == "gpu-a6000x2"


def _ratio_file(path: Path, samples: list[float]) -> Path:
    from kvbench.envinfo import collect_env

    with ResultWriter(path, collect_env()) as w:
        w.write(measured("probe", "ratio", "r", "x", "lower", samples))
        w.write(measured("probe", "timer", "t", "ns", "lower", [s * 100 for s in samples]))
    return path


def test_check_guards_only_listed_metrics(tmp_path, capsys):
    suite = write(tmp_path, '[suite.guard]\n"ratio.*" = "25%"\n\n' + TIMER)
    base = _ratio_file(tmp_path / "base.jsonl", [2.0 + 0.01 * i for i in range(20)])
    same = _ratio_file(tmp_path / "same.jsonl", [2.05 + 0.01 * i for i in range(20)])
    slow = _ratio_file(tmp_path / "slow.jsonl", [3.0 + 0.01 * i for i in range(20)])
    assert run_cli(["suite", "check", str(suite), str(same), "--baseline", str(base)]) == 0
    assert run_cli(["suite", "check", str(suite), str(slow), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "regressed" in out and "1 quantities" in out  # the timer metric is not guarded
    assert "threshold 25%" in out
    rows = compare_sets(load(base), load(slow), 0.25, 0.05, ["ratio.*", "timer.t"])
    assert [r.verdict for r in rows] == ["regressed", "regressed"]


def test_check_fails_when_a_guarded_baseline_quantity_is_missing(tmp_path, capsys):
    """A guarded metric whose parameters changed (e.g. a new run option) matches nothing:
    the guard would silently stop guarding, so the check fails and says why."""
    from kvbench.envinfo import collect_env

    suite = write(tmp_path, '[suite.guard]\n"ratio.*" = "25%"\n\n' + TIMER)
    base = _ratio_file(tmp_path / "base.jsonl", [2.0 + 0.01 * i for i in range(20)])
    moved = tmp_path / "moved.jsonl"
    with ResultWriter(moved, collect_env()) as w:
        w.write(measured("probe", "ratio", "r", "x", "lower", [2.0] * 20, {"turns": 1}))
    assert run_cli(["suite", "check", str(suite), str(moved), "--baseline", str(base)]) == 1
    assert "guarded ratio.r of the baseline has no match" in capsys.readouterr().err


def test_shipped_suites_validate():
    for path in sorted((REPO / "suites").glob("*.toml")):
        suite = load_suite(path)
        assert units(suite), path
    smoke = load_suite(REPO / "suites" / "smoke.toml")
    assert smoke.guard and smoke.threshold > 0
    assert os.path.exists(REPO / "results" / "baselines" / "cpu-2c-x86_64" / "smoke.jsonl")


def test_resume_reruns_errored_and_partial_units_only(tmp_path, monkeypatch):
    """A unit whose records are an error or marked partial (interrupted) is not done: resume
    runs it again; finished and waived units are skipped."""
    from kvbench.probes.timer import TimerProbe

    path = write(tmp_path, TIMER + "sweep = { reps = [3, 4, 5] }\n\n" + TIMER
                 + 'requires = "gpu"\n')
    monkeypatch.setattr("kvbench.suite_jobs.has_gpu", lambda: False)
    suite = load_suite(path)
    out = tmp_path / "out.jsonl"
    ran = []

    def first(self, config):  # reps 3 errors, reps 4 is cut short (partial), reps 5 finishes
        ran.append(config.reps)
        if config.reps == 3:
            raise RuntimeError("boom")
        method = {"partial": "interrupted by SIGTERM"} if config.reps == 4 else {}
        yield measured("probe", "timer", "x", "ns", "lower", [1.0], {"reps": config.reps},
                       method)

    monkeypatch.setattr(TimerProbe, "run", first)
    assert run_suite(suite, out) == 1
    assert ran == [3, 4, 5]
    ids = {u.params["reps"]: u.case_id for u in units(suite) if u.case.requires is None}
    assert recorded_units(out) == {ids[5], next(u.case_id for u in units(suite)
                                               if u.case.requires)}
    ran.clear()

    def second(self, config):
        ran.append(config.reps)
        yield measured("probe", "timer", "x", "ns", "lower", [2.0], {"reps": config.reps})

    monkeypatch.setattr(TimerProbe, "run", second)
    assert run_suite(suite, out, resume=True) == 0
    assert ran == [3, 4]  # the finished unit and the waived one are not run again
    assert len(recorded_units(out)) == 4
    assert run_suite(suite, out, resume=True) == 0 and ran == [3, 4]


def test_jobs_run_shared_cases_in_workers_and_speed_cases_alone(tmp_path):
    """--jobs 2: non-exclusive cases run in worker processes and are marked concurrent; an
    exclusive case runs alone (unmarked); each unit's records land whole, exactly once, and
    a resume of the finished file adds nothing."""
    shared = '[[case]]\nprobe = "timer"\nparams = { calls = 200, reps = 3 }\n' \
             'sweep = { reps = [3, 4, 5, 6] }\nexclusive = false\n\n'
    path = write(tmp_path, shared + TIMER.replace("reps = 3", "reps = 7") + "repetitions = 2\n")
    suite = load_suite(path)
    assert [u.case.exclusive for u in units(suite)] == [False] * 4 + [True] * 2
    out = tmp_path / "out.jsonl"
    assert run_cli(["suite", "run", str(path), "--jobs", "2"]) == 0
    recs = load(out).records
    per_unit = Counter(r["method"]["suite_case"] for r in recs)
    assert set(per_unit) == {u.case_id for u in units(suite)} and len(set(per_unit.values())) == 1
    shared_ids = {u.case_id for u in units(suite) if not u.case.exclusive}
    assert all(r["method"].get("concurrent_jobs") == 2 for r in recs
               if r["method"]["suite_case"] in shared_ids)
    assert not any("concurrent_jobs" in r["method"] for r in recs
                   if r["method"]["suite_case"] not in shared_ids)
    assert run_suite(suite, out, resume=True, jobs=2) == 0
    assert len(load(out).records) == len(recs)


def test_case_keys_exclusive_and_resources_validated(tmp_path, capsys):
    path = write(tmp_path, TIMER + 'exclusive = "yes"\nresources = { cxl = -1 }\n')
    assert run_cli(["suite", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "exclusive must be true or false" in err and "resources must be a table" in err
    eval_case = '[[case]]\nstrategy = "full"\nparams = { mode = "eval" }\n'
    suite = load_suite(write(tmp_path, TIMER + "\n" + eval_case + "\n" + eval_case.replace(
        "eval", "generate")))
    assert [c.exclusive for c in suite.cases] == [True, False, True]


def test_without_ray_the_flag_exits_2_with_the_install_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert_usage_error(cli(["suite", "run", str(write(tmp_path, TIMER)), "--ray"], capsys),
                       "pip install -e '.[cluster]'")


def test_workers_parse_the_suite_from_its_text(tmp_path):
    """--jobs workers and fleet nodes get the suite as text: it is the whole file."""
    from kvbench.suite_jobs import unit_in

    suite = load_suite(REPO / "suites" / "smoke.toml")
    assert suite.text == (REPO / "suites" / "smoke.toml").read_text()
    first = units(suite)[0]
    assert unit_in("elsewhere/smoke.toml", suite.text, first.case_id).label == first.label


def test_only_takes_brackets_literally(tmp_path):
    """Labels hold brackets ('timer[calls=200,reps=3]#0'): a glob of a label's start
    matches it, where fnmatch alone would read '[calls=...' as a character class."""
    suite = load_suite(write(tmp_path, TIMER))
    assert [u.label for u in units(suite, "timer[calls=200*")] == ["timer[calls=200,reps=3]#0"]
    assert units(suite, "timer[calls=200,reps=3]#0") == units(suite)
    assert units(suite, "timer[cr]*") == []


def test_only_matching_no_case_is_an_error(tmp_path, capsys):
    """`--only 'zzz*'` ran nothing and exited 0 with `results: FILE` for a file never
    written."""
    path = write(tmp_path, TIMER)
    err = assert_usage_error(cli(["suite", "run", str(path), "--only", "zzz*"], capsys))
    assert f"--only 'zzz*' matches no case of {path}" in err
    assert "'timer[calls=200,reps=3]#0'" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("case, message", [
    ('[[case]]\nstrategy = "quest"\nparams = { budget_tokens = -5 }\n',
     "s.toml:8: quest: --budget-tokens -5: smaller than one page of 16 tokens "
     "(nothing was run)"),
    (TIMER + "sweep = { reps = [3, 2] }\n",
     "s.toml:8: timer: --reps must be at least 3 (got 2) (nothing was run)"),
])
def test_bad_parameter_values_are_refused_up_front(tmp_path, capsys, monkeypatch, case,
                                                   message):
    """Each point's config is built (its dataclasses' own checks) before anything runs: a
    bad value used to run, write an error record and exit 1."""
    monkeypatch.setattr("kvbench.suite_jobs.execute", lambda *a: pytest.fail("a case ran"))
    path = write(tmp_path, TIMER + "\n" + case)
    assert_usage_error(cli(["suite", "run", str(path)], capsys), message)
    assert not (tmp_path / "out.jsonl").exists()


def test_check_bad_input_is_one_line(tmp_path, capsys):
    """`suite check` with a suite or a result or baseline file that is missing, not a
    file, corrupt or of an unknown schema, or an unknown format: one line, exit 2."""
    suite = write(tmp_path, TIMER)
    results = tmp_path / "r.jsonl"
    with ResultWriter(results, {"env_id": "e", "cpu": {"logical_cpus": 3, "arch": "z80"}},
                      command="x") as w:
        w.write(measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0]))
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text("{not json\n")
    future = tmp_path / "future.jsonl"
    future.write_text('{"schema_version": 42, "kind": "env", "env_id": "x"}\n')
    bad_toml = write(tmp_path, "[[case]\n", "bad.toml")
    bad_guard = write(tmp_path, '[suite.guard]\n"x" = "lots"\n\n' + TIMER, "guard.toml")
    for argv, message in [
        ([str(bad_toml), str(results)], "bad.toml: not valid TOML"),
        ([str(bad_guard), str(results)], "guard 'x': cannot parse threshold 'lots'"),
        ([str(tmp_path), str(results)], "cannot read suite"),
        ([str(suite), str(corrupt)], "holds no kvbench records"),
        ([str(suite), str(future)], "schema version 42"),
        ([str(suite), str(tmp_path)], "is not a file"),
        ([str(suite), str(results), "--baseline", str(corrupt)], "holds no kvbench records"),
        ([str(suite), str(results), "--baseline", str(tmp_path / "nob.jsonl")],
         "does not exist"),
        ([str(suite), str(results), "--format", "nosuch"],
         "unknown format 'nosuch' (table, markdown, json)"),
        ([str(suite), str(tmp_path / "missing.jsonl")], "does not exist"),
        ([str(suite), str(results)], "no baseline for machine class 'cpu-3c-z80'"),
        ([str(suite), str(results), "--baseline", str(tmp_path / ("b" * 300))],
         "File name too long"),
        ([str(tmp_path / "nosuch.toml"), str(results)], "cannot read suite"),
    ]:
        assert_usage_error(cli(["suite", "check", *argv], capsys), message)


def test_interrupted_case_keeps_its_finished_records_marked_partial(tmp_path, monkeypatch,
                                                                     capsys):
    """Ctrl-C inside a case: what it had measured is written, marked partial (it was lost
    with the case); --resume runs the case again and the loader drops the partial one."""
    from kvbench.probes.timer import TimerProbe

    interrupt = [True]

    def run(self, config):
        yield measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0], {"reps": config.reps})
        if interrupt[0]:
            raise KeyboardInterrupt
        yield measured("probe", "timer", "y", "ns", "lower", [1.0, 2.0], {"reps": config.reps})

    monkeypatch.setattr(TimerProbe, "run", run)
    path = write(tmp_path, TIMER)
    out = tmp_path / "out.jsonl"
    assert run_cli(["suite", "run", str(path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    (rec,) = load(out).records
    assert rec["metric"] == "x"
    assert rec["method"]["suite_case"] == units(load_suite(path))[0].case_id
    assert rec["method"]["partial"] == "interrupted (KeyboardInterrupt) before the case finished"
    assert recorded_units(out) == set()
    interrupt[0] = False
    assert run_suite(load_suite(path), out, resume=True) == 0
    assert [(r["metric"], "partial" in r["method"]) for r in load(out).records] == [
        ("x", False), ("y", False)]


def test_sigterm_keeps_the_running_strategy_cases_steps(tmp_path):
    """SIGTERM while a strategy case decodes: the run (its own session) is sent SIGTERM
    once, stores its steps so far marked partial, and the suite keeps them (the case's
    scratch folder used to be deleted with them)."""
    import psutil

    path = write(tmp_path, '[[case]]\nstrategy = "full"\nparams = { weights = "random", '
                           'layers = 1, prompt_len = 8, gen_len = 4000, threads = 1 }\n')
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "suite", "run", str(path)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    decoding = False
    while not decoding and time.monotonic() < deadline:  # the run's stderr: its scratch file
        time.sleep(0.1)
        for child in psutil.Process(proc.pid).children():
            # only the run's: another child (git, from the environment record) writes to
            # this test's pipe, whose read would wait for the suite to end
            with contextlib.suppress(OSError):
                err = Path(os.readlink(f"/proc/{child.pid}/fd/2"))
                decoding = decoding or (err.name == "stderr.txt"
                                        and "decoding 4000 steps" in err.read_text())
    assert decoding, "the case never started decoding"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    recs = {r["metric"]: r for r in load(out).records}
    done = recs["tbt"]["params"]["steps_completed"]
    assert 1 <= done < 4000
    assert recs["tbt"]["method"]["partial"] == (f"interrupted by SIGTERM after {done} of "
                                                "4000 decode steps")
    assert all(r["method"]["partial"] and r["method"]["suite_case"] for r in recs.values())
    assert recorded_units(out) == set()  # --resume runs it again


def test_a_workers_interrupt_goes_back_as_itself(tmp_path, monkeypatch):
    """A --jobs worker's unit does not pickle: its interrupt is returned bare, as before."""
    from kvbench.probes.timer import TimerProbe
    from kvbench.suite_jobs import _work

    def run(self, config):
        yield measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0])
        raise KeyboardInterrupt

    monkeypatch.setattr(TimerProbe, "run", run)
    suite = load_suite(write(tmp_path, TIMER))
    with pytest.raises(KeyboardInterrupt):
        _work(str(suite.path), suite.text, units(suite)[0].case_id, False)


def test_ratio_where_picks_the_records_it_pairs(tmp_path):
    """`where` restricts a ratio to records with those parameter values: a suite's short
    runs of the same strategies do not pair into its KV-bound ratio; a where that is not a
    table is refused with its line."""
    from kvbench.suite import derive_ratio
    from kvbench.suite_spec import RatioSpec

    def rec(name: str, prompt: int, samples: list[float]) -> dict:
        return {"name": name, "metric": "tbt", "status": "ok", "samples": samples,
                "params": {"prompt_len": prompt, "batch": 1}}

    records = [rec("hgca", 64, [2.0, 2.0]), rec("full", 64, [1.0, 1.0]),
               rec("hgca", 2048, [3.0, 3.0]), rec("full", 2048, [4.0, 4.0])]
    spec = RatioSpec("r", "hgca.tbt", "full.tbt", "lower", ("prompt_len", "batch"))
    assert sorted(r.value for r in derive_ratio(spec, records)) == [0.75, 2.0]
    only = RatioSpec("r", "hgca.tbt", "full.tbt", "lower", ("prompt_len", "batch"),
                     (("prompt_len", 2048),))
    got = list(derive_ratio(only, records))
    assert [(r.value, r.params["prompt_len"]) for r in got] == [(0.75, 2048)]
    path = write(tmp_path, TIMER + '\n[[ratio]]\nname = "r"\nnumerator = "a.b"\n'
                                   'denominator = "c.d"\nwhere = ["prompt_len"]\n')
    with pytest.raises(KvbenchError, match="where is a table"):
        load_suite(path)
