"""Defaults chosen because of the machine: what `kvbench run` changes, and says, when no GPU.

Without a GPU the accelerator role runs on the CPU, so a paper-sized model (e.g. the HGCA
Fig. 12 example `kvbench run hgca --model opt-6.7b`) would need more memory and time than
a small CPU machine has. When `--layers` is left at 0 (all) on such a machine, the run
keeps the first layers whose weights fit a CPU budget (CPU_WEIGHT_BUDGET, at most
CPU_MEMORY_SHARE of the available memory) and says so; records carry `layers` <
`layers_total`. The user's explicit `--layers` is never changed.

Defaults that keep a strategy in its paper's regime at the run's length are the strategy's
own (`Strategy.for_run`, called by the run after this): e.g. hgca's automatic block keeps
its accelerator window a ring of at least four blocks at the CPU default lengths, and a
window under four blocks is warned about and recorded (`window_blocks`).
"""

from __future__ import annotations

from typing import Any

from kvbench.models import ModelSpec
from kvbench.units import format_bytes

# Weight bytes a CPU-only run keeps by default: ~2 minutes of a 2-core machine for prefill
# 256 + 32 decode steps of an OPT-6.7B-sized layer stack (measured ~12 s per such layer).
CPU_WEIGHT_BUDGET = 8 << 30
CPU_MEMORY_SHARE = 0.4


def machine_defaults(spec: ModelSpec, layers_opt: int, layers: int, device: Any, weights: str,
                     elem: int, prompt_len: int, gen_len: int) -> tuple[int, list[str]]:
    """(layers to run, notes for the user) for a run resolved to `layers` on `device`."""
    import psutil

    if device.type != "cpu":
        return layers, []
    notes = ["no GPU: the accelerator role runs on the CPU, so its timings are CPU timings"]
    if weights == "random":
        notes.append(f"random weights for {spec.name} (no checkpoint here; perplexity is off)")
    budget = min(CPU_WEIGHT_BUDGET, int(psutil.virtual_memory().available * CPU_MEMORY_SHARE))
    if layers_opt == 0 and spec.params(layers) * elem > budget:
        fit = max(n for n in range(1, layers + 1) if n == 1 or spec.params(n) * elem <= budget)
        notes.append(f"{fit} of {spec.n_layers} layers: {format_bytes(spec.params(fit) * elem)} "
                     f"of weights within this machine's CPU budget of {format_bytes(budget)} "
                     f"(pass --layers to choose)")
        layers = fit
    notes.append(f"lengths: prompt {prompt_len}, {gen_len} generated tokens "
                 "(--prompt-len/--gen-len)")
    return layers, notes
