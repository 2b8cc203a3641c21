"""Validation table of issue 14 (a): measured vs projected decode step time (tbt median)
and prefill time (ttft) per strategy, batch and prompt, on this machine.

Reads measured.jsonl (the suite projection-validation; ~20 MB with the per-(step, layer)
task graphs `kvbench project` needs, kept local) into measured-summary.jsonl (committed,
without the traces), projected-before.jsonl and projected-after.jsonl (`kvbench project
... --hardware this` with the probes taken before and after the runs), load.txt and
notes.md (this run's reading); and the repeated runs of rounds.sh under rounds/; writes
table.md. Error = projected / measured - 1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kvbench.store import load, slim

HERE = Path(__file__).parent
DROP = ("hardware", "where", "energy_devices")


def _key(r: dict) -> tuple:
    p = {k: v for k, v in r["params"].items() if k not in DROP}
    return (r["name"], tuple(sorted((k, repr(v)) for k, v in p.items())))


def _values(path: Path, provenance: str) -> dict[tuple, dict[str, float]]:
    out: dict[tuple, dict[str, float]] = {}
    if not path.exists():
        return out
    for r in load(path).records:
        if r.get("kind") == "run" and r.get("provenance") == provenance \
                and r["metric"] in ("tbt", "ttft", "carried_share") and r.get("status") == "ok":
            out.setdefault(_key(r), {})[r["metric"]] = r["value"]
            out[_key(r)]["_params"] = r["params"]  # type: ignore[assignment]
    return out


def _summary(errors: list[float]) -> str:
    if not errors:
        return "n/a"
    a = [abs(e) for e in errors]
    return f"median {statistics.median(a):.1%}, worst {max(a):.1%} (n={len(a)})"


def per_case() -> tuple[str, list[str]]:
    """(summary line, table) of per_case.py's runs: each case against its projection from
    the roofline and timer probes taken right before it."""
    d = HERE / "per-case"
    raw = sorted(d.glob("measured-*.jsonl"))
    if raw:
        slim(raw, d / "measured-summary.jsonl", ())
    meas = _values(d / "measured-summary.jsonl", "measured")
    proj = _values(HERE / "projected-per-case.jsonl", "projected")
    lines = ["| strategy | batch | prompt | measured tbt | projected tbt | error | carried share |",
             "|---" * 7 + "|"]
    errs: list[float] = []
    for key in sorted(meas, key=lambda k: (k[0], str(meas[k]["_params"]["batch"]),
                                            str(meas[k]["_params"]["prompt_len"]))):
        m, p, j = meas[key], meas[key]["_params"], proj.get(key, {})
        if "tbt" not in j:
            continue
        e = j["tbt"] / m["tbt"] - 1
        errs.append(e)
        lines.append(f"| {key[0]} | {p['batch']} | {p['prompt_len']} | {m['tbt'] * 1e3:.1f} ms | "
                     f"{j['tbt'] * 1e3:.1f} ms | {e:+.1%} | {j.get('carried_share', 0):.0%} |")
    return f"- decode step time, each case from its own probes: {_summary(errs)}", lines


def rounds() -> tuple[list[str], list[str]]:
    """(summary lines, table) of rounds.sh: per case, the median over rounds of the measured
    step against the median of the rounds' projections (each from the probes either side of
    its round), and the per-round errors for comparison."""
    d = HERE / "rounds"
    n = 0
    meas, pooled, before = [], [], []
    while (d / f"projected-{n + 1}.jsonl").exists():
        n += 1
        raw = d / f"measured-{n}.jsonl"
        if raw.exists():
            slim([raw], d / f"measured-{n}-summary.jsonl", ())
        meas.append(_values(d / f"measured-{n}-summary.jsonl", "measured"))
        pooled.append(_values(d / f"projected-{n}.jsonl", "projected"))
        before.append(_values(d / f"projected-before-{n}.jsonl", "projected"))
    if not n:
        return [], []
    lines = ["| strategy | batch | prompt | measured tbt per round | median | projected tbt per "
             "round | median | error of medians | carried share | measured ttft (median) | "
             "projected ttft (median) | error |", "|---" * 12 + "|"]
    err_med, err_round, err_before, err_ttft = [], [], [], []
    params = {k: m[k]["_params"] for m in meas for k in m}
    keys = sorted(params, key=lambda k: (k[0], str(params[k]["batch"]),
                                         str(params[k]["prompt_len"])))
    for key in keys:
        pairs = [(m[key], j[key]) for m, j in zip(meas, pooled, strict=True)
                 if "tbt" in m.get(key, {}) and "tbt" in j.get(key, {})]
        if not pairs:
            continue
        p = params[key]
        mt = [m["tbt"] for m, _ in pairs]
        jt = [j["tbt"] for _, j in pairs]
        err_round += [b / a - 1 for a, b in zip(mt, jt, strict=True)]
        err_before += [b[key]["tbt"] / m[key]["tbt"] - 1 for m, b in zip(meas, before,
                                                                          strict=True)
                       if "tbt" in b.get(key, {}) and "tbt" in m.get(key, {})]
        e = statistics.median(jt) / statistics.median(mt) - 1
        err_med.append(e)
        mf = statistics.median(m["ttft"] for m, _ in pairs)
        jf = statistics.median(j["ttft"] for _, j in pairs)
        err_ttft.append(jf / mf - 1)
        carried = statistics.median(j.get("carried_share", 0.0) for _, j in pairs)
        lines.append(
            f"| {key[0]} | {p['batch']} | {p['prompt_len']} | "
            f"{', '.join(f'{x * 1e3:.0f}' for x in mt)} ms | {statistics.median(mt) * 1e3:.1f} ms"
            f" | {', '.join(f'{x * 1e3:.0f}' for x in jt)} ms | "
            f"{statistics.median(jt) * 1e3:.1f} ms | {e:+.1%} | {carried:.0%} | {mf:.2f} s | "
            f"{jf:.2f} s | {jf / mf - 1:+.1%} |")
    load_txt = (d / "load.txt").read_text().strip() if (d / "load.txt").exists() else ""
    summary = [
        f"- **decode step time, median over {n} rounds vs median projection: "
        f"{_summary(err_med)}**",
        f"- decode step time, each round against its own projection: {_summary(err_round)}",
        f"- decode step time, each round from the probes before it only: "
        f"{_summary(err_before)}",
        f"- prefill time, medians over rounds: {_summary(err_ttft)}",
        "", "Timeline of the rounds (UTC) and the load average (1, 5, 15 min):", "",
        "```", load_txt, "```"]
    return summary, lines


def main() -> None:
    if (HERE / "measured.jsonl").exists():
        slim([HERE / "measured.jsonl"], HERE / "measured-summary.jsonl", ())
    meas = _values(HERE / "measured-summary.jsonl", "measured")
    before = _values(HERE / "projected-before.jsonl", "projected")
    after = _values(HERE / "projected-after.jsonl", "projected")
    pooled = _values(HERE / "projected-pooled.jsonl", "projected")
    lines = ["| strategy | batch | prompt | measured tbt | projected tbt (probes before) | "
             "error | carried share | projected tbt (probes after) | error | projected tbt "
             "(pooled) | error | measured ttft | projected ttft (before) | error |",
             "|---" * 14 + "|"]
    err_b, err_a, err_p, err_t = [], [], [], []
    for key in sorted(meas, key=lambda k: (k[0], str(meas[k]["_params"]["batch"]),
                                            str(meas[k]["_params"]["prompt_len"]))):
        m, p = meas[key], meas[key]["_params"]
        b, a, pl = before.get(key, {}), after.get(key, {}), pooled.get(key, {})

        def err(proj: dict, metric: str, acc: list[float], m: dict = m) -> str:
            if metric not in proj:
                return "-"
            e = proj[metric] / m[metric] - 1
            acc.append(e)
            return f"{e:+.1%}"

        eb, ea, et = err(b, "tbt", err_b), err(a, "tbt", err_a), err(b, "ttft", err_t)
        ep = err(pl, "tbt", err_p)
        lines.append(f"| {key[0]} | {p['batch']} | {p['prompt_len']} | {m['tbt'] * 1e3:.1f} ms | "
                     f"{b.get('tbt', float('nan')) * 1e3:.1f} ms | {eb} | "
                     f"{b.get('carried_share', float('nan')):.0%} | "
                     f"{a.get('tbt', float('nan')) * 1e3:.1f} ms | {ea} | "
                     f"{pl.get('tbt', float('nan')) * 1e3:.1f} ms | {ep} | {m['ttft']:.2f} s | "
                     f"{b.get('ttft', float('nan')):.2f} s | {et} |")
    own, own_lines = per_case()
    round_summary, round_lines = rounds()
    load_txt = (HERE / "load.txt").read_text() if (HERE / "load.txt").exists() else ""
    # this run's reading of the figures (conditions, what the errors come from)
    notes = (HERE / "notes.md").read_text().strip() if (HERE / "notes.md").exists() else ""
    text = "\n".join([
        "# Projection validation on this machine (issue 14, validation a)",
        "",
        "Measured decode step time (tbt, median of 8 steps) and prefill time (ttft) of every",
        "strategy against `kvbench project --hardware this`, the profile built from this",
        "machine's probes. Machine: the 2-core CPU VM (no GPU: the accelerator role is the",
        "CPU), shared with other agents.",
        "",
        *(["## Repeated rounds (`rounds.sh`): the result", "", *round_summary, ""]
          if round_summary else []),
        "Done-when bar of the issue: 15% median, 25% worst (decode step time). Carried share:",
        "the part of the projected step that is measured time carried over (a CPU run's",
        "dispatch and bookkeeping without a work model), not modelled from the probes.",
        "",
        notes,
        "",
        *(["Commands: `PRIO=\"chrt -f 10\" ROUNDS=3 sh results/projection-validation/rounds.sh`",
           "(probes, then per round the suite `suites/projection-validation.toml` and the",
           "probes again, each round projected from the probes either side of it, then this",
           "script).", "", *round_lines, ""] if round_lines else []),
        "## One run, probes before and after (`run.sh`, 2026-11-23 08:04-08:30)",
        "",
        "The priority the runs had and the load average around each phase (1, 5, 15 min):",
        "",
        "```", load_txt.strip(), "```",
        "",
        f"- decode step time, probes before: {_summary(err_b)}",
        f"- decode step time, probes after: {_summary(err_a)}",
        f"- decode step time, both probe sets pooled: {_summary(err_p)}",
        own,
        f"- prefill time, probes before: {_summary(err_t)}",
        "",
        "Commands: `sh results/projection-validation/run.sh` (probes, the suite",
        "`suites/projection-validation.toml`, probes again, two `kvbench project` calls,",
        "then this script).",
        "",
        *lines, "",
        "## Each case from probes taken right before it",
        "",
        "`per_case.py`: per case, `kvbench probe timer` and `kvbench probe roofline` (the",
        "dense layers' linear GB/s), then the run, then `kvbench project --hardware this`",
        "with those probes and the attention and copy curves of `probes-before.jsonl`.",
        "",
        *own_lines, ""])
    (HERE / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
