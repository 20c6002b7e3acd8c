//! The one-line explanation of a decision, for humans: built only when
//! asked for, so the decision itself formats nothing.

use std::fmt;

use super::{Decision, DenyReason, Facts, FleetEffect, HedgeNote, Rule, UnknownOutcome, Verdict};

impl Decision {
    /// One line for humans, the text of `Display`, built only when asked
    /// for so that the hot path does not format strings nobody reads. The
    /// gRPC edge asks once per response, so it is written with `push_str`
    /// into one allocation rather than through `core::fmt`, which cost
    /// ~650 of a DecideStream item's ~8,700 server instructions (callgrind).
    pub fn explanation(&self) -> String {
        self.explain(None)
    }

    /// The explanation, naming the layers of a call chain's denial (which
    /// layer retried below, which one above is retrying) from the facts
    /// the decision was made on.
    pub fn explanation_in(&self, facts: &Facts<'_>) -> String {
        self.explain(Some(facts))
    }

    fn explain(&self, facts: Option<&Facts<'_>>) -> String {
        if let Some(note) = &self.hedge {
            return self.explain_hedge(note);
        }
        // The longest is under 200 bytes, plus a chain denial's layer name
        // (at most 64).
        let mut text = String::with_capacity(264);
        let evidence = self.effective_evidence.as_str();
        match self.verdict {
            Verdict::Retry {
                backoff,
                refresh_credentials,
            } => {
                // Whole milliseconds: precise enough for a human.
                text.push_str("retry after ");
                push_decimal(
                    &mut text,
                    u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX),
                );
                text.push_str("ms: ");
                match (self.http_status, self.grpc_status) {
                    _ if refresh_credentials => {
                        text.push_str("refresh credentials and replay once (rule 9, ");
                        text.push_str(match self.grpc_status {
                            Some(_) => "unauthenticated)",
                            None => "401)",
                        });
                    }
                    (Some(status), _) => {
                        text.push_str("status ");
                        push_decimal(&mut text, status.into());
                        text.push_str(" is retryable (rule 9)");
                    }
                    (None, Some(code)) => {
                        text.push_str("gRPC status ");
                        text.push_str(code.as_str());
                        text.push_str(" is retryable (rule 9)");
                    }
                    (None, None) => {
                        text.push_str("evidence ");
                        text.push_str(evidence);
                        text.push_str(" allows another attempt (rule 9)");
                    }
                }
                if self.fleet == FleetEffect::Spread {
                    text.push_str(
                        "; the upstream is recovering, and the backoff is spread over the rest of its ramp",
                    );
                }
                if self.fleet == FleetEffect::Stretched {
                    text.push_str(
                        "; the backoff was stretched past the upstream's earliest-retry time, set by another caller's Retry-After or pushback",
                    );
                }
            }
            Verdict::Ambiguous if self.rule == Rule::AMBIGUOUS_SEND => text.push_str(
                "ambiguous: the request was sent and may have taken effect; the operation is not idempotent, so reconcile (rule 8)",
            ),
            Verdict::Ambiguous => {
                text.push_str("ambiguous: evidence ");
                text.push_str(evidence);
                text.push_str(
                    " means the request may have taken effect; the operation is not idempotent, so reconcile (rule 9)",
                );
            }
            Verdict::Deny(reason) => {
                let why = match reason {
                    DenyReason::MaxAttempts => "no attempts left",
                    DenyReason::BudgetExhausted if self.fleet == FleetEffect::Ramped => {
                        "the upstream is recovering, and its retry budget admits only part of the retries yet"
                    }
                    DenyReason::BudgetExhausted => "the upstream's retry budget is empty",
                    DenyReason::BudgetUnavailable => {
                        "the shared retry budget is unreachable and the policy is to deny"
                    }
                    DenyReason::BodyNotReplayable => "the body cannot be sent again",
                    DenyReason::ResponseAlreadyDelivered => {
                        "part of the response already reached the application"
                    }
                    DenyReason::RuntimeDraining => "the caller's runtime is draining",
                    DenyReason::RetriesDisabled => "an operator switched retries off for this upstream",
                    DenyReason::RetriedBelow => {
                        "a layer below already retried this failure, and only the layer nearest a failure retries it"
                    }
                    DenyReason::InsideEnclosingRetry => {
                        "a layer above is already retrying the request this call serves"
                    }
                    DenyReason::Deadline => "the remaining deadline leaves no room for another attempt",
                    DenyReason::PermanentFailure => "the failure is permanent",
                    DenyReason::StatusNotRetryable => match (self.http_status, self.grpc_status) {
                        (None, None) => "the outcome is not retryable for this operation",
                        _ => "the status is not retryable for this operation",
                    },
                    DenyReason::ServerPushback if self.fleet == FleetEffect::Stopped => {
                        "the server asked another caller not to retry (a negative grpc-retry-pushback-ms), which stops this upstream's retries for a while"
                    }
                    DenyReason::ServerPushback => {
                        "the server asked not to retry (grpc-retry-pushback-ms)"
                    }
                    // Only hedges deny for these, and they are explained
                    // by `explain_hedge`.
                    DenyReason::HedgingOff => "hedging is off",
                    DenyReason::HedgeCap => "hedges reached their cap",
                    DenyReason::UniformlySlow => "the upstream is uniformly slow",
                };
                text.push_str("deny: ");
                text.push_str(why);
                text.push_str(" (rule ");
                push_decimal(&mut text, self.rule.number().into());
                if reason == DenyReason::StatusNotRetryable {
                    if let Some(status) = self.http_status {
                        text.push_str(", status ");
                        push_decimal(&mut text, status.into());
                    } else if let Some(code) = self.grpc_status {
                        text.push_str(", gRPC status ");
                        text.push_str(code.as_str());
                    }
                }
                match (reason, facts) {
                    (DenyReason::RetriedBelow, Some(facts)) => {
                        if let Some(layer) = facts.retried_below {
                            text.push_str(", retried by layer ");
                            text.push_str(layer);
                        }
                    }
                    (DenyReason::InsideEnclosingRetry, Some(facts)) => {
                        if let Some((layer, attempt)) = facts.lineage.enclosing_retry() {
                            text.push_str(", inside attempt ");
                            push_decimal(&mut text, attempt.into());
                            text.push_str(" of layer ");
                            text.push_str(layer);
                        }
                    }
                    _ => {}
                }
                text.push(')');
            }
        }
        if self.evidence_adjusted {
            text.push_str("; the claimed evidence was weakened to ");
            text.push_str(evidence);
        }
        // An AMBIGUOUS answer already says it; a DENY must say it too, or
        // the caller reads "failed" where the truth is "unknown".
        match (self.unknown_outcome, self.verdict) {
            (Some(UnknownOutcome::Reconcile), Verdict::Ambiguous) | (None, _) => {}
            (Some(UnknownOutcome::Reconcile), _) => text.push_str(
                "; the outcome upstream is unknown: reconcile before reporting a failure",
            ),
            (Some(UnknownOutcome::ResendWithKey), _) => text.push_str(
                "; the outcome upstream is unknown: re-send only with the same idempotency key",
            ),
        }
        text
    }
}

impl Decision {
    /// A hedge's explanation, with the numbers it was decided on.
    fn explain_hedge(&self, note: &HedgeNote) -> String {
        let mut text = String::with_capacity(200);
        let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        // "p50 9ms, p99 1007ms over 1200 samples", of the window or of its
        // recent part.
        let latencies = |text: &mut String, p50, tail, samples| {
            text.push_str("p50 ");
            push_decimal(text, millis(p50));
            text.push_str("ms, p");
            push_decimal(text, (note.tail_quantile * 1000.0).round() as u64 / 10);
            text.push(' ');
            push_decimal(text, millis(tail));
            text.push_str("ms over ");
            push_decimal(text, samples);
            text.push_str(" samples");
        };
        let numbers = |text: &mut String| {
            text.push_str("delay ");
            push_decimal(text, millis(note.delay));
            text.push_str("ms at p");
            push_decimal(text, (note.quantile * 1000.0).round() as u64 / 10);
            text.push_str(", ");
            latencies(text, note.p50, note.tail, note.samples);
            text.push_str(", ");
            push_decimal(text, note.hedges);
            text.push_str(" hedges of ");
            push_decimal(text, note.first_attempts);
            text.push_str(" first attempts in the window");
        };
        match self.verdict {
            Verdict::Retry { .. } => {
                text.push_str("hedge ");
                push_decimal(&mut text, note.hedge.into());
                text.push_str(" now: the first attempt ran past the fleet's hedge delay (");
                numbers(&mut text);
                text.push(')');
            }
            Verdict::Deny(reason) => {
                text.push_str("deny hedge ");
                push_decimal(&mut text, note.hedge.into());
                text.push_str(": ");
                text.push_str(match reason {
                    DenyReason::HedgingOff if note.quantile == 0.0 => {
                        "the upstream has no hedging policy"
                    }
                    DenyReason::HedgingOff => {
                        "hedging is off for this call (its idempotency, its hedge count, or too few latencies reported yet)"
                    }
                    DenyReason::HedgeCap => "hedges reached the cap on extra load",
                    DenyReason::UniformlySlow => {
                        "the upstream is uniformly slow (its p50 is close to its tail, over its window or its most recent sixth): a copy would be as slow"
                    }
                    DenyReason::BudgetExhausted => "the upstream's retry budget is empty",
                    DenyReason::BudgetUnavailable => {
                        "the shared retry budget is unreachable and the policy is to deny"
                    }
                    DenyReason::RetriesDisabled => {
                        "an operator switched retries off for this upstream"
                    }
                    DenyReason::Deadline => "the remaining deadline leaves no room for another attempt",
                    _ => "not hedged",
                });
                text.push_str(" (");
                numbers(&mut text);
                let recent = &note.recent;
                if reason == DenyReason::UniformlySlow && recent.samples > 0 {
                    text.push_str("; over its most recent sixth: ");
                    latencies(&mut text, recent.p50, recent.tail, recent.samples);
                }
                text.push(')');
            }
            Verdict::Ambiguous => text.push_str("ambiguous"),
        }
        text
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.explanation())
    }
}

/// Appends `n` in decimal.
pub(crate) fn push_decimal(text: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    text.extend(digits[start..].iter().map(|&digit| char::from(digit)));
}
