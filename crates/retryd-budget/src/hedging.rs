//! The fleet's latency and hedges per upstream over a sliding window: what
//! a hedge decision and a served hedge delay are computed from.
//!
//! A window is [`SLOTS`] slots, each `window / SLOTS` long, on an injected
//! [`Clock`]; a slot older than the window is cleared when its turn comes
//! round again. Each slot holds the first-attempt latencies reported in it
//! (successes: the delay is how long a healthy call takes; a fast failure
//! would pull it down and a slow one is the retry rule's), the first
//! attempts reported, and the hedges granted. Thirty slots bound an
//! upstream's memory at ~60 KiB whatever the window.
//!
//! Only upstreams with a hedging policy are ever recorded: an upstream
//! without one costs nothing. The quantiles are computed at most once per
//! slot and write, never per decision.
//!
//! On a store that shares the window (Redis, `BudgetStore::SHARES_HEDGING`)
//! the slots live in the store, numbered by the wall clock so that every
//! replica means the same slot, and this process keeps the fleet's window
//! as last read ([`HedgeWindows::set_fleet`]) plus the hedges it granted
//! since its last flush ([`HedgeWindows::take_pending`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use retryd_engine::latency::Histogram;
use retryd_engine::{HedgePolicy, HedgeState, RecentLatency};

use crate::memory::{Clock, MonotonicClock};

/// Slots per window.
pub const SLOTS: usize = 30;
/// The window's most recent slots (its last sixth), the current one
/// included, over which an upstream turned slow as a whole is found
/// uniformly slow before its slow calls are half the window
/// (`retryd_engine::RecentLatency`).
pub const RECENT_SLOTS: usize = SLOTS / 6;

#[derive(Debug, Default)]
struct Slot {
    /// Which slot of time (`now / slot length`) this one holds.
    epoch: u64,
    latencies: Histogram,
    first_attempts: u64,
    hedges: u64,
}

#[derive(Debug)]
struct Window {
    slot_nanos: u64,
    slots: Vec<Slot>,
    /// The latency part of the state, as of `(epoch, writes)`.
    cached: Option<(u64, u64, HedgeState)>,
    writes: u64,
    /// The fleet's window as last read from a shared store.
    fleet: Option<HedgeState>,
    /// Hedges granted here and not yet added to the shared store.
    pending: u64,
    /// Hedges taken for a flush whose read-back has not landed yet.
    flushing: u64,
}

/// One slot's counts to add to a shared window.
#[derive(Clone, Copy, Debug)]
pub struct HedgeAdd<'a> {
    /// The slot (wall-clock nanoseconds / slot length).
    pub slot: u64,
    /// How long the slot is kept: two windows.
    pub ttl: Duration,
    /// First attempts reported.
    pub first_attempts: u64,
    /// Hedges granted.
    pub hedges: u64,
    /// Latencies reported.
    pub latencies: Option<&'a Histogram>,
}

/// A shared window, summed over its slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetWindow {
    /// The fleet's first-attempt latencies.
    pub latencies: Histogram,
    /// Those of its [`RECENT_SLOTS`] most recent slots.
    pub recent: Histogram,
    /// First attempts reported.
    pub first_attempts: u64,
    /// Hedges granted.
    pub hedges: u64,
}

/// The length of one slot of `window`, in nanoseconds.
pub fn slot_nanos(window: Duration) -> u64 {
    (window.as_nanos() as u64 / SLOTS as u64).max(1_000_000)
}

/// The wall-clock slot of `window` now: the same on every replica (up to
/// their clocks' skew).
pub fn wall_slot(window: Duration) -> u64 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    now.as_nanos() as u64 / slot_nanos(window)
}

/// The state a window's sums give, for `policy`.
pub fn state_of(window: &FleetWindow, policy: &HedgePolicy) -> HedgeState {
    HedgeState {
        first_attempts: window.first_attempts,
        hedges: window.hedges,
        ..latency_state(&window.latencies, &window.recent, policy)
    }
}

/// The latency part of a state: the quantiles of the whole window and of
/// its recent part.
fn latency_state(whole: &Histogram, recent: &Histogram, policy: &HedgePolicy) -> HedgeState {
    let quantile = |histogram: &Histogram, q| histogram.quantile(q).unwrap_or_default();
    HedgeState {
        samples: whole.total(),
        p50: quantile(whole, 0.5),
        delay: quantile(whole, policy.quantile),
        tail: quantile(whole, policy.tail_quantile()),
        recent: RecentLatency {
            samples: recent.total(),
            p50: quantile(recent, 0.5),
            tail: quantile(recent, policy.tail_quantile()),
        },
        ..HedgeState::default()
    }
}

impl Window {
    fn new(window: Duration) -> Self {
        Window {
            slot_nanos: slot_nanos(window),
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            cached: None,
            writes: 0,
            fleet: None,
            pending: 0,
            flushing: 0,
        }
    }

    /// The slot for `now`, cleared if it held an older one.
    fn slot(&mut self, now: u64) -> &mut Slot {
        let epoch = now / self.slot_nanos;
        let slot = &mut self.slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::default()
            };
        }
        slot
    }

    /// The slots still inside the window at `now`.
    fn live(&self, now: u64) -> impl Iterator<Item = &Slot> {
        let epoch = now / self.slot_nanos;
        self.slots
            .iter()
            .filter(move |slot| slot.epoch + (SLOTS as u64) > epoch && slot.epoch <= epoch)
    }

    fn state(&mut self, now: u64, policy: &HedgePolicy) -> HedgeState {
        if let Some(fleet) = self.fleet {
            return HedgeState {
                hedges: fleet.hedges + self.pending + self.flushing,
                ..fleet
            };
        }
        let epoch = now / self.slot_nanos;
        let mut state = match self.cached {
            Some((at, writes, state)) if at == epoch && writes == self.writes => state,
            _ => {
                let (mut whole, mut recent) = (Histogram::new(), Histogram::new());
                for slot in self.live(now) {
                    whole.merge(&slot.latencies);
                    if slot.epoch + RECENT_SLOTS as u64 > epoch {
                        recent.merge(&slot.latencies);
                    }
                }
                let state = latency_state(&whole, &recent, policy);
                self.cached = Some((epoch, self.writes, state));
                state
            }
        };
        for slot in self.live(now) {
            state.first_attempts += slot.first_attempts;
            state.hedges += slot.hedges;
        }
        state
    }
}

/// Every hedged upstream's window, in process (the memory store's, and
/// each replica's own view on the Redis store).
#[derive(Debug)]
pub struct HedgeWindows<C = MonotonicClock> {
    clock: C,
    upstreams: Mutex<HashMap<String, Arc<Mutex<Window>>>>,
}

impl Default for HedgeWindows {
    fn default() -> Self {
        HedgeWindows::with_clock(MonotonicClock::default())
    }
}

impl<C: Clock> HedgeWindows<C> {
    /// Windows on `clock`.
    pub fn with_clock(clock: C) -> Self {
        HedgeWindows {
            clock,
            upstreams: Mutex::new(HashMap::new()),
        }
    }

    fn window(&self, upstream: &str, policy: &HedgePolicy) -> Arc<Mutex<Window>> {
        let mut upstreams = self.upstreams.lock().unwrap_or_else(|e| e.into_inner());
        let window = upstreams
            .entry(upstream.to_owned())
            .or_insert_with(|| Arc::new(Mutex::new(Window::new(policy.window))));
        // A reload that changed the window starts the upstream afresh.
        let fresh = Window::new(policy.window).slot_nanos;
        if window.lock().unwrap_or_else(|e| e.into_inner()).slot_nanos != fresh {
            *window = Arc::new(Mutex::new(Window::new(policy.window)));
        }
        Arc::clone(window)
    }

    /// Records a report's first attempts and their latencies.
    pub fn record(
        &self,
        upstream: &str,
        policy: &HedgePolicy,
        latencies: &Histogram,
        first_attempts: u64,
    ) {
        if latencies.total() == 0 && first_attempts == 0 {
            return;
        }
        let now = self.clock.now_nanos();
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        let slot = window.slot(now);
        slot.latencies.merge(latencies);
        slot.first_attempts = slot.first_attempts.saturating_add(first_attempts);
        if latencies.total() > 0 {
            window.writes += 1;
        }
    }

    /// Counts one granted hedge.
    pub fn count_hedge(&self, upstream: &str, policy: &HedgePolicy) {
        let now = self.clock.now_nanos();
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        window.slot(now).hedges += 1;
        window.pending += 1;
    }

    /// The hedges granted here since the last flush, for a shared store;
    /// they still count in this replica's state until [`Self::set_fleet`]
    /// brings the fleet's sum back (or [`Self::restore`] returns them).
    pub fn take_pending(&self, upstream: &str, policy: &HedgePolicy) -> u64 {
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        let taken = window.pending;
        window.pending = 0;
        window.flushing += taken;
        taken
    }

    /// Returns hedges whose flush failed, for the next one.
    pub fn restore(&self, upstream: &str, policy: &HedgePolicy, hedges: u64) {
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        window.flushing = window.flushing.saturating_sub(hedges);
        window.pending += hedges;
    }

    /// The fleet's window as read from a shared store, after flushing
    /// `flushed` hedges: from now on the state is the fleet's.
    pub fn set_fleet(
        &self,
        upstream: &str,
        policy: &HedgePolicy,
        fleet: &FleetWindow,
        flushed: u64,
    ) {
        let state = state_of(fleet, policy);
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        window.flushing = window.flushing.saturating_sub(flushed);
        window.fleet = Some(state);
    }

    /// The upstream's state over its window now.
    pub fn state(&self, upstream: &str, policy: &HedgePolicy) -> HedgeState {
        let now = self.clock.now_nanos();
        let window = self.window(upstream, policy);
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        window.state(now, policy)
    }

    /// Forgets every upstream `keep` says no longer has a policy (after a
    /// reload).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut upstreams = self.upstreams.lock().unwrap_or_else(|e| e.into_inner());
        upstreams.retain(|upstream, _| keep(upstream));
    }

    /// Upstreams with a window.
    pub fn len(&self) -> usize {
        self.upstreams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// True with no window.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use retryd_engine::Served;

    use super::*;

    #[derive(Clone, Default)]
    struct Manual(Arc<AtomicU64>);

    impl Clock for Manual {
        fn now_nanos(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    impl Manual {
        fn advance(&self, by: Duration) {
            self.0.fetch_add(by.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    fn latencies(millis: &[(u64, u64)]) -> Histogram {
        let mut histogram = Histogram::new();
        for &(ms, count) in millis {
            for _ in 0..count {
                histogram.record(Duration::from_millis(ms));
            }
        }
        histogram
    }

    #[test]
    fn the_window_slides() {
        let clock = Manual::default();
        let windows = HedgeWindows::with_clock(clock.clone());
        let policy = HedgePolicy::default();
        windows.record("a", &policy, &latencies(&[(10, 95), (100, 5)]), 100);
        let state = windows.state("a", &policy);
        assert_eq!((state.samples, state.first_attempts), (100, 100));
        assert!(
            state.delay >= Duration::from_millis(9) && state.delay <= Duration::from_millis(11)
        );
        windows.count_hedge("a", &policy);
        clock.advance(Duration::from_secs(15));
        windows.record("a", &policy, &latencies(&[(100, 100)]), 100);
        let state = windows.state("a", &policy);
        assert_eq!(
            (state.samples, state.first_attempts, state.hedges),
            (200, 200, 1)
        );
        // The first report leaves the window; the second stays.
        clock.advance(Duration::from_secs(16));
        let state = windows.state("a", &policy);
        assert_eq!(
            (state.samples, state.first_attempts, state.hedges),
            (100, 100, 0)
        );
        assert!(state.p50 >= Duration::from_millis(90), "{state:?}");
        clock.advance(Duration::from_secs(30));
        assert_eq!(windows.state("a", &policy).samples, 0);
        assert_eq!(windows.state("b", &policy), HedgeState::default());
    }

    /// 26 s fast with a 2% tail, then slow as a whole: one second in, the
    /// recent part (the last five one-second slots) is still mostly fast;
    /// five seconds in it is all slow and says so, while the whole window
    /// still holds its fast past and its tail.
    #[test]
    fn the_recent_part_is_the_last_sixth_of_the_window() {
        let clock = Manual::default();
        let windows = HedgeWindows::with_clock(clock.clone());
        let policy = HedgePolicy::default();
        for second in 0..31 {
            if second > 0 {
                clock.advance(Duration::from_secs(1));
            }
            let report = if second < 26 {
                latencies(&[(10, 98), (1_000, 2)])
            } else {
                latencies(&[(200, 100)])
            };
            windows.record("a", &policy, &report, 100);
            let state = windows.state("a", &policy);
            if second == 26 {
                assert_eq!(state.recent.samples, 500);
                assert!(state.recent.p50 < Duration::from_millis(11), "{state:?}");
                assert!(!state.recent.is_uniform(&policy), "{state:?}");
                assert!(matches!(state.served(&policy), Served::Hedge(_)));
            }
        }
        let state = windows.state("a", &policy);
        assert_eq!((state.samples, state.recent.samples), (3_000, 500));
        assert!(state.p50 < Duration::from_millis(11), "{state:?}");
        assert!(state.tail >= Duration::from_millis(900), "{state:?}");
        assert!(state.recent.p50 >= Duration::from_millis(190), "{state:?}");
        assert!(state.recent.tail < Duration::from_millis(230), "{state:?}");
        assert!(state.recent.is_uniform(&policy), "{state:?}");
        assert_eq!(state.served(&policy), Served::UniformlySlow);
    }

    #[test]
    fn a_slot_is_reused_only_once_its_time_has_passed() {
        let clock = Manual::default();
        let windows = HedgeWindows::with_clock(clock.clone());
        let policy = HedgePolicy::default();
        for _ in 0..(2 * SLOTS) {
            windows.record("a", &policy, &latencies(&[(5, 1)]), 1);
            clock.advance(Duration::from_secs(1));
        }
        // Thirty one-second slots: the last thirty reports.
        let state = windows.state("a", &policy);
        assert_eq!(
            (state.samples, state.first_attempts),
            (SLOTS as u64 - 1, SLOTS as u64 - 1)
        );
    }
}
