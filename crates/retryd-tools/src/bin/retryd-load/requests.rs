//! What `retryd-load` sends: the RETRY, DENY and AMBIGUOUS templates, mixed
//! by weight (`--mix`) and spread over `--upstreams` names.

use std::str::FromStr;
use std::sync::Arc;

use retryd_proto as pb;

/// Weights of `retry`, `deny` and `ambiguous` requests.
#[derive(Clone, Debug)]
pub(crate) struct Mix {
    retry: usize,
    deny: usize,
    ambiguous: usize,
}

impl FromStr for Mix {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut mix = Mix {
            retry: 0,
            deny: 0,
            ambiguous: 0,
        };
        for part in text.split(',').filter(|part| !part.is_empty()) {
            let (kind, weight) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected KIND=WEIGHT"))?;
            let weight: usize = weight
                .parse()
                .map_err(|_| format!("{part:?}: the weight is not a whole number"))?;
            match kind {
                "retry" => mix.retry = weight,
                "deny" => mix.deny = weight,
                "ambiguous" => mix.ambiguous = weight,
                other => return Err(format!("{other:?}: kinds are retry, deny, ambiguous")),
            }
        }
        if mix.retry + mix.deny + mix.ambiguous == 0 {
            return Err("the weights add up to zero".into());
        }
        Ok(mix)
    }
}

/// What every template shares: a first attempt with 2 s of deadline left,
/// and a replayable body.
fn template(operation: &str, idempotency: pb::Idempotency) -> pb::DecideRequest {
    pb::DecideRequest {
        operation: operation.into(),
        idempotency: idempotency as i32,
        body: Some(pb::Body {
            kind: pb::BodyKind::Bytes as i32,
            ..pb::Body::default()
        }),
        attempt: 1,
        deadline_remaining: Some(prost_types::Duration {
            seconds: 2,
            nanos: 0,
        }),
        ..pb::DecideRequest::default()
    }
}

/// A request retryd answers RETRY: an idempotent call whose connect failed
/// (proven not sent), with deadline to spare. It spends one token.
pub(crate) fn retry_template() -> pb::DecideRequest {
    pb::DecideRequest {
        evidence: pb::Evidence::NotSent as i32,
        failure: pb::FailureKind::Connect as i32,
        ..template("PUT /v1/accounts/{id}", pb::Idempotency::Idempotent)
    }
}

/// A request retryd answers DENY (status not retryable) after checking
/// every rule: a safe call that got a 404.
pub(crate) fn deny_template() -> pb::DecideRequest {
    pb::DecideRequest {
        body: None,
        evidence: pb::Evidence::ResponseReceived as i32,
        http_status: 404,
        ..template("GET /v1/accounts/{id}", pb::Idempotency::Safe)
    }
}

/// A request retryd answers AMBIGUOUS: a non-idempotent charge that failed
/// with a generic I/O error, so it may have been sent.
pub(crate) fn ambiguous_template() -> pb::DecideRequest {
    pb::DecideRequest {
        evidence: pb::Evidence::NotSent as i32,
        failure: pb::FailureKind::GenericIo as i32,
        ..template("POST /v1/charges", pb::Idempotency::NonIdempotent)
    }
}

/// Builds each sender's requests: the mix's templates in turn, each for
/// the next upstream name.
#[derive(Clone)]
pub(crate) struct Requests {
    templates: Arc<Vec<pb::DecideRequest>>,
    upstreams: Arc<Vec<String>>,
    next_template: usize,
    next_upstream: usize,
}

impl Requests {
    pub(crate) fn new(mix: &Mix, n_upstreams: usize) -> Self {
        let mut templates = Vec::new();
        templates.extend(std::iter::repeat_n(retry_template(), mix.retry));
        templates.extend(std::iter::repeat_n(deny_template(), mix.deny));
        templates.extend(std::iter::repeat_n(ambiguous_template(), mix.ambiguous));
        let upstreams = (0..n_upstreams.max(1))
            .map(|i| format!("upstream-{i:06}"))
            .collect();
        Requests {
            templates: Arc::new(templates),
            upstreams: Arc::new(upstreams),
            next_template: 0,
            next_upstream: 0,
        }
    }

    /// The same sequence, started at a different place for sender `index`.
    pub(crate) fn for_sender(&self, index: usize) -> Self {
        Requests {
            next_template: index % self.templates.len(),
            next_upstream: index.wrapping_mul(7919) % self.upstreams.len(),
            ..self.clone()
        }
    }

    pub(crate) fn next(&mut self) -> pb::DecideRequest {
        let mut request = self.templates[self.next_template].clone();
        request.upstream = self.upstreams[self.next_upstream].clone();
        self.next_template = (self.next_template + 1) % self.templates.len();
        self.next_upstream = (self.next_upstream + 1) % self.upstreams.len();
        request
    }
}
