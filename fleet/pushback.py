"""Issue 32's pushback and recovery scenarios, run by fleet/run.py
(``scripts/fleet pushback`` / ``scripts/fleet recovery``, ``--update``
rewrites docs/fleet.md's fleet-pushback section).

Every phase of a scenario has the same callers (Python, the client's httpx
adapter for retryd), the same seeds and rates, on the same upstream process,
one phase after the other in one run:

  pushback  healthy, then every request 429 with ``Retry-After: 2`` for
            PUSHBACK_S, then healthy. Naive retries honour Retry-After per
            caller (each waits on its own 429); retryd with
            ``fleet_pushback = false`` (each caller its own Retry-After) and
            with its default (a caller's Retry-After paces the fleet).
            ``pushback-mixed``: the same window, but half the requests 503
            (a limiter answers 429, the overloaded backend behind it 503):
            a caller whose own attempt got a 503 has no Retry-After of its own.
            A retry is early if it reaches the upstream before the deadline
            of the latest 429 the upstream had served (100 ms of reporting
            slack, fleet/upstream.mjs) when the retry's previous attempt was
            answered: what retryd had been told when it decided the retry.
  recovery  healthy, a total outage (503), healthy again: naive retries,
            retryd with its ramp off (``ramp_window = "0s"``), retryd at its
            defaults, and retryd with the kill switch off at mid-outage and
            on again at its end. The peak 250 ms bucket in the second after
            the recovery, over the healthy rate of the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import run as fleet  # fleet/run.py: processes, deployments, helpers
import svg

PUSHBACK_S = 4.0  # the 429 window
PUSHBACK_DEADLINE_S = 6.0  # room for a 2 s Retry-After and a second one
RECOVERY_OUTAGE_S = 6.0
WARM_S, RECOVER_S = 3.0, 5.0
PEAK_TARGET = 1.5  # the bound on the post-recovery peak bucket


@dataclass
class Phase:
    scenario: str
    strategy: str
    label: str
    policy: dict[str, Any] = field(default_factory=dict)  # extra keys of the upstream's policy in retryd
    kill_switch: bool = False
    fault: dict[str, Any] = field(default_factory=lambda: {"mode": "outage"})
    upstream: str = ""


class PolicyDeployment(fleet.Deployment):
    """run.py's Deployment at retryd's default budget, with extra policy keys
    (``fleet_pushback``, ``ramp_window``) per upstream."""

    extra: dict[str, dict[str, Any]]

    def config(self) -> str:
        text = super().config()
        for upstream, keys in self.extra.items():
            lines = "".join(f"\n{key} = {json.dumps(value) if isinstance(value, str) else str(value).lower()}"
                            for key, value in keys.items())
            text = text.replace(f'[upstreams."{upstream}"]', f'[upstreams."{upstream}"]{lines}', 1)
        return text


def plan(name: str) -> list[Phase]:
    if name == "pushback":
        phases = [Phase(scenario, strategy, label, policy, fault=fault)
                  for scenario, fault in (("pushback", {"mode": "pushback", "retry_after_s": 2}),
                                          ("pushback-mixed", {"mode": "pushback", "retry_after_s": 2, "p503": 0.5}))
                  for strategy, label, policy in (
                      ("naive", "naive, Retry-After per caller", {}),
                      ("retryd", "retryd, fleet_pushback = false", {"fleet_pushback": False}),
                      ("retryd", "retryd (default: fleet_pushback)", {}))]
    else:
        phases = [Phase("recovery", "naive", "naive"),
                  Phase("recovery", "retryd", 'retryd, ramp_window = "0s"', {"ramp_window": "0s"}),
                  Phase("recovery", "retryd", "retryd (default ramp)"),
                  Phase("recovery", "retryd", "retryd, kill switch off at mid-outage, on at its end", kill_switch=True)]
    for index, phase in enumerate(phases):
        phase.upstream = f"{name}-{index}"
    return phases


def set_retries(deployment: fleet.Deployment, upstream: str, enabled: bool) -> int:
    """The kill switch, asked again (at most 5 times, 200 ms apart) when the
    store answers UNAVAILABLE: a debug retryd on a loaded machine can miss
    its Redis timeout once. Returns how many attempts it took."""
    from retryd.errors import RetrydUnavailableError

    for attempt in range(1, 6):
        try:
            fleet.set_retries(deployment, upstream, enabled)
            return attempt
        except RetrydUnavailableError:
            if attempt == 5:
                raise
            time.sleep(0.2)
    return 5


def run_phase(phase: Phase, deployment: fleet.Deployment, upstream_url: str, args: argparse.Namespace,
              log_dir: str) -> dict[str, Any]:
    pushback = phase.scenario.startswith("pushback")
    fault_s = PUSHBACK_S if pushback else RECOVERY_OUTAGE_S
    fault = phase.fault
    duration = WARM_S + fault_s + RECOVER_S
    callers = []
    for index in range(args.callers):
        config = {
            "id": index, "strategy": phase.strategy, "rate": args.rate / args.callers, "duration_s": duration,
            "upstream_url": upstream_url, "retryd_target": deployment.target(index),
            "retryd_upstream": phase.upstream, "seed": 1000 + index, "bucket_ms": fleet.BUCKET_MS,
            "deadline_s": PUSHBACK_DEADLINE_S if pushback else fleet.DEADLINE_S,
            "attempt_timeout_s": fleet.ATTEMPT_TIMEOUT_S, "max_in_flight": 500, "keyed": False,
            "out": os.path.join(log_dir, f"{phase.upstream}-caller-{index}.json"),
            "honour_retry_after": True, "tag_retries": True,
        }
        path = os.path.join(log_dir, f"{phase.upstream}-caller-{index}.config.json")
        with open(path, "w") as file:
            json.dump(config, file)
        proc = fleet.Proc(f"{phase.upstream}-caller-{index}-python", [args.python, os.path.join(fleet.HERE, "caller.py"), path],
                          log_dir, stdin=True)
        callers.append((config, proc))
    for _, proc in callers:
        proc.expect(lambda line: line == "ready", 120)
    before = deployment.metrics()
    epoch_ms = int(time.time() * 1000) + 300
    fleet.http_json(f"{upstream_url}/_control", {"reset_epoch_ms": epoch_ms, "fault": {"mode": "ok"}})
    for _, proc in callers:
        proc.send(f"go {epoch_ms}")
    epoch = epoch_ms / 1000

    def at(offset: float) -> None:
        delay = epoch + offset - time.time()
        if delay > 0:
            time.sleep(delay)

    events: list[tuple[float, str]] = []
    at(WARM_S)
    fleet.http_json(f"{upstream_url}/_control", {"fault": fault})
    began = time.time() - epoch
    if phase.kill_switch:
        at(WARM_S + fault_s / 2)
        tries = set_retries(deployment, phase.upstream, False)
        events.append((time.time() - epoch, "retries off" + (f" ({tries} tries)" if tries > 1 else "")))
    at(WARM_S + fault_s)
    fleet.http_json(f"{upstream_url}/_control", {"fault": {"mode": "ok"}})
    ended = time.time() - epoch
    if phase.kill_switch:
        tries = set_retries(deployment, phase.upstream, True)
        events.append((time.time() - epoch, "retries on" + (f" ({tries} tries)" if tries > 1 else "")))
    for _, proc in callers:
        proc.expect(lambda line: line == "done", duration + PUSHBACK_DEADLINE_S + 60)
    results = []
    for config, proc in callers:
        proc.popen.wait(timeout=30)
        with open(config["out"]) as file:
            results.append(json.load(file))
    after = deployment.metrics()
    stats = fleet.http_json(f"{upstream_url}/_stats")
    return summarise(phase, results, stats, before, after, (began, ended), events, duration)


def summarise(phase: Phase, results: list[dict[str, Any]], stats: dict[str, Any], before: list[Any], after: list[Any],
              window: tuple[float, float], events: list[tuple[float, str]], duration: float) -> dict[str, Any]:
    per_s = 1000 / fleet.BUCKET_MS
    series = {int(b["bucket"]): b for b in stats["series"]}
    last = int(duration * per_s) + int(PUSHBACK_DEADLINE_S * per_s)
    buckets = list(range(0, last + 1))
    requests = [series.get(b, {}).get("requests", 0) for b in buckets]
    retries = [series.get(b, {}).get("retries", 0) for b in buckets]
    early = [series.get(b, {}).get("early_retries", 0) for b in buckets]
    firsts = [r - t for r, t in zip(requests, retries)]
    began_b, ended_b = int(window[0] * per_s), int(window[1] * per_s)
    # The healthy rate: the warm-up's buckets after its first second.
    steady = statistics.mean(requests[int(per_s):began_b] or [0])
    after_recovery = requests[ended_b:ended_b + int(per_s)]
    peak = max(after_recovery or [0])
    outcomes: dict[str, int] = {}
    for result in results:
        for name in ("ok", "failed", "ambiguous"):
            outcomes[name] = outcomes.get(name, 0) + sum(result["series"].get(name, {}).values())
    decisions: dict[str, int] = {}
    for result in results:
        for name, n in result["decisions"].items():
            decisions[name] = decisions.get(name, 0) + n
    fault_s = window[1] - window[0]

    def delta(name: str) -> float:
        return fleet.metric_sum(after, name) - fleet.metric_sum(before, name)

    return {
        "scenario": phase.scenario, "label": phase.label, "strategy": phase.strategy, "window": list(window),
        "events": events, "callers": len(results),
        "early_retries": stats["totals"].get("early_retries", 0),
        "early_ms_max": stats["totals"].get("early_ms_max", 0),
        "retries": stats["totals"].get("retries", 0),
        "retries_in_window": sum(retries[began_b:ended_b]),
        "retries_peak_bucket": max(retries[began_b:] or [0]),
        "first_rps_window": sum(firsts[began_b:ended_b]) / fault_s if fault_s else None,
        "first_rps_warm": statistics.mean(firsts[int(per_s):began_b] or [0]) * per_s,
        "rejected_429": stats["totals"].get("rejected_429", 0),
        # The callers' own pace: an even open-loop stream is 20 per bucket;
        # a starved caller (a loaded machine) sends in bursts, which the
        # peak would otherwise blame on retries.
        "first_bucket_range": (min(firsts[int(per_s):int(duration * per_s) - 1] or [0]),
                               max(firsts[int(per_s):int(duration * per_s) - 1] or [0])),
        "retries_in_peak_window": max(retries[ended_b:ended_b + int(per_s)] or [0]),
        "steady_bucket": steady, "peak_bucket": peak, "peak_ratio": peak / steady if steady else None,
        "outcomes": outcomes, "decisions": decisions,
        "stretched": delta("retryd_backoffs_stretched_total"),
        "series": {"t": [b / per_s for b in buckets], "requests": [r * per_s for r in requests],
                   "retries_per_bucket": retries, "early_per_bucket": early},
    }


def pushback_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| strategy | early retries (max early by) | retries in the 429 window | peak retries / 250 ms after it began "
             "| first attempts / s: warm-up, 429 window | backoffs stretched (metric) | calls ok / failed / ambiguous |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['early_retries']} ({row['early_ms_max']:.0f} ms) | {row['retries_in_window']} "
                     f"| {row['retries_peak_bucket']} | {row['first_rps_warm']:.1f}, {row['first_rps_window']:.1f} "
                     f"| {row['stretched']:.0f} | {row['outcomes']['ok']} / {row['outcomes']['failed']} / {row['outcomes']['ambiguous']} |")
    return "\n".join(lines)


def recovery_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| strategy | healthy requests / 250 ms (warm-up) | peak 250 ms bucket in the second after recovery "
             f"| peak ÷ healthy (target ≤ {PEAK_TARGET}× for retryd) | most retries in one bucket of that second "
             "| first attempts / 250 ms, min–max (callers' evenness) | retries | calls ok / failed / ambiguous |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        met = "" if row["strategy"] != "retryd" else (" ✓" if (row["peak_ratio"] or 0) <= PEAK_TARGET else " ✗")
        lines.append(f"| {row['label']} | {row['steady_bucket']:.1f} | {row['peak_bucket']} | {fleet.fmt(row['peak_ratio'])}×{met} "
                     f"| {row['retries_in_peak_window']} | {row['first_bucket_range'][0]}–{row['first_bucket_range'][1]} "
                     f"| {row['retries']} | {row['outcomes']['ok']} / {row['outcomes']['failed']} / {row['outcomes']['ambiguous']} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: str) -> str:
    scenario = rows[0]["scenario"]
    window = rows[0]["window"]
    marks = [mark for row in rows for mark in row["events"]]
    if scenario.startswith("pushback"):
        name = f"{scenario}.svg"
        series = [(row["label"], row["series"]["t"], row["series"]["retries_per_bucket"]) for row in rows]
        what = "half 429 + Retry-After: 2, half 503" if scenario == "pushback-mixed" else "429 + Retry-After: 2 to everyone"
        svg.line_chart(os.path.join(out_dir, name), f"Retries reaching the upstream per 250 ms: {what}",
                       series, shade=(window[0], window[1]), shade_label=what, marks=marks,
                       ylabel="retries / 250 ms")
    else:
        name = "recovery.svg"
        series = [(row["label"], row["series"]["t"], row["series"]["requests"]) for row in rows]
        steady = rows[0]["steady_bucket"] * 1000 / fleet.BUCKET_MS
        svg.line_chart(os.path.join(out_dir, name), "Requests reaching the upstream: an outage (503) ends",
                       series, shade=(window[0], window[1]), shade_label="outage (503)", marks=marks,
                       reference=(steady * PEAK_TARGET, f"{PEAK_TARGET}× the healthy rate"))
    return name


def report(rows: list[dict[str, Any]], args: argparse.Namespace, plot_dir: str) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["scenario"], []).append(row)
    rel = os.path.relpath(plot_dir, os.path.join(fleet.REPO, "docs"))
    lines = [f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{fleet.git_head()}`, "
             f"`scripts/fleet {args.scenario}`, retryd `{args.retryd_bin_label}` (2 replicas, Redis exact, default "
             f"settings), {args.callers} Python callers, {args.rate:g} first attempts/s for the whole fleet, "
             f"{WARM_S:g} s healthy before the fault and {RECOVER_S:g} s after; load average "
             f"{os.getloadavg()[0]:.2f} at the end.", ""]
    for scenario, group in by.items():
        if scenario == "pushback":
            lines += [f"**pushback** ({PUSHBACK_S:g} s of 429 with `Retry-After: 2` to every request; deadline "
                      f"{PUSHBACK_DEADLINE_S:g} s per call)", "", pushback_table(group), ""]
        elif scenario == "pushback-mixed":
            lines += [f"**pushback-mixed** ({PUSHBACK_S:g} s: each request 429 with `Retry-After: 2` or, at even "
                      f"odds, 503; deadline {PUSHBACK_DEADLINE_S:g} s per call)", "", pushback_table(group), ""]
        else:
            lines += [f"**recovery** ({RECOVERY_OUTAGE_S:g} s of 503 to every request, then healthy)", "",
                      recovery_table(group), ""]
        lines += [f"![{scenario}]({rel}/{plot(group, plot_dir)})", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace, upstream_url: str, log_dir: str, retryd_bin: str) -> str:
    """Runs ``args.scenario`` (pushback | recovery); returns its report."""
    phases = plan(args.scenario)
    for phase in phases:
        if phase.scenario == "recovery":
            phase.fault = {"mode": "outage"}
    deployment = PolicyDeployment("redis", "exact", 2, log_dir=log_dir, retryd_bin=retryd_bin,
                                  upstreams=[p.upstream for p in phases], budget=dict(fleet.DEFAULT_BUDGET))
    deployment.extra = {p.upstream: p.policy for p in phases if p.policy}
    deployment.start()
    rows = []
    try:
        for phase in phases:
            deployment.heal()
            print(f"fleet: {phase.scenario}: {phase.label} ({args.callers} callers, {phase.upstream})", flush=True)
            row = run_phase(phase, deployment, upstream_url, args, log_dir)
            rows.append(row)
            print(f"  early retries {row['early_retries']}, retries {row['retries']}, peak/healthy "
                  f"{fleet.fmt(row['peak_ratio'])}×, outcomes {row['outcomes']}, stretched {row['stretched']:.0f}", flush=True)
    finally:
        deployment.stop()
        with open(os.path.join(log_dir, f"{args.scenario}-results.json"), "w") as file:
            json.dump(rows, file, indent=1)
    plot_dir = os.path.join(fleet.REPO, "docs", "fleet") if args.update else log_dir
    os.makedirs(plot_dir, exist_ok=True)
    return report(rows, args, plot_dir)
