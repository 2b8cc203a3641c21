"""Fleet sweeps on Ray: one suite across many machines into one result file (issue 17).

`kvbench suite run FILE --ray [ADDRESS]` makes every unit of the suite a Ray task:

- Placement by resources: each task asks for one CPU, one GPU when the case `requires =
  "gpu"`, and the custom resources the case names (`resources = { cxl = 1 }`), which
  nodes advertise when started (`ray start --resources '{"cxl": 1}'`). A unit no node can
  hold is recorded as waived with the reason; the rest runs.
- Machines and classes: a node is a machine named by its Ray node name (`ray start
  --node-name`, by default its IP address); its class is the custom resource
  `class:NAME` it advertises, else kvbench's hardware class (`gpu-h100`, `cpu-2c-x86_64`).
- Fan-out: `--on all-nodes | all-gpu-nodes | CLASS[,CLASS]` or the suite's `machines =
  [CLASS, ...]` run each unit once on every matching node (pinned to it); such a unit's
  resume key is (case, machine). Without fan-out a unit runs once, wherever it fits.
- Streaming: the driver appends each unit's records (one batch) as its task returns,
  under the environment of the node that ran it (one env line per machine, its env_id
  salted with the node's name and class so that twin machines stay apart).
- Faults: a task whose worker or node dies is retried once by Ray (`max_retries=1`; an
  unpinned unit lands on another node with the same resources); a second loss becomes the
  unit's error record naming the nodes and the reason. A fan-out unit whose node is gone
  is recorded as an error; `--resume` runs it again. An exception inside a case is the
  case's own error record (suite_units.execute), as on one machine.
- Refusals (KvbenchError, exit 2): Ray not installed (install hint), an address that does
  not answer within 3 s, a node whose kvbench version differs from the driver's (both
  named), a fan-out class no node has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.schema import Record, not_measured
from kvbench.suite import Suite, machine_class
from kvbench.suite_units import Unit, execute, has_gpu

INSTALL_HINT = "Ray is not installed here: pip install -e '.[cluster]' (or: pip install ray)"
CLASS_PREFIX = "class:"
CONNECT_TIMEOUT_S = 3.0

_NODE_ENV: dict[str, dict[str, Any]] = {}  # per worker process: its node's environment


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise KvbenchError(INSTALL_HINT) from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail fast on an address that does not answer (ray.init would wait a minute)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port or 6379)),
                                 timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise KvbenchError(f"no Ray cluster answers at '{address}' within "
                           f"{CONNECT_TIMEOUT_S:.0f} s: {why}") from None


def _token_at_hand() -> bool:
    """Whether Ray finds an authentication token here: RAY_AUTH_TOKEN, the file that
    RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token (where `ray get-auth-token --generate`
    writes it on the head, and where a worker machine gets a copy of it)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def enable_token_auth() -> None:
    """Ray (2.59+) turns token authentication on by itself for `ray start --head`, a new local
    cluster and `auto`, but a driver joining an explicit address authenticates only under
    RAY_AUTH_MODE=token, else the head answers `InvalidAuthToken`. Where the mode is unset
    and a token is at hand, set it for this process, as Ray does for a head: a cluster
    without authentication accepts a driver that sends a token."""
    if "RAY_AUTH_MODE" not in os.environ and _token_at_hand():
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config

        Config.initialize("")  # Ray read its config at import: read it again


def _auth_hint() -> str:
    """What a driver that the head refused (InvalidAuthToken) lacks: the mode, set to
    something else here, or the head's token."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        return f"RAY_AUTH_MODE is {mode} here; set RAY_AUTH_MODE=token"
    return ("copy the head's token here: ~/.ray/auth_token, the file RAY_AUTH_TOKEN_PATH "
            "names, or RAY_AUTH_TOKEN")


def _join_error(address: str | None, e: BaseException) -> str:
    """The one line for a failed ray.init: Ray's first line, or, where the head refused this
    driver's token (Ray retries for about 20 s, then wraps the refusal), that and the hint."""
    where = f"join the Ray cluster at '{address}'" if address else "start a local Ray cluster"
    cause: BaseException | None = e
    while cause is not None:
        if "InvalidAuthToken" in str(cause):
            return f"cannot {where}: the head refused this driver (InvalidAuthToken): " \
                f"{_auth_hint()}"
        cause = cause.__cause__ or cause.__context__
    return f"cannot {where}: {(str(e).strip().splitlines() or [''])[0]}"


def _nodes(ray: Any) -> dict[str, dict[str, Any]]:
    """Alive nodes by id: {'name', 'class' (None: from hardware), 'resources'}."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    names = [n.get("NodeName") or n["NodeManagerAddress"] for n in alive]
    out = {}
    for n, name in zip(alive, names, strict=True):
        res = {k: v for k, v in n.get("Resources", {}).items()  # CPU, GPU, custom ones
               if not k.startswith("node:") and "memory" not in k}
        cls = next((k.removeprefix(CLASS_PREFIX) for k in sorted(res)
                    if k.startswith(CLASS_PREFIX)), None)
        out[n["NodeID"]] = {"name": name if names.count(name) == 1 else
                            f"{name}-{n['NodeID'][:6]}", "class": cls, "resources": res}
    return out


def node_env(node_id: str | None = None) -> dict[str, Any]:
    """This node's environment with its fleet identity under 'node' (cached per process)."""
    ray = _ray()
    node_id = node_id or ray.get_runtime_context().get_node_id()
    if node_id not in _NODE_ENV:
        from kvbench.envinfo import collect_env

        env = collect_env()
        node = _nodes(ray)[node_id]
        node["class"] = node["class"] or machine_class(env)
        node["id"] = node_id
        salt = f"{env['env_id']}/{node['name']}/{node['class']}"
        env.update(node=node, env_id=hashlib.sha1(salt.encode()).hexdigest()[:12])
        _NODE_ENV[node_id] = env
    return _NODE_ENV[node_id]


def _use_all_cores() -> None:
    """Ray sets OMP_NUM_THREADS to the task's one CPU; a case measures the whole machine:
    torch here and the `kvbench run` child of a strategy case get the machine's default."""
    if os.environ.pop("OMP_NUM_THREADS", None) is not None:
        import psutil
        import torch

        torch.set_num_threads(psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def _info() -> tuple[str, dict[str, Any]]:
    """Run on each node at start: (its kvbench version, its environment)."""
    _use_all_cores()
    return __version__, node_env()


def _task(path: str, text: str, case_id: str, key: str, tracker: Any
          ) -> tuple[dict[str, Any], list[Record]]:
    """One unit on whatever node Ray placed it: (that node's env, the unit's records)."""
    from kvbench.suite_jobs import unit_in

    _use_all_cores()
    env = node_env()
    ray = _ray()
    with contextlib.suppress(ray.exceptions.RayError):  # best effort: it names lost nodes
        ray.get(tracker.started.remote(key, env["node"]["name"]))  # delivered before the case
    return env, execute(unit_in(path, text, case_id), has_gpu())


class _Tracker:
    """Where each unit's attempts started (for the error record of a unit lost twice)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def started(self, key: str, node: str) -> None:
        self.seen.setdefault(key, []).append(node)

    def where(self, key: str) -> list[str]:
        return self.seen.get(key, [])


def _fits(resources: dict[str, float], demand: dict[str, float]) -> bool:
    return all(resources.get(k, 0) >= v for k, v in demand.items())


def _demand(unit: Unit) -> dict[str, float]:
    gpu = {"GPU": 1.0} if unit.case.requires == "gpu" else {}
    return {"CPU": 1.0, **gpu, **unit.case.resources}


class Fleet:
    """A connected Ray cluster: its machines (by node id) and how to run units on them."""

    def __init__(self, ray: Any, on: str | list[str] | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Pin

        from kvbench.envinfo import collect_env

        self.ray, self.on, self.pin = ray, on, Pin
        self.env = collect_env()  # the driver's: for units waived before they could run
        nodes = [i for i, n in _nodes(ray).items() if n["resources"].get("CPU", 0) >= 1]
        if not nodes:
            raise KvbenchError("no node of the Ray cluster has a CPU to run cases on")
        info = ray.get([ray.remote(num_cpus=0)(_info).options(
            scheduling_strategy=Pin(i, soft=False)).remote() for i in nodes])
        for version, env in info:
            if version != __version__:
                raise KvbenchError(f"node {env['node']['name']} runs kvbench {version} but "
                                   f"this driver runs kvbench {__version__}: install the same "
                                   "kvbench on every node")
        self.machines = {env["node"]["name"]: env for _, env in info}
        here = ray.get_runtime_context().get_node_id()
        self.tracker = ray.remote(num_cpus=0)(_Tracker).options(  # restarted if killed
            scheduling_strategy=Pin(here, soft=True), max_restarts=-1,
            max_task_retries=-1).remote()
        ray.get(self.tracker.where.remote(""))  # started before any unit reports to it
        self.run_unit = ray.remote(max_retries=1, retry_exceptions=False)(_task)

    def close(self) -> None:
        self.ray.kill(self.tracker)

    def targets(self) -> list[str] | None:
        """Machine names each unit runs on (fan-out), or None to run each unit once."""
        if not self.on:
            return None
        envs = self.machines.values()
        if self.on in ("all-nodes", "all-gpu-nodes"):
            gpu = self.on == "all-gpu-nodes"
            names = [e["node"]["name"] for e in envs
                     if not gpu or e["node"]["resources"].get("GPU", 0) > 0]
            if not names:
                raise KvbenchError(f"--on {self.on}: no such node in the Ray cluster")
            return sorted(names)
        wanted = self.on.split(",") if isinstance(self.on, str) else list(self.on)
        classes = sorted({e["node"]["class"] for e in envs})
        missing = [c for c in wanted if c not in classes]
        if missing:
            raise KvbenchError(f"no node of machine class {', '.join(missing)} in the Ray "
                               f"cluster (classes here: {', '.join(classes)})")
        return sorted(e["node"]["name"] for e in envs if e["node"]["class"] in wanted)

    def plan(self, todo: list[Unit]) -> list[Unit]:
        """The units to run: each once, or once per target machine."""
        names = self.targets()
        if names is None:
            return todo
        return [Unit(u.case, u.params, u.rep, u.label, name) for u in todo for name in names]

    def _waive(self, unit: Unit) -> str:
        """Why no node can run this unit ('' when one can)."""
        demand = _demand(unit)
        if unit.machine:
            if _fits(self.machines[unit.machine]["node"]["resources"], demand):
                return ""
            return f"machine {unit.machine} lacks resources {demand}"
        if any(_fits(n["resources"], demand) for n in _nodes(self.ray).values()):
            return ""
        return f"no node of the Ray cluster has resources {demand}"

    def run(self, suite: Suite, pending: list[Unit]
            ) -> Iterator[tuple[Unit, list[Record], dict[str, Any] | None, bool]]:
        """Submit every unit, then yield (unit, records, env, False) as each task returns."""
        refs = {}
        for unit in pending:
            why = self._waive(unit)
            if why:
                c = unit.case
                yield unit, [not_measured(c.kind, c.name, "case", "waived", why, unit.params)], \
                    self.machines.get(unit.machine or ""), False
                continue
            demand = _demand(unit)
            opts: dict[str, Any] = {"num_cpus": 1, "num_gpus": demand.get("GPU", 0),
                                    "resources": unit.case.resources}
            if unit.machine:
                node_id = self.machines[unit.machine]["node"]["id"]
                opts["scheduling_strategy"] = self.pin(node_id, soft=False)
            ref = self.run_unit.options(**opts).remote(str(suite.path), suite.text,
                                                       unit.case_id, unit.key, self.tracker)
            refs[ref] = unit
        while refs:
            ready, _ = self.ray.wait(list(refs), num_returns=1)
            unit = refs.pop(ready[0])
            try:
                env, records = self.ray.get(ready[0])
            except self.ray.exceptions.RayError as e:
                env, records = self._lost(unit, e)
            yield unit, records, env, False

    def _lost(self, unit: Unit, e: Exception) -> tuple[dict[str, Any] | None, list[Record]]:
        """The error record of a unit whose task failed: raised outside the case (not
        retried: it would raise again), or its worker or node lost on both attempts."""
        nodes = []
        with contextlib.suppress(self.ray.exceptions.RayError):
            nodes = self.ray.get(self.tracker.where.remote(unit.key))
        nodes = nodes or ([unit.machine] if unit.machine else [])
        where = f"on node(s) {', '.join(nodes) or 'unknown'}"
        cause = getattr(e, "cause", None)
        if isinstance(e, self.ray.exceptions.RayTaskError) and cause is not None:
            why = f"task raised {where}: {type(cause).__name__}: {cause}"
        else:
            first = (str(e).strip().splitlines() or [""])[0]
            why = (f"failed on both attempts (Ray retried it once), {where}: "
                   f"{type(e).__name__}: {first}")
        c = unit.case
        env = self.machines.get(nodes[-1]) if nodes else None
        return env, [not_measured(c.kind, c.name, "case", "error", why, unit.params)]


@contextlib.contextmanager
def connect(address: str | None, on: str | list[str] | None) -> Iterator[Fleet]:
    """Join the cluster at `address` ('auto': the running one; None: start a local one with
    one CPU, so that its cases run one at a time) and yield its Fleet; disconnect after.
    A process already connected to that address (a test session) keeps its connection."""
    ray = _ray()
    if ray.is_initialized() and address in ("auto", ray.get_runtime_context().gcs_address):
        fleet = Fleet(ray, on)
        try:
            yield fleet
        finally:
            fleet.close()
        return
    if address not in (None, "auto"):
        _check_reachable(address)
        enable_token_auth()
    local = {"num_cpus": 1, "include_dashboard": False} if address is None else {}
    try:  # "local": a new cluster even where one is running
        ray.init(address=address or "local", log_to_driver=False, logging_level="ERROR",
                 **local)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise KvbenchError(_join_error(address, e)) from None
    try:
        fleet = Fleet(ray, on)
        yield fleet
        fleet.close()
    finally:
        ray.shutdown()
