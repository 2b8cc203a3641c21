"""KV offload strategies: one module per strategy, each a small class registered by name.

A strategy decides, for every attention layer, where that layer's KV cache lives
(accelerator or host memory) and how attention over it is computed. The decoder
(kvbench.models) computes q/k/v (positions already applied) and hands them to the run's one
strategy object; everything between "new k/v" and "attention output" is the strategy's.

Shapes (B batch, Hq query heads, Hkv KV heads, D head dim, P prompt length, T >= 2 appended
tokens; GQA: Hq % Hkv == 0):

    prefill(layer, q, k, v) -> out   q [B, Hq, P, D], k/v [B, Hkv, P, D], out [B, Hq, P, D]
    decode(layer, q, k, v)  -> out   q [B, Hq, 1, D], k/v [B, Hkv, 1, D], out [B, Hq, 1, D]
    append(layer, q, k, v)  -> out   q [B, Hq, T, D], k/v [B, Hkv, T, D], out [B, Hq, T, D]

`append` is a multi-turn run's next prompt (HGCA Alg. 1 lines 19-21): T new tokens after
the cached ones, each attending causally to the cache and the new tokens up to itself.
It is optional: `supports_append(cls)` says whether a strategy implements it, and the
runtime refuses `--turns` > 1 for one that does not.

    export_kv() -> [(k, v)] per layer, k/v [B, Hkv, n, D]: every cached token, in order
    import_kv(kv)  the same into an empty strategy, as if it had processed those n tokens

are the prefix cache's interface (kvbench.prefix, CXL KV-storage paper section 2: `save`
when a request finishes, `load` when the next one's prefill begins); optional too
(`supports_prefix(cls)`; `--prefix-cache` needs them and append).

q/k/v arrive on `ctx.accel` in the model dtype; `out` must be returned there. Layers are
called in order 0..L-1 for the prefill, then once per layer for every decode step or
append, with `begin_step(step)` before each step (step 0 is the prefill, and every append
of a multi-turn run; decode steps are numbered 1, 2, ... across turns). Strategies that
speculate on the next layer (InfiniGen, ScoutAttention) override `layer_input(layer, x)`,
called with the normed hidden state x [B, T, hidden] before each layer's q/k/v
projection, and may use `ctx.model` (the decoder) to reach the next layer's weights.

Prefill attention weights (H2O's and HGCA's initial scores) are never computed unless asked:
`column_scores(q, k, lse)` turns the lse that `dense_attention` returns into per-key
attention mass [B, Hq, P] for the strategy that calls it (`q_start=N` for an append's T
queries over N cached + T new keys: [B, Hq, N + T]).

Work is reported into `ctx.counters` (kvbench.runtime.context.Counters): `attended(where, q,
n_kv)` for each attention computation (tokens, FLOPs, bytes read on device `where`:
"accel" or "host"; `attention(where, tokens, flops, nbytes)` when the shapes do not say),
`moved(link, nbytes)` for copies ("h2d", "d2h"), `add(quantity, where, value)` for
anything else (e.g. `add("time", "bookkeeping", s)`, `add("time", "accel_idle", s)`; a
quantity no run shares, e.g. arkvale's "pages", is declared in the class's `metrics` with
its unit and the figure derived from it, kvbench.runtime.breakdown.Metric). The
runtime files these under the current (step, layer) and stores them as records; the same
calls build the run's stage graph (kvbench.runtime.trace, what `kvbench project` re-times).
A strategy that overlaps work says so with three hints: `with counters.fork(name):` (work
beside the main chain, joined by the layer's output or `counters.join()`),
`moved(link, n, ahead=k)` (a prefetch for layer + k), `with counters.background():` (work
only the next step's same layer waits for); `counters.task(resource, op, **work)` adds
work on a resource no counter covers ("cxl", "pnm").

Parameters are a frozen dataclass in the class attribute `params`: `kvbench run NAME`
gets one option per field (default = the field default, help = the `help` metadata),
and suites build the same dataclass from a TOML table by field name. The class method
`placement` (by default `kv_placement`, the KV bytes each device holds at a given length)
says how many bytes each device will hold, so that the run can refuse a batch that cannot
fit before allocating anything; `for_run` resolves length-dependent defaults.

A strategy with more than one semantics (the authors' accuracy code, their kernel path,
kvbench's own generalisation) declares them with `variant_field(Variant(...), ...)` as its
`variant` parameter: the first is the default and is the authors' algorithm; each variant
names the parameters it does not take, and `check_variant` (called from the params'
`__post_init__`) refuses an unknown variant or such a parameter with one line. The variant
that ran is in every record's params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvbench.errors import KvbenchError
from kvbench.options import flag
from kvbench.registry import Registry, first_line

if TYPE_CHECKING:
    import torch

    from kvbench.kernels.step import NativeCache, Pages, Recall
    from kvbench.runtime.breakdown import Metric
    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class NoParams:
    """Parameters of a strategy that has none."""


@dataclass(frozen=True)
class Variant:
    """One semantics of a strategy: its `name`, one line on what it is (whose code it
    follows), and the parameters it does not take (`ignores`: field names)."""

    name: str
    text: str
    ignores: tuple[str, ...] = ()


def variant_field(*variants: Variant) -> Any:
    """The `variant` parameter of a params dataclass: the first variant is the default (the
    authors' algorithm); `--help` lists every variant."""
    names = [v.name for v in variants]
    if not variants or len(set(names)) != len(names):
        raise ValueError(f"variants must be distinct and at least one: {names}")
    text = "; ".join(f"'{v.name}'{' (default)' if i == 0 else ''}: {v.text}"
                     for i, v in enumerate(variants))
    return dataclasses.field(default=variants[0].name,
                             metadata={"help": f"Semantics. {text}.", "variants": variants})


def variants(params_cls: type) -> tuple[Variant, ...]:
    """The variants a params dataclass declares (empty: one semantics)."""
    for f in dataclasses.fields(params_cls):
        if f.name == "variant":
            return f.metadata["variants"]
    return ()


def check_variant(params: Any) -> None:
    """KvbenchError (one line naming the variants) for an unknown `params.variant`, or for a
    parameter the chosen variant does not take set away from its default."""
    by_name = {f.name: f for f in dataclasses.fields(params)}
    declared = variants(type(params))
    chosen = {v.name: v for v in declared}.get(params.variant)
    known = ", ".join(v.name for v in declared)
    if chosen is None:
        raise KvbenchError(f"--variant '{params.variant}': unknown (variants: {known})")
    for name in chosen.ignores:
        if getattr(params, name) != by_name[name].default:
            raise KvbenchError(f"{flag(name)} is not a parameter of variant '{chosen.name}' "
                               f"(variants: {known})")


class Strategy:
    """Base class of KV offload strategies; `name` and `version` go into every record."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    params: ClassVar[type] = NoParams
    # (parameter, value) overrides under which the strategy computes exactly full attention
    # (a budget covering the context, beta 0, ...): tests/test_strategy_contract.py runs
    # every registered strategy in it; None: not declared (the contract test fails)
    exact: ClassVar[tuple[tuple[str, Any], ...] | None] = None
    # overrides under which a strategy with a non-empty `exact` leaves tokens out (about a
    # third of a 98-token context or less; pages of 8 where its default pages would not fit
    # such a budget): the contract test checks that its NLL then moves off full's; None:
    # not declared (the contract test fails)
    sparse: ClassVar[tuple[tuple[str, Any], ...] | None] = None
    # the figures it reports beyond every run's (kvbench.runtime.breakdown.Metric): each
    # names its unit, direction and how it derives from what the strategy counts; a
    # quantity counted (`counters.add`) that no metric declares fails the run's records
    metrics: ClassVar[tuple[Metric, ...]] = ()
    # device values its decode step reads on the host by design: at most this many per
    # layer, and why (e.g. the page ids a recall copies from host memory); the run's
    # syncs_per_step names it (`by_design`) and tests/test_strategy_contract.py holds every
    # strategy's counted step to it, so an undeclared read fails there
    host_reads: ClassVar[tuple[int, str]] = (0, "")

    def __init__(self, params: Any, ctx: RunContext) -> None:
        self.p = params
        self.ctx = ctx

    @classmethod
    def summary(cls) -> str:
        return first_line(cls.__doc__)

    @classmethod
    def kv_placement(cls, params: Any, kv_bytes: int) -> dict[str, int]:
        """KV bytes per device ("accel", "host") when the whole cache is `kv_bytes` bytes."""
        return {"accel": kv_bytes, "host": 0}

    @classmethod
    def placement(cls, params: Any, ctx: RunContext) -> dict[str, int]:
        """Bytes per device ("accel", "host") that `cls(params, ctx)` allocates: its KV and
        the state beside it (scores, staging buffers). Default: `kv_placement` of a cache of
        ctx.max_len tokens. Strategies whose state is not a share of the KV override this.
        An optional "pinned" entry is the part of "host" page-locked on CUDA (0 otherwise);
        the fit check reports it as `pinned_bytes`."""
        kv = ctx.batch * ctx.max_len * ctx.spec.kv_bytes_per_token(ctx.elem_bytes,
                                                                   ctx.n_layers)
        return cls.kv_placement(params, kv)

    @classmethod
    def for_run(cls, params: Any, max_len: int) -> tuple[Any, list[str]]:
        """The parameters a run over a cache of max_len tokens uses and records (defaults
        that depend on the length resolved) and warnings for the user (a setting outside
        the regime the strategy's paper describes)."""
        return params, []

    def begin_step(self, step: int) -> None:
        """Called before each step's layer 0 (step 0: prefill or append, 1, 2, ... decode)."""

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """The normed hidden state x [B, T, hidden] entering `layer` (for look-ahead)."""

    def attended(self, layer: int) -> torch.Tensor | None:
        """Which cached positions the last decode step of `layer` attended: bool [B, Hq, n]
        over the n tokens cached so far (None: not tracked, e.g. dense strategies), on
        ctx.accel. Eval mode reads it between steps, outside their times, for the share of
        full attention's top keys a strategy kept."""
        return None

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store the prompt's k/v [B, Hkv, P, D] and return causal attention [B, Hq, P, D]."""
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Append one token's k/v [B, Hkv, 1, D] and return its attention [B, Hq, 1, D]."""
        raise NotImplementedError

    def native_cache(self, layer: int) -> NativeCache | None:
        """What a decode step in one native call (kvbench.kernels.step) needs of `layer`,
        when this strategy's decode of it is one that call runs (dense attention over its
        cache or ring, Quest's or ArkVale's) and `layer_input` does nothing; the decoder then
        calls `native_rule` before the call and `decoded` for each layer after it. None (the
        default): the strategy's own `decode`."""
        return None

    def native_rule(self, n: int) -> Pages | Recall | None:
        """The page selection of a native step whose caches hold n tokens with the new one
        (Quest's `Pages`, ArkVale's `Recall`), after the bookkeeping that must precede the
        call (ArkVale completes a full page); None: no layer selects."""
        return None

    def decoded(self, layer: int, q: torch.Tensor, select_s: float) -> None:
        """After a native step wrote `layer`'s new k/v at its cache's n and attended q
        [B, Hq, 1, D]: what `decode` does besides (its length, its counters, and the
        seconds its selection took in the call, `select_s` (-1: none), recorded where its
        decode's "bookkeeping.select" block sits). Called only where `native_cache` is not
        None."""
        raise NotImplementedError

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Store T >= 2 new tokens' k/v [B, Hkv, T, D] after the cached ones and return the
        causal attention [B, Hq, T, D] of new query i over the cache and new tokens 0..i."""
        raise NotImplementedError

    def export_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the KV of every token seen, k/v [B, Hkv, n, D] in token order and the
        model dtype (views where the strategy holds them that way)."""
        raise NotImplementedError

    def import_kv(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take per-layer k/v [B, Hkv, n, D] (on the accelerator) into this empty strategy;
        the next call is an append or decode at position n."""
        raise NotImplementedError


def supports_append(cls: type[Strategy]) -> bool:
    """Whether strategy class `cls` implements `append` (multi-turn runs)."""
    return cls.append is not Strategy.append


def supports_prefix(cls: type[Strategy]) -> bool:
    """Whether `cls` exports and imports its KV (a prefix cache can serve it)."""
    return cls.export_kv is not Strategy.export_kv and cls.import_kv is not Strategy.import_kv


def position_mask(pos: torch.Tensor, n: int, hq: int, lens: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Bool [B, Hq, n] marking positions pos [B, H, m] (the first lens[b, h] of each row when
    given); H = Hkv rows are shared by their group's Hq / Hkv query heads."""
    import torch

    b, h, m = pos.shape
    valid = torch.ones_like(pos, dtype=torch.bool) if lens is None else (
        torch.arange(m, device=pos.device) < lens[..., None])
    mask = torch.zeros(b, h, n + 1, dtype=torch.bool, device=pos.device)
    mask.scatter_(2, pos.masked_fill(~valid, n).long(), True)  # invalid: column n, dropped
    return mask[:, :, :n].repeat_interleave(hq // h, dim=1)


def column_scores(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *,
                  scale: float | None = None, chunk: int = 512, q_start: int = 0
                  ) -> torch.Tensor:
    """Causal attention mass per key: sum over queries of softmax(q k^T) [B, Hq, N].

    q [B, Hq, T, D] at key positions q_start..q_start+T-1 (query i sees keys 0..q_start+i),
    k [B, Hkv, N, D], lse [B, Hq, T] (fp32, from dense_attention on the same q/k). Prefill:
    q_start 0, N = T = P; append: N = q_start + T; q_start = N: keys that all precede the
    queries (hgca's host cache). Query chunks, fp32: memory stays O(chunk * N). A chunk
    reads only the keys its queries see (a prefill does half the products of a square) and
    masks only the keys some of its queries do not; the exp runs in place.
    """
    import torch

    b, hq, t, d = q.shape
    n = k.shape[2]
    g = hq // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)  # [B, Hq, N, D]
    s = scale if scale is not None else d ** -0.5
    out = torch.zeros(b, hq, n, dtype=torch.float32, device=q.device)
    for i in range(0, t, chunk):
        qi = q[:, :, i:i + chunk].float() * s
        c, first = qi.shape[2], q_start + i  # the chunk's queries see keys 0..first + row
        end = min(n, first + c)
        w = torch.matmul(qi, kk[:, :, :end].transpose(-1, -2))  # [B, Hq, c, end]
        w.sub_(lse[:, :, i:i + c, None])
        if first < end:  # keys first..end-1: row r sees those up to first + r
            cols = torch.arange(first, end, device=q.device)
            rows = torch.arange(first, first + c, device=q.device)
            w[..., first:].masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
        out[:, :, :end] += w.exp_().sum(dim=2)
    return out


def decode_weights(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *,
                   scale: float | None = None) -> torch.Tensor:
    """Attention weights of single-token queries over every key: softmax rows [B, Hq, N].

    q [B, Hq, 1, D], k [B, Hkv, N, D], lse [B, Hq, 1] (from dense_attention over the same
    keys, causal=False); fp32. What H2O accumulates and HGCA averages (A_gpu, Alg. 1 line 8).
    One batched matmul and two in-place ops: this runs once per layer and decode step.
    """
    import torch

    b, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    s = scale if scale is not None else d ** -0.5
    qs = (q.float() * s).view(b * hkv, hq // hkv, d)
    w = torch.bmm(qs, k.float().reshape(b * hkv, n, d).transpose(1, 2))  # [B*Hkv, G, N]
    return w.sub_(lse.float().view(b * hkv, hq // hkv, 1)).exp_().view(b, hq, n)


STRATEGIES: Registry[type[Strategy]] = Registry("strategy", __name__)
