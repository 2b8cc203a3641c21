"""Issue 14 validation (a), drift-controlled: each case of suites/projection-validation.toml
projected from probes taken right before it.

On this shared VM the machine's speed moves by tens of percent between minutes (notes.md),
so one probe set for a 26-minute grid measures the drift as much as the model. Here each
case runs right after its own roofline (linear GB/s: the dense layers) and timer probe;
attention and copy curves come from `probes-before.jsonl` (run.sh takes it). Writes
per-case/measured-NN.jsonl (local), per-case/probes.jsonl and projected-per-case.jsonl.

    PRIO="chrt -f 10" python results/projection-validation/per_case.py [FIRST LAST]

FIRST LAST (case indices, inclusive) re-run those cases only; their new projections are
appended and read last.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from kvbench.suite import units
from kvbench.suite_spec import load_suite

HERE = Path(__file__).parent
SUITE = HERE.parents[1] / "suites" / "projection-validation.toml"
OWN = ("roofline", "timer")  # probes taken per case; the rest from probes-before.jsonl


def sh(cmd: str) -> None:
    subprocess.run(shlex.split(os.environ.get("PRIO", "nice -n 10")) + shlex.split(cmd),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    out = HERE / "per-case"
    out.mkdir(exist_ok=True)
    base = [line for line in (HERE / "probes-before.jsonl").read_text().splitlines()
            if json.loads(line).get("name") not in OWN]
    projected = HERE / "projected-per-case.jsonl"
    todo = list(enumerate(units(load_suite(SUITE))))
    if len(sys.argv) == 3:
        todo = todo[int(sys.argv[1]):int(sys.argv[2]) + 1]
    else:
        projected.unlink(missing_ok=True)
    for i, unit in todo:
        probes, meas = out / f"probes-{i:02d}.jsonl", out / f"measured-{i:02d}.jsonl"
        for f in (probes, meas):
            f.unlink(missing_ok=True)
        sh(f"kvbench probe timer --out {probes}")
        sh(f"kvbench probe roofline --model smollm2-135m --tokens 512 --matmul 1024 "
           f"--linear-rows 1,8,32,128 --out {probes}")
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in unit.params.items())
        sh(f"kvbench run {unit.case.name} {flags} --out {meas}")
        merged = out / "merged.jsonl"
        merged.write_text("\n".join(base + probes.read_text().splitlines()) + "\n")
        sh(f"kvbench project {meas} --hardware this --probes {merged} --out {projected}")
        merged.unlink()
        print(i, unit.label, flush=True)
    # the per-case probes in one committed file; the runs' summaries for render.py
    with open(out / "probes.jsonl", "w") as f:
        for p in sorted(out.glob("probes-*.jsonl")):
            f.write(p.read_text())


if __name__ == "__main__":
    main()
