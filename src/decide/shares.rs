//! Per-principal shares of the unconfigured upstreams
//! (`limits.max_upstreams_per_principal`): each principal may hold at most
//! that many at once, so that one team's runaway caller fills its own share
//! and not the table every team decides from.
//!
//! Enforced by the pipeline, which knows the caller the edge authenticated;
//! the store still enforces `limits.max_upstreams` for all. A principal holds
//! an upstream from its first RETRY decision or traffic report for it (the
//! calls that make the store track an upstream) until it has not used it
//! for `limits.evict_idle_after`; a name several principals use is in the
//! share of each. An admin who switches an unconfigured upstream's retries
//! off holds it in its share until they are switched on again, since the
//! store keeps a switched-off bucket for good. Nothing here is on the path
//! of a configured upstream, nor of any call when the limit is off.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// The last use of a name pinned in a share, which no idle period reaches.
const PINNED: u64 = u64::MAX;

/// A principal's share is full: the caller gets RESOURCE_EXHAUSTED naming
/// the limit.
#[derive(Debug, thiserror::Error)]
#[error(
    "upstream: principal {principal:?} already holds limits.max_upstreams_per_principal ({limit}) unconfigured upstreams"
)]
pub struct ShareFull {
    /// The principal whose share is full.
    pub principal: String,
    /// `limits.max_upstreams_per_principal`.
    pub limit: usize,
}

/// Every principal's share.
#[derive(Debug)]
pub(crate) struct Shares {
    limit: Option<usize>,
    idle: Duration,
    origin: Instant,
    /// Per principal: its upstreams and when each was last used (ms since
    /// `origin`). One lock per principal: only its own calls contend.
    held: DashMap<Box<str>, Mutex<HashMap<Box<str>, u64>>>,
}

impl Shares {
    pub(crate) fn new(limit: Option<usize>, idle: Duration) -> Shares {
        Shares {
            limit,
            idle,
            origin: Instant::now(),
            held: DashMap::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Takes `upstreams` (unconfigured, as the caller filtered them) into
    /// `principal`'s share, all or none: a traffic report over the share
    /// changes nothing.
    pub(crate) fn claim<'u>(
        &self,
        principal: &str,
        upstreams: impl IntoIterator<Item = &'u str> + Clone,
    ) -> Result<(), ShareFull> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        let now = self.now_ms();
        if !self.held.contains_key(principal) {
            self.held.entry(principal.into()).or_default();
        }
        let Some(share) = self.held.get(principal) else {
            return Ok(());
        };
        let mut share = share.lock().unwrap_or_else(PoisonError::into_inner);
        let mut new: Vec<&str> = upstreams
            .clone()
            .into_iter()
            .filter(|upstream| !share.contains_key(*upstream))
            .collect();
        new.sort_unstable();
        new.dedup();
        if share.len() + new.len() > limit {
            return Err(ShareFull {
                principal: principal.to_owned(),
                limit,
            });
        }
        for upstream in upstreams {
            share
                .entry(upstream.into())
                .and_modify(|used| {
                    if *used != PINNED {
                        *used = now;
                    }
                })
                .or_insert(now);
        }
        Ok(())
    }

    /// Takes `upstream` into `principal`'s share, as [`Shares::claim`],
    /// and keeps it there while its retries are switched off: the store
    /// never evicts a switched-off bucket (a kill switch is never lost), so
    /// the name must hold its place in the share of the admin who made it
    /// for as long as it holds its place in the table.
    pub(crate) fn pin(&self, principal: &str, upstream: &str) -> Result<(), ShareFull> {
        self.claim(principal, [upstream])?;
        if let Some(share) = self.held.get(principal) {
            let mut share = share.lock().unwrap_or_else(PoisonError::into_inner);
            share.insert(upstream.into(), PINNED);
        }
        Ok(())
    }

    /// Retries are on again for `upstream`: whoever switched them off no
    /// longer holds it pinned, and it leaves their share once idle.
    pub(crate) fn unpin(&self, upstream: &str) {
        if self.limit.is_none() {
            return;
        }
        let now = self.now_ms();
        for share in self.held.iter() {
            let mut share = share.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(used) = share.get_mut(upstream) {
                if *used == PINNED {
                    *used = now;
                }
            }
        }
    }

    /// Forgets what each principal has not used for the idle period (and
    /// principals left with nothing). Off the decision path: the server's
    /// sweep calls it.
    pub(crate) fn forget_idle(&self) {
        if self.limit.is_none() {
            return;
        }
        let idle = self.idle.as_millis() as u64;
        let now = self.now_ms();
        self.held.retain(|_, share| {
            let share = share.get_mut().unwrap_or_else(PoisonError::into_inner);
            share.retain(|_, used| *used == PINNED || now.saturating_sub(*used) < idle);
            !share.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_all_or_nothing_and_per_principal() {
        let shares = Shares::new(Some(2), Duration::from_secs(60));
        shares.claim("flood", ["a"]).unwrap();
        // Names already held, repeated or not, take no more room.
        shares.claim("flood", ["a", "b", "b"]).unwrap();
        let full = shares.claim("flood", ["a", "c"]).unwrap_err();
        assert_eq!(
            full.to_string(),
            "upstream: principal \"flood\" already holds limits.max_upstreams_per_principal (2) unconfigured upstreams"
        );
        shares.claim("flood", ["b"]).unwrap();
        // Another principal has a share of its own, even of the same names.
        shares.claim("other", ["a", "c"]).unwrap();
        // With no limit, nothing is kept.
        let off = Shares::new(None, Duration::from_secs(60));
        off.claim("flood", ["a", "b", "c"]).unwrap();
        assert!(off.held.is_empty());
    }

    #[test]
    fn a_switched_off_name_stays_in_its_share_until_switched_on() {
        let shares = Shares::new(Some(2), Duration::ZERO);
        shares.pin("admin", "made-up").unwrap();
        // A decision on it later does not unpin it.
        shares.claim("admin", ["made-up"]).unwrap();
        shares.forget_idle();
        shares.pin("admin", "made-up-2").unwrap();
        assert!(shares.pin("admin", "made-up-3").is_err(), "share full");
        shares.unpin("made-up");
        shares.forget_idle();
        shares.pin("admin", "made-up-3").unwrap();
    }

    #[test]
    fn idle_names_leave_the_share() {
        let shares = Shares::new(Some(1), Duration::ZERO);
        shares.claim("flood", ["a"]).unwrap();
        shares.forget_idle();
        assert!(shares.held.is_empty());
        shares.claim("flood", ["b"]).unwrap();
    }
}
