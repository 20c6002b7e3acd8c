"""The fleet scenario runner behind ``scripts/fleet`` (read docs/fleet.md).

Starts, all on 127.0.0.1: the sick upstream (fleet/upstream.mjs), a fleet of
callers in Python and TypeScript (fleet/caller.py, fleet/caller.mjs, using
the project's clients), redis-server and 1-3 retryd replicas, and plays a
fault schedule against each strategy in turn with the same callers, rates
and seeds. Every phase uses a budget upstream of its own (``pay-N``), so a
phase starts from the configured initial tokens whatever came before.

Run through scripts/fleet, which prepares the clients and the venv this runs
in (it imports the Python client for the kill switch).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import math
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import svg  # noqa: E402

BUCKET_MS = 250  # fleet/upstream.mjs counts in the same buckets
DEADLINE_S = 1.5  # every caller's deadline for one logical call, all attempts included
ATTEMPT_TIMEOUT_S = 0.4  # per attempt; the latency fault holds responses well beyond it
LATENCY_DELAY_MS = 1500
# retryd's budget for each phase's upstream: the same 20% + 10/s the
# per-client budgets get, but once for the whole fleet.
REPORT_BUDGET = {"capacity": 50.0, "initial": 50.0, "ratio": 0.2, "min_per_second": 10.0}
# The short test uses retryd's default ratio and floor and a small capacity,
# so that what the callers ask for is well above the bound: a budget that was
# not shared by the replicas (each its own) or not enforced would exceed it.
CHECK_BUDGET = {"capacity": 20.0, "initial": 20.0, "ratio": 0.1, "min_per_second": 1.0}
BUDGET = dict(REPORT_BUDGET)
# retryd's own defaults (README, Configuration): the adaptive scenarios
# measure the budget as shipped.
DEFAULT_BUDGET = {"capacity": 100.0, "initial": 100.0, "ratio": 0.1, "min_per_second": 1.0}
BUDGET_KEYS = ("capacity", "initial", "ratio", "min_per_second")
# Amplification "after the fault's first seconds": the tokens a full bucket
# holds when the fault begins are spent in them, whatever the rule.
SETTLE_S = 2.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------- processes

_children: list[subprocess.Popen[bytes]] = []
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a child is killed if this runner dies without
    # cleaning up (SIGKILL, a crash), so no scenario process outlives it.
    _libc.prctl(1, signal.SIGKILL)


def cleanup() -> None:
    for child in _children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + 5
    for child in _children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


atexit.register(cleanup)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class Proc:
    """A child process whose stdout lines are read into a queue."""

    def __init__(self, name: str, argv: list[str], log_dir: str, stdin: bool = False, env: Optional[dict[str, str]] = None):
        self.name = name
        self.stderr_path = os.path.join(log_dir, f"{name}.log")
        self.stderr = open(self.stderr_path, "ab")
        try:
            self.popen = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                preexec_fn=_die_with_parent, env=env,
            )
        except FileNotFoundError as error:
            raise SystemExit(f"fleet: cannot run {argv[0]}: {error}") from None
        _children.append(self.popen)
        self.lines: queue.Queue[Optional[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def expect(self, predicate: Any, timeout: float) -> str:
        """Waits for a stdout line that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name}: no expected output within {timeout:.0f}s; see {self.stderr_path}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.popen.wait()}) early; see {self.stderr_path}:\n"
                                   + tail(self.stderr_path))
            if predicate(line):
                return line

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((line + "\n").encode())
        self.popen.stdin.flush()

    def cpu_s(self) -> float:
        """User + system CPU seconds so far, from /proc (0 once it is gone)."""
        try:
            with open(f"/proc/{self.popen.pid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, IndexError):
            return 0.0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to anyone."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(file.readlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def http_json(url: str, body: Optional[dict[str, Any]] = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$')


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text from retryd's /metrics, keyed by (name, labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or "")))
        try:
            out[(match.group(1), labels)] = float(match.group(4))
        except ValueError:
            pass
    return out


# -------------------------------------------------------------- deployments


@dataclass
class Deployment:
    """redis-server (if any) and the retryd replicas of one store setup."""

    kind: str  # memory | redis
    mode: str  # exact | leased (redis only)
    replicas: int
    log_dir: str
    retryd_bin: str
    upstreams: list[str]
    redis: Optional[Proc] = None
    redis_port: int = 0
    servers: list[Optional[Proc]] = field(default_factory=list)
    addresses: list[dict[str, str]] = field(default_factory=list)
    # CPU of processes that were killed or replaced, kept for the phase's account.
    lost_cpu: dict[str, float] = field(default_factory=dict)
    # Every upstream's budget; None: the run's BUDGET.
    budget: Optional[dict[str, float]] = None
    # Upstreams with a policy of their own: budget keys over `budget`, and
    # `max_attempts`.
    policies: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.mode}-{self.replicas}" if self.kind == "redis" else f"memory-{self.replicas}"

    def start(self) -> None:
        if self.kind == "redis":
            self.redis_port = free_port()
            self.start_redis()
        self.servers = [None] * self.replicas
        self.addresses = [{}] * self.replicas
        for index in range(self.replicas):
            self.start_replica(index)

    def start_redis(self) -> None:
        # Never the shared 6379: a free port, no persistence, as the test kit does.
        self.redis = Proc("redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--protected-mode", "no", "--dir", self.log_dir],
                          self.log_dir)
        wait_until(lambda: redis_ping(self.redis_port) or not self.redis.alive(), 10, "redis-server to answer PING")
        if not self.redis.alive():
            raise RuntimeError("redis-server exited at start:\n" + tail(self.redis.stderr_path))

    def config(self) -> str:
        lines = ['[server]', 'listen = "127.0.0.1:0"', 'metrics_listen = "127.0.0.1:0"', '',
                 '[telemetry]', 'log_level = "warn"', '', '[store]', f'kind = "{self.kind}"']
        if self.kind == "redis":
            lines += [f'url = "redis://127.0.0.1:{self.redis_port}"', f'mode = "{self.mode}"',
                      f'key_prefix = "fleet-{os.getpid()}"']
        for upstream in self.upstreams:
            own = dict(self.policies.get(upstream, {}))
            attempts = own.pop("max_attempts", None)
            adaptive = own.pop("adaptive", None)
            budget = ", ".join(f"{key} = {value}" for key, value in dict(self.budget or BUDGET, **own).items())
            lines += ['', f'[upstreams."{upstream}"]']
            if attempts is not None:
                lines.append(f'max_attempts = {int(attempts)}')
            if adaptive is not None:
                lines.append(f'adaptive = {"true" if adaptive else "false"}')
            lines.append(f'budget = {{ {budget} }}')
        return "\n".join(lines) + "\n"

    def start_replica(self, index: int) -> None:
        path = os.path.join(self.log_dir, f"retryd-{self.key}.toml")
        with open(path, "w") as file:
            file.write(self.config())
        name = f"retryd-{self.key}-{index}"
        proc = Proc(name, [self.retryd_bin, "serve", "--config", path], self.log_dir)
        line = proc.expect(lambda text: text.startswith("{") and '"grpc"' in text, 60)
        self.servers[index] = proc
        self.addresses[index] = json.loads(line)

    def heal(self) -> None:
        """Restarts whatever a phase killed, so the next phase starts whole."""
        if self.redis is not None and not self.redis.alive():
            self.start_redis()
        for index, proc in enumerate(self.servers):
            if proc is None or not proc.alive():
                self.start_replica(index)

    def target(self, caller: int) -> str:
        """Caller ``caller``'s retryd target: every replica, starting from a
        different one per caller (gRPC's pick_first then spreads the callers
        and fails over to the next replica when one dies)."""
        grpc = [a["grpc"] for a in self.addresses]
        if len(grpc) == 1:
            return grpc[0]
        start = caller % len(grpc)
        return "ipv4:" + ",".join(grpc[start:] + grpc[:start])

    def cpu(self) -> dict[str, float]:
        out = {}
        if self.redis is not None:
            out["redis"] = self.redis.cpu_s()
        out["retryd"] = sum(p.cpu_s() for p in self.servers if p is not None)
        return out

    def metrics(self) -> list[dict[Any, float]]:
        scraped = []
        for proc, address in zip(self.servers, self.addresses):
            if proc is not None and proc.alive():
                scraped.append(scrape(address["metrics"]))
        return scraped

    def stop(self) -> None:
        for proc in self.servers:
            if proc is not None:
                proc.stop()
        if self.redis is not None:
            self.redis.stop()


# ------------------------------------------------------------------- phases


@dataclass
class Phase:
    scenario: str
    strategy: str  # none | naive | local | retryd
    callers: int
    deployment: str  # deployment key
    fault: dict[str, Any]
    event: Optional[str] = None  # kill-replica | kill-redis | kill-switch, at mid-fault
    label: str = ""
    upstream: str = ""
    keyed: bool = False  # charges to POST /keyed-charges, declared IDEMPOTENT_WITH_KEY
    fault_s: Optional[float] = None  # this phase's fault length; None: --fault
    # The upstream's policy in retryd: budget keys over the run's BUDGET, and
    # `adaptive` (unset: retryd's default, on).
    policy: dict[str, Any] = field(default_factory=dict)

    def title(self) -> str:
        return self.label or self.strategy

    def budget(self) -> dict[str, float]:
        """The bucket retryd gives this phase's upstream."""
        return dict(BUDGET, **{key: value for key, value in self.policy.items() if key in BUDGET_KEYS})


def plan(args: argparse.Namespace) -> list[Phase]:
    outage = {"mode": "outage"}
    partial = {"mode": "partial", "p": 0.3}
    latency = {"mode": "latency", "delay_ms": LATENCY_DELAY_MS}
    exact2 = "redis-exact-2"
    baselines = ["none", "naive", "local", "retryd"]
    n = args.callers
    scenarios: dict[str, list[Phase]] = {
        # Three fleet sizes at the same total rate: per-client budgets grow
        # with the number of clients, a shared one does not.
        "outage": [Phase("outage", s, size, exact2, outage, label=f"{s}, {size} callers")
                   for size in (n, 2 * n, 4 * n) for s in baselines if not (s == "none" and size == 4 * n)],
        "partial": [Phase("partial", s, n, exact2, partial) for s in baselines],
        "latency": [Phase("latency", s, n, exact2, latency) for s in baselines],
        "stores": [Phase("stores", "naive", n, exact2, outage, label="naive"),
                   Phase("stores", "retryd", n, "memory-1", outage, label="retryd, memory, 1 replica"),
                   Phase("stores", "retryd", n, exact2, outage, label="retryd, Redis exact, 2 replicas"),
                   Phase("stores", "retryd", n, "redis-leased-3", outage, label="retryd, Redis leased, 3 replicas")],
        "replica-kill": [Phase("replica-kill", "naive", n, exact2, outage, label="naive"),
                         Phase("replica-kill", "retryd", n, exact2, outage, "kill-replica",
                               label="retryd, a replica killed")],
        "redis-kill": [Phase("redis-kill", "naive", n, exact2, outage, label="naive"),
                       Phase("redis-kill", "retryd", n, exact2, outage, "kill-redis", label="retryd exact, Redis killed"),
                       Phase("redis-kill", "retryd", n, "redis-leased-2", outage, "kill-redis",
                             label="retryd leased, Redis killed")],
        "kill-switch": [Phase("kill-switch", "naive", n, exact2, outage, label="naive"),
                        Phase("kill-switch", "retryd", n, exact2, outage, label="retryd"),
                        Phase("kill-switch", "retryd", n, exact2, outage, "kill-switch",
                              label="retryd, kill switch at mid-outage")],
        # The same faults against a charge endpoint that honours the key.
        "keyed": [Phase("keyed", s, n, exact2, fault, label=f"{s}, {fault_name(fault)}", keyed=True)
                  for fault in (partial, latency) for s in baselines],
        # Issue 32: the adaptive budget at retryd's defaults, against naive
        # retries and the same budget with `adaptive = false`; same callers
        # and seeds. The outage lasts 20 s; the partial faults the usual
        # --fault. Not part of "all": `scripts/fleet adaptive --update`
        # writes its own section of docs/fleet.md.
        "adaptive": [Phase(f"adaptive-{name}", strategy, n, exact2, fault, label=label, fault_s=fault_s,
                           policy=dict(DEFAULT_BUDGET, **policy))
                     for name, fault, fault_s in (("outage", outage, 20.0),
                                                  ("partial-10", {"mode": "partial", "p": 0.1}, None),
                                                  ("partial-30", partial, None))
                     for strategy, label, policy in (("naive", "naive", {}),
                                                     ("retryd", "retryd, adaptive = false", {"adaptive": False}),
                                                     ("retryd", "retryd, adaptive (default)", {}))],
        "check": [Phase("check", "naive", 2, exact2, outage, label="naive"),
                  Phase("check", "retryd", 2, exact2, outage, label="retryd, Redis exact, 2 replicas")],
    }
    if args.scenario == "all":
        names = [name for name in scenarios if name not in ("check", "adaptive")]
    elif args.scenario in ("layers", "tail"):
        names = []  # run_layers, tail.run: phases of their own, not this plan's
    elif args.scenario in scenarios:
        names = [args.scenario]
    else:
        raise SystemExit(f"fleet: unknown scenario {args.scenario!r}; one of: all, layers, tail, {', '.join(scenarios)}")
    phases = [phase for name in names for phase in scenarios[name]]
    for index, phase in enumerate(phases):
        phase.upstream = f"pay-{index}"
    return phases


def deployment_of(key: str, **kwargs: Any) -> Deployment:
    parts = key.split("-")
    if parts[0] == "memory":
        return Deployment("memory", "", int(parts[1]), **kwargs)
    return Deployment("redis", parts[1], int(parts[2]), **kwargs)


def sum_series(results: list[dict[str, Any]], name: str) -> dict[int, int]:
    total: dict[int, int] = {}
    for result in results:
        for bucket, count in result["series"].get(name, {}).items():
            total[int(bucket)] = total.get(int(bucket), 0) + count
    return total


def metric_sum(scrapes: list[dict[Any, float]], name: str, **match: str) -> float:
    total = 0.0
    for scraped in scrapes:
        for (metric, labels), value in scraped.items():
            if metric == name and all((k, v) in labels for k, v in match.items()):
                total += value
    return total


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_phase(phase: Phase, deployment: Deployment, upstream_url: str, upstream: Proc, args: argparse.Namespace,
              log_dir: str) -> dict[str, Any]:
    warm, fault_s, recover = args.warm, phase.fault_s or args.fault, args.recover
    duration = warm + fault_s + recover
    rate_each = args.rate / phase.callers
    callers = []
    for index in range(phase.callers):
        lang = "python" if index % 2 == 0 else "typescript"
        config = {
            "id": index, "strategy": phase.strategy, "rate": rate_each, "duration_s": duration,
            "upstream_url": upstream_url, "retryd_target": deployment.target(index),
            "retryd_upstream": phase.upstream, "seed": 1000 + index, "bucket_ms": BUCKET_MS,
            "deadline_s": DEADLINE_S, "attempt_timeout_s": ATTEMPT_TIMEOUT_S, "max_in_flight": 500,
            "out": os.path.join(log_dir, f"{phase.upstream}-caller-{index}.json"), "keyed": phase.keyed,
        }
        path = os.path.join(log_dir, f"{phase.upstream}-caller-{index}.config.json")
        with open(path, "w") as file:
            json.dump(config, file)
        argv = ([args.python, os.path.join(HERE, "caller.py"), path] if lang == "python"
                else ["node", os.path.join(HERE, "caller.mjs"), path])
        callers.append((lang, config, Proc(f"{phase.upstream}-caller-{index}-{lang}", argv, log_dir, stdin=True)))
    for _, _, proc in callers:
        proc.expect(lambda line: line == "ready", 120)

    scrape_before = deployment.metrics()
    cpu_before = {**deployment.cpu(), "upstream": upstream.cpu_s()}
    epoch_ms = int(time.time() * 1000) + 300
    http_json(f"{upstream_url}/_control", {"reset_epoch_ms": epoch_ms, "fault": {"mode": "ok"}})
    for _, _, proc in callers:
        proc.send(f"go {epoch_ms}")
    epoch = epoch_ms / 1000

    def at(offset: float) -> None:
        # The schedule itself is wall time: these are the instants faults begin and end.
        delay = epoch + offset - time.time()
        if delay > 0:
            time.sleep(delay)

    events: list[tuple[float, str]] = []
    at(warm)
    http_json(f"{upstream_url}/_control", {"fault": phase.fault})
    fault_began = time.time() - epoch
    start_account = budget_account_start(deployment, phase) if phase.strategy == "retryd" else None
    if phase.event:
        at(warm + fault_s / 2)
        event_at = time.time() - epoch
        if phase.event == "kill-replica":
            victim = deployment.servers[0]
            assert victim is not None
            deployment.lost_cpu["retryd"] = deployment.lost_cpu.get("retryd", 0) + victim.cpu_s()
            victim.kill()
            events.append((event_at, "replica killed"))
        elif phase.event == "kill-redis":
            assert deployment.redis is not None
            deployment.lost_cpu["redis"] = deployment.lost_cpu.get("redis", 0) + deployment.redis.cpu_s()
            deployment.redis.kill()
            events.append((event_at, "Redis killed"))
        elif phase.event == "kill-switch":
            set_retries(deployment, phase.upstream, False)
            events.append((event_at, "retries off"))
    at(warm + fault_s)
    http_json(f"{upstream_url}/_control", {"fault": {"mode": "ok"}})
    fault_ended = time.time() - epoch
    end_account = (time.monotonic(), deployment.metrics()) if start_account is not None else None
    if phase.event == "kill-redis":
        deployment.start_redis()  # same port: the replicas reconnect by themselves
        events.append((time.time() - epoch, "Redis back"))
    elif phase.event == "kill-switch":
        set_retries(deployment, phase.upstream, True)
        events.append((time.time() - epoch, "retries on"))

    for _, _, proc in callers:
        proc.expect(lambda line: line == "done", duration + DEADLINE_S + 60)
    results = []
    for lang, config, proc in callers:
        proc.popen.wait(timeout=30)
        with open(config["out"]) as file:
            results.append(json.load(file))
    elapsed = time.time() - epoch + 0.3  # from just before the first call to after the last report
    scrape_after = deployment.metrics()
    stats = http_json(f"{upstream_url}/_stats")
    cpu_after = {**deployment.cpu(), "upstream": upstream.cpu_s()}
    for part, lost in deployment.lost_cpu.items():
        cpu_after[part] = cpu_after.get(part, 0) + lost
    deployment.lost_cpu.clear()
    cpu = {part: cpu_after.get(part, 0) - cpu_before.get(part, 0) for part in cpu_after}
    for lang in ("python", "typescript"):
        cpu[f"callers ({lang})"] = sum(r["cpu_s"] for r in results if r["lang"] == lang)

    row = summarise(phase, results, stats, scrape_before, scrape_after, cpu, elapsed, duration,
                    (fault_began, fault_ended), events, deployment, warm)
    if start_account is not None and end_account is not None:
        row["budget"]["fault"] = budget_account(phase, deployment, start_account, end_account)
    return row


def budget_account_start(deployment: Deployment, phase: Phase) -> dict[str, Any]:
    """What the fleet-wide bound over the fault needs at its start, in an
    order that can only loosen it: a scrape (for deposits and the clock),
    the tokens left (RetryAdmin/GetBudget, fleet-wide on Redis), a second
    scrape (for the RETRY verdicts, so none spent before the tokens were
    read is counted)."""
    from retryd import Client

    first = (time.monotonic(), deployment.metrics())
    # A replica that believes Redis down (one store call slower than
    # store.timeout on this busy machine is enough, for 150 ms) answers
    # GetBudget from its local bucket, which reads 0 tokens, not the fleet's
    # level. So wait (briefly) until every replica has the store, and take the
    # highest answer: a larger "left" only loosens the bound.
    def store_up() -> bool:
        return all(scraped.get(("retryd_store_available", ()), 1.0) == 1.0 for scraped in deployment.metrics())

    deadline = time.monotonic() + 3
    while not store_up() and time.monotonic() < deadline:
        time.sleep(0.02)
    store_available = store_up()
    answers = []
    for proc, address in zip(deployment.servers, deployment.addresses):
        if proc is not None and proc.alive():
            client = Client(address["grpc"], timeout=2.0)
            try:
                answers.append(client.get_budget(phase.upstream).tokens)
            finally:
                client.close()
    return {"t": first[0], "deposits": first[1], "left": max(answers), "left_per_replica": answers,
            "store_available": store_available, "spent": deployment.metrics()}


def budget_account(phase: Phase, deployment: Deployment, start: dict[str, Any],
                   end: tuple[float, list[dict[Any, float]]]) -> dict[str, Any]:
    """The issue's bound over the fault window, from retryd's own counters:
    retries granted ≤ what was left + ratio × reported first attempts + floor × duration."""
    t_end, scraped = end
    granted = (metric_sum(scraped, "retryd_decisions_total", upstream=phase.upstream, verdict="retry")
               - metric_sum(start["spent"], "retryd_decisions_total", upstream=phase.upstream, verdict="retry"))
    reported = (metric_sum(scraped, "retryd_reported_requests_total")
                - metric_sum(start["deposits"], "retryd_reported_requests_total"))
    seconds = t_end - start["t"]
    budget = phase.budget()
    bound = start["left"] + budget["ratio"] * reported + budget["min_per_second"] * seconds
    return {"granted": granted, "left": start["left"], "left_per_replica": start["left_per_replica"],
            "store_available_at_start": start["store_available"],
            "reported": reported, "seconds": seconds, "bound": bound,
            # One token of slack: a RETRY's counter is incremented just after
            # its withdrawal, so a grant made as the tokens were read may be
            # counted on both sides of the start.
            "holds": granted <= bound + 1.0,
            "all_replicas_counted": len(scraped) == deployment.replicas == len(start["spent"])}


def set_retries(deployment: Deployment, upstream: str, enabled: bool) -> None:
    """The incident lever, RetryAdmin/SetRetriesEnabled, through the Python client."""
    from retryd import Client

    for proc, address in zip(deployment.servers, deployment.addresses):
        if proc is not None and proc.alive():
            client = Client(address["grpc"], timeout=2.0)
            try:
                client.set_retries_enabled(upstream, enabled, reason="fleet scenario: upstream in outage")
            finally:
                client.close()
            return  # fleet-wide through Redis: one replica is enough
    raise RuntimeError("no live replica for the kill switch")


def summarise(phase: Phase, results: list[dict[str, Any]], stats: dict[str, Any], before: list[dict[Any, float]],
              after: list[dict[Any, float]], cpu: dict[str, float], elapsed: float, duration: float,
              window: tuple[float, float], events: list[tuple[float, str]], deployment: Deployment,
              warm: float) -> dict[str, Any]:
    bucket_s = BUCKET_MS / 1000
    upstream_series = {int(row["bucket"]): row["requests"] for row in stats["series"]}
    first = sum_series(results, "first")
    attempts = sum_series(results, "attempts")
    lo, hi = int(window[0] / bucket_s), int(window[1] / bucket_s)
    in_fault = range(lo, hi)
    fault_first = sum(first.get(b, 0) for b in in_fault)
    fault_upstream = sum(upstream_series.get(b, 0) for b in in_fault)
    # The fault after its first SETTLE_S, and the second after it ends
    # against the healthy warm-up's first attempts (the recovery wave).
    settled = range(lo + int(SETTLE_S / bucket_s), hi)
    settled_first = sum(first.get(b, 0) for b in settled)
    settled_upstream = sum(upstream_series.get(b, 0) for b in settled)
    warm_buckets = range(int(1 / bucket_s), int(warm / bucket_s))
    steady_rps = (sum(upstream_series.get(b, 0) for b in warm_buckets) / (len(warm_buckets) * bucket_s)
                  if warm_buckets else None)
    after_fault = range(hi, hi + int(1 / bucket_s))
    recovery_peak_rps = max((upstream_series.get(b, 0) for b in after_fault), default=0) / bucket_s
    outcomes = {name: sum(sum_series(results, name).values()) for name in ("ok", "failed", "ambiguous", "shed")}
    get_first, get_ok = sum_series(results, "get_first"), sum_series(results, "get_ok")
    fault_get_first = sum(get_first.get(b, 0) for b in in_fault)
    fault_get_ok = sum(get_ok.get(b, 0) for b in in_fault)
    fault_outcomes = {name: sum(sum_series(results, name).get(b, 0) for b in in_fault)
                      for name in ("ok", "failed", "ambiguous", "shed")}
    arrivals = sum(r["arrivals"] for r in results)
    decisions: dict[str, int] = {}
    for result in results:
        for label, count in result["decisions"].items():
            decisions[label] = decisions.get(label, 0) + count
    decide_ms = [v for r in results for v in r["decide_ms"]]
    by_lang: dict[str, dict[str, int]] = {}
    for result in results:
        mine = by_lang.setdefault(result["lang"], {"arrivals": 0, "decisions": 0})
        mine["arrivals"] += result["arrivals"]
        mine["decisions"] += sum(result["decisions"].values())
    call_ms = [v for r in results for v in r["call_ms"]]
    summary: dict[str, Any] = {
        "scenario": phase.scenario, "strategy": phase.strategy, "label": phase.title(), "callers": phase.callers,
        "deployment": deployment.key if phase.strategy == "retryd" else "-", "upstream": phase.upstream,
        "fault": phase.fault, "event": phase.event, "window": window, "events": events, "duration_s": duration,
        "arrivals": arrivals, "first_attempts_in_fault": fault_first, "upstream_requests_in_fault": fault_upstream,
        "amplification": fault_upstream / fault_first if fault_first else None,
        "amplification_settled": settled_upstream / settled_first if settled_first else None,
        "steady_rps": steady_rps, "recovery_peak_rps": recovery_peak_rps,
        "recovery_peak_ratio": recovery_peak_rps / steady_rps if steady_rps else None,
        "upstream_requests": stats["totals"]["requests"], "attempts_sent": sum(attempts.values()),
        "outcomes": outcomes, "fault_outcomes": fault_outcomes,
        "success_rate": outcomes["ok"] / arrivals if arrivals else None,
        "fault_success_rate": fault_outcomes["ok"] / fault_first if fault_first else None,
        # The idempotent calls (GETs) alone: the charges are NON_IDEMPOTENT,
        # so a failed one is AMBIGUOUS under retryd, whatever its budget.
        "fault_idempotent_success_rate": fault_get_ok / fault_get_first if fault_get_first else None,
        "duplicates": stats["totals"]["duplicates"], "charges_applied": stats["totals"]["applied"],
        "replays": stats["totals"]["replays"], "keyed": phase.keyed,
        # Payments the upstream took while their caller was told the call
        # failed (not AMBIGUOUS): nobody will reconcile these.
        "charged_but_told_failed": len(set(stats["applied_keys"]) & {key for r in results for key in r["failed_charge_keys"]}),
        "decisions": decisions, "by_language": by_lang,
        "decide_ms": {"n": len(decide_ms), "p50": percentile(decide_ms, 0.5), "p99": percentile(decide_ms, 0.99),
                      "max": max(decide_ms) if decide_ms else None},
        "call_ms_ok": {"p50": percentile(call_ms, 0.5), "p99": percentile(call_ms, 0.99)},
        "cpu_s": cpu, "elapsed_s": elapsed,
        "reporter_dropped": sum(r["reporter_dropped"] or 0 for r in results),
        "unfinished": sum(r["unfinished"] for r in results),
        "series": {
            "t": [b * bucket_s for b in range(0, int(duration / bucket_s) + 1)],
            "upstream_rps": [upstream_series.get(b, 0) / bucket_s for b in range(0, int(duration / bucket_s) + 1)],
            "first_rps": [first.get(b, 0) / bucket_s for b in range(0, int(duration / bucket_s) + 1)],
        },
    }
    if phase.strategy == "retryd":
        # Fleet-wide, from every replica's counters (a killed replica's are lost,
        # so the bound is checked only where all replicas lived).
        # Deposits and withdrawals are counted per process, not per upstream:
        # one phase runs at a time and only its retryd callers report, so the
        # deltas over the phase are this phase's. Granted retries per upstream
        # are its RETRY verdicts (each withdrew one token).
        def delta(name: str, **match: str) -> float:
            return metric_sum(after, name, **match) - metric_sum(before, name, **match)

        granted_metric = delta("retryd_decisions_total", upstream=phase.upstream, verdict="retry")
        withdrawals = delta("retryd_budget_withdrawals_total")
        reported = delta("retryd_reported_requests_total")
        granted_seen = sum(count for label, count in decisions.items() if label == "RETRY")
        granted = max(granted_metric, withdrawals, granted_seen)
        budget = phase.budget()
        bound = budget["initial"] + budget["ratio"] * reported + budget["min_per_second"] * elapsed
        summary["budget"] = {
            "granted_metric": granted_metric, "withdrawals": withdrawals, "granted_seen_by_callers": granted_seen, "granted": granted,
            "reported": reported, "initial": budget["initial"], "ratio": budget["ratio"],
            "floor_per_s": budget["min_per_second"], "elapsed_s": elapsed, "bound": bound,
            "holds": granted <= bound, "all_replicas_counted": len(after) == deployment.replicas,
            "fallback_retries": sum(c for label, c in decisions.items() if label == "fallback RETRY"),
            "denied_budget": decisions.get("DENY:BUDGET_EXHAUSTED", 0),
        }
    return summary


# ------------------------------------------------------------------ layers
#
# Issue 31's judge: a call chain of real processes, edge → middle → back →
# the sick upstream, each tier on the project's clients inbound and
# outbound (fleet/tier.mjs, fleet/tier.py), and five strategies in one run.

LAYERS_RATE = 20.0  # first requests/s at the edges, both together
LAYERS_WARM_S = 2.0
LAYERS_FAULT_S = {"outage": 4.0, "partial": 10.0, "latency": 4.0}
# Close to retryd's defaults (ratio 0.2 here, floor 1/s) with a small
# capacity: at these rates a floor of 10/s or a capacity of 50 would be most
# of the bound, and "one hop's 1 + ratio" would not be what is measured.
LAYERS_BUDGET = {"capacity": 10.0, "initial": 10.0, "ratio": 0.2, "min_per_second": 1.0}
# (attempt timeout, deadline) per tier. They nest: a tier's attempt timeout
# outlasts the whole call of the tier below, as deadline propagation gives:
# its deadline, plus one wait for a decision after it (the clients' 200 ms
# decide timeout), plus 0.2 s for a busy machine. So a layer above hears the
# layer below's answer (a 503/504, marked with lineage) rather than timing
# out itself. Without that margin (0.1 s in a first version) a debug retryd
# on 2 busy cores made the middles time out, unmarked, and retry.
LAYER_TIMEOUTS = {"edge": (3.9, 12.2), "middle": (1.0, 3.4), "back": (0.15, 0.6)}
# (label, strategy, lineage, nearest): `nearest` gives the hop nearest the
# failure (the backs' upstream) NEAREST_POLICY. With lineage it is the only
# hop that still retries, so the chain's retry budget belongs there; the
# fifth row measures that, beside the same four with every hop alike.
LAYER_STRATEGIES = [("naive", "naive", False, False), ("local", "local", False, False),
                    ("retryd, no lineage", "retryd", False, False), ("retryd, lineage", "retryd", True, False),
                    ("retryd, lineage, budget at the nearest hop", "retryd", True, True)]
# A 30% fault asks 0.3 + 0.09 + 0.027 retries per request of the one
# retrying hop; 4 attempts leave 0.3^4 = 0.8% failed.
NEAREST_POLICY = {"ratio": 0.5, "max_attempts": 4}
# Two chains, every hop between two languages, so that both clients serve
# every role (inbound middleware, outbound adapter, the back's retries):
#   edge-0 (TypeScript) → middle-1 (Python) → back-0 (TypeScript) → upstream
#   edge-1 (Python) → middle-0 (TypeScript) → back-1 (Python) → upstream
# The budgets are per hop: both backs share the upstream's, both middles the back's.
LAYER_LANGS = {"edge-0": "typescript", "edge-1": "python", "middle-0": "typescript", "middle-1": "python",
               "back-0": "typescript", "back-1": "python"}
LAYER_DOWNSTREAM = {"edge-0": "middle-1", "edge-1": "middle-0", "middle-0": "back-1", "middle-1": "back-0"}


def python_tiers_supported(python: str) -> bool:
    """Whether the installed Python client has the lineage middleware (and uvicorn to serve it)."""
    return subprocess.run([python, "-c", "import retryd.asgi, uvicorn"], capture_output=True).returncode == 0


def layer_faults() -> list[dict[str, Any]]:
    return [{"mode": "outage"}, {"mode": "partial", "p": 0.3}, {"mode": "latency", "delay_ms": LATENCY_DELAY_MS}]


def layer_argv(args: argparse.Namespace, lang: str, path: str) -> list[str]:
    return ([args.python, os.path.join(HERE, "tier.py"), path] if lang == "python"
            else ["node", os.path.join(HERE, "tier.mjs"), path])


def run_layers_phase(index: int, label: str, strategy: str, lineage: bool, fault: dict[str, Any], fault_s: float,
                     deployment: Deployment, upstream_url: str, args: argparse.Namespace, log_dir: str,
                     langs: dict[str, str], hop_budget: dict[str, float]) -> dict[str, Any]:
    base = f"layers-{index}"
    warm = LAYERS_WARM_S
    services: dict[str, tuple[Proc, str]] = {}

    def tier_config(name: str, role: str, layer: str, downstream: str, retryd_upstream: str, seed: int) -> dict[str, Any]:
        attempt_timeout, deadline = LAYER_TIMEOUTS[layer]
        return {"id": seed, "role": role, "layer": layer, "strategy": strategy, "lineage": lineage,
                "downstream_url": downstream, "retryd_target": deployment.target(seed),
                "retryd_upstream": retryd_upstream, "seed": 2000 + seed, "attempt_timeout_s": attempt_timeout,
                "deadline_s": deadline, "out": os.path.join(log_dir, f"{base}-{name}.json")}

    def start_service(name: str, layer: str, downstream: str, retryd_upstream: str, seed: int) -> str:
        config = tier_config(name, "service", layer, downstream, retryd_upstream, seed)
        path = os.path.join(log_dir, f"{base}-{name}.config.json")
        with open(path, "w") as file:
            json.dump(config, file)
        proc = Proc(f"{base}-{name}-{langs[name]}", layer_argv(args, langs[name], path), log_dir)
        port = json.loads(proc.expect(lambda line: line.startswith("{"), 120))["port"]
        url = f"http://127.0.0.1:{port}"
        services[name] = (proc, url)
        return url

    try:
        urls = {"upstream": upstream_url}
        for i in range(2):
            urls[f"back-{i}"] = start_service(f"back-{i}", "back", upstream_url, f"{base}-store", i)
        for i in range(2):
            name = f"middle-{i}"
            urls[name] = start_service(name, "middle", urls[LAYER_DOWNSTREAM[name]], f"{base}-back", 2 + i)
        edges = []
        for i in range(2):
            name = f"edge-{i}"
            config = tier_config(name, "edge", "edge", urls[LAYER_DOWNSTREAM[name]], f"{base}-middle", 4 + i)
            config.update({"rate": LAYERS_RATE / 2, "duration_s": warm + fault_s,
                           # A call tagged at the very start could reach the
                           # upstream just before the fault is switched on.
                           "tag_window_s": [warm + 0.1, warm + fault_s]})
            path = os.path.join(log_dir, f"{base}-{name}.config.json")
            with open(path, "w") as file:
                json.dump(config, file)
            edges.append((config, Proc(f"{base}-{name}-{langs[name]}", layer_argv(args, langs[name], path), log_dir,
                                       stdin=True)))
        for _, proc in edges:
            proc.expect(lambda line: line == "ready", 120)
        epoch_ms = int(time.time() * 1000) + 300
        http_json(f"{upstream_url}/_control", {"reset_epoch_ms": epoch_ms, "fault": {"mode": "ok"}})
        for _, proc in edges:
            proc.send(f"go {epoch_ms}")
        epoch = epoch_ms / 1000
        delay = epoch + warm - time.time()
        if delay > 0:
            time.sleep(delay)
        http_json(f"{upstream_url}/_control", {"fault": fault})
        fault_began = time.monotonic()
        # The fault lasts until every tagged call has ended (each is bounded by
        # the edge's deadline), so that none of its attempts meets a healthy
        # upstream.
        edge_deadline = LAYER_TIMEOUTS["edge"][1]
        for _, proc in edges:
            proc.expect(lambda line: line == "done", fault_s + edge_deadline + 60)
        # An edge that gave up at its deadline leaves its last call running
        # below (at most a middle's deadline): the fault stays until the
        # tiers have served everything, so that no tagged attempt meets a
        # healthy upstream.
        wait_until(lambda: all(http_json(f"{url}/_stats")["in_flight"] == 0 for _, url in services.values()),
                   LAYER_TIMEOUTS["middle"][1] + 10, "the tiers to finish their calls")
        fault_lasted = time.monotonic() - fault_began
        http_json(f"{upstream_url}/_control", {"fault": {"mode": "ok"}})
        upstream_stats = http_json(f"{upstream_url}/_stats")
        tiers: dict[str, list[dict[str, Any]]] = {"edge": [], "middle": [], "back": []}
        per_process: dict[str, dict[str, Any]] = {}
        for config, proc in edges:
            proc.popen.wait(timeout=30)
            with open(config["out"]) as file:
                per_process[f"edge-{config['id'] - 4}"] = json.load(file)
        for name, (proc, url) in services.items():
            per_process[name] = http_json(f"{url}/_stats")
        for name, stats in per_process.items():
            tiers[name.split("-")[0]].append(stats)
    finally:
        for proc, _ in services.values():
            proc.stop()

    def tagged(tier: str, name: str) -> int:
        return sum(int(result["counts"].get(name, {}).get("f", 0)) for result in tiers[tier])

    first = tagged("edge", "first")
    arrived = {"middle": tagged("middle", "inbound"), "back": tagged("back", "inbound"),
               "upstream": int(upstream_stats["tagged"].get("f", 0))}
    decisions: dict[str, dict[str, int]] = {}
    for tier, results in tiers.items():
        mine = decisions.setdefault(tier, {})
        for result in results:
            for key, count in result["decisions"].items():
                mine[key] = mine.get(key, 0) + count
    decide_ms = [v for results in tiers.values() for result in results for v in result["decide_ms"]]
    # One hop's bound over this fault: the first requests, plus the budget's
    # ratio of them, plus what the capacity and the floor add over the
    # fault's duration, divided by the first requests.
    budget = hop_budget
    hop_bound = (1 + budget["ratio"] + (budget["initial"] + budget["min_per_second"] * fault_lasted) / first
                 if first else None)
    return {
        "scenario": "layers", "label": label, "strategy": strategy, "lineage": lineage, "fault": fault,
        "fault_s": fault_s, "fault_lasted_s": fault_lasted, "first": first,
        "arrived": arrived,
        "amplification": {tier: (count / first if first else None) for tier, count in arrived.items()},
        "ok": tagged("edge", "ok"), "success_rate": tagged("edge", "ok") / first if first else None,
        "decisions": decisions, "hop_bound": hop_bound,
        "decide_ms": {"n": len(decide_ms), "p50": percentile(decide_ms, 0.5), "p99": percentile(decide_ms, 0.99)},
        "langs": dict(langs),
        # The machine's 1-minute load at the phase's end: the tiers' CPU is
        # what a busy machine takes first (decide waits, attempt timeouts).
        "load": os.getloadavg()[0],
        # Each process's own counters (without the decide times), for a look at one tier.
        "per_process": {name: {"lang": stats["lang"], "counts": stats["counts"], "decisions": stats["decisions"]}
                        for name, stats in per_process.items()},
        "cpu_s": {tier: sum(r.get("cpu_s", 0) for r in results) for tier, results in tiers.items()},
    }


def run_layers(args: argparse.Namespace, upstream_url: str, log_dir: str, retryd_bin: str,
               check_only: bool = False) -> list[dict[str, Any]]:
    faults = [fault for fault in layer_faults() if not args.layers_faults or fault["mode"] in args.layers_faults.split(",")]
    strategies = LAYER_STRATEGIES
    if check_only:
        faults, strategies = faults[:1], [LAYER_STRATEGIES[0], LAYER_STRATEGIES[3]]
    plan_ = [(fault, s) for fault in faults for s in strategies]
    upstreams = [f"layers-{i}-{hop}" for i in range(len(plan_)) for hop in ("middle", "back", "store")]
    policies = {f"layers-{i}-store": dict(NEAREST_POLICY) for i, (_, s) in enumerate(plan_) if s[3]}
    deployment = Deployment("memory", "", 1, log_dir, retryd_bin, upstreams, budget=LAYERS_BUDGET,
                            policies=policies)
    deployment.start()
    langs = dict(LAYER_LANGS)
    if not python_tiers_supported(args.python):
        # Said in the report's header (the tiers' languages), not hidden.
        print("fleet: layers: the Python client here has no retryd.asgi (or no uvicorn): every tier in TypeScript",
              flush=True)
        langs = {name: "typescript" for name in langs}
    rows = []
    try:
        for index, (fault, (label, strategy, lineage, nearest)) in enumerate(plan_):
            fault_s = LAYERS_FAULT_S[fault["mode"]] if not check_only else 3.0
            print(f"fleet: layers: {label}, {fault_name(fault)}", flush=True)
            # One hop's bound is the budget of the hop that retries.
            hop_budget = dict(LAYERS_BUDGET, ratio=NEAREST_POLICY["ratio"]) if nearest else LAYERS_BUDGET
            row = run_layers_phase(index, label, strategy, lineage, fault, fault_s, deployment, upstream_url, args,
                                   log_dir, langs, hop_budget)
            rows.append(row)
            amp = row["amplification"]
            print(f"  {row['first']} first requests: at middle {fmt(amp['middle'])}×, back {fmt(amp['back'])}×, "
                  f"upstream {fmt(amp['upstream'])}× (hop bound {fmt(row['hop_bound'])}), "
                  f"success {pct(row['success_rate'])}; "
                  + "; ".join(f"{tier}: {deny_summary(d)}" for tier, d in row["decisions"].items()), flush=True)
    finally:
        deployment.stop()
    return rows


def layers_table(rows: list[dict[str, Any]]) -> str:
    out = ["| fault | strategy | first requests | at the middles | at the back | at the upstream | one hop's bound | "
           "edge success | decide p50 / p99 ms | load | decisions: edge; middle; back |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        amp = row["amplification"]
        decisions = "; ".join(deny_summary(row["decisions"].get(tier, {})) for tier in ("edge", "middle", "back"))
        out.append(f"| {fault_name(row['fault'])} | {row['label']} | {row['first']} | {fmt(amp['middle'])}× | "
                   f"{fmt(amp['back'])}× | **{fmt(amp['upstream'])}×** | {fmt(row['hop_bound'])}× | "
                   f"{pct(row['success_rate'])} | {fmt(row['decide_ms']['p50'], 1)} / {fmt(row['decide_ms']['p99'], 1)} | "
                   f"{row.get('load', 0):.1f} | {decisions} |")
    return "\n".join(out)


def layers_plot(rows: list[dict[str, Any]], out_dir: str) -> str:
    name = "layers.svg"
    faults = []
    for row in rows:
        if fault_name(row["fault"]) not in faults:
            faults.append(fault_name(row["fault"]))
    labels = []
    for row in rows:
        if row["label"] not in labels:
            labels.append(row["label"])
    values = {(fault_name(row["fault"]), row["label"]): row["amplification"]["upstream"] or 0 for row in rows}
    svg.bar_chart(os.path.join(out_dir, name),
                  "Requests at the failing upstream per first request at the edge (edge → middle → back → upstream)",
                  faults, [(label, [values.get((fault, label), 0.0) for fault in faults]) for label in labels],
                  ylabel="amplification (log scale)", reference=(27.0, "27× = 3 × 3 × 3"))
    return name


def layers_report(rows: list[dict[str, Any]], plot_dir: str, plot_name: str, args: argparse.Namespace) -> str:
    rel = os.path.relpath(plot_dir, os.path.join(REPO, "docs"))
    langs = rows[0]["langs"] if rows else {}
    by_lang = ", ".join(f"{name} {lang}" for name, lang in langs.items())
    budget = ", ".join(f"{key} {value:g}" for key, value in LAYERS_BUDGET.items())
    lines = [f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{git_head()}`, `scripts/fleet layers`, "
             f"retryd `{args.retryd_bin_label}` (1 replica, memory store; budget per hop: {budget}; in the "
             f"nearest-hop rows the backs' upstream has ratio {NEAREST_POLICY['ratio']:g} and "
             f"max_attempts {NEAREST_POLICY['max_attempts']:g}), "
             f"{LAYERS_RATE:g} first requests/s at the edges, {LAYERS_WARM_S:g} s healthy, then the fault "
             f"({', '.join(f'{mode} {s:g} s' for mode, s in LAYERS_FAULT_S.items())} of first requests, held until "
             f"the last of them ended); tiers: {by_lang}; load average {os.getloadavg()[0]:.2f} at the end.", "",
             layers_table(rows), "", f"![layers]({rel}/{plot_name})", ""]
    return "\n".join(lines)


def layers_check(rows: list[dict[str, Any]]) -> list[str]:
    """The short layers assertions: lineage holds the chain to one hop's bound, naive shows the problem."""
    failures = []
    for row in rows:
        amp = row["amplification"]
        if not row["first"]:
            failures.append(f"layers {row['label']}: no first requests were tagged")
            continue
        if row["label"] == "naive" and row["fault"]["mode"] == "outage" and (amp["upstream"] or 0) < 10:
            failures.append(f"layers naive: amplification {fmt(amp['upstream'])}× < 10× (the baseline does not "
                            "show the problem)")
        if row["lineage"]:
            # A decision slower than the clients' 200 ms timeout is the local
            # rule's: one retry per call, no budget (it, too, denies what was
            # retried below or inside a retry). Those retries are allowed on
            # top of the bound, and may not be a quarter of the decisions, or
            # the phase tested the local rule rather than retryd.
            fallback_retries = row["decisions"].get("back", {}).get("fallback RETRY", 0)
            total = sum(sum(d.values()) for d in row["decisions"].values())
            fallback = sum(c for d in row["decisions"].values() for label, c in d.items() if label.startswith("fallback"))
            if total and fallback > 0.25 * total:
                failures.append(f"layers {row['label']}: {fallback} of {total} decisions came from the local fallback")
            for tier in ("middle", "back", "upstream"):
                allowed = row["hop_bound"] + (fallback_retries / row["first"] if tier == "upstream" else 0)
                if amp[tier] is None or amp[tier] > allowed:
                    failures.append(f"layers {row['label']}: {fmt(amp[tier])}× at the {tier}, above one hop's bound "
                                    f"{fmt(row['hop_bound'])}×" + (f" + {fallback_retries} fallback retries"
                                                                  if tier == "upstream" and fallback_retries else ""))
            if row["fault"]["mode"] == "outage":
                below = sum(d.get("DENY:RETRIED_BELOW", 0) for d in row["decisions"].values())
                retried = row["decisions"].get("back", {}).get("RETRY", 0)
                if not below:
                    failures.append(f"layers {row['label']}: no DENY RETRIED_BELOW above the back (lineage untested)")
                if not retried:
                    failures.append(f"layers {row['label']}: the back was granted no retry (nothing was tested)")
    return failures


# ------------------------------------------------------------------ report


def fmt(value: Optional[float], digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def pct(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def pct1(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def fault_name(fault: dict[str, Any]) -> str:
    mode = fault["mode"]
    if mode == "partial":
        return f"{int(fault['p'] * 100)}% 503"
    if mode == "latency":
        return f"responses held {fault['delay_ms']} ms"
    return "total outage (503)"


def deny_summary(decisions: dict[str, int]) -> str:
    interesting = {k: v for k, v in decisions.items() if k not in ("local RETRY",)}
    if not interesting:
        return "–"
    return ", ".join(f"{k.replace('DENY:', 'DENY ')} {v}" for k, v in sorted(interesting.items(), key=lambda kv: -kv[1]))


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| strategy | callers | amplification in fault | upstream req/s in fault | success (fault / all) | ambiguous | duplicate charges | charged, caller told failed | decide p50 / p99 ms | decisions |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        window = row["window"][1] - row["window"][0]
        replays = f" ({row['replays']} replays)" if row["keyed"] else ""
        out.append(
            f"| {row['label']} | {row['callers']} | {fmt(row['amplification'])}× | "
            f"{row['upstream_requests_in_fault'] / window:.0f} | {pct(row['fault_success_rate'])} / {pct(row['success_rate'])} | "
            f"{row['outcomes']['ambiguous']} | {row['duplicates']}{replays} | "
            f"{row['charged_but_told_failed']} | "
            f"{fmt(row['decide_ms']['p50'], 1)} / {fmt(row['decide_ms']['p99'], 1)} | {deny_summary(row['decisions'])} |")
    return "\n".join(out)


def adaptive_table(rows: list[dict[str, Any]]) -> str:
    """Issue 32's measures, per phase of the adaptive scenario."""
    out = ["| fault | strategy | amplification in fault | after its first 2 s | success in fault (idempotent / all) | "
           "peak 250 ms after recovery ÷ steady | retries granted ≤ bound | decisions |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        budget = row.get("budget")
        granted = "–" if not budget else (f"{budget['granted']:.0f} ≤ {budget['bound']:.0f}"
                                          + ("" if budget["holds"] else " **no**"))
        out.append(f"| {fault_name(row['fault'])} | {row['label']} | {fmt(row['amplification'])}× | "
                   f"{fmt(row['amplification_settled'])}× | {pct1(row['fault_idempotent_success_rate'])} / {pct1(row['fault_success_rate'])} | "
                   f"{fmt(row['recovery_peak_ratio'])}× ({row['recovery_peak_rps']:.0f} / {fmt(row['steady_rps'], 0)} req/s) | "
                   f"{granted} | {deny_summary(row['decisions'])} |")
    return "\n".join(out)


def budget_table(rows: list[dict[str, Any]]) -> str:
    out = ["| phase | whole phase: granted (metric / seen by callers) | bound = initial + ratio × reported + floor × s | during the fault: granted | bound = left at its start + ratio × reported + floor × s | holds |",
           "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        budget = row.get("budget")
        if not budget:
            continue
        window = budget.get("fault")
        holds = "yes" if budget["holds"] and (window is None or window["holds"]) else "**no**"
        if not budget["all_replicas_counted"] or (window and not window["all_replicas_counted"]):
            holds += " (a killed replica's counts are lost)"
        fault_cells = "– | –" if window is None else (
            f"{window['granted']:.0f} | {window['left']:.1f} + {budget['ratio']} × {window['reported']:.0f} + "
            f"{budget['floor_per_s']:g} × {window['seconds']:.1f} = {window['bound']:.1f}")
        out.append(f"| {row['scenario']}: {row['label']} | {budget['granted_metric']:.0f} / {budget['granted_seen_by_callers']} | "
                   f"{budget['initial']:.0f} + {budget['ratio']} × {budget['reported']:.0f} + "
                   f"{budget['floor_per_s']:g} × {budget['elapsed_s']:.1f} = {budget['bound']:.0f} | {fault_cells} | {holds} |")
    return "\n".join(out)


def cpu_table(rows: list[dict[str, Any]]) -> str:
    parts = ["callers (python)", "callers (typescript)", "upstream", "retryd", "redis"]
    out = ["| phase | " + " | ".join(parts) + " | total, cores |", "| --- |" + " ---: |" * (len(parts) + 1)]
    for row in rows:
        cpu = row["cpu_s"]
        total = sum(cpu.values())
        out.append(f"| {row['scenario']}: {row['label']} | " + " | ".join(f"{cpu.get(p, 0):.1f}" for p in parts)
                   + f" | {total:.1f} s = {total / row['elapsed_s']:.2f} |")
    return "\n".join(out)


def plots(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    written = []
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_scenario.setdefault(row["scenario"], []).append(row)
    for scenario, group in by_scenario.items():
        sizes = sorted({row["callers"] for row in group})
        modes = sorted({row["fault"]["mode"] for row in group})
        for size, mode in [(size, mode) for size in sizes for mode in modes]:
            subset = [row for row in group if row["callers"] == size and row["fault"]["mode"] == mode]
            if not subset:
                continue
            name = scenario + (f"-{size}-callers" if len(sizes) > 1 else "") + (f"-{mode}" if len(modes) > 1 else "") + ".svg"
            first = subset[0]
            window = first["window"]
            marks = [mark for row in subset for mark in row["events"]]
            series = [(row["label"], row["series"]["t"], row["series"]["upstream_rps"]) for row in subset]
            first_rate = statistics.mean(first["series"]["first_rps"][1:-1] or [0])
            svg.line_chart(
                os.path.join(out_dir, name),
                f"Requests reaching the upstream: {scenario}, {size} callers ({fault_name(first['fault'])})",
                series, shade=(window[0], window[1]), shade_label=fault_name(first["fault"]),
                marks=marks, reference=(first_rate, f"first attempts ({first_rate:.0f}/s)"))
            written.append(name)
        if len(sizes) > 1:
            # The per-client budgets against the shared one, at every size.
            subset = [row for row in group if row["strategy"] in ("local", "retryd")]
            name = f"{scenario}-by-size.svg"
            first = subset[0]
            svg.line_chart(
                os.path.join(out_dir, name),
                f"Same total traffic, more callers: {scenario} ({fault_name(first['fault'])})",
                [(row["label"], row["series"]["t"], row["series"]["upstream_rps"]) for row in subset],
                shade=(first["window"][0], first["window"][1]), shade_label=fault_name(first["fault"]))
            written.append(name)
    return written


def write_report(rows: list[dict[str, Any]], args: argparse.Namespace, plot_dir: str, plot_names: list[str]) -> str:
    lines = [f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{git_head()}`, "
             f"`scripts/fleet {args.scenario}`, retryd `{args.retryd_bin_label}`, "
             f"{args.rate:g} first attempts/s for the whole fleet, {args.warm:g} s healthy, {args.fault:g} s fault"
             + "".join(sorted({f" (the {row['scenario']} {row['window'][1] - row['window'][0]:.0f} s)" for row in rows
                               if row["scenario"] == "adaptive-outage"}))
             + f", {args.recover:g} s recovery; load average {os.getloadavg()[0]:.2f} at the end.", ""]
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_scenario.setdefault(row["scenario"], []).append(row)
    rel = os.path.relpath(plot_dir, os.path.join(REPO, "docs"))
    for scenario, group in by_scenario.items():
        what = ("charges to POST /keyed-charges, declared IDEMPOTENT_WITH_KEY" if group[0]["keyed"]
                else fault_name(group[0]["fault"]))
        lines += [f"**{scenario}** ({what})", "", table(group), ""]
        for name in plot_names:
            if name.startswith(scenario + ".") or name.startswith(scenario + "-"):
                lines += [f"![{scenario}]({rel}/{name})", ""]
    if any(row["scenario"].startswith("adaptive-") for row in rows):
        lines += ["**Adaptive budget** (issue 32, retryd's default budget: capacity 100, ratio 0.1, floor 1/s)", "",
                  adaptive_table(rows), ""]
    lines += ["**Budget bound** (fleet-wide, per retryd phase)", "", budget_table(rows), "",
              "**CPU seconds used by each part** (per phase; the last column divides by the phase's wall time)", "",
              cpu_table(rows), ""]
    return "\n".join(lines)


def git_head() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


# ------------------------------------------------------------------- check


def check(rows: list[dict[str, Any]]) -> list[str]:
    """The short test's assertions; returns what failed."""
    failures = []
    naive = [row for row in rows if row["strategy"] == "naive"]
    governed = [row for row in rows if row["strategy"] == "retryd"]
    if not naive or not governed:
        return ["the check needs a naive and a retryd phase"]
    for row in rows:
        if row["duplicates"]:
            failures.append(f"{row['label']}: {row['duplicates']} duplicate charges")
        if row["unfinished"]:
            failures.append(f"{row['label']}: {row['unfinished']} calls never finished")
        langs_seen = row["arrivals"]
        if not langs_seen:
            failures.append(f"{row['label']}: no calls were made")
    amp = naive[0]["amplification"] or 0
    if amp < 2.5:
        failures.append(f"naive amplification {amp:.2f}× < 2.5× (the baseline does not show the problem)")
    for row in governed:
        # Issue 36: a charge that may have been made is never reported to
        # retryd's callers as a plain failure, whichever rule denied it.
        if row["charged_but_told_failed"]:
            failures.append(f"{row['label']}: {row['charged_but_told_failed']} charges applied while the caller "
                            "was told the call failed")
        budget = row["budget"]
        if not budget["all_replicas_counted"]:
            failures.append(f"{row['label']}: a replica's counters are missing")
        if not budget["holds"]:
            failures.append(f"{row['label']}: {budget['granted']:.0f} retries granted > bound {budget['bound']:.1f}")
        if budget["reported"] <= 0:
            failures.append(f"{row['label']}: no traffic was reported (the budget bound would be vacuous)")
        if budget["granted"] <= 0:
            failures.append(f"{row['label']}: retryd granted no retry at all (nothing was tested)")
        window = budget["fault"]
        if not window["all_replicas_counted"]:
            failures.append(f"{row['label']}: a replica's counters are missing from the fault's account")
        if not window["holds"]:
            failures.append(f"{row['label']}: during the fault {window['granted']:.0f} retries were granted, more than "
                            f"{window['left']:.1f} left + {BUDGET['ratio']} × {window['reported']:.0f} reported + "
                            f"{BUDGET['min_per_second']} × {window['seconds']:.1f} s = {window['bound']:.1f}")
        asked = budget["granted"] + budget["denied_budget"]
        if asked < 1.3 * budget["bound"]:
            failures.append(f"{row['label']}: the callers asked for {asked:.0f} retries, not well above the bound "
                            f"{budget['bound']:.0f}: the scenario would not catch a budget that over-grants")
        for lang in ("python", "typescript"):
            seen = row["by_language"].get(lang)
            if not seen or not seen["arrivals"] or not seen["decisions"]:
                failures.append(f"{row['label']}: no {lang} caller asked retryd anything")
        # A decision slower than the client's 200 ms timeout is decided by the
        # client's local rule; a few on a busy machine are expected, but if
        # they dominate, the phase did not test retryd's budget.
        fallback = sum(c for label, c in row["decisions"].items() if label.startswith("fallback"))
        total = sum(row["decisions"].values())
        if total and fallback > 0.25 * total:
            failures.append(f"{row['label']}: {fallback} of {total} decisions came from the clients' local fallback")
        if row["amplification"] is not None and amp and row["amplification"] >= amp:
            failures.append(f"{row['label']}: amplification {row['amplification']:.2f}× not below naive {amp:.2f}×")
    return failures


# -------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description="fleet scenarios: what retries do to a sick upstream")
    parser.add_argument("scenario", nargs="?", default="all")
    parser.add_argument("--check", action="store_true", help="the short test: assert, write no report")
    parser.add_argument("--rate", type=float, help="first attempts per second for the whole fleet (80; check: 40)")
    parser.add_argument("--callers", type=int, default=4, help="fleet size (the outage scenario also runs twice this)")
    parser.add_argument("--warm", type=float, help="seconds healthy before the fault (4; check: 3)")
    parser.add_argument("--fault", type=float, help="seconds of fault (10; check: 6)")
    parser.add_argument("--recover", type=float, help="seconds healthy after it (5; check: 3)")
    parser.add_argument("--update", action="store_true", help="write the plots and tables into docs/fleet.md")
    parser.add_argument("--layers-faults", default="", help="layers: only these faults (outage,partial,latency)")
    parser.add_argument("--out", default=os.path.join(REPO, "target", "fleet"))
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    short = args.scenario == "check"
    for name, full, quick in (("rate", 80.0, 40.0), ("warm", 4.0, 3.0), ("fault", 10.0, 6.0), ("recover", 5.0, 3.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if short else full)
    BUDGET.clear()
    BUDGET.update(CHECK_BUDGET if short else REPORT_BUDGET)

    retryd_bin = os.environ.get("RETRYD_BIN") or os.path.join(REPO, "target", "release", "retryd")
    if not os.access(retryd_bin, os.X_OK):
        raise SystemExit(f"fleet: no retryd binary at {retryd_bin} (set RETRYD_BIN or cargo build --release --bin retryd)")
    args.retryd_bin_label = ("release" if "/release/" in retryd_bin else "debug" if "/debug/" in retryd_bin
                             else os.path.basename(os.path.dirname(retryd_bin)) + "/" + os.path.basename(retryd_bin))
    if args.scenario in ("pushback", "recovery"):
        return run_pushback(args, retryd_bin)  # issue 32's pushback and recovery: fleet/pushback.py
    phases = plan(args)
    os.makedirs(args.out, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix=f"run-{time.strftime('%Y%m%d-%H%M%S')}-", dir=args.out)
    print(f"fleet: {len(phases)} phases of {args.warm + args.fault + args.recover:g} s; logs in {log_dir}", flush=True)

    upstream = Proc("upstream", ["node", os.path.join(HERE, "upstream.mjs")], log_dir)
    upstream_url = f"http://127.0.0.1:{json.loads(upstream.expect(lambda l: l.startswith('{'), 30))['port']}"
    deployments: dict[str, Deployment] = {}
    rows = []
    layer_rows: list[dict[str, Any]] = []
    tail_rows: list[dict[str, Any]] = []
    try:
        for phase in phases:
            deployment = deployments.get(phase.deployment)
            if deployment is None:
                for other in deployments.values():
                    other.stop()  # one store setup at a time: the machine has 2 cores
                deployments.clear()
                deployment = deployment_of(phase.deployment, log_dir=log_dir, retryd_bin=retryd_bin,
                                           upstreams=[p.upstream for p in phases],
                                           policies={p.upstream: dict(p.policy) for p in phases if p.policy})
                deployment.start()
                deployments[phase.deployment] = deployment
            else:
                deployment.heal()
            print(f"fleet: {phase.scenario}: {phase.title()} ({phase.callers} callers, {phase.upstream})", flush=True)
            row = run_phase(phase, deployment, upstream_url, upstream, args, log_dir)
            rows.append(row)
            print(f"  amplification {fmt(row['amplification'])}×, success in fault {pct(row['fault_success_rate'])}, "
                  f"duplicates {row['duplicates']}, charged but told failed {row['charged_but_told_failed']}, ambiguous {row['outcomes']['ambiguous']}, "
                  f"decisions {deny_summary(row['decisions'])}"
                  + (f", budget {row['budget']['granted']:.0f} granted ≤ {row['budget']['bound']:.0f}"
                     if "budget" in row else ""), flush=True)
        for deployment in deployments.values():
            deployment.stop()
        deployments.clear()
        if args.scenario in ("all", "layers", "check"):
            layer_rows = run_layers(args, upstream_url, log_dir, retryd_bin, check_only=short)
        if args.scenario == "tail":  # issue 33's hedging scenario, in fleet/tail.py
            import tail as tail_scenario
            tail_rows = tail_scenario.run(sys.modules[__name__], args, upstream_url, log_dir, retryd_bin)
    finally:
        for deployment in deployments.values():
            deployment.stop()
        upstream.stop()
        with open(os.path.join(log_dir, "results.json"), "w") as file:
            json.dump(rows + layer_rows + tail_rows, file, indent=1)

    plot_dir = os.path.join(REPO, "docs", "fleet") if args.update else log_dir
    os.makedirs(plot_dir, exist_ok=True)
    report = ""
    if rows:
        names = plots(rows, plot_dir)
        report = write_report(rows, args, plot_dir, names)
        if args.update:
            update_doc(report, "fleet-adaptive" if args.scenario == "adaptive" else "fleet")
    if layer_rows:
        layers = layers_report(layer_rows, plot_dir, layers_plot(layer_rows, plot_dir), args)
        report += "\n" + layers
        if args.update and not short:
            update_doc(layers, "fleet-layers")
    if tail_rows:
        import tail as tail_scenario
        report += tail_scenario.report(sys.modules[__name__], tail_rows, args, plot_dir,
                                       tail_scenario.plots(sys.modules[__name__], tail_rows, plot_dir))
        if args.update:
            update_doc(report, "fleet-tail")
    with open(os.path.join(log_dir, "report.md"), "w") as file:
        file.write(report)
    print(f"fleet: results in {log_dir}/results.json, report {log_dir}/report.md, plots in {plot_dir}", flush=True)
    if args.check:
        failures = check(rows) + layers_check(layer_rows)
        if failures:
            print("fleet check FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
            return 1
        lineage = [row for row in layer_rows if row["lineage"]]
        print("fleet check passed: budget bound held fleet-wide, no duplicate charges, naive amplified "
              f"{rows[0]['amplification']:.2f}×"
              + "".join(f"; call chains: naive {fmt(layer_rows[0]['amplification']['upstream'])}×, with lineage "
                        f"{fmt(row['amplification']['upstream'])}× ≤ one hop's {fmt(row['hop_bound'])}×"
                        for row in lineage[:1]), flush=True)
    return 0


def run_pushback(args: argparse.Namespace, retryd_bin: str) -> int:
    import pushback

    os.makedirs(args.out, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix=f"run-{time.strftime('%Y%m%d-%H%M%S')}-", dir=args.out)
    upstream = Proc("upstream", ["node", os.path.join(HERE, "upstream.mjs")], log_dir)
    try:
        upstream_url = f"http://127.0.0.1:{json.loads(upstream.expect(lambda l: l.startswith('{'), 30))['port']}"
        report = pushback.run(args, upstream_url, log_dir, retryd_bin)
    finally:
        upstream.stop()
    with open(os.path.join(log_dir, "report.md"), "w") as file:
        file.write(report)
    if args.update:
        update_doc(report, f"fleet-{args.scenario}-run")
    print(report, flush=True)
    return 0


def update_doc(report: str, marker: str = "fleet") -> None:
    path = os.path.join(REPO, "docs", "fleet.md")
    with open(path) as file:
        text = file.read()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"fleet: {path} has no {begin} … {end} markers")
    head, rest = text.split(begin, 1)
    _, tail_text = rest.split(end, 1)
    with open(path, "w") as file:
        file.write(head + begin + "\n" + report + "\n" + end + tail_text)


if __name__ == "__main__":
    sys.exit(main())
