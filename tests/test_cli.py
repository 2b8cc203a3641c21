import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.schema import measured
from kvbench.store import ResultWriter, load


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    with ResultWriter(path, {"env_id": "e"}) as w:
        w.write(measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0]))
    return path


def test_list_json_has_registered_probes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["list", "--json"], capsys)
    assert code == 0
    entries = json.loads(out)
    timer = next(e for e in entries if e["name"] == "timer")
    assert timer["kind"] == "probe" and timer["summary"].startswith("Overhead")


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["list"], capsys)
    assert code == 0 and "timer" in out


def bad_inputs(tmp: Path, good: Path) -> list[tuple[list[str], str]]:
    corrupt = tmp / "corrupt.jsonl"
    corrupt.write_text("this is not json\nnor this\n")
    future = tmp / "future.jsonl"
    future.write_text('{"schema_version": 42, "kind": "env", "env_id": "x"}\n')
    return [
        (["frobnicate"], "No such command"),
        (["probe", "nosuchprobe"], "No such command"),
        (["compare", str(tmp / "missing.jsonl"), str(good)], "does not exist"),
        (["compare", str(corrupt), str(good)], "not kvbench JSON Lines"),
        (["compare", str(good), str(future)], "schema version 42"),
        (["compare", str(good), str(good), "--threshold", "lots"], "cannot parse threshold"),
        (["compare", str(good), str(good), "--format", "xml"], "unknown format"),
        (["probe", "timer", "--calls", "notanumber"], "Invalid value"),
    ]


def test_bad_input_is_one_line_exit_2(tmp_path: Path, good_file: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in bad_inputs(tmp_path, good_file):
        code, _, err = run(argv, capsys)
        assert code == 2, argv
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("kvbench: error:") and message in lines[0], (argv, err)


def test_console_script_no_traceback(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("kvbench")
    proc = subprocess.run([str(exe), "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "compare" in out


def test_timer_probe_writes_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["probe", "timer", "--calls", "500", "--reps", "3"], capsys)
    assert code == 0
    (path,) = (tmp_path / "results").glob("timer-*.jsonl")
    assert str(path.relative_to(tmp_path)) in out
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kind"] == "env"
    recs = {r["metric"]: r for r in lines[1:]}
    assert recs["perf_counter_ns_overhead"]["value"] > 0
    assert recs["perf_counter_ns_overhead"]["method"]["reps"] == 3
    assert recs["cuda_event_floor"]["status"] in ("waived", "ok")


def kvbench(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kvbench")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "banana"],
     "cannot parse size 'banana'"),
    (["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "1M",
      "--threads", "0"], "--threads must be at least 1"),
    (["run", "full", "--threads", "-1"], "--threads -1"),
])
def test_rejected_command_draws_and_writes_nothing(tmp_path: Path, argv: list[str],
                                                   message: str) -> None:
    """Bad input: one line, exit 2, no live table on stdout and no result file (issue 11.9)."""
    out = tmp_path / "r.jsonl"
    proc = kvbench(*argv, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout == "" and not out.exists()


def test_sigterm_keeps_partial_run(tmp_path: Path) -> None:
    """A scheduler's SIGTERM during decode: the records so far, marked partial, exit 143."""
    out = tmp_path / "r.jsonl"
    exe = Path(sys.executable).with_name("kvbench")
    proc = subprocess.Popen([str(exe), "run", "full", "--weights", "random", "--layers", "1",
                             "--prompt-len", "8", "--gen-len", "4000", "--threads", "1",
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # the line printed as the timed decode starts
        if line.startswith("decoding 4000 steps"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    recs = {r["metric"]: r for r in load(out).records}
    tbt = recs["tbt"]
    done = tbt["params"]["steps_completed"]
    assert 1 <= done < 4000 and len(tbt["samples"]) == done
    assert tbt["method"]["partial"] == f"interrupted by SIGTERM after {done} of 4000 decode steps"
    assert all(r["params"]["steps_completed"] == done for r in recs.values())
