//! A decision the caller gave up on spends nothing (issue 16, finding 6):
//! against the real binary, frozen with SIGSTOP as the report did it.

use retryd_testkit as support;

use std::time::{Duration, Instant};

use retryd_proto as pb;
use support::{Server, retryable};
use tonic::Code;

const CONFIG: &str =
    "[defaults]\nbudget = { capacity = 2.0, initial = 2.0, ratio = 0.0, min_per_second = 0.0 }\n";

async fn tokens(server: &Server, upstream: &str) -> f64 {
    let mut admin = server.admin().await;
    admin
        .get_budget(pb::GetBudgetRequest {
            upstream: upstream.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap()
        .tokens
}

/// Waits until the kernel reports the process in `state` ('T': stopped):
/// a signal is delivered asynchronously.
fn wait_for_state(server: &Server, state: char) {
    let path = format!("/proc/{}/stat", server.pid());
    let deadline = Instant::now() + support::HANG_GUARD;
    loop {
        let stat = std::fs::read_to_string(&path).expect("read /proc stat");
        // The state follows the parenthesised command name.
        let current = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.trim().chars().next());
        if current == Some(state) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process never reached state {state}: {stat}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    // Sets grpc-timeout, as every gRPC client does for a call with a deadline.
    request.set_timeout(timeout);
    request
}

/// Three calls time out at the client while retryd is frozen; after it
/// resumes, the 2-token budget is untouched and retryd still works.
#[tokio::test]
async fn calls_abandoned_while_frozen_spend_nothing() {
    let server = Server::start(CONFIG);
    let mut client = server.decider().await;
    frozen_run(&server, &mut client, "frozen", 0).await;
    let granted = client
        .decide(with_timeout(retryable("frozen"), Duration::from_secs(5)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(granted.verdict(), pb::Verdict::Retry, "{granted:?}");
    assert_eq!(granted.tokens_remaining, 1.0);
}

/// One frozen run on `upstream`'s fresh 2-token budget: retryd stopped,
/// three calls given up by the client (each resetting its stream), retryd
/// resumed; once it has dealt with all three (each answered
/// DEADLINE_EXCEEDED or dropped on its reset, as counted), nothing is spent.
async fn frozen_run(
    server: &Server,
    client: &mut pb::retry_decider_client::RetryDeciderClient<tonic::transport::Channel>,
    upstream: &str,
    run: usize,
) {
    // The connection is up and the bucket exists before the freeze.
    assert_eq!(tokens(server, upstream).await, 2.0);
    let before = given_up(server);
    server.signal("STOP");
    wait_for_state(server, 'T');
    for _ in 0..3 {
        // The client gives up, as the caller's fallback would: tonic's
        // client enforces grpc-timeout itself and resets the stream.
        let call = client.decide(with_timeout(
            retryable(upstream),
            Duration::from_millis(300),
        ));
        let outcome = tokio::time::timeout(Duration::from_millis(400), call).await;
        assert!(
            !matches!(outcome, Ok(Ok(_))),
            "run {run}: a frozen retryd answered: {outcome:?}"
        );
    }
    // The client's connection task writes the resets of the calls it gave
    // up on, as any client's does before its caller moves on: let it run
    // (tokio runs every ready task before a yielded one).
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    server.signal("CONT");
    let waited = Instant::now();
    while given_up(server) < before + 3.0 {
        assert!(
            waited.elapsed() < support::HANG_GUARD,
            "run {run}: {} of the three calls given up, {} tokens left",
            given_up(server) - before,
            tokens(server, upstream).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        tokens(server, upstream).await,
        2.0,
        "run {run}: {}",
        server.logs()
    );
}

/// Calls given up on so far: those answered DEADLINE_EXCEEDED and those
/// their caller's reset dropped.
fn given_up(server: &Server) -> f64 {
    let scrape = server.scrape();
    ["deadline", "cancelled"]
        .iter()
        .map(|reason| {
            let series = format!("retryd_expired_requests_total{{reason=\"{reason}\"}} ");
            scrape
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .map_or(0.0, |value| value.parse::<f64>().unwrap())
        })
        .sum()
}

/// Two threads that keep the machine's two cores busy while alive, as
/// `stress-ng --cpu 2` does.
struct CpuLoad {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuLoad {
    fn start(threads: usize) -> CpuLoad {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        CpuLoad { stop, threads }
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The frozen case, 20 times in a row with both cores busy. On a loaded
/// machine one yield let the handler run again before the connection's
/// task had processed the reset it had already read, and the call spent
/// (7 of 8 runs under `stress-ng --cpu 2`); each run here waits until
/// retryd has dealt with all three calls before it reads the budget.
#[tokio::test]
async fn calls_abandoned_while_frozen_spend_nothing_on_a_busy_machine() {
    let server = Server::start(CONFIG);
    let mut client = server.decider().await;
    let _load = CpuLoad::start(2);
    for run in 0..20 {
        frozen_run(&server, &mut client, &format!("frozen-{run}"), run).await;
    }
}

/// A DecideStream whose deadline passed answers each later item
/// DEADLINE_EXCEEDED in place, spending nothing, and the stream goes on.
#[tokio::test]
async fn stream_items_after_the_deadline_spend_nothing() {
    let server = Server::start(CONFIG);
    let mut client = server.decider().await;
    let (sender, receiver) = tokio::sync::mpsc::channel(4);
    let requests = tokio_stream::wrappers::ReceiverStream::new(receiver);
    let mut responses = client
        .decide_stream(with_timeout(requests, Duration::from_millis(500)))
        .await
        .unwrap()
        .into_inner();
    sender.send(retryable("streamed")).await.unwrap();
    let first = responses.message().await.unwrap().unwrap();
    assert_eq!(first.verdict(), pb::Verdict::Retry, "{first:?}");
    assert_eq!(first.tokens_remaining, 1.0);

    // Past the stream's deadline (measured from its start), by a margin.
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await;
    sender.send(retryable("streamed")).await.unwrap();
    let late = responses.message().await.unwrap().unwrap();
    let error = late.error.expect("an error item");
    assert_eq!(error.code, Code::DeadlineExceeded as i32, "{error:?}");
    assert!(error.message.starts_with("grpc-timeout"), "{error:?}");
    assert!(started.elapsed() >= Duration::from_millis(700));
    assert_eq!(tokens(&server, "streamed").await, 1.0, "nothing spent");
}

/// Unary: a call whose deadline is already past when the handler looks is
/// DEADLINE_EXCEEDED; the same call with time left is decided.
#[tokio::test]
async fn a_call_with_time_left_is_decided() {
    let server = Server::start(CONFIG);
    let mut client = server.decider().await;
    let decided = client
        .decide(with_timeout(retryable("timed"), Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decided.verdict(), pb::Verdict::Retry);
    // One nanosecond is gone before any handler can look.
    let status = client
        .decide(with_timeout(retryable("timed"), Duration::from_nanos(1)))
        .await
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert_eq!(tokens(&server, "timed").await, 1.0, "nothing spent");
}
