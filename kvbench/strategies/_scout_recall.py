"""ScoutAttention's per-layer recall intervals R_l (section 3.4): the offline profile.

"For each layer, we determine the maximum number of steps that keeps the measured ratio
below a threshold" tau: a calibration run decodes without recall and records, per layer
and decode step, the CPU compute ratio (tokens attended on the host / sparse budget,
Fig. 6a); R_l is the number of steps before the layer's ratio first exceeds tau (at least 1;
the steps observed when it never does, marked `censored`). Dense layers get 0 (no recall).

The interval file is JSON: {"kind": KIND, "model", "layers", "page_size", "budget_tokens",
"tau", "steps", "intervals": [R_0 .. R_{L-1}], "censored": [layer ids], "mean_ratio":
[per-layer mean ratio without recall]}. A run loads it only for the same model and layer
count (`load`); anything else is one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.errors import KvbenchError, require

KIND = "kvbench.scout.recall-intervals"


def intervals(ratios: list[list[float]], tau: float) -> tuple[list[int], list[int]]:
    """(R_l per layer, layers whose ratio never exceeded tau) from per-layer ratio series
    (ratios[l][t]: step t + 1 since prefill; an empty series is a dense layer: R_l = 0)."""
    out, censored = [], []
    for layer, series in enumerate(ratios):
        if not series:
            out.append(0)
            continue
        over = next((t for t, r in enumerate(series) if r > tau), None)
        if over is None:
            censored.append(layer)
            out.append(len(series))
        else:
            out.append(max(1, over))
    return out, censored


def write(path: str, model: str, ratios: list[list[float]], tau: float, page_size: int,
          budget_tokens: int) -> None:
    """Store the calibrated intervals of `model` (len(ratios) layers) at `path`."""
    r, censored = intervals(ratios, tau)
    doc = {"kind": KIND, "model": model, "layers": len(ratios), "page_size": page_size,
           "budget_tokens": budget_tokens, "tau": tau,
           "steps": max((len(s) for s in ratios), default=0), "intervals": r,
           "censored": censored,
           "mean_ratio": [sum(s) / len(s) if s else 0.0 for s in ratios]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read(path: str) -> dict:
    """The parsed interval file; KvbenchError for a missing or foreign file."""
    p = Path(path)
    require(p.is_file(), f"--recall-intervals '{path}': no such file")
    try:
        doc = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise KvbenchError(f"--recall-intervals '{path}': not JSON ({e})") from None
    ok = (isinstance(doc, dict) and doc.get("kind") == KIND
          and isinstance(doc.get("intervals"), list)
          and all(isinstance(r, int) and r >= 0 for r in doc["intervals"])
          and len(doc["intervals"]) == doc.get("layers"))
    require(ok, f"--recall-intervals '{path}': not a scout recall-interval file "
            "(write one with --calibrate-recall)")
    return doc


def load(path: str, model: str, layers: int) -> list[int]:
    """R_l for each of the run's `layers` layers of `model`; refuses another model's file."""
    doc = read(path)
    require(doc.get("model") == model and doc["layers"] == layers,
            f"--recall-intervals '{path}' was calibrated for {doc.get('model')} with "
            f"{doc['layers']} layers; this run is {model} with {layers} layers")
    return list(doc["intervals"])


def mean_interval(path: str) -> float:
    """Mean R_l over the file's sparse layers (R_l > 0), for the records."""
    r = [x for x in read(path)["intervals"] if x > 0]
    return sum(r) / len(r) if r else 0.0
