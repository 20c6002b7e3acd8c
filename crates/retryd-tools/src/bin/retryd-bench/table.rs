//! BENCHMARKS.md's table from one run's results: criterion's medians
//! (`criterion/**/new/`), its interleaved ratios (`criterion.log`), and
//! the rows of `results.jsonl`. Every ratio is against a reference of the
//! same run: the baseline server, the memory store, or the previous
//! configuration's neighbour in time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// What the table is made from.
pub(crate) struct Inputs<'a> {
    pub(crate) out: &'a Path,
    pub(crate) rows: &'a [Value],
    pub(crate) redis_measured: bool,
    pub(crate) load_before: &'a str,
    pub(crate) load_after: &'a str,
}

/// h2load's throughput (req/s) and succeeded count, 0 where it printed none.
pub(crate) fn parse_h2load(text: &str) -> (f64, u64) {
    // "finished in 3.00s, 41234.56 req/s, 3.21MB/s" and "... 123 succeeded, ..."
    let throughput = text
        .lines()
        .find_map(|line| {
            let rest = line.trim().strip_prefix("finished in ")?;
            let (_, after) = rest.split_once(", ")?;
            after.split_once(" req/s")?.0.trim().parse().ok()
        })
        .unwrap_or(0.0);
    let succeeded = text
        .split([',', '\n'])
        .find_map(|part| {
            part.trim()
                .strip_suffix(" succeeded")?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0);
    (throughput, succeeded)
}

fn fmt_rate(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M/s", x / 1e6)
    } else {
        format!("{:.1} k/s", x / 1e3)
    }
}

/// Digits grouped by thousands, as Python's `{:,}`.
fn grouped(value: f64, decimals: usize) -> String {
    let text = format!("{:.*}", decimals, value.abs());
    let (whole, fraction) = text
        .split_once('.')
        .map_or((text.as_str(), None), |(w, f)| (w, Some(f)));
    let mut out = String::new();
    for (i, digit) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    if let Some(fraction) = fraction {
        out.push('.');
        out.push_str(fraction);
    }
    if value < 0.0 { format!("-{out}") } else { out }
}

fn us(x: f64) -> String {
    if x >= 100.0 {
        format!("{} µs", grouped(x, 0))
    } else {
        format!("{x:.1} µs")
    }
}

fn percent(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

fn num(row: &Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or(0.0)
}

/// The mean of a group of interleaved runs.
struct Aggregate {
    throughput: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    errors: f64,
    verdicts: (f64, f64, f64),
}

struct Rows<'a>(&'a [Value]);

impl<'a> Rows<'a> {
    fn runs(&self, prefix: &str) -> Vec<&'a Value> {
        self.0
            .iter()
            .filter(|row| {
                row["label"]
                    .as_str()
                    .is_some_and(|label| label.starts_with(prefix))
            })
            .collect()
    }

    fn one(&self, label: &str) -> Option<&'a Value> {
        self.0.iter().rev().find(|row| row["label"] == label)
    }

    fn agg(&self, prefix: &str) -> Option<Aggregate> {
        let found = self.runs(prefix);
        if found.is_empty() {
            return None;
        }
        let mean =
            |key: &str| found.iter().map(|row| num(row, key)).sum::<f64>() / found.len() as f64;
        let sum = |key: &str| found.iter().map(|row| num(row, key)).sum::<f64>();
        Some(Aggregate {
            throughput: mean("throughput"),
            p50: mean("p50_us"),
            p99: mean("p99_us"),
            p999: mean("p999_us"),
            errors: sum("errors"),
            verdicts: (sum("retry"), sum("deny"), sum("ambiguous")),
        })
    }
}

/// Criterion's median per (group, function), in ns: robust to the other
/// work sharing the cores.
fn criterion_medians(dir: &Path) -> BTreeMap<(String, String), f64> {
    let mut medians = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .file_name()
                .is_some_and(|name| name == "benchmark.json")
                && path
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|name| name == "new")
            {
                let read = |path: &Path| -> Option<Value> {
                    serde_json::from_str(&fs::read_to_string(path).ok()?).ok()
                };
                let (Some(meta), Some(estimates)) =
                    (read(&path), read(&path.with_file_name("estimates.json")))
                else {
                    continue;
                };
                let (Some(group), Some(function), Some(median)) = (
                    meta["group_id"].as_str(),
                    meta["function_id"].as_str(),
                    estimates["median"]["point_estimate"].as_f64(),
                ) else {
                    continue;
                };
                medians.insert((group.to_owned(), function.to_owned()), median);
            }
        }
    }
    medians
}

/// The `ratio KEY: VALUE` and `parallelism KEY: VALUE` lines the budget
/// bench prints.
fn bench_lines(log: &str, prefix: &str) -> BTreeMap<String, f64> {
    log.lines()
        .filter_map(|line| {
            let (key, value) = line.strip_prefix(prefix)?.rsplit_once(':')?;
            Some((key.trim().to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

fn output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The table, as BENCHMARKS.md shows it between its markers.
pub(crate) fn render(inputs: &Inputs<'_>) -> anyhow::Result<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut emit = |line: String| lines.push(line);
    let rows = Rows(inputs.rows);
    let crit = criterion_medians(&inputs.out.join("criterion"));
    let criterion_log = fs::read_to_string(inputs.out.join("criterion.log")).unwrap_or_default();
    let ratios = bench_lines(&criterion_log, "ratio ");
    let parallel = bench_lines(&criterion_log, "parallelism ");
    let cores = std::thread::available_parallelism().map_or(1, usize::from);

    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    let rustc = output("rustc", &["--version"]);
    let rev = output("git", &["rev-parse", "--short", "HEAD"]);
    let dirty = !output("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty();
    let date = output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    emit(format!(
        "Run: {date}, `{rev}{}`, {cores} cores ({cpu}), {rustc}, server and load generator sharing the cores; \
         load average {} before the gRPC runs, {} after (anything above ~2 is other work competing for the 2 cores).",
        if dirty { "+changes" } else { "" },
        inputs.load_before,
        inputs.load_after
    ));
    emit(String::new());

    // --- engine ---
    emit("**Engine** (`engine::decide`, criterion median, ns per decision)".into());
    emit(String::new());
    emit("| case | ns |".into());
    emit("| --- | ---: |".into());
    let engine: Vec<(&str, f64)> = crit
        .iter()
        .filter(|((group, _), _)| group == "engine")
        .map(|((_, function), ns)| (function.as_str(), *ns))
        .collect();
    for (name, ns) in &engine {
        emit(format!("| {name} | {ns:.1} |"));
    }
    for ((group, name), ns) in &crit {
        if group == "explain" {
            emit(format!(
                "| explanation text (`Decision::explanation`), {name} | {ns:.1} |"
            ));
        }
    }
    emit(String::new());

    // --- budget ---
    emit(format!(
        "**Budget store vs governor vs tower** (criterion median; contended = {cores} threads on one key, \
         wall time per operation, i.e. 1 / aggregate throughput)"
    ));
    emit(String::new());
    emit("| operation | implementation | single-thread ns | contended ns | contended ops/s | memory ÷ this (contended) |".into());
    emit("| --- | --- | ---: | ---: | ---: | ---: |".into());
    let get = |group: String, function: &str| crit.get(&(group, function.to_owned())).copied();
    for op in ["withdraw", "withdraw_deposit"] {
        let memory_contended = get(format!("budget_contended/{op}"), "memory");
        for implementation in [
            "memory",
            "memory_os_clock",
            "governor_keyed",
            "governor_direct",
            "tower_tps",
        ] {
            let single = get(format!("budget_single/{op}"), implementation);
            let contended = get(format!("budget_contended/{op}"), implementation);
            let (Some(single), Some(contended)) = (single, contended) else {
                continue;
            };
            let ratio = match memory_contended {
                Some(memory) if implementation != "memory" && memory > 0.0 => {
                    format!("{:.2}×", contended / memory)
                }
                _ => String::new(),
            };
            emit(format!(
                "| {op} | {implementation} | {single:.1} | {contended:.1} | {} | {ratio} |",
                fmt_rate(1e9 / contended)
            ));
        }
    }
    emit(String::new());
    emit("A ratio above 1× means the memory store is faster than that implementation.".into());
    emit(String::new());
    if !ratios.is_empty() {
        emit(
            "Interleaved ratios (batches of each alternate, so load from other work hits both alike; \
             median over 101 rounds of time(other) ÷ time(memory); above 1× the memory store is faster):"
                .into(),
        );
        emit(String::new());
        emit("| comparison | single thread | contended |".into());
        emit("| --- | ---: | ---: |".into());
        // Keys are "budget_single/OP PAIR": one row per (PAIR, OP).
        let mut pairs: Vec<(String, String)> = ratios
            .keys()
            .filter_map(|key| {
                let (group, pair) = key.split_once(' ')?;
                let op = group.split_once('/')?.1;
                Some((pair.to_owned(), op.to_owned()))
            })
            .collect();
        pairs.sort();
        pairs.dedup();
        for (pair, op) in pairs {
            let cell = |group: &str| {
                ratios
                    .get(&format!("{group}/{op} {pair}"))
                    .map_or_else(String::new, |x| format!("{x:.2}×"))
            };
            emit(format!(
                "| {op}: {} | {} | {} |",
                pair.replace('/', " vs "),
                cell("budget_single"),
                cell("budget_contended")
            ));
        }
        emit(String::new());
    }
    if !parallel.is_empty() {
        let listed: Vec<String> = parallel
            .iter()
            .map(|(key, value)| {
                format!(
                    "{} {value:.2}",
                    key.split_once('/').map_or(key.as_str(), |(_, rest)| rest)
                )
            })
            .collect();
        emit(format!(
            "Threads actually running at once in the contended rows (CPU time ÷ wall time, 2.00 = both all along): {}.",
            listed.join(", ")
        ));
        emit(String::new());
    }

    // --- gRPC ---
    let (bu, mu, lu) = (
        rows.agg("baseline.unary."),
        rows.agg("memory.unary."),
        rows.agg("limits.unary."),
    );
    let (bs, ms) = (rows.agg("baseline.stream."), rows.agg("memory.stream."));
    emit("**gRPC, saturated** (`retryd-load`, mean of interleaved rounds; verdict mix retry:deny:ambiguous = 2:1:1)".into());
    emit(String::new());
    emit("| server | RPC | throughput | p50 | p99 | p99.9 | ratio |".into());
    emit("| --- | --- | ---: | ---: | ---: | ---: | --- |".into());
    let cells = |a: &Aggregate| {
        format!(
            "{} | {} | {} | {}",
            fmt_rate(a.throughput),
            us(a.p50),
            us(a.p99),
            us(a.p999)
        )
    };
    if let (Some(bu), Some(mu)) = (&bu, &mu) {
        emit(format!(
            "| baseline (canned answers) | Decide | {} | |",
            cells(bu)
        ));
        if let Some(lu) = &lu {
            emit(format!(
                "| baseline set up as retryd (`[server]` defaults, routes) | Decide | {} | {:.2}× baseline |",
                cells(lu),
                lu.throughput / bu.throughput
            ));
        }
        emit(format!(
            "| retryd, memory store | Decide | {} | {:.2}× baseline |",
            cells(mu),
            mu.throughput / bu.throughput
        ));
    }
    if let (Some(bs), Some(ms), Some(mu)) = (&bs, &ms, &mu) {
        emit(format!(
            "| baseline (canned answers) | DecideStream | {} | |",
            cells(bs)
        ));
        emit(format!(
            "| retryd, memory store | DecideStream | {} | {:.2}× baseline stream, {:.1}× retryd Decide |",
            cells(ms),
            ms.throughput / bs.throughput,
            ms.throughput / mu.throughput
        ));
    }
    if let Some(mu) = &mu {
        let (retry, deny, ambiguous) = mu.verdicts;
        emit(String::new());
        emit(format!(
            "retryd answered {} RETRY, {} DENY, {} AMBIGUOUS in the measured Decide runs; errors: {}.",
            grouped(retry, 0),
            grouped(deny, 0),
            grouped(ambiguous, 0),
            mu.errors + ms.as_ref().map_or(0.0, |ms| ms.errors)
        ));
    }
    emit(String::new());

    // --- latency under load ---
    emit(
        "**Decide latency at a fixed rate** (open loop: evenly spaced arrivals, latency from the arrival; \
         two rounds, servers alternating). CPU is what the generator and the server used during the run, \
         in cores; *busy* is both together as a share of the machine's cores."
            .into(),
    );
    emit(String::new());
    let cpu_cells = |row: &Value| {
        if row.get("wall_s").is_none() {
            return "| | | |".to_owned();
        }
        let wall = num(row, "wall_s");
        let (load, server) = (
            num(row, "load_cpu_s") / wall,
            num(row, "server_cpu_s") / wall,
        );
        format!(
            "| {load:.2} | {server:.2} | {} |",
            percent((load + server) / cores as f64)
        )
    };
    let latency_table = |emit: &mut dyn FnMut(String),
                         table: Vec<(String, u32, Option<&Value>)>| {
        emit("| server | offered | round | achieved | p50 | p90 | p99 | p99.9 | generator CPU | server CPU | busy |".into());
        emit(
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |".into(),
        );
        for (name, round, row) in table {
            if let Some(row) = row {
                emit(format!(
                    "| {name} | {} | {round} | {} | {} | {} | {} | {} {}",
                    fmt_rate(num(row, "rate")),
                    fmt_rate(num(row, "throughput")),
                    us(num(row, "p50_us")),
                    us(num(row, "p90_us")),
                    us(num(row, "p99_us")),
                    us(num(row, "p999_us")),
                    cpu_cells(row)
                ));
            }
        }
        emit(String::new());
    };
    let server_name = |server: &str| {
        if server == "baseline" {
            "baseline"
        } else {
            "retryd memory"
        }
    };
    let mut at_fractions = Vec::new();
    for server in ["baseline", "memory"] {
        for pct in [10, 50, 90] {
            for round in [1, 2] {
                at_fractions.push((
                    format!("{}, {pct}% of its saturation", server_name(server)),
                    round,
                    rows.one(&format!("{server}.at{pct}.{round}")),
                ));
            }
        }
    }
    latency_table(&mut emit, at_fractions);
    let mut pinned = Vec::new();
    for server in ["baseline", "memory"] {
        let Some(sat) = rows.one(&format!("{server}.pinned.sat")) else {
            continue;
        };
        for pct in [50, 90] {
            for round in [1, 2] {
                pinned.push((
                    format!(
                        "{}, {pct}% of {}",
                        server_name(server),
                        fmt_rate(num(sat, "throughput"))
                    ),
                    round,
                    rows.one(&format!("{server}.pinned.at{pct}.{round}")),
                ));
            }
        }
    }
    if !pinned.is_empty() {
        emit(
            "The same, with the server pinned to core 1 and the generator to core 0 (`taskset`), each at 50% and 90% \
             of its own saturation measured pinned, two rounds each:"
                .into(),
        );
        emit(String::new());
        latency_table(&mut emit, pinned);
    }

    // --- scaling ---
    emit("**Scaling with the number of upstreams** (retryd, memory store, `limits.max_upstreams` = upstreams; saturated)".into());
    emit(String::new());
    emit("| upstreams | Decide | Decide p99 | DecideStream | DecideStream p99 |".into());
    emit("| ---: | ---: | ---: | ---: | ---: |".into());
    if let (Some(mu), Some(ms)) = (&mu, &ms) {
        let mut scale = vec![(1u64, rows.agg("memory.unary."), rows.agg("memory.stream."))];
        for n in [1000u64, 100_000] {
            scale.push((
                n,
                rows.agg(&format!("memory.unary.up{n}")),
                rows.agg(&format!("memory.stream.up{n}")),
            ));
        }
        for (n, unary, stream) in scale {
            let (Some(unary), Some(stream)) = (unary, stream) else {
                continue;
            };
            let (ru, rs) = if n == 1 {
                (String::new(), String::new())
            } else {
                (
                    format!(" ({:.2}×)", unary.throughput / mu.throughput),
                    format!(" ({:.2}×)", stream.throughput / ms.throughput),
                )
            };
            emit(format!(
                "| {} | {}{ru} | {} | {}{rs} | {} |",
                grouped(n as f64, 0),
                fmt_rate(unary.throughput),
                us(unary.p99),
                fmt_rate(stream.throughput),
                us(stream.p99)
            ));
        }
    }
    emit(String::new());

    // --- redis ---
    emit("**Redis store** (own `redis-server` on loopback, no persistence)".into());
    emit(String::new());
    let (re, rl) = (
        rows.agg("redis-exact.unary."),
        rows.agg("redis-leased.unary."),
    );
    let (bre, mre) = (
        rows.agg("baseline-redis.unary."),
        rows.agg("memory-redis-round.unary."),
    );
    let (raw, sre, srl, sratio) = (
        rows.one("redis.raw"),
        rows.one("redis.store.exact"),
        rows.one("redis.store.leased"),
        rows.one("redis.store_ratio"),
    );
    if !inputs.redis_measured || (re.is_none() && rl.is_none()) {
        emit("Not measured: `retryd serve` did not start with `[store] kind = \"redis\"` (see target/bench-run/redis-*.err).".into());
    } else {
        emit("Through gRPC (`retryd-load`, saturated, mean of two interleaved rounds):".into());
        emit(String::new());
        emit(
            "| server | Decide | p50 | p99 | RETRY share (50% expected) | p99 at 50% | ratio |"
                .into(),
        );
        emit("| --- | ---: | ---: | ---: | ---: | ---: | --- |".into());
        if let Some(bre) = &bre {
            emit(format!(
                "| baseline + the exact store's script per call | {} | {} | {} | | | |",
                fmt_rate(bre.throughput),
                us(bre.p50),
                us(bre.p99)
            ));
        }
        if let Some(mre) = &mre {
            emit(format!(
                "| retryd, memory store | {} | {} | {} | | | |",
                fmt_rate(mre.throughput),
                us(mre.p50),
                us(mre.p99)
            ));
        }
        for (mode, run) in [("exact", &re), ("leased", &rl)] {
            let Some(run) = run else { continue };
            let half = rows.one(&format!("redis-{mode}.at50"));
            let mut parts = Vec::new();
            if let Some(mre) = &mre {
                parts.push(format!("{:.2}× memory", run.throughput / mre.throughput));
            }
            if let (true, Some(bre)) = (mode == "exact", &bre) {
                parts.push(format!(
                    "{:.2}× baseline + script",
                    run.throughput / bre.throughput
                ));
            }
            let (retry, deny, ambiguous) = run.verdicts;
            let share = retry / (retry + deny + ambiguous).max(1.0);
            emit(format!(
                "| retryd, redis {mode} | {} | {} | {} | {:.0}% | {} | {} |",
                fmt_rate(run.throughput),
                us(run.p50),
                us(run.p99),
                100.0 * share,
                half.map_or_else(String::new, |half| us(num(half, "p99_us"))),
                parts.join(", ")
            ));
        }
        emit(String::new());
        emit(
            "A RETRY share below 50% means RETRY verdicts became budget denials: store calls that timed out \
             (`store.timeout`) fell back to the local bucket, which starts empty."
                .into(),
        );
        emit(String::new());
        if let (Some(raw), Some(_)) = (raw, sre) {
            let tasks = raw
                .get("tasks")
                .map_or_else(|| "?".to_owned(), Value::to_string);
            emit(format!(
                "In one process (`benches/redis_raw.rs`, {tasks} tasks each, alternating slices; \
                 `RedisBudgetStore::check` withdrawing, as a RETRY decision calls it, against `EVALSHA` of the same script):"
            ));
            emit(String::new());
            emit("| caller | calls/s | p50 | p99 | ÷ raw script (median of rounds) |".into());
            emit("| --- | ---: | ---: | ---: | ---: |".into());
            emit(format!(
                "| raw script (redis-rs `ConnectionManager`) | {} | {} | {} | |",
                fmt_rate(num(raw, "throughput")),
                us(num(raw, "p50_us")),
                us(num(raw, "p99_us"))
            ));
            for (name, run, key) in [
                ("exact", sre, "exact_vs_raw"),
                ("leased", srl, "leased_vs_raw"),
            ] {
                let Some(run) = run else { continue };
                let ratio =
                    sratio.map_or_else(String::new, |ratios| format!("{:.2}×", num(ratios, key)));
                emit(format!(
                    "| store, {name} mode | {} | {} | {} | {ratio} |",
                    fmt_rate(num(run, "throughput")),
                    us(num(run, "p50_us")),
                    us(num(run, "p99_us"))
                ));
            }
            emit(String::new());
        }
    }
    emit(String::new());

    // --- h2load ---
    let h2: Vec<&Value> = rows.runs("h2load.");
    if !h2.is_empty() {
        emit("**Cross-check with h2load** (`-c4 -m32`, one RETRY-kind request repeated)".into());
        emit(String::new());
        emit("| server | h2load Decide/s | retryd-load Decide/s |".into());
        emit("| --- | ---: | ---: |".into());
        for (server, mine) in [("baseline", &bu), ("memory", &mu)] {
            if let (Some(row), Some(mine)) = (rows.one(&format!("h2load.{server}")), mine) {
                emit(format!(
                    "| {server} | {} | {} |",
                    fmt_rate(num(row, "throughput")),
                    fmt_rate(mine.throughput)
                ));
            }
        }
        emit(String::new());
    }

    // --- callgrind ---
    let per_call = |server: &str, work: &str| {
        let idle = rows.one(&format!("callgrind.{server}.idle"))?;
        let run = rows.one(&format!("callgrind.{server}.{work}"))?;
        let calls = num(run, "calls");
        (calls > 0.0).then(|| (num(run, "instructions") - num(idle, "instructions")) / calls)
    };
    let cg_rows: Vec<(&str, Option<f64>, Option<f64>)> = ["unary", "stream"]
        .into_iter()
        .map(|work| (work, per_call("baseline", work), per_call("memory", work)))
        .collect();
    if cg_rows.iter().any(|(_, b, m)| b.is_some() && m.is_some()) {
        emit(
            "**Instructions per call, server side** (callgrind; a fixed number of calls from `retryd-load --requests`, \
             minus an idle run of the same server; not timed, so not moved by the machine's other work)"
                .into(),
        );
        emit(String::new());
        emit("| call | baseline | retryd, memory store | retryd ÷ baseline |".into());
        emit("| --- | ---: | ---: | ---: |".into());
        for (work, baseline, memory) in &cg_rows {
            if let (Some(b), Some(m)) = (baseline, memory) {
                let name = if *work == "unary" {
                    "Decide (unary, 4 × 32 in flight)"
                } else {
                    "DecideStream item (2 streams × 256 in flight)"
                };
                emit(format!(
                    "| {name} | {} | {} | {:.2}× |",
                    grouped(*b, 0),
                    grouped(*m, 0),
                    m / b
                ));
            }
        }
        emit(String::new());
    }

    // --- targets ---
    emit("**Targets** (issue 6; each a ratio within this run)".into());
    emit(String::new());
    emit("| target | measured | met |".into());
    emit("| --- | --- | --- |".into());
    let target = |emit: &mut dyn FnMut(String), name: &str, text: String, ok: bool| {
        emit(format!(
            "| {name} | {text} | {} |",
            if ok { "yes" } else { "no" }
        ));
    };
    if let (Some(bu), Some(mu)) = (&bu, &mu) {
        let x = mu.throughput / bu.throughput;
        target(
            &mut emit,
            "unary Decide ≥ 0.85 × baseline",
            format!("{x:.3}×"),
            x >= 0.85,
        );
    }
    if let (Some(mu), Some(ms)) = (&mu, &ms) {
        let x = ms.throughput / mu.throughput;
        target(
            &mut emit,
            "DecideStream ≥ 10 × unary Decide",
            format!("{x:.1}×"),
            x >= 10.0,
        );
    }
    if let Some((name, ns)) = engine.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1)) {
        target(
            &mut emit,
            "engine decide < 200 ns",
            format!("slowest case {name}: {ns:.0} ns"),
            ns < 200.0,
        );
    }
    let interleaved = ratios.get("budget_contended/withdraw memory/governor_keyed");
    let memory_contended = get("budget_contended/withdraw".into(), "memory");
    let governor_contended = get("budget_contended/withdraw".into(), "governor_keyed");
    if let Some(&x) = interleaved {
        let par = parallel
            .get("budget_contended/withdraw/memory")
            .map_or_else(String::new, |par| {
                format!(" (threads ran in parallel {par:.2} of 2)")
            });
        target(
            &mut emit,
            "memory store ≥ governor under contention",
            format!("withdraw, keyed, interleaved: {x:.2}× governor's throughput{par}"),
            x >= 1.0,
        );
    } else if let (Some(memory), Some(governor)) = (memory_contended, governor_contended) {
        target(
            &mut emit,
            "memory store ≥ governor under contention",
            format!(
                "withdraw, keyed: {:.2}× governor's throughput",
                governor / memory
            ),
            memory <= governor,
        );
    }
    let busy = |row: &Value| {
        if row.get("wall_s").is_none() {
            return f64::NAN;
        }
        (num(row, "load_cpu_s") + num(row, "server_cpu_s")) / num(row, "wall_s") / cores as f64
    };
    let at50: Vec<&Value> = [1, 2]
        .iter()
        .filter_map(|round| rows.one(&format!("memory.at50.{round}")))
        .collect();
    let base50: Vec<&Value> = [1, 2]
        .iter()
        .filter_map(|round| rows.one(&format!("baseline.at50.{round}")))
        .collect();
    let p99s = |found: &[&Value]| {
        found
            .iter()
            .map(|row| us(num(row, "p99_us")))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    if !at50.is_empty() {
        let worst = at50
            .iter()
            .map(|row| num(row, "p99_us"))
            .fold(f64::MIN, f64::max);
        let busiest = at50.iter().map(|row| busy(row)).fold(f64::MIN, f64::max);
        let baseline = if base50.is_empty() {
            String::new()
        } else {
            format!(" (baseline: {})", p99s(&base50))
        };
        target(
            &mut emit,
            "unary p99 at 50% of saturation < 1 ms, cores shared",
            format!(
                "{} in two rounds{baseline}; generator and server kept the machine {} busy",
                p99s(&at50),
                percent(busiest)
            ),
            worst < 1000.0,
        );
    }
    let pinned50: Vec<&Value> = [1, 2]
        .iter()
        .filter_map(|round| rows.one(&format!("memory.pinned.at50.{round}")))
        .collect();
    if !pinned50.is_empty() {
        let best = pinned50
            .iter()
            .map(|row| num(row, "p99_us"))
            .fold(f64::MAX, f64::min);
        let worst = pinned50
            .iter()
            .map(|row| num(row, "p99_us"))
            .fold(f64::MIN, f64::max);
        target(
            &mut emit,
            "unary p99 at 50% of saturation < 1 ms, pinned",
            format!("{} and {} in two rounds", us(best), us(worst)),
            worst < 1000.0,
        );
    }
    match (&rl, &mre) {
        (Some(rl), Some(mre)) if inputs.redis_measured => {
            let x = rl.throughput / mre.throughput;
            target(
                &mut emit,
                "Redis leased ≥ 0.8 × memory",
                format!("{x:.2}× (Decide, interleaved rounds)"),
                x >= 0.8,
            );
        }
        _ => emit("| Redis leased ≥ 0.8 × memory | not measured | |".into()),
    }
    match (&re, &bre) {
        (Some(re), Some(bre)) if inputs.redis_measured => {
            let x = re.throughput / bre.throughput;
            target(
                &mut emit,
                "Redis exact ≥ 0.8 × raw script, through gRPC",
                format!("{x:.2}× the baseline running the script per call"),
                x >= 0.8,
            );
        }
        _ => emit("| Redis exact ≥ 0.8 × raw script, through gRPC | not measured | |".into()),
    }
    if let Some(ratios) = sratio {
        let x = num(ratios, "exact_vs_raw");
        target(
            &mut emit,
            "Redis exact ≥ 0.8 × raw script, in process",
            format!("{x:.2}× (store `check` ÷ `EVALSHA`)"),
            x >= 0.8,
        );
    }
    let mut table = String::new();
    for line in &lines {
        writeln!(table, "{line}")?;
    }
    Ok(table.trim_end_matches('\n').to_owned())
}
