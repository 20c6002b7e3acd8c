//! Where a call sits in a call chain (docs/lineage.md in the repository):
//! the inbound side ([`LineageLayer`], a tower layer for HTTP and gRPC
//! servers) and what the outbound adapters read from it.
//!
//! - Downward, each outbound attempt carries the W3C `baggage` member
//!   `retryd.lineage=edge:2/middle:1`: the inbound request's lineage plus
//!   this layer's `layer:attempt`. Each Decide carries the inbound lineage,
//!   so retryd can deny a retry made inside an enclosing retry.
//! - Upward, a failed response whose handler's outbound call was retried to
//!   the end or denied says `retryd-retried: <layer>` (for gRPC also
//!   `grpc-retry-pushback-ms: -1`, which plain gRPC clients obey), and the
//!   layer above reports it as `retried_below`: only the layer nearest a
//!   failure retries it.
//!
//! The inbound request's state travels in a tokio task-local, set by the
//! layer around the handler's future: the adapters find it with no code
//! from the user. A handler that spawns a task carries it with
//! [`Inbound::scope`].
// With neither adapter, nothing sends a lineage: the outbound half is
// unused, which is no defect.
#![cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]

use std::future::Future;
#[cfg(feature = "tower")]
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "tower")]
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderValue};
use retryd_engine::{Lineage, MAX_LINEAGE_BYTES, MAX_LINEAGE_ENTRIES, layer_name};

/// The baggage member's key.
pub const BAGGAGE_KEY: &str = "retryd.lineage";
/// The upward header (and gRPC trailer) naming the layer that retried.
pub const RETRIED_HEADER: &str = "retryd-retried";

tokio::task_local! {
    static INBOUND: Arc<Inbound>;
}

/// The request being served: its lineage, this layer's name, and whether
/// an outbound call made for it failed after retryd's decision.
#[derive(Debug)]
pub struct Inbound {
    layer: String,
    lineage: String,
    dependency_failed: AtomicBool,
}

impl Inbound {
    /// A request served by `layer` (a valid layer name, else
    /// [`default_layer`]) whose `baggage` header is `baggage`.
    pub fn new(layer: &str, baggage: Option<&str>) -> Inbound {
        let layer = match layer_name(layer) {
            Ok(layer) => layer.to_owned(),
            Err(_) => default_layer(),
        };
        Inbound {
            layer,
            lineage: baggage.and_then(lineage_of_baggage).unwrap_or_default(),
            dependency_failed: AtomicBool::new(false),
        }
    }

    /// The inbound lineage, empty at the edge.
    pub fn lineage(&self) -> &str {
        &self.lineage
    }

    /// Whether an outbound call made while serving it ended in failure
    /// after retryd's decision: its failed response says so upward.
    pub fn dependency_failed(&self) -> bool {
        self.dependency_failed.load(Ordering::Relaxed)
    }

    /// Runs `future` as part of serving this request (a spawned task, a
    /// custom server): the adapters inside it find the lineage.
    pub fn scope<F: Future>(self: Arc<Self>, future: F) -> impl Future<Output = F::Output> {
        INBOUND.scope(self, future)
    }

    /// The request being served by the current task, if any.
    pub fn current() -> Option<Arc<Inbound>> {
        INBOUND.try_with(Arc::clone).ok()
    }
}

/// The layer name when none is configured: `OTEL_SERVICE_NAME` if it is a
/// valid layer name, else the program's name reduced to `[A-Za-z0-9._-]`,
/// else `service`.
pub fn default_layer() -> String {
    if let Ok(name) = std::env::var("OTEL_SERVICE_NAME") {
        if layer_name(&name).is_ok() {
            return name;
        }
    }
    let program = std::env::current_exe()
        .ok()
        .and_then(|path| {
            path.file_stem()
                .map(|stem| stem.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    let cleaned: String = program
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(retryd_engine::MAX_LAYER_BYTES)
        .collect();
    if cleaned.is_empty() {
        "service".to_owned()
    } else {
        cleaned
    }
}

/// The `retryd.lineage` member of a `baggage` header, if valid. A lineage
/// that does not parse is dropped (it came from outside: better no lineage
/// than a refused decision).
pub fn lineage_of_baggage(baggage: &str) -> Option<String> {
    let value = baggage.split(',').find_map(|member| {
        let member = member.split(';').next()?.trim();
        let (key, value) = member.split_once('=')?;
        (key.trim() == BAGGAGE_KEY).then(|| value.trim())
    })?;
    let entries: Vec<&str> = value.split('/').collect();
    let shortened = shorten(&entries, MAX_LINEAGE_ENTRIES);
    let valid = Lineage::parse(&shortened).is_ok();
    valid.then_some(shortened)
}

/// At most `max_entries` entries and [`MAX_LINEAGE_BYTES`] bytes, dropping
/// the outermost; if a dropped entry was a retry (attempt above 1), the
/// first entry becomes `...:<highest dropped attempt>` so that retryd still
/// sees that a layer above is retrying.
fn shorten(entries: &[&str], max_entries: usize) -> String {
    let attempt_of = |entry: &&str| {
        entry
            .rsplit_once(':')
            .and_then(|(_, attempt)| attempt.parse::<u32>().ok())
            .unwrap_or(1)
    };
    let mut start = entries.len().saturating_sub(max_entries);
    loop {
        let (dropped, kept) = entries.split_at(start);
        let marker = dropped
            .iter()
            .map(attempt_of)
            .max()
            .filter(|&attempt| attempt > 1)
            .map(|attempt| format!("...:{}", attempt.min(retryd_engine::MAX_LINEAGE_ATTEMPT)));
        let count = kept.len() + usize::from(marker.is_some());
        let joined = marker
            .iter()
            .map(String::as_str)
            .chain(kept.iter().copied())
            .collect::<Vec<_>>()
            .join("/");
        if (count <= max_entries && joined.len() <= MAX_LINEAGE_BYTES) || kept.len() <= 1 {
            return joined;
        }
        start += 1;
    }
}

/// The inbound lineage of the current task, empty at the edge (what a
/// Decide carries).
pub(crate) fn inbound_lineage() -> String {
    INBOUND
        .try_with(|inbound| inbound.lineage.clone())
        .unwrap_or_default()
}

/// The `retryd.lineage` value of outbound attempt `attempt`: the inbound
/// lineage (shortened to leave room) plus this layer's entry.
pub(crate) fn outbound_lineage(attempt: u32) -> String {
    let (layer, lineage) = INBOUND
        .try_with(|inbound| (inbound.layer.clone(), inbound.lineage.clone()))
        .unwrap_or_else(|_| (default_layer_cached().to_owned(), String::new()));
    let own = format!(
        "{layer}:{}",
        attempt.min(retryd_engine::MAX_LINEAGE_ATTEMPT)
    );
    if lineage.is_empty() {
        return own;
    }
    let mut entries: Vec<&str> = lineage.split('/').collect();
    entries.push(&own);
    shorten(&entries, MAX_LINEAGE_ENTRIES)
}

fn default_layer_cached() -> &'static str {
    static LAYER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LAYER.get_or_init(default_layer)
}

/// Sets the `retryd.lineage` member on an outbound attempt's `baggage`,
/// keeping the other members.
pub(crate) fn set_baggage(headers: &mut HeaderMap, attempt: u32) {
    let member = format!("{BAGGAGE_KEY}={}", outbound_lineage(attempt));
    let value = match headers.get("baggage").and_then(|value| value.to_str().ok()) {
        None => member,
        Some(existing) => {
            let others = existing
                .split(',')
                .filter(|m| {
                    let key = m.split(['=', ';']).next().unwrap_or_default().trim();
                    !m.trim().is_empty() && key != BAGGAGE_KEY
                })
                .map(str::trim);
            others
                .chain(std::iter::once(member.as_str()))
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert("baggage", value);
    }
}

/// The `retryd-retried` of a failed response, if it names a valid layer
/// (anything else came from an upstream we do not control: ignored).
pub(crate) fn retried_below(headers: &HeaderMap) -> String {
    headers
        .get(RETRIED_HEADER)
        .and_then(|value| value.to_str().ok())
        .filter(|layer| layer_name(layer).is_ok())
        .unwrap_or_default()
        .to_owned()
}

/// Notes that an outbound call of the request being served failed after
/// retryd's decision (no more attempts): its failed response says so.
pub(crate) fn note_dependency_failed() {
    let _ = INBOUND.try_with(|inbound| inbound.dependency_failed.store(true, Ordering::Relaxed));
}

#[cfg(feature = "tower")]
pub use self::layer::{LineageBody, LineageLayer, LineageService};

#[cfg(feature = "tower")]
mod layer {
    use super::*;

    /// A tower layer for servers (axum, hyper, tonic): reads the inbound
    /// lineage for the adapters, and marks a failed response whose handler's
    /// outbound call was retried to the end or denied.
    #[derive(Clone, Debug)]
    pub struct LineageLayer {
        layer: Arc<str>,
    }

    impl LineageLayer {
        /// The layer named `layer` (a valid layer name, else
        /// [`default_layer`]).
        pub fn new(layer: impl Into<String>) -> LineageLayer {
            let layer = layer.into();
            let layer = if layer_name(&layer).is_ok() {
                layer
            } else {
                default_layer()
            };
            LineageLayer {
                layer: layer.into(),
            }
        }
    }

    impl<S> tower_layer::Layer<S> for LineageLayer {
        type Service = LineageService<S>;

        fn layer(&self, inner: S) -> LineageService<S> {
            LineageService {
                inner,
                layer: Arc::clone(&self.layer),
            }
        }
    }

    /// The service of [`LineageLayer`].
    #[derive(Clone, Debug)]
    pub struct LineageService<S> {
        inner: S,
        layer: Arc<str>,
    }

    impl<S, B, R> tower_service::Service<http::Request<B>> for LineageService<S>
    where
        S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
        S::Future: Send + 'static,
    {
        type Response = http::Response<LineageBody<R>>;
        type Error = S::Error;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<LineageBody<R>>, S::Error>> + Send>>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let baggage = request
                .headers()
                .get("baggage")
                .and_then(|value| value.to_str().ok());
            let inbound = Arc::new(Inbound::new(&self.layer, baggage));
            let future = INBOUND.scope(Arc::clone(&inbound), self.inner.call(request));
            Box::pin(async move {
                let mut response = future.await?;
                if inbound.dependency_failed() {
                    mark(&mut response, &inbound.layer);
                }
                // A status already in the headers needs no trailer mark.
                let trailers = !response.headers().contains_key("grpc-status");
                Ok(response.map(|inner| LineageBody {
                    inner,
                    inbound,
                    trailers,
                }))
            })
        }
    }

    pin_project_lite::pin_project! {
        /// The response body of [`LineageService`]: the handler's, polled
        /// inside the inbound request's scope (so that an outbound call
        /// made while a streamed response is produced carries its lineage
        /// too), with the upward mark added to a gRPC failure sent in
        /// trailers after response messages (a streaming handler's late
        /// error) when an outbound call of the request failed after
        /// retryd's decision.
        #[derive(Debug)]
        pub struct LineageBody<B> {
            #[pin]
            inner: B,
            inbound: Arc<Inbound>,
            trailers: bool,
        }
    }

    impl<B: http_body::Body> http_body::Body for LineageBody<B> {
        type Data = B::Data;
        type Error = B::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
            let this = self.project();
            let inbound = Arc::clone(this.inbound);
            let inner = this.inner;
            let polled = INBOUND.sync_scope(Arc::clone(&inbound), || inner.poll_frame(cx));
            if let Poll::Ready(Some(Ok(mut frame))) = polled {
                if *this.trailers && inbound.dependency_failed() {
                    if let Some(trailers) = frame.trailers_mut() {
                        mark_trailers(trailers, &inbound.layer);
                    }
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            polled
        }

        fn is_end_stream(&self) -> bool {
            self.inner.is_end_stream()
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.inner.size_hint()
        }
    }

    /// Adds the upward signal to gRPC trailers carrying a failure.
    pub(super) fn mark_trailers(trailers: &mut HeaderMap, layer: &str) {
        let failed = trailers
            .get("grpc-status")
            .is_some_and(|status| status.as_bytes() != b"0");
        if !failed {
            return;
        }
        if let Ok(value) = HeaderValue::from_str(layer) {
            trailers.insert(RETRIED_HEADER, value);
            trailers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
        }
    }

    /// Adds the upward signal to a failed response: a 5xx, or a gRPC status
    /// other than OK in the headers (a trailers-only response, which is how a
    /// tonic handler's error is sent).
    pub(super) fn mark<R>(response: &mut http::Response<R>, layer: &str) {
        let grpc_failed = response
            .headers()
            .get("grpc-status")
            .is_some_and(|status| status.as_bytes() != b"0");
        if !(response.status().is_server_error() || grpc_failed) {
            return;
        }
        let Ok(value) = HeaderValue::from_str(layer) else {
            return;
        };
        let headers = response.headers_mut();
        headers.insert(RETRIED_HEADER, value);
        if grpc_failed {
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_member_is_found_among_others() {
        assert_eq!(
            lineage_of_baggage("a=1, retryd.lineage=edge:2/middle:1;prop=x ,b=2").as_deref(),
            Some("edge:2/middle:1")
        );
        assert_eq!(lineage_of_baggage("a=1"), None);
        assert_eq!(
            lineage_of_baggage("retryd.lineage=edge"),
            None,
            "invalid: dropped"
        );
    }

    #[test]
    fn a_long_lineage_keeps_its_innermost_entries_and_any_retry_above() {
        let mut entries = vec!["outer:3"];
        entries.extend(std::iter::repeat_n("a:1", 40));
        let shortened = shorten(&entries, MAX_LINEAGE_ENTRIES);
        let parsed = Lineage::parse(&shortened).unwrap();
        assert_eq!(parsed.depth() as usize, MAX_LINEAGE_ENTRIES + 1);
        assert!(shortened.starts_with("...:3/a:1"), "{shortened}");
        assert_eq!(parsed.enclosing_retry(), Some(("...", 3)));
        // Only first attempts dropped: nothing to keep.
        let plain = vec!["a:1"; 40];
        assert_eq!(
            shorten(&plain, MAX_LINEAGE_ENTRIES),
            vec!["a:1"; 32].join("/")
        );
    }

    #[tokio::test]
    async fn outbound_attempts_append_their_entry() {
        let inbound = Arc::new(Inbound::new("middle", Some("retryd.lineage=edge:2")));
        let (first, second, decide) = Arc::clone(&inbound)
            .scope(async { (outbound_lineage(1), outbound_lineage(2), inbound_lineage()) })
            .await;
        assert_eq!(first, "edge:2/middle:1");
        assert_eq!(second, "edge:2/middle:2");
        assert_eq!(decide, "edge:2");
        // Outside any inbound request: the edge, its own entry only.
        assert_eq!(inbound_lineage(), "");
        assert!(outbound_lineage(1).ends_with(":1"));
    }

    #[test]
    fn baggage_keeps_other_members() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "baggage",
            HeaderValue::from_static("k=v,retryd.lineage=old:1"),
        );
        set_baggage(&mut headers, 2);
        let value = headers["baggage"].to_str().unwrap();
        assert!(value.starts_with("k=v,retryd.lineage="), "{value}");
        assert!(!value.contains("old:1"), "{value}");
    }

    #[cfg(feature = "tower")]
    #[test]
    fn only_a_failed_response_is_marked() {
        use super::layer::mark;
        let mut ok = http::Response::new(());
        mark(&mut ok, "middle");
        assert!(ok.headers().get(RETRIED_HEADER).is_none());
        let mut unavailable = http::Response::new(());
        *unavailable.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        mark(&mut unavailable, "middle");
        assert_eq!(unavailable.headers()[RETRIED_HEADER], "middle");
        let mut grpc = http::Response::new(());
        grpc.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("14"));
        mark(&mut grpc, "middle");
        assert_eq!(grpc.headers()["grpc-retry-pushback-ms"], "-1");
        assert!(retried_below(unavailable.headers()) == "middle");
        // A failure in trailers after messages: marked there.
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("14"));
        super::layer::mark_trailers(&mut trailers, "middle");
        assert_eq!(trailers[RETRIED_HEADER], "middle");
        assert_eq!(trailers["grpc-retry-pushback-ms"], "-1");
        let mut ok_trailers = HeaderMap::new();
        ok_trailers.insert("grpc-status", HeaderValue::from_static("0"));
        super::layer::mark_trailers(&mut ok_trailers, "middle");
        assert!(ok_trailers.get(RETRIED_HEADER).is_none());
        let mut junk = HeaderMap::new();
        junk.insert(RETRIED_HEADER, HeaderValue::from_static("a b"));
        assert_eq!(retried_below(&junk), "");
    }
}
