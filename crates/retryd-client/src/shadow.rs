//! Shadow answers (an upstream with `enforce = false`): retryd decided as it
//! would, but asks not to be obeyed, so the client acts on its local rule,
//! as every other client does. Differences are counted per upstream and
//! logged at most once per upstream per interval.
//!
//! It compares decisions; it decides nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::Decision;

/// The least time between two warnings about one upstream's differences.
pub const DEFAULT_SHADOW_LOG_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub(crate) struct ShadowLog {
    interval: Duration,
    upstreams: Mutex<HashMap<String, Upstream>>,
}

#[derive(Debug, Default)]
struct Upstream {
    count: u64,
    unlogged: u64,
    logged_at: Option<Instant>,
}

/// Whether two decisions disagree on what to do (the jittered backoff aside).
pub(crate) fn differ(retryd: &Decision, local: &Decision) -> bool {
    std::mem::discriminant(&retryd.verdict) != std::mem::discriminant(&local.verdict)
        || retryd.deny_reason() != local.deny_reason()
}

impl ShadowLog {
    pub(crate) fn new(interval: Duration) -> ShadowLog {
        ShadowLog {
            interval,
            upstreams: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn record(&self, upstream: &str, retryd: &Decision, local: &Decision) {
        let mut upstreams = self.upstreams.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded as the local buckets are: past the bound, differences of
        // new upstreams are not counted (the warning still names the first).
        if !upstreams.contains_key(upstream)
            && upstreams.len() >= crate::fallback::MAX_LOCAL_UPSTREAMS
        {
            return;
        }
        let state = upstreams.entry(upstream.to_owned()).or_default();
        state.count += 1;
        let now = Instant::now();
        if state
            .logged_at
            .is_some_and(|at| now.saturating_duration_since(at) < self.interval)
        {
            state.unlogged += 1;
            return;
        }
        let unlogged = std::mem::take(&mut state.unlogged);
        state.logged_at = Some(now);
        drop(upstreams);
        tracing::warn!(
            target: "retryd_client",
            "retryd: shadow decision for upstream {upstream:?} differs from the local rule: retryd {}, local rule {} (acted on); {unlogged} more difference(s) for this upstream not logged since the last line",
            retryd.describe(),
            local.describe()
        );
    }

    pub(crate) fn counts(&self) -> HashMap<String, u64> {
        let upstreams = self.upstreams.lock().unwrap_or_else(|e| e.into_inner());
        upstreams
            .iter()
            .map(|(upstream, state)| (upstream.clone(), state.count))
            .collect()
    }
}
