#!/usr/bin/env bash
# HGCA Table 1 on the bundled model (smollm2-135m) with the paper's protocol (section 5.3:
# perplexity of the whole text, not of the first generated token): 2048 tokens of text, every
# token after the first predicted by a teacher-forced decode step (prompt 1, 2046 decode
# steps), so each strategy's eviction and selection act while the text is generated. GPU
# share x beta grid for hgca, h2o and streaming at the same accelerator KV budget (share of
# the 2048-token cache), full attention as the reference; hgca's other knobs at their
# defaults. One result file per configuration, written as NAME.part and renamed when the
# run completed, so a rerun resumes (and runs started side by side share the work); JOBS (default 2) configurations at a time, one thread
# each; ONLY=REGEX runs the configurations whose name matches (and skips the breakdown).
# Render with: .venv/bin/python results/hgca-table1/render.py
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT=results/hgca-table1
configs() {  # the bar's configurations first
  echo "full full"
  echo "hgca-s0.25-b1.0 hgca --gpu-share 0.25 --beta 1.0"
  echo "h2o-s0.25 h2o --gpu-share 0.25"
  echo "streaming-s0.25 streaming --gpu-share 0.25"
  echo "hgca-s0.25-b0 hgca --gpu-share 0.25 --beta 0"  # every host entry: must equal full
  for s in 0.25 0.5 0.75; do
    for b in 0.25 0.5 0.75 1.0; do echo "hgca-s$s-b$b hgca --gpu-share $s --beta $b"; done
    echo "h2o-s$s h2o --gpu-share $s"
    echo "streaming-s$s streaming --gpu-share $s"
  done
}
one() {  # one NAME STRATEGY ARGS...: run unless its result file exists
  local name=$1 f="$OUT/$1.jsonl"
  shift
  [ -s "$f" ] && return 0
  exec {lock}>"$f.lock"
  flock -n "$lock" || return 0  # another run.sh is on this configuration
  rm -f "$f.part"
  .venv/bin/kvbench run "$@" --mode eval --prompt-len 1 --gen-len 2046 --threads 1 \
    --out "$f.part" > "$OUT/$name.log" 2>&1 && mv "$f.part" "$f"
}
export -f one
configs | awk '!seen[$1]++' | grep -E "^(${ONLY:-.*}) " | xargs -P "${JOBS:-2}" -L 1 bash -c 'one "$@"' _
[ -z "${ONLY:-}" ] || exit 0
# alpha (not given in the paper) was chosen before the grid ran, on held-out text: the default
# text from character 150000 on, GPU share 0.25, beta 1, same protocol (alpha/):
#   .venv/bin/python -c "from kvbench.runtime.run import read_text as r
#   open('/tmp/heldout.txt', 'w').write(r('')[150000:])"
#   for a in 0.001 0.003 0.01 0.03 0.1; do .venv/bin/kvbench run hgca --gpu-share 0.25 \
#     --beta 1.0 --alpha $a --text /tmp/heldout.txt --mode eval --prompt-len 1 \
#     --gen-len 2046 --threads 1 --out $OUT/alpha/hgca-a$a-s0.25-b1.0.jsonl; done
#   (and h2o --gpu-share 0.25 the same way into alpha/h2o-s0.25.jsonl)
# multi-turn (multiturn/): each of full, hgca, h2o and streaming (the last three at
# --gpu-share 0.25) with --mode eval --prompt-len 192 --gen-len 128 --turns 4 --threads 1
# hgca's decode-step breakdown at batch 1, 2048 context (a timing: run it alone on an
# otherwise idle machine, default threads): prompt 1536 then 511 generated tokens, so the
# ring evicts a block every 64 steps per layer
bd=$OUT/breakdown/hgca-generate-2048.jsonl
[ -s "$bd" ] || .venv/bin/kvbench run hgca --mode generate --prompt-len 1536 --gen-len 511 \
  --gpu-share 0.25 --beta 1.0 --out "$bd"
