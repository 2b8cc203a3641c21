#!/bin/sh
# Issue 14, validation (a): measured runs of every strategy on this machine against their
# projection onto `--hardware this`, built from probes taken just before the runs (and,
# to show how far the machine drifted meanwhile, from probes taken just after).
# The 2-core VM is shared with other agents: everything runs under $PRIO (default nice -n 10;
# `PRIO="chrt -f 10" sh run.sh` shields it from them as SCHED_FIFO) and the load average is
# logged around each phase (load.txt).
set -e
cd "$(dirname "$0")/../.."
D=results/projection-validation
K="${PRIO:-nice -n 10} kvbench"
. results/projection-validation/probes.sh
# `run.sh resume` continues an interrupted suite (probes-before kept)
if [ "$1" != resume ]; then
  rm -f $D/probes-before.jsonl $D/probes-after.jsonl $D/measured.jsonl $D/projected-*.jsonl
  echo "before probes: $(cat /proc/loadavg)" > $D/load.txt
  probes $D/probes-before.jsonl
fi
rm -f $D/probes-after.jsonl
echo "before runs: $(cat /proc/loadavg)" >> $D/load.txt
$K suite run suites/projection-validation.toml --resume --out $D/measured.jsonl || true
echo "after runs: $(cat /proc/loadavg)" >> $D/load.txt
probes $D/probes-after.jsonl
echo "after probes: $(cat /proc/loadavg)" >> $D/load.txt
$K project $D/measured.jsonl --hardware this --probes $D/probes-before.jsonl --out $D/projected-before.jsonl
$K project $D/measured.jsonl --hardware this --probes $D/probes-after.jsonl --out $D/projected-after.jsonl
# both probe sets pooled: the machine's speed over the whole window (medians of the two)
cat $D/probes-before.jsonl $D/probes-after.jsonl > $D/probes-pooled.jsonl
$K project $D/measured.jsonl --hardware this --probes $D/probes-pooled.jsonl --out $D/projected-pooled.jsonl
rm $D/probes-pooled.jsonl
python results/projection-validation/render.py
