#!/bin/sh
# HGCA Fig. 12 as a projection (issue 14): the FlexGen-style offload, H2O and HGCA runs of
# the validation suite (results/projection-validation/measured.jsonl: bundled SmolLM2-135M,
# batch 1, prompt 32, 8 decode steps, measured on the shared 2-core VM) projected onto
# OPT-6.7B/13B/30B at the paper's prompt 1920 and 128 generated tokens, batch 1..32, on the
# RTX A6000 / PCIe 4.0 profile, with the runs' selection statistics carried over.
# (A dedicated source run at the paper's settings, `kvbench run hgca --gpu-share 0.05
# --prompt-len 512`, did not get enough CPU on the loaded machine in the time available.)
set -e
cd "$(dirname "$0")/../.."
D=results/hgca-fig12
python - <<'PY'
import json
src = "results/projection-validation/measured.jsonl"
keep = []
for line in open(src):
    r = json.loads(line)
    p = r.get("params", {})
    if r["kind"] == "env" or (r["name"] in ("offload", "h2o", "hgca") and p.get("batch") == 1
                              and p.get("prompt_len") == 32):
        keep.append(line)
open("results/hgca-fig12/source.jsonl", "w").writelines(keep)
PY
rm -f $D/projected-*.jsonl
for m in opt-6.7b opt-13b opt-30b; do
  for b in 1 2 4 8 16 32; do
    for bk in measured none; do
      kvbench project $D/source.jsonl --hardware a6000-pcie4 --model $m --batch $b \
        --prompt-len 1920 --gen-len 128 --bookkeeping $bk --out $D/projected-$bk.jsonl
    done
  done
done
python $D/render.py
