#!/bin/sh
# Issue 15's runs, one at a time, niced, one torch thread (a shared 2-core VM), then the
# projections and the tables. Usage: PYTHONPATH=. sh results/pnm/run.sh (repository root)
set -e
K="nice -n 19 .venv/bin/kvbench"
D=results/pnm
$K suite run suites/pnm-parallel.toml --resume
# both strategies as typed on the papers' model shapes (random weights, 2 layers)
for s in pnm-kv png-kv; do
  for m in opt-6.7b llama-3.1-8b; do
    $K run $s --model $m --weights random --layers 2 --prompt-len 256 --gen-len 4 \
      --threads 1 --budget-tokens 128 --page-size 16 --out $D/shapes-$s-$m.jsonl
  done
done
# source runs of the Figs. 10-14 projections, then the projections (seconds)
$K suite run suites/pnm-project.toml --resume
nice -n 19 .venv/bin/python $D/project.py
$K suite run suites/pnm-passkey.toml --resume
# pnm-kv's perplexity: suites/pnm-ppl.toml's case, one thread
$K run pnm-kv --mode eval --prompt-len 1 --gen-len 511 --threads 1 --budget-tokens 64 \
  --page-size 16 --sinks 1 --window-pages 2 --out $D/ppl-pnm-kv.jsonl
nice -n 19 .venv/bin/python $D/render.py
