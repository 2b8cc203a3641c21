"""Report: grouping, run figures, accuracy table, formats, and the HTML in a real browser."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.envinfo import collect_env
from kvbench.plots import pyplot, save
from kvbench.probes.timer import TimerProbe
from kvbench.schema import measured, not_measured
from kvbench.store import ResultWriter

RUN_CMD = "kvbench run hgca --model smollm2 --batch 2"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A probe group (timer, one waived) and runs of full/hgca over batch and context."""
    path = tmp_path / "res.jsonl"
    with ResultWriter(path, collect_env(), command="kvbench probe timer") as w:
        w.write(measured("probe", "timer", "perf_counter_ns_overhead", "ns", "lower",
                         [70.0, 71.0, 75.0], {"calls": 1000}))
        w.write(not_measured("probe", "timer", "cuda_event_floor", "waived",
                             "no CUDA GPU on this machine", {"calls": 1000}))
        for name, extra, scale in (("full", {}, 1.0), ("hgca", {"beta": 1.0}, 0.8)):
            for batch in (1, 2, 4):
                for context in (256, 512):
                    p = {"batch": batch, "context": context, **extra}
                    rec = measured("run", name, "throughput", "tok/s", "higher",
                                   [scale * 10 * batch / context * 256] * 3, p)
                    rec.command = RUN_CMD if name == "hgca" else "kvbench run full"
                    w.write(rec)
                    w.write(measured("run", name, "tbt", "s", "lower",
                                     [0.1 * context / 256 / scale], p))
            w.write(measured("run", name, "perplexity", "", "lower",
                             [12.0 if name == "full" else 12.3], {"context": 512, **extra}))
        proj = measured("run", "hgca", "throughput", "tok/s", "higher", [50.0],
                        {"batch": 8, "context": 256, "beta": 1.0})
        proj.provenance = "projected"
        w.write(proj)
    return path


def report(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(["report", *argv])
    return e.value.code


def test_html_is_self_contained_with_figures_commands_and_env(results, tmp_path, monkeypatch):
    def timer_plot(cls, records, out_dir):
        fig, ax = pyplot().subplots()
        ax.plot([r["value"] for r in records])
        return [save(fig, out_dir / "timer-overhead.png")]

    monkeypatch.setattr(TimerProbe, "plot", classmethod(timer_plot))
    assert report([str(results), "--format", "html", "--out", str(tmp_path / "rep")]) == 0
    html = (tmp_path / "rep" / "report.html").read_text()
    assert list((tmp_path / "rep").iterdir()) == [tmp_path / "rep" / "report.html"]
    assert not re.search(r'(src|href)="(?!data:)', html)  # nothing loaded from elsewhere
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", html)
    assert captions == ["probe timer: timer-overhead", "runs: tbt against batch",
                        "runs: tbt against context", "runs: throughput against batch",
                        "runs: throughput against context"]
    assert html.count('src="data:image/png;base64,') == len(captions)
    assert RUN_CMD in html and "kvbench probe timer" in html
    assert "no CUDA GPU on this machine" in html and 'class="waived"' in html
    assert 'class="projected"' in html and "throughput (projected)" in html
    assert "logical CPUs" in html and "versions" in html
    # accuracy: hgca next to the full-attention reference at the same context
    assert re.search(r"<td>hgca</td><td>context=512 beta=1.0</td><td>12.3</td><td>12</td>"
                     r"<td>\+2.50%</td>", html)


def test_markdown_and_table(results, tmp_path, capsys):
    assert report([str(results), "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert "## probe timer" in md and "## runs (all strategies)" in md
    assert "| hgca | throughput (projected) | batch=8 context=256 beta=1.0 |" in md
    assert "waived: no CUDA GPU on this machine" in md and "![" not in md
    assert report([str(results), "--format", "markdown", "--out", str(tmp_path / "md")]) == 0
    md = (tmp_path / "md" / "report.md").read_text()
    figs = re.findall(r"!\[[^]]*\]\((figures/[^)]+)\)", md)
    assert len(figs) == 5 and all((tmp_path / "md" / f).is_file() for f in figs)
    assert report([str(results)]) == 0
    assert "accuracy (perplexity" in capsys.readouterr().out


def test_bad_input_is_one_line(results, tmp_path, capsys):
    line = assert_usage_error(cli(["report", str(results), "--format", "pdf"], capsys))
    assert line == "kvbench: error: unknown format 'pdf' (table, markdown, html)"
    assert_usage_error(cli(["report", str(tmp_path / "missing.jsonl")], capsys),
                       "does not exist")


@pytest.mark.parametrize("fmt", ["html", "markdown"])
@pytest.mark.parametrize("where, message", [
    ("/proc/nope/r", "--out '/proc/nope/r': cannot write in '/proc'"),
    ("FILE", "is not a folder: give a folder path"),
    ("LONG", "File name too long"),
])
def test_unusable_out_folder_is_one_line(fmt, where, message, results, tmp_path, capsys):
    """--out is the report's folder: unwritable or an existing file used to end in a
    traceback (FileNotFoundError, FileExistsError)."""
    existing = tmp_path / "existing.txt"
    existing.write_text("keep me")
    out = {"FILE": str(existing), "LONG": str(tmp_path / ("x" * 300))}.get(where, where)
    before = sorted(tmp_path.rglob("*"))
    line = assert_usage_error(cli(["report", str(results), "--format", fmt, "--out", out],
                                  capsys), message)
    assert line.startswith("kvbench: error: --out '")
    assert sorted(tmp_path.rglob("*")) == before and existing.read_text() == "keep me"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000"]


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    profile.mkdir()
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; "
                    ".ci/run installs it)")
def test_html_renders_in_headless_chromium(results, tmp_path):
    from matplotlib.image import imread

    assert report([str(results), "--format", "html", "--out", str(tmp_path / "rep")]) == 0
    url = (tmp_path / "rep" / "report.html").resolve().as_uri()
    dom = chromium(tmp_path, "--dump-dom", url).stdout
    n = dom.count("<img ")
    assert n == 5  # four run figures; the timer has no plot of its own: its samples figure
    assert 'data-figures="5/5"' in dom  # set by the page once every image has decoded
    shot = tmp_path / "shot.png"
    chromium(tmp_path, "--window-size=1280,3000", f"--screenshot={shot}", url)
    px = imread(shot)
    assert px.shape[:2] == (3000, 1280)
    ink = (px[..., :3].mean(axis=2) < 0.9).mean()  # share of pixels that are not white
    assert 0.02 < ink < 0.9 and px[..., :3].std() > 0.1


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """Eval-mode runs of full and hgca on the CPU as `kvbench run` stores them: summary
    metrics, per-place records and per-layer traces."""
    path = tmp_path / "runs.jsonl"
    base = {"model": "smollm2-135m", "batch": 1, "prompt_len": 256, "gen_len": 8,
            "mode": "eval", "accel": "cpu"}
    with ResultWriter(path, collect_env(), command="kvbench run") as w:
        for name, own, ppl, speed in (("full", {}, 12.0, 20.0),
                                      ("hgca", {"gpu_share": 0.25, "beta": 1.0}, 12.3, 15.0)):
            p = {**base, **own}
            w.write(measured("run", name, "ttft", "s", "lower", [0.5], p))
            w.write(measured("run", name, "tbt", "s", "lower", [1 / speed] * 8, p))
            w.write(measured("run", name, "tbt_p90", "s", "lower", [1.1 / speed], p))
            w.write(measured("run", name, "decode_tokens_per_s", "tokens/s", "higher",
                             [speed] * 8, p))
            w.write(measured("run", name, "peak_memory", "B", "lower", [2 << 30],
                             {**p, "where": "host"}))
            w.write(measured("run", name, "perplexity", "ppl", "lower", [ppl], p))
            for where, n in (("accel", 64.0), ("host", 5.5)) if own else (("accel", 256.0),):
                w.write(measured("run", name, "tokens_attended_per_step", "tokens", "none",
                                 [n] * 8, {**p, "where": where}))
                for layer in range(3):
                    w.write(measured("run", name, "trace.tokens", "tokens", "none", [n] * 8,
                                     {**p, "where": where, "layer": layer,
                                      "phase": "decode"}))
            if own:
                w.write(measured("run", name, "bytes_moved_per_step", "B", "none",
                                 [32768.0] * 8, {**p, "where": "h2d"}))
                w.write(measured("run", name, "accel_idle_share", "ratio", "lower", [0.02],
                                 p))
    return path


def test_html_opens_with_a_summary_and_folds_raw_rows(runs, tmp_path):
    """Machine line, headline figures and the runs side by side come before the detail;
    traces are a figure, raw rows sit in a collapsed <details>; the accelerator role that
    ran on the CPU is `accel (cpu)`."""
    assert report([str(runs), "--format", "html", "--out", str(tmp_path / "rep")]) == 0
    html = (tmp_path / "rep" / "report.html").read_text()
    head, _, detail = html.partition("<h2>Environment</h2>")
    assert 'id="summary"' in head and "<details" not in head
    assert "no GPU (the accelerator role runs on the CPU)" in head
    assert re.search(r"<td>hgca on smollm2-135m \(accel \(cpu\)\)</td><td>perplexity 12\.3 "
                     r"\(\+2\.50% vs full 12\)</td>", head)
    assert "<td>20 tokens/s (eval mode)</td>" in head
    row = re.search(r"<tr class=\"\"><td>hgca</td>(.*?)</tr>", head).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[0] == "beta=1.0 gpu_share=0.25" or cells[0] == "gpu_share=0.25 beta=1.0"
    assert cells[1:8] == ["500 ms", "66.7 ms", "73.3 ms", "15", "host 2 GiB", "12.3", "+2.50%"]
    assert "mode=eval" in head and "(times in eval mode)" in head
    assert head.count("<b>machine</b>") == 1
    assert cells[8:] == ["accel (cpu) 64, host 5.5", "h2d 32 KiB", "2.0%", *["-"] * 4]
    assert "gpu" not in re.sub(r"gpu_share=[\d.]+|no GPU", "", head).lower()
    assert "runs: per-layer work traces" in detail
    assert "trace.tokens" not in re.sub(r"<details>.*?</details>", "", detail, flags=re.S)
    assert detail.count("<details><summary>") == 1


def test_rows_name_their_machine_when_the_files_hold_several(tmp_path):
    """A fleet file: every row and the accuracy table say which machine measured it, and
    each strategy's change is against full attention on its own machine."""
    from kvbench.report import build

    path = tmp_path / "fleet.jsonl"
    base = collect_env()
    for name, cls, full, hgca in (("n1", "small", 12.0, 12.6), ("n2", "big", 10.0, 10.2)):
        env = {**base, "env_id": f"id-{name}", "node": {"name": name, "class": cls}}
        with ResultWriter(path, env) as w:
            for strategy, ppl in (("full", full), ("hgca", hgca)):
                w.write(measured("run", strategy, "perplexity", "", "lower", [ppl],
                                 {"context": 512}))
    rep = build([path], tmp_path)
    runs = next(g for g in rep.groups if g.kind == "run")
    assert sorted(rep.row(r)[0] for r in runs.records) == [
        "full @ big (n2)", "full @ small (n1)", "hgca @ big (n2)", "hgca @ small (n1)"]
    changes = {row[0]: row[4] for row in rep.accuracy}
    assert changes["hgca @ small (n1)"] == "+5.00%" and changes["hgca @ big (n2)"] == "+2.00%"
    assert report([str(path), "--format", "markdown", "--out", str(tmp_path / "md")]) == 0
    assert "| hgca @ big (n2) |" in (tmp_path / "md" / "report.md").read_text()


def test_a_sweep_shows_what_varies_as_columns_and_on_every_row() -> None:
    """Runs of two strategies over budgets: the perplexity pivot has the budget as columns
    (through the --budget-tokens / --gpu-tokens alias), a parameter that follows the budget
    leaves the row label, and each headline row names the setting that tells it apart."""
    from kvbench.present.sweep import sweep_tables
    from kvbench.summary import headlines

    def run(name: str, value: float, **params: object) -> dict:
        return {"kind": "run", "name": name, "metric": "perplexity", "unit": "ppl",
                "direction": "lower", "value": value, "status": "ok",
                "provenance": "measured", "samples": [value],
                "params": {"model": "m", "mode": "eval", **params}}

    recs = [run("quest", 21.4, budget_tokens=64, pages=4),
            run("quest", 16.1, budget_tokens=128, pages=8),
            run("h2o", 18.7, gpu_tokens=64), run("h2o", 15.9, gpu_tokens=128),
            run("full", 15.8)]
    (table,), notes = sweep_tables(recs)
    assert notes == [] and table.p.title == "perplexity by budget"
    head, rows = table.grid()
    assert head == ["name", "budget 64", "budget 128", "budget None"]
    assert rows == [["full", "-", "-", "15.8"], ["h2o", "18.7", "15.9", "-"],
                    ["quest", "21.4", "16.1", "-"]]
    whats = {row[0] for row in headlines(recs)}
    assert "quest on m (accel (?)) budget_tokens=64 pages=4" in whats
    assert "h2o on m (accel (?)) gpu_tokens=128" in whats


def test_a_parameter_only_later_runs_have_still_tells_rows_apart() -> None:
    """A run recorded before a strategy had `variant` lacks the parameter: it is a value of
    its own whatever the records' order, so the earlier and the later run get two rows (the
    report of results/page-sparse refused to pivot perplexity before), and two versions with
    equal parameters are told apart by `version`."""
    from kvbench.present.sweep import sweep_tables

    def run(name: str, value: float, version: str = "1", **params: object) -> dict:
        return {"kind": "run", "name": name, "metric": "perplexity", "unit": "ppl",
                "direction": "lower", "value": value, "status": "ok", "version": version,
                "provenance": "measured", "samples": [value],
                "params": {"model": "m", "mode": "eval", **params}}

    recs = [run("hgca", 18.0, "3", gpu_tokens=64), run("hgca", 15.8, "5", gpu_tokens=64,
                                                         variant="authors"),
            run("hgca", 16.6, "3", gpu_tokens=128), run("quest", 21.4, "1", budget_tokens=64),
            run("quest", 16.1, "1", budget_tokens=128), run("quest", 23.0, "2", budget_tokens=64)]
    for order in (recs, recs[::-1]):
        (table,), notes = sweep_tables(order)
        assert notes == []
        head, rows = table.grid()
        assert head == ["name / version", "budget 64", "budget 128"]  # version sets variant
        assert rows == [["hgca (version 3)", "18", "16.6"], ["hgca (version 5)", "15.8", "-"],
                        ["quest (version 1)", "21.4", "16.1"], ["quest (version 2)", "23", "-"]]
