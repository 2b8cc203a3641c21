"""A strategy's `--variant`: the authors' semantics the default, every variant named, a
parameter the chosen variant does not take refused with one line (exit 2)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.strategies import STRATEGIES, Variant, check_variant, variant_field, variants


@dataclass(frozen=True)
class ToyParams:
    variant: str = variant_field(
        Variant("authors", "the authors' accuracy code", ignores=("window",)),
        Variant("kernel", "the authors' kernel path"))
    window: int = field(default=1, metadata={"help": "pages kept"})

    def __post_init__(self) -> None:
        check_variant(self)


def test_the_first_variant_is_the_default_and_help_lists_all() -> None:
    assert ToyParams().variant == "authors"
    assert [v.name for v in variants(ToyParams)] == ["authors", "kernel"]
    text = next(f for f in ToyParams.__dataclass_fields__.values()
                if f.name == "variant").metadata["help"]
    assert "'authors' (default): the authors' accuracy code" in text
    assert "'kernel': the authors' kernel path" in text


def test_unknown_variant_names_the_variants() -> None:
    with pytest.raises(KvbenchError, match=r"--variant 'nope': unknown \(variants: authors, "
                                           r"kernel\)"):
        ToyParams(variant="nope")


def test_a_parameter_the_variant_does_not_take_is_refused() -> None:
    assert ToyParams(variant="kernel", window=3).window == 3
    assert ToyParams(variant="authors", window=1).window == 1  # the default: not "given"
    with pytest.raises(KvbenchError, match="--window is not a parameter of variant 'authors'"):
        ToyParams(variant="authors", window=3)


def test_distinct_variants_required() -> None:
    with pytest.raises(ValueError):
        variant_field(Variant("a", "x"), Variant("a", "y"))
    with pytest.raises(ValueError):
        variant_field()


def test_list_shows_each_strategys_variants() -> None:
    out = CliRunner().invoke(app, ["list", "--json"])
    assert out.exit_code == 0, out.output
    listed = {e["name"]: e.get("variants") for e in json.loads(out.output)
              if e["kind"] == "strategy"}
    for cls in STRATEGIES.all():
        names = [v.name for v in variants(cls.params)]
        assert listed[cls.name] == (names or None)
