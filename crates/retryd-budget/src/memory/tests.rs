//! Unit tests of the memory store: the bucket arithmetic under concurrency,
//! the per-thread index, the upstream limit and admission.

use super::*;
use futures::executor::block_on;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Withdraw,
    Deposit(u64),
    Advance(u64),
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Withdraw),
        1 => (0u64..50).prop_map(Op::Deposit),
        1 => (0u64..3_000_000_000).prop_map(Op::Advance),
    ]
}

proptest! {
    /// Over any sequence, tokens stay in 0..=capacity and the retries
    /// granted never exceed initial + ratio × reported + floor × elapsed.
    #[test]
    fn invariant_holds(
        ops in prop::collection::vec(any_op(), 1..300),
        capacity in 1.0f64..50.0,
        initial_fraction in 0.0f64..1.0,
        ratio in 0.0f64..1.0,
        per_second in 0.0f64..5.0,
    ) {
        let config = BucketConfig {
            capacity,
            initial: capacity * initial_fraction,
            ratio,
            min_per_second: per_second,
            ..BucketConfig::default()
        };
        let clock = ManualClock::default();
        let store = MemoryBudgetStore::with_clock(10, clock.clone());
        let (mut granted, mut reported, mut elapsed) = (0u64, 0u64, 0u64);
        for op in ops {
            match op {
                Op::Withdraw => {
                    if block_on(store.try_withdraw("up", &config)).unwrap().is_some() {
                        granted += 1;
                    }
                }
                Op::Deposit(n) => {
                    block_on(store.deposit("up", &config, n)).unwrap();
                    reported += n;
                }
                Op::Advance(nanos) => {
                    clock.advance(nanos);
                    elapsed += nanos;
                }
            }
            let tokens = block_on(store.view("up", &config)).unwrap().tokens;
            // Capacity is held in whole units, so it may round up by half a unit.
            prop_assert!((0.0..=capacity + 1e-6).contains(&tokens), "tokens {tokens}");
            let bound = config.initial + ratio * reported as f64 + per_second * elapsed as f64 / 1e9;
            prop_assert!(granted as f64 <= bound + 1e-6, "granted {granted} > {bound}");
        }
    }
}

#[test]
fn contended_withdrawals_grant_exactly_the_tokens() {
    let config = BucketConfig {
        capacity: 1000.0,
        initial: 1000.0,
        ratio: 0.0,
        min_per_second: 0.0,
        ..BucketConfig::default()
    };
    let store = Arc::new(MemoryBudgetStore::with_clock(10, ManualClock::default()));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                (0..1000)
                    .filter(|_| {
                        block_on(store.try_withdraw("up", &config))
                            .unwrap()
                            .is_some()
                    })
                    .count()
            })
        })
        .collect();
    let granted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(granted, 1000);
    assert_eq!(block_on(store.view("up", &config)).unwrap().tokens, 0.0);
}

#[test]
fn looking_does_not_track_and_the_limit_holds() {
    let config = BucketConfig::default();
    let store = MemoryBudgetStore::with_clock(2, ManualClock::default());
    let view = block_on(store.view("a", &config)).unwrap();
    assert!(!view.tracked);
    assert_eq!(view.tokens, 100.0);
    block_on(store.deposit("a", &config, 1)).unwrap();
    block_on(store.try_withdraw("b", &config)).unwrap();
    let third = block_on(store.try_withdraw("c", &config));
    assert!(
        matches!(third, Err(StoreError::TooManyUpstreams { limit: 2 })),
        "{third:?}"
    );
    // Known upstreams keep working at the limit.
    assert!(
        block_on(store.try_withdraw("a", &config))
            .unwrap()
            .is_some()
    );
}

#[test]
fn threads_share_buckets_and_the_limit() {
    // Each thread indexes buckets on its own; what it finds must be the
    // one shared bucket, and the limit counts upstreams, not indexes.
    let config = BucketConfig {
        capacity: 3.0,
        initial: 3.0,
        ratio: 0.0,
        min_per_second: 0.0,
        ..BucketConfig::default()
    };
    let store = MemoryBudgetStore::with_clock(1, ManualClock::default());
    assert_eq!(
        block_on(store.try_withdraw("a", &config)).unwrap(),
        Some(2.0)
    );
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(block_on(store.view("a", &config)).unwrap().tokens, 2.0);
            assert_eq!(
                block_on(store.try_withdraw("a", &config)).unwrap(),
                Some(1.0)
            );
            let other = block_on(store.try_withdraw("b", &config));
            assert!(
                matches!(other, Err(StoreError::TooManyUpstreams { limit: 1 })),
                "{other:?}"
            );
        });
    });
    assert_eq!(block_on(store.view("a", &config)).unwrap().tokens, 1.0);
}

#[test]
fn a_lowered_capacity_caps_what_is_held() {
    let store = MemoryBudgetStore::with_clock(2, ManualClock::default());
    let wide = BucketConfig::default();
    block_on(store.deposit("a", &wide, 0)).unwrap();
    let narrow = BucketConfig {
        capacity: 5.0,
        ..wide
    };
    assert_eq!(block_on(store.view("a", &narrow)).unwrap().tokens, 5.0);
    assert_eq!(
        block_on(store.try_withdraw("a", &narrow)).unwrap(),
        Some(4.0)
    );
}

#[test]
fn frequent_looks_lose_no_floor_credit() {
    // 0.001 tokens per second is one unit per millisecond; looking every
    // 100 µs accrues a tenth of a unit each time, which must neither be
    // lost nor consume time: ten seconds credit exactly 10,000 units.
    let config = BucketConfig {
        capacity: 10.0,
        initial: 0.0,
        ratio: 0.0,
        min_per_second: 0.001,
        ..BucketConfig::default()
    };
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(2, clock.clone());
    block_on(store.deposit("a", &config, 0)).unwrap();
    for _ in 0..100_000 {
        clock.advance(100_000);
        block_on(store.view("a", &config)).unwrap();
    }
    let tokens = block_on(store.view("a", &config)).unwrap().tokens;
    assert_eq!(crate::tokens_to_units(tokens), 10_000);
}

#[test]
fn admission_is_all_or_nothing() {
    let config = BucketConfig {
        capacity: 10.0,
        initial: 4.0,
        ratio: 1.0,
        min_per_second: 0.0,
        ..BucketConfig::default()
    };
    let store = MemoryBudgetStore::with_clock(3, ManualClock::default());
    block_on(store.deposit("known", &config, 1)).unwrap();
    // Two new upstreams for two slots; repeats and known ones are free.
    let fits = [
        ("known", &config),
        ("b", &config),
        ("c", &config),
        ("b", &config),
    ];
    block_on(store.admit(&fits)).unwrap();
    let listed: Vec<_> = block_on(store.list(|_| config))
        .unwrap()
        .into_iter()
        .map(|budget| (budget.upstream, budget.tokens))
        .collect();
    assert_eq!(
        listed,
        [
            ("b".to_owned(), 4.0),
            ("c".to_owned(), 4.0),
            ("known".to_owned(), 5.0)
        ],
        "admission creates fresh buckets and moves no budget"
    );
    // Full: a new upstream is refused, and nothing else is created.
    let store = MemoryBudgetStore::with_clock(3, ManualClock::default());
    block_on(store.deposit("known", &config, 1)).unwrap();
    let over = [
        ("known", &config),
        ("b", &config),
        ("c", &config),
        ("d", &config),
    ];
    let refused = block_on(store.admit(&over));
    assert!(
        matches!(refused, Err(StoreError::TooManyUpstreams { limit: 3 })),
        "{refused:?}"
    );
    assert_eq!(block_on(store.list(|_| config)).unwrap().len(), 1);
    // The refused room was not taken: two newcomers still fit.
    block_on(store.admit(&[("b", &config), ("c", &config)])).unwrap();
    assert!(matches!(
        block_on(store.try_withdraw("d", &config)),
        Err(StoreError::TooManyUpstreams { limit: 3 })
    ));
    // Admitted upstreams can be deposited to at the limit.
    block_on(store.deposit("c", &config, 2)).unwrap();
    assert_eq!(block_on(store.view("c", &config)).unwrap().tokens, 6.0);
}

#[test]
fn admission_knows_buckets_other_threads_created() {
    let config = BucketConfig::default();
    let store = MemoryBudgetStore::with_clock(2, ManualClock::default());
    // Another thread created "a": this thread's index does not know
    // it, the shared map does, and it takes no second slot.
    std::thread::scope(|scope| {
        scope.spawn(|| block_on(store.deposit("a", &config, 1)).unwrap());
    });
    block_on(store.admit(&[("a", &config), ("b", &config)])).unwrap();
    assert_eq!(store.tracked.load(Ordering::Acquire), 2);
    assert!(matches!(
        block_on(store.admit(&[("c", &config)])),
        Err(StoreError::TooManyUpstreams { limit: 2 })
    ));
}

#[test]
fn kill_switch_reports_the_previous_state() {
    let store = MemoryBudgetStore::with_clock(2, ManualClock::default());
    let config = BucketConfig::default();
    assert!(block_on(store.set_retries_enabled("a", &config, false)).unwrap());
    assert!(!block_on(store.view("a", &config)).unwrap().retries_enabled);
    assert!(!block_on(store.set_retries_enabled("a", &config, true)).unwrap());
}
