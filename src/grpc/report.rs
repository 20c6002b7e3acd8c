//! `RetryDecider/ReportTraffic`'s edge: the report validated into the
//! pipeline's [`Report`], applied by the pipeline (`decide/report.rs`), and
//! its span.

use tonic::{Request, Response, Status};

use super::{Service, peer_addr, trace_context, validate};
use crate::budget::BudgetStore;
use crate::decide::{Hedging, Report};
use crate::engine::Served;
use crate::pb;
use crate::record::Recorder;
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
        let recorder = self.recorder();
        let span = recorder
            .tracer()
            .start(trace_context(request.metadata()).as_ref());
        let caller = || (attr::CALLER, Attribute::Text(principal.name.clone()));
        let message = request.get_ref();
        let applied = match validate::traffic_report(message)
            .and_then(|entries| Ok((entries, validate::report_id(&message.report_id)?)))
        {
            Err(invalid) => Err(Status::from(invalid)),
            Ok((entries, id)) => {
                let report = Report {
                    entries: &entries,
                    id,
                };
                self.decider()
                    .report(&live, principal, report, recorder)
                    .await
                    .map_err(|refused| self.refusal(refused))
            }
        };
        match applied {
            Ok((accepted, already_applied)) => {
                if let Some(span) = span {
                    let requests: u64 = message.traffic.iter().map(|entry| entry.requests).sum();
                    let attributes = vec![
                        (attr::TRAFFIC_ENTRIES, Attribute::Int(i64::from(accepted))),
                        (attr::TRAFFIC_REQUESTS, Attribute::Int(requests as i64)),
                        caller(),
                    ];
                    recorder
                        .tracer()
                        .finish(span, SPAN_REPORT_TRAFFIC, attributes, None);
                }
                // Each hedged upstream once, however often the report names
                // it; nothing for the others.
                let mut hedging: Vec<pb::Hedging> = Vec::new();
                for entry in &message.traffic {
                    if hedging.iter().any(|seen| seen.upstream == entry.upstream) {
                        continue;
                    }
                    if let Some(served) = self.decider().hedging(&live, &entry.upstream) {
                        record_hedging(recorder, &entry.upstream, &served);
                        hedging.push(super::answer::hedging(&entry.upstream, &served));
                    }
                }
                Ok(Response::new(pb::ReportTrafficResponse {
                    accepted,
                    already_applied,
                    hedging,
                }))
            }
            Err(status) => {
                let peer = peer_addr(&request);
                recorder.audit_refusal(RPC_REPORT_TRAFFIC, peer, Some(&principal.name), &status);
                recorder.finish_failed(span, SPAN_REPORT_TRAFFIC, &status, vec![caller()]);
                Err(status)
            }
        }
    }
}

/// The hedging gauges, as of what was just served.
pub(super) fn record_hedging(recorder: &Recorder, upstream: &str, served: &Hedging) {
    let (delay, uniformly_slow) = match served.served {
        Served::Hedge(delay) => (delay, false),
        Served::TooFewSamples => (std::time::Duration::ZERO, false),
        Served::UniformlySlow => (std::time::Duration::ZERO, true),
    };
    recorder
        .metrics()
        .record_hedging(upstream, delay, uniformly_slow);
}
