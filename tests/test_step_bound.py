"""The bytes bound of a decode step and the ops and syncs it dispatches (issue 26 parts 1-2):
step_bound_s against bytes / bandwidth worked out by hand, step_efficiency against the
measured steps, exact op counts, syncs found where a strategy reads a device value, and the
fields in the run summary, `kvbench report` and `kvbench compare`."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Probes, assert_usage_error
from conftest import cli as run_cli

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import MODELS, ModelSpec
from kvbench.runtime import bound
from kvbench.runtime.command import execute
from kvbench.runtime.opcount import Counting
from kvbench.runtime.run import RunConfig
from kvbench.strategies.full import Full
from kvbench.units import format_bytes

# a llama-shaped model small enough that a run takes a fraction of a second
TINY = ModelSpec("tiny-bound", "llama", 2, 4, 2, 64, 128, 256, 128)
KV_BYTES = 1_000_000.0  # what the fake strategies say a decode reads per layer
GBPS = 10.0  # the bandwidth the tests hand the bound


@dataclass(frozen=True)
class FakeParams:
    extra_ops: int = 0  # aten ops a decode adds per layer
    item: bool = False  # read a device value (`.item()`) in every layer's decode


class Fixed(Full):
    """Full attention whose decode reports KV_BYTES read per layer; `extra_ops` more ops
    and an `.item()` per layer as its parameters say."""

    name = "fixed-bytes"
    params = FakeParams

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        from kvbench.kernels.attention import dense_attention

        n = self.length[layer] + 1
        self.k[layer][:, :, n - 1:n] = k
        self.v[layer][:, :, n - 1:n] = v
        self.length[layer] = n
        out, _ = dense_attention(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n],
                                 threads=1)
        self.ctx.counters.attention("accel", 0.0, 0.0, KV_BYTES)
        for _ in range(self.p.extra_ops):
            out = out.add(0.0)  # one aten op each
        if self.p.item:
            self.peak = out.max().item()  # two ops, one of them a sync
        return out


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, TINY.name, TINY)
    known = bound.Bandwidth({"host": GBPS, "accel": GBPS, "h2d": GBPS, "d2h": GBPS}, True,
                            "probe", {"host": "handed to the test"})
    monkeypatch.setattr(bound, "probe", lambda cuda, threads: known)


def run(tmp_path: Path, params: FakeParams | None = None, name: str = "run", **cfg: Any
        ) -> dict[str, dict]:
    """Records by metric of one run of Fixed on the tiny model (5 decode steps)."""
    out = tmp_path / f"{name}.jsonl"
    execute(Fixed, params or FakeParams(), RunConfig(model=TINY.name, weights="random",
                                                     prompt_len=8, gen_len=5, threads=1,
                                                     **cfg), out)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["metric"]: r for r in recs if r["kind"] == "run"}


def cli(argv: list[str]) -> int:
    """Exit code of `kvbench ARGV`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0)


def hand_bytes(batch: int, elem: int = 4) -> float:
    """Bytes one decode step of Fixed on TINY reads: each layer's weights (fused q/k/v,
    out-projection, MLP, two norms) with its activations in, the logits head (tied
    embedding) with its input, and KV_BYTES per layer. (The final norm's `hidden` weights
    are not in the decoder's counters: 0.2% of TINY's bytes, 1e-6 of a real model's.)"""
    s = TINY
    qkv = s.hidden * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    out_proj = s.n_heads * s.head_dim * s.hidden
    mlp = 3 * s.hidden * s.ffn
    norms = 2 * s.hidden
    layer = qkv + out_proj + mlp + norms
    acts = s.hidden + (s.n_heads * s.head_dim + s.hidden)  # rows in: before and after
    head = s.vocab * s.hidden + batch * s.hidden
    return elem * (s.n_layers * layer + head + batch * s.n_layers * acts) \
        + s.n_layers * KV_BYTES


def test_step_bound_is_bytes_over_bandwidth_and_efficiency_bound_over_steps(
        tiny: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = run(tmp_path, batch=2)
    rec = recs["step_bound_s"]
    want = hand_bytes(2) / (GBPS * 1e9)
    assert rec["samples"] == pytest.approx([want] * 5, rel=1e-12)
    assert rec["method"]["bandwidth_source"] == "probe"
    assert rec["method"]["bytes_per_step"] == {"accel": pytest.approx(hand_bytes(2))}
    # the bytes alone, counted: one record per memory or link and their total
    counted = {r["params"]["where"]: r for r in map(json.loads, (tmp_path / "run.jsonl")
                                                    .read_text().splitlines())
               if r.get("metric") == "step_bytes"}
    assert list(counted) == ["accel", "total"]
    assert {(r["unit"], r["direction"]) for r in counted.values()} == {("B", "lower")}
    for r in counted.values():
        assert r["samples"] == pytest.approx([hand_bytes(2)] * 5, rel=1e-12)
    eff = recs["step_efficiency"]
    tbt = recs["tbt"]
    assert eff["direction"] == "higher" and eff["unit"] == "ratio"
    assert eff["samples"] == pytest.approx([want / t for t in tbt["samples"]], rel=1e-12)
    # the bound is the same every step and the steps are odd in number: bound / median
    assert eff["value"] == pytest.approx(want / statistics.median(tbt["samples"]), rel=1e-12)
    shown = capsys.readouterr().out
    assert "step_bound_s" in shown and "step_efficiency" in shown
    assert (f"bytes bound per decode step: accel {format_bytes(hand_bytes(2))} at 10 GB/s "
            "(probe, one memory)") in shown


def test_ops_per_step_exact_and_syncs_found(tiny: None, tmp_path: Path) -> None:
    base = run(tmp_path, name="base")
    more = run(tmp_path, FakeParams(extra_ops=3), name="more")
    syncing = run(tmp_path, FakeParams(item=True), name="item")
    layers = TINY.n_layers
    assert more["ops_per_step"]["value"] - base["ops_per_step"]["value"] == 3 * layers
    assert more["ops_per_step"]["method"]["top_ops"]["aten.add"] >= 3 * layers
    assert base["syncs_per_step"]["value"] == 0
    assert syncing["syncs_per_step"]["value"] == layers
    assert syncing["syncs_per_step"]["method"]["ops"] == {"aten.item": layers}
    assert syncing["ops_per_step"]["value"] - base["ops_per_step"]["value"] == 2 * layers
    assert base["ops_per_step"]["direction"] == "lower"
    # eval mode: the full-attention reference beside the strategy is not part of its step
    shadowed = run(tmp_path, name="eval", mode="eval")
    assert shadowed["step_efficiency"]["samples"]
    assert shadowed["ops_per_step"]["value"] == base["ops_per_step"]["value"]


def test_counting_counts_every_op_and_each_kind_of_sync() -> None:
    x = torch.randn(4, 8)
    with Counting() as c:
        (x + 1).mul(2).sum()
    assert (c.ops, c.syncs) == (3, 0)
    cases = {"item": lambda: x[0, 0].item(), "float": lambda: float(x.sum()),
             "bool": lambda: bool((x > 0).any()), "tolist": lambda: x.sum(0).tolist(),
             "mask": lambda: x[x > 0], "nonzero": lambda: (x > 0).nonzero(),
             "where": lambda: torch.where(x > 0),
             "repeats": lambda: torch.arange(2).repeat_interleave(torch.tensor([1, 2]))}
    for what, fn in cases.items():
        with torch.inference_mode(), Counting() as c:
            fn()
        assert c.syncs == 1, what
    quiet = {"where3": lambda: torch.where(x > 0, x, 0.0), "gather": lambda: x[torch.tensor([1])],
             "sized": lambda: torch.arange(2).repeat_interleave(torch.tensor([1, 2]),
                                                                 output_size=3),
             "topk": lambda: x.topk(2, dim=-1)}
    for what, fn in quiet.items():
        with torch.inference_mode(), Counting() as c:
            fn()
        assert c.syncs == 0, what
    for what, fn in cases.items():  # a CUDA run's count: host tensors stall nothing
        with torch.inference_mode(), Counting(cuda_only=True) as c:
            fn()
        assert c.syncs == 0 and c.ops > 0, what


@pytest.mark.gpu
def test_cuda_run_counts_the_reads_of_cuda_tensors_only() -> None:
    """On CUDA: a scalar read or `.tolist()` of a CUDA tensor is a sync under cuda_only, the
    same read of a host tensor beside it is not."""
    x, h = torch.randn(4, 8, device="cuda"), torch.randn(4, 8)
    with torch.inference_mode(), Counting(cuda_only=True) as c:
        float(x.sum()), float(h.sum()), x.sum(0).tolist(), h.sum(0).tolist()
        x.to("cpu"), h.to("cuda")
    assert c.syncs == 3 and c.syncs_by_op["Tensor.tolist"] == 1, c.syncs_by_op


def test_memories_in_parallel_bound_by_the_busiest_one_memory_adds() -> None:
    rates = {"accel": 100.0, "host": 10.0, "h2d": 20.0, "d2h": 20.0}
    step = {"accel": 1e9, "host": 5e7, "pnm": 5e7, "h2d.recall": 2e8, "pnm_reduce": 1e6}
    gpu = bound.Bandwidth(rates, False, "probe")
    seconds, busy, unbounded = bound.bound(step, gpu)
    assert busy == pytest.approx({"accel": 0.01, "host": 0.01, "h2d": 0.01})
    assert seconds == pytest.approx(0.01)
    assert unbounded == {"pnm_reduce": 1e6}
    cpu = bound.Bandwidth(rates, True, "probe")
    seconds, busy, _ = bound.bound(step, cpu)
    assert seconds == pytest.approx(1e9 / 100e9 + 1e8 / 10e9 + 2e8 / 20e9)
    assert list(busy) == ["host"]


def test_report_and_compare_show_the_bound(tiny: None, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, name="base")
    base = tmp_path / "base.jsonl"
    capsys.readouterr()
    assert cli(["report", str(base), "--format", "markdown"]) == 0
    shown = capsys.readouterr().out
    for metric in ("step_bound_s", "step_efficiency", "ops_per_step", "syncs_per_step"):
        assert f"| {metric} |" in shown
    # a new file whose every step reached twice the best share of its bound the base did
    new = tmp_path / "new.jsonl"
    lines = []
    for line in base.read_text().splitlines():
        r = json.loads(line)
        if r.get("metric") == "step_efficiency":
            r["samples"] = [2 * max(r["samples"])] * len(r["samples"])
            r["value"] = r["samples"][0]
        lines.append(json.dumps(r))
    new.write_text("\n".join(lines) + "\n")
    assert cli(["compare", str(base), str(new), "--format", "json",
                "--metric", "step_efficiency"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["metric"], r["direction"]) for r in rows] == [("step_efficiency", "higher")]
    assert rows[0]["change"] >= 1.0 and rows[0]["verdict"] == "improved"
    assert cli(["compare", str(new), str(base), "--metric", "step_efficiency"]) == 1
    assert "regressed" in capsys.readouterr().out


def test_calibration_source_and_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def rec(name: str, metric: str, value: float, **params: Any) -> dict:
        return {"kind": "probe", "name": name, "metric": metric, "value": value,
                "status": "ok", "params": params, "time": "t"}

    records = [rec("attention", "host_read_gbps", 30.0, bytes=1 << 20),
               rec("attention", "host_read_gbps", 12.0, bytes=256 << 20),
               *(rec("bandwidth", "bandwidth", v, src="host:0", dst="host:0",
                     memory="pageable", size=s) for v, s in ((40.0, 4096), (8.0, 1 << 28)))]
    bw = bound.from_calibration(records, False, "probes.jsonl")
    assert bw.gbps == {"host": 12.0, "h2d": 8.0, "d2h": 8.0, "accel": 12.0}
    assert bw.source == "calibration" and bw.shared
    with pytest.raises(KvbenchError, match="has no host:0 -> gpu:0 pinned bandwidth curve"):
        bound.from_calibration(records, True, "probes.jsonl")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(MODELS, TINY.name, TINY)
    for args, says in ((["--bandwidth", "calibration"], "--bandwidth calibration: no "
                        "calibration of this machine"),
                       (["--bandwidth", "guess"], "--bandwidth 'guess': probe or calibration")):
        assert_usage_error(run_cli(["run", "full", "--model", TINY.name, "--weights", "random",
                                    "--prompt-len", "8", "--gen-len", "2", *args], capsys),
                           says)


def test_probe_measures_this_machine() -> None:
    bw = bound.probe(False, 1)
    assert bw.shared and bw.source == "probe"
    assert all(0.1 < v < 10_000 for v in bw.gbps.values())
    assert "native read loop" in bw.how["host"]


@pytest.mark.gpu
def test_cuda_run_probes_each_memory_and_counts_device_to_host_copies(
        tiny: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the probe measures device memory and both links apart from the host's
    (bound: the busiest of them), `.item()` and a blocking copy to the host sync, a
    non-blocking one into pinned memory does not."""
    monkeypatch.undo()  # the real probe, the tiny model again
    monkeypatch.setitem(MODELS, TINY.name, TINY)
    recs = run(tmp_path, FakeParams(item=True), device="cuda")
    m = recs["step_bound_s"]["method"]
    assert set(m["gbps"]) == {"host", "accel", "h2d", "d2h"} and not m["one_memory"]
    assert m["gbps"]["accel"] > m["gbps"]["h2d"]
    assert recs["syncs_per_step"]["value"] == TINY.n_layers
    x = torch.ones(4, device="cuda")
    pinned = torch.empty(4).pin_memory()
    for fn, n in ((lambda: x.cpu(), 1), (lambda: x.to("cpu", non_blocking=True), 0),
                  (lambda: pinned.copy_(x, non_blocking=True), 0), (lambda: pinned.copy_(x), 1)):
        with Counting() as c:
            fn()
        assert c.syncs == n


def test_a_probe_slower_than_the_steps_is_taken_again(
        tiny: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that bounds steps reading past the caches below their own rate caught a stall:
    the run probes again until the bound holds (3 probes at most) and keeps each quantity's
    highest reading; steps within the caches (the tiny model's, at the real cache size) may
    beat a memory bound, and are probed once."""
    quantities = ("host", "accel", "h2d", "d2h")
    probes = Probes(monkeypatch)

    def fake(readings: list[float]) -> None:
        probes([{k: g for k in quantities} for g in readings])

    def calls() -> list[float]:
        return [g["host"] for _, _, g in probes.calls]

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1)  # every step past the cache
    fake([0.001, 1000.0, 5.0])  # GB/s: far below any step, then one that bounds them
    recs = run(tmp_path, name="stalled")
    assert calls() == [0.001, 1000.0]
    m = recs["step_bound_s"]["method"]
    assert m["gbps"] == {k: 1000.0 for k in quantities}
    assert "the highest of 2 probes (the first, 0.001 GB/s" in m["how"]["host"]
    assert recs["step_efficiency"]["value"] < 1

    fake([0.001, 0.003, 0.002, 1000.0])  # never sane: three probes, the highest kept
    recs = run(tmp_path, name="stuck")
    assert calls() == [0.001, 0.003, 0.002]
    assert recs["step_bound_s"]["method"]["gbps"]["host"] == 0.003

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1 << 40)  # all within the cache
    fake([0.001, 1000.0])
    recs = run(tmp_path, name="cached")
    assert calls() == [0.001]
    assert recs["step_efficiency"]["value"] > 1  # left as measured: a cached step beat it
