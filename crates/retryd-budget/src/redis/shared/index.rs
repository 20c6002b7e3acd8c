//! The fleet-wide index of upstreams and admission to it: one sorted set
//! (`{prefix}:{index}:upstreams`, scores are lapse times, `+inf` while
//! retries are off) through which `max_upstreams` holds across every
//! replica, and this replica's knowledge of which entries are live, so that
//! it asks Redis about an upstream about once a minute, not per call. The
//! same for both modes; it must not touch a bucket.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::{Core, Operations, Upstream, UpstreamState, lock};
use crate::redis::error::Failure;
use crate::redis::replies::{Admission, INF_SCORE, Reply};
use crate::{BucketConfig, StoreError};

/// An index entry outlives the bucket it stands for by this much, so that
/// a replica refreshes it about once per this period, not on every write.
const INDEX_SLACK_MS: u64 = 60_000;
/// A traffic report's admission asks Redis again about an upstream whose
/// index entry this replica knows to be live for less than this, so that
/// no entry lapses while the report's deposits are made.
const ADMISSION_MARGIN_MS: u64 = 10_000;
/// Index score of a bucket that never expires (no floor, below initial):
/// far in the future, yet distinct from the `+inf` of a kill switch.
const FAR_SCORE: u64 = 1_000_000_000_000_000;

/// An admission that went nowhere: Redis gave no answer (the caller falls
/// back), or it refused the upstream.
pub(in crate::redis) type NotAdmitted = Result<Failure, StoreError>;

impl<M: Operations> Core<M> {
    /// The upstream's local state, admitting it to the fleet-wide index
    /// first if this replica does not know it to be there; with it, the
    /// deadline the store call goes on with: later than `deadline` only if
    /// the admission was answered after a wait that went on because this
    /// process was starved (see [`Core::call_continuing`]).
    pub(in crate::redis) async fn admitted(
        &self,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<(Arc<Upstream<M::Upstream>>, Instant), NotAdmitted> {
        if let Some(known) = self.upstreams.get(upstream) {
            if known.index_until.load(Ordering::Acquire) > self.now_ms() {
                *lock(&known.config) = *config;
                return Ok((Arc::clone(known.value()), deadline));
            }
        }
        let mut invocation = self.scripts.admit.prepare_invoke();
        invocation
            .key(self.keys.index())
            .arg(upstream)
            .arg(self.limit_for(config))
            .arg(INDEX_SLACK_MS);
        let (values, deadline): (Vec<i64>, _) = self
            .call_continuing(
                Some(self.keys.index()),
                deadline,
                self.connection.invoke(Some(self.keys.index()), &invocation),
            )
            .await
            .map_err(Ok)?;
        match Admission::parse_one(&values).map_err(|error| Ok(Failure::Unknown(error)))? {
            Admission::Admitted { scores, now_ms } => {
                let state = self.enter(upstream, config);
                self.set_index(&state, scores[0], now_ms);
                Ok((state, deadline))
            }
            Admission::Full => Err(Err(StoreError::TooManyUpstreams {
                limit: self.max_upstreams,
            })),
        }
    }

    /// [`crate::BudgetStore::admit`]: one script on the index admits every
    /// upstream the replica does not know to be there for a while yet, all
    /// or none; with Redis unreachable, [`Core::admit_locally`].
    pub(in crate::redis) async fn admit(
        &self,
        upstreams: &[(&str, &BucketConfig)],
    ) -> Result<(), StoreError> {
        if !self.reach.is_up_for(self.keys.index()) {
            return self.admit_locally(upstreams, Failure::NotSent).await;
        }
        let soon = self.now_ms().saturating_add(ADMISSION_MARGIN_MS);
        let mut asked: Vec<(&str, &BucketConfig)> = upstreams
            .iter()
            .filter(|(upstream, _)| {
                self.upstreams
                    .get(*upstream)
                    .is_none_or(|known| known.index_until.load(Ordering::Acquire) <= soon)
            })
            .copied()
            .collect();
        if asked.is_empty() {
            return Ok(());
        }
        asked.sort_unstable_by(|a, b| a.0.cmp(b.0));
        asked.dedup_by(|a, b| a.0 == b.0);
        // Configured upstreams first, in a call of their own without the
        // limit: they enter the index (for ListBudgets and expiry) but never
        // compete with made-up names for room.
        let (configured, counted): (Vec<_>, Vec<_>) =
            asked.into_iter().partition(|(_, config)| config.configured);
        for batch in [configured, counted] {
            if !batch.is_empty() {
                self.admit_batch(upstreams, &batch).await?;
            }
        }
        Ok(())
    }

    /// The index's limit for an admission of `config`'s upstream: the
    /// store's, or none for a configured upstream.
    fn limit_for(&self, config: &BucketConfig) -> u64 {
        if config.configured {
            // Beyond any ZCARD; exact in the script's doubles.
            1 << 52
        } else {
            self.max_upstreams as u64
        }
    }

    /// One `admit_all` for `asked` (all configured or none), all or none;
    /// with Redis unreachable, [`Core::admit_locally`] for the whole report.
    async fn admit_batch(
        &self,
        upstreams: &[(&str, &BucketConfig)],
        asked: &[(&str, &BucketConfig)],
    ) -> Result<(), StoreError> {
        let mut invocation = self.scripts.admit_all.prepare_invoke();
        invocation
            .key(self.keys.index())
            .arg(self.limit_for(asked[0].1))
            .arg(INDEX_SLACK_MS);
        for (upstream, _) in asked {
            invocation.arg(*upstream);
        }
        let values: Vec<i64> = match self
            .call(
                Some(self.keys.index()),
                self.deadline(),
                self.connection.invoke(Some(self.keys.index()), &invocation),
            )
            .await
        {
            Ok(values) => values,
            Err(failure) => return self.admit_locally(upstreams, failure).await,
        };
        let (scores, now_ms) = match Admission::parse_all(&values, asked.len()) {
            Ok(Admission::Admitted { scores, now_ms }) => (scores, now_ms),
            Ok(Admission::Full) => {
                return Err(StoreError::TooManyUpstreams {
                    limit: self.max_upstreams,
                });
            }
            Err(error) => return self.admit_locally(upstreams, Failure::Unknown(error)).await,
        };
        for ((upstream, config), score) in asked.iter().zip(scores) {
            let state = self.enter(upstream, config);
            self.set_index(&state, score, now_ms);
        }
        Ok(())
    }

    /// The upstream's entry in this replica's map, created if new, with the
    /// bucket parameters of this call.
    fn enter(&self, upstream: &str, config: &BucketConfig) -> Arc<Upstream<M::Upstream>> {
        let state = Arc::clone(
            self.upstreams
                .entry(upstream.into())
                .or_insert_with(|| Arc::new(Upstream::new(config, self.mode.upstream())))
                .value(),
        );
        *lock(&state.config) = *config;
        state
    }

    fn set_index(&self, state: &Upstream<M::Upstream>, score: u64, server_now_ms: i64) {
        state.index_score.store(score, Ordering::Release);
        let until = if score >= FAR_SCORE {
            u64::MAX
        } else {
            self.now_ms()
                .saturating_add(score.saturating_sub(server_now_ms.max(0) as u64))
        };
        state.index_until.store(until, Ordering::Release);
    }

    /// After a write: the index entry must outlive the bucket, and read
    /// `+inf` exactly while retries are off. Returns the score to write, if
    /// this caller is the one to write it.
    pub(in crate::redis) fn index_update(
        &self,
        state: &Upstream<M::Upstream>,
        reply: &Reply,
    ) -> Option<u64> {
        let desired = match reply.index {
            -1 => INF_SCORE,
            -3 => FAR_SCORE,
            expiry if expiry >= 0 => expiry as u64 + INDEX_SLACK_MS,
            _ => return None,
        };
        let known = state.index_score.load(Ordering::Acquire);
        let stale = if known == 0 || desired >= FAR_SCORE || known >= FAR_SCORE {
            desired != known
        } else {
            reply.index as u64 > known
        };
        (stale
            && state
                .index_score
                .compare_exchange(known, desired, Ordering::AcqRel, Ordering::Acquire)
                .is_ok())
        .then(|| {
            self.set_index(state, desired, reply.now_ms);
            desired
        })
    }

    pub(in crate::redis) async fn write_index(
        &self,
        upstream: &str,
        state: &Upstream<M::Upstream>,
        score: u64,
        deadline: Instant,
    ) {
        let score_text = if score == INF_SCORE {
            "+inf".to_owned()
        } else {
            score.to_string()
        };
        let mut command = ::redis::cmd("ZADD");
        command.arg(self.keys.index()).arg(score_text).arg(upstream);
        if self
            .call(
                Some(self.keys.index()),
                deadline,
                self.connection
                    .query::<i64>(Some(self.keys.index()), &command),
            )
            .await
            .is_err()
        {
            // Try again on the next write.
            state.index_score.store(0, Ordering::Release);
        }
    }

    /// Everything a bucket reply teaches this replica: the kill switch, the
    /// mode's reading, and whether the index entry needs refreshing.
    pub(in crate::redis) fn after_write(
        self: &Arc<Self>,
        upstream: &str,
        state: &Arc<Upstream<M::Upstream>>,
        reply: &Reply,
    ) {
        self.note_switch(upstream, reply.enabled);
        state.mode.remember(reply);
        if let Some(score) = self.index_update(state, reply) {
            // Off the request path: an index refresh is bookkeeping.
            let core = Arc::clone(self);
            let state = Arc::clone(state);
            let upstream = upstream.to_owned();
            tokio::spawn(async move {
                let deadline = Instant::now() + core.timeout;
                core.write_index(&upstream, &state, score, deadline).await;
            });
        }
    }
}
