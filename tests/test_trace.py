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
