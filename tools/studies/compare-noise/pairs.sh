#!/bin/bash
# Issue 11 item 17: does `kvbench compare` cry wolf? Each probe's default run is repeated
# RUNS times unchanged; every consecutive pair (run i, run i+1) is compared at the default
# threshold and its exit code logged (0 clean, 1 regression). Then run 0 with its GB/s halved
# must exit 1. Usage (repository root): pairs.sh OUT_DIR [RUNS] [PROBES]
set -uo pipefail
out=$1; runs=${2:-11}; probes=${3:-"timer bandwidth latency attention roofline"}
mkdir -p "$out"
echo "probe pair exit regressed"
for p in $probes; do
  for i in $(seq 0 $((runs - 1))); do
    [ -s "$out/$p-$i.jsonl" ] || .venv/bin/kvbench probe "$p" --out "$out/$p-$i.jsonl" >/dev/null 2>&1
    if [ "$i" -gt 0 ]; then
      .venv/bin/kvbench compare "$out/$p-$((i - 1)).jsonl" "$out/$p-$i.jsonl" --format json \
        > "$out/$p-cmp-$i.json" 2>/dev/null
      rc=$?
      reg=$(.venv/bin/python -c "import json,sys; print(';'.join(sorted({r['metric'] for r in json.load(open(sys.argv[1]))['rows'] if r['verdict'] == 'regressed'})) or '-')" "$out/$p-cmp-$i.json")
      echo "$p $((i - 1))-$i $rc $reg"
    fi
  done
done
