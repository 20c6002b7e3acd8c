//! The memory budget store against the `governor` crate's rate limiter and
//! tower's retry budget (`TpsBudget`), single-threaded and contended on
//! every core, in one run so that the figures can be read as ratios.
//!
//! What is compared (all on the real clock, all answering "yes"):
//! - `withdraw`: spend one unit of budget for one key. The memory store's
//!   `try_withdraw` (clock, map lookup, refill check, CAS) against
//!   governor's keyed `check_key` (clock, DashMap lookup, CAS): the same
//!   work. Governor's unkeyed `check` and tower's `withdraw` (one budget, no
//!   key) are listed as floors: they skip the lookup.
//! - `withdraw_deposit`: one retry spent and one real request reported, the
//!   pair a budget does per call. The memory store's `try_withdraw` +
//!   `deposit` against tower's `withdraw` + `deposit`. Governor has no
//!   deposit (its refill is time alone), so it has no row here.
//!
//! Contended rows run the same loop on as many threads as there are cores,
//! all on one key (the worst case: the whole fleet retrying one upstream),
//! and report wall time per operation summed over threads, i.e. the inverse
//! of aggregate throughput.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use futures::FutureExt as _;
use governor::{Quota, RateLimiter};
use retryd_budget::memory::Clock;
use retryd_budget::{BucketConfig, BudgetStore, MemoryBudgetStore};
use tower::retry::budget::{Budget as _, TpsBudget};

const KEY: &str = "payments-api";

/// A bucket that never runs dry within a benchmark, so every withdrawal
/// does its write (a refused withdrawal only reads).
fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 1e9,
        initial: 1e9,
        ratio: 1.0,
        min_per_second: 1.0,
        ..BucketConfig::default()
    }
}

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::MAX).allow_burst(NonZeroU32::MAX)
}

/// A tower budget whose reserve outlasts any benchmark: deposits and
/// withdrawals are one unit each.
fn tps_budget() -> TpsBudget {
    TpsBudget::new(Duration::from_secs(10), (i32::MAX - 1) as u32, 1.0)
}

/// retryd's `Clock` on the OS monotonic clock (`std::time::Instant`, a
/// vDSO call): what the memory store read before it moved to the TSC, kept
/// to show what that move bought.
struct OsClock(Instant);

impl Clock for OsClock {
    fn now_nanos(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
}

/// The operations under test, each shared by all threads of a contended run.
struct Contenders {
    store: MemoryBudgetStore,
    store_os: MemoryBudgetStore<OsClock>,
    config: BucketConfig,
    keyed: governor::DefaultKeyedRateLimiter<String>,
    key: String,
    direct: governor::DefaultDirectRateLimiter,
    tower: TpsBudget,
}

impl Contenders {
    fn new() -> Self {
        let contenders = Contenders {
            store: MemoryBudgetStore::new(16),
            store_os: MemoryBudgetStore::with_clock(16, OsClock(Instant::now())),
            config: bucket(),
            keyed: RateLimiter::keyed(quota()),
            key: KEY.to_owned(),
            direct: RateLimiter::direct(quota()),
            tower: tps_budget(),
        };
        // Create every key up front: creation is not what is measured, and
        // each operation must succeed.
        assert!(
            ready(contenders.store.try_withdraw(KEY, &contenders.config))
                .expect("the store tracks 16 upstreams")
                .is_some()
        );
        assert!(
            ready(contenders.store_os.try_withdraw(KEY, &contenders.config))
                .expect("the store tracks 16 upstreams")
                .is_some()
        );
        assert!(contenders.keyed.check_key(&contenders.key).is_ok());
        assert!(contenders.direct.check().is_ok());
        contenders.tower.deposit();
        assert!(contenders.tower.withdraw());
        contenders
    }
}

type Op = fn(&Contenders) -> bool;

/// The output of a memory store future, which is ready when returned:
/// polled once, as `.await` on the gRPC path does, with no executor.
fn ready<T>(future: impl std::future::Future<Output = T>) -> T {
    future
        .now_or_never()
        .expect("the memory store's futures are ready when returned")
}

fn memory_withdraw(c: &Contenders) -> bool {
    matches!(
        ready(c.store.try_withdraw(black_box(KEY), &c.config)),
        Ok(Some(_))
    )
}

fn memory_os_clock_withdraw(c: &Contenders) -> bool {
    matches!(
        ready(c.store_os.try_withdraw(black_box(KEY), &c.config)),
        Ok(Some(_))
    )
}

fn memory_withdraw_deposit(c: &Contenders) -> bool {
    let spent = memory_withdraw(c);
    ready(c.store.deposit(black_box(KEY), &c.config, 1)).is_ok() && spent
}

fn governor_keyed(c: &Contenders) -> bool {
    c.keyed.check_key(black_box(&c.key)).is_ok()
}

fn governor_direct(c: &Contenders) -> bool {
    c.direct.check().is_ok()
}

fn tower_withdraw(c: &Contenders) -> bool {
    c.tower.withdraw()
}

fn tower_withdraw_deposit(c: &Contenders) -> bool {
    let spent = c.tower.withdraw();
    c.tower.deposit();
    spent
}

const WITHDRAW: [(&str, Op); 5] = [
    ("memory", memory_withdraw),
    ("memory_os_clock", memory_os_clock_withdraw),
    ("governor_keyed", governor_keyed),
    ("governor_direct", governor_direct),
    ("tower_tps", tower_withdraw),
];

const WITHDRAW_DEPOSIT: [(&str, Op); 2] = [
    ("memory", memory_withdraw_deposit),
    ("tower_tps", tower_withdraw_deposit),
];

/// CPU time the calling thread has run, from the scheduler's statistics
/// (Linux); `None` elsewhere.
fn thread_cpu_nanos() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// CPU time and wall time of the contended samples so far, to tell whether
/// the threads really ran at the same time: on a machine busy with other
/// work they may take turns on one core, and contention then never shows.
#[derive(Default)]
struct Overlap {
    cpu_nanos: u64,
    wall_nanos: u64,
}

/// Runs `iters` operations split over `threads` threads and returns the
/// wall time from the first thread's start to the last thread's end (thread
/// start-up excluded).
fn contended(
    contenders: &Contenders,
    op: Op,
    threads: usize,
    iters: u64,
    overlap: &mut Overlap,
) -> Duration {
    let barrier = Barrier::new(threads);
    let per_thread = iters.div_ceil(threads as u64);
    let spans: Vec<(Instant, Instant, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let cpu_before = thread_cpu_nanos();
                    let start = Instant::now();
                    for _ in 0..per_thread {
                        assert!(op(contenders), "every operation must succeed");
                    }
                    let end = Instant::now();
                    let cpu = match (cpu_before, thread_cpu_nanos()) {
                        (Some(before), Some(after)) => after.saturating_sub(before),
                        _ => 0,
                    };
                    (start, end, cpu)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a benchmark thread panicked"))
            .collect()
    });
    let first = spans
        .iter()
        .map(|s| s.0)
        .min()
        .expect("at least one thread");
    let last = spans
        .iter()
        .map(|s| s.1)
        .max()
        .expect("at least one thread");
    overlap.cpu_nanos += spans.iter().map(|s| s.2).sum::<u64>();
    overlap.wall_nanos += (last - first).as_nanos() as u64;
    last - first
}

fn budget(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    for (kind, ops) in [
        ("withdraw", &WITHDRAW[..]),
        ("withdraw_deposit", &WITHDRAW_DEPOSIT[..]),
    ] {
        let mut group = c.benchmark_group(format!("budget_single/{kind}"));
        for &(name, op) in ops {
            let contenders = Contenders::new();
            group.bench_function(name, |b| b.iter(|| op(&contenders)));
        }
        group.finish();

        let mut group = c.benchmark_group(format!("budget_contended/{kind}"));
        for &(name, op) in ops {
            let contenders = Contenders::new();
            let mut overlap = Overlap::default();
            group.bench_function(name, |b| {
                b.iter_custom(|iters| contended(&contenders, op, threads, iters, &mut overlap))
            });
            // Read by scripts/bench: 2.00 means both threads ran all along.
            if overlap.wall_nanos > 0 {
                eprintln!(
                    "parallelism budget_contended/{kind}/{name}: {:.2}",
                    overlap.cpu_nanos as f64 / overlap.wall_nanos as f64
                );
            }
        }
        group.finish();
    }
}

/// The target comparison, measured so that load from other work on the
/// machine hits both sides alike: batches of `a` and `b` alternate, on
/// `threads` threads at once, and the answer is the median over rounds of
/// time(b) / time(a). Above 1, `a` is faster.
fn interleaved_ratio(contenders: &Contenders, a: Op, b: Op, threads: usize, rounds: usize) -> f64 {
    const BATCH: u64 = 20_000;
    let barrier = Barrier::new(threads);
    let timings: Vec<Vec<(Instant, Instant, Instant, Instant)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                scope.spawn(move || {
                    (0..rounds)
                        .map(|_| {
                            barrier.wait();
                            let a_start = Instant::now();
                            for _ in 0..BATCH {
                                assert!(a(contenders), "every operation must succeed");
                            }
                            let a_end = Instant::now();
                            barrier.wait();
                            let b_start = Instant::now();
                            for _ in 0..BATCH {
                                assert!(b(contenders), "every operation must succeed");
                            }
                            (a_start, a_end, b_start, Instant::now())
                        })
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a benchmark thread panicked"))
            .collect()
    });
    let mut ratios: Vec<f64> = (0..rounds)
        .map(|round| {
            let span =
                |start: fn(&(Instant, Instant, Instant, Instant)) -> Instant,
                 end: fn(&(Instant, Instant, Instant, Instant)) -> Instant| {
                    let first = timings.iter().map(|t| start(&t[round])).min();
                    let last = timings.iter().map(|t| end(&t[round])).max();
                    match (first, last) {
                        (Some(first), Some(last)) => (last - first).as_secs_f64(),
                        _ => f64::NAN,
                    }
                };
            span(|t| t.2, |t| t.3) / span(|t| t.0, |t| t.1)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// The issue's target, "the memory store at least as fast as governor
/// under contention", as interleaved ratios; printed for scripts/bench.
fn ratios(_: &mut Criterion) {
    // Set when profiling one benchmark, which these runs would drown.
    if std::env::var_os("RETRYD_BENCH_NO_RATIOS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    // Under `cargo test` (no --bench), one quick round proves it runs.
    let rounds = if std::env::args().any(|arg| arg == "--bench") {
        101
    } else {
        1
    };
    let contenders = Contenders::new();
    for (name, threads) in [("single", 1), ("contended", cores)] {
        for (other, op) in [
            ("governor_keyed", governor_keyed as Op),
            ("governor_direct", governor_direct),
            ("tower_tps", tower_withdraw),
        ] {
            let ratio = interleaved_ratio(&contenders, memory_withdraw, op, threads, rounds);
            eprintln!("ratio budget_{name}/withdraw memory/{other}: {ratio:.3}");
            if other == "governor_keyed" {
                let ratio =
                    interleaved_ratio(&contenders, memory_os_clock_withdraw, op, threads, rounds);
                eprintln!("ratio budget_{name}/withdraw memory_os_clock/{other}: {ratio:.3}");
            }
        }
        let ratio = interleaved_ratio(
            &contenders,
            memory_withdraw_deposit,
            tower_withdraw_deposit,
            threads,
            rounds,
        );
        eprintln!("ratio budget_{name}/withdraw_deposit memory/tower_tps: {ratio:.3}");
    }
}

/// What a report id adds to a report on the memory store: one claim and
/// one settle, beside the deposit every entry makes anyway.
fn report_ids(c: &mut Criterion) {
    use retryd_budget::{BucketConfig, BudgetStore, MemoryBudgetStore};
    let store = MemoryBudgetStore::new(1_000);
    let config = BucketConfig::default();
    let ids: Vec<String> = (0..50_000)
        .map(|i| format!("7f3c9a2e-4b1d-4e8a-9c6f-{i:012}"))
        .collect();
    let window = Duration::from_secs(600);
    let mut group = c.benchmark_group("report_ids");
    group.bench_function("deposit", |b| {
        b.iter(|| {
            futures::executor::block_on(store.deposit("orders", &config, 10)).unwrap();
        })
    });
    let mut next = 0;
    group.bench_function("claim_settle", |b| {
        b.iter(|| {
            let id = &ids[next % ids.len()];
            next += 1;
            futures::executor::block_on(store.claim_report(id, 42, 1, window)).unwrap();
            futures::executor::block_on(store.settle_report(id, 42, 1)).unwrap();
        })
    });
    group.finish();
}

/// Hedging's window (issue 33): what a hedge decision reads (the state,
/// cached between writes), what a report's entry adds (a 20-bucket
/// histogram), and the state recomputed after a write (30 slots merged).
fn hedging(c: &mut Criterion) {
    use retryd_budget::HedgeWindows;
    use retryd_engine::HedgePolicy;
    use retryd_engine::latency::Histogram;
    let windows = HedgeWindows::default();
    let policy = HedgePolicy::default();
    let mut histogram = Histogram::new();
    for i in 0..20u64 {
        histogram.add(60 + i as u32, 10 + i);
    }
    windows.record("orders", &policy, &histogram, 100);
    let mut group = c.benchmark_group("hedging");
    group.bench_function("state_cached", |b| {
        b.iter(|| windows.state("orders", &policy))
    });
    group.bench_function("record_report_entry", |b| {
        b.iter(|| windows.record("orders", &policy, &histogram, 100))
    });
    group.bench_function("record_then_state", |b| {
        b.iter(|| {
            windows.record("orders", &policy, &histogram, 100);
            windows.state("orders", &policy)
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = budget, ratios, report_ids, hedging
}
criterion_main!(benches);
