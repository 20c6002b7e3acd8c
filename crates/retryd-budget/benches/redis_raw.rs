//! The Redis store against its own script, raw, in one process: `EVALSHA`
//! of exactly the script the exact-mode store runs once per decision (the
//! `bucket.lua` prelude plus `check.lua`, withdrawing), with the same keys
//! and arguments, through the same client (redis-rs, one multiplexed
//! `ConnectionManager`, with TCP_NODELAY as the store sets it), against
//! `RedisBudgetStore::check` of an `ExactStore` and a `LeasedStore` (what a
//! decision calls), each from the same number of tasks; and the raw script
//! once more with redis-rs's default, Nagle on, to show what NODELAY does.
//! The four alternate in short slices (`--rounds`), so that load from other
//! work hits them alike, and the median of the per-round ratios is reported
//! next to the totals.
//!
//! Not a criterion bench: it needs a Redis, which `scripts/bench` starts,
//! and it prints JSON lines like `retryd-load`'s:
//!
//! ```text
//! cargo bench --bench redis_raw -- --url redis://127.0.0.1:PORT [--duration 5s] [--tasks 64] [--rounds 10]
//! ```
//!
//! Without `--url` (as under `cargo test --all-targets`) it does nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use hdrhistogram::Histogram;
use redis::aio::ConnectionManager;
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig};
use retryd_budget::{BucketConfig, BudgetStore, RedisBudgetStore};

const SCRIPT: &str = retryd_budget::redis::CHECK_SOURCE;

/// The store's idle TTL argument (`IDLE_TTL_MS` in `redis/shared.rs`).
const IDLE_TTL_MS: u64 = 60_000;

struct Args {
    url: Option<String>,
    duration: Duration,
    warmup: Duration,
    tasks: usize,
    rounds: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        url: None,
        duration: Duration::from_secs(5),
        warmup: Duration::from_secs(1),
        tasks: 64,
        rounds: 10,
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
            "--rounds" => {
                args.rounds = value("--rounds")?
                    .parse::<u32>()
                    .map_err(|_| "--rounds: not a number".to_owned())?
                    .max(1)
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

/// One way of making a decision's budget call.
type Call = Arc<dyn Fn() -> BoxFuture<'static, Result<bool, String>> + Send + Sync>;

/// What one side measured over all its slices.
struct Tally {
    latency: Histogram<u64>,
    granted: u64,
    errors: u64,
    elapsed: Duration,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            latency: Histogram::new_with_bounds(1_000, 60_000_000_000, 3)
                .expect("valid constant bounds"),
            granted: 0,
            errors: 0,
            elapsed: Duration::ZERO,
        }
    }

    fn throughput(&self) -> f64 {
        self.latency.len() as f64 / self.elapsed.as_secs_f64()
    }
}

/// Runs `call` from `tasks` tasks for `length`; returns calls per second
/// and adds what it saw to `tally` (unless warming up).
async fn slice(call: &Call, tasks: usize, length: Duration, tally: Option<&mut Tally>) -> f64 {
    let end = Instant::now() + length;
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let call = Arc::clone(call);
            tokio::spawn(async move {
                let mut latency = Tally::new();
                while Instant::now() < end {
                    let sent = Instant::now();
                    let outcome = call().await;
                    latency
                        .latency
                        .saturating_record(sent.elapsed().as_nanos() as u64);
                    match outcome {
                        Ok(granted) => latency.granted += u64::from(granted),
                        Err(_) => latency.errors += 1,
                    }
                }
                latency
            })
        })
        .collect();
    let started = Instant::now();
    let mut total = Tally::new();
    for worker in workers {
        if let Ok(part) = worker.await {
            let _ = total.latency.add(&part.latency);
            total.granted += part.granted;
            total.errors += part.errors;
        }
    }
    let took = started.elapsed();
    let rate = total.latency.len() as f64 / took.as_secs_f64();
    if let Some(tally) = tally {
        let _ = tally.latency.add(&total.latency);
        tally.granted += total.granted;
        tally.errors += total.errors;
        tally.elapsed += took;
    }
    rate
}

async fn store<M: Mode>(url: &str) -> Result<RedisBudgetStore<M>, String> {
    let mode = M::MODE;
    let config = RedisConfig {
        urls: vec![url.into()],
        mode,
        // retryd's defaults.
        timeout: Duration::from_millis(20),
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: format!("retryd-bench-{mode:?}").to_lowercase(),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, 10_000)
        .await
        .map_err(|err| format!("cannot connect the {mode:?} store: {err}"))
}

fn store_call<M: Mode>(store: RedisBudgetStore<M>, config: BucketConfig) -> Call {
    Arc::new(move || {
        let store = store.clone();
        Box::pin(async move {
            store
                .check("upstream-000000", &config, true)
                .await
                .map(|check| check.withdrew)
                .map_err(|err| err.to_string())
        })
    })
}

/// The script called directly on a `ConnectionManager` of its own, with
/// TCP_NODELAY as the store sets it, or with redis-rs's default (Nagle on).
async fn raw_call(url: &str, nodelay: bool, config: BucketConfig) -> Result<Call, String> {
    let mut info =
        redis::IntoConnectionInfo::into_connection_info(url).map_err(|err| err.to_string())?;
    if nodelay {
        info = info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    }
    let client = redis::Client::open(info).map_err(|err| err.to_string())?;
    let connection = ConnectionManager::new(client)
        .await
        .map_err(|err| format!("cannot connect to {url}: {err}"))?;
    // Shared, not cloned per call: a `Script` clone copies its text.
    let script = Arc::new(redis::Script::new(SCRIPT));
    let floor: Arc<str> = format!("{:?}", config.floor_units_per_nano()).into();
    Ok(Arc::new(move || {
        let mut connection = connection.clone();
        let (script, floor) = (Arc::clone(&script), Arc::clone(&floor));
        Box::pin(async move {
            let mut invocation = script.prepare_invoke();
            invocation
                .key("retryd:{u:upstream-000000}:bucket")
                .key("retryd:{u:upstream-000000}:off")
                .key("retryd:{u:upstream-000000}:leases")
                .arg(config.capacity_units())
                .arg(config.initial_units())
                .arg(&*floor)
                .arg(IDLE_TTL_MS)
                .arg("1");
            invocation
                .invoke_async::<Vec<i64>>(&mut connection)
                .await
                .map(|values| values.first() == Some(&1))
                .map_err(|err| err.to_string())
        })
    }))
}

async fn run(url: String, args: Args) -> Result<(), String> {
    // The bucket retryd's bench configuration uses: it never runs dry.
    let config = BucketConfig {
        capacity: 1e9,
        initial: 1e9,
        ratio: 0.1,
        min_per_second: 1000.0,
        ..BucketConfig::default()
    };
    let sides: [(&str, Call); 4] = [
        ("raw", raw_call(&url, true, config).await?),
        ("exact", store_call(store::<Exact>(&url).await?, config)),
        ("leased", store_call(store::<Leased>(&url).await?, config)),
        // What TCP_NODELAY changes, on the same script.
        ("raw_nagle", raw_call(&url, false, config).await?),
    ];
    for (_, call) in &sides {
        slice(call, args.tasks, args.warmup / 3, None).await;
    }
    let length = args.duration / args.rounds;
    let mut tallies: Vec<Tally> = sides.iter().map(|_| Tally::new()).collect();
    let mut ratios: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..args.rounds {
        let mut rates = [0.0; 4];
        for (index, (_, call)) in sides.iter().enumerate() {
            rates[index] = slice(call, args.tasks, length, Some(&mut tallies[index])).await;
        }
        ratios[0].push(rates[1] / rates[0]);
        ratios[1].push(rates[2] / rates[0]);
        ratios[2].push(rates[3] / rates[0]);
    }
    let micros = |nanos: u64| (nanos as f64 / 100.0).round() / 10.0;
    for ((name, _), tally) in sides.iter().zip(&tallies) {
        let label = if name.starts_with("raw") {
            format!("redis.{name}")
        } else {
            format!("redis.store.{name}")
        };
        eprintln!(
            "redis {name}, {} tasks: {:.0}/s, p50 {} µs, p99 {} µs; granted {}, errors {}",
            args.tasks,
            tally.throughput(),
            micros(tally.latency.value_at_quantile(0.5)),
            micros(tally.latency.value_at_quantile(0.99)),
            tally.granted,
            tally.errors,
        );
        println!(
            "{{\"label\":\"{label}\",\"tasks\":{},\"throughput\":{:.1},\"answered\":{},\
             \"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\"granted\":{},\"errors\":{}}}",
            args.tasks,
            tally.throughput(),
            tally.latency.len(),
            micros(tally.latency.value_at_quantile(0.5)),
            micros(tally.latency.value_at_quantile(0.99)),
            micros(tally.latency.value_at_quantile(0.999)),
            tally.granted,
            tally.errors,
        );
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (exact, leased) = (median(&mut ratios[0]), median(&mut ratios[1]));
    let nagle = median(&mut ratios[2]);
    eprintln!(
        "store ÷ raw script, median of {} rounds: exact {exact:.3}, leased {leased:.3}; \
         raw script with Nagle ÷ with TCP_NODELAY {nagle:.3}",
        args.rounds
    );
    println!(
        "{{\"label\":\"redis.store_ratio\",\"rounds\":{},\"exact_vs_raw\":{exact:.4},\"leased_vs_raw\":{leased:.4},\"nagle_vs_nodelay\":{nagle:.4}}}",
        args.rounds
    );
    Ok(())
}
