#!/bin/bash
# Issue 11 item 3: kvbench's 256M host-to-host copy median against an independent pthread
# memcpy loop (memcpy_ref.c) run right before and after it, ROUNDS times per thread count.
# Usage: check_memcpy.sh OUT_DIR [ROUNDS] [THREAD_COUNTS]   (run from the repository root)
set -euo pipefail
out=$1; rounds=${2:-5}; counts=${3:-"1 $(nproc)"}
here=$(dirname "$0"); mkdir -p "$out"
cc -O2 -pthread "$here/memcpy_ref.c" -o "$out/memcpy_ref"
echo "threads round ref_before probe ref_after probe_over_ref"
for t in $counts; do
  for r in $(seq "$rounds"); do
    a=$("$out/memcpy_ref" "$t")
    f="$out/bw-t$t-r$r.jsonl"
    .venv/bin/kvbench probe bandwidth --src host:0 --dst host:0 --sizes 256M --threads "$t" \
      --out "$f" >/dev/null
    p=$(.venv/bin/python -c "import json,sys; print([json.loads(l)['value'] for l in open(sys.argv[1]) if '\"metric\":\"peak_bandwidth\"' in l][0])" "$f")
    b=$("$out/memcpy_ref" "$t")
    echo "$t $r $a $p $b $(python3 -c "print(round($p / (($a + $b) / 2), 3))")"
  done
done
