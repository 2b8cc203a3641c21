"""Mutation testing of the code that turns measurements into numbers (issue 30; `make mutate`).

    python tools/mutate.py run [MODULE ...]   # mutmut 3 over each module, resumable
    python tools/mutate.py summary            # results/mutation/summary.{md,json}

Each module runs in its own workspace, build/mutate/<module>/ (a copy of kvbench/, tests/
and the files its tests read, with a [tool.mutmut] table naming that one source file and
that module's test files), so mutmut's stats run maps each mutated function to the tests
of those files that call it, and each mutant runs only those tests. mutmut keeps its
verdicts there: a second `run` of a module skips the mutants already decided and reruns the
survivors (the tests may have changed since). After each module, its verdicts are exported
to results/mutation/<module>.json (mutant -> status, and the diff of every survivor), which
`summary` reads with results/mutation/triage.toml (survivor -> why it is equivalent, or the
test that now kills it) to write the committed summary. Workers: MUTATE_JOBS (default 2).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutate"
OUT = ROOT / "results" / "mutation"
TRIAGE = OUT / "triage.toml"


@dataclass(frozen=True)
class Spec:
    """One module: its source file, the test files that cover it, the repository files
    those tests read, and (for large modules) the functions in scope (mutmut name globs)."""

    source: str
    tests: tuple[str, ...]
    target: float  # the share of non-equivalent mutants that must be killed
    extra: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    group: str = "core"


CORE, OTHER = 0.9, 0.8


def _in(module: str, *functions: str) -> tuple[str, ...]:
    """mutmut name globs of a module's functions ("f") and methods ("Class.m"): the scope
    of a module whose plots and live views are no arithmetic."""
    return tuple(f"{module}.x{'ǁ'.join(['', *f.split('.')]) if '.' in f else '_' + f}"
                 f"__mutmut_*" for f in functions)
MODULES: dict[str, Spec] = {
    "units": Spec("kvbench/units.py", ("tests/test_units.py",), CORE),
    "timing": Spec("kvbench/timing.py", ("tests/test_timing.py",), CORE),
    "schema": Spec("kvbench/schema.py", ("tests/test_records.py", "tests/test_store.py"), CORE,
                   extra=("results/baselines", "suites")),
    "store": Spec("kvbench/store.py", ("tests/test_store.py",), CORE,
                  extra=("results/baselines", "suites")),
    "compare": Spec("kvbench/compare.py", ("tests/test_compare.py", "tests/test_noise.py"), CORE),
    "noise": Spec("kvbench/noise.py", ("tests/test_noise.py",), CORE),
    "context": Spec("kvbench/runtime/context.py", ("tests/test_context.py",
                                                  "tests/test_trace.py"), CORE),
    "copy": Spec("kvbench/probes/_copy.py", ("tests/test_bandwidth.py",
                                             "tests/test_memory_probes.py",
                                             "tests/test_copy_plan.py"), OTHER,
                 group="probes"),
    "latency": Spec("kvbench/probes/latency.py", ("tests/test_memory_probes.py",
                                                   "tests/test_latency_records.py"), OTHER,
                    functions=_in("kvbench.probes.latency", "chase_bytes",
                                  "LatencyProbe.run", "LatencyProbe._copy_record",
                                  "LatencyProbe._chase"), group="probes"),
    "attention": Spec("kvbench/probes/attention.py", ("tests/test_probe_attention.py",
                                                       "tests/test_attention_records.py",
                                                       "tests/test_attention_parts.py"), OTHER,
                      functions=_in("kvbench.probes.attention", "_ints", "grid", "modes",
                                    "_groups", *(f"AttentionProbe.{m}" for m in (
                                        "run", "_time", "_copies", "_copy_records", "_point",
                                        "_measure", "_records", "_read_bytes",
                                        "_dense_rounds", "_read_ratios", "_bars"))),
                      group="probes"),
    "roofline": Spec("kvbench/probes/roofline.py", ("tests/test_probe_attention.py",
                                                     "tests/test_roofline_records.py"), OTHER,
                     functions=_in("kvbench.probes.roofline", "intensity", "shapes",
                                   "device_setup", "RooflineProbe.run",
                                   "RooflineProbe._points", "RooflineProbe._linear"),
                     group="probes"),
    "hwmodel": Spec("kvbench/hwmodel/project.py", ("tests/test_hwmodel.py",
                                                   "tests/test_project_records.py", "-k",
                                                   "project or scale or hardware_this"),
                    OTHER, group="hwmodel"),
    # test_trace's strategy runs take minutes here: its breakdown tests
    "breakdown": Spec("kvbench/runtime/breakdown.py", ("tests/test_trace.py", "-k",
                                                       "breakdown"), OTHER, group="runtime"),
    # test_shadow's strategy runs take minutes here: its two unit tests and the arithmetic
    "shadow": Spec("kvbench/runtime/shadow.py", (
        "tests/test_shadow_arith.py", "tests/test_shadow.py::test_reference_runs_between_steps",
        "tests/test_shadow.py::test_error_of_a_sparse_strategy_is_its_distance_from_full_"
        "attention"), OTHER, group="runtime"),
    "energy": Spec("kvbench/runtime/energy.py", ("tests/test_energy.py",), OTHER,
                   group="runtime"),
    # the bytes bound and step_efficiency (issue 26 part 1), the probe taken again included
    "bound": Spec("kvbench/runtime/bound.py", ("tests/test_step_bound_arith.py",
                                               "tests/test_step_bound.py"), OTHER,
                  group="runtime"),
    "pages": Spec("kvbench/strategies/_pages.py", ("tests/test_pages_arith.py",), OTHER,
                  group="strategies"),
    # the strategies' selection: what each keeps or picks to attend
    "quest": Spec("kvbench/strategies/quest.py", ("tests/test_fidelity_quest.py",
                                                 "tests/test_page_strategies.py"), OTHER,
                  functions=_in("kvbench.strategies.quest", "QuestParams.pages",
                                "QuestParams.rule", "Quest.decode"), group="strategies"),
    "h2o": Spec("kvbench/strategies/h2o.py", ("tests/test_offload_strategies.py",), OTHER,
                functions=_in("kvbench.strategies.h2o", "group_sum", "H2O._compact",
                              "H2O.append", "H2O.decode"), group="strategies"),
    "streaming": Spec("kvbench/strategies/streaming.py", ("tests/test_offload_strategies.py",
                                                         "tests/test_kernels_step.py"),
                      OTHER, functions=_in("kvbench.strategies.streaming", "Streaming._slot",
                                           "Streaming.append", "Streaming.decode",
                                           "Streaming.native_cache", "Streaming.decoded"),
                      group="strategies"),
    "infinigen": Spec("kvbench/strategies/infinigen.py", ("tests/test_fidelity_infinigen.py",
                                                         "tests/test_infinigen_steps.py",
                                                         "tests/test_page_strategies.py"),
                      OTHER, functions=_in("kvbench.strategies.infinigen",
                                           "InfiniGen.attended", "InfiniGen.layer_input",
                                           "InfiniGen._prefetch", "InfiniGen.decode",
                                           "InfiniGen._ranked"),
                      group="strategies"),
    "infinigen_cache": Spec("kvbench/strategies/_infinigen_cache.py", (
        "tests/test_fidelity_infinigen.py", "tests/test_infinigen_steps.py",
        "tests/test_page_strategies.py"), OTHER,
        functions=_in("kvbench.strategies._infinigen_cache", "InfiniGenCache.cap",
                      "InfiniGenCache._partial", "InfiniGenCache._read"), group="strategies"),
    "arkvale": Spec("kvbench/strategies/arkvale.py", ("tests/test_fidelity_arkvale.py",
                                                     "tests/test_arkvale_steps.py",
                                                     "tests/test_page_strategies.py",
                                                     "tests/test_kernels_step.py"), OTHER,
                    functions=_in("kvbench.strategies.arkvale", *(f"ArkVale.{m}" for m in (
                        "attended", "append", "decode", "native_cache", "native_rule",
                        "decoded"))), group="strategies"),
    "arkvale_pool": Spec("kvbench/strategies/_arkvale_pool.py", (
        "tests/test_fidelity_arkvale.py", "tests/test_arkvale_steps.py",
        "tests/test_page_strategies.py", "tests/test_kernels_step.py"), OTHER,
        functions=_in("kvbench.strategies._arkvale_pool", "ArkValeParams.topk",
                      "ArkValeParams.prefill_sinks", *(f"ArkValePool.{m}" for m in (
                          "_split", "_enter", "_place", "_recall", "_count_recalled",
                          "_complete", "_select", "_all"))), group="strategies"),
    "hgca": Spec("kvbench/strategies/hgca.py", ("tests/test_fidelity_hgca.py",
                                               "tests/test_hgca_steps.py",
                                               "tests/test_hgca_reference.py",
                                               "tests/test_hgca_append.py"), OTHER,
                 functions=_in("kvbench.strategies.hgca", *(f"Hgca.{m}" for m in (
                     "_window", "_host", "attended", "decode"))), group="strategies"),
    "hgca_manager": Spec("kvbench/strategies/_hgca_manager.py", (
        "tests/test_fidelity_hgca.py", "tests/test_hgca_steps.py",
        "tests/test_hgca_reference.py", "tests/test_hgca_append.py"), OTHER,
        functions=_in("kvbench.strategies._hgca_manager", *(f"HgcaManager.{m}" for m in (
            "_evict", "_manage", "_chosen", "_select", "_reselect", "_update_maw"))),
        group="strategies"),
    "hgca_kv": Spec("kvbench/strategies/_hgca_kv.py", ("tests/test_fidelity_hgca.py",
                                                      "tests/test_hgca_steps.py",
                                                      "tests/test_hgca_reference.py",
                                                      "tests/test_hgca_append.py"), OTHER,
                    functions=_in("kvbench.strategies._hgca_kv", "HgcaParams.tokens",
                                  "HgcaParams.window", "LayerKV.keep", "union_keep",
                                  "topk_keep", "column_mean", "ingest_maw"),
                    group="strategies"),
    # test_scout's runs of the bundled model take minutes a mutant here: its unit tests,
    # the reference decode and the steps test
    "scout": Spec("kvbench/strategies/scout.py", ("tests/test_scout.py",
                                                 "tests/test_scout_steps.py", "-k",
                                                 "not (equals_full or precompute_error_is or "
                                                 "recall_lowers or run_records)"), OTHER,
                  functions=_in("kvbench.strategies.scout", *(f"Scout.{m}" for m in (
                      "attended", "_issue", "_host", "decode", "_pred_error", "_finish"))),
                  group="strategies"),
    "scout_blocks": Spec("kvbench/strategies/_scout_blocks.py", (
        "tests/test_scout.py", "tests/test_scout_steps.py", "-k",
        "not (equals_full or precompute_error_is or recall_lowers or run_records)"), OTHER,
        functions=_in("kvbench.strategies._scout_blocks", *(
            f"ScoutBlocks.{m}" for m in ("_blocks", "_evict", "_slide", "_recall"))),
        group="strategies"),
    "pnm": Spec("kvbench/strategies/_pnm.py", ("tests/test_pnm.py",), OTHER,
                functions=_in("kvbench.strategies._pnm", "group_devices",
                              "mask_tokens", "DeviceKV.select", "DeviceKV.select_tokens",
                              "DeviceKV._count_selection", "DeviceKV.count_load"),
                group="strategies"),
    "png_kv": Spec("kvbench/strategies/png_kv.py", ("tests/test_pnm.py",), OTHER,
                   functions=_in("kvbench.strategies.png_kv", "PngKV.steady_select",
                                 "PngKV.decode"), group="strategies"),
    # the native decode step's Python: what it hands the call, when it takes a step
    "step": Spec("kvbench/kernels/step.py", ("tests/test_kernels_step.py",), OTHER,
                 functions=_in("kvbench.kernels.step", "_layer", "Step.build", "Step.ready",
                               "Step.__call__", "Step._account", "Step._run"),
                 group="kernels"),
    "greedy": Spec("kvbench/kernels/cpu.py", ("tests/test_kernels_greedy.py",), OTHER,
                   functions=_in("kvbench.kernels.cpu", "greedy"), group="kernels"),
    "topk": Spec("kvbench/kernels/cpu.py", ("tests/test_kernels_topk.py",), OTHER,
                 functions=_in("kvbench.kernels.cpu", "topk_ok", "topk"), group="kernels"),
}
# the order of a full pass: core first, the strategies last
ORDER = list(MODULES)


def _sync(src: Path, dst: Path) -> None:
    """Copy src to dst where their bytes differ (keeping the time stamp, which mutmut reads
    to see whether a source changed since it made its mutants)."""
    if src.is_dir():
        for p in src.rglob("*"):
            if "__pycache__" in p.parts or p.is_dir():
                continue
            _sync(p, dst / p.relative_to(src))
        return
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _workspace(name: str, spec: Spec) -> Path:
    ws = WORK / name
    for rel in ("kvbench", "tests", *spec.extra):
        _sync(ROOT / rel, ws / rel)
    _sync(ROOT / "tools" / "mutate_order.py", ws / "mutate_order.py")
    project = (ROOT / "pyproject.toml").read_text()
    table = {
        "source_paths": ["kvbench"],
        "only_mutate": [spec.source],
        "also_copy": [*spec.extra, "mutate_order.py"],
        "pytest_add_cli_args_test_selection": list(spec.tests),
        # pytest's unraisable-exception plugin runs gc.collect() five times at each session's
        # end: 3.5 s a mutant with torch loaded, ten times the tests themselves
        "pytest_add_cli_args": ["-m", "not bench and not gpu", "-p", "no:cacheprovider",
                                "-p", "no:unraisableexception", "-p", "no:benchmark",
                                "-p", "mutate_order"],
        "process_isolation": "forkserver",
        "use_git_change_detection": False,
        "timeout_multiplier": 10.0,
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    text = project + "\n".join(lines) + "\n"
    if not (ws / "pyproject.toml").exists() or (ws / "pyproject.toml").read_text() != text:
        (ws / "pyproject.toml").write_text(text)
    return ws


def _in_scope(spec: Spec, mutant: str) -> bool:
    return not spec.functions or any(fnmatch.fnmatch(mutant, g) for g in spec.functions)


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def run(names: list[str], jobs: int) -> None:
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="160",
               KVBENCH_CACHE="off")
    for name in names:
        spec = MODULES[name]
        ws = _workspace(name, spec)
        t0 = time.monotonic()
        # A first run takes every mutant in scope; a later one the mutants not yet decided
        # and the survivors (a test written since may kill them).
        meta = ws / "mutants" / (spec.source + ".meta")
        before = _verdicts(ws, spec) if meta.exists() else {}
        if before:  # map the tests afresh: mutmut keeps the first run's test-to-function map,
            # so a test function written since would not run against the mutants it reaches
            (ws / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
        runs = [list(spec.functions)] if not before else [] if spec.functions else [[]]
        # not checked: never run, or reset by mutmut when the module's test list changed
        redo = [k for k, v in before.items() if v in ("survived", "no tests", "not checked")]
        for names_ in runs + ([redo] if redo else []):
            done = subprocess.run([mutmut, "run", "--max-children", str(jobs), *names_],
                                  cwd=ws, env=env, capture_output=True, text=True)
            if done.returncode:  # e.g. a test that fails without any mutant
                tail = done.stdout.replace("\r", "\n").splitlines()[-3:]
                print(f"{name}: mutmut failed ({done.returncode}):", *tail, sep="\n  ")
        _export(name, spec, ws, time.monotonic() - t0, redo)


# -6: SIGABRT, a test process that died as with -11 (glibc's heap checks: a mutant that
# makes a native call write past its buffer)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          -11: "segfault", -9: "segfault", -6: "segfault", None: "not checked"}


def _verdicts(ws: Path, spec: Spec) -> dict[str, str]:
    meta = json.loads((ws / "mutants" / (spec.source + ".meta")).read_text())
    return {k: STATUS.get(v, "suspicious") for k, v in sorted(meta["exit_code_by_key"].items())
            if _in_scope(spec, k)}


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({m: get_diff_for_mutant(m) for m in sys.argv[1:]}))
"""


def _diffs(ws: Path, mutants: list[str]) -> dict[str, str]:
    """Each mutant's diff (changed lines only), from one process in the workspace."""
    if not mutants:
        return {}
    out = subprocess.run([sys.executable, "-c", _DIFFS, *mutants], cwd=ws, check=True,
                         capture_output=True, text=True)
    return {m: "\n".join(line for line in diff.splitlines()
                         if line.startswith(("+", "-", "@@"))
                         and not line.startswith(("+++", "---")))
            for m, diff in json.loads(out.stdout.splitlines()[-1]).items()}


def _export(name: str, spec: Spec, ws: Path, seconds: float, redo: list[str]) -> None:
    verdicts = _verdicts(ws, spec)
    path = OUT / f"{name}.json"
    # survivors of an earlier run that a test written since kills, kept across runs
    earlier = json.loads(path.read_text()).get("killed_on_rerun", []) if path.exists() else []
    rescued = sorted({*earlier, *(k for k in redo if verdicts.get(k) in ("killed", "timeout"))}
                     & set(verdicts))
    survivors = _diffs(ws, [k for k, v in verdicts.items() if v in ("survived", "no tests")])
    OUT.mkdir(parents=True, exist_ok=True)
    record = {
        "module": name, "source": spec.source, "tests": list(spec.tests),
        "commit": _commit(),
        "source_sha256": hashlib.sha256((ROOT / spec.source).read_bytes()).hexdigest(),
        "seconds": round(seconds, 1), "target": spec.target, "group": spec.group,
        "verdicts": verdicts, "survivor_diffs": survivors, "killed_on_rerun": rescued,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    counts = {s: sum(v == s for v in verdicts.values()) for s in set(verdicts.values())}
    print(f"{name}: {counts} in {seconds:.0f} s", flush=True)


def _score(record: dict, reasons: dict[str, str]) -> dict:
    """Counts of one module; survivors triaged "equivalent: why" leave the score."""
    verdicts = record["verdicts"]
    killed = sum(v in ("killed", "segfault") for v in verdicts.values())
    timeout = sum(v == "timeout" for v in verdicts.values())
    alive = [k for k, v in verdicts.items() if v in ("survived", "no tests", "suspicious")]
    equivalent = [k for k in alive if reasons.get(k, "").startswith("equivalent")]
    survived = [k for k in alive if k not in equivalent]
    counted = killed + timeout + len(survived)
    score = (killed + timeout) / counted if counted else 1.0
    return {"killed": killed, "timeout": timeout, "survived": len(survived),
            "equivalent": len(equivalent), "not_run": sum(v == "not checked"
                                                          for v in verdicts.values()),
            "total": len(verdicts), "score": round(score, 4),
            "meets_target": score >= record["target"] and not any(
                v == "not checked" for v in verdicts.values()),
            "killed_by_new_tests": len(record.get("killed_on_rerun", [])),
            "untriaged": [k for k in survived if k not in reasons]}


def summary() -> None:
    """results/mutation/summary.{json,md} from the modules' exports and the triage file
    (one TOML table per module: mutant = "equivalent: why"; [notes]: module = text)."""
    triage = tomllib.loads(TRIAGE.read_text()) if TRIAGE.exists() else {}
    notes = triage.pop("notes", {})
    reasons: dict[str, str] = {k: v for table in triage.values() for k, v in table.items()}
    records = {n: json.loads((OUT / f"{n}.json").read_text()) for n in ORDER
               if (OUT / f"{n}.json").exists()}
    rows = {n: _score(rec, reasons) for n, rec in records.items()}
    missing = [n for n in ORDER if n not in rows]
    (OUT / "summary.json").write_text(json.dumps(
        {"modules": {n: {**rows[n], "source": records[n]["source"],
                         "commit": records[n]["commit"], "seconds": records[n]["seconds"],
                         "target": records[n]["target"], "note": notes.get(n, "")}
                     for n in rows}, "not_run": missing}, indent=1) + "\n")
    md = ["# Mutation testing (issue 30)", "",
          "Written by `python tools/mutate.py summary` from results/mutation/<module>.json "
          "(written by `make mutate`) and results/mutation/triage.toml. Score = (killed + "
          "timeout) / (killed + timeout + survived), survivors triaged equivalent left out; "
          "\"new tests\" counts survivors of an earlier run that a test written since kills.",
          "", "| module | source | commit | killed | timeout | survived | equivalent | "
          "score | target | new tests | run (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in rows.items():
        rec = records[n]
        met = "" if r["meets_target"] else " (below)"
        if r["not_run"]:
            met += f" ({r['not_run']} of {r['total']} not run)"
        md.append(f"| {n} | {rec['source']} | {rec['commit'][:7]} | {r['killed']} | "
                  f"{r['timeout']} | {r['survived']} | {r['equivalent']} | "
                  f"{100 * r['score']:.1f}%{met} | {100 * rec['target']:.0f}% | "
                  f"{r['killed_by_new_tests']} | {rec['seconds']} |")
    if missing:
        md += ["", "Not run yet: " + ", ".join(missing) + "."]
    md += [f"- {n}: {text}" for n, text in notes.items()]
    md += ["", "## Surviving mutants", ""]
    for rec in records.values():
        for k, diff in rec["survivor_diffs"].items():
            md += [f"- `{k}`: {reasons.get(k, 'UNTRIAGED')}", "", "  ```diff",
                   *("  " + line for line in diff.splitlines()), "  ```", ""]
    (OUT / "summary.md").write_text("\n".join(md) + "\n")
    for n, r in rows.items():
        print(f"{n}: {100 * r['score']:.1f}% (target {100 * records[n]['target']:.0f}%), "
              f"{len(r['untriaged'])} untriaged, {r['not_run']} not run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("modules", nargs="*", help=f"any of: {' '.join(ORDER)} (default: all)")
    r.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATE_JOBS", "2")))
    sub.add_parser("summary")
    args = ap.parse_args()
    if args.cmd == "summary":
        summary()
        return
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        sys.exit(f"unknown module(s) {' '.join(unknown)}; known: {' '.join(ORDER)}")
    run(args.modules or ORDER, args.jobs)
    summary()


if __name__ == "__main__":
    main()
