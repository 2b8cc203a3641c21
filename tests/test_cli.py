import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.schema import measured
from kvbench.store import ResultWriter


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
