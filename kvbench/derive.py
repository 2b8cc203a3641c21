"""Derived records: what a package function computes from an experiment's records.

An experiment's `[[derive]]` (kvbench.experiment) names a function `(records, **args) ->
list[Record]` that turns committed records into new ones (a model fed with measurements,
e.g. the CXL KV-storage paper's ROI model, appendix A.1, with inputs read from measured
TTFTs: kvbench.prefix.roi.derived). Each is labelled provenance "projected", so measured
and derived numbers never mix unlabelled, unless its module declares PROVENANCE "measured"
(statistics of measured records that are measurements themselves, not a model: compare's
verdicts between unchanged runs, kvbench.compare_study); `kvbench experiment run`
rewrites the output whole after the suites, and the tables pivot it like any records. The
function's module names the parameters its records carry in RECORD_PARAMS (tables may
name them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require


@dataclass(frozen=True)
class Derivation:
    """One `[[derive]]`: `function = "kvbench.module:name"`, `args`, `out`."""

    function: str
    out: Path
    args: dict[str, Any]

    @classmethod
    def parse(cls, raw: dict[str, Any], root: Path, where: str) -> Derivation:
        """From its TOML table; an unknown key or function is refused naming it."""
        unknown = sorted(set(raw) - {"function", "out", "args"})
        require(not unknown, f"{where}: unknown key '{unknown[0] if unknown else ''}'")
        require("function" in raw and "out" in raw, f"{where}: 'function' and 'out' are "
                "required")
        d = cls(raw["function"], root / raw["out"], dict(raw.get("args", {})))
        try:
            d.resolve()
        except KvbenchError as e:
            raise KvbenchError(f"{where}: {e}") from None
        return d

    def module(self) -> Any:
        """The function's module (None when it is not a kvbench module that imports)."""
        import importlib

        module = self.function.partition(":")[0]
        try:
            return importlib.import_module(module) if module.startswith("kvbench.") else None
        except ImportError:
            return None

    def resolve(self) -> Any:
        name = self.function.partition(":")[2]
        fn = getattr(self.module(), name, None) if name else None
        require(callable(fn), f"unknown derive function '{self.function}' (a "
                "'kvbench.module:function')")
        return fn

    def params(self) -> set[str]:
        """The parameters its records carry (its module's RECORD_PARAMS)."""
        self.resolve()
        return set(getattr(self.module(), "RECORD_PARAMS", ()))

    def write(self, records: list[dict[str, Any]]) -> int:
        """`out` rewritten whole with what the function computes from `records`, every
        record checked to carry its module's provenance before anything is written."""
        from kvbench.envinfo import collect_env
        from kvbench.store import ResultWriter

        recs = self.resolve()(records, **self.args)
        want = getattr(self.module(), "PROVENANCE", "projected")
        for r in recs:
            require(r.provenance == want, f"derive '{self.function}': its record "
                    f"{r.name} {r.metric} is not labelled {want}")
        self.out.unlink(missing_ok=True)
        with ResultWriter(self.out, collect_env()) as w:
            w.write_all(recs)
        return len(recs)
