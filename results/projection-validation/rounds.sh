#!/bin/sh
# Issue 14, validation (a), repeated in time: ROUNDS (default 3) rounds of the whole grid
# (suites/projection-validation.toml), probes before the first round and after every one.
# Round r is projected onto `--hardware this` from the probes on either side of it
# (probes-(r-1) and probes-r pooled: the machine's speed over that round); render.py then
# compares, per case, the median measured step over the rounds with the median projection.
# A VM that drifts by tens of percent between minutes (notes.md) moves single runs and single
# probe sets; the medians over rounds spread in time are what the model must match.
# Usage (repository root): PRIO="chrt -f 10" ROUNDS=3 sh results/projection-validation/rounds.sh
set -e
cd "$(dirname "$0")/../.."
D=results/projection-validation/rounds
K="${PRIO:-nice -n 10} kvbench"
R="${ROUNDS:-3}"
. results/projection-validation/probes.sh
rm -rf $D && mkdir -p $D
echo "probes 0: $(date -u +%H:%M) load $(cat /proc/loadavg)" > $D/load.txt
probes $D/probes-0.jsonl
r=1
while [ $r -le "$R" ]; do
  echo "round $r: $(date -u +%H:%M) load $(cat /proc/loadavg)" >> $D/load.txt
  $K suite run suites/projection-validation.toml --out $D/measured-$r.jsonl || true
  echo "probes $r: $(date -u +%H:%M) load $(cat /proc/loadavg)" >> $D/load.txt
  probes $D/probes-$r.jsonl
  cat $D/probes-$((r - 1)).jsonl $D/probes-$r.jsonl > $D/pooled.jsonl
  $K project $D/measured-$r.jsonl --hardware this --probes $D/pooled.jsonl --out $D/projected-$r.jsonl
  $K project $D/measured-$r.jsonl --hardware this --probes $D/probes-$((r - 1)).jsonl \
     --out $D/projected-before-$r.jsonl
  r=$((r + 1))
done
echo "end: $(date -u +%H:%M) load $(cat /proc/loadavg)" >> $D/load.txt
rm -f $D/pooled.jsonl
python results/projection-validation/render.py
