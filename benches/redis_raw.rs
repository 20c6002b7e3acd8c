//! The Redis store's withdraw script, raw: `EVALSHA` of exactly the script
//! `RedisBudgetStore` runs (the `bucket.lua` prelude plus `withdraw.lua`),
//! with the same keys and arguments, through the same client (redis-rs, one
//! multiplexed `ConnectionManager`), from many tasks at once, for a fixed
//! time. This is the ceiling the exact-mode store is compared with.
//!
//! Not a criterion bench: it needs a Redis, which `scripts/bench` starts,
//! and it prints one JSON line like `retryd-load`'s:
//!
//! ```text
//! cargo bench --bench redis_raw -- --url redis://127.0.0.1:PORT [--duration 5s] [--tasks 64]
//! ```
//!
//! Without `--url` (as under `cargo test --all-targets`) it does nothing.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use redis::aio::ConnectionManager;
use retryd::budget::BucketConfig;

const SCRIPT: &str = concat!(
    include_str!("../src/budget/redis/bucket.lua"),
    "\n",
    include_str!("../src/budget/redis/withdraw.lua")
);

/// The store's idle TTL argument (`IDLE_TTL_MS` in `budget/redis.rs`).
const IDLE_TTL_MS: u64 = 60_000;

struct Args {
    url: Option<String>,
    duration: Duration,
    warmup: Duration,
    tasks: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        url: None,
        duration: Duration::from_secs(5),
        warmup: Duration::from_secs(1),
        tasks: 64,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = |name: &str| words.next().ok_or(format!("{name} needs a value"));
        match word.as_str() {
            "--url" => args.url = Some(value("--url")?),
            "--duration" => {
                args.duration = humantime::parse_duration(&value("--duration")?)
                    .map_err(|err| format!("--duration: {err}"))?
            }
            "--warmup" => {
                args.warmup = humantime::parse_duration(&value("--warmup")?)
                    .map_err(|err| format!("--warmup: {err}"))?
            }
            "--tasks" => {
                args.tasks = value("--tasks")?
                    .parse()
                    .map_err(|_| "--tasks: not a number".to_owned())?
            }
            // cargo passes --bench; criterion-style filters are ignored.
            _ => {}
        }
    }
    Ok(args)
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("redis_raw: {message}");
            std::process::exit(2);
        }
    };
    let Some(url) = args.url.clone() else {
        eprintln!("redis_raw: no --url given; nothing to measure");
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime for the benchmark");
    if let Err(message) = runtime.block_on(run(url, args)) {
        eprintln!("redis_raw: {message}");
        std::process::exit(1);
    }
}

async fn run(url: String, args: Args) -> Result<(), String> {
    let client = redis::Client::open(url.as_str()).map_err(|err| err.to_string())?;
    let connection = ConnectionManager::new(client)
        .await
        .map_err(|err| format!("cannot connect to {url}: {err}"))?;
    let script = redis::Script::new(SCRIPT);
    // The bucket retryd's bench configuration uses: it never runs dry.
    let config = BucketConfig {
        capacity: 1e9,
        initial: 1e9,
        ratio: 0.1,
        min_per_second: 1000.0,
        ..BucketConfig::default()
    };
    let floor = format!("{:?}", config.floor_units_per_nano());
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;

    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            let mut connection = connection.clone();
            let script = script.clone();
            let floor = floor.clone();
            tokio::spawn(async move {
                let mut latency = Histogram::<u64>::new_with_bounds(1_000, 60_000_000_000, 3)
                    .expect("valid constant bounds");
                let (mut granted, mut errors) = (0u64, 0u64);
                loop {
                    let sent = Instant::now();
                    if sent >= end {
                        break;
                    }
                    let reply: redis::RedisResult<Vec<i64>> = script
                        .key("retryd:{u:upstream-000000}:bucket")
                        .key("retryd:{u:upstream-000000}:off")
                        .key("retryd:{u:upstream-000000}:leases")
                        .arg(config.capacity_units())
                        .arg(config.initial_units())
                        .arg(&floor)
                        .arg(IDLE_TTL_MS)
                        .invoke_async(&mut connection)
                        .await;
                    let done = Instant::now();
                    if sent < measure_from || done > end {
                        continue;
                    }
                    match reply {
                        Ok(values) => {
                            latency.saturating_record((done - sent).as_nanos() as u64);
                            granted += u64::from(values.first() == Some(&1));
                        }
                        Err(_) => errors += 1,
                    }
                }
                (latency, granted, errors)
            })
        })
        .collect();
    let mut latency =
        Histogram::<u64>::new_with_bounds(1_000, 60_000_000_000, 3).expect("valid constant bounds");
    let (mut granted, mut errors) = (0u64, 0u64);
    for task in tasks {
        let (histogram, task_granted, task_errors) = task
            .await
            .map_err(|err| format!("a task panicked: {err}"))?;
        let _ = latency.add(&histogram);
        granted += task_granted;
        errors += task_errors;
    }
    let calls = latency.len();
    let throughput = calls as f64 / args.duration.as_secs_f64();
    let micros = |nanos: u64| (nanos as f64 / 100.0).round() / 10.0;
    eprintln!(
        "redis raw withdraw script, {} tasks: {throughput:.0}/s, p50 {} µs, p99 {} µs; granted {granted}, errors {errors}",
        args.tasks,
        micros(latency.value_at_quantile(0.5)),
        micros(latency.value_at_quantile(0.99)),
    );
    println!(
        "{{\"label\":\"redis.raw\",\"tasks\":{},\"throughput\":{throughput:.1},\"answered\":{calls},\
         \"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\"granted\":{granted},\"errors\":{errors}}}",
        args.tasks,
        micros(latency.value_at_quantile(0.5)),
        micros(latency.value_at_quantile(0.99)),
        micros(latency.value_at_quantile(0.999)),
    );
    Ok(())
}
