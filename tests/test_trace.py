"""The stage graph (trace version 2): dependencies from the counter calls and the hints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench.cli import main
from kvbench.models import get_spec
from kvbench.runtime.context import Counters
from kvbench.runtime.trace import COLUMNS, TRACE_VERSION, dense_work


def _q(b: int = 1, hq: int = 4, lq: int = 1, d: int = 8) -> torch.Tensor:
    return torch.zeros(b, hq, lq, d)


def test_chain_fork_join_and_background() -> None:
    c = Counters(kv_heads=2, elem_bytes=4, n_layers=2)
    spec = get_spec("smollm2-135m")
    c.dense(spec, "pre", 1)  # 0
    with c.fork("host"):
        c.moved("d2h", 64)  # 1: after 0
    c.attended("accel", _q(), 10)  # 2: after 0, not the fork
    with c.fork("host"):
        c.attended("host", _q(), 30)  # 3: after 1 (the fork continues)
    with c.background():
        c.moved("d2h", 128)  # 4: nobody in this step waits
    c.dense(spec, "post", 1)  # 5: joins the fork's tail (3) and the chain (2)
    t = c.graph.tasks
    assert [x.after for x in t] == [[], [0], [0], [1], [2], [2, 3]]
    assert t[4].background and not t[5].background
    c.step = 1  # the next step: layer 0 waits for the background copy and the chain end
    c.dense(spec, "pre", 1)
    assert sorted(t[6].after) == [4, 5]


def test_prefetch_ahead_wraps_into_next_step() -> None:
    c = Counters(kv_heads=2, elem_bytes=4, n_layers=2)
    c.layer = 1
    c.moved("h2d", 100, ahead=1)  # 0: for layer 0 of the next step
    c.attended("accel", _q(), 5)  # 1
    c.step, c.layer = 1, 0
    c.task("accel", "pre", flops=1.0)  # 2: dense work does not wait for the prefetch
    c.attended("accel", _q(), 5)  # 3: the attention does
    t = c.graph.tasks
    assert t[2].after == [1] and sorted(t[3].after) == [0, 2]


def test_timed_blocks_carry_seconds_only_without_modelled_work() -> None:
    c = Counters(kv_heads=2, elem_bytes=4, n_layers=1)
    with c.timed("bookkeeping.scores"):
        pass
    with c.timed("bookkeeping.speculate"):
        c.add("flops", "accel", 10.0)
        c.add("bytes_read", "accel", 20.0)  # merges into the same compute task
    with c.timed("accel_idle"):
        pass
    with c.timed("bookkeeping.handoff", wait=True):
        pass
    ops = [(x.resource, x.op) for x in c.graph.tasks]
    assert ops == [("host", "bookkeeping.scores"), ("accel", "compute")]
    assert c.graph.tasks[1].work["flops"] == 10.0 and c.graph.tasks[1].work["bytes_read"] == 20


def test_dense_work_matches_parameter_count() -> None:
    spec = get_spec("llama-3.1-8b")
    pre, post = dense_work(spec, "pre", 3, 2), dense_work(spec, "post", 3, 2)
    # 2 FLOPs per weight per row; the layer's weights split between the two parts
    assert pre["flops"] + post["flops"] == 2 * 3 * spec.layer_params()
    assert dense_work(spec, "head", 1, 2)["flops"] == 2 * 4096 * 128256


def _tasks(path: Path) -> dict[int, list[list]]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("metric") == "trace.tasks":
            assert r["method"]["trace_version"] == TRACE_VERSION
            assert r["method"]["columns"] == list(COLUMNS)
            out[r["params"]["step"]] = r["method"]["tasks"]
    return out


@pytest.mark.parametrize("strategy", ["offload", "hgca", "infinigen"])
def test_run_stores_task_graph(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    extra = {"hgca": ["--gpu-share", "0.5", "--beta", "0"],
             "infinigen": ["--variant", "oracle", "--skew-tokens", "8", "--dense-layers",
                           "0"]}.get(strategy, [])
    with pytest.raises(SystemExit) as e:
        main(["run", strategy, "--model", "opt-125m", "--weights", "random", "--layers", "2",
              "--prompt-len", "24", "--gen-len", "3", "--out", str(out), *extra])
    assert e.value.code == 0
    steps = _tasks(out)
    assert sorted(steps) == [0, 1, 2, 3]
    col = {c: i for i, c in enumerate(COLUMNS)}
    dec = steps[2]
    ops = [(t[col["layer"]], t[col["resource"]], t[col["op"]]) for t in dec]
    # a CPU run: the step's dispatch (what kernels and waits leave of it) closes the step
    assert ops[-2:] == [(1, "accel", "head"), (1, "host", "dispatch")]
    assert dec[-1][col["seconds"]] > 0
    assert sum(op == "pre" for _, _, op in ops) == 2
    by_id = {t[col["id"]]: t for s in steps.values() for t in s}
    if strategy == "offload":
        # each layer's attention waits for a prefetch recorded one layer earlier
        for t in dec:
            if t[col["op"]] == "attention":
                pre = [by_id[i] for i in t[col["after"]] if by_id[i][col["resource"]] == "h2d"]
                assert len(pre) == 1 and pre[0][col["id"]] < t[col["id"]]
                src = pre[0][col["layer"]]
                assert src == (t[col["layer"]] - 1) % 2
    elif strategy == "infinigen":
        # layer 1's attention waits for the gather layer 0 speculated and prefetched
        (att,) = [t for t in dec if t[col["op"]] == "attention" and t[col["layer"]] == 1]
        pre = [by_id[i] for i in att[col["after"]] if by_id[i][col["resource"]] == "h2d"]
        assert len(pre) == 1 and pre[0][col["layer"]] == 0
    else:
        host = [t for t in dec if t[col["resource"]] == "host" and t[col["op"]] == "attention"]
        assert host, "hgca attends host entries once the window has evicted"
        for t in host:  # beside the accelerator window: it waits for the query copy only
            (dep,) = t[col["after"]]
            assert by_id[dep][col["resource"]] == "d2h"


# --- the run's derived figures (runtime.breakdown), each computed by hand (issue 30) ---

def _own() -> tuple:
    """The figures these tests count beyond every run's: scout's and hgca's declarations."""
    from kvbench.strategies.hgca import Hgca
    from kvbench.strategies.scout import Scout

    return (*Scout.metrics, *Hgca.metrics)


def _breakdown(params: dict | None = None) -> dict[str, object]:
    """Two layers, a prefill (step 0, left out) and decode steps 1 and 2 of 0.5 s and 1.5 s."""
    from kvbench.runtime.breakdown import derived

    c = Counters(kv_heads=1, elem_bytes=2, n_layers=2, metrics=_own())
    per = {  # (quantity, where) -> {(step, layer): value}
        ("bytes_moved", "h2d"): {(0, 0): 99.0, (1, 0): 10.0, (1, 1): 20.0, (2, 1): 5.0},
        ("pages", "recalled"): {(1, 0): 2.0, (2, 0): 4.0},
        ("cpu_ratio", "host"): {(1, 0): 0.2, (1, 1): 0.4, (2, 0): 0.6, (2, 1): 1.0},
        ("tokens", "accel"): {(1, 0): 40.0, (1, 1): 40.0, (2, 0): 80.0, (2, 1): 80.0},
        ("tokens", "host_resident"): {(1, 0): 50.0, (2, 0): 50.0, (1, 1): 10.0},
        ("tokens", "host_selected.h0"): {(1, 0): 10.0, (2, 0): 15.0, (1, 1): 5.0},
        ("tokens", "host_selected.h1"): {(1, 0): 40.0},
        ("time", "accel_idle"): {(1, 0): 0.1, (2, 1): 0.3},
        ("time", "bookkeeping.scores"): {(1, 0): 0.2},
        ("time", "bookkeeping.issue"): {(2, 1): 0.6},
        ("rel_error", "attention"): {(1, 0): 0.1, (2, 0): 0.3, (1, 1): 0.5, (2, 1): 0.7},
        ("topk_recall", "attention"): {(1, 0): 1.0, (2, 0): 0.8, (1, 1): 0.4, (2, 1): 0.6},
        ("pred_error", "attention"): {(1, 0): 0.2},
    }
    for (quantity, where), values in per.items():
        for (step, layer), v in values.items():
            c.step, c.layer = step, layer
            c.add(quantity, where, v)
    p = {"layers": 2, "batch": 2, **(params or {})}
    return {r.metric + ("@" + str(r.params.get("where")) if "where" in r.params else ""): r
            for r in derived("x", p, [0.5, 1.5], c)}


def test_breakdown_figures_by_hand() -> None:
    out = _breakdown()
    moved = out["bytes_moved_per_step@h2d"]
    assert moved.samples == [30.0, 5.0] and moved.direction == "none" and moved.unit == "B"
    assert out["pages_recalled_per_step"].samples == [2.0, 4.0]
    cpu = out["cpu_compute_ratio_per_step"]
    assert cpu.samples == pytest.approx([0.3, 0.8], rel=1e-12) and cpu.direction == "lower"
    tokens = out["tokens_attended_per_step@accel"]  # per layer and sequence: / (2 x 2)
    assert tokens.samples == [20.0, 40.0] and tokens.unit == "tokens/layer"
    assert "2 layers and 2 sequences" in tokens.method["per"]
    assert "tokens_attended_per_step@host_resident" not in out
    assert out["accel_idle_share"].samples == [pytest.approx(0.4 / 2.0, rel=1e-12)]
    book = out["bookkeeping_share"]
    assert book.samples == [pytest.approx(0.8 / 2.0, rel=1e-12)]
    assert book.method["phases"] == {"bookkeeping.issue": pytest.approx(0.3, rel=1e-12),
                                     "bookkeeping.scores": pytest.approx(0.1, rel=1e-12)}
    sel = out["selected_fraction"]  # h0: layer 0 25/100, layer 1 5/10; h1: layer 0 40/100
    assert sel.samples == [0.25, 0.5, 0.4]
    assert (sel.method["min"], sel.method["max"]) == (0.25, 0.5)
    err = out["attention_rel_error"]  # layer means 0.2 and 0.6
    assert err.samples == pytest.approx([0.2, 0.6], rel=1e-12) and err.direction == "lower"
    assert err.method["worst_layer"] == 1 and err.method["worst"] == pytest.approx(0.6)
    assert err.method["mean"] == pytest.approx(0.4, rel=1e-12)
    rec = out["top10_recall"]  # layer means 0.9 and 0.5: the worst is the lowest
    assert rec.method["worst_layer"] == 1 and rec.direction == "higher"
    assert out["predicted_query_rel_error"].samples == [0.1]  # step 2 holds 0


def test_breakdown_waives_query_cosine_of_random_weights() -> None:
    from kvbench.runtime.breakdown import derived

    c = Counters(kv_heads=1, elem_bytes=2, n_layers=1, metrics=_own())
    c.step = 1
    c.add("q_cosine", "attention", 0.9)
    (rec,) = derived("x", {"weights": "random"}, [1.0], c)
    assert rec.status == "waived" and rec.metric == "query_cosine"
    (real,) = derived("x", {"weights": "gguf"}, [1.0], c)
    assert real.value == 0.9 and real.direction == "higher"
    assert list(derived("x", {}, [0.0], Counters(1, 2))) == []  # nothing counted, no time


def test_breakdown_records_fields_in_full() -> None:
    """Every record's identity, unit, direction, params and method, as written."""
    out = _breakdown()
    p = {"layers": 2, "batch": 2}
    step = {"per": "decode step, summed over layers", "statistic": "median"}
    want = {
        "bytes_moved_per_step@h2d": ("B", "none", {**p, "where": "h2d"}, step),
        "pages_recalled_per_step": ("pages", "none", p, {
            **step, "per": "decode step: pages summed over layers, sequences and KV heads"}),
        "cpu_compute_ratio_per_step": ("ratio", "lower", p, {
            **step, "per": "decode step: tokens attended on the host / budget, mean over the "
                           "layers that report it"}),
        "tokens_attended_per_step@accel": ("tokens/layer", "none", {**p, "where": "accel"}, {
            "per": "decode step: tokens attended per layer and sequence, mean over the run's "
                   "2 layers and 2 sequences", "statistic": "median"}),
        "accel_idle_share": ("ratio", "lower", p, {
            "per": "sum over decode steps / sum of decode step times"}),
    }
    for key, (unit, direction, params, method) in want.items():
        r = out[key]
        assert (r.kind, r.name, r.unit, r.direction, r.params, r.method) == (
            "run", "x", unit, direction, params, method), key
    assert all(r.kind == "run" and r.name == "x" for r in out.values())
    sel = out["selected_fraction"]
    assert (sel.unit, sel.direction, sel.params) == ("ratio", "none", p)
    assert sel.method["per"] == "(layer, KV head): selected / host-resident entries"
    err = out["attention_rel_error"]
    assert (err.unit, err.params) == ("ratio", p)
    assert err.method["statistic"] == "median over layers of the mean over decode steps"


def test_breakdown_tokens_on_host_and_pnm() -> None:
    from kvbench.runtime.breakdown import derived

    c = Counters(kv_heads=1, elem_bytes=2, n_layers=1)
    c.step = 1
    for where, v in (("host", 6.0), ("pnm", 8.0), ("disk", 1.0)):
        c.add("tokens", where, v)
    got = {r.params["where"]: r.samples for r in derived("x", {"layers": 1, "batch": 2}, [1.0],
                                                          c)}
    assert got == {"host": [3.0], "pnm": [4.0]}


def test_breakdown_shares_below_one_second_and_the_remaining_fields() -> None:
    from kvbench.runtime.breakdown import derived

    c = Counters(kv_heads=1, elem_bytes=2, n_layers=1, metrics=_own())
    c.step = 1
    c.add("time", "accel_idle", 0.1)
    c.add("time", "bookkeeping.x", 0.2)
    c.add("tokens", "host_resident", 10.0)
    c.add("tokens", "host_selected.h0", 5.0)
    c.add("pred_overlap", "attention", 0.7)
    c.add("pred_error", "attention", 0.3)
    c.add("q_cosine", "attention", 0.9)
    out = {r.metric: r for r in derived("x", {"weights": "random"}, [0.5], c)}
    assert out["accel_idle_share"].samples == [pytest.approx(0.2, rel=1e-12)]
    book = out["bookkeeping_share"]  # a step of 0.5 s: shares are still taken
    assert (book.unit, book.direction, book.params, book.samples) == (
        "ratio", "lower", {"weights": "random"}, [pytest.approx(0.4, rel=1e-12)])
    assert out["selected_fraction"].method["statistic"] == "median"
    overlap = out["predicted_block_overlap"]
    assert (overlap.direction, overlap.samples) == ("higher", [0.7])
    assert out["predicted_query_rel_error"].direction == "lower"
    cos = out["query_cosine"]
    assert (cos.kind, cos.name, cos.status, cos.params) == ("run", "x", "waived",
                                                            {"weights": "random"})
    assert cos.reason == "random weights: the predicted query's cosine is meaningless"
    none = {r.metric for r in derived("x", {}, [0.0], c)}
    assert not {"accel_idle_share", "bookkeeping_share"} & none  # no time: no share
