"""Units: sizes are binary (1K = 1 KiB = 1024 B), rates are decimal (1 GB/s = 1e9 B/s).

One place parses what users type (sizes, size lists, percentages) and formats what kvbench
prints, so every command agrees on what "256M" and "GB/s" mean.
"""

from __future__ import annotations

import math
import re

from kvbench.errors import KvbenchError

_SIZE_SUFFIX = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse '4K', '1.5M', '256MiB' or '4096' into a positive number of bytes."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).upper() not in _SIZE_SUFFIX:
        raise KvbenchError(f"cannot parse size '{text}' (examples: 4096, 4K, 1.5M, 256MiB)")
    value = float(m.group(1)) * _SIZE_SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise KvbenchError(f"size '{text}' is not a whole number of bytes")
    if value <= 0:
        raise KvbenchError(f"size '{text}' must be greater than zero")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """Parse a size list: '1K,4K,16K', a geometric run '1K,4K,...,256M', or '1K..256M' (x4).

    In '1K,4K,...,256M' the ratio comes from the two sizes before the ellipsis;
    'A..B' steps by 4 and 'A..B:x2' by the given factor.
    """
    text = text.strip()
    if not text:
        raise KvbenchError("empty size list")
    if ".." in text and "..." not in text:
        span, _, step = text.partition(":")
        lo_s, _, hi_s = span.partition("..")
        factor = 4
        if step:
            if not re.fullmatch(r"x\d+", step.strip()) or int(step.strip()[1:]) < 2:
                raise KvbenchError(f"bad step '{step}' in '{text}' (expected x2, x4, ...)")
            factor = int(step.strip()[1:])
        return _geometric(parse_size(lo_s), parse_size(hi_s), factor, text)
    parts = [p.strip() for p in text.split(",")]
    if "..." in parts:
        i = parts.index("...")
        if i < 2 or i != len(parts) - 2:
            raise KvbenchError(f"'...' in '{text}' needs two sizes before it and one after it")
        head = [parse_size(p) for p in parts[:i]]
        if head[-1] % head[-2] or head[-1] <= head[-2]:
            raise KvbenchError(f"'{text}': the two sizes before '...' must grow by a whole factor")
        run = _geometric(head[-2], parse_size(parts[-1]), head[-1] // head[-2], text)
        return head[:-2] + run
    sizes = [parse_size(p) for p in parts]
    return sizes


def _geometric(lo: int, hi: int, factor: int, text: str) -> list[int]:
    if hi < lo:
        raise KvbenchError(f"'{text}': the last size is smaller than the first")
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    if out[-1] != hi:
        raise KvbenchError(f"'{text}': {format_size(hi)} is not reached from {format_size(lo)}")
    return out


def format_size(n: int) -> str:
    """Shortest binary form: 1024 -> '1K', 268435456 -> '256M', 1000 -> '1000'."""
    for suffix, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def format_bytes(n: float) -> str:
    """Capacity in binary units with 3 significant digits: 5.34 GiB, 512 KiB, 100 B."""
    for suffix, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g} {suffix}"
    return f"{int(n)} B"


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s for nbytes moved in seconds."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def format_rate(gb_per_s: float) -> str:
    return f"{gb_per_s:.2f} GB/s"


def format_seconds(seconds: float) -> str:
    """Human time with a unit that keeps 3 significant digits: 1.23 us, 45.6 ms, 2.00 s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def parse_fraction(text: str, what: str = "threshold") -> float:
    """Parse '5%' or '0.05' into 0.05; anything else is an error."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise KvbenchError(f"cannot parse {what} '{text}' (examples: 5%, 0.05)") from None
    if not math.isfinite(value) or value < 0 or (not t.endswith("%") and value >= 1):
        raise KvbenchError(f"{what} '{text}' out of range (use a percentage like 5% or 0.05)")
    return value


# dtype spellings users type -> the torch name every record stores
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def dtype_name(text: str, what: str = "--dtype") -> str:
    """'fp32'/'bf16'/'fp16' or a torch name ('float32', ...) -> the torch name."""
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise KvbenchError(f"{what} '{text}': one of {', '.join(DTYPE_NAMES)}")
    return name
