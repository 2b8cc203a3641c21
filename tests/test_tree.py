"""The working tree travels to a GPU machine only under 64 MiB (tracked plus untracked files
that git does not ignore): tracked files stay under 48 MB, leaving room for a session's
results. Generated HTML reports stay out of git; large records are committed gzip-compressed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIMIT = 48_000_000


def _files(*args: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", *args],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.decode().split("\0") if p]


def test_tracked_files_fit_a_gpu_machine_with_room_to_spare() -> None:
    sizes = {p: p.stat().st_size for p in _files() if p.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:5]
    assert total <= LIMIT, (f"tracked files hold {total / 1e6:.1f} MB (limit {LIMIT / 1e6:.0f} "
                            "MB); largest: " + ", ".join(f"{p.relative_to(REPO)} "
                                                         f"{sizes[p] / 1e6:.1f} MB"
                                                         for p in largest))


def test_no_generated_report_is_tracked() -> None:
    html = [p.relative_to(REPO) for p in _files() if p.name == "report.html"]
    assert html == []
