#!/usr/bin/env bash
# HGCA Table 1 on the bundled model (smollm2-135m): 2048 tokens of text, prompt 1792,
# 255 teacher-forced decode steps (perplexity over the last 256 tokens), GPU share x beta
# grid for hgca, h2o and streaming at the same accelerator KV budget (share 0.25, 0.5, 0.75),
# full attention as the reference. One result file per configuration; existing ones are kept
# (rerun resumes). Render with: .venv/bin/python results/hgca-table1/render.py
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/hgca-table1
RUN=(.venv/bin/kvbench run)
COMMON=(--mode eval --prompt-len 1792 --gen-len 255)
one() {  # one NAME ARGS...: run unless its result file exists
  local f="$OUT/$1.jsonl"; shift
  [ -s "$f" ] || "${RUN[@]}" "$@" "${COMMON[@]}" --out "$f"
}
one full full
one hgca-s0.25-b1.0 hgca --gpu-share 0.25 --beta 1.0
one h2o-s0.25 h2o --budget 0.25
one streaming-s0.25 streaming --budget 0.25
for s in 0.25 0.5 0.75; do
  for b in 0.25 0.5 0.75 1.0; do one "hgca-s$s-b$b" hgca --gpu-share "$s" --beta "$b"; done
  one "h2o-s$s" h2o --budget "$s"
  one "streaming-s$s" streaming --budget "$s"
done
