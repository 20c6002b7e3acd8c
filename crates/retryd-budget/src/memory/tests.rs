//! Unit tests of the memory store: the bucket arithmetic under concurrency,
//! the per-thread index, the upstream limit, admission and idle eviction.

use super::*;
use futures::executor::block_on;
use proptest::prelude::*;
use std::time::Duration;

#[derive(Clone, Debug)]
enum Op {
    Withdraw,
    Deposit(u64),
    Advance(u64),
    /// A sweep evicting buckets idle for this many nanoseconds.
    Evict(u64),
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Withdraw),
        1 => (0u64..50).prop_map(Op::Deposit),
        1 => (0u64..3_000_000_000).prop_map(Op::Advance),
        1 => (0u64..2_000_000_000).prop_map(Op::Evict),
    ]
}

proptest! {
    /// Over any sequence, evictions included, tokens stay in 0..=capacity
    /// and the retries granted never exceed initial + ratio × reported +
    /// floor × elapsed: a bucket evicted and made again grants no more.
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
                Op::Evict(idle) => {
                    store.evict_idle(Duration::from_nanos(idle), |_| config);
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

/// A bucket of 10 tokens refilling one a second, no deposits.
fn slow() -> BucketConfig {
    BucketConfig {
        capacity: 10.0,
        initial: 10.0,
        ratio: 0.0,
        min_per_second: 1.0,
        ..BucketConfig::default()
    }
}

const SECOND: u64 = 1_000_000_000;
const MINUTE: Duration = Duration::from_secs(60);

#[test]
fn idle_buckets_are_evicted_and_their_places_reused() {
    let config = slow();
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(3, clock.clone());
    for name in ["flood-1", "flood-2", "flood-3"] {
        block_on(store.try_withdraw(name, &config)).unwrap();
    }
    assert!(matches!(
        block_on(store.try_withdraw("legit", &config)),
        Err(StoreError::TooManyUpstreams { limit: 3 })
    ));
    // Not idle long enough: nothing goes.
    clock.advance(30 * SECOND);
    assert_eq!(store.evict_idle(MINUTE, |_| config), 0);
    clock.advance(31 * SECOND);
    assert_eq!(store.evict_idle(MINUTE, |_| config), 3);
    assert_eq!((store.counted_upstreams(), store.evictions()), (0, 3));
    assert!(block_on(store.list(|_| config)).unwrap().is_empty());
    // The places are free again, and a bucket made again starts at initial.
    assert_eq!(
        block_on(store.try_withdraw("legit", &config)).unwrap(),
        Some(9.0)
    );
    assert_eq!(
        block_on(store.try_withdraw("flood-1", &config)).unwrap(),
        Some(9.0)
    );
    assert_eq!(store.counted_upstreams(), 2);
}

#[test]
fn only_buckets_that_could_be_made_again_are_evicted() {
    let config = BucketConfig {
        min_per_second: 0.1,
        ..slow()
    };
    let no_floor = BucketConfig {
        min_per_second: 0.0,
        ..config
    };
    let named = BucketConfig {
        configured: true,
        ..config
    };
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(10, clock.clone());
    for _ in 0..7 {
        block_on(store.try_withdraw("drained", &config)).unwrap();
    }
    block_on(store.try_withdraw("no-floor", &no_floor)).unwrap();
    block_on(store.try_withdraw("named", &named)).unwrap();
    block_on(store.set_retries_enabled("switched-off", &config, false)).unwrap();
    let config_of = |upstream: &str| match upstream {
        "no-floor" => no_floor,
        "named" => named,
        _ => config,
    };
    // Idle a minute: "drained" (7 tokens short, 0.1 a second) is 1 short.
    clock.advance(60 * SECOND);
    assert_eq!(store.evict_idle(MINUTE, config_of), 0);
    // Idle 50 s more: refilled, so it goes; the others never do.
    clock.advance(50 * SECOND);
    assert_eq!(store.evict_idle(MINUTE, config_of), 1);
    clock.advance(3600 * SECOND);
    assert_eq!(store.evict_idle(MINUTE, config_of), 0);
    let left: Vec<_> = block_on(store.list(config_of))
        .unwrap()
        .into_iter()
        .map(|budget| (budget.upstream, budget.retries_enabled))
        .collect();
    assert_eq!(
        left,
        [
            ("named".to_owned(), true),
            ("no-floor".to_owned(), true),
            ("switched-off".to_owned(), false)
        ]
    );
    // The configured one never held a place; the others still do.
    assert_eq!(store.counted_upstreams(), 2);
}

#[test]
fn a_thread_holding_an_evicted_bucket_uses_the_new_one() {
    let config = BucketConfig {
        ratio: 1.0,
        ..slow()
    };
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(10, clock.clone());
    let (to_worker, orders) = std::sync::mpsc::channel::<Option<u64>>();
    let (to_test, answers) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        // A worker thread that keeps "a" in its index throughout.
        let (store, config) = (&store, &config);
        scope.spawn(move || {
            while let Ok(Some(deposit)) = orders.recv() {
                block_on(store.deposit("a", config, deposit)).unwrap();
                let left = block_on(store.try_withdraw("a", config)).unwrap();
                let indexed = store.near().map.borrow().len();
                to_test.send((left, indexed)).unwrap();
            }
        });
        to_worker.send(Some(0)).unwrap();
        assert_eq!(answers.recv().unwrap(), (Some(9.0), 1));
        clock.advance(120 * SECOND);
        assert_eq!(store.evict_idle(MINUTE, |_| *config), 1);
        // The worker's index still holds the old bucket: its deposit and
        // withdrawal must land on a new one, which starts at 10.
        to_worker.send(Some(0)).unwrap();
        assert_eq!(answers.recv().unwrap(), (Some(9.0), 1));
        assert_eq!(block_on(store.view("a", config)).unwrap().tokens, 9.0);
        to_worker.send(None).unwrap();
    });
    assert_eq!(store.counted_upstreams(), 1);
}

#[test]
fn threads_prune_evicted_buckets_from_their_index() {
    let config = slow();
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(1000, clock.clone());
    for i in 0..100 {
        block_on(store.try_withdraw(&format!("flood-{i}"), &config)).unwrap();
    }
    block_on(store.try_withdraw("busy", &config)).unwrap();
    assert_eq!(store.near().map.borrow().len(), 101);
    clock.advance(120 * SECOND);
    // "busy" is used just before the sweep: it stays.
    block_on(store.try_withdraw("busy", &config)).unwrap();
    assert_eq!(store.evict_idle(MINUTE, |_| config), 100);
    // This thread's next operation on anything gives the memory back.
    block_on(store.view("busy", &config)).unwrap();
    assert_eq!(store.near().map.borrow().len(), 1);
}

#[test]
fn a_kill_switch_is_never_lost_to_an_eviction() {
    // The switch and a sweep race on several threads: whichever wins, the
    // upstream ends with retries off.
    let config = slow();
    for _ in 0..200 {
        let clock = ManualClock::default();
        let store = MemoryBudgetStore::with_clock(10, clock.clone());
        block_on(store.deposit("a", &config, 0)).unwrap();
        clock.advance(120 * SECOND);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                block_on(store.set_retries_enabled("a", &config, false)).unwrap();
            });
            scope.spawn(|| store.evict_idle(MINUTE, |_| config));
        });
        assert!(!block_on(store.view("a", &config)).unwrap().retries_enabled);
    }
}

#[test]
fn a_newly_configured_upstream_gives_its_place_back() {
    let config = slow();
    let store = MemoryBudgetStore::with_clock(1, ManualClock::default());
    block_on(store.try_withdraw("later-named", &config)).unwrap();
    assert_eq!(store.counted_upstreams(), 1);
    let named = BucketConfig {
        configured: true,
        ..config
    };
    assert_eq!(store.evict_idle(MINUTE, |_| named), 0);
    assert_eq!(store.counted_upstreams(), 0);
    block_on(store.try_withdraw("another", &config)).unwrap();
}

mod fleet {
    use super::super::*;
    use crate::{Announce, FleetCall};
    use std::time::Duration;

    fn configured() -> BucketConfig {
        BucketConfig {
            configured: true,
            ..BucketConfig::default()
        }
    }

    fn check(
        store: &MemoryBudgetStore<ManualClock>,
        withdraw: bool,
        fleet: FleetCall,
    ) -> BudgetCheck {
        store
            .check_in_fleet("up", &configured(), withdraw, fleet)
            .now_or_never()
            .unwrap()
            .unwrap()
    }

    fn announcing(announce: Announce) -> FleetCall {
        FleetCall {
            announce,
            ..FleetCall::PLAIN
        }
    }

    use futures::FutureExt;

    #[test]
    fn a_pushback_is_set_if_later_and_read_before_its_own_announcement() {
        let clock = ManualClock::default();
        let store = MemoryBudgetStore::with_clock(10, clock.clone());
        let first = check(
            &store,
            false,
            announcing(Announce::Wait(Duration::from_secs(2))),
        );
        // The announcer reads the state before its announcement.
        assert_eq!(first.pushback.wait, Duration::ZERO);
        clock.advance(500_000_000);
        let second = check(
            &store,
            true,
            announcing(Announce::Wait(Duration::from_millis(100))),
        );
        assert_eq!(second.pushback.wait, Duration::from_millis(1500));
        assert!(second.withdrew, "a wait with no deadline is borne");
        // The shorter announcement did not bring it forward.
        let third = check(&store, false, FleetCall::PLAIN);
        assert_eq!(third.pushback.wait, Duration::from_millis(1500));
        assert_eq!(third.pushback_remaining, Some(Duration::from_millis(1500)));
        // A caller whose deadline cannot hold it withdraws nothing.
        let impatient = FleetCall {
            patience: Some(Duration::from_secs(1)),
            ..FleetCall::PLAIN
        };
        assert!(!check(&store, true, impatient).withdrew);
        clock.advance(1_500_000_000);
        assert_eq!(
            check(&store, false, FleetCall::PLAIN).pushback_remaining,
            None
        );
    }

    #[test]
    fn a_stop_withdraws_nothing_for_its_window() {
        let clock = ManualClock::default();
        let store = MemoryBudgetStore::with_clock(10, clock.clone());
        check(
            &store,
            false,
            announcing(Announce::Stop(Duration::from_secs(5))),
        );
        let stopped = check(&store, true, FleetCall::PLAIN);
        assert!(stopped.pushback.stop && !stopped.withdrew);
        assert_eq!(stopped.tokens, 100.0);
        clock.advance(5_000_000_000);
        assert!(check(&store, true, FleetCall::PLAIN).withdrew);
    }

    #[test]
    fn a_ramp_withdraws_only_for_the_draws_it_admits() {
        let clock = ManualClock::default();
        let store = MemoryBudgetStore::with_clock(10, clock.clone());
        let config = configured();
        let ramped = |draw| FleetCall {
            draw,
            ramp_window: Duration::from_secs(5),
            ..FleetCall::PLAIN
        };
        store
            .set_retries_enabled("up", &config, false)
            .now_or_never()
            .unwrap()
            .unwrap();
        store
            .set_retries_enabled("up", &config, true)
            .now_or_never()
            .unwrap()
            .unwrap();
        clock.advance(1_000_000_000);
        let denied = check(&store, true, ramped(0.3));
        assert!(!denied.withdrew);
        assert_eq!(denied.pushback.ramp, 0.2);
        assert_eq!(denied.pushback.ramp_remaining, Duration::from_secs(4));
        assert!(check(&store, true, ramped(0.1)).withdrew);
        // A level returning from low starts one too; rare failures do not.
        clock.advance(4_000_000_000);
        assert!(check(&store, true, ramped(0.9)).withdrew);
        store
            .note_level("up", &config, 0.9)
            .now_or_never()
            .unwrap()
            .unwrap();
        assert!(check(&store, true, ramped(0.9)).withdrew);
        store
            .note_level("up", &config, 0.1)
            .now_or_never()
            .unwrap()
            .unwrap();
        store
            .note_level("up", &config, 1.0)
            .now_or_never()
            .unwrap()
            .unwrap();
        let ramping = check(&store, true, ramped(0.9));
        assert!(!ramping.withdrew);
        assert_eq!(ramping.adaptive_level, 1.0);
        assert_eq!(ramping.ramp_elapsed, Some(Duration::ZERO));
    }
}
