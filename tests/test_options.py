"""Config dataclasses are the command lines (issue 11 item 13): every probe's and strategy's
options come from its config fields, defaults written once, and the flags a suite writes
for a case (its repro command) parse back into the same config."""

from __future__ import annotations

import dataclasses
import inspect
import shlex
from pathlib import Path

import pytest
import typer

from kvbench.options import collect, fields, to_argv
from kvbench.probes import PROBES, probe_command
from kvbench.runtime.command import make_command
from kvbench.runtime.run import RunConfig
from kvbench.strategies import STRATEGIES
from kvbench.suite import load_suite, units

SUITES = sorted(Path(__file__).parent.parent.glob("suites/*.toml"))


def parse(command, args: list[str]) -> dict:
    """What typer parses `args` of `command` into (nothing runs)."""
    app = typer.Typer()
    app.command()(command)
    return dict(typer.main.get_command(app).make_context("kvbench", list(args)).params)


@pytest.mark.parametrize("name", [c.name for c in PROBES.all()])
def test_probe_options_are_the_config_fields(name: str) -> None:
    """One option per config field, with the field's default: nothing written twice."""
    cls = PROBES.get(name)
    sig = inspect.signature(probe_command(cls)).parameters
    for f in fields(cls.config):
        assert f.name in sig, f"--{f.name} missing from `kvbench probe {name}`"
        assert sig[f.name].default.default == f.default
    visible = {n for n, p in sig.items() if not p.default.hidden} - {"out"}
    assert visible == {f.name for f in fields(cls.config) if not f.metadata.get("hidden")}


def test_to_argv_spells_every_kind_of_value() -> None:
    assert to_argv({"quick": True, "bars": False, "sizes": ["1K", "4K"], "gpu_share": 0.5,
                    "batch": (1, 2)}) == ["--quick", "--no-bars", "--sizes", "1K,4K",
                                          "--gpu-share", "0.5", "--batch", "1,2"]


@pytest.mark.parametrize("suite", SUITES, ids=[p.stem for p in SUITES])
def test_suite_commands_parse_into_the_case_config(suite: Path) -> None:
    """Each unit's repro command (`Unit.command`, also what runs a strategy case) parses
    through the real command into the config the suite builds for it."""
    for unit in units(load_suite(suite)):
        args = shlex.split(unit.command())
        assert args[:3] == ["kvbench", "probe" if unit.case.kind == "probe" else "run",
                            unit.case.name]
        if unit.case.kind == "probe":
            cls = PROBES.get(unit.case.name)
            got = collect(cls.config, parse(probe_command(cls), args[3:]))
            assert got == unit.case.build(unit.params)
        else:
            cls = STRATEGIES.get(unit.case.name)
            kw = parse(make_command(cls), args[3:])
            run, own = collect(RunConfig, kw), collect(cls.params, kw)
            names = {f.name for f in dataclasses.fields(RunConfig)}
            assert run == RunConfig(**{k: v for k, v in unit.params.items() if k in names})
            assert own == cls.params(**{k: v for k, v in unit.params.items()
                                        if k not in names})


def test_hidden_flags_and_aliases_set_their_field() -> None:
    bw = PROBES.get("bandwidth")
    assert collect(bw.config, parse(probe_command(bw), ["--pageable"])).memory == "pageable"
    assert collect(bw.config, parse(probe_command(bw), ["--memory", "pinned"])).memory == "pinned"
    h2o = STRATEGIES.get("h2o")
    kw = parse(make_command(h2o), ["--budget", "0.3"])
    collect(RunConfig, kw)
    assert collect(h2o.params, kw).gpu_share == 0.3
