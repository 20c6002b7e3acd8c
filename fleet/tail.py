"""The ``tail`` fleet scenario (issue 33): hedging against a latency tail.

Run by fleet/run.py (``scripts/fleet tail [--update]``), which hands over its
own module as ``runner`` for the processes and helpers it already has. Each
strategy meets the same callers, rates, seeds and upstream schedule:

1. TAIL_S seconds where a random 2% of responses are held 1 s, the rest
   10 ms +- 2 ms (the upstream's ``delay`` mode: drawn per call, so every
   strategy meets the same slow first attempts, while a hedge draws afresh);
2. SLOW_S seconds where every response takes 200 ms +- 20 ms (uniformly slow).

Strategies:

- no hedging: one attempt per call;
- a fixed 50 ms hedge delay: the clients' own fixed-delay hedging
  (``LocalHedging`` / ``localHedging``) with ``max_extra_load = 1``, that is
  one hedge per slow call and no cap, as failsafe-go, Polly and gRFC A6's
  ``hedgingPolicy`` without throttling hedge. The clients hedge locally only
  while retryd is unreachable, and retryd has no fixed-delay policy (its
  delay is always the fleet's quantile), so these callers point at a closed
  port: every hedge is then the local rule's;
- retryd: ``[upstreams.NAME.hedging]`` at its defaults (p95, 5% cap, 30 s
  window), the callers' reporters sending latency histograms;
- the same with ``window = "5s"``: how fast the uniformly slow phase is seen
  depends on the window (the p50 must cross into the slow latencies).

retryd: one replica on the memory store, retryd's default budget. The calls
are GETs (SAFE): a NON_IDEMPOTENT call is never hedged.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any, Optional

RATE = 100.0  # calls/s, the whole fleet
# TypeScript callers only by default: a Python caller at 25 calls/s falls
# behind on a loaded 2-core machine (its event loop late past the hedge
# delay, every call hedged), its calls time out, and their latencies,
# reported as first attempts, make retryd's served delay long for every
# caller (docs/fleet.md, the tail section: diagnosed, the httpcore pool leak
# that fed it fixed in the client, the overload itself measured).
# FLEET_TAIL_LANGS=python,typescript,python,typescript runs the mixed fleet.
LANGS = os.environ.get("FLEET_TAIL_LANGS", "typescript,typescript,typescript,typescript").split(",")
CALLERS = len(LANGS)
TAIL_S = 30.0
SLOW_S = 20.0
# The tail phase's measured part starts after this: before it retryd has
# fewer than min_samples latencies (100) and the callers no served delay.
SETTLE_S = 5.0
BUCKET_S = 0.25
# Beyond any response held, so that a slow call is slow, not failed.
ATTEMPT_TIMEOUT_S = 2.5
DEADLINE_S = 3.0
TAIL_FAULT = {"mode": "delay", "base_ms": 10, "jitter_ms": 2, "tail_p": 0.02, "tail_ms": 1000, "seed": 33}
SLOW_FAULT = {"mode": "delay", "base_ms": 200, "jitter_ms": 20, "tail_p": 0.0, "tail_ms": 0, "seed": 34}
FIXED = {"delay_s": 0.05, "max_hedges": 1, "max_extra_load": 1.0}
# (label, caller strategy, local hedging, retryd hedging section or None, dead retryd)
STRATEGIES: list[tuple[str, str, Optional[dict[str, Any]], Optional[dict[str, Any]], bool]] = [
    ("no hedging", "none", None, None, False),
    ("fixed 50 ms (clients' local hedging, no cap)", "retryd", FIXED, None, True),
    ("retryd hedging, defaults", "retryd", None, {}, False),
    ('retryd hedging, window = "5s"', "retryd", None, {"window": '"5s"'}, False),
]


def quantile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


def window_sum(series: dict[int, int], lo: float, hi: float) -> int:
    return sum(n for b, n in series.items() if lo / BUCKET_S <= b < hi / BUCKET_S)


def run(runner: Any, args: Any, upstream_url: str, log_dir: str, retryd_bin: str) -> list[dict[str, Any]]:
    upstreams = [f"tail-{i}" for i in range(len(STRATEGIES))]
    sections = {up: s[3] for up, s in zip(upstreams, STRATEGIES) if s[3] is not None}

    class TailDeployment(runner.Deployment):  # type: ignore[misc, name-defined]
        def config(self) -> str:
            text = super().config()
            for upstream, keys in sections.items():
                text += f'\n[upstreams."{upstream}".hedging]\n' + "".join(f"{k} = {v}\n" for k, v in keys.items())
            return text

    deployment = TailDeployment("memory", "", 1, log_dir, retryd_bin, upstreams, budget=runner.DEFAULT_BUDGET)
    deployment.start()
    rows = []
    try:
        for upstream, (label, strategy, local, section, dead) in zip(upstreams, STRATEGIES):
            print(f"fleet: tail: {label} ({upstream})", flush=True)
            row = run_one(runner, args, deployment, upstream, label, strategy, local, section is not None, dead,
                          upstream_url, log_dir)
            rows.append(row)
            for phase in ("tail", "slow"):
                p = row[phase]
                print(f"  {phase}: p50 {fmt(p['p50'])} ms, p99 {fmt(p['p99'])} ms, p99.9 {fmt(p['p999'])} ms, "
                      f"extra {pct(p['extra'])}, hedges asked/granted/won {p['hedges_asked']}/{p['hedges_granted']}/"
                      f"{p['hedges_won']}, errors {p['errors']}", flush=True)
            print(f"  slow phase: hedges < 1% of requests from {fmt(row['below_1pct_after_s'], 1)} s; "
                  f"decisions {row['decisions']}", flush=True)
    finally:
        deployment.stop()
    return rows


def run_one(runner: Any, args: Any, deployment: Any, upstream: str, label: str, strategy: str,
            local: Optional[dict[str, Any]], hedged_by_retryd: bool, dead: bool, upstream_url: str,
            log_dir: str) -> dict[str, Any]:
    duration = TAIL_S + SLOW_S
    dead_target = f"127.0.0.1:{runner.free_port()}"  # nothing listens there
    callers = []
    for index in range(CALLERS):
        lang = LANGS[index]
        config = {
            "id": index, "strategy": strategy, "rate": RATE / CALLERS, "duration_s": duration,
            "upstream_url": upstream_url, "retryd_target": dead_target if dead else deployment.target(index),
            "retryd_upstream": upstream, "seed": 3300 + index, "bucket_ms": int(BUCKET_S * 1000),
            "deadline_s": DEADLINE_S, "attempt_timeout_s": ATTEMPT_TIMEOUT_S, "max_in_flight": 500,
            "out": os.path.join(log_dir, f"{upstream}-caller-{index}.json"), "keyed": False,
            "tail": True, "local_hedging": local,
        }
        path = os.path.join(log_dir, f"{upstream}-caller-{index}.config.json")
        with open(path, "w") as file:
            json.dump(config, file)
        argv = ([args.python, os.path.join(runner.HERE, "caller.py"), path] if lang == "python"
                else ["node", os.path.join(runner.HERE, "caller.mjs"), path])
        callers.append((config, runner.Proc(f"{upstream}-caller-{index}-{lang}", argv, log_dir, stdin=True)))
    for _, proc in callers:
        proc.expect(lambda line: line == "ready", 120)

    before = deployment.metrics()
    epoch_ms = int(time.time() * 1000) + 300
    runner.http_json(f"{upstream_url}/_control", {"reset_epoch_ms": epoch_ms, "fault": TAIL_FAULT})
    for _, proc in callers:
        proc.send(f"go {epoch_ms}")
    epoch = epoch_ms / 1000

    # retryd's served delay and uniformly-slow flag, once a second.
    gauges: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            try:
                scraped = deployment.metrics()
            except OSError:
                continue
            delay = runner.metric_sum(scraped, "retryd_hedge_delay_seconds", upstream=upstream)
            uniform = runner.metric_sum(scraped, "retryd_hedging_uniformly_slow", upstream=upstream)
            gauges.append((time.time() - epoch, delay * 1000, uniform))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    delay = epoch + TAIL_S - time.time()
    if delay > 0:
        time.sleep(delay)
    runner.http_json(f"{upstream_url}/_control", {"fault": SLOW_FAULT})
    switched = time.time() - epoch
    for _, proc in callers:
        proc.expect(lambda line: line == "done", duration + DEADLINE_S + 60)
    stop.set()
    watcher.join()
    results = []
    for config, proc in callers:
        proc.popen.wait(timeout=30)
        with open(config["out"]) as file:
            results.append(json.load(file))
    after = deployment.metrics()
    stats = runner.http_json(f"{upstream_url}/_stats")
    runner.http_json(f"{upstream_url}/_control", {"fault": {"mode": "ok"}})
    return summarise(runner, label, upstream, hedged_by_retryd, results, stats, before, after, gauges, switched)


def summarise(runner: Any, label: str, upstream: str, hedged_by_retryd: bool, results: list[dict[str, Any]],
              stats: dict[str, Any], before: list[Any], after: list[Any], gauges: list[tuple[float, float, float]],
              switched: float) -> dict[str, Any]:
    requests = {int(r["bucket"]): r["requests"] for r in stats["series"]}
    repeats = {int(r["bucket"]): r.get("repeats", 0) for r in stats["series"]}
    first = runner.sum_series(results, "first")
    asked = runner.sum_series(results, "hedge_asked")
    granted = runner.sum_series(results, "hedge_granted")
    errors = {name: runner.sum_series(results, name) for name in ("failed", "ambiguous", "shed")}
    calls = [c for r in results for c in r["tail_calls"]]
    decisions: dict[str, int] = {}
    for result in results:
        for key, count in result["decisions"].items():
            decisions[key] = decisions.get(key, 0) + count

    def delta(name: str, **match: str) -> float:
        return runner.metric_sum(after, name, **match) - runner.metric_sum(before, name, **match)

    def phase(lo: float, hi: float) -> dict[str, Any]:
        ms = [c[1] for c in calls if lo <= c[0] < hi]
        firsts = window_sum(first, lo, hi)
        # Arrivals at the upstream in the same buckets (a hedge arrives a
        # delay after its call started: a bucket's shift at the edges only).
        reached = window_sum(requests, lo, hi)
        return {
            "from_s": lo, "to_s": hi, "calls": len(ms), "first": firsts, "upstream_requests": reached,
            "repeats": window_sum(repeats, lo, hi),
            "extra": reached / firsts - 1 if firsts else None,
            "p50": quantile(ms, 0.5), "p99": quantile(ms, 0.99),
            # p99.9 from 2,000 calls is the 2nd slowest: said as such in the report.
            "p999": quantile(ms, 0.999) if len(ms) >= 2000 else None,
            "hedges_asked": window_sum(asked, lo, hi), "hedges_granted": window_sum(granted, lo, hi),
            "hedges_won": sum(1 for c in calls if lo <= c[0] < hi and c[2] >= 2),
            "errors": sum(window_sum(s, lo, hi) for s in errors.values()),
        }

    end = TAIL_S + SLOW_S
    # Per second: requests beyond the first attempts (hedges, a retry) over
    # the first attempts, and the callers' p99 of the calls started in it.
    seconds = list(range(int(end)))
    extra_series = []
    for s in seconds:
        f = window_sum(first, s, s + 1)
        extra_series.append(100 * window_sum(repeats, s, s + 1) / f if f else 0.0)
    p99_series = [quantile([c[1] for c in calls if s <= c[0] < s + 1], 0.99) or 0.0 for s in seconds]
    # The first second of the slow phase from which every later second's
    # hedges stay below 1% of its first attempts (the last second left out:
    # its calls end after the callers stop counting).
    slow_seconds = [s for s in seconds if s >= TAIL_S and s < end - 1]
    below = None
    for s in slow_seconds:
        if all(extra_series[t] < 1.0 for t in slow_seconds if t >= s):
            below = s - TAIL_S
            break
    hedges = {}
    for (name, labels), _ in after[0].items() if after else []:
        if name == "retryd_hedges_total" and ("upstream", upstream) in labels:
            key = ",".join(f"{k}={v}" for k, v in labels if k != "upstream")
            hedges[key] = delta("retryd_hedges_total", **dict(labels))
    return {
        "scenario": "tail", "label": label, "upstream": upstream, "hedged_by_retryd": hedged_by_retryd,
        "switched_s": switched, "tail": phase(SETTLE_S, TAIL_S), "slow": phase(TAIL_S, end - 1),
        "slow_first_5s": phase(TAIL_S, TAIL_S + 5), "slow_after_5s": phase(TAIL_S + 5, end - 1),
        "below_1pct_after_s": below, "decisions": decisions, "retryd_hedges": hedges,
        "gauges": gauges, "load": os.getloadavg()[0], "upstream_totals": stats["totals"],
        "hedge_explanations": {r["id"]: r.get("hedge_explanations", []) for r in results},
        "series": {"t": seconds, "extra_pct": extra_series, "p99_ms": p99_series},
        "cpu_s": {lang: sum(r["cpu_s"] for r in results if r["lang"] == lang) for lang in ("python", "typescript")},
    }


# ------------------------------------------------------------------ report


def fmt(value: Optional[float], digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def pct(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def denied(decisions: dict[str, int]) -> str:
    hedge = {k: v for k, v in decisions.items() if "hedge" in k and "RETRY" not in k}
    return ", ".join(f"{k.replace('hedge DENY:', '')} {v}" for k, v in sorted(hedge.items(), key=lambda kv: -kv[1])) or "–"


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| phase | strategy | calls | p50 ms | p99 ms | p99.9 ms | p99 ÷ p50 | extra requests | "
           "hedges asked / granted / won | errors |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, name in (("tail", f"2% held 1 s ({SETTLE_S:g}–{TAIL_S:g} s)"),
                      ("slow_first_5s", f"uniformly slow, its first 5 s ({TAIL_S:g}–{TAIL_S + 5:g} s)"),
                      ("slow_after_5s", f"uniformly slow, after ({TAIL_S + 5:g}–{TAIL_S + SLOW_S - 1:g} s)")):
        for row in rows:
            p = row[key]
            ratio = p["p99"] / p["p50"] if p["p50"] and p["p99"] else None
            out.append(f"| {name} | {row['label']} | {p['calls']} | {fmt(p['p50'], 1)} | {fmt(p['p99'], 1)} | "
                       f"{fmt(p['p999'], 1)} | {fmt(ratio, 1)}× | {pct(p['extra'])} | "
                       f"{p['hedges_asked']} / {p['hedges_granted']} / {p['hedges_won']} | {p['errors']} |")
    return "\n".join(out)


def denial_table(rows: list[dict[str, Any]]) -> str:
    out = ["| strategy | hedge answers seen by the callers (whole run) | retryd_hedges_total (whole run) | "
           "slow phase: hedges < 1% of first attempts from |",
           "| --- | --- | --- | ---: |"]
    for row in rows:
        seen = ", ".join(f"{k.replace('hedge ', '')} {v}" for k, v in sorted(row["decisions"].items(), key=lambda kv: -kv[1])
                         if "hedge" in k) or "–"
        metric = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["retryd_hedges"].items()) if v) or "–"
        below = "never" if row["below_1pct_after_s"] is None else f"{row['below_1pct_after_s']} s"
        out.append(f"| {row['label']} | {seen} | {metric} | {below} |")
    return "\n".join(out)


def plots(runner: Any, rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    shade = (TAIL_S, TAIL_S + SLOW_S)
    runner.svg.line_chart(
        os.path.join(out_dir, "tail-extra.svg"),
        "Requests beyond the first attempts at the upstream, per second (% of first attempts)",
        [(row["label"], row["series"]["t"], row["series"]["extra_pct"]) for row in rows],
        shade=shade, shade_label="uniformly slow (200 ms ± 20)", ylabel="% extra requests",
        reference=(5.0, "5% cap"))
    runner.svg.line_chart(
        os.path.join(out_dir, "tail-p99.svg"),
        "Callers' p99 latency of the calls started in each second (ms)",
        [(row["label"], row["series"]["t"], row["series"]["p99_ms"]) for row in rows],
        shade=shade, shade_label="uniformly slow (200 ms ± 20)", ylabel="p99 ms")
    return ["tail-extra.svg", "tail-p99.svg"]


def report(runner: Any, rows: list[dict[str, Any]], args: Any, plot_dir: str, names: list[str]) -> str:
    rel = os.path.relpath(plot_dir, os.path.join(runner.REPO, "docs"))
    delays = []
    for row in rows:
        if row["hedged_by_retryd"] and row["gauges"]:
            tail_delays = [d for t, d, _ in row["gauges"] if SETTLE_S <= t < TAIL_S and d > 0]
            uniform_at = next((t - TAIL_S for t, _, u in row["gauges"] if t >= TAIL_S and u > 0), None)
            delays.append(f"{row['label']}: served delay {fmt(statistics.median(tail_delays) if tail_delays else None, 1)} ms "
                          f"(median over the tail phase), `retryd_hedging_uniformly_slow` 1 from "
                          f"{'never' if uniform_at is None else f'{uniform_at:.0f} s'} into the slow phase")
    lines = [f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{runner.git_head()}`, "
             f"`scripts/fleet tail`, retryd `{args.retryd_bin_label}` (1 replica, memory store, default budget), "
             f"{RATE:g} calls/s (GET, SAFE) from {CALLERS} callers ({', '.join(LANGS)}), per strategy "
             f"{TAIL_S:g} s with 2% of responses held 1 s (the rest 10 ± 2 ms) then {SLOW_S:g} s uniformly slow "
             f"(200 ± 20 ms); load average {os.getloadavg()[0]:.2f} at the end "
             f"(per strategy: {', '.join('%.1f' % row['load'] for row in rows)}).", "",
             table(rows), "", denial_table(rows), ""]
    if delays:
        lines += ["; ".join(delays) + ".", ""]
    lines += [f"![tail: extra requests]({rel}/{names[0]})", "", f"![tail: p99]({rel}/{names[1]})", ""]
    return "\n".join(lines)
