//! Reloading the reloadable part of the configuration (policies and
//! principals) on SIGHUP or `ReloadConfig`: one reload at a time, off the
//! runtime's workers, never weakening authentication, and the keys that
//! need a restart named.
//!
//! Invariant: a reload swaps one whole `Live` into the pipeline or
//! changes nothing; budgets live in the store and are not touched.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::auth::Auth;
use crate::budget::BudgetStore;
use crate::config::{Config, InvalidConfig};
use crate::decide::{Decider, Live};
use crate::telemetry::Metrics;

/// How to reload: the file the server started with and what it said at
/// startup, to tell the operator which changes need a restart.
#[derive(Debug)]
pub struct Reload {
    /// The configuration file, if any.
    pub path: Option<PathBuf>,
    /// The configuration at startup.
    pub startup: Config,
}

/// Reloads, one at a time.
#[derive(Debug)]
pub struct Reloader {
    /// Where the configuration came from.
    pub reload: Reload,
    /// Held by the reload in progress: when the last one ended.
    last: tokio::sync::Mutex<Option<tokio::time::Instant>>,
    /// Reloads running or waiting for `last`.
    queued: AtomicUsize,
}

impl Reloader {
    /// Reloads from `reload`.
    pub fn new(reload: Reload) -> Reloader {
        Reloader {
            reload,
            last: tokio::sync::Mutex::new(None),
            queued: AtomicUsize::new(0),
        }
    }

    /// Re-reads the configuration file and swaps in its policies and
    /// principals, after any reload already running (what SIGHUP does). An
    /// invalid file changes nothing. Returns the number of named upstreams
    /// and the changed keys that need a restart.
    pub async fn reload<S: BudgetStore>(
        &self,
        decider: &Decider<S>,
        metrics: &Metrics,
    ) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let _slot = ReloadSlot::take(&self.queued);
        let last = self.last.lock().await;
        // Not paced: a signal comes from the host, which the pace is not
        // about, and its reload must read the file as it is now.
        self.reload_after(last, Duration::ZERO, decider, metrics)
            .await
    }

    /// [`Reloader::reload`] for `ReloadConfig`: refused with
    /// [`ReloadError::Busy`] when one reload is running and another already
    /// waits its turn, so that a flood of calls costs one reload at a time,
    /// at most one per [`RELOAD_INTERVAL`], and its refusals cost nothing.
    pub async fn try_reload<S: BudgetStore>(
        &self,
        decider: &Decider<S>,
        metrics: &Metrics,
    ) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let slot = ReloadSlot::take(&self.queued);
        if slot.ahead >= 2 {
            return Err(ReloadError::Busy);
        }
        let last = self.last.lock().await;
        self.reload_after(last, RELOAD_INTERVAL, decider, metrics)
            .await
    }

    /// Reloads, holding the reload lock, once `pace` has passed since the
    /// last reload ended.
    async fn reload_after<S: BudgetStore>(
        &self,
        mut last: tokio::sync::MutexGuard<'_, Option<tokio::time::Instant>>,
        pace: Duration,
        decider: &Decider<S>,
        metrics: &Metrics,
    ) -> Result<(usize, Vec<&'static str>), ReloadError> {
        if let Some(last) = *last {
            tokio::time::sleep_until(last + pace).await;
        }
        // Reading the file (and the TLS files it names) and validating it
        // block: on a thread of their own, never on a runtime worker that
        // decisions run on.
        let path = self.reload.path.clone();
        let loaded = tokio::task::spawn_blocking(move || Config::load_for_reload(path.as_deref()))
            .await
            .unwrap_or_else(|_| {
                Err(InvalidConfig::Load(
                    "the reload's reading thread failed".into(),
                ))
            });
        let applied = self.apply(loaded, decider, metrics);
        *last = Some(tokio::time::Instant::now());
        Ok(applied?)
    }

    /// Swaps in a loaded configuration's policies and principals, unless
    /// it failed to load or would weaken authentication.
    fn apply<S: BudgetStore>(
        &self,
        loaded: Result<Config, InvalidConfig>,
        decider: &Decider<S>,
        metrics: &Metrics,
    ) -> Result<(usize, Vec<&'static str>), InvalidConfig> {
        let live = decider.live();
        let result = loaded.and_then(|config| self.refuse_weaker_auth(&live.auth, config));
        metrics.record_reload(result.is_ok());
        let config = match result {
            Ok(config) => config,
            Err(error) => {
                tracing::error!(%error, "configuration reload refused; keeping the running configuration");
                return Err(error);
            }
        };
        let changes = live.auth.changes_to(&config.auth);
        if !changes.is_empty() {
            // Who may call is the most sensitive thing a reload changes:
            // loud, on the audit target, naming every principal concerned.
            tracing::warn!(
                target: "retryd::audit",
                added = ?changes.added,
                removed = ?changes.removed,
                changed = ?changes.changed,
                "principals changed by a configuration reload"
            );
        }
        let startup = &self.reload.startup;
        let restart_required: Vec<&'static str> = [
            ("server.listen", config.listen != startup.listen),
            (
                "server.metrics_listen",
                config.metrics_listen != startup.metrics_listen,
            ),
            ("server.tls", config.tls != startup.tls),
            (
                "server limits",
                config.server_limits != startup.server_limits,
            ),
            ("store", config.store != startup.store),
            ("telemetry", config.telemetry != startup.telemetry),
            (
                "limits.max_upstreams",
                config.max_upstreams != startup.max_upstreams,
            ),
            (
                "limits.report_id_window, limits.max_report_ids",
                config.report_ids != startup.report_ids,
            ),
            (
                "limits.max_upstreams_per_principal",
                config.max_upstreams_per_principal != startup.max_upstreams_per_principal,
            ),
            (
                "limits.evict_idle_after",
                config.evict_idle_after != startup.evict_idle_after,
            ),
        ]
        .into_iter()
        .filter_map(|(key, changed)| changed.then_some(key))
        .collect();
        if !restart_required.is_empty() {
            tracing::warn!(
                ?restart_required,
                "these settings changed but take effect only after a restart"
            );
        }
        let named = config.policies.named().count();
        decider.replace_live(Live {
            policies: config.policies,
            auth: config.auth,
        });
        tracing::info!(named_upstreams = named, "configuration reloaded");
        Ok((named, restart_required))
    }

    /// Refuses a reloaded configuration that would weaken authentication:
    /// one naming no principal while the running one authenticates (a
    /// truncated file, or one cut before its `[auth]`), since every caller
    /// of the port, still bound, would become the all-powerful anonymous
    /// principal; and one without `[auth]` whose non-loopback rule holds
    /// only for its own `server.listen`, not for the address actually bound
    /// (a reload binds nothing). Switching authentication off needs a
    /// restart, which binds and checks afresh.
    fn refuse_weaker_auth(&self, running: &Auth, config: Config) -> Result<Config, InvalidConfig> {
        if config.auth.is_enabled() {
            return Ok(config);
        }
        if running.is_enabled() {
            return Err(InvalidConfig::Value {
                key: "auth.principals".into(),
                reason: "the running configuration authenticates callers and this file names no principal; a reload never switches authentication off (restart to do so)".into(),
            });
        }
        let bound = self.reload.startup.listen;
        if !bound.ip().is_loopback() && !config.allow_unauthenticated {
            return Err(InvalidConfig::Value {
                key: "server.listen".into(),
                reason: format!(
                    "the server is bound to {bound}, which is not a loopback address, and [auth] names no principal; configure [auth] or set server.allow_unauthenticated = true"
                ),
            });
        }
        Ok(config)
    }
}

/// The least time between a reload and a `ReloadConfig` call's: a flood of
/// calls reloads ten times a second at most.
pub const RELOAD_INTERVAL: Duration = Duration::from_millis(100);

/// A place among the reloads running or waiting, given back when the
/// reload ends or its caller goes away.
struct ReloadSlot<'q> {
    queued: &'q AtomicUsize,
    /// Reloads that were running or waiting when this one came.
    ahead: usize,
}

impl<'q> ReloadSlot<'q> {
    fn take(queued: &'q AtomicUsize) -> ReloadSlot<'q> {
        let ahead = queued.fetch_add(1, Ordering::AcqRel);
        ReloadSlot { queued, ahead }
    }
}

impl Drop for ReloadSlot<'_> {
    fn drop(&mut self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is invalid, or would weaken authentication.
    #[error(transparent)]
    Invalid(#[from] InvalidConfig),
    /// Another reload is running or waiting: `ReloadConfig` does not queue.
    #[error("a configuration reload is already running; try again once it is done")]
    Busy,
}
