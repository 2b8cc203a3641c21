"""README.md's probe and strategy tables are what `kvbench list --markdown` prints from the
registries, between two marker comments, so that the two cannot drift apart; the README
links only docs pages that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.probes import PROBES
from kvbench.strategies import STRATEGIES

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- kvbench list --markdown -->\n", "<!-- /kvbench list --markdown -->"


def list_markdown(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(["list", "--markdown"])
    assert e.value.code in (0, None)
    return capsys.readouterr().out


def test_readme_tables_are_kvbench_list_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (REPO / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    between = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    assert between == list_markdown(capsys), \
        "README.md's tables differ from `kvbench list --markdown`: paste its output there"


def test_list_markdown_has_every_probe_and_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    out = list_markdown(capsys)
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", out, re.MULTILINE)
    assert [n for n, _ in rows] == PROBES.names() + STRATEGIES.names()
    assert dict(rows)["timer"] == PROBES.get("timer").summary()
    assert out.index("| probe |") < out.index("| strategy |")


def test_list_json_and_markdown_together_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    line = assert_usage_error(cli(["list", "--json", "--markdown"], capsys))
    assert line == "kvbench: error: give --json or --markdown, not both"


def test_readme_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert "docs/fleet.md" in local
    assert [link for link in local if not (REPO / link).exists()] == []
