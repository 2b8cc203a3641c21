"""InfiniGen's offline calibration, as the authors' accuracy setup does it (variant `authors`).

snu-comparch/InfiniGen at 3754f52 (paper section 4.2, "offline skewing"):
`accuracy/setup/gen_llama_skewing_matrix.py` runs the model once over the first 2048 tokens
of a fixed book (`pg19_firstbook.txt`) and takes, per layer and head, the skewing matrix A
from the SVD of that head's post-RoPE queries (the right singular vectors; their column
order is immaterial here, since channels are picked by mass); `gen_partial_weight.py` then
runs a separate short prompt through the skewed model and keeps, per head, the union of the
int(r * D) channels of largest sum |q A| and of largest sum |k A| over its tokens.

kvbench does the same on the model it runs: the skew text is the first SKEW_TOKENS tokens of
`--calib-text` (default: `kvbench/data/infinigen_calibration.txt`, a ~2.5K-token English
narrative written for kvbench, Apache-2.0 like the package), the channel prompt is
`kvbench/data/infinigen_channels.txt` (five short cause-and-effect sentences written for
kvbench, in the manner of the authors' prompt). GQA (the authors' Llama-2 code has none):
one A per KV head from its group's queries stacked (`skew`), the query channel mass
summed over the group, so q A . k A = q . k and one partial key cache serves the group.

Computed once per (weights, texts, ratio) and stored under $KVBENCH_CACHE/infinigen (default
~/.cache/kvbench; `off`: recomputed in every process); never inside a timed step.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench import paths
from kvbench.errors import KvbenchError, require
from kvbench.strategies import Strategy

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext

SKEW_TOKENS = 2048  # the authors' input_ids[:, :2048]
CHECK_TOKENS = 32  # layer-0 keys kept to recognise a scored prompt that is the skew text
DATA = Path(__file__).resolve().parent.parent / "data"
CALIB_TEXT = DATA / "infinigen_calibration.txt"
CHANNEL_TEXT = DATA / "infinigen_channels.txt"
_FORMAT = 1  # bump when what is stored changes
_MEMO: dict[str, Calibration] = {}


@dataclass(frozen=True)
class Calibration:
    """Per layer: A [Hkv, D, D], channel ids [Hkv, w] and their use [Hkv, w] (1.0, or 0.0
    for the padding of a KV head whose union has fewer than w channels); k0 [Hkv, m, D]:
    layer 0's keys of the skew text's first m tokens (float32)."""

    a: list[torch.Tensor]
    ch: list[torch.Tensor]
    on: list[torch.Tensor]
    k0: torch.Tensor

    def to(self, device: torch.device) -> Calibration:
        return Calibration(*([t.to(device) for t in ts] for ts in (self.a, self.ch, self.on)),
                           self.k0.to(device))


def read_text(path: str) -> tuple[str, str]:
    """(text, name) of the skew text: `--calib-text` PATH or the bundled one."""
    if not path:
        return CALIB_TEXT.read_text(encoding="utf-8"), CALIB_TEXT.name
    found = paths.stat(path, "--calib-text")
    require(found is not None and Path(path).is_file(),
            f"--calib-text '{paths.shown(path)}' is not a readable file")
    try:
        return Path(path).read_text(encoding="utf-8"), paths.shown(path)
    except (UnicodeDecodeError, OSError) as e:
        raise KvbenchError(f"--calib-text '{paths.shown(path)}': not readable UTF-8 text "
                           f"({e})") from None


def channels(a: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ratio: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [Hkv, w], on [Hkv, w]): per KV head the union of the int(r * D) channels of
    largest sum |q A| (q [B, Hq, T, D], the group's heads summed) and of largest sum |k A|
    (k [B, Hkv, T, D]); w = the largest union, shorter ones padded with use 0."""
    import torch

    hkv, d = a.shape[0], a.shape[-1]
    keep = max(1, int(ratio * d))
    qa = torch.matmul(q.float().unflatten(1, (hkv, -1)), a[None, :, None])  # [B,Hkv,G,T,D]
    ka = torch.matmul(k.float(), a[None])  # [B, Hkv, T, D]
    top_q = qa.abs().sum(dim=(0, 2, 3)).topk(keep, dim=-1).indices
    top_k = ka.abs().sum(dim=(0, 2)).topk(keep, dim=-1).indices
    used = torch.zeros(hkv, d, dtype=torch.bool, device=a.device)
    used.scatter_(1, top_q, True).scatter_(1, top_k, True)
    w = int(used.sum(1).max())
    # used channels first (ascending), then unused ones as padding
    order = torch.sort((~used).float() * d + torch.arange(d, device=a.device), dim=1).indices
    ids = order[:, :w]
    return ids, used.gather(1, ids).float()


class _Capture(Strategy):
    """Dense causal attention that hands each layer's post-RoPE q [1, Hq, T, D] and k
    [1, Hkv, T, D] to `seen(layer, q, k)`."""

    name = "infinigen-calibration"

    def __init__(self, ctx: RunContext, seen: Any) -> None:
        super().__init__(None, ctx)
        self.seen = seen

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        from kvbench.kernels.attention import dense_attention

        self.seen(layer, q, k)
        return dense_attention(q, k, v)[0]


def _run(model: Any, ctx: RunContext, ids: list[int], seen: Any) -> None:
    """One prefill of token ids through `model` with `seen` on every layer's q and k; the
    model's strategy, counters and position tables are put back afterwards."""
    import torch

    from kvbench.runtime.context import Counters

    held = (model.strategy, model.counters, model._rope, model._at)
    counters = Counters(ctx.spec.n_kv_heads, ctx.elem_bytes, ctx.accel.type == "cuda",
                        ctx.n_layers)
    try:
        model.setup(_Capture(ctx, seen), counters, len(ids))
        model(torch.tensor([ids], device=ctx.accel), 0)
    finally:
        model.strategy, model.counters, model._rope, model._at = held


def _key(model: Any, ctx: RunContext, texts: tuple[str, str], ratio: float) -> str:
    """The calibration's identity: the weights (shape and a strided sample of every
    parameter), dtype, layers, both texts and the ratio."""
    h = hashlib.sha1(json.dumps([_FORMAT, ctx.spec.name, ctx.n_layers, str(ctx.dtype),
                                 SKEW_TOKENS, ratio, *texts]).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(flat[::max(1, flat.numel() // 1024)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _home() -> Path | None:
    """<cache>/infinigen, <cache> being $KVBENCH_CACHE (default ~/.cache/kvbench, as the
    weights' and hardware calibrations' caches); None when KVBENCH_CACHE=off."""
    root = os.environ.get("KVBENCH_CACHE", "")
    if root == "off":
        return None
    return (Path(root) if root else Path.home() / ".cache" / "kvbench") / "infinigen"


def calibrate(ctx: RunContext, text: str, ratio: float) -> Calibration:
    """The offline calibration of ctx.model on the skew `text` and the bundled channel
    prompt (module docstring), from the process memo, the disk cache or computed."""
    import torch

    model = ctx.model
    encode = getattr(model, "encode", None)
    require(encode is not None, "infinigen --variant authors calibrates on the model's "
            "tokenizer; this model has none (use --variant oracle)")
    prompt = CHANNEL_TEXT.read_text(encoding="utf-8")
    key = _key(model, ctx, (text, prompt), ratio)
    if key in _MEMO:  # (a process may run on the CPU and on the GPU)
        return _MEMO[key].to(ctx.accel)
    home = _home()
    path = None if home is None else home / f"{key}.pt"
    if path is not None and path.is_file():
        try:
            stored = torch.load(path, map_location="cpu")
            _MEMO[key] = Calibration(**stored).to(ctx.accel)
            return _MEMO[key]
        except Exception:  # a damaged entry: compute it again
            path.unlink(missing_ok=True)
    vocab = ctx.spec.vocab
    ids = [t % vocab for t in encode(text)][:min(SKEW_TOKENS, ctx.spec.ctx)]
    require(len(ids) >= CHECK_TOKENS, f"--calib-text has {len(ids)} tokens; the skew needs "
            f"at least {CHECK_TOKENS} (the authors use {SKEW_TOKENS})")
    a: list[torch.Tensor] = []
    k0: list[torch.Tensor] = []

    def skewed(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        a.append(skew(q, ctx.spec.n_kv_heads, ratio)[0])
        if layer == 0:
            k0.append(k[0, :, :CHECK_TOKENS].float())

    with torch.inference_mode():
        _run(model, ctx, ids, skewed)
        picked: list[tuple[torch.Tensor, torch.Tensor]] = []
        _run(model, ctx, [t % vocab for t in encode(prompt)][:ctx.spec.ctx],
             lambda layer, q, k: picked.append(channels(a[layer], q, k, ratio)))
    cal = Calibration(a, [c for c, _ in picked], [o for _, o in picked], k0[0])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            torch.save(vars(cal.to(torch.device("cpu"))), tmp)
            tmp.rename(path)
        except OSError:  # a cache that cannot be written only costs the next run the time
            tmp.unlink(missing_ok=True)
    _MEMO[key] = cal
    return cal


def skew(q: torch.Tensor, hkv: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewing matrices A [Hkv, D, D] and kept channels [Hkv, d'] from queries q [B, Hq, P, D]:
    one A per KV head from its group's queries (so q A . k A = q . k within the group)."""
    import torch

    b, hq, p, d = q.shape
    g = hq // hkv
    qs = q.float().view(b, hkv, g, p, d).transpose(0, 1).reshape(hkv, b * g * p, d)
    # fewer rows than D (a prompt with G * P < D): full_matrices completes A to a square,
    # orthogonal one past the rank; otherwise not, since U [Hkv, rows, rows] would be
    # rows^2 floats (7 GB for batch 4 x 3 queries per KV head x 2048 tokens)
    rows = qs.shape[1]
    a = torch.linalg.svd(qs, full_matrices=rows < d).Vh.transpose(1, 2)  # [Hkv, D, D]
    mass = torch.bmm(qs, a).abs().sum(dim=1)  # [Hkv, D]
    keep = max(1, int(ratio * d))
    return a, mass.topk(keep, dim=-1).indices.sort(dim=-1).values
