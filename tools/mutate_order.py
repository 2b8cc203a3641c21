"""pytest plugin for `make mutate` (tools/mutate.py): run a mutant's tests fastest first.

mutmut runs each mutant's tests with -x, so a mutant is decided by the first test that
fails; ordering them by the durations mutmut's stats run measured (mutmut-stats.json)
decides most mutants with their cheapest test instead of a random one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    took = json.loads(stats.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: took.get(item.nodeid, 0.0))
