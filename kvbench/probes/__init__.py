"""Hardware probes: one module per probe, each a small class registered by name.

A probe module defines a frozen config dataclass (the class attribute `config`) and a
`Probe` subclass whose `run` yields records for that config. `kvbench probe NAME` is the
command `probe_command(cls)` builds from the registry, as `kvbench run NAME` is for
strategies: one option per config field (help and checks in the field metadata, through
`kvbench.options.config_command`) around `Probe.command`, which stores and shows each record
as it is measured and writes the probe's figures (a probe with a live view overrides it).
Suites build the same config from a TOML table, so every option is a config field of the
same name; `kvbench list` shows the first line of the class docstring, `--help` the
class's `description`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvbench.registry import Registry, first_line
from kvbench.schema import Record
from kvbench.timing import PASSES, Policy, Timing, time_passes

Measure = Callable[[Policy], Timing]  # measure(policy): one quantity's timing under policy
RecordOf = Callable[[Timing], Record]  # the record of a quantity from its timing


class Probe(ABC):
    """Base class: `name` and `version` identify the probe in every record it writes."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    config: ClassVar[type]
    description: ClassVar[str]  # `kvbench probe NAME --help`
    # parameters its records carry beside its config's fields (an experiment's tables may
    # name them, kvbench.experiment)
    record_params: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def summary(cls) -> str:
        return first_line(cls.__doc__)

    @abstractmethod
    def run(self, config: Any) -> Iterator[Record]:
        """Measure and yield one record per quantity, as soon as each is measured."""

    @classmethod
    def plot(cls, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        """Write this probe's PNG figures for loaded records (dicts); reports call this."""
        return []

    @classmethod
    def command(cls, config: Any, out: Path | None) -> None:
        """`kvbench probe NAME`: each record stored and shown as it is measured, then the
        figures (`plot`) next to the result file."""
        from kvbench.console import show_record, wrote
        from kvbench.store import load

        path = run_and_store(cls(), config, out, show_record)
        wrote(path)
        if cls.plot is not Probe.plot:
            for png in cls.plot(load(path).records, path.parent / f"{path.stem}-plots"):
                wrote(png)


PROBES: Registry[type[Probe]] = Registry("probe", __name__)


def probe_command(cls: type[Probe]) -> Callable[..., None]:
    """The typer command of `kvbench probe NAME`: the config's fields as options, then
    --out (checked before anything is measured), calling `cls.command`."""
    from kvbench.options import config_command

    return config_command([(cls.config, None)], cls.command, cls.description)


def in_passes(todo: Sequence[tuple[Measure, RecordOf]], policy: Policy,
              passes: int = PASSES) -> Iterator[Record]:
    """The records of quantities timed together in passes (kvbench.timing.time_passes):
    `todo` holds each quantity's measure and the function that makes its record from its
    samples joined over the passes."""
    timings = time_passes([m for m, _ in todo], policy, passes) if todo else []
    for (_, record), t in zip(todo, timings, strict=True):
        yield record(t)


def measure(probe: Probe, config: Any) -> Iterator[Record]:
    """probe.run(config) as every caller (CLI, suites) should see it: dtype spellings
    (fp32, bf16, ...) turned into torch names first, so records carry those; each record
    stamped with the probe's version and, when kvbench's attention kernels ran since the
    previous record, which backend ran them per phase (`method.backend`: the native kernel
    or the torch fallback, kvbench.kernels.attention.backend_use)."""
    from kvbench.kernels.attention import backend_use
    from kvbench.units import dtype_name

    if isinstance(getattr(config, "dtype", None), str):
        config = dataclasses.replace(config, dtype=",".join(
            dtype_name(t) for t in config.dtype.split(",")))
    backend_use(reset=True)
    for rec in probe.run(config):
        rec.version = probe.version
        used = backend_use(reset=True)
        if used:
            rec.method.setdefault("backend", used)
        yield rec


def run_and_store(probe: Probe, config: Any, out: Path | None,
                  show: Callable[[Record], None] | None = None) -> Path:
    """Run a probe (`measure`), appending each record to `out` (default: a new file under
    results/) as soon as it is measured."""
    from kvbench.envinfo import collect_env
    from kvbench.store import ResultWriter, default_out_path

    path = out or default_out_path(probe.name)
    with ResultWriter(path, collect_env()) as w:
        for rec in measure(probe, config):
            w.write(rec)
            if show is not None:
                show(rec)
    return path
