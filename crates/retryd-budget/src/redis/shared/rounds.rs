//! The background task, supervised: it must never die silently (a panic is
//! counted, logged and the task restarted) and holds the store only weakly,
//! so dropping the store ends it. Each round (every `M::TICK`) probes a
//! Redis believed down, runs the mode's part (leased: flush batched
//! deposits, retire expired leases, hand them back), and once a second
//! refreshes the kill-switch cache and forgets upstreams that lapsed and
//! hold nothing. Nothing here answers a caller.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use super::{Core, Operations, UpstreamState, bump};

/// The kill-switch cache and the local map are tidied this often.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(1);
/// A Cluster's slot map is re-read this often while a master is down.
const DEGRADED_SLOTS_INTERVAL: Duration = Duration::from_millis(50);

pub(in crate::redis) fn spawn_supervised<M: Operations>(store: Weak<Core<M>>) {
    // The background task must not die silently: if it ever panics, it is
    // counted, logged and restarted. It holds only a weak reference, so
    // dropping the store ends it.
    tokio::spawn(async move {
        loop {
            let worker = tokio::spawn(run_background(store.clone()));
            match worker.await {
                Err(error) if error.is_panic() => {
                    let Some(core) = store.upgrade() else { return };
                    bump(&core.counters.task_restarts, 1);
                    drop(core);
                    tracing::error!(
                        "the Redis budget store's background task panicked; restarting it"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => return,
            }
        }
    });
}

async fn run_background<M: Operations>(store: Weak<Core<M>>) {
    let mut interval = tokio::time::interval(M::TICK);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_housekeeping = Instant::now();
    loop {
        interval.tick().await;
        let Some(core) = store.upgrade() else { return };
        if core.closed.load(Ordering::Acquire) {
            return;
        }
        core.background_round(&mut last_housekeeping).await;
    }
}

impl<M: Operations> Core<M> {
    async fn background_round(self: &Arc<Self>, last_housekeeping: &mut Instant) {
        // Each circuit believed down is re-probed on its own: a Cluster
        // master's probe carries a key of its slots, so it goes there.
        for (_, probe_key) in self.reach.claim_probes() {
            let mut invocation = self.scripts.probe.prepare_invoke();
            if let Some(key) = &probe_key {
                invocation.key(key);
            }
            let _ = self
                .send(
                    probe_key.as_deref(),
                    Instant::now() + self.timeout,
                    self.connection
                        .invoke::<i64>(probe_key.as_deref(), &invocation),
                )
                .await;
        }
        M::round(self).await;
        // A Cluster's slot map: once a second, and every 50 ms while a
        // master is down, to see its replica promoted soon (its slots are
        // then shared again at once, through the new master's circuit).
        if self.reach.is_cluster() {
            let every = if self.reach.is_cluster_degraded() {
                DEGRADED_SLOTS_INTERVAL
            } else {
                HOUSEKEEPING_INTERVAL
            };
            if self.reach.claim_refresh(every) {
                self.refresh_slots().await;
            }
        }
        if last_housekeeping.elapsed() >= HOUSEKEEPING_INTERVAL {
            *last_housekeeping = Instant::now();
            self.housekeeping().await;
        }
    }

    /// Reads `CLUSTER SLOTS` from some node (any answers for the whole
    /// Cluster), outside every node's circuit: it is bookkeeping, and a
    /// dead node's failure must not count against a live one.
    pub(in crate::redis) async fn refresh_slots(&self) {
        let mut command = ::redis::cmd("CLUSTER");
        command.arg("SLOTS");
        let answer = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(100)),
            self.connection.query::<::redis::Value>(None, &command),
        )
        .await;
        match answer {
            Ok(Ok(reply)) => {
                self.connection.learn_slots(&reply);
                if let Err(error) = self.reach.update(&reply, self.keys.prefix()) {
                    tracing::warn!(%error, "cannot read the Redis Cluster's slot map");
                }
            }
            Ok(Err(error)) => tracing::debug!(%error, "CLUSTER SLOTS failed"),
            Err(_) => tracing::debug!("CLUSTER SLOTS timed out"),
        }
    }

    async fn housekeeping(self: &Arc<Self>) {
        if self.reach.is_up_for(self.keys.index()) {
            let mut command = ::redis::cmd("ZRANGEBYSCORE");
            command.arg(self.keys.index()).arg("+inf").arg("+inf");
            if let Ok(names) = self
                .call(
                    Some(self.keys.index()),
                    Instant::now() + self.timeout,
                    self.connection
                        .query::<Vec<String>>(Some(self.keys.index()), &command),
                )
                .await
            {
                let fresh: HashSet<Box<str>> = names
                    .into_iter()
                    .take(self.max_upstreams)
                    .map(String::into_boxed_str)
                    .collect();
                *self
                    .disabled
                    .write()
                    .unwrap_or_else(PoisonError::into_inner) = fresh;
            }
        }
        // Forget upstreams whose index entry lapsed and that hold nothing.
        let now_ms = self.now_ms();
        self.upstreams.retain(|_, state| {
            state.index_until.load(Ordering::Acquire) > now_ms
                || Arc::strong_count(state) > 1
                || state.mode.holds_anything()
        });
    }
}
