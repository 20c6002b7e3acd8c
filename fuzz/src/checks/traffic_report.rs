//! Fuzz target `traffic_report`: validation of a `ReportTrafficRequest`.

use prost::Message;
use retryd::grpc::validate;
use retryd_proto as pb;

use super::common::{Input, check_invalid_request, check_name, name};

/// Fuzz target `traffic_report`: a mode byte, then a protobuf
/// `ReportTrafficRequest` (even mode) or bytes mapped to one (odd mode).
pub fn traffic_report(data: &[u8]) {
    let mut input = Input::new(data);
    let request = if input.byte() % 2 == 0 {
        match pb::ReportTrafficRequest::decode(input.rest()) {
            Ok(request) => request,
            Err(_) => return,
        }
    } else {
        let n_entries = input.pick(&[
            0,
            1,
            2,
            3,
            4,
            validate::MAX_TRAFFIC_ENTRIES,
            validate::MAX_TRAFFIC_ENTRIES + 1,
            1,
        ]);
        let traffic = (0..n_entries)
            .map(|_| pb::UpstreamTraffic {
                upstream: name(&mut input),
                requests: match input.byte() % 6 {
                    0 => 0,
                    1 => 1_000_000_000,
                    2 => 1_000_000_001,
                    3 => input.u64(),
                    _ => u64::from(input.u16()),
                },
                successes: count(&mut input),
                failures: count(&mut input),
                retry_successes: count(&mut input),
                retry_failures: count(&mut input),
                // Drawn after the outcomes, so that older inputs read the
                // same counts as before (an exhausted input reads 0).
                hedges_won: count(&mut input),
                ..Default::default()
            })
            .collect();
        pb::ReportTrafficRequest {
            traffic,
            ..Default::default()
        }
    };
    check_traffic_report(&request);
}

/// An outcome count: mostly small, sometimes at or over the bound.
fn count(input: &mut Input<'_>) -> u64 {
    match input.byte() % 8 {
        0 => 1_000_000_000,
        1 => 1_000_000_001,
        2 => input.u64(),
        _ => u64::from(input.byte()),
    }
}

/// Validation of a traffic report keeps every entry, in order, within the
/// limits, or names the entry at fault.
pub fn check_traffic_report(request: &pb::ReportTrafficRequest) {
    match validate::traffic_report(request) {
        Ok(entries) => {
            assert!(entries.len() <= validate::MAX_TRAFFIC_ENTRIES);
            assert_eq!(entries.len(), request.traffic.len());
            for (traffic, entry) in entries.iter().zip(&request.traffic) {
                let upstream = traffic.upstream;
                assert!(!upstream.is_empty(), "an empty upstream passed");
                check_name("upstream", upstream);
                assert_eq!(upstream, entry.upstream);
                let outcomes = &traffic.outcomes;
                for (kept, sent) in [
                    (traffic.requests, entry.requests),
                    (outcomes.successes, entry.successes),
                    (outcomes.failures, entry.failures),
                    (outcomes.retry_successes, entry.retry_successes),
                    (outcomes.retry_failures, entry.retry_failures),
                    (traffic.hedges_won, entry.hedges_won),
                ] {
                    assert_eq!(kept, sent);
                    assert!(kept <= 1_000_000_000, "{kept} passed");
                }
            }
        }
        Err(invalid) => {
            check_invalid_request(&invalid, &["traffic"]);
            if let Some(index) = invalid
                .field
                .strip_prefix("traffic[")
                .and_then(|rest| rest.split(']').next())
            {
                let index: usize = index.parse().expect("an entry's index");
                assert!(index < request.traffic.len(), "{invalid}");
            }
        }
    }
}
