"""Config dataclasses as command lines: one field, one option (probes, strategies, suites).

A frozen config dataclass is the command line, the suite schema and the repro string (as
vllm's `EngineArgs.add_cli_args` and `ParameterSweepItem.apply_to_cmd`): `options(cls)`
turns its fields into typer options (default: the field default; help, `min` and hidden
aliases from the field's metadata), `collect(cls, kw)` builds the config back from what
typer parsed, and `to_argv(params)` turns parameters into the flags of the same command
(booleans as --x / --no-x, lists comma-joined), for suites and repro commands.

Field metadata: "help" (text), "hidden" (an option for tests), "min" (smallest value,
checked by `check_ranges`, which a config's `__post_init__` calls so that suites get the
same one-line error), "aliases" (older option names kept as hidden options that set this
field), "flags" ({flag: value}: hidden boolean options that each set the field to one
value; two at once is an error) and "derived" (set by the run, recorded, never an option).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer

from kvbench.errors import KvbenchError, require


def opt(default: Any, text: str, **meta: Any) -> Any:
    """A config field with its option's help text and other metadata (see above)."""
    return dataclasses.field(default=default, metadata={"help": text, **meta})


def flag(name: str) -> str:
    """The option spelling of a field name: block_size -> --block-size."""
    return "--" + name.replace("_", "-")


def _typer_hint(hint: Any) -> Any:
    """`X | None` as typing.Optional[X], the spelling every typer version reads."""
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return typing.Optional[args[0]] if len(args) == 1 else hint  # noqa: UP045
    return hint


def _param(name: str, hint: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_typer_hint(hint),
                             default=option)


def fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that are options (not "derived")."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def options(cls: type, helps: dict[str, str] | None = None) -> list[inspect.Parameter]:
    """Typer options of every field of dataclass `cls` (help: `helps[name]` or the field's
    "help" metadata), then the hidden aliases and flags the fields declare."""
    hints = typing.get_type_hints(cls)
    out, hidden = [], []
    for f in fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = (helps or {}).get(f.name) or f.metadata.get("help", f.name)
        out.append(_param(f.name, hints[f.name], typer.Option(
            default, help=text, hidden=f.metadata.get("hidden", False))))
        for alias in f.metadata.get("aliases", ()):
            hidden.append(_param(alias, typing.Optional[hints[f.name]],  # noqa: UP045
                                 typer.Option(None, flag(alias), hidden=True)))
        for name in f.metadata.get("flags", {}):
            hidden.append(_param(name, bool, typer.Option(False, flag(name), hidden=True)))
    return out + hidden


def collect(cls: type, kw: dict[str, Any]) -> Any:
    """Pop `cls`'s fields (and their aliases and flags) from typer's keywords `kw` and build
    the config; a given alias or flag wins over the field's default."""
    values = {}
    for f in fields(cls):
        values[f.name] = kw.pop(f.name)
        for alias in f.metadata.get("aliases", ()):
            if (v := kw.pop(alias)) is not None:
                values[f.name] = v
        flags = f.metadata.get("flags", {})
        chosen = [name for name in flags if kw.pop(name)]
        if len(chosen) > 1:
            raise KvbenchError(f"use only one of {', '.join(flag(n) for n in flags)}")
        if chosen:
            values[f.name] = flags[chosen[0]]
    return cls(**values)


def check_ranges(config: Any) -> None:
    """KvbenchError (one line) for a field below its metadata "min"."""
    for f in dataclasses.fields(config):
        low = f.metadata.get("min")
        value = getattr(config, f.name)
        if low is not None:
            require(value >= low, f"{flag(f.name)} must be at least {low} (got {value})")


def to_argv(params: dict[str, Any]) -> list[str]:
    """Command-line flags of parameters: --name value, booleans --name / --no-name, lists
    and tuples comma-joined (what `options` parses back)."""
    args: list[str] = []
    for k, v in params.items():
        if isinstance(v, bool):
            args.append(flag(k) if v else "--no-" + k.replace("_", "-"))
        else:
            args += [flag(k), ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)]
    return args


_OUT = _param("out", typing.Optional[Path],  # noqa: UP045
              typer.Option(None, help="Result file (default: new file in results/)."))


def config_command(configs: Iterable[tuple[type, dict[str, str] | None]],
                   run: Callable[..., None], doc: str, results: bool = True
                   ) -> Callable[..., None]:
    """A typer command whose options are the fields of each config class in turn, then
    --out; it calls `run(config, ..., out)` with the configs built from the options, once
    --out is known to be writable (kvbench.paths; `results`: the command stores records in
    --out, appended to, or else in a new file in results/)."""
    configs = list(configs)

    def command(**kw: Any) -> None:
        from kvbench.paths import check_out
        from kvbench.store import check_results_out

        out = kw.pop("out")
        built = [collect(cls, kw) for cls, _ in configs]
        if results:  # before anything is measured
            check_results_out(out)
        elif out is not None:
            check_out(out)
        run(*built, out)

    params = [p for cls, helps in configs for p in options(cls, helps)]
    command.__signature__ = inspect.Signature([*params, _OUT])  # type: ignore[attr-defined]
    command.__doc__ = doc
    return command
