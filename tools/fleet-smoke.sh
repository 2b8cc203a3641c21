#!/bin/sh
# Issue 17's done-when on one machine: the smoke suite through a Ray cluster whose two worker
# nodes stand in for two machine classes (`small`, which also advertises `cxl`, and `big`),
# into one result file, then the report with both machines side by side.
# Both stand-ins are this same 2-core VM: their columns should agree within the run-to-run
# spread (results/baselines/README.md), which checks the plumbing, not the hardware. The two
# classes run one after the other (--on small, then --on big --resume into the same file),
# so no case of one stand-in shares the CPUs with a case of the other.
# The cluster lives in its own temp dir and port, and each node is a `ray start --block`
# process: stopping it (SIGTERM to that process) stops that node only, where `ray stop`
# would stop every Ray node on the machine (other sessions' test clusters too).
# A quick check of the script itself: ONLY='timer*' tools/fleet-smoke.sh /tmp/f.jsonl
# (only the units matching ONLY, into that file, not rendered).
set -e
cd "$(dirname "$0")/.."
D=results/fleet-smoke
OUT=${1:-$D/smoke.jsonl}
T=/tmp/kvb-ray                       # the cluster's temp dir (session logs)
PORT=6390
HEAD=$(hostname -I | cut -d' ' -f1):$PORT
export RAY_AUTH_MODE=token           # every node and the driver (docs/fleet.md: Authentication)
export PYTHONPATH="$PWD"             # the nodes' `kvbench run` children import this checkout
RAY=".venv/bin/ray"
KVB=".venv/bin/kvbench"
STORE=200000000                      # 200 MB object store per node: records are small
$RAY get-auth-token --generate >/dev/null   # the cluster's token in ~/.ray/auth_token
mkdir -p $D/logs
nice -n 19 $RAY start --head --port $PORT --num-cpus 0 --temp-dir $T --include-dashboard false \
    --object-store-memory $STORE --disable-usage-stats --block > $D/logs/head.log 2>&1 &
echo $! > $D/logs/pids
trap 'kill -TERM $(cat $D/logs/pids) 2>/dev/null; sleep 5' EXIT   # this cluster's nodes only
sleep 10
# nodes on one machine start one at a time (two starting together can pick the same port)
nice -n 19 $RAY start --address "$HEAD" --num-cpus 1 --node-name small-1 \
    --resources '{"class:small": 1, "cxl": 1}' --object-store-memory $STORE \
    --disable-usage-stats --block > $D/logs/small.log 2>&1 &
echo $! >> $D/logs/pids
sleep 15
nice -n 19 $RAY start --address "$HEAD" --num-cpus 1 --node-name big-1 \
    --resources '{"class:big": 1}' --object-store-memory $STORE \
    --disable-usage-stats --block > $D/logs/big.log 2>&1 &
echo $! >> $D/logs/pids
sleep 15
$RAY status --address "$HEAD"
nice -n 19 $KVB suite run suites/smoke.toml --ray "$HEAD" --on small --out "$OUT" \
    ${ONLY:+--only "$ONLY"}
nice -n 19 $KVB suite run suites/smoke.toml --ray "$HEAD" --on big --out "$OUT" --resume \
    ${ONLY:+--only "$ONLY"}
# the committed summary: every env line and record but the per-layer traces (~3.5 MB a
# machine), and the report with both machines side by side
[ "$OUT" != $D/smoke.jsonl ] || {
  .venv/bin/python -c "from pathlib import Path; from kvbench.store import slim; \
slim([Path('$D/smoke.jsonl')], Path('$D/summary.jsonl'), ())"
  $KVB report $D/summary.jsonl --format markdown > $D/report.md
}
