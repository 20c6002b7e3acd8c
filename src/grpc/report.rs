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
use crate::budget::{BucketConfig, BudgetStore};
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
            Ok(accepted) => {
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
                    already_applied: 0,
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

    async fn report_traffic(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::ReportTrafficRequest,
    ) -> Result<u32, Status> {
        let entries = validate::traffic_report(request)?;
        // All or nothing: a report naming a forbidden upstream deposits
        // nowhere.
        for (index, (upstream, _)) in entries.iter().enumerate() {
            permit(principal, upstream, &format!("traffic[{index}].upstream"))?;
        }
        // All or nothing against the store's upstream limit too: every
        // upstream is admitted before anything is deposited, so a report
        // naming one too many deposits nowhere. (Report ids, for idempotent
        // re-sends, would be checked here, before the deposits.)
        let admitting: Vec<(&str, &BucketConfig)> = entries
            .iter()
            .map(|&(upstream, _)| (upstream, &live.policies.get(upstream).bucket))
            .collect();
        let unconfigured = admitting
            .iter()
            .filter(|(_, config)| !config.configured)
            .map(|&(upstream, _)| upstream);
        self.claim_share(principal, unconfigured)
            .map_err(|status| report_failed(status, None, entries.len()))?;
        let store = &self.inner.store;
        let asked = Instant::now();
        let admitted = store.admit(&admitting).await;
        self.inner
            .metrics
            .record_store(StoreOp::Admit, asked.elapsed(), admitted.is_err());
        admitted.map_err(|error| report_failed(self.store_refusal(error), None, entries.len()))?;
        // Deposits are one store call each (on Redis, on different Cluster
        // slots, so never one transaction): if one fails, the status says
        // which entries were applied.
        for (index, (&(upstream, config), &(_, requests))) in
            admitting.iter().zip(&entries).enumerate()
        {
            let depositing = Instant::now();
            let deposited = store.deposit(upstream, config, requests).await;
            self.inner.metrics.record_store(
                StoreOp::Deposit,
                depositing.elapsed(),
                deposited.is_err(),
            );
            deposited
                .map_err(|error| report_failed(store_status(error), Some(index), entries.len()))?;
            self.inner.metrics.record_deposit(requests);
        }
        // At most MAX_TRAFFIC_ENTRIES (validated).
        Ok(entries.len() as u32)
    }
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
