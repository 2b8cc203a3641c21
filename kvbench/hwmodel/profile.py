"""Hardware profiles: the speeds `kvbench project` re-times a run's stage graph with.

A profile is a TOML file (shipped ones in kvbench/hwmodel/profiles/, `kvbench hardware
list`) with one table per resource of the graph (kvbench.runtime.trace.RESOURCES):

    [accel]  memory_gbps, peak_tflops.<dtype>, attention_gbps, launch_us, memory_gib,
             shares_host (true: the accelerator role is the host CPU, as on a CPU-only run)
    [host]   attention_gbps (CPU attention KV-read rate), launch_us, cores
    [h2d], [d2h]  copy speed over transfer size, per host memory kind: `pinned` and
             `pageable`, each either {sizes = [B...], gbps = [...]} (measured curve) or
             {peak_gbps, latency_us} (curve size / (latency + size / peak))
    [cxl], [pnm]  optional: a CXL.mem link (same curve form) and a near-memory device
             (memory_gbps, peak_tflops, link_gbps)
    [power]  accel_idle_w, accel_peak_w, host_idle_w, host_peak_w (pnm_* when [pnm])
    [price]  usd_per_hour

Every table has a `source` sub-table naming where each of its fields comes from
(datasheet, paper section, probe result, or "estimate: ..."); `kvbench hardware show`
prints them beside the values. A table may instead be a string naming a component file
(profiles/components/NAME.toml), so hosts and links are written once. Rates are decimal
GB/s (kvbench.units), sizes bytes. A curve is read by linear interpolation in log size,
flat beyond its ends.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PROFILES = Path(__file__).parent / "profiles"
# fields the graph's tasks need: (table, field, what needs it)
REQUIRED = (("accel", "memory_gbps", "accelerator tasks' bytes"),
            ("accel", "peak_tflops", "accelerator tasks' FLOPs"),
            ("accel", "attention_gbps", "accelerator attention tasks"),
            ("accel", "launch_us", "task launches"),
            ("host", "attention_gbps", "host attention tasks"),
            ("host", "launch_us", "host task launches"),
            ("h2d", "pageable", "h2d copies"), ("d2h", "pageable", "d2h copies"))


@dataclass(frozen=True)
class Curve:
    """GB/s against transfer size (bytes), interpolated in log size."""

    sizes: tuple[float, ...]
    gbps: tuple[float, ...]

    @classmethod
    def of(cls, spec: Any, where: str) -> Curve:
        """A rate in GB/s (the same at every size), {sizes = [B...], gbps = [...]} or
        {peak_gbps, latency_us}; KvbenchError naming `where` for anything else."""
        if _number(spec):
            require(spec > 0, f"{where} = {spec!r}: a rate must be above 0 GB/s")
            return cls((1.0,), (float(spec),))
        require(isinstance(spec, dict), f"{where}: a number, a curve or peak_gbps/latency_us")
        if "sizes" in spec:
            sizes, rates = spec["sizes"], spec.get("gbps", [])
            require(isinstance(sizes, list) and isinstance(rates, list) and bool(sizes)
                    and len(sizes) == len(rates)
                    and all(_number(v) and v > 0 for v in sizes + rates),
                    f"{where}: sizes and gbps must be equally long lists of numbers above 0")
            pts = sorted(zip(map(float, sizes), map(float, rates), strict=True))
            return cls(tuple(p[0] for p in pts), tuple(p[1] for p in pts))
        require("peak_gbps" in spec and "latency_us" in spec,
                f"{where}: give sizes/gbps or peak_gbps and latency_us")
        require(_number(spec["peak_gbps"]) and spec["peak_gbps"] > 0
                and _number(spec["latency_us"]) and spec["latency_us"] >= 0,
                f"{where}: peak_gbps must be a number above 0, latency_us one of 0 or more")
        peak, lat = float(spec["peak_gbps"]), float(spec["latency_us"]) * 1e-6
        sizes = [float(4 ** e) for e in range(5, 15)]  # 1K .. 256M
        return cls(tuple(sizes), tuple(s / (lat + s / (peak * 1e9)) / 1e9 for s in sizes))

    def at(self, size: float) -> float:
        """GB/s at `size` bytes."""
        if len(self.sizes) == 1 or size <= self.sizes[0]:
            return self.gbps[0]
        if size >= self.sizes[-1]:
            return self.gbps[-1]
        i = bisect.bisect_right(self.sizes, size)
        x0, x1 = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        f = (math.log(size) - x0) / (x1 - x0)
        return self.gbps[i - 1] + f * (self.gbps[i] - self.gbps[i - 1])

    def seconds(self, nbytes: float, copies: float = 1.0) -> float:
        """Time of `copies` transfers of nbytes / copies each."""
        if nbytes <= 0:
            return 0.0
        n = max(copies, 1.0)
        return nbytes / (self.at(nbytes / n) * 1e9)


@dataclass
class Profile:
    """A parsed profile: its tables as dicts, the file it came from."""

    name: str
    tables: dict[str, dict[str, Any]]
    path: str

    def get(self, table: str, field: str, default: Any = None) -> Any:
        return self.tables.get(table, {}).get(field, default)

    def need(self, table: str, field: str, why: str) -> Any:
        v = self.get(table, field)
        if v is None:
            raise KvbenchError(f"hardware profile '{self.name}' has no field "
                               f"'{table}.{field}' ({why} need it)")
        return v

    def check(self) -> Profile:
        for table, field, why in REQUIRED:
            self.need(table, field, why)
        return self

    def curve(self, link: str, memory: str = "pageable") -> Curve:
        spec = self.get(link, memory) or self.need(link, "pageable", f"{link} copies")
        return Curve.of(spec, f"profile '{self.name}' {link}.{memory}")

    def rate(self, table: str, field: str, size: float, why: str) -> float:
        """A rate field (a number or a curve over bytes) at `size` bytes, GB/s."""
        return Curve.of(self.need(table, field, why), f"{table}.{field}").at(size)

    def tflops(self, dtype: str) -> float:
        peak = self.need("accel", "peak_tflops", "accelerator tasks' FLOPs")
        if isinstance(peak, (int, float)):
            return float(peak)
        key = dtype if dtype in peak else "float32"
        require(key in peak, f"hardware profile '{self.name}' has no field "
                f"'accel.peak_tflops.{dtype}' (accelerator tasks' FLOPs need it)")
        return float(peak[key])


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# every field a profile may set, by name: what its value must be
_POSITIVE, _AT_LEAST_0, _COUNT = "a number above 0", "a number of 0 or more", "an integer >= 1"
_FIELDS: dict[str, str] = {
    **dict.fromkeys(("memory_gbps", "host_link_gbps", "memory_gib", "tflops_fp16"), _POSITIVE),
    **dict.fromkeys(("launch_us", "idle_w", "peak_w", "accel_idle_w", "accel_peak_w",
                     "pnm_idle_w", "pnm_peak_w", "usd_per_hour", "pnm_usd_per_hour"),
                    _AT_LEAST_0),
    **dict.fromkeys(("cores", "gpus_per_node", "pnm_per_node"), _COUNT),
    **dict.fromkeys(("attention_gbps", "dense_gbps", "pinned", "pageable", "link"), "curve"),
    "peak_tflops": "tflops", "efficiency": "fraction", "shares_host": "bool", "name": "text",
    "source": "sources"}
_TABLES = ("accel", "host", "h2d", "d2h", "cxl", "pnm", "power", "price", "node")


def _check_field(table: str, key: str, v: Any, where: str) -> None:
    """KvbenchError unless field `key` of `table` has a value of its kind (_FIELDS)."""
    at = f"{where}: {table}.{key}"
    kind = _FIELDS.get(key)
    require(kind is not None, f"{at}: unknown field (known: {', '.join(sorted(_FIELDS))})")
    if kind == "curve":
        Curve.of(v, at)
    elif kind == "tflops":
        peaks = v if isinstance(v, dict) else {"": v}
        require(bool(peaks) and all(_number(x) and x > 0 for x in peaks.values()),
                f"{at} = {v!r}: TFLOP/s above 0, or a table of them per dtype")
    elif kind == "fraction":
        require(_number(v) and 0 < v <= 1, f"{at} = {v!r}: must be a number in (0, 1]")
    elif kind == "bool":
        require(isinstance(v, bool), f"{at} = {v!r}: must be true or false")
    elif kind == "text":
        require(isinstance(v, str), f"{at} = {v!r}: must be a string")
    elif kind == "sources":
        require(isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                f"{at}: must be a table of strings")
    else:  # _POSITIVE, _AT_LEAST_0, _COUNT
        ok = _number(v) and (isinstance(v, int) or kind != _COUNT)
        require(ok and (v >= 0 if kind == _AT_LEAST_0 else v > 0), f"{at} = {v!r}: must be {kind}")


def names() -> list[str]:
    """Shipped profiles (file stems), sorted."""
    return sorted(p.stem for p in PROFILES.glob("*.toml"))


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise KvbenchError(f"cannot read {what} {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise KvbenchError(f"{what} {path} is not valid TOML: {e}") from None


def load(name: str) -> Profile:
    """A shipped profile by name or a TOML file path; KvbenchError when unknown."""
    from kvbench.paths import shown, stat

    path = Path(name)
    if not (name.endswith(".toml") and stat(path, "hardware profile") is not None):
        require(name in names(), f"unknown hardware profile '{shown(name)}' (known: "
                f"{', '.join(names())}, this, or a FILE.toml)")
        path = PROFILES / f"{name}.toml"
    return parse(_read(path, "hardware profile"), str(path))


def parse(doc: dict[str, Any], path: str = "") -> Profile:
    """Resolve component references (a table given as a component's name) and check every
    field by name for its type and range (KvbenchError naming the first that is wrong)."""
    where = f"hardware profile {path or doc.get('name', '')}"
    tables: dict[str, dict[str, Any]] = {}
    for key, val in doc.items():
        if key in ("name", "description"):
            require(isinstance(val, str), f"{where}: {key} must be a string")
            continue
        require(key in _TABLES, f"{where}: unknown table [{key}] (known: {', '.join(_TABLES)})")
        if isinstance(val, str):
            comp = PROFILES / "components" / f"{val}.toml"
            require(comp.is_file(), f"hardware profile {path}: [{key}] names unknown "
                    f"component '{val}'")
            val = _read(comp, "component")
        require(isinstance(val, dict), f"{where}: [{key}] must be a table or a component name")
        for field, v in val.items():
            _check_field(key, field, v, where)
        tables[key] = val
    name = str(doc.get("name") or Path(path).stem)
    return Profile(name, tables, path)


def rows(p: Profile) -> list[tuple[str, str, str]]:
    """(field, value, source) for `kvbench hardware show`: every leaf of every table."""
    out = []
    for table, fields in p.tables.items():
        src = fields.get("source", {})
        for k, v in fields.items():
            if k in ("source", "name"):
                continue
            if isinstance(v, dict) and "sizes" not in v and "peak_gbps" not in v:
                for kk, vv in v.items():
                    out.append((f"{table}.{k}.{kk}", str(vv), str(src.get(k, ""))))
            else:
                if isinstance(v, dict) and "sizes" in v:
                    v = f"curve {len(v['sizes'])} sizes, {min(v['gbps']):.3g}-" \
                        f"{max(v['gbps']):.3g} GB/s"
                out.append((f"{table}.{k}", str(v), str(src.get(k, ""))))
    return out


def replicate(p: Profile, gpus: int, pnms: int) -> Profile:
    """`p` with `gpus` accelerators (tensor parallel) and `pnms` near-memory devices (data
    parallel) in place of its one each, for CXL-PNM's GPU and PNM counts: rates, peaks,
    memory, power and price of each multiplied by its count, the copy links as well (one
    link per GPU). Ideal scaling: no tensor-parallel all-reduce, requests balanced over
    the PNMs; `pnms` 0 drops the PNM (the GPU-CXL-memory baseline). Recorded in
    tables["replicas"]."""
    import copy

    require(gpus >= 1 and pnms >= 0, f"--gpus {gpus} / --pnms {pnms}: at least 1 GPU, "
            "0 or more PNMs")
    t = copy.deepcopy(p.tables)

    def mul(table: str, keys: tuple[str, ...], n: int) -> None:
        for k in keys:
            v = t.get(table, {}).get(k)
            if isinstance(v, (int, float)):
                t[table][k] = v * n
            elif isinstance(v, dict) and "sizes" in v:
                v["gbps"] = [g * n for g in v["gbps"]]
            elif isinstance(v, dict):
                for kk, vv in v.items():  # peak_tflops per dtype; a link's peak_gbps
                    if kk != "latency_us" and isinstance(vv, (int, float)):
                        v[kk] = vv * n

    mul("accel", ("memory_gbps", "attention_gbps", "peak_tflops", "memory_gib"), gpus)
    for link in ("h2d", "d2h"):
        mul(link, ("pinned", "pageable"), gpus)
    mul("power", ("accel_idle_w", "accel_peak_w"), gpus)
    mul("price", ("usd_per_hour",), gpus)
    if pnms == 0:
        t.pop("pnm", None)
        for table, keys in (("power", ("pnm_idle_w", "pnm_peak_w")),
                            ("price", ("pnm_usd_per_hour",))):
            for k in keys:
                t.get(table, {}).pop(k, None)
    else:
        mul("pnm", ("memory_gbps", "peak_tflops", "memory_gib"), pnms)
        mul("power", ("pnm_idle_w", "pnm_peak_w"), pnms)
        mul("price", ("pnm_usd_per_hour",), pnms)
    t["replicas"] = {"gpus": gpus, "pnms": pnms, "source": {
        "gpus": "kvbench project --gpus (ideal tensor parallel: no all-reduce modelled)",
        "pnms": "kvbench project --pnms (ideal data parallel: requests balanced)"}}
    return Profile(f"{p.name}:{gpus}gpu+{pnms}pnm", t, p.path)
