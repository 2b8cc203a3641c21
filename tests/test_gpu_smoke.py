"""tools/gpu-smoke and tools/gpu_audit.py on the CPU (GPU campaign, audit section 4): every
command the smoke would run parses through the real CLI (a renamed option fails here, not
on the GPU's clock) and the audit's strategy loop runs on a tiny model."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvbench.options import collect
from kvbench.probes import PROBES
from kvbench.runtime.run import RunConfig, resolve
from kvbench.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = "ABCDSR"


def _dry(chunk: str) -> list[list[str]]:
    out = subprocess.run(["bash", str(ROOT / "tools/gpu-smoke"), chunk], cwd=ROOT,
                         env={**os.environ, "DRY": "1"}, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [shlex.split(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def commands() -> dict[str, list[list[str]]]:
    return {c: _dry(c) for c in CHUNKS}


@pytest.fixture(scope="module")
def cli() -> Any:
    from kvbench.cli import command

    return command()


def _parse(root: Any, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(command path, parsed options) of `kvbench ARGV`, through click's own parsing."""
    cmd, path = root, []
    while hasattr(cmd, "commands"):
        assert argv and argv[0] in cmd.commands, f"no command {argv[:1]} under {path}"
        path.append(argv[0])
        cmd, argv = cmd.commands[argv[0]], argv[1:]
    return path, dict(cmd.make_context("kvbench " + " ".join(path), list(argv)).params)


def _audit_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_audit", ROOT / "tools/gpu_audit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_chunk_has_steps_and_writes_under_out_gpu(commands) -> None:
    for chunk, lines in commands.items():
        assert len(lines) >= 5, chunk
        outs = [line[line.index("--out") + 1] for line in lines if "--out" in line]
        assert outs and all(o.startswith(f"out/gpu/{chunk}/") for o in outs), (chunk, outs)
    assert subprocess.run(["bash", str(ROOT / "tools/gpu-smoke"), "E"], cwd=ROOT,
                          capture_output=True, timeout=60).returncode == 2


def test_steps_log_resume_and_pack(tmp_path: Path) -> None:
    """Each step's output and exit code land in its log, a step done is not run again, none
    starts past BUDGET_S, and the chunk's folder comes back as $OUT/<chunk>.tgz (PYTHON=true
    stands in for python3, so every kvbench step succeeds at once)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": "true", "GPU_SMOKE_DIR": str(tmp_path / "gpu"),
           "OUT": str(out)}

    def smoke(chunk: str, **extra: str) -> list[str]:
        return subprocess.run(["bash", str(ROOT / "tools/gpu-smoke"), chunk], cwd=tmp_path,
                              env={**env, **extra}, capture_output=True, text=True, timeout=60,
                              check=True).stdout.splitlines()

    first = smoke("B")
    assert [line.split()[1] for line in first] == ["timer", "bw", "bw-cupy-h2d", "bw-cupy-d2h",
                                                  "lat", "roof32", "roof16"]
    assert all(" rc=0 " in line for line in first)
    assert (tmp_path / "gpu/B/bw.log").read_text() == "rc=0\n"
    assert smoke("B") == []  # resumed: every step done
    with tarfile.open(out / "B.tgz") as tar:
        assert "B/roof16.log" in tar.getnames()
    assert all(line.endswith("run A again") for line in smoke("A", BUDGET_S="0"))


def test_every_kvbench_command_parses_into_its_config(commands, cli) -> None:
    """Each printed `kvbench ...` line parses; probes and runs build their configs (range
    checks included) and runs resolve (model, context length) as `kvbench run` would."""
    seen = set()
    for line in (x for lines in commands.values() for x in lines if x[0] == "kvbench"):
        path, kw = _parse(cli, line[1:])
        seen.add(path[0])
        if path[0] == "probe":
            collect(PROBES.get(path[1]).config, kw)
        elif path[0] == "run":
            cfg = collect(RunConfig, kw)
            cls = STRATEGIES.get(path[1])
            cls.for_run(collect(cls.params, kw), cfg.seq_len)
            assert cfg.weights == "random" and cfg.text == "README.md", line
            assert resolve(cfg)[0].name == cfg.model
    assert seen == {"env", "probe", "run"}


def test_a_renamed_option_fails_the_parse(cli) -> None:
    with pytest.raises(Exception, match="No such option: --sizez") as e:
        _parse(cli, ["probe", "bandwidth", "--sizez", "1K"])
    assert hasattr(e.value, "format_message")  # click's usage error: one line, exit 2


def test_other_commands_exist(commands) -> None:
    """pytest node ids and tools the smoke names exist; the audit's flags parse."""
    audit = _audit_module()
    for line in (x for lines in commands.values() for x in lines):
        if line[:3] == ["python3", "-m", "pytest"]:
            for node in (a for a in line[3:] if a.startswith("tests")):
                file, _, test = node.partition("::")
                assert (ROOT / file).exists(), node
                assert not test or f"def {test}(" in (ROOT / file).read_text(), node
        elif line[:2] == ["python3", "tools/gpu_audit.py"]:
            audit.parser().parse_args(line[2:])


def test_audit_without_cuda_is_one_line_exit_2() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools/gpu_audit.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == \
        "gpu_audit.py: error: no CUDA GPU on this machine"


def test_audit_kinds_of_profiled_activity() -> None:
    audit = _audit_module()
    assert audit.copy_kinds(["ampere_bf16_gemm", "Memcpy HtoD (Pageable -> Device)",
                             "Memcpy DtoH (Device -> Pinned)", "Memset (Device)",
                             "void at::native::index_kernel"]) == {
        "kernels": 2, "memcpy": 2, "memcpy_pageable": 1, "memset": 1}


def test_audit_params_and_loop_for_every_strategy_on_cpu(monkeypatch) -> None:
    """Every registered strategy builds from SCALED and runs the audit's prefill and decode
    steps on a tiny random model; sync debug mode is "warn" only inside strategy.decode and
    each synchronising call inside it is counted at its source line."""
    from kvbench.models import get_spec
    from kvbench.models.weights import load
    from kvbench.strategies.full import Full

    audit = _audit_module()
    modes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Syncing(Full):
        name = "syncing"

        def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            assert modes[-1] == "warn"
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
            return super().decode(layer, q, k, v)

    a = argparse.Namespace(layers=2, batch=1, prompt_len=48, steps=2, profiled=0)
    model = load(get_spec("smollm2-135m"), "random", 2, torch.float32,
                 torch.device("cpu")).model
    cpu = torch.device("cpu")
    for cls in [*STRATEGIES.all(), Syncing]:
        params, _ = audit.scaled_params(cls, 64)
        for f, v in audit.SCALED.items():
            if hasattr(params, f) and f not in ("budget_tokens", "gpu_share"):
                assert getattr(params, f) == v, (cls.name, f)
        lines = list(audit.audit(cls, model, a, cpu, torch.float32))
        assert [x["step"] for x in lines] == [1, 2] and not any(x["nan"] for x in lines)
        assert all(x["enqueue_s"] > 0 and not x["profiled"] for x in lines)
        assert model.strategy is None
        if cls is Syncing:
            assert [x["syncs"] for x in lines] == [2, 2]  # one per layer
            (site,) = lines[0]["sync_sites"]
            assert site.startswith("tests/test_gpu_smoke.py:")
        else:
            assert all(x["syncs"] == 0 for x in lines), cls.name
    assert modes and set(modes) == {"warn", 0} and modes[-1] == 0
