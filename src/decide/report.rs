//! Traffic reports: counts of real requests fill the budgets. A report is
//! all or nothing up to the deposits: authorised and admitted under the
//! store's upstream limit as a whole before anything is deposited; with a
//! report id, applied at most once per entry.
//!
//! With the adaptive budget (the default; `adaptive = false` turns it off
//! per upstream or in `[defaults]`), an entry funds retries with only the
//! share of its requests its outcomes allow (`retryd_budget::adaptive`):
//! all of them when failures are rare, almost none when nothing succeeds.
//! The store, the candidate's budget and the decision log all see that
//! funded count, so `retryd replay` deposits what the live service did.

use std::time::Instant;

use sha2::{Digest, Sha256};

use super::names::invalid;
use super::{Decider, Live, Observe, Refused, permit};
use crate::auth::Principal;
use crate::budget::hedging::{self, HedgeAdd};
use crate::budget::{BucketConfig, BudgetStore, Outcomes, ReportClaim};
use crate::engine::HedgePolicy;
use crate::engine::latency::Histogram;
use crate::telemetry::StoreOp;

/// One validated entry of a traffic report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Traffic<'a> {
    /// The upstream.
    pub upstream: &'a str,
    /// First attempts sent since the caller's last report.
    pub requests: u64,
    /// How the caller's attempts ended (all 0: not reported).
    pub outcomes: Outcomes,
    /// How long the successful first attempts took, if reported (kept
    /// only for an upstream with a hedging policy).
    pub latencies: Option<Box<Histogram>>,
    /// Hedged calls whose answer came from a hedge (counted only for an
    /// upstream with a hedging policy).
    pub hedges_won: u64,
}

impl<'a> Traffic<'a> {
    /// An entry without outcomes (a caller that does not report them).
    pub fn requests(upstream: &'a str, requests: u64) -> Self {
        Traffic {
            upstream,
            requests,
            outcomes: Outcomes::default(),
            latencies: None,
            hedges_won: 0,
        }
    }
}

/// A validated traffic report.
#[derive(Clone, Copy, Debug)]
pub struct Report<'a> {
    /// Its entries, in order; at most `MAX_TRAFFIC_ENTRIES`.
    pub entries: &'a [Traffic<'a>],
    /// Its id, for a report that may be re-sent.
    pub id: Option<&'a str>,
}

impl<S: BudgetStore> Decider<S> {
    /// Applies a report: (entries applied now, entries an earlier call
    /// with the same report id had applied).
    pub async fn report(
        &self,
        live: &Live,
        principal: &Principal,
        report: Report<'_>,
        observe: &impl Observe,
    ) -> Result<(u32, u32), Refused> {
        let entries = report.entries;
        // All or nothing: a report naming a forbidden upstream deposits
        // nowhere.
        for (index, entry) in entries.iter().enumerate() {
            permit(
                principal,
                entry.upstream,
                &format!("traffic[{index}].upstream"),
            )?;
        }
        // At most MAX_TRAFFIC_ENTRIES (validated).
        let count = entries.len() as u32;
        // A re-sent report resumes after what an earlier call with its id
        // applied (or skipped as of unknown outcome): nothing twice.
        let claimed = match report.id {
            None => None,
            Some(id) => {
                let digest = digest(entries);
                let claim = self
                    .store
                    .claim_report(id, digest, count, self.report_window)
                    .await
                    .map_err(|error| failed(error.into(), None, entries.len()))?;
                match claim {
                    ReportClaim::Fresh => Some((id, digest, 0)),
                    ReportClaim::Applied(applied) if applied >= count => {
                        self.settle_report(id, digest, applied).await;
                        return Ok((0, applied));
                    }
                    ReportClaim::Applied(applied) => Some((id, digest, applied)),
                    ReportClaim::InProgress => return Err(Refused::ReportInProgress),
                    ReportClaim::Conflict => {
                        return Err(invalid(
                            "report_id",
                            "already used for a report with other entries",
                        )
                        .into());
                    }
                }
            }
        };
        let skip = claimed.map_or(0, |(_, _, applied)| applied);
        let applied = self
            .apply(live, principal, entries, skip as usize, observe)
            .await;
        if let Some((id, digest, _)) = claimed {
            // Entry i of a failure may have landed: it is never re-applied.
            let settled = match &applied {
                Ok(()) => count,
                Err(Refused::Report { failed: None, .. }) => skip,
                Err(Refused::Report {
                    failed: Some(index),
                    ..
                }) => *index as u32 + 1,
                Err(_) => skip,
            };
            self.settle_report(id, digest, settled).await;
        }
        applied.map(|()| (count - skip, skip))
    }

    /// Settles a claimed report id. If the store fails here, the id stays
    /// claimed until its lease runs out, and then counts as wholly applied:
    /// fewer retries, never a request counted twice.
    async fn settle_report(&self, id: &str, digest: u64, applied: u32) {
        if let Err(error) = self.store.settle_report(id, digest, applied).await {
            tracing::warn!(%error, report_id = id, "could not record a traffic report as applied");
        }
    }

    /// Admits and deposits `entries[skip..]`. A failure is a
    /// [`Refused::Report`] saying which entry's deposit failed, if any.
    async fn apply(
        &self,
        live: &Live,
        principal: &Principal,
        entries: &[Traffic<'_>],
        skip: usize,
        observe: &impl Observe,
    ) -> Result<(), Refused> {
        // All or nothing against the store's upstream limit too: every
        // upstream is admitted before anything is deposited, so a report
        // naming one too many deposits nowhere.
        let admitting: Vec<(&str, &BucketConfig)> = entries[skip..]
            .iter()
            .map(|entry| (entry.upstream, &live.policies.get(entry.upstream).bucket))
            .collect();
        let unconfigured = admitting
            .iter()
            .filter(|(_, config)| !config.configured)
            .map(|&(upstream, _)| upstream);
        self.shares
            .claim(&principal.name, unconfigured)
            .map_err(|full| failed(full.into(), None, entries.len()))?;
        let asked = Instant::now();
        let admitted = self.store.admit(&admitting).await;
        observe.store_call(StoreOp::Admit, asked.elapsed(), admitted.is_err());
        admitted.map_err(|error| failed(error.into(), None, entries.len()))?;
        // Deposits are one store call each (on Redis, on different Cluster
        // slots, so never one transaction): if one fails, the refusal says
        // which entries were applied.
        for (offset, (&(upstream, config), entry)) in
            admitting.iter().zip(&entries[skip..]).enumerate()
        {
            let index = skip + offset;
            let adaptive = live.policies.get(upstream).adaptive;
            // A pacing upstream's failures are its announced 429s, not ill
            // health (`pacing.rs`): the entry funds in full and the level
            // stays.
            let paced = adaptive && entry.outcomes.is_reported() && self.pacing.holds(upstream);
            let funded_requests = if paced {
                entry.requests
            } else {
                funded(live, entry)
            };
            let depositing = Instant::now();
            let deposited = self.store.deposit(upstream, config, funded_requests).await;
            observe.store_call(StoreOp::Deposit, depositing.elapsed(), deposited.is_err());
            deposited.map_err(|error| failed(error.into(), Some(index), entries.len()))?;
            observe.deposited(upstream, entry.requests, funded_requests);
            // The fleet's latency, for hedging: only an upstream with a
            // policy keeps any (after its deposit, so that a re-sent report
            // records each entry at most once, as it deposits).
            if let Some(hedging) = &live.policies.get(upstream).hedging {
                self.record_latencies(upstream, hedging, entry).await;
                if entry.hedges_won > 0 {
                    observe.hedges_won(upstream, entry.hedges_won);
                }
            }
            // The level fleet-wide, for GetBudget and the recovery ramp:
            // successes returning after a low level start it.
            if adaptive && !paced && entry.outcomes.moves_the_level() {
                let noting = Instant::now();
                let noted = self
                    .store
                    .note_level(upstream, config, entry.outcomes.health())
                    .await;
                observe.store_call(StoreOp::Deposit, noting.elapsed(), noted.is_err());
                if let Err(error) = noted {
                    tracing::debug!(%error, upstream, "could not note the adaptive level");
                }
            }
            if let Some(candidate) = &live.policies.get(upstream).candidate {
                self.candidates
                    .deposit(upstream, candidate, funded_requests);
            }
        }
        Ok(())
    }
}

impl<S: BudgetStore> Decider<S> {
    /// Adds an entry's first attempts and latencies to the upstream's
    /// window: this process's own, or the shared store's (then read back,
    /// so that the report's answer serves the fleet's delay with them). A
    /// shared store that fails loses the entry's latencies (fewer samples,
    /// never a failed report: its deposit has landed).
    async fn record_latencies(&self, upstream: &str, policy: &HedgePolicy, entry: &Traffic<'_>) {
        if !S::SHARES_HEDGING {
            let none = Histogram::new();
            let latencies = entry.latencies.as_deref().unwrap_or(&none);
            self.hedges
                .record(upstream, policy, latencies, entry.requests);
            return;
        }
        let slot = hedging::wall_slot(policy.window);
        let add = HedgeAdd {
            slot,
            ttl: 2 * policy.window,
            first_attempts: entry.requests,
            hedges: 0,
            latencies: entry.latencies.as_deref(),
        };
        let read = match self.store.add_hedging(upstream, &add).await {
            Ok(()) => self.store.read_hedging(upstream, slot).await,
            Err(error) => Err(error),
        };
        match read {
            Ok(Some(fleet)) => self.hedges.set_fleet(upstream, policy, &fleet, 0),
            Ok(None) => {}
            Err(error) => {
                tracing::debug!(%error, upstream, "could not add latencies to the shared hedging window");
            }
        }
    }

    /// Flushes the hedges this replica granted to the shared store and
    /// reads every hedged upstream's window back: the fleet's view, which
    /// every replica answers from. Run every second by the server, off the
    /// decision path; does nothing on a store that shares no window.
    pub async fn refresh_hedging(&self) {
        if !S::SHARES_HEDGING {
            return;
        }
        let live = self.live_full();
        for (upstream, policy) in live.policies.named() {
            let Some(hedging) = &policy.hedging else {
                continue;
            };
            let slot = hedging::wall_slot(hedging.window);
            let flushed = self.hedges.take_pending(upstream, hedging);
            if flushed > 0 {
                let add = HedgeAdd {
                    slot,
                    ttl: 2 * hedging.window,
                    first_attempts: 0,
                    hedges: flushed,
                    latencies: None,
                };
                if let Err(error) = self.store.add_hedging(upstream, &add).await {
                    tracing::debug!(%error, upstream, "could not flush granted hedges");
                    self.hedges.restore(upstream, hedging, flushed);
                    continue;
                }
            }
            match self.store.read_hedging(upstream, slot).await {
                Ok(Some(fleet)) => self.hedges.set_fleet(upstream, hedging, &fleet, flushed),
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(%error, upstream, "could not read the shared hedging window");
                    // Flushed, but not read back: the next read counts them.
                    self.hedges.restore(upstream, hedging, 0);
                }
            }
        }
    }
}

/// The requests of `entry` that fund retries: all of them with the
/// adaptive budget off or no outcomes reported, else the share its
/// outcomes allow.
fn funded(live: &Live, entry: &Traffic<'_>) -> u64 {
    if live.policies.get(entry.upstream).adaptive {
        entry.outcomes.funded(entry.requests)
    } else {
        entry.requests
    }
}

fn failed(refused: Refused, failed: Option<usize>, entries: usize) -> Refused {
    Refused::Report {
        refused: Box::new(refused),
        failed,
        entries,
    }
}

/// A report's entries, in order, hashed: the same id re-sent with other
/// entries is refused rather than half-applied. SHA-256 (already in the
/// build for key hashes) so that every replica and version agrees.
/// Outcomes are hashed only when reported, so an entry without them hashes
/// as it did before they existed (a re-send across an upgrade still
/// matches).
fn digest(entries: &[Traffic<'_>]) -> u64 {
    let mut hasher = Sha256::new();
    for entry in entries {
        hasher.update((entry.upstream.len() as u64).to_le_bytes());
        hasher.update(entry.upstream.as_bytes());
        hasher.update(entry.requests.to_le_bytes());
        let outcomes = &entry.outcomes;
        if outcomes.is_reported() {
            for count in [
                outcomes.successes,
                outcomes.failures,
                outcomes.retry_successes,
                outcomes.retry_failures,
            ] {
                hasher.update(count.to_le_bytes());
            }
        }
    }
    let hash = hasher.finalize();
    u64::from_le_bytes(hash[..8].try_into().expect("a SHA-256 is 32 bytes"))
}
