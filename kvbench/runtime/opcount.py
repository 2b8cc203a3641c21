"""Torch ops and device-to-host syncs of a decode step, counted (issue 26 part 2).

`count_step` runs ONE decode step more after the timed run (so no timed step is slowed):
the strategy's next token, the last one of the run's sequence, at the last position its
cache holds (the run's last token is scored, never fed, so the cache has room for it). It
counts the model's forward of that token: the decoder and the strategy (under a `Shadow`,
the strategy alone: the accuracy reference is not part of a step), not the harness's
scoring of the logits nor `begin_step`, which the timed loop calls before its clock.

`Counting` is both modes torch offers for this, active on the calling thread only (a
strategy's worker threads, e.g. hgca's evictions, are not counted):
    ops    every aten op dispatched (a TorchDispatchMode: ops as dispatched under inference
           mode, e.g. aten.linear once, not its decomposition);
    syncs  ops that wait for the device's results on the host, which on a GPU stall the
           stream: scalar reads (aten item / _local_scalar_dense / is_nonzero: `.item()`,
           `float(t)`, `int(t)`, `bool(t)`, `if t:`), ops whose output shape depends on the
           data (nonzero, masked_select, unique, bincount, one-argument where, repeat_
           interleave without output_size, indexing or index_put with a bool mask), whole-
           tensor comparisons answered on the host (equal, allclose), tensor-to-Python
           conversions (`.tolist()`, `.numpy()`: a TorchFunctionMode) and, on CUDA, blocking
           copies from the device to the host. On a CUDA run only those that read a CUDA
           tensor count (a scalar read of a host tensor stalls nothing); on a CPU run every
           one counts, where none of them stalls anything, so a CPU test catches what could
           stall a GPU (an upper bound: some of those tensors live on the host there).
           Explicit `torch.cuda.synchronize()` / event or stream waits are not dispatched
           ops and are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.schema import ParamValue, Record, measured, not_measured

# aten op packets that read a device value on the host whatever their arguments
SYNC_OPS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "nonzero", "nonzero_numpy",
                      "argwhere", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "unique_dim", "unique_dim_consecutive",
                      "bincount", "equal", "allclose"})
INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
COPY_OPS = frozenset({"to", "_to_copy", "copy_"})
CONVERSIONS = frozenset({"tolist", "numpy"})  # Tensor methods handing data to Python


def _arg(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """Argument `name` of an aten call, positional or keyword (None when absent)."""
    names = [a.name for a in func._schema.arguments]
    i = names.index(name) if name in names else -1
    return args[i] if 0 <= i < len(args) else kwargs.get(name)


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor among the arguments (or in a list of them) lives on a CUDA device."""
    import torch

    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                return True
    return False


def syncs(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether the aten call `func`(*args, **kwargs) -> out waits for device results."""
    import torch

    op = func.overloadpacket.__name__
    if op in SYNC_OPS:
        return True
    if op == "where":  # where(condition) alone is nonzero
        return len(args) + len(kwargs) == 1
    if op == "repeat_interleave":
        return isinstance(args[0] if func._overloadname == "Tensor" else _arg(
            func, args, kwargs, "repeats"), torch.Tensor) and \
            _arg(func, args, kwargs, "output_size") is None
    if op in INDEX_OPS:
        indices = _arg(func, args, kwargs, "indices") or ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices)
    if op in COPY_OPS:
        src = args[1] if op == "copy_" else args[0]
        dst = args[0] if op == "copy_" else out
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type == "cuda" and dst.device.type == "cpu"
                and not _arg(func, args, kwargs, "non_blocking"))
    return False


class _Ops(TorchDispatchMode):
    """Every aten op dispatched, and those that sync (`syncs`), into a Counting."""

    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.counting = counting

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c, name = self.counting, f"aten.{func.overloadpacket.__name__}"
        c.by_op[name] += 1
        if not c.converting and syncs(func, args, kwargs, out) \
                and (not c.cuda_only or _on_cuda(args, kwargs)):
            c.syncs_by_op[name] += 1
        return out


class _Conversions(TorchFunctionMode):
    """Tensor-to-Python conversions (CONVERSIONS), each one sync into a Counting (the device
    copy inside it is not counted again)."""

    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.counting = counting

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name not in CONVERSIONS:
            return func(*args, **(kwargs or {}))
        c = self.counting
        if not c.cuda_only or _on_cuda(args, kwargs or {}):
            c.syncs_by_op[f"Tensor.{name}"] += 1
        c.converting += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            c.converting -= 1


class Counting:
    """Context: counts the ops and syncs (module docstring) of the code it runs on this
    thread; `by_op` and `syncs_by_op` name them (aten packet, or Tensor.tolist/numpy).
    `cuda_only`: only syncs that read a CUDA tensor (a CUDA run's)."""

    def __init__(self, cuda_only: bool = False) -> None:
        self.cuda_only = cuda_only
        self.by_op: Counter[str] = Counter()
        self.syncs_by_op: Counter[str] = Counter()
        self.converting = 0  # inside a conversion
        self._modes = (_Conversions(self), _Ops(self))

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def syncs(self) -> int:
        return sum(self.syncs_by_op.values())

    def __enter__(self) -> Counting:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def count_step(model: Any, strategy: Any, seq: Any, sync: Callable[[], None]) -> Counting:
    """Count one more decode step of `strategy` (module docstring): token seq[:, -1] at
    position seq.shape[1] - 1, after a complete run of `seq` [B, turns * (P + G + 1)]."""
    inner = getattr(strategy, "inner", strategy)  # a Shadow's strategy, without the reference
    counters = model.counters
    counters.step += 1
    inner.begin_step(counters.step)
    pos = seq.shape[1] - 1
    model.strategy = inner
    try:  # the run's tokens live where its model does
        with Counting(cuda_only=seq.device.type == "cuda") as counting:
            model(seq[:, pos:pos + 1], pos)
            counters.flush()  # a native step's accounts (its strategy's `decoded`) count
        sync()
    finally:
        model.strategy = strategy
    return counting


def records(name: str, params: dict[str, ParamValue], counted: Counting | str,
            step: int, by_design: tuple[int, str] = (0, "")) -> Iterator[Record]:
    """`ops_per_step` and `syncs_per_step` of `counted` (decode step `step`, untimed), or
    waived records giving the reason `counted` when the step was not run; `by_design`: the
    strategy's declared host reads (`Strategy.host_reads`), named in the syncs' method."""
    if isinstance(counted, str):
        for metric in ("ops_per_step", "syncs_per_step"):
            yield not_measured("run", name, metric, "waived", counted, params)
        return
    how = {"per": f"decode step {step}: one untimed step after the timed ones (the model's "
                  "forward: decoder and strategy)", "statistic": "count",
           "exact": "counted: the same run gives the same count"}
    yield measured("run", name, "ops_per_step", "ops", "lower", [counted.ops], params,
                   {**how, "counted": "aten ops dispatched (TorchDispatchMode), run's thread",
                    "top_ops": dict(counted.by_op.most_common(12))})
    yield measured("run", name, "syncs_per_step", "syncs", "lower", [counted.syncs], params,
                   {**how, "counted": "ops that wait for device results on the host "
                                      "(kvbench.runtime.opcount.syncs), run's thread, "
                                      + ("those reading a CUDA tensor" if counted.cuda_only
                                         else "every one (CPU run: an upper bound of a GPU's)"),
                    "ops": dict(counted.syncs_by_op),
                    "by_design": f"at most {by_design[0]} per layer: {by_design[1]}"
                    if by_design[0] else "none"})

