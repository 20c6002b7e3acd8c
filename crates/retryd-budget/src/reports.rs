//! Traffic-report ids: a report re-sent with the same id is applied at
//! most once (per entry), so a client that re-sends after a timeout or a
//! partial failure never counts a request twice.
//!
//! A report's id moves through two states: *in progress* from the claim
//! until the report is settled, then *applied* with the number of its
//! entries, from the first, that need no applying again. A re-send resumes
//! after those. An id is remembered for the caller's window and then
//! forgotten. [`ReportLedger`] keeps them in memory for the memory store,
//! and for nothing else: the Redis store keeps its own in Redis, so that a
//! re-send to another replica is recognised too.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// How long a claim may stay in progress before a re-send may take it
/// over, in nanoseconds. The report handler settles within its store
/// timeouts; a claim older than this belongs to a replica that died
/// mid-report, and its entries are then all taken as applied (fewer
/// retries, never a request counted twice).
pub const CLAIM_LEASE_NANOS: u64 = 30_000_000_000;

/// What a claim on a report id found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportClaim {
    /// A new id, now claimed: apply every entry, then settle.
    Fresh,
    /// Seen before with the same entries: its first `n` entries need no
    /// applying; the id is claimed again for the rest, then settle.
    Applied(u32),
    /// Another call with this id is still being applied.
    InProgress,
    /// Seen before with different entries.
    Conflict,
}

#[derive(Clone, Copy, Debug)]
enum State {
    InProgress { since: u64 },
    Applied(u32),
}

#[derive(Debug)]
struct Entry {
    digest: u64,
    state: State,
    expires: u64,
}

#[derive(Debug, Default)]
struct Ids {
    entries: HashMap<Box<str>, Entry>,
    /// Ids in the order they were first claimed, with the expiry they got
    /// then: the oldest expire (or are evicted) first.
    order: VecDeque<(u64, Box<str>)>,
}

/// Report ids in memory, bounded in number: past `max_ids`, the oldest is
/// forgotten early (its re-sends, if any still come, would be applied
/// again). A report takes one lock, which is nothing next to its deposits
/// and never on the decision path.
#[derive(Debug)]
pub struct ReportLedger {
    ids: Mutex<Ids>,
    max_ids: usize,
}

impl ReportLedger {
    /// A ledger holding at most `max_ids` ids.
    pub fn new(max_ids: usize) -> ReportLedger {
        ReportLedger {
            ids: Mutex::new(Ids::default()),
            max_ids: max_ids.max(1),
        }
    }

    /// Claims `id` for a report of `entries` entries whose content hashes
    /// to `digest`, at `now` (nanoseconds on any monotonic clock), to be
    /// remembered for `window_nanos`.
    pub fn claim(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        now: u64,
        window_nanos: u64,
    ) -> ReportClaim {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        ids.forget_expired(now);
        if let Some(entry) = ids.entries.get_mut(id) {
            if entry.digest != digest {
                return ReportClaim::Conflict;
            }
            return match entry.state {
                State::InProgress { since } if now.saturating_sub(since) < CLAIM_LEASE_NANOS => {
                    ReportClaim::InProgress
                }
                // Its claimer died mid-report: assume it applied everything.
                State::InProgress { .. } => {
                    entry.state = State::InProgress { since: now };
                    ReportClaim::Applied(entries)
                }
                State::Applied(applied) => {
                    entry.state = State::InProgress { since: now };
                    ReportClaim::Applied(applied)
                }
            };
        }
        while ids.entries.len() >= self.max_ids {
            let Some((_, oldest)) = ids.order.pop_front() else {
                break;
            };
            ids.entries.remove(&oldest);
        }
        let expires = now.saturating_add(window_nanos);
        let key: Box<str> = id.into();
        ids.order.push_back((expires, key.clone()));
        ids.entries.insert(
            key,
            Entry {
                digest,
                state: State::InProgress { since: now },
                expires,
            },
        );
        ReportClaim::Fresh
    }

    /// Settles a claimed id: its first `applied` entries need no applying
    /// again.
    pub fn settle(&self, id: &str, digest: u64, applied: u32) {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(entry) = ids.entries.get_mut(id) {
            if entry.digest == digest {
                entry.state = State::Applied(applied);
            }
        }
    }

    /// Ids remembered now.
    pub fn len(&self) -> usize {
        self.ids
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entries
            .len()
    }

    /// True if no id is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Ids {
    fn forget_expired(&mut self, now: u64) {
        while let Some((expires, _)) = self.order.front() {
            if *expires > now {
                break;
            }
            let Some((_, id)) = self.order.pop_front() else {
                break;
            };
            // The entry may have been replaced by a later claim of the same
            // id (after it expired once): remove only the one that expired.
            if self
                .entries
                .get(&id)
                .is_some_and(|entry| entry.expires <= now)
            {
                self.entries.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: u64 = 600_000_000_000;

    #[test]
    fn an_id_is_applied_once_then_resumed_after_what_was_applied() {
        let ledger = ReportLedger::new(10);
        assert_eq!(ledger.claim("a", 7, 3, 0, WINDOW), ReportClaim::Fresh);
        // A concurrent re-send while the first is applied.
        assert_eq!(ledger.claim("a", 7, 3, 1, WINDOW), ReportClaim::InProgress);
        ledger.settle("a", 7, 2);
        assert_eq!(ledger.claim("a", 7, 3, 2, WINDOW), ReportClaim::Applied(2));
        ledger.settle("a", 7, 3);
        assert_eq!(ledger.claim("a", 7, 3, 3, WINDOW), ReportClaim::Applied(3));
        // The same id with other entries.
        assert_eq!(ledger.claim("a", 8, 3, 4, WINDOW), ReportClaim::Conflict);
    }

    #[test]
    fn a_dead_claim_counts_as_all_applied() {
        let ledger = ReportLedger::new(10);
        assert_eq!(ledger.claim("a", 7, 5, 0, WINDOW), ReportClaim::Fresh);
        assert_eq!(
            ledger.claim("a", 7, 5, CLAIM_LEASE_NANOS, WINDOW),
            ReportClaim::Applied(5)
        );
    }

    #[test]
    fn ids_expire_and_the_bound_evicts_the_oldest() {
        let ledger = ReportLedger::new(2);
        assert_eq!(ledger.claim("a", 1, 1, 0, 100), ReportClaim::Fresh);
        ledger.settle("a", 1, 1);
        assert_eq!(ledger.claim("a", 1, 1, 99, 100), ReportClaim::Applied(1));
        ledger.settle("a", 1, 1);
        // Past the window: forgotten, a new report again.
        assert_eq!(ledger.claim("a", 1, 1, 100, 100), ReportClaim::Fresh);
        assert_eq!(ledger.claim("b", 1, 1, 101, 100), ReportClaim::Fresh);
        assert_eq!(ledger.claim("c", 1, 1, 102, 100), ReportClaim::Fresh);
        assert_eq!(ledger.len(), 2, "bounded");
        // "a" was the oldest.
        assert_eq!(ledger.claim("a", 1, 1, 103, 100), ReportClaim::Fresh);
        assert_eq!(ledger.len(), 2);
    }
}
