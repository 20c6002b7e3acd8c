//! `retryd-load`: a load generator for `retryd.v1.RetryDecider`.
//!
//! It drives `Decide` (unary) or `DecideStream` over N HTTP/2 connections
//! with C requests in flight on each (unary: C calls per connection;
//! stream: C messages in flight per stream), either flat out or at a fixed
//! total rate (`--rate`), for a warm-up and then a measured duration. It
//! reports throughput and latency percentiles from an HDR histogram, on
//! stderr for people and as one JSON line on stdout for scripts.
//!
//! Requests cycle through a mix of templates that retryd answers RETRY,
//! DENY and AMBIGUOUS (`--mix`), spread over `--upstreams` distinct names,
//! so the server does its real work; the response verdicts are counted and
//! reported so a run whose RETRYs silently became budget denials shows.
//!
//! With `--requests N` it sends exactly N requests flat out and measures
//! them all: a fixed amount of work, so that a server's instruction count
//! under callgrind divides into a cost per call.
//!
//! At a fixed rate the generator is open-loop: a pacer thread releases
//! tickets at the rate, evenly spaced, into one queue that every idle
//! sender draws from, and latency runs from the ticket's release, so time a
//! request waited for a free sender counts (no coordinated omission). The
//! pacer sleeps on the OS timer (tens of µs of slack), not on tokio's 1 ms
//! timer wheel, which would send in bursts and inflate the tail it measures.
//!
//! About 500 lines: the arguments, the two senders (unary, stream), the
//! run and the report, one tool; pacing and the request mix are modules.
//!
//! It only talks to the address it is given; bench scripts give it
//! loopback ones.

mod pacing;
mod requests;

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tokio::sync::{Semaphore, mpsc};
use tonic::transport::{Channel, Endpoint};

use pacing::{Tickets, start_pacer};
use requests::{Mix, Requests, retry_template};

#[derive(Parser, Debug)]
#[command(about = "Drives retryd's Decide or DecideStream and reports throughput and latency.")]
struct Args {
    /// The gRPC address to load (host:port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    target: String,
    /// Which RPC to drive.
    #[arg(long, value_enum, default_value_t = Mode::Unary)]
    mode: Mode,
    /// HTTP/2 connections.
    #[arg(long, short = 'n', default_value_t = 4)]
    connections: usize,
    /// Requests in flight: unary calls per connection, or messages per
    /// stream.
    #[arg(long, short = 'c', default_value_t = 16)]
    concurrency: usize,
    /// DecideStream streams per connection.
    #[arg(long, default_value_t = 1)]
    streams: usize,
    /// Measured time, after the warm-up.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Time under load before measuring.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Total requests per second across all connections; 0 is flat out.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Send exactly this many requests, flat out, and measure them all
    /// (instead of a warm-up and a duration): a fixed amount of work, for
    /// counting a server's instructions per call under callgrind.
    #[arg(long, conflicts_with_all = ["rate", "duration", "warmup"])]
    requests: Option<u64>,
    /// Weights of the verdict kinds the requests are built to get.
    #[arg(long, default_value = "retry=2,deny=1,ambiguous=1")]
    mix: Mix,
    /// Distinct upstream names the requests are spread over.
    #[arg(long, default_value_t = 1)]
    upstreams: usize,
    /// A label copied into the JSON line.
    #[arg(long, default_value = "")]
    label: String,
    /// Tokio worker threads of the generator (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Send every call (unary) or stream with this gRPC deadline
    /// (`grpc-timeout`), as clients with a deadline do; none by default.
    #[arg(long, value_parser = humantime::parse_duration)]
    grpc_timeout: Option<Duration>,
    /// Write one RETRY-kind request as a gRPC frame (the body h2load sends
    /// with `-d`) to this file, and exit.
    #[arg(long)]
    write_frame: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// `RetryDecider/Decide`, one call per decision.
    Unary,
    /// `RetryDecider/DecideStream`, many decisions per stream.
    Stream,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Unary => "unary",
            Mode::Stream => "stream",
        }
    }
}

/// The measured window: requests sent from `measure_from` and answered by
/// `end` count.
#[derive(Clone, Copy)]
struct Window {
    measure_from: Instant,
    end: Instant,
}

/// What one sender saw.
struct Tally {
    latency_ns: Histogram<u64>,
    retry: u64,
    deny: u64,
    ambiguous: u64,
    /// Stream items answered with `error`, and failed unary calls.
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            // 1 µs to 60 s at three significant digits.
            latency_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 3)
                .expect("the bounds are valid constants"),
            retry: 0,
            deny: 0,
            ambiguous: 0,
            errors: 0,
            first_error: None,
        }
    }

    fn record(
        &mut self,
        window: Window,
        sent: Instant,
        done: Instant,
        verdict: Result<i32, String>,
    ) {
        if sent < window.measure_from || done > window.end {
            return;
        }
        match verdict {
            Ok(verdict) => {
                self.latency_ns
                    .saturating_record((done - sent).as_nanos().min(u64::MAX as u128) as u64);
                match pb::Verdict::try_from(verdict) {
                    Ok(pb::Verdict::Retry) => self.retry += 1,
                    Ok(pb::Verdict::Deny) => self.deny += 1,
                    Ok(pb::Verdict::Ambiguous) => self.ambiguous += 1,
                    _ => self.error("a response without a verdict".into()),
                }
            }
            Err(message) => self.error(message),
        }
    }

    fn error(&mut self, message: String) {
        self.errors += 1;
        self.first_error.get_or_insert(message);
    }

    fn merge(&mut self, other: Tally) {
        // Both histograms have the same bounds, so adding cannot fail.
        let _ = self.latency_ns.add(&other.latency_ns);
        self.retry += other.retry;
        self.deny += other.deny;
        self.ambiguous += other.ambiguous;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

fn verdict_of(response: &pb::DecideResponse) -> Result<i32, String> {
    match &response.error {
        Some(error) => Err(format!("item error {}: {}", error.code, error.message)),
        None => Ok(response.verdict),
    }
}

/// A request with the deadline, if any, in its `grpc-timeout`.
fn with_deadline<T>(message: T, deadline: Option<Duration>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(deadline) = deadline {
        request.set_timeout(deadline);
    }
    request
}

async fn unary_sender(
    mut client: RetryDeciderClient<Channel>,
    mut requests: Requests,
    tickets: Tickets,
    window: Window,
    deadline: Option<Duration>,
) -> Tally {
    let mut tally = Tally::new();
    while let Some(sent) = tickets.next().await {
        let answer = client
            .decide(with_deadline(requests.next(), deadline))
            .await;
        let done = Instant::now();
        let verdict = answer
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
            .and_then(|response| verdict_of(response.get_ref()));
        tally.record(window, sent, done, verdict);
    }
    tally
}

async fn stream_sender(
    mut client: RetryDeciderClient<Channel>,
    requests: Requests,
    tickets: Tickets,
    window: Window,
    in_flight: usize,
    deadline: Option<Duration>,
) -> Tally {
    let mut tally = Tally::new();
    let credit = Arc::new(Semaphore::new(in_flight));
    // Send times, in request order; responses come back in the same order.
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<Instant>();
    let paced = tickets.is_paced();
    let outbound = futures::stream::unfold(
        (tickets, requests, Arc::clone(&credit), sent_tx),
        move |(tickets, mut requests, credit, sent_tx)| async move {
            let released = tickets.next().await?;
            credit.acquire().await.ok()?.forget();
            // Flat out, the clock starts when the request can leave; at a
            // rate, when its ticket was released.
            let sent = if paced { released } else { Instant::now() };
            sent_tx.send(sent).ok()?;
            let request = requests.next();
            Some((request, (tickets, requests, credit, sent_tx)))
        },
    );
    let mut inbound = match client
        .decide_stream(with_deadline(outbound, deadline))
        .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tally.error(format!("opening the stream: {status}"));
            return tally;
        }
    };
    loop {
        match inbound.message().await {
            Ok(Some(response)) => {
                let done = Instant::now();
                credit.add_permits(1);
                match sent_rx.try_recv() {
                    Ok(sent) => tally.record(window, sent, done, verdict_of(&response)),
                    Err(_) => {
                        tally.error("more responses than requests".into());
                        break;
                    }
                }
            }
            Ok(None) => break,
            Err(status) => {
                tally.error(format!("the stream failed: {status}"));
                break;
            }
        }
    }
    tally
}

async fn connect(target: &str) -> anyhow::Result<Channel> {
    Endpoint::from_shared(format!("http://{target}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("cannot connect to {target}"))
}

/// The run's tally, the measured window's length, and for a paced run the
/// tickets its pacer released (warm-up included).
async fn run(args: &Args) -> anyhow::Result<(Tally, Duration, Option<u64>)> {
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        channels.push(connect(&args.target).await?);
    }
    let requests = Requests::new(&args.mix, args.upstreams);
    let start = Instant::now();
    let (window, tickets) = match args.requests {
        // Every answer counts, however long they take.
        Some(count) => (
            Window {
                measure_from: start,
                end: start + Duration::from_secs(86_400),
            },
            Tickets::Counted(Arc::new(AtomicU64::new(count))),
        ),
        None => {
            let window = Window {
                measure_from: start + args.warmup,
                end: start + args.warmup + args.duration,
            };
            let tickets = if args.rate > 0.0 {
                start_pacer(args.rate, start, window.end)
            } else {
                Tickets::FlatOut { end: window.end }
            };
            (window, tickets)
        }
    };

    let mut senders = Vec::new();
    for channel in &channels {
        match args.mode {
            Mode::Unary => {
                for _ in 0..args.concurrency {
                    let client = RetryDeciderClient::new(channel.clone());
                    let requests = requests.for_sender(senders.len());
                    senders.push(tokio::spawn(unary_sender(
                        client,
                        requests,
                        tickets.clone(),
                        window,
                        args.grpc_timeout,
                    )));
                }
            }
            Mode::Stream => {
                for _ in 0..args.streams {
                    let client = RetryDeciderClient::new(channel.clone());
                    let requests = requests.for_sender(senders.len());
                    senders.push(tokio::spawn(stream_sender(
                        client,
                        requests,
                        tickets.clone(),
                        window,
                        args.concurrency,
                        args.grpc_timeout,
                    )));
                }
            }
        }
    }
    let released = tickets.released();
    drop(tickets);

    let mut total = Tally::new();
    for sender in senders {
        total.merge(sender.await.context("a sender task panicked")?);
    }
    let measured = match args.requests {
        Some(_) => start.elapsed(),
        None => window.end - window.measure_from,
    };
    let released = released.map(|count| count.load(Ordering::Relaxed));
    Ok((total, measured, released))
}

fn micros(nanos: u64) -> f64 {
    (nanos as f64 / 100.0).round() / 10.0
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(path) = &args.write_frame {
        let mut request = retry_template();
        request.upstream = "upstream-000000".into();
        let message = prost::Message::encode_to_vec(&request);
        // A gRPC frame: not compressed, then the length, big-endian.
        let mut frame = vec![0u8];
        frame.extend_from_slice(&u32::try_from(message.len())?.to_be_bytes());
        frame.extend_from_slice(&message);
        std::fs::write(path, frame).with_context(|| format!("cannot write {}", path.display()))?;
        return Ok(());
    }
    if args.connections == 0 || args.concurrency == 0 || args.streams == 0 {
        bail!("--connections, --concurrency and --streams must be at least 1");
    }
    if !(args.rate >= 0.0 && args.rate.is_finite()) {
        bail!("--rate must be a non-negative number");
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(threads);
    }
    let runtime = runtime.enable_all().build()?;
    let (tally, measured, released) = runtime.block_on(run(&args))?;

    let answered = tally.latency_ns.len();
    let throughput = answered as f64 / measured.as_secs_f64();
    let h = &tally.latency_ns;
    let (p50, p90, p99, p999, max, mean) = if answered == 0 {
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    } else {
        (
            micros(h.value_at_quantile(0.5)),
            micros(h.value_at_quantile(0.9)),
            micros(h.value_at_quantile(0.99)),
            micros(h.value_at_quantile(0.999)),
            micros(h.max()),
            (h.mean() / 100.0).round() / 10.0,
        )
    };
    eprintln!(
        "{label}{mode} {target}: {n} conns x {c} in flight{streams}, {rate}",
        label = if args.label.is_empty() {
            String::new()
        } else {
            format!("[{}] ", args.label)
        },
        mode = args.mode.as_str(),
        target = args.target,
        n = args.connections,
        c = args.concurrency,
        streams = match args.mode {
            Mode::Stream => format!(" x {} streams", args.streams),
            Mode::Unary => String::new(),
        },
        rate = match args.requests {
            Some(count) => format!("{count} requests, flat out"),
            None if args.rate > 0.0 => format!("{} req/s offered", args.rate),
            None => "flat out".to_owned(),
        },
    );
    eprintln!(
        "  {answered} answered in {:.1}s: {throughput:.0}/s; latency µs p50 {p50} p90 {p90} p99 {p99} p99.9 {p999} max {max}",
        measured.as_secs_f64()
    );
    eprintln!(
        "  verdicts: retry {} deny {} ambiguous {}; errors {}{}",
        tally.retry,
        tally.deny,
        tally.ambiguous,
        tally.errors,
        tally
            .first_error
            .as_deref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    );

    let mut json = String::new();
    let _ = write!(
        json,
        "{{\"label\":{label},\"mode\":\"{mode}\",\"target\":{target},\"connections\":{n},\
         \"concurrency\":{c},\"streams\":{s},\"rate\":{rate},\"upstreams\":{u},\
         \"duration_s\":{d:.3},\"answered\":{answered},\"throughput\":{throughput:.1},\
         \"p50_us\":{p50},\"p90_us\":{p90},\"p99_us\":{p99},\"p999_us\":{p999},\"max_us\":{max},\
         \"mean_us\":{mean},\"retry\":{r},\"deny\":{de},\"ambiguous\":{a},\"errors\":{e},\
         \"released\":{released}}}",
        label = json_string(&args.label),
        mode = args.mode.as_str(),
        target = json_string(&args.target),
        n = args.connections,
        c = args.concurrency,
        s = if args.mode == Mode::Stream {
            args.streams
        } else {
            0
        },
        rate = args.rate,
        u = args.upstreams,
        d = measured.as_secs_f64(),
        r = tally.retry,
        de = tally.deny,
        a = tally.ambiguous,
        e = tally.errors,
        // The pacer's own count, so a test can tell the offered load from
        // what a slow server answered; null when not paced.
        released = released.map_or_else(|| "null".to_string(), |count| count.to_string()),
    );
    println!("{json}");
    Ok(())
}

/// A JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            ch if (ch as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", ch as u32);
            }
            ch => out.push(ch),
        }
    }
    out.push('"');
    out
}
