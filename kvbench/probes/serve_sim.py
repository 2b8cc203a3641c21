"""Serving probe: TTFT vs batch under a TTFT SLO, recompute vs prefix cache per tier.

The CXL KV-storage paper's Fig. 1b/1c set-up (section 3.3) on the bundled model, then a
Poisson serving simulation driven by the measured batch times; the method is
kvbench.prefix.serve's. A probe so suites run it (`probe = "serve-sim"`);
`kvbench serve-sim` is the same command.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.prefix.serve import ServeConfig
from kvbench.probes import PROBES, Probe, run_and_store
from kvbench.schema import Record


@PROBES.register
class ServeSimProbe(Probe):
    """Prefix-cache TTFT vs batch under an SLO per tier, and a serving simulation on it."""

    name = "serve-sim"
    version = "1"
    config = ServeConfig
    description = ("TTFT vs batch under a TTFT SLO, recompute vs prefix cache per tier (CXL "
                   "KV-storage paper Fig. 1c), and a Poisson serving simulation driven by it.")

    def run(self, config: ServeConfig) -> Iterator[Record]:
        from kvbench.prefix.serve import run

        yield from run(config)

    @classmethod
    def command(cls, config: Any, out: Path | None) -> None:
        """Stored, not shown record by record: the run prints its two tables."""
        from kvbench.console import wrote

        wrote(run_and_store(cls(), config, out))
