//! The `retryd` command: `serve` (the default), `check-config`, `replay`, `health` and
//! `hash-key`.
//! Startup wiring only: load and validate configuration, start telemetry,
//! choose the budget store once, serve until SIGTERM or SIGINT. (About 500
//! lines: one function per subcommand, each reading top to bottom.)

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use retryd::config::{Config, StoreConfig};
use retryd::decision_log::DecisionLog;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{self, Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::redis::{Mode, RedisConfig, RedisMode, redact_url};
use retryd_budget::{BudgetStore, ExactStore, LeasedStore, MemoryBudgetStore, RedisBudgetStore};

#[derive(Parser)]
#[command(
    version = retryd::build::LONG_VERSION,
    about = "Decides whether a failed outbound call may be retried."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gRPC API (the default when no command is given).
    Serve {
        /// A TOML configuration file; without one, built-in defaults.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate a configuration file (and RETRYD__ overrides) and exit.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
    /// Print the SHA-256 of an API key read from stdin (one line), for
    /// `auth.principals[].api_keys_sha256`.
    ///
    /// A key is printable ASCII without spaces (it travels in an HTTP/2
    /// header, `authorization: Bearer <key>`), at least 16 characters.
    /// Leading and trailing whitespace, the newline included, is trimmed,
    /// here as by the server; the hash is the SHA-256 of the trimmed key's
    /// UTF-8 bytes, printed as 64 lower-case hex digits.
    HashKey,
    /// Decide a recorded decision log (`[decision_log]`) again under a
    /// configuration, budgets included, and print per upstream how it
    /// would have decided.
    Replay {
        /// The configuration to replay under (a candidate, or the live one).
        #[arg(long, short)]
        config: PathBuf,
        /// The decision log, JSON lines.
        file: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Ask a running retryd's gRPC health service; exit 0 if it is serving.
    Health {
        /// The gRPC address to ask.
        #[arg(long, default_value = "127.0.0.1:50051")]
        addr: SocketAddr,
        /// The health entry to ask about: `retryd.v1.RetryDecider` (the
        /// decider, NOT_SERVING once a drain begins), `retryd.v1.BudgetStore`
        /// (all of the store reachable), `retryd.v1.BudgetStore.Any` (any of
        /// it), or "" (the server as a whole).
        #[arg(long, default_value = "retryd.v1.RetryDecider")]
        service: String,
        /// How long to wait for an answer.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Serve { config: None }) {
        Command::Serve { config } => serve(config),
        Command::CheckConfig { file } => check_config(&file),
        Command::Health {
            addr,
            service,
            timeout,
        } => health(addr, &service, timeout),
        Command::HashKey => hash_key(),
        Command::Replay { config, file, json } => replay(&config, &file, json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("retryd: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn replay(config: &std::path::Path, file: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let config = Config::load(Some(config))?;
    let log = std::fs::File::open(file)
        .with_context(|| format!("cannot open the decision log {}", file.display()))?;
    let replay = retryd::decide::replay::replay(&config, std::io::BufReader::new(log))
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{}", file.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&replay)?);
    } else {
        print!("{}", replay.table());
    }
    Ok(())
}

fn check_config(file: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(Some(file))?;
    // The certificates and keys are parsed as serving would parse them.
    Acceptor::try_new(config.tls.as_ref(), &config.server_limits)?;
    println!(
        "{}: ok ({} named upstreams, store {})",
        file.display(),
        config.policies.named().count(),
        match &config.store {
            StoreConfig::Memory => "memory".to_owned(),
            StoreConfig::Redis(redis) => format!("redis, {}", describe_redis(redis)),
        }
    );
    // Telemetry as resolved from [telemetry] and the OTEL_* variables
    // (header values are secrets, and are not shown).
    println!("telemetry:");
    for (setting, value, origin) in &config.telemetry.origins {
        // An endpoint may carry credentials.
        let shown = if *setting == "otlp endpoint" {
            redact_url(value)
        } else {
            value.clone()
        };
        println!("  {setting}: {shown} ({origin})");
    }
    Ok(())
}

fn hash_key() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("cannot read the key from stdin")?;
    // Trimmed by the same function the server's hash goes through.
    let key = retryd::auth::normalize_key(&line);
    check_key(key)?;
    let hash = retryd::auth::hash_key(key);
    println!("{}", hex::encode(hash));
    Ok(())
}

/// Refuses a (trimmed) key that a caller could not send as typed in an
/// `authorization` header, or that is too short to be a secret. The
/// message names what is wrong, never the key's characters.
fn check_key(key: &str) -> anyhow::Result<()> {
    if let Some(bad) = key.chars().find(|c| !c.is_ascii_graphic()) {
        let what = if bad.is_whitespace() {
            "whitespace inside it"
        } else if bad.is_control() {
            "a control character"
        } else {
            "a non-ASCII character"
        };
        anyhow::bail!(
            "an API key is printable ASCII without spaces (it travels in an HTTP/2 header); this one has {what}"
        );
    }
    anyhow::ensure!(
        key.len() >= retryd::auth::MIN_KEY_LEN,
        "an API key should be at least 16 characters"
    );
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn health(addr: SocketAddr, service: &str, timeout: Duration) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(timeout)
            .timeout(timeout);
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("cannot reach {addr}"))?;
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
        let response = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .with_context(|| format!("health check of {service:?} failed"))?;
        let status = response.into_inner().status();
        println!("{status:?}");
        anyhow::ensure!(
            status == tonic_health::pb::health_check_response::ServingStatus::Serving,
            "not serving"
        );
        Ok(())
    })
}

fn serve(config_path: Option<PathBuf>) -> anyhow::Result<()> {
    // Every bad value is refused before any port is bound.
    let config = Config::load(config_path.as_deref())?;
    if !config.listen.ip().is_loopback() && !config.auth.is_enabled() {
        eprintln!(
            "retryd: WARNING: serving {} without authentication (server.allow_unauthenticated)",
            config.listen
        );
    }
    telemetry::init_logs(&config.telemetry).map_err(anyhow::Error::msg)?;
    let principals = config.auth.principal_names().len();
    if config.auth.is_enabled() && principals > 1 && config.max_upstreams_per_principal.is_none() {
        tracing::warn!(
            principals,
            "limits.max_upstreams_per_principal = 0: the principals share limits.max_upstreams with no share of their own, so one team's flood of upstream names refuses every other team's new upstreams"
        );
    }
    let acceptor = Acceptor::try_new(config.tls.as_ref(), &config.server_limits)?;
    let decision_log = config
        .decision_log
        .as_ref()
        .map(|log| {
            DecisionLog::open(&log.path, log.queue, log.max_bytes)
                .with_context(|| format!("decision_log.path: cannot open {}", log.path.display()))
        })
        .transpose()?;
    let served = Served {
        config_path,
        acceptor,
        decision_log,
    };
    runtime()?.block_on(async move {
        match config.store.clone() {
            StoreConfig::Memory => {
                let store = MemoryBudgetStore::new(config.max_upstreams)
                    .with_max_report_ids(config.report_ids.max_ids);
                run(config, served, store, "memory").await
            }
            // The mode is chosen here, once, as a type: no store operation
            // asks it again.
            StoreConfig::Redis(redis) => match redis.mode {
                RedisMode::Exact => {
                    let label = "redis-exact";
                    let store: ExactStore =
                        connect_redis(&redis, config.max_upstreams, label).await?;
                    run(config, served, store, label).await
                }
                RedisMode::Leased => {
                    let label = "redis-leased";
                    let store: LeasedStore =
                        connect_redis(&redis, config.max_upstreams, label).await?;
                    run(config, served, store, label).await
                }
            },
        }
    })
}

async fn connect_redis<M: Mode>(
    redis: &RedisConfig,
    max_upstreams: usize,
    label: &'static str,
) -> anyhow::Result<RedisBudgetStore<M>> {
    // `RedisUrl` prints without its credentials.
    let urls = redis
        .urls
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if redis.access.tls.insecure_skip_verify {
        tracing::warn!(
            "store.tls.insecure_skip_verify is set: the Redis server's certificate is NOT verified; anyone on the path can read and change budgets"
        );
    }
    tracing::info!(topology = %describe_redis(redis), "connecting to Redis");
    let store = RedisBudgetStore::<M>::connect(redis, max_upstreams)
        .await
        .with_context(|| format!("store.url: cannot use Redis at {urls}"))?;
    tracing::info!(urls, mode = label, "budgets shared through Redis");
    Ok(store)
}

/// The Redis topology and how it is reached, without any secret: for
/// `check-config` and the startup log.
fn describe_redis(redis: &RedisConfig) -> String {
    let access = &redis.access;
    let topology = match &access.sentinel {
        Some(sentinel) => format!(
            "sentinel master {:?} via {} sentinel(s)",
            sentinel.master_name,
            redis.urls.len()
        ),
        None if redis.urls.len() > 1 => format!("cluster of {} seed nodes", redis.urls.len()),
        None => "one node (or a cluster seed)".to_owned(),
    };
    let tls = if !redis.urls.iter().any(|url| url.is_tls()) {
        "no TLS"
    } else if access.tls.insecure_skip_verify {
        "TLS WITHOUT certificate verification"
    } else if access.tls.client_pem.is_some() {
        "mutual TLS"
    } else {
        "TLS"
    };
    let user = match (&access.username, &access.password) {
        (Some(user), _) => format!("user {user:?}"),
        (None, Some(_)) => "password".to_owned(),
        (None, None) => "credentials from the URL, if any".to_owned(),
    };
    format!("{topology}, {tls}, {user}")
}

/// What `serve` prepared before any port is bound.
struct Served {
    config_path: Option<PathBuf>,
    acceptor: Acceptor,
    decision_log: Option<DecisionLog>,
}

async fn run<S: BudgetStore>(
    config: Config,
    served: Served,
    store: S,
    store_label: &'static str,
) -> anyhow::Result<()> {
    let Served {
        config_path,
        acceptor,
        decision_log,
    } = served;
    let grpc_listener = grpc::bind(config.listen)
        .await
        .with_context(|| format!("server.listen: cannot bind {}", config.listen))?;
    let metrics_listener = grpc::bind(config.metrics_listen).await.with_context(|| {
        format!(
            "server.metrics_listen: cannot bind {}",
            config.metrics_listen
        )
    })?;
    let grpc_addr = grpc_listener.local_addr()?;
    let metrics_addr = metrics_listener.local_addr()?;

    let metrics = Arc::new(Metrics::with_principals(
        config.policies.named().map(|(name, _)| name),
        config.auth.principal_names(),
    ));
    let (tracer, tracer_guard) =
        Tracer::from_config(&config.telemetry, Arc::clone(&metrics)).map_err(anyhow::Error::msg)?;
    if let Some(export) = &config.telemetry.otlp {
        tracing::info!(
            // An endpoint may carry credentials too.
            endpoint = %redact_url(&export.endpoint),
            protocol = export.protocol.as_str(),
            "exporting decision spans over OTLP"
        );
    }
    let shutdown_grace = config.shutdown_grace;
    let service = Service::new(
        store,
        store_label,
        Reload {
            path: config_path,
            startup: config.clone(),
        },
        Arc::clone(&metrics),
        tracer,
    );
    let service = match decision_log {
        Some(log) => service.with_decision_log(log),
        None => service,
    };
    tokio::spawn(reload_on_sighup(service.clone()));
    tokio::spawn(flush_refusals(service.clone()));
    let store_for_shutdown = service.clone();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The budget gauges come from a snapshot: a scrape lists the store at
    // most once per interval, never once per request.
    let gauges = Arc::new(telemetry::BudgetGauges::new());
    let scrape = {
        let service = service.clone();
        let metrics = Arc::clone(&metrics);
        move || {
            let service = service.clone();
            let metrics = Arc::clone(&metrics);
            let gauges = Arc::clone(&gauges);
            async move {
                let live = service.policies();
                let store = service.store();
                let budgets = gauges
                    .budgets(|| store.list(|upstream| live.policies.get(upstream).bucket))
                    .await;
                metrics.render_with_ramps(
                    &budgets,
                    store.availability(),
                    &store.stats(),
                    &|upstream| live.policies.get(upstream).ramp_window,
                )
            }
        }
    };
    let metrics_task = tokio::spawn(telemetry::serve_metrics(metrics_listener, scrape, {
        let mut stop = stop_rx.clone();
        async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        }
    }));

    tracing::info!(grpc = %grpc_addr, metrics = %metrics_addr, "retryd listening");
    // The one line on stdout: where to connect, for scripts and tests that
    // start retryd on port 0.
    println!("{{\"grpc\":\"{grpc_addr}\",\"metrics\":\"{metrics_addr}\"}}");

    grpc::serve(
        grpc_listener,
        acceptor,
        service,
        async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        },
        shutdown_grace,
    )
    .await
    .context("the gRPC server failed")?;
    let _ = metrics_task.await;
    // Hand back leased tokens and flush batched deposits before exiting.
    store_for_shutdown.store().shutdown().await;
    let flusher = store_for_shutdown.clone();
    let flushed =
        tokio::task::spawn_blocking(move || flusher.flush_decision_log(Duration::from_secs(5)))
            .await
            .unwrap_or(false);
    if !flushed {
        tracing::warn!("the decision log's last lines may not have been written");
    }
    if let Some(guard) = tracer_guard {
        guard.shutdown(Duration::from_secs(5)).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Reloads policies and principals, and reopens the decision log, on every
/// SIGHUP. A bad file is logged, counted and ignored (see
/// `Service::reload`).
async fn reload_on_sighup<S: BudgetStore>(service: Service<S>) {
    #[cfg(unix)]
    {
        let mut hangups = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::hangup(),
        ) {
            Ok(signal) => signal,
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch SIGHUP; reload with RetryAdmin/ReloadConfig");
                return;
            }
        };
        while hangups.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the configuration and reopening the decision log");
            // Log rotation moves the file first, then signals.
            service.reopen_decision_log();
            let _ = service.reload().await;
        }
    }
    #[cfg(not(unix))]
    let _ = service;
}

/// Every second, logs the count of refused calls the audit throttle held
/// back, so that a burst's count never waits for the next refusal.
async fn flush_refusals<S: BudgetStore>(service: Service<S>) {
    let mut every_second = tokio::time::interval(Duration::from_secs(1));
    every_second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every_second.tick().await;
        service.flush_refusals();
    }
}

/// SIGTERM (what orchestrators and background shells send) or SIGINT.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch SIGTERM; stopping on SIGINT only");
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("shutdown signal received");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_key_accepts_printable_ascii_only() {
        for key in ["checkout-key-0123456789", "!~#$%&'()*+,-./:;<=>?@[]^_`{|}"] {
            assert!(check_key(key).is_ok(), "{key:?}");
        }
        for (key, reason) in [
            ("checkout key 0123456789", "whitespace"),
            ("checkout\tkey-0123456789", "whitespace"),
            ("checkout\u{1b}key-0123456789", "control"),
            ("checkout-schl\u{fc}ssel-0123456789", "non-ASCII"),
            ("short-key", "16 characters"),
            ("", "16 characters"),
        ] {
            let message = check_key(key).expect_err("must be refused").to_string();
            assert!(message.contains(reason), "{key:?}: {message}");
        }
    }
}
