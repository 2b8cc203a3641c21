"""Shared prefill: one prompt's prefill recorded once and replayed into any strategy.

A decode-speed sweep runs many strategies over one prompt; each used to pay the prompt's
O(P^2) attention itself (an 8000-token prompt at batch 4 on two cores: about 140 s per run
for 8 layers). `kvbench run ... --prefill PATH` records, during a run's own prefill, what
every layer handed its strategy and what the prompt's dense attention returned, per layer

    q [B, Hq, P, D], k/v [B, Hkv, P, D]  (positions applied, the model dtype)
    out [B, Hq, P, D], lse [B, Hq, P] float32

and the prompt's last logits [B, vocab]. A later run with the same PATH replays it: every
layer's `strategy.prefill(layer, q, k, v)` runs on the recorded tensors, its dense attention
over the prompt answered from the file (kvbench.kernels.attention.prompt_attention), so
each strategy builds exactly the state its own prefill builds (caches, digests, pages,
H2O's column scores, ArkVale's first selection) and counts the same work; only the
projections, MLPs and the prompt's attention are not recomputed. Every strategy attends its
prompt densely, so the recorded attention is theirs (tests/test_prefill.py checks each
registered strategy decodes the same tokens after a replay as after its own prefill).

A file is replayed only into a run with the same model, weights (seed too when random),
layers, dtype, device type, batch and prompt tokens; anything else is refused with one line
naming the field. The replayed prefill is not timed: such runs waive `ttft` and their
records say where the prefill came from (`method.prefill`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require

FORMAT = 1
# what must agree between the recording run and a replaying one (the prompt rows besides)
MATCH = ("model", "weights", "seed", "layers", "dtype", "accel", "batch", "prompt_len")


def file_for(arg: str, meta: dict[str, Any], rows: Any) -> Path:
    """The file `--prefill arg` names: arg itself, or inside directory `arg` the file for
    this run's fields and prompt tokens (so every run of a sweep finds its own)."""
    path = Path(arg)
    if path.is_dir() or arg.endswith(os.sep):
        h = hashlib.sha256(repr(sorted(meta.items())).encode())
        h.update(rows.cpu().numpy().tobytes())
        return path / (f"prefill-{meta['model']}-{meta['prompt_len']}x{meta['batch']}-"
                       f"{h.hexdigest()[:12]}.pt")
    return path


@dataclass
class Recorder:
    """Collects each layer's prompt tensors during a run's own prefill (`layers`, in order)."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    logits: Any = None  # [B, vocab] of the prompt's last token

    def add(self, q: Any, k: Any, v: Any, result: Any) -> None:
        """One layer: q/k/v as the strategy got them, result (out, lse) or None when the
        strategy never attended the whole prompt in one call (computed in `save`, outside
        the timed prefill)."""
        out, lse = result if result is not None else (None, None)
        self.layers.append({"q": q, "k": k, "v": v, "out": out, "lse": lse})

    def save(self, path: Path, meta: dict[str, Any], rows: Any, made_by: str) -> None:
        """Write the file atomically (a temporary beside it, then renamed)."""
        import torch

        from kvbench.kernels.attention import dense_attention

        for d in self.layers:
            if d["out"] is None:
                d["out"], d["lse"] = dense_attention(d["q"], d["k"], d["v"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"format": FORMAT, "meta": meta, "made_by": made_by, "rows": rows.cpu(),
                    "logits": self.logits.cpu(), "layers": [{n: t.cpu() for n, t in d.items()}
                                                       for d in self.layers]}, tmp)
        tmp.replace(path)


@dataclass
class Replay:
    """A recorded prefill, memory-mapped: `layer(i)` gives its tensors on `device`."""

    path: Path
    data: dict[str, Any]
    device: Any

    @property
    def made_by(self) -> str:
        return str(self.data["made_by"])

    def layer(self, i: int) -> dict[str, Any]:
        return {n: t.to(self.device) for n, t in self.data["layers"][i].items()}

    def logits(self) -> Any:
        return self.data["logits"].to(self.device)


def load(path: Path, meta: dict[str, Any], rows: Any, device: Any) -> Replay:
    """The file at `path` checked against this run (KvbenchError naming what differs)."""
    import torch

    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        require(isinstance(data, dict) and data.get("format") == FORMAT, "not a format-"
                f"{FORMAT} kvbench prefill")
        theirs = data["meta"]
    except (OSError, RuntimeError, KeyError, ValueError, KvbenchError) as e:
        raise KvbenchError(f"--prefill '{path}': unreadable ({str(e).splitlines()[0]})"
                           ) from None
    for name in MATCH:
        require(theirs.get(name) == meta[name], f"--prefill '{path}': recorded with {name} "
                f"{theirs.get(name)!r}, this run has {meta[name]!r}")
    require(len(data["layers"]) == meta["layers"] and torch.equal(data["rows"], rows.cpu()),
            f"--prefill '{path}': recorded for other prompt tokens (--text, --mode, --seed "
            "or the passkey's --depth differ)")
    return Replay(path, data, device)


def method(replay: Replay | None, path: Path | None) -> dict[str, str]:
    """What every record of the run says about its prefill ({} without --prefill)."""
    if replay is not None:
        return {"prefill": f"shared: replayed from {path} (recorded by {replay.made_by}); "
                           "not timed"}
    if path is not None:
        return {"prefill": f"own, recorded to {path}"}
    return {}


def replay_prefill(model: Any, replay: Replay) -> Any:
    """The prompt's logits [B, vocab] after every layer's `strategy.prefill` ran on the
    recorded tensors, its prompt attention answered from the file, the layers' dense work
    counted as the model's own prefill counts it. `layer_input` is not called: look-ahead
    strategies (InfiniGen, ScoutAttention) act on decode steps only."""
    import torch

    from kvbench.kernels.attention import prompt_attention

    with torch.inference_mode():
        for i in range(model.n_layers):
            model.counters.layer = i
            t = replay.layer(i)
            with prompt_attention(t["q"], t["k"], t["v"], (t["out"], t["lse"])):
                model.attend(i, t["q"], t["k"], t["v"], 0)
        model.counters.dense(model.spec, "head", t["q"].shape[0])
    return replay.logits()
