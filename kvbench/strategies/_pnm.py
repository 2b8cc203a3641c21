"""The CXL-PNM device role shared by pnm-kv and png-kv (CXL-PNM, arXiv 2511.00321).

The PNM device (section 3.1, Table 2) holds the whole KV cache in CXL memory and runs the
KV-cache management there: min/max page digests (VPU comparator mode), score estimation
(max of q.min, q.max per channel, as Quest), the Top-K sorter and GEMV attention with
softmax over the selected T_Budget tokens. Here the device role is played by host memory
and host threads: every KV and digest buffer is allocated on one NUMA node, `--device-node`
(-1: the first memory-only node, which is how a CXL Type-3 expander appears, else the
node local to this process), and every quantity it computes is filed under where "pnm" in
the work trace, so a projection can re-time it on the device profile.

Several device roles (`--devices N`, section 3.2, Fig. 7): "dp" gives request b to device
b mod N (the paper's TP->DP mapping: each device scores and sorts its own requests, no
reduction); "tp" splits the query heads into N contiguous shards (the GPU's TP mapping):
a KV group whose heads span several devices has its page scores reduced across them
(host-mediated, CXL has no device-to-device path: one message of the partial score vector
per extra device) and sorted on each of them. Both compute the same selection; the trace
counts the difference: "topk_sorts" and "topk_candidates" (pages entering the sorts),
"reductions" (messages, bytes on link "pnm_reduce") and "device_load" per device "pnmK"
(KV and digest bytes each device reads, groups split by TP read on every device holding
a head of theirs). Activations cross the GPU-PNM link each layer and step (section 3.2):
B (Hq + 2 Hkv) D e bytes to the device ("d2h"), B Hq D e back ("h2d").

Shapes: device k/v per layer [B, Hkv, max_len, D] on the node, digests lo/hi [B, Hkv,
ceil(max_len / S), D] beside them; budget page masks [B, Hkv, n_pages].
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import KvbenchError, require
from kvbench.runtime.breakdown import Metric
from kvbench.strategies._pages import check_pages
from kvbench.topology import NumaNode, get_node, read_file, read_nodes
from kvbench.units import format_bytes

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext

SYSFS_ROOT = "/"  # where the topology is read (tests point it at a fake sysfs tree)
PARALLEL = ("dp", "tp")
# the device roles' own quantities (module docstring), in the trace only
PNM_METRICS = (Metric("topk_sorts", "sorts"), Metric("topk_candidates", "pages"),
               Metric("reductions", "messages"), Metric("device_load", "B"))


def device_node(requested: int, root: str | None = None) -> NumaNode:
    """The node that holds the device role's memory: `requested` (checked: it exists and
    has memory), or for -1 the first memory-only node, else the node of this process's
    first CPU."""
    root = SYSFS_ROOT if root is None else root
    if requested >= 0:
        node = get_node(requested, root)
        require(node.mem_total_bytes > 0, f"--device-node {requested}: NUMA node "
                f"{requested} has no memory")
        return node
    require(requested == -1, f"--device-node {requested}: a node id, or -1 (auto)")
    nodes = read_nodes(root)
    cxl = [n for n in nodes if n.memory_only]
    if cxl:
        return cxl[0]
    cpu = min(os.sched_getaffinity(0))
    return next((n for n in nodes if cpu in n.cpus), nodes[0])


def node_free_bytes(node: NumaNode, root: str | None = None) -> int:
    """MemFree of the node from sysfs (MemTotal when the kernel gives no MemFree)."""
    import re
    from pathlib import Path

    text = read_file(Path(SYSFS_ROOT if root is None else root)
                     / f"sys/devices/system/node/node{node.id}/meminfo")
    m = re.search(r"MemFree:\s+(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else node.mem_total_bytes


def alloc_on_node(node: int, shape: tuple[int, ...], dtype: torch.dtype,
                  keep: list[Any]) -> torch.Tensor:
    """A zeroed-then-touched tensor of `shape` on NUMA node `node` (libnuma, placement
    checked by kvbench.memory.HostBuffer); its buffer is appended to `keep` (held as long
    as the tensor is used). Without libnuma: plain host memory, unplaced."""
    import math

    import torch

    from kvbench.memory import HostBuffer
    from kvbench.topology import libnuma

    if libnuma() is None:
        return torch.zeros(shape, dtype=dtype)
    n = math.prod(shape) * dtype.itemsize
    buf = HostBuffer(node, max(n, 1))
    keep.append(buf)
    return buf.tensor()[:n].view(dtype).view(shape)


@dataclass(frozen=True)
class PnmParams:
    """Page size, token budget, sinks/window and dense layers, and the device roles."""

    budget_tokens: int = field(default=4096, metadata={
        "help": "T_Budget: tokens attended per decode step, layer and KV head (whole pages, "
                "the current page included; unstated in the paper, ArkVale's 4096); a "
                "budget covering the context is exact."})
    page_size: int = field(default=32, metadata={
        "help": "Tokens per page (S; unstated in the paper, ArkVale's 32)."})
    sinks: int = field(default=2, metadata={"help": "First pages always selected."})
    window_pages: int = field(default=2, metadata={
        "help": "Last pages always selected, the current (partial) page included."})
    dense_layers: int = field(default=2, metadata={
        "help": "Leading layers attended densely on the device (by real layer index)."})
    device_node: int = field(default=-1, metadata={
        "help": "NUMA node holding the device role's KV (-1: the first memory-only (CXL) "
                "node, else the local node); the run records the node used."})
    devices: int = field(default=1, metadata={"help": "PNM device roles (#PNM)."})
    parallel: str = field(default="dp", metadata={
        "help": "Mapping onto the devices: 'dp' (requests, the paper's choice) or 'tp' "
                "(query-head shards: N top-k sorts and cross-device score reductions)."})

    def __post_init__(self) -> None:
        check_pages(self.page_size, self.budget_tokens, self.sinks, self.window_pages,
                    self.dense_layers)
        require(self.device_node >= -1, f"--device-node {self.device_node}: a node id, "
                "or -1 (auto)")
        require(self.devices >= 1, f"--devices {self.devices}: at least one device role")
        require(self.parallel in PARALLEL, f"--parallel '{self.parallel}': one of "
                f"{', '.join(PARALLEL)}")


def resolve_node(params: PnmParams) -> tuple[PnmParams, list[str]]:
    """`params` with device_node resolved (what the run records) and a note on the node."""
    import dataclasses

    import torch

    node = device_node(params.device_node)
    kind = "memory-only (CXL)" if node.memory_only else "local, with CPUs (no CXL node)"
    keep: list[Any] = []
    alloc_on_node(node.id, (4096,), torch.uint8, keep)  # one page: is placement checkable?
    state = keep[0].placement if keep else "unplaced (libnuma unavailable)"
    for buf in keep:
        buf.close()
    return dataclasses.replace(params, device_node=node.id), [
        f"device role: KV on NUMA node {node.id}, {kind}; a test page's placement: {state}"]


def check_device_fit(params: PnmParams, ctx: RunContext, kv_bytes: int) -> None:
    """Refuse KV (plus digests) that the device roles' node cannot hold: per device, the
    busiest device's rows (dp) or every row (tp, head shards) against the node's free
    memory shared by the devices."""
    node = device_node(params.device_node)
    free = node_free_bytes(node)
    per_row = kv_bytes / ctx.batch * (1 + 1 / params.page_size)
    rows = -(-ctx.batch // params.devices) if params.parallel == "dp" else ctx.batch
    share = 1.0
    if params.parallel == "tp":  # the most KV groups any device holds a head of
        groups = group_devices(ctx.spec.n_heads, ctx.spec.n_kv_heads, params.devices)
        share = max(sum(d in ds for ds in groups) for d in range(params.devices)) / len(groups)
    need, have = per_row * rows * share, free / params.devices
    if need > have:
        raise KvbenchError(
            f"KV does not fit the device roles: {format_bytes(need)} per device ({rows} of "
            f"{ctx.batch} sequences x {ctx.max_len} tokens, {format_bytes(kv_bytes)} KV in "
            f"all) > {format_bytes(have)} ({format_bytes(free)} free on node {node.id} / "
            f"{params.devices} devices)")


def group_devices(hq: int, hkv: int, n: int) -> list[list[int]]:
    """tp: the devices holding a query head of each KV group, query heads split into n
    contiguous shards (head h on device h * n // hq)."""
    shard = [h * n // hq for h in range(hq)]
    g = hq // hkv
    return [sorted(set(shard[j * g:(j + 1) * g])) for j in range(hkv)]


class DeviceKV:
    """Per-layer KV and min/max digests on the device node, and the device's page selection.

    `write` stores new k/v [B, Hkv, T, D] (on any device) and updates the digests;
    `select` scores pages for q [B, Hq, 1, D] and returns the budget set (sinks, window,
    top of the rest: `_pages.select_pages`) as a mask [B, Hkv, n_pages] plus the ranking
    scores (forced pages +inf), counting the device's work.
    """

    def __init__(self, params: PnmParams, ctx: RunContext) -> None:
        import torch

        from kvbench.strategies._pages import Digests

        self.p, self.ctx = params, ctx
        self.node = device_node(params.device_node).id
        s, b = ctx.spec, ctx.batch
        self.hkv, self.hq, self.d = s.n_kv_heads, s.n_heads, s.head_dim
        self.buffers: list[Any] = []
        shape = (b, self.hkv, ctx.max_len, self.d)
        self.k = [alloc_on_node(self.node, shape, ctx.dtype, self.buffers)
                  for _ in range(ctx.n_layers)]
        self.v = [alloc_on_node(self.node, shape, ctx.dtype, self.buffers)
                  for _ in range(ctx.n_layers)]
        cpu = torch.device("cpu")

        def alloc(p_shape: tuple[int, ...]) -> torch.Tensor:
            return alloc_on_node(self.node, p_shape, ctx.dtype, self.buffers)

        self.dig = [Digests(b, self.hkv, ctx.max_len, self.d, params.page_size, "minmax", cpu,
                            ctx.dtype, alloc) for _ in range(ctx.n_layers)]
        self.length = [0] * ctx.n_layers
        n = params.devices
        self.row_dev = [r % n for r in range(b)]  # dp: request -> device
        self.group_devs = group_devices(self.hq, self.hkv, n)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store k/v [B, Hkv, T, D] after the cached tokens (their bytes cross to the device,
        "d2h") and re-digest the pages they touch; returns the new length."""
        n0 = self.length[layer]
        n1 = n0 + k.shape[2]
        kd, vd = self.k[layer], self.v[layer]
        kd[:, :, n0:n1], vd[:, :, n0:n1] = k.to(kd.device), v.to(vd.device)
        self.dig[layer].update(kd, n0, n1)
        self.length[layer] = n1
        self.ctx.counters.moved("d2h", 2.0 * k.numel() * self.ctx.elem_bytes)
        return n1

    def select(self, layer: int, q: torch.Tensor, n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(budget mask [B, Hkv, n_pages], ranking scores [B, Hkv, n_pages])."""
        import torch

        from kvbench.strategies._pages import page_scores, select_pages

        p = self.p
        n_pages, k_pages = -(-n // p.page_size), p.budget_tokens // p.page_size
        dig = self.dig[layer]
        qd = q.to(dig.lo.device)
        scores = page_scores(qd, dig.lo[:, :, :n_pages], dig.hi[:, :, :n_pages], "kv")
        pages = select_pages(scores, n_pages, k_pages, p.sinks, p.window_pages)
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, pages, True)
        ranked = scores.clone()
        ranked[:, :, :p.sinks] = float("inf")
        ranked[:, :, max(n_pages - p.window_pages, 0):] = float("inf")
        self._count_selection(layer, q, n)
        return mask, ranked

    def select_tokens(self, layer: int, q: torch.Tensor, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The budget set's token positions [B, Hkv, K * S] (ascending, the first lens
        valid) and lens [B, Hkv]: `select`'s rule (group-summed scores, sinks, window, top
        of the rest) as Quest's selection lists it (`_pages.select_positions`: one native
        call on the CPU), without the ranking only PnG-KV's Steady-Select reads."""
        from kvbench.strategies._pages import select_positions

        p = self.p
        n_pages, k_pages = -(-n // p.page_size), p.budget_tokens // p.page_size
        dig = self.dig[layer]
        self._count_selection(layer, q, n)
        return select_positions(q.to(dig.lo.device), dig.lo[:, :, :n_pages],
                                dig.hi[:, :, :n_pages], n_pages, k_pages, p.sinks,
                                p.window_pages, "kv", p.page_size, n)

    def _count_selection(self, layer: int, q: torch.Tensor, n: int) -> None:
        """The scores' digest bytes and FLOPs, the top-K sorts, their candidates and TP's
        score reductions (module docstring) of the layer's selection for q [B, Hq, 1, D]
        over n tokens."""
        c, b, n_pages = self.ctx.counters, q.shape[0], -(-n // self.p.page_size)
        dig_row = self.dig[layer].nbytes(n) / b
        c.add("bytes_read", "pnm", b * dig_row)
        c.add("flops", "pnm", 4.0 * b * self.hq * n_pages * self.d)
        if self.p.parallel == "dp":
            sorts, extra = b * self.hkv, 0
            for r in range(b):
                c.add("device_load", f"pnm{self.row_dev[r]}", dig_row)
        else:
            sorts = b * sum(len(ds) for ds in self.group_devs)
            extra = b * sum(len(ds) - 1 for ds in self.group_devs)
            for ds in self.group_devs:
                for dev in ds:
                    c.add("device_load", f"pnm{dev}", b * dig_row / self.hkv)
            c.add("reductions", "pnm", float(extra))
            c.moved("pnm_reduce", 4.0 * extra * n_pages)
        c.add("topk_sorts", "pnm", float(sorts))
        c.add("topk_candidates", "pnm", float(sorts * n_pages))

    def count_load(self, lens: torch.Tensor) -> None:
        """device_load of attention over lens [B, Hkv] selected tokens per row and KV head:
        tensors summed at the step's end (no device value read here)."""
        c, e = self.ctx.counters, self.ctx.elem_bytes
        per = lens.double() * (2.0 * self.d * e)  # [B, Hkv] bytes
        if self.p.parallel == "dp":
            for r in range(per.shape[0]):
                c.add("device_load", f"pnm{self.row_dev[r]}", per[r])
            return
        for j, ds in enumerate(self.group_devs):
            for dev in ds:
                c.add("device_load", f"pnm{dev}", per[:, j])

    def activations_back(self, b: int, lse: bool) -> None:
        """The device's attention output (and, for a merge, its lse) back to the GPU."""
        extra = b * self.hq * 4.0 if lse else 0.0
        self.ctx.counters.moved("h2d", b * self.hq * self.d * self.ctx.elem_bytes + extra)

    def query_in(self, q: torch.Tensor) -> None:
        """The query's bytes to the device (k/v are counted by `write`)."""
        self.ctx.counters.moved("d2h", float(q.numel() * self.ctx.elem_bytes))


def mask_tokens(mask: torch.Tensor, page: int, n: int, most: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions [B, H, M * S] of the pages marked in mask [B, H, n_pages], M =
    min(most, n_pages) with `most` at least the pages any row marks (`_pages.kept_pages`: the
    width is known on the host, so no device value is read), and valid lengths [B, H],
    valid positions first (`_pages.page_tokens` for a variable number of pages per row)."""
    import torch

    from kvbench.strategies._pages import page_tokens

    cnt = mask.sum(-1)
    m = max(min(most, mask.shape[-1]), 1)
    ids = (~mask).to(torch.int8).argsort(dim=-1, stable=True)[..., :m]  # marked first
    pos, _ = page_tokens(ids, page, n + page * mask.shape[-1])  # every position valid
    off = torch.arange(m * page, device=mask.device)
    valid = (off < (cnt * page)[..., None]) & (pos < n)
    order = (~valid).to(torch.int8).argsort(dim=-1, stable=True)
    return pos.masked_fill(~valid, 0).gather(-1, order), valid.sum(-1)
