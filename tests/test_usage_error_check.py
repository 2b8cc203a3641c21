"""The bad-input check every exit 2 of the tests goes through (conftest.assert_usage_error)
fails on each way bad input can be reported wrongly: another exit code, a second line, a
traceback, output on stdout, no "kvbench: error: " prefix, a missing fragment."""

from __future__ import annotations

import subprocess

import pytest
from conftest import assert_usage_error, cli

GOOD = "kvbench: error: --calls must be at least 100 (got 5)\n"


def result(code: int, stdout: str, stderr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["kvbench"], code, stdout, stderr)


def test_passes_one_line_exit_2_and_returns_it() -> None:
    assert assert_usage_error(result(2, "", GOOD), "--calls", "got 5") == GOOD.strip()


@pytest.mark.parametrize("code, stdout, stderr, fragments", [
    (1, "", GOOD, ()),  # another exit code
    (0, "", "", ()),  # success
    (2, "", GOOD + "kvbench: error: and more\n", ()),  # two lines
    (2, "", "Traceback (most recent call last):\n" + GOOD, ()),  # a traceback
    (2, "a table\n", GOOD, ()),  # something drawn on stdout
    (2, GOOD, "", ()),  # the error on stdout
    (2, "", "error: --calls must be at least 100\n", ()),  # not kvbench's one-line form
    (2, "", GOOD, ("--reps",)),  # the wrong message
])
def test_fails_on_each_wrong_report(code: int, stdout: str, stderr: str,
                                    fragments: tuple[str, ...]) -> None:
    with pytest.raises(AssertionError):
        assert_usage_error(result(code, stdout, stderr), *fragments)


def test_cli_returns_what_kvbench_printed_only(capsys: pytest.CaptureFixture[str]) -> None:
    print("earlier output")
    got = cli(["probe", "timer", "--calls", "5"], capsys)
    assert got.returncode == 2 and got.stdout == "" and "earlier" not in got.stderr
    assert_usage_error(got, "--calls must be at least 100 (got 5)")
