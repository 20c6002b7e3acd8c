//! `RetryDecider/ReportTraffic`: counts of real requests fill the budgets.
//! A report is all or nothing up to the deposits: validated, authorized and
//! admitted under the store's upstream limit as a whole before anything is
//! deposited.

use std::time::Instant;

use tonic::{Request, Response, Status};

use super::decider::permit;
use super::status::store_status;
use super::{Live, Service, peer_addr, trace_context, validate};
use crate::auth::Principal;
use sha2::{Digest, Sha256};

use crate::budget::{BucketConfig, BudgetStore, ReportClaim};
use crate::pb;
use crate::telemetry::StoreOp;
use crate::telemetry::{Attribute, SPAN_REPORT_TRAFFIC, attr};

/// The method, as refusals name it in the audit log.
const RPC_REPORT_TRAFFIC: &str = "/retryd.v1.RetryDecider/ReportTraffic";

impl<S: BudgetStore> Service<S> {
    pub(super) async fn report_traffic_call(
        &self,
        request: Request<pb::ReportTrafficRequest>,
    ) -> Result<Response<pb::ReportTrafficResponse>, Status> {
        let live = self.policies();
        let principal = self.authenticate(&live, &request, RPC_REPORT_TRAFFIC)?;
        let span = self
            .inner
            .tracer
            .start(trace_context(request.metadata()).as_ref());
        let caller = || (attr::CALLER, Attribute::Text(principal.name.clone()));
        match self
            .report_traffic(&live, principal, request.get_ref())
            .await
        {
            Ok((accepted, already_applied)) => {
                if let Some(span) = span {
                    let requests: u64 = request
                        .get_ref()
                        .traffic
                        .iter()
                        .map(|entry| entry.requests)
                        .sum();
                    let attributes = vec![
                        (attr::TRAFFIC_ENTRIES, Attribute::Int(i64::from(accepted))),
                        (attr::TRAFFIC_REQUESTS, Attribute::Int(requests as i64)),
                        caller(),
                    ];
                    self.inner
                        .tracer
                        .finish(span, SPAN_REPORT_TRAFFIC, attributes, None);
                }
                Ok(Response::new(pb::ReportTrafficResponse {
                    accepted,
                    already_applied,
                }))
            }
            Err(status) => {
                let peer = peer_addr(&request);
                self.audit_refusal(RPC_REPORT_TRAFFIC, peer, Some(&principal.name), &status);
                self.finish_failed_with(span, SPAN_REPORT_TRAFFIC, &status, vec![caller()]);
                Err(status)
            }
        }
    }

    /// Applies a report: (entries applied now, entries an earlier call
    /// with the same report id had applied).
    async fn report_traffic(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::ReportTrafficRequest,
    ) -> Result<(u32, u32), Status> {
        let entries = validate::traffic_report(request)?;
        let report_id = validate::report_id(&request.report_id)?;
        // All or nothing: a report naming a forbidden upstream deposits
        // nowhere.
        for (index, (upstream, _)) in entries.iter().enumerate() {
            permit(principal, upstream, &format!("traffic[{index}].upstream"))?;
        }
        let store = &self.inner.store;
        // At most MAX_TRAFFIC_ENTRIES (validated).
        let count = entries.len() as u32;
        // A re-sent report resumes after what an earlier call with its id
        // applied (or skipped as of unknown outcome): nothing twice.
        let claimed = match report_id {
            None => None,
            Some(id) => {
                let digest = digest(&entries);
                let window = self.inner.reload.startup.report_ids.window;
                let claim = store
                    .claim_report(id, digest, count, window)
                    .await
                    .map_err(|error| report_failed(store_status(error), None, entries.len()))?;
                match claim {
                    ReportClaim::Fresh => Some((id, digest, 0)),
                    ReportClaim::Applied(applied) if applied >= count => {
                        self.settle(id, digest, applied).await;
                        return Ok((0, applied));
                    }
                    ReportClaim::Applied(applied) => Some((id, digest, applied)),
                    ReportClaim::InProgress => {
                        return Err(Status::aborted(
                            "report_id: another call with this id is still being applied; nothing was applied by this one, re-send it later",
                        ));
                    }
                    ReportClaim::Conflict => {
                        return Err(Status::invalid_argument(
                            "report_id: already used for a report with other entries",
                        ));
                    }
                }
            }
        };
        let skip = claimed.map_or(0, |(_, _, applied)| applied);
        let applied = self.apply(live, principal, &entries, skip as usize).await;
        if let Some((id, digest, _)) = claimed {
            // Entry i of a failure may have landed: it is never re-applied.
            let settled = match &applied {
                Ok(()) => count,
                Err((None, _)) => skip,
                Err((Some(index), _)) => *index as u32 + 1,
            };
            self.settle(id, digest, settled).await;
        }
        match applied {
            Ok(()) => Ok((count - skip, skip)),
            Err((_, status)) => Err(status),
        }
    }

    /// Settles a claimed report id. If the store fails here, the id stays
    /// claimed until its lease runs out, and then counts as wholly applied:
    /// fewer retries, never a request counted twice.
    async fn settle(&self, id: &str, digest: u64, applied: u32) {
        if let Err(error) = self.inner.store.settle_report(id, digest, applied).await {
            tracing::warn!(%error, report_id = id, "could not record a traffic report as applied");
        }
    }

    /// Admits and deposits `entries[skip..]`. On failure: the index of the
    /// entry whose deposit failed (`None` if nothing was deposited) and the
    /// status.
    async fn apply(
        &self,
        live: &Live,
        principal: &Principal,
        entries: &[(&str, u64)],
        skip: usize,
    ) -> Result<(), (Option<usize>, Status)> {
        // All or nothing against the store's upstream limit too: every
        // upstream is admitted before anything is deposited, so a report
        // naming one too many deposits nowhere.
        let admitting: Vec<(&str, &BucketConfig)> = entries[skip..]
            .iter()
            .map(|&(upstream, _)| (upstream, &live.policies.get(upstream).bucket))
            .collect();
        let unconfigured = admitting
            .iter()
            .filter(|(_, config)| !config.configured)
            .map(|&(upstream, _)| upstream);
        self.claim_share(principal, unconfigured)
            .map_err(|status| (None, report_failed(status, None, entries.len())))?;
        let store = &self.inner.store;
        let asked = Instant::now();
        let admitted = store.admit(&admitting).await;
        self.inner
            .metrics
            .record_store(StoreOp::Admit, asked.elapsed(), admitted.is_err());
        admitted.map_err(|error| {
            (
                None,
                report_failed(self.store_refusal(error), None, entries.len()),
            )
        })?;
        // Deposits are one store call each (on Redis, on different Cluster
        // slots, so never one transaction): if one fails, the status says
        // which entries were applied.
        for (offset, (&(upstream, config), &(_, requests))) in
            admitting.iter().zip(&entries[skip..]).enumerate()
        {
            let index = skip + offset;
            let depositing = Instant::now();
            let deposited = store.deposit(upstream, config, requests).await;
            self.inner.metrics.record_store(
                StoreOp::Deposit,
                depositing.elapsed(),
                deposited.is_err(),
            );
            deposited.map_err(|error| {
                (
                    Some(index),
                    report_failed(store_status(error), Some(index), entries.len()),
                )
            })?;
            self.inner.metrics.record_deposit(requests);
            if let Some(candidate) = &live.policies.get(upstream).candidate {
                self.deposit_candidate(upstream, candidate, requests);
            }
            if let Some(log) = &self.inner.decision_log {
                log.report(upstream, requests);
            }
        }
        Ok(())
    }
}

/// A report's entries, in order, hashed: the same id re-sent with other
/// entries is refused rather than half-applied. SHA-256 (already in the
/// build for key hashes) so that every replica and version agrees.
fn digest(entries: &[(&str, u64)]) -> u64 {
    let mut hasher = Sha256::new();
    for (upstream, requests) in entries {
        hasher.update((upstream.len() as u64).to_le_bytes());
        hasher.update(upstream.as_bytes());
        hasher.update(requests.to_le_bytes());
    }
    let hash = hasher.finalize();
    u64::from_le_bytes(hash[..8].try_into().expect("a SHA-256 is 32 bytes"))
}

/// The status of a traffic report the store failed, saying what was
/// applied: nothing if it failed before the deposits (`failed` is `None`),
/// else the entries before `failed`, maybe `failed` itself (a deposit that
/// timed out may have landed), and none after it. The wording is the
/// contract's (see ReportTraffic in the proto).
fn report_failed(status: Status, failed: Option<usize>, entries: usize) -> Status {
    let message = match failed {
        None => format!("{}; no traffic entry was applied", status.message()),
        Some(index) => format!(
            "traffic[{index}]: {}; entries 0..{index} were applied, entry {index} may or may not have been, entries {}..{entries} were not",
            status.message(),
            index + 1
        ),
    };
    Status::new(status.code(), message)
}
