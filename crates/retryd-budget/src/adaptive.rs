//! The adaptive budget's rule: how much of a traffic report funds retries,
//! from how the reported attempts ended (issue 32).
//!
//! A report entry carries the first attempts sent (`requests`) and, when
//! the caller reports outcomes, how its completed first attempts and its
//! retries ended. The budget is funded by `requests × health`, where
//! `health` is Google SRE client-side throttling's acceptance,
//! `1 − max(0, (n − K·accepts) / (n + 1))`, computed separately for first
//! attempts and for retries, and the smaller taken:
//!
//! - failures are rare (at most about half of the attempts fail, with
//!   K = 2): health is exactly 1 and the budget is what it was without the
//!   rule;
//! - nothing succeeds: health tends to 1 / (n + 1), so the deposits
//!   vanish and the budget falls to its floor (`min_per_second`) once the
//!   tokens it held are spent;
//! - retries stop succeeding while first attempts still do (the failures
//!   stick to some requests): the retries' own health falls and takes the
//!   deposits down with it.
//!
//! The `+ 1` keeps a report of one or two attempts from swinging the
//! deposit to nothing on a single failure. A caller that reports no
//! outcomes (all four counts 0) funds as before: health 1.
//!
//! The funded requests are rounded down: a sick upstream errs towards fewer
//! retries. Health is never above 1, so the rule can only take deposits
//! away, and the fleet-wide bound (retries ≤ initial + ratio × reported +
//! floor × elapsed) holds unchanged.
//!
//! The rule is stateless, one report entry at a time: every store (memory,
//! Redis exact and leased, and a shared store's local fallback) receives
//! the same funded count through `BudgetStore::deposit`, so they agree by
//! construction, and a re-sent report (same id, same entries) funds the
//! same. It takes no clock and no randomness.

/// The SRE book's K: the acceptance ratio below which the rule starts to
/// take deposits away is 1 / K (half the attempts succeeding).
pub const K: f64 = 2.0;

/// Outcomes one report entry needs to set the upstream's fleet-wide level.
/// Fewer say little about the upstream: two failed attempts of one call in
/// an otherwise idle second read as health 0.33, and the next success
/// started a recovery ramp that denied retries for its 5 s on a
/// quiet upstream (seen in the clients' suites). An upstream this quiet has
/// no wave of retries to spread when it recovers. The adaptive funding of
/// each report is unaffected.
pub const LEVEL_EVIDENCE: u64 = 10;

/// How the attempts of one report entry ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Outcomes {
    /// First attempts that completed without the caller asking to retry.
    pub successes: u64,
    /// First attempts the caller asked (or would ask) about retrying.
    pub failures: u64,
    /// Retries (attempt 2 or later) that completed.
    pub retry_successes: u64,
    /// Retries that failed.
    pub retry_failures: u64,
}

impl Outcomes {
    /// True when the caller reports outcomes at all (any count set).
    pub fn is_reported(&self) -> bool {
        self.successes != 0
            || self.failures != 0
            || self.retry_successes != 0
            || self.retry_failures != 0
    }

    /// True when the entry holds enough outcomes
    /// ([`LEVEL_EVIDENCE`]) to move the upstream's fleet-wide level, whose
    /// return from below one half after a fault starts a recovery ramp.
    pub fn moves_the_level(&self) -> bool {
        self.successes
            .saturating_add(self.failures)
            .saturating_add(self.retry_successes)
            .saturating_add(self.retry_failures)
            >= LEVEL_EVIDENCE
    }

    /// The share of the entry's requests that funds retries, 0 to 1: the
    /// smaller of the first attempts' and the retries' acceptance.
    pub fn health(&self) -> f64 {
        acceptance(self.successes, self.failures)
            .min(acceptance(self.retry_successes, self.retry_failures))
    }

    /// The requests that fund retries out of `requests` reported: all of
    /// them when health is 1, else `floor(requests × health)`.
    pub fn funded(&self, requests: u64) -> u64 {
        let health = self.health();
        if health >= 1.0 {
            return requests;
        }
        // requests ≤ 1e9 (validated), so the product is exact enough and
        // the floor never rounds up past `requests`.
        ((requests as f64 * health).floor() as u64).min(requests)
    }
}

/// `1 − max(0, (n − K·accepts) / (n + 1))` with n = accepts + rejects: 1
/// when nothing was reported.
fn acceptance(accepts: u64, rejects: u64) -> f64 {
    let n = accepts.saturating_add(rejects) as f64;
    let throttled = ((n - K * accepts as f64) / (n + 1.0)).max(0.0);
    (1.0 - throttled).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn outcomes(
        successes: u64,
        failures: u64,
        retry_successes: u64,
        retry_failures: u64,
    ) -> Outcomes {
        Outcomes {
            successes,
            failures,
            retry_successes,
            retry_failures,
        }
    }

    #[test]
    fn nothing_reported_funds_every_request() {
        assert!(!Outcomes::default().is_reported());
        assert_eq!(Outcomes::default().health(), 1.0);
        assert_eq!(Outcomes::default().funded(100), 100);
    }

    #[test]
    fn rare_failures_change_nothing() {
        // 10% and 30% failures, the retries mostly succeeding.
        assert_eq!(outcomes(90, 10, 9, 1).funded(100), 100);
        assert_eq!(outcomes(70, 30, 21, 9).funded(100), 100);
        // Exactly half failing is still health 1 (K = 2).
        assert_eq!(outcomes(50, 50, 0, 0).funded(100), 100);
    }

    #[test]
    fn an_outage_funds_almost_nothing() {
        // 100 first attempts, all failing: 1 / 101 of the requests.
        assert_eq!(outcomes(0, 100, 0, 0).funded(100), 0);
        assert_eq!(outcomes(0, 100, 0, 30).funded(1000), 9);
    }

    #[test]
    fn retries_that_stop_succeeding_take_deposits_down() {
        // First attempts are fine, but no retry succeeds.
        let sticky = outcomes(80, 20, 0, 20);
        assert!(sticky.health() < 0.05, "{}", sticky.health());
        assert_eq!(sticky.funded(100), 4);
    }

    #[test]
    fn one_failure_does_not_swing_a_small_report_to_nothing() {
        assert_eq!(outcomes(0, 1, 0, 0).health(), 0.5);
        assert_eq!(outcomes(1, 1, 0, 0).health(), 1.0);
    }

    #[test]
    fn the_sre_formula_is_followed() {
        // 1 − (n − 2a) / (n + 1) for n = 10, a = 3: 1 − 4/11.
        let health = outcomes(3, 7, 0, 0).health();
        assert!((health - 7.0 / 11.0).abs() < 1e-12, "{health}");
        assert_eq!(outcomes(3, 7, 0, 0).funded(11), 7);
    }

    proptest! {
        #[test]
        fn funded_never_exceeds_requests(
            requests in 0u64..=1_000_000_000,
            s in 0u64..=1_000_000_000, f in 0u64..=1_000_000_000,
            rs in 0u64..=1_000_000_000, rf in 0u64..=1_000_000_000,
        ) {
            let o = outcomes(s, f, rs, rf);
            let health = o.health();
            prop_assert!((0.0..=1.0).contains(&health));
            prop_assert!(o.funded(requests) <= requests);
        }

        #[test]
        fn more_successes_never_fund_less(
            requests in 0u64..100_000, s in 0u64..10_000, f in 0u64..10_000, extra in 0u64..10_000,
        ) {
            prop_assert!(outcomes(s + extra, f, 0, 0).funded(requests) >= outcomes(s, f, 0, 0).funded(requests));
            prop_assert!(outcomes(s, f, 0, 0).funded(requests) >= outcomes(s, f + extra, 0, 0).funded(requests));
        }

        #[test]
        fn at_most_half_failing_is_unchanged(s in 0u64..100_000, f in 0u64..100_000, requests in 0u64..100_000) {
            prop_assume!(f <= s);
            prop_assert_eq!(outcomes(s, f, s, f).funded(requests), requests);
        }
    }
}
