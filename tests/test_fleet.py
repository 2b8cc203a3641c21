"""Fleet sweeps on a Ray cluster on this machine, started by docs/fleet.md's commands: two
worker nodes stand in for two machine classes (custom resources class:small + cxl, class:big +
a fake GPU). The cluster starts once for this file; cases are tiny probes. Skipped where
Ray is not installed."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import assert_usage_error, cli

ray = pytest.importorskip("ray")
# one Ray cluster per test session: under pytest-xdist every fleet test runs on one worker
pytestmark = pytest.mark.xdist_group("ray")

from kvbench.cli import main  # noqa: E402
from kvbench.compare import compare_sets, select_env  # noqa: E402
from kvbench.fleet import _join_error, connect, enable_token_auth  # noqa: E402
from kvbench.store import load  # noqa: E402
from kvbench.suite import load_suite, recorded_units, run_suite, units  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BANDWIDTH = '[[case]]\nprobe = "bandwidth"\nparams = { sizes = "64K", quick = true }\n\n'
# what docs/fleet.md's "A cluster on one machine" adds to each `ray start` besides the
# cluster's own --temp-dir: a `--block` process per node, small object stores; and no
# dashboard or usage stats, which the tests do not use
ONE_MACHINE = ["--block", "--object-store-memory", str(80 * 1024 * 1024),
               "--disable-usage-stats"]


def documented() -> list[str]:
    """The command lines of docs/fleet.md's cluster block (comments and blanks dropped)."""
    text = (REPO / "docs" / "fleet.md").read_text()
    block = text.split("<!-- fleet-commands", 1)[1].split("<!-- /fleet-commands -->", 1)[0]
    body = block.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.join(shlex.split(ln, comments=True)) for ln in body.splitlines()
            if shlex.split(ln, comments=True)]


def node_name(argv: list[str]) -> str:
    return argv[argv.index("--node-name") + 1]


DOC = documented()
WORKERS = [c for c in DOC if c.startswith("ray start --address")]
SMALL, BIG = (node_name(shlex.split(w)) for w in WORKERS)  # small-1 (cxl), big-1 (GPU)


def timer(reps: int, calls: int = 200, extra: str = "") -> str:
    return f'[[case]]\nprobe = "timer"\nparams = {{ calls = {calls}, reps = {reps} }}\n{extra}\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DocCluster:
    """docs/fleet.md's cluster, started with its commands on loopback. `head`: its address as
    the documented commands write it (127.0.0.1:PORT); `address`: as Ray names it; `env`: a
    shell's on the head after the documented exports, its HOME a temp dir holding the token
    (~/.ray/auth_token); `procs`: the nodes' `ray start --block` processes, head first."""
    head: str
    address: str
    env: dict[str, str]
    procs: list[subprocess.Popen]

    def typed(self, command: str) -> list[str]:
        """A documented command as it is typed here: HEAD_IP and port 6379 are this cluster's."""
        return shlex.split(command.replace("HEAD_IP:6379", self.head)
                           .replace("--port 6379", f"--port {self.head.rpartition(':')[2]}"))


def _wait(until: Callable[[], bool], what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while not until():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not up; exited: {[p.args for p in dead]}")
        time.sleep(0.2)


def _alive(name: str) -> bool:
    return any(n["Alive"] and n.get("NodeName") == name for n in ray.nodes())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One Ray cluster for this file's tests (stopped after them: an idle cluster's daemons
    would take CPU from the rest of the suite), started by docs/fleet.md's commands as a user types
    them on one machine: the head, then its two worker nodes (two machine classes: small-1
    with class:small + cxl, big-1 with class:big + a fake GPU), each `ray start --block` in
    the background and stopped by SIGTERM to its process (`ray stop` would stop every Ray
    node on the machine). This process joins it as the driver of the in-process tests."""
    home = tmp_path_factory.mktemp("home")
    temp = tempfile.mkdtemp(prefix="kvbray", dir="/tmp")  # short: Ray's socket paths in it
    env = {**os.environ, "HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           # Ray kills its workers when the whole machine's memory is 95% used, whoever
           # uses it: on a shared test machine other processes' memory would fail these tests
           "RAY_memory_monitor_refresh_ms": "0"}
    for command in DOC:
        if command.startswith("export "):
            env.update(kv.split("=", 1) for kv in shlex.split(command)[1:])
    c = DocCluster(f"127.0.0.1:{free_port()}", "", env, [])
    extra = ["--temp-dir", temp, *ONE_MACHINE]
    subprocess.run(c.typed(next(d for d in DOC if d.startswith("ray get-auth-token"))),
                   env=env, check=True, capture_output=True, timeout=120)
    mp = pytest.MonkeyPatch()
    try:
        head = c.typed(next(d for d in DOC if d.startswith("ray start --head")))
        c.procs.append(subprocess.Popen([*head, "--include-dashboard", "false", *extra],
                                        env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
        host, _, port = c.head.rpartition(":")

        def answers() -> bool:
            with contextlib.suppress(OSError):
                socket.create_connection((host, int(port)), timeout=1).close()
                return True
            return False

        _wait(answers, "head", c.procs)
        # this process, the driver of the in-process tests, is given the token's path only
        mp.setenv("RAY_AUTH_TOKEN_PATH", str(home / ".ray" / "auth_token"))
        mp.setenv("RAY_AUTH_MODE", "")  # undo: as it was before the session, set or not
        mp.delenv("RAY_AUTH_MODE")
        enable_token_auth()
        assert os.environ["RAY_AUTH_MODE"] == "token"
        ray.init(address=c.head, log_to_driver=False, logging_level="ERROR")
        c.address = ray.get_runtime_context().gcs_address
        for worker in WORKERS:  # one at a time
            argv = c.typed(worker)
            c.procs.append(subprocess.Popen(argv + extra, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
            name = node_name(argv)
            _wait(lambda name=name: _alive(name), name, c.procs)
        yield c
    finally:
        ray.shutdown()
        for proc in reversed(c.procs):  # workers, then the head
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        for proc in c.procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
        mp.undo()


def write(tmp_path: Path, text: str, head: str = "") -> Path:
    path = tmp_path / "s.toml"
    path.write_text(f'[suite]\nname = "f"\noutput = "{tmp_path / "out.jsonl"}"\n{head}\n{text}')
    return path


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def machine_of(rs, rec) -> str:
    return rs.envs[rec["env_id"]]["node"]["name"]


def test_fan_out_streams_every_machine_into_one_file_and_reports_side_by_side(
        cluster, tmp_path, capsys):
    path = write(tmp_path, BANDWIDTH + timer(3, extra="resources = { cxl = 1 }")
                 + timer(4, extra='requires = "gpu"'), head='machines = ["small", "big"]')
    assert run_cli(["suite", "run", str(path), "--ray", cluster.address]) == 0
    rs = load(tmp_path / "out.jsonl")
    # one env line per machine, each the node's own, and every record under its machine's
    assert sorted(e["node"]["name"] for e in rs.envs.values()) == [BIG, SMALL]
    assert {e["node"]["class"] for e in rs.envs.values()} == {"big", "small"}
    # a case times the whole machine, not the one CPU Ray's task asked for (torch's default
    # threads; this process's own may have been set by an earlier test)
    threads = {e["versions"]["torch_threads"] for e in rs.envs.values()}
    assert threads != {1} or os.cpu_count() == 1
    assert all(machine_of(rs, r) == r["method"]["machine"] for r in rs.records)
    suite = load_suite(path)
    assert recorded_units(tmp_path / "out.jsonl") == {f"{u.case_id}@{m}" for u in units(suite)
                                                      for m in (SMALL, BIG)}
    cases = {(r["params"].get("reps"), r["method"]["machine"]): r for r in rs.records
             if r["metric"] == "case"}
    assert "lacks resources" in cases[(3, BIG)]["reason"]  # cxl is on the small machine only
    assert "lacks resources" in cases[(4, SMALL)]["reason"]
    # the fake GPU routes the GPU case to the big machine, where torch finds no CUDA GPU
    assert "requires a CUDA GPU; none on this machine" in cases[(4, BIG)]["reason"]
    assert any(r["metric"] == "native_clock_overhead" and r["status"] == "ok"
               and r["method"]["machine"] == SMALL for r in rs.records)
    peaks = {r["method"]["machine"]: r["value"] for r in rs.records
             if r["metric"] == "peak_bandwidth"}
    assert set(peaks) == {SMALL, BIG} and all(v > 0 for v in peaks.values())

    capsys.readouterr()
    assert run_cli(["report", str(tmp_path / "out.jsonl"), "--format", "markdown"]) == 0
    md = capsys.readouterr().out.split("## Machines side by side\n\n", 1)[1].splitlines()
    assert md[0] == f"| headline | big ({BIG}) | small ({SMALL}) |"
    copy = next(ln for ln in md if ln.startswith("| peak copy"))
    assert copy.endswith(f"| {peaks[BIG]:.3g} GB/s | {peaks[SMALL]:.3g} GB/s |")

    # two machines of one file compared: only each machine's own records, marked
    rows = compare_sets(select_env(rs, "small"), select_env(rs, BIG), 0.05, 0.05,
                        "peak_bandwidth")
    assert len(rows) == 1 and rows[0].base == peaks[SMALL] and rows[0].new == peaks[BIG]
    assert "env differs" in rows[0].marks
    assert run_cli(["compare", str(tmp_path / "out.jsonl"), "--base-env", "small",
                    "--new-env", "big", "--metric", "peak_bandwidth"]) in (0, 1)
    assert_usage_error(cli(["compare", str(tmp_path / "out.jsonl"), "--base-env", "tiny",
                            "--new-env", "big"], capsys), "no environment 'tiny'")


def test_cases_routed_by_resources_once_each(cluster, tmp_path):
    path = write(tmp_path, timer(3, extra="resources = { cxl = 1 }")
                 + timer(4, extra='requires = "gpu"') + timer(5, extra="resources = { tpu = 1 }"))
    with connect(cluster.address, None) as fleet:
        assert run_suite(load_suite(path), tmp_path / "out.jsonl", fleet=fleet) == 0
    rs = load(tmp_path / "out.jsonl")
    reps = {u.case_id: u.params["reps"] for u in units(load_suite(path))}
    where = {reps[r["method"]["suite_case"]]: rs.envs[r["env_id"]].get("node", {}).get("name")
             for r in rs.records}
    assert where == {3: SMALL, 4: BIG, 5: None}  # 5: waived by the driver, on no node
    tpu = next(r for r in rs.records if reps[r["method"]["suite_case"]] == 5)
    assert tpu["status"] == "waived" and "no node of the Ray cluster has resources" in \
        tpu["reason"]
    assert Counter(reps[r["method"]["suite_case"]] for r in rs.records
                   if r["metric"] == "case") == {4: 1, 5: 1}  # once each, not per machine


def test_resume_after_the_driver_is_killed(cluster, tmp_path):
    path = write(tmp_path, timer(6, calls=100000, extra="repetitions = 12"))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "suite", "run", str(path),
                             "--ray", cluster.address, "--on", "all-nodes"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(recorded_units(out)) < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    _, err = proc.communicate(timeout=30)
    before = recorded_units(out)
    assert 3 <= len(before) < 24, err.decode()[-2000:]
    with connect(cluster.address, "all-nodes") as fleet:
        assert run_suite(load_suite(path), out, resume=True, fleet=fleet) == 0
    rs = load(out)
    per_pair = Counter((r["method"]["suite_case"], machine_of(rs, r)) for r in rs.records)
    # whole, exactly once: every (unit, machine) has one timer run's records
    assert len(per_pair) == 24 and len(set(per_pair.values())) == 1


def _kill_task_workers(times: int, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the worker process running a kvbench unit (a child of this test's cluster),
    `times` times, each time once the retry has started."""
    me = os.getpid()
    while len(killed) < times and not stop.is_set():
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if "ray::_task" in " ".join(p.info["cmdline"] or []) and p.pid not in killed \
                        and any(q.pid == me for q in p.parents()):
                    time.sleep(1.0)  # mid-case: the unit has started measuring
                    p.kill()
                    killed.append(p.pid)
                    break
            except psutil.Error:
                continue
        time.sleep(0.05)


@pytest.mark.parametrize("kills", [1, 2])
def test_worker_killed_mid_case(cluster, tmp_path, kills):
    """Killed once: Ray runs the unit again and its records arrive whole. Killed twice: the
    unit's error record names the machine and the reason, and resume runs it again."""
    path = write(tmp_path, timer(20, calls=400000, extra="resources = { cxl = 1 }"))
    out = tmp_path / "out.jsonl"
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_task_workers, args=(kills, killed, stop))
    killer.start()
    try:
        with connect(cluster.address, None) as fleet:
            errors = run_suite(load_suite(path), out, fleet=fleet)
    finally:
        stop.set()
        killer.join()
    assert len(killed) == kills
    recs = load(out).records
    if kills == 1:
        assert errors == 0 and {r["status"] for r in recs} <= {"ok", "waived"}
        assert Counter(r["metric"] for r in recs)["native_clock_overhead"] == 1
        return
    assert errors == 1 and [r["status"] for r in recs] == ["error"]
    assert SMALL in recs[0]["reason"] and "both attempts" in recs[0]["reason"]
    assert recorded_units(out) == set()


def test_bad_input_exits_2(cluster, tmp_path, capsys, monkeypatch):
    path = write(tmp_path, timer(3))
    start = time.monotonic()
    line = assert_usage_error(cli(["suite", "run", str(path), "--ray", "127.0.0.1:9"], capsys))
    assert time.monotonic() - start < 10
    assert line.startswith("kvbench: error: no Ray cluster answers at '127.0.0.1:9'")
    assert_usage_error(cli(["suite", "run", str(path), "--on", "all-nodes"], capsys),
                       "add --ray")
    assert_usage_error(cli(["suite", "run", str(path), "--ray", "--jobs", "2"], capsys),
                       "--jobs is for one machine")
    assert_usage_error(cli(["suite", "run", str(path), "--ray", cluster.address, "--on",
                            "tiny"], capsys), "no node of machine class tiny")
    monkeypatch.setattr("kvbench.fleet.__version__", "9.9.9")
    assert_usage_error(cli(["suite", "run", str(path), "--ray", cluster.address], capsys),
                       "runs kvbench 0.1.0 but this driver runs kvbench 9.9.9")
    assert not (tmp_path / "out.jsonl").exists()


def test_local_cluster_without_address(tmp_path):
    """`--ray` alone starts a local one-CPU cluster for the run (in a fresh process: this
    session's driver is connected to the test cluster)."""
    path = write(tmp_path, timer(3))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "suite", "run", str(path),
                           "--ray"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    envs = [ln["env"] for ln in lines if ln["kind"] == "env"]
    assert len(envs) == 1 and envs[0]["node"]["resources"]["CPU"] == 1
    assert {ln["env_id"] for ln in lines if ln["kind"] == "probe"} == {envs[0]["env_id"]}


def test_documented_driver_joins_with_the_token_alone(cluster, tmp_path):
    """docs/fleet.md's driver commands as typed, against the cluster its commands started: the
    driver, another process, holds the head's token (~/.ray/auth_token) but no RAY_AUTH_MODE;
    a two-case suite runs on both worker machines into one file, and report and compare
    read it."""
    path = write(tmp_path, timer(3) + timer(4))
    out = tmp_path / "fleet.jsonl"
    run, report, compare = (cluster.typed(d.replace("suites/smoke.toml", str(path))
                                          .replace("results/fleet.jsonl", str(out)))
                            for d in DOC if d.startswith("kvbench "))
    env = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rs = load(out)
    assert sorted(e["node"]["name"] for e in rs.envs.values()) == [BIG, SMALL]
    assert Counter(r["method"]["machine"] for r in rs.records
                   if r["metric"] == "native_clock_overhead") == {SMALL: 2, BIG: 2}
    assert run_cli(report[1:]) == 0
    assert run_cli(compare[1:]) in (0, 1)


def test_a_refused_driver_is_told_what_token_auth_needs(monkeypatch):
    """Ray wraps the head's refusal of a driver's token in its own errors after about 20 s
    of retries: the one line names it and the token's places, or RAY_AUTH_MODE when it is
    set to something else here; any other failure keeps Ray's first line."""
    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback\n"
                               "AuthenticationError: RPC error: InvalidAuthToken: missing")
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") \
                from inner
    except ConnectionError as e:
        refused = e
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert _join_error("10.0.0.1:6379", refused) == (
        "cannot join the Ray cluster at '10.0.0.1:6379': the head refused this driver "
        "(InvalidAuthToken): copy the head's token here: ~/.ray/auth_token, the file "
        "RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert _join_error("10.0.0.1:6379", refused).endswith(
        "(InvalidAuthToken): RAY_AUTH_MODE is disabled here; set RAY_AUTH_MODE=token")
    assert _join_error(None, RuntimeError("no room\nmore")) == \
        "cannot start a local Ray cluster: no room"
