#!/bin/bash
# Issue 11 item 3: kvbench's 256M host-to-host copy median against an independent pthread
# memcpy loop (memcpy_ref.c) run right before and after it, ROUNDS times per thread count.
# Each round's ratio is the probe over the mean of the two references around it, so a
# machine that drifts over minutes reaches both alike; the last line per thread count is the
# median ratio over the rounds with its range (a VM's memory bandwidth moves +-25% within
# seconds: one round says little, results/compare-noise).
# Usage: check_memcpy.sh OUT_DIR [ROUNDS] [THREAD_COUNTS]   (run from the repository root)
set -euo pipefail
out=$1; rounds=${2:-5}; counts=${3:-"1 $(nproc)"}
here=$(dirname "$0"); mkdir -p "$out"
cc -O2 -pthread "$here/memcpy_ref.c" -o "$out/memcpy_ref"
echo "threads round ref_before probe ref_after probe_over_ref"
for t in $counts; do
  b=$("$out/memcpy_ref" "$t")
  ratios=""
  for r in $(seq "$rounds"); do
    a=$b
    f="$out/bw-t$t-r$r.jsonl"
    rm -f "$f"
    .venv/bin/kvbench probe bandwidth --src host:0 --dst host:0 --sizes 256M --threads "$t" \
      --out "$f" >/dev/null
    p=$(.venv/bin/python -c "import json,sys; print(round([json.loads(l)['value'] for l in open(sys.argv[1]) if '\"metric\":\"peak_bandwidth\"' in l][0], 3))" "$f")
    b=$("$out/memcpy_ref" "$t")
    q=$(python3 -c "print(round($p / (($a + $b) / 2), 3))")
    ratios="$ratios $q"
    echo "$t $r $a $p $b $q"
  done
  python3 -c "import statistics as s, sys; v = [float(x) for x in sys.argv[2:]]; print(f'# threads {sys.argv[1]}: median probe/ref {s.median(v):.3f} over {len(v)} rounds (min {min(v):.3f}, max {max(v):.3f}; {sum(x >= 0.9 for x in v)} of {len(v)} >= 0.9)')" "$t" $ratios
done
