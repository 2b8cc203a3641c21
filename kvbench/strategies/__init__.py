"""KV offload strategies: one module per strategy, each a small class registered by name.

The runtime (model runtime issue) defines the strategy interface; this package holds the
registry so that `kvbench list` and `kvbench run NAME` look strategies up by name.
"""

from __future__ import annotations

from typing import ClassVar

from kvbench.registry import Registry, first_line


class Strategy:
    """Base class of KV offload strategies; `name` and `version` go into every record."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"

    @classmethod
    def summary(cls) -> str:
        return first_line(cls.__doc__)


STRATEGIES: Registry[type[Strategy]] = Registry("strategy", __name__)
