//! [`Client`]: one connection to retryd for `Decide`, `DecideStream` and
//! `ReportTraffic` (and the two admin calls a client may need), with the
//! API key on every call, TLS and mTLS through tonic's rustls, a per-call
//! timeout bounded by the caller's deadline, the local fallback when
//! retryd does not answer, and shadow answers followed by the local rule.
//!
//! It owns the connection and the calls; the rules are the engine's (via
//! [`crate::Fallback`]) and it never imports the server.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tokio::sync::mpsc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::decision::{Decision, Source};
use crate::fallback::{Fallback, FallbackPolicy};
use crate::outage::{OutageCounts, OutageLog};
use crate::reporter::{ReporterOptions, TrafficReporter};
use crate::request::InvalidRequest;
use crate::shadow::{self, DEFAULT_SHADOW_LOG_INTERVAL, ShadowLog};

/// How long a decision may take unless [`Builder::timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);
/// How long [`Builder::connect`] waits for the first connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The least time given to one decision, whatever the caller's deadline
/// says, so that retryd can still answer DENY DEADLINE.
pub const MIN_CALL_TIMEOUT: Duration = Duration::from_millis(50);

/// What can go wrong calling retryd through this client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is invalid (a bug in the caller); retryd or the same
    /// check made locally names the field.
    #[error("invalid request: {0}")]
    InvalidRequest(#[from] InvalidRequest),
    /// retryd did not answer and the fallback is off ([`Builder::no_fallback`]).
    #[error("retryd unavailable: {0}")]
    Unavailable(#[source] tonic::Status),
    /// retryd answered a report or an admin call with an error.
    #[error("retryd refused the call: {0}")]
    Refused(#[source] tonic::Status),
    /// The client's configuration cannot be used (an API key that cannot
    /// travel in a header, an endpoint that does not parse).
    #[error("invalid client configuration: {0}")]
    InvalidConfig(String),
    /// TLS could not be set up on the endpoint.
    #[error("retryd endpoint: {0}")]
    Transport(#[source] tonic::transport::Error),
}

/// Builds a [`Client`]; see [`Client::builder`].
#[derive(Clone, Debug)]
pub struct Builder {
    endpoint: String,
    api_key: Option<String>,
    tls: Option<ClientTlsConfig>,
    timeout: Duration,
    connect_timeout: Duration,
    fallback: FallbackPolicy,
    no_fallback: bool,
    reporter: Option<ReporterOptions>,
    shadow_log_interval: Duration,
}

impl Builder {
    /// Sends `authorization: Bearer <key>` with every call (the key as
    /// retryd's principals name it; printable ASCII without spaces).
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// TLS to retryd, and mTLS with an identity (`ClientTlsConfig::identity`);
    /// the endpoint should then be `https://`.
    pub fn tls(mut self, tls: ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The longest one decision may take (default 200 ms); each call is
    /// also bounded by the request's `deadline_remaining`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long [`Builder::connect`] waits for the connection (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The policy of the local fallback (default: [`FallbackPolicy::default`]).
    pub fn fallback(mut self, policy: FallbackPolicy) -> Self {
        self.fallback = policy;
        self
    }

    /// Returns [`Error::Unavailable`] instead of deciding locally when
    /// retryd does not answer. Shadow answers still follow the local rule.
    pub fn no_fallback(mut self) -> Self {
        self.no_fallback = true;
        self
    }

    /// Configures the traffic reporter (on by default, one batch a second).
    pub fn reporter(mut self, options: ReporterOptions) -> Self {
        self.reporter = Some(options);
        self
    }

    /// Switches the background traffic reporter off: first attempts are
    /// then still counted by [`Client::reporter`] but only sent on
    /// [`TrafficReporter::flush`].
    pub fn disable_reporting(mut self) -> Self {
        self.reporter = None;
        self
    }

    /// The least time between two warnings about one upstream's shadow
    /// decisions that differ from the local rule (default a minute).
    pub fn shadow_log_interval(mut self, interval: Duration) -> Self {
        self.shadow_log_interval = interval;
        self
    }

    /// Connects to retryd and waits, up to the connect timeout, for the
    /// connection, so that the first decision is retryd's and not charged
    /// with connecting. It never fails because retryd is down: the channel
    /// then connects on the next call and the fallback decides meanwhile.
    /// Needs a tokio runtime (the reporter is a task).
    pub async fn connect(self) -> Result<Client, Error> {
        let auth = match &self.api_key {
            None => None,
            Some(key) => {
                let key = key.trim();
                if key.is_empty() || !key.bytes().all(|byte| byte.is_ascii_graphic()) {
                    return Err(Error::InvalidConfig(
                        "api_key: must be printable ASCII without spaces".into(),
                    ));
                }
                Some(
                    MetadataValue::try_from(format!("Bearer {key}"))
                        .map_err(|e| Error::InvalidConfig(format!("api_key: {e}")))?,
                )
            }
        };
        let mut endpoint = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|e| Error::InvalidConfig(format!("endpoint {:?}: {e}", self.endpoint)))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        if let Some(tls) = self.tls.clone() {
            endpoint = endpoint.tls_config(tls).map_err(Error::Transport)?;
        }
        let channel = match tokio::time::timeout(self.connect_timeout, endpoint.connect()).await {
            Ok(Ok(channel)) => channel,
            // retryd is down or slow: connect on demand, decide locally
            // meanwhile. The first failing decision warns.
            _ => endpoint.connect_lazy(),
        };
        let reporter_options = self.reporter.clone().unwrap_or_default();
        let inner = Arc::new(Inner {
            decider: RetryDeciderClient::new(channel.clone()),
            admin: RetryAdminClient::new(channel),
            auth,
            timeout: self.timeout,
            fallback: Fallback::new(self.fallback),
            no_fallback: self.no_fallback,
            outage: OutageLog::default(),
            shadow: ShadowLog::new(self.shadow_log_interval),
            reporter: OnceLock::new(),
        });
        let client = Client { inner };
        let reporter = TrafficReporter::new(client.clone(), reporter_options);
        if self.reporter.is_some() {
            reporter.start();
        }
        let _ = client.inner.reporter.set(reporter);
        Ok(client)
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    decider: RetryDeciderClient<Channel>,
    admin: RetryAdminClient<Channel>,
    auth: Option<MetadataValue<Ascii>>,
    timeout: Duration,
    pub(crate) fallback: Fallback,
    no_fallback: bool,
    pub(crate) outage: OutageLog,
    shadow: ShadowLog,
    reporter: OnceLock<TrafficReporter>,
}

/// A client of one retryd. Cheap to clone (one shared connection); share
/// one per process and [`Client::close`] it on shutdown to flush traffic.
///
/// For an upstream in shadow mode (retryd answers `shadow = true`), the
/// client acts on its local rule, not on retryd's answer (which is in
/// [`Decision::retryd`]); differences are counted in
/// [`Client::shadow_divergences`] and logged at most once per upstream per
/// interval.
#[derive(Clone, Debug)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl Client {
    /// A builder for a client of retryd at `endpoint` (`http://host:port`,
    /// or `https://` with [`Builder::tls`]).
    pub fn builder(endpoint: impl Into<String>) -> Builder {
        Builder {
            endpoint: endpoint.into(),
            api_key: None,
            tls: None,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            fallback: FallbackPolicy::default(),
            no_fallback: false,
            reporter: Some(ReporterOptions::default()),
            shadow_log_interval: DEFAULT_SHADOW_LOG_INTERVAL,
        }
    }

    /// The client's traffic reporter: count every first attempt on it
    /// ([`TrafficReporter::record`]); the adapters do.
    pub fn reporter(&self) -> &TrafficReporter {
        self.inner
            .reporter
            .get()
            .expect("the reporter is set when the client is built")
    }

    /// The local fallback this client decides with when retryd does not answer.
    pub fn fallback(&self) -> &Fallback {
        &self.inner.fallback
    }

    /// What the outage log has counted.
    pub fn outage(&self) -> OutageCounts {
        self.inner.outage.counts()
    }

    /// Shadow answers that disagreed with the local rule, per upstream.
    pub fn shadow_divergences(&self) -> std::collections::HashMap<String, u64> {
        self.inner.shadow.counts()
    }

    /// Stops the reporter and sends what it holds (within `limit`).
    pub async fn close(&self, limit: Duration) -> Result<(), Error> {
        let reporter = self.reporter();
        reporter.stop();
        match tokio::time::timeout(limit, reporter.flush()).await {
            Ok(result) => result,
            Err(_) => Err(Error::Unavailable(tonic::Status::deadline_exceeded(
                "close: the last traffic batches were not taken in time",
            ))),
        }
    }

    fn request<T>(&self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        if let Some(auth) = &self.inner.auth {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// The timeout of one decision: the client's, bounded by the request's
    /// own deadline, with a floor so that retryd can still answer.
    fn call_timeout(&self, request: &pb::DecideRequest) -> Duration {
        let mut limit = self.inner.timeout;
        if let Some(remaining) = request.deadline_remaining {
            let remaining = Duration::new(
                remaining.seconds.max(0) as u64,
                remaining.nanos.clamp(0, 999_999_999) as u32,
            );
            limit = limit.min(remaining.max(MIN_CALL_TIMEOUT));
        }
        limit
    }

    /// Asks retryd whether the failed attempt `request` describes may be
    /// retried; every field is sent as it is. Bounded by the client's
    /// timeout and the request's `deadline_remaining`.
    ///
    /// An invalid request is [`Error::InvalidRequest`]. When retryd does not
    /// answer, the local fallback decides ([`Source::Fallback`]) and one
    /// warning per outage is logged, unless [`Builder::no_fallback`]. A
    /// shadow answer is followed by the local rule ([`Source::Shadow`]).
    pub async fn decide(&self, request: &pb::DecideRequest) -> Result<Decision, Error> {
        let timeout = self.call_timeout(request);
        let mut decider = self.inner.decider.clone();
        let call = decider.decide(self.request(request.clone(), timeout));
        let answer = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => return self.on_error(status, request),
            Err(_) => {
                return self.on_error(
                    tonic::Status::deadline_exceeded("no answer in time"),
                    request,
                );
            }
        };
        self.acted_on(request, &answer)
    }

    pub(crate) fn on_error(
        &self,
        status: tonic::Status,
        request: &pb::DecideRequest,
    ) -> Result<Decision, Error> {
        if status.code() == tonic::Code::InvalidArgument {
            self.inner.outage.answered();
            return Err(InvalidRequest::from_message(status.message()).into());
        }
        if self.inner.no_fallback {
            return Err(Error::Unavailable(status));
        }
        let cause = format!("{:?}: {}", status.code(), status.message());
        let decision = self.inner.fallback.decide(
            request,
            &format!("retryd unreachable ({:?})", status.code()),
            Source::Fallback,
        )?;
        self.inner.outage.fallback(&cause);
        Ok(decision)
    }

    /// The decision to act on for retryd's `answer`: retryd's own, or for
    /// a shadow answer the local rule's, with retryd's beside it.
    fn acted_on(
        &self,
        request: &pb::DecideRequest,
        answer: &pb::DecideResponse,
    ) -> Result<Decision, Error> {
        self.inner.outage.answered();
        let Some(retryd) = Decision::from_pb(answer) else {
            // An answer newer than this client: decide as if retryd had not
            // answered rather than guess what it means.
            return self.on_error(
                tonic::Status::unknown("an answer this client cannot read"),
                request,
            );
        };
        if !answer.shadow {
            return Ok(retryd);
        }
        let mut local = self.inner.fallback.decide(
            request,
            "retryd shadow answer, not enforced (upstream in shadow mode)",
            Source::Shadow,
        )?;
        if shadow::differ(&retryd, &local) {
            self.inner.shadow.record(&request.upstream, &retryd, &local);
        }
        local.decision_id = retryd.decision_id.clone();
        local.retryd = Some(Box::new(retryd));
        Ok(local)
    }

    /// Sends one traffic batch as it is (see the contract for `report_id`).
    /// Most callers let the [`TrafficReporter`] do it.
    pub async fn report_traffic(
        &self,
        report: pb::ReportTrafficRequest,
    ) -> Result<pb::ReportTrafficResponse, tonic::Status> {
        let timeout = self.inner.timeout.max(Duration::from_secs(1));
        let mut decider = self.inner.decider.clone();
        let call = decider.report_traffic(self.request(report, timeout));
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(response)) => {
                self.inner.outage.answered();
                Ok(response.into_inner())
            }
            Ok(Err(status)) => Err(status),
            Err(_) => Err(tonic::Status::deadline_exceeded("no answer in time")),
        }
    }

    /// Switches retries on or off for `upstream`, fleet-wide (admin
    /// credentials needed once retryd authenticates); returns the state
    /// before the call.
    pub async fn set_retries_enabled(
        &self,
        upstream: &str,
        enabled: bool,
        reason: &str,
    ) -> Result<bool, Error> {
        let mut admin = self.inner.admin.clone();
        let request = self.request(
            pb::SetRetriesEnabledRequest {
                upstream: upstream.into(),
                enabled,
                reason: reason.into(),
            },
            self.inner.timeout.max(Duration::from_secs(1)),
        );
        let response = admin
            .set_retries_enabled(request)
            .await
            .map_err(Error::Refused)?;
        Ok(response.into_inner().previous)
    }

    /// One upstream's budget as retryd holds it (admin).
    pub async fn get_budget(&self, upstream: &str) -> Result<pb::Budget, Error> {
        let mut admin = self.inner.admin.clone();
        let request = self.request(
            pb::GetBudgetRequest {
                upstream: upstream.into(),
            },
            self.inner.timeout.max(Duration::from_secs(1)),
        );
        let response = admin.get_budget(request).await.map_err(Error::Refused)?;
        response
            .into_inner()
            .budget
            .ok_or_else(|| Error::Refused(tonic::Status::internal("no budget in the answer")))
    }

    /// Opens a stream of decisions ([`DecideStream`]). Opening does not
    /// wait for retryd: the first [`DecideStream::decide`] does.
    pub fn decide_stream(&self) -> DecideStream {
        DecideStream {
            client: self.clone(),
            open: tokio::sync::Mutex::new(None),
        }
    }
}

/// One `DecideStream` call used for one decision after another. Safe for
/// concurrent use: decisions are serialised, which the stream's in-order
/// answers require. A stream that breaks or does not answer in time is
/// dropped and reopened by the next decision; meanwhile the fallback
/// decides, as for [`Client::decide`].
#[derive(Debug)]
pub struct DecideStream {
    client: Client,
    open: tokio::sync::Mutex<Option<OpenStream>>,
}

#[derive(Debug)]
struct OpenStream {
    requests: mpsc::Sender<pb::DecideRequest>,
    responses: tonic::Streaming<pb::DecideResponse>,
}

impl DecideStream {
    /// Sends `request` on the stream and returns its decision, with the
    /// errors, timeout and fallback of [`Client::decide`]. An item retryd
    /// rejects as invalid is [`Error::InvalidRequest`] and leaves the
    /// stream open.
    pub async fn decide(&self, request: &pb::DecideRequest) -> Result<Decision, Error> {
        let timeout = self.client.call_timeout(request);
        let mut open = self.open.lock().await;
        let answer = tokio::time::timeout(timeout, self.round_trip(&mut open, request, timeout))
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer on the stream")));
        let answer = match answer {
            Ok(answer) => answer,
            Err(status) => {
                // The stream cannot be trusted to be in step any more.
                *open = None;
                return self.client.on_error(status, request);
            }
        };
        drop(open);
        if let Some(error) = &answer.error {
            if error.code == tonic::Code::InvalidArgument as i32 {
                self.client.inner.outage.answered();
                return Err(InvalidRequest::from_message(&error.message).into());
            }
            let status = tonic::Status::new(tonic::Code::from(error.code), error.message.clone());
            return self.client.on_error(status, request);
        }
        self.client.acted_on(request, &answer)
    }

    async fn round_trip(
        &self,
        open: &mut Option<OpenStream>,
        request: &pb::DecideRequest,
        timeout: Duration,
    ) -> Result<pb::DecideResponse, tonic::Status> {
        if open.is_none() {
            let (requests, receiver) = mpsc::channel(16);
            // The first item goes in before the call, so that opening never
            // waits on a server that answers headers with its first item.
            requests
                .send(request.clone())
                .await
                .map_err(|_| tonic::Status::internal("stream closed"))?;
            let mut decider = self.client.inner.decider.clone();
            let mut call = self.client.request(
                tokio_stream::wrappers::ReceiverStream::new(receiver),
                timeout,
            );
            // A stream lives across many decisions: no grpc-timeout on it.
            call.metadata_mut().remove("grpc-timeout");
            let responses = decider.decide_stream(call).await?.into_inner();
            *open = Some(OpenStream {
                requests,
                responses,
            });
        } else if let Some(stream) = open.as_ref() {
            stream
                .requests
                .send(request.clone())
                .await
                .map_err(|_| tonic::Status::unavailable("the stream ended"))?;
        }
        let stream = open
            .as_mut()
            .ok_or_else(|| tonic::Status::internal("no stream"))?;
        match stream.responses.message().await? {
            Some(answer) => Ok(answer),
            None => Err(tonic::Status::unavailable("the stream ended")),
        }
    }
}
