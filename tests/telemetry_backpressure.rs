//! Back-pressure from the span exporter and the decision log's writer to
//! DecideStream (issue 34), against the real binary at its default
//! telemetry settings and a real OTLP/gRPC receiver in the test: a
//! receiver slower than the stream gets every span (the stream waits, and
//! the waits are counted), and one that never answers does not hold the
//! stream: its spans are dropped and counted, and warned. The same for the
//! decision log written to a FIFO that the test reads slowly, as a slow
//! disk would take it.

use retryd_testkit as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use support::{Server, retryable};

/// A receiver that takes `delay` over each export (or never answers), and
/// counts the spans of those it answered, and of those the spans of
/// upstream `pay`.
#[derive(Clone)]
struct Receiver {
    spans: Arc<AtomicU64>,
    of_pay: Arc<AtomicU64>,
    delay: Option<Duration>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        match self.delay {
            Some(delay) => tokio::time::sleep(delay).await,
            None => std::future::pending().await,
        }
        let spans: Vec<_> = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .flat_map(|scope| &scope.spans)
            .collect();
        let of_pay = spans
            .iter()
            .filter(|span| {
                span.attributes.iter().any(|kv| {
                    kv.key == "retry.upstream"
                        && kv.value.as_ref().and_then(|v| v.value.as_ref())
                            == Some(&Value::StringValue("pay".into()))
                })
            })
            .count();
        self.of_pay.fetch_add(of_pay as u64, Ordering::SeqCst);
        self.spans.fetch_add(spans.len() as u64, Ordering::SeqCst);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Receiver {
    async fn start(delay: Option<Duration>) -> (SocketAddr, Arc<AtomicU64>) {
        let (addr, spans, _) = Receiver::start_counting_pay(delay).await;
        (addr, spans)
    }

    /// Also returns the count of upstream `pay`'s spans.
    async fn start_counting_pay(
        delay: Option<Duration>,
    ) -> (SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
        let spans = Arc::new(AtomicU64::new(0));
        let of_pay = Arc::new(AtomicU64::new(0));
        let receiver = Receiver {
            spans: Arc::clone(&spans),
            of_pay: Arc::clone(&of_pay),
            delay,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(receiver))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (addr, spans, of_pay)
    }
}

/// The sum of a metric's series whose labels include `label`.
fn metric_of(scrape: &str, name: &str, label: &str) -> u64 {
    scrape
        .lines()
        .map(|line| line.split(" # ").next().unwrap_or_default().trim())
        .filter(|sample| sample.starts_with(&format!("{name}{{")) && sample.contains(label))
        .map(|sample| sample.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

/// The sum of a metric's series.
fn metric(scrape: &str, name: &str) -> u64 {
    let mut found = false;
    let mut total = 0.0;
    for line in scrape.lines() {
        let sample = line.split(" # ").next().unwrap_or_default().trim();
        if sample.starts_with(&format!("{name}{{")) || sample.starts_with(&format!("{name} ")) {
            found = true;
            total += sample.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
        }
    }
    assert!(found, "no {name} in\n{scrape}");
    total as u64
}

/// Sends `count` items over one DecideStream as fast as the stream takes
/// them; every one must be answered with a decision.
async fn stream(server: &Server, count: usize) {
    let mut client = server.decider().await;
    let items = tokio_stream::iter((0..count).map(|_| retryable("pay")));
    let mut responses = client.decide_stream(items).await.unwrap().into_inner();
    let mut answered = 0;
    while let Some(response) = responses.message().await.unwrap() {
        assert_eq!(response.error, None, "item {answered}");
        answered += 1;
    }
    assert_eq!(answered, count);
}

const BOUNDLESS: &str = "[defaults]\nbudget = { capacity = 1e9, initial = 1e9, ratio = 0.1, min_per_second = 1000.0 }\n";

#[tokio::test]
async fn a_stream_waits_for_a_slow_receiver_and_every_span_arrives() {
    // At most 16 exports of 512 spans on their way, each answered after
    // 400 ms: ~20,000 spans a second, far below what a stream decides, so
    // the default queue (8,192 spans) would overflow within the stream.
    let (receiver, received) = Receiver::start(Some(Duration::from_millis(400))).await;
    let server = Server::start(&format!(
        "{BOUNDLESS}[telemetry]\notlp_endpoint = \"http://{receiver}\"\n"
    ));
    const ITEMS: usize = 30_000;
    stream(&server, ITEMS).await;
    support::eventually("every span received", || {
        (received.load(Ordering::SeqCst) >= ITEMS as u64).then_some(())
    })
    .await;
    // The receiver counts a request's spans before it answers; the
    // exporter counts them once the answer is back, a round trip later.
    let scrape = support::eventually("every span counted as exported", || {
        let scrape = server.scrape();
        (metric(&scrape, "retryd_spans_exported_total") >= ITEMS as u64).then_some(scrape)
    })
    .await;
    assert_eq!(metric(&scrape, "retryd_decisions_total"), ITEMS as u64);
    assert_eq!(received.load(Ordering::SeqCst), ITEMS as u64);
    assert_eq!(metric(&scrape, "retryd_spans_exported_total"), ITEMS as u64);
    assert_eq!(metric(&scrape, "retryd_spans_dropped_total"), 0, "{scrape}");
    assert_eq!(metric(&scrape, "retryd_spans_export_failed_total"), 0);
    // It held the stream back to get there, and said so.
    assert!(
        metric(&scrape, "retryd_span_export_waits_total") > 0,
        "{scrape}"
    );
    assert!(
        !server.logs().contains("not keeping up"),
        "{}",
        server.logs()
    );
}

#[tokio::test]
async fn a_receiver_that_never_answers_does_not_hold_the_stream() {
    let (receiver, received) = Receiver::start(None).await;
    let server = Server::start(&format!(
        "{BOUNDLESS}[telemetry]\notlp_endpoint = \"http://{receiver}\"\n"
    ));
    // Sixteen exports of 512 held, the queue's 8,192 waiting: the rest of
    // the stream's spans have no room, and the stream waits only until
    // the exporter is taken to be stalled (500 ms without progress).
    const ITEMS: usize = 30_000;
    stream(&server, ITEMS).await;
    let scrape = server.scrape();
    assert_eq!(metric(&scrape, "retryd_decisions_total"), ITEMS as u64);
    // Dropped: what neither the queue nor the held exports could take
    // (how many exactly depends on when the exports time out).
    let dropped = metric(&scrape, "retryd_spans_dropped_total");
    assert!(dropped > 0, "{scrape}");
    assert!(metric(&scrape, "retryd_span_export_waits_total") > 0);
    assert_eq!(received.load(Ordering::SeqCst), 0);
    support::eventually("the stall and the drops are warned", || {
        let logs = server.logs();
        (logs.contains("not keeping up") && logs.contains("the span export queue is full"))
            .then_some(())
    })
    .await;
}

/// A decision log slower than the stream: written to a FIFO the test reads
/// at ~1.6 MB/s (8 KiB every 5 ms, a few thousand lines a second, below
/// what a stream decides even on a busy machine), with a queue of 512
/// lines, so that the stream outruns the writer within its first second.
/// (The queue is smaller than the default 65,536 only so that the test is
/// short: a smaller queue needs the back-pressure sooner, it relaxes
/// nothing. A batch the writer takes, 512 lines at most, ~300 KB, drains
/// in ~0.2 s, within the 500 ms after which a writer is taken to be
/// stalled.) Every line arrives, none is dropped, and the waits are
/// counted.
#[tokio::test]
async fn a_stream_waits_for_a_slow_decision_log_and_every_line_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("decisions.jsonl");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let read = Arc::new(AtomicU64::new(0));
    let reader = {
        let (fifo, read) = (fifo.clone(), Arc::clone(&read));
        std::thread::spawn(move || {
            use std::io::Read as _;
            // Opening blocks until retryd opens the log for writing.
            let mut file = std::fs::File::open(&fifo).unwrap();
            let mut all = Vec::new();
            let mut chunk = vec![0; 8 * 1024];
            loop {
                match file.read(&mut chunk).unwrap() {
                    0 => break all,
                    n => {
                        all.extend_from_slice(&chunk[..n]);
                        let lines = all
                            .split(|byte| *byte == b'\n')
                            .filter(|line| line.starts_with(br#"{"kind":"decision""#))
                            .count();
                        read.store(lines as u64, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        })
    };
    let mut server = Server::start(&format!(
        "{BOUNDLESS}[decision_log]\npath = \"{}\"\nqueue = 512\n",
        fifo.display()
    ));
    const ITEMS: usize = 5_000;
    stream(&server, ITEMS).await;
    support::eventually("every line read", || {
        (read.load(Ordering::SeqCst) >= ITEMS as u64).then_some(())
    })
    .await;
    let scrape = server.scrape();
    assert_eq!(metric(&scrape, "retryd_decisions_total"), ITEMS as u64);
    assert_eq!(
        metric(&scrape, "retryd_decision_log_dropped_total"),
        0,
        "{scrape}"
    );
    assert!(
        metric(&scrape, "retryd_decision_log_waits_total") > 0,
        "{scrape}"
    );
    assert!(
        !server.logs().contains("not keeping up"),
        "{}",
        server.logs()
    );
    server.terminate(support::HANG_GUARD);
    let all = reader.join().unwrap();
    let lines = all
        .split(|byte| *byte == b'\n')
        .filter(|line| line.starts_with(br#"{"kind":"decision""#))
        .count();
    assert_eq!(lines, ITEMS);
}

/// A DecideStream's spans go to the export queue a batch at a time
/// (`otlp::SpanBatch`): a stream that stays open after its last item,
/// answered, has every item's span exported all the same.
#[tokio::test]
async fn an_open_stream_has_every_span_exported_before_it_ends() {
    let (receiver, received) = Receiver::start(Some(Duration::ZERO)).await;
    let server = Server::start(&format!(
        "{BOUNDLESS}[telemetry]\notlp_endpoint = \"http://{receiver}\"\n"
    ));
    let mut client = server.decider().await;
    let (items, requests) = tokio::sync::mpsc::channel(16);
    let mut responses = client
        .decide_stream(tokio_stream::wrappers::ReceiverStream::new(requests))
        .await
        .unwrap()
        .into_inner();
    // Fewer than a batch, each answered before the next is sent.
    const ITEMS: u64 = 10;
    for item in 0..ITEMS {
        items.send(retryable("pay")).await.unwrap();
        let response = responses.message().await.unwrap().unwrap();
        assert_eq!(response.error, None, "item {item}");
    }
    support::eventually("every span of the open stream received", || {
        (received.load(Ordering::SeqCst) == ITEMS).then_some(())
    })
    .await;
    drop(items);
    assert!(responses.message().await.unwrap().is_none());
}

/// A caller that sends items and stops reading the answers: the server
/// stops deciding once the stream's flow-control windows are full, with
/// some spans in the stream's batch; the export task takes them at a batch
/// window, so the spans of every decision made arrive while the stream is
/// still open and unread, and while another stream keeps the export task
/// woken every few milliseconds (a window that each wake put off never
/// came).
#[tokio::test]
async fn a_stream_whose_answers_are_not_read_holds_no_span_back() {
    let (receiver, _, of_pay) = Receiver::start_counting_pay(Some(Duration::ZERO)).await;
    // `busy` has its own label; `pay`'s decisions count under `_other`.
    let server = Server::start(&format!(
        "{BOUNDLESS}[upstreams.\"busy\"]\n[telemetry]\notlp_endpoint = \"http://{receiver}\"\n"
    ));
    let decided_of = |scrape: &str, upstream: &str| {
        metric_of(
            scrape,
            "retryd_decisions_total",
            &format!("upstream=\"{upstream}\""),
        )
    };
    // Another stream, read, decides on and on throughout.
    let busy = tokio::spawn({
        let mut client = server.decider().await;
        async move {
            let items = tokio_stream::iter(std::iter::repeat_with(|| retryable("busy")));
            let mut answers = client.decide_stream(items).await.unwrap().into_inner();
            while answers.message().await.unwrap().is_some() {}
        }
    });
    support::eventually("the other stream decides", || {
        (decided_of(&server.scrape(), "busy") > 0).then_some(())
    })
    .await;
    let mut client = server.decider().await;
    // Far more items than the windows hold answers for (~40 bytes each).
    let items = tokio_stream::iter((0..200_000).map(|_| retryable("pay")));
    let responses = client.decide_stream(items).await.unwrap().into_inner();
    // Deciding stops once the answers back up: the count holds still.
    support::eventually("the stream stops deciding", {
        let server = &server;
        let mut last = (0, std::time::Instant::now());
        move || {
            let decided = decided_of(&server.scrape(), "_other");
            if decided != last.0 {
                last = (decided, std::time::Instant::now());
                None
            } else {
                (decided > 0 && last.1.elapsed() > Duration::from_secs(1)).then_some(())
            }
        }
    })
    .await;
    // A pause of a starved machine may have looked like the stop: compared
    // with the count as it is then, not as it was.
    let decided = support::eventually("a span for every decision made", || {
        let decided = decided_of(&server.scrape(), "_other");
        (of_pay.load(Ordering::SeqCst) == decided).then_some(decided)
    })
    .await;
    busy.abort();
    assert!(
        decided < 200_000,
        "every item was decided: nothing backed up"
    );
    drop(responses);
}
