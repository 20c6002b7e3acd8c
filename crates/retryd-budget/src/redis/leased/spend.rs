//! Leased mode's four operations: a view from the lease plus a reading of
//! the shared bucket; a withdrawal spent from the lease (a compare-and-swap)
//! or, when it is dry, from a new one (one task takes it while the others
//! wait for its answer); a deposit batched for the next round. An
//! acquisition whose answer never came counts as consumed. After
//! `shutdown` each is the core's direct operation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

use super::returns::queue_return;
use super::{LeaseState, Leased, Reading};
use crate::redis::error::{Failure, RedisStoreError};
use crate::redis::leases::{Acquisition, Lease, LeaseEnd};
use crate::redis::shared::{Core, Source, Upstream, UpstreamState, bump, lock};
use crate::{
    Announce, BucketConfig, BudgetCheck, FleetCall, FleetPushback, OnUnavailable, StoreError,
    UNITS_PER_TOKEN, units_to_tokens,
};

fn is_closed(core: &Core<Leased>) -> bool {
    core.closed.load(Ordering::Acquire)
}

/// A view: this replica's lease and deposits on top of a reading of the
/// shared bucket (cached for up to 100 ms); an upstream this replica
/// holds nothing of is read as an exact store reads it.
pub(super) async fn view_with_lease(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    deadline: Instant,
) -> Result<(BudgetCheck, Source), StoreError> {
    let known = (!is_closed(core))
        .then(|| {
            core.upstreams
                .get(upstream)
                .map(|entry| Arc::clone(entry.value()))
        })
        .flatten();
    let Some(state) = known else {
        return core.direct_view(upstream, config, deadline).await;
    };
    let now = Instant::now();
    let local = state.mode.local_units(now, config);
    // While Redis is believed down a cached reading is not trusted: the
    // upstream's on_unavailable policy answers.
    let cached = state
        .mode
        .cached(now, core.mode.view_cache)
        .filter(|_| core.is_up_for(upstream));
    let reading = match cached {
        Some(reading) => reading,
        None => {
            let reply = match core
                .run_bucket(&core.scripts.view, upstream, config, &[], deadline)
                .await
            {
                Ok(reply) => reply,
                Err(_) => {
                    let leased = state.mode.lease_units(now);
                    return core.fallback_view(upstream, config, leased).await;
                }
            };
            core.note_switch(upstream, reply.enabled);
            state.mode.remember(&reply);
            Reading::of(&reply, now)
        }
    };
    let (pushback, pushback_remaining) = reading.pushback(now);
    let (ramp_elapsed, adaptive_level) = reading.ramp(now);
    Ok((
        BudgetCheck {
            tokens: units_to_tokens(
                reading
                    .units
                    .saturating_add(local)
                    .min(config.capacity_units()),
            ),
            retries_enabled: reading.enabled,
            withdrew: false,
            pushback,
            pushback_remaining,
            adaptive_level,
            ramp_elapsed,
        },
        Source::Shared { tracked: true },
    ))
}

/// A decision's business with the budget: the view (usually no round
/// trip), then, if it promises a token, the lease; both within the
/// call's one deadline.
pub(super) async fn check_with_lease(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    withdraw: bool,
    fleet: FleetCall,
    deadline: Instant,
) -> Result<BudgetCheck, StoreError> {
    if !withdraw && !fleet.announce.is_set() {
        let mut view = view_with_lease(core, upstream, config, deadline).await?.0;
        view.pushback = fleet.fleet(view.pushback, view.ramp_elapsed);
        return Ok(view);
    }
    if is_closed(core) {
        return core
            .direct_check(upstream, config, withdraw, fleet, deadline)
            .await;
    }
    // A reported pushback is written to Redis at once, by the check script
    // without a withdrawal (a round trip only for the rare decision that
    // reports one); its reply also renews this replica's reading.
    let announced = if fleet.announce.is_set() {
        Some(announce_now(core, upstream, config, fleet.announce, deadline).await)
    } else {
        None
    };
    let (mut view, _) = view_with_lease(core, upstream, config, deadline).await?;
    if let Some(Some((pushback, remaining))) = announced {
        view.pushback = pushback;
        view.pushback_remaining = remaining;
    }
    // The ramp from the cached reading, as the kill switch is.
    view.pushback = fleet.fleet(view.pushback, view.ramp_elapsed);
    if !withdraw
        || !view.retries_enabled
        || view.tokens < 1.0
        || !fleet.lets_through(&view.pushback)
    {
        return Ok(view);
    }
    Ok(
        match withdraw_from_lease(core, upstream, config, deadline).await? {
            Some(left) => BudgetCheck {
                tokens: left,
                withdrew: true,
                ..view
            },
            // Less than a whole token, however much the view promised.
            None => BudgetCheck {
                tokens: 0.0,
                withdrew: false,
                ..view
            },
        },
    )
}

/// Writes `announce` to the upstream's pushback in Redis: the pushback as
/// it was before, or `None` if Redis did not answer (the announcement is
/// then lost; the caller's own Retry-After still paces its own retry).
async fn announce_now(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    announce: Announce,
    deadline: Instant,
) -> Option<(FleetPushback, Option<std::time::Duration>)> {
    let (wait_ms, stop_ms) = announce.millis();
    let reply = core
        .run_bucket(
            &core.scripts.check,
            upstream,
            config,
            &[
                "0",
                &wait_ms.to_string(),
                &stop_ms.to_string(),
                "-1",
                "0",
                "0",
            ],
            deadline,
        )
        .await
        .ok()?;
    core.note_switch(upstream, reply.enabled);
    if let Some(state) = core.upstreams.get(upstream) {
        state.mode.remember(&reply);
        state.mode.announced(announce, Instant::now());
    }
    Some((reply.pushback(), reply.pushback_remaining()))
}

pub(super) async fn withdraw_from_lease(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    deadline: Instant,
) -> Result<Option<f64>, StoreError> {
    if is_closed(core) {
        return core.direct_withdraw(upstream, config, deadline).await;
    }
    let (state, deadline) = match core.admitted(upstream, config, deadline).await {
        Ok(admitted) => admitted,
        Err(Ok(failure)) => return core.fallback_withdraw(upstream, config, failure).await,
        Err(Err(refused)) => return Err(refused),
    };
    spend_or_lease(core, upstream, config, &state, deadline).await
}

async fn spend_or_lease(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    state: &Arc<Upstream<LeaseState>>,
    deadline: Instant,
) -> Result<Option<f64>, StoreError> {
    let held = &state.mode;
    // `deny` means no retry while Redis is down, lease or not; `local`
    // spends what its lease already reserved before its local bucket.
    if !core.is_up_for(upstream) && config.on_unavailable == OnUnavailable::Deny {
        return core
            .fallback_withdraw(upstream, config, Failure::NotSent)
            .await;
    }
    if let Some(left) = held.spend(Instant::now()) {
        return Ok(Some(held.left(left, config)));
    }
    // The lease is dry or expired: one task asks Redis for another while
    // the others wait for its answer rather than each asking in turn.
    let generation = held.acquisitions.load(Ordering::Acquire);
    // The wait is for the holder's Redis call, which may wait once more
    // when this process was starved (`within`): as long as that, since the
    // holder tells its answer, a failure included, when it has one.
    let Ok(_guard) = tokio::time::timeout_at(deadline + core.timeout, held.acquiring.lock()).await
    else {
        return core
            .fallback_withdraw(upstream, config, Failure::Unknown(RedisStoreError::Timeout))
            .await;
    };
    if held.acquisitions.load(Ordering::Acquire) != generation {
        if let Some(left) = held.spend(Instant::now()) {
            return Ok(Some(held.left(left, config)));
        }
        match held.last_acquisition.load() {
            Acquisition::Empty => return Ok(None),
            Acquisition::Failed => {
                return core
                    .fallback_withdraw(upstream, config, Failure::NotSent)
                    .await;
            }
            // Others spent that lease already: take a new one.
            Acquisition::Acquired => {}
        }
    }
    // Out of time after waiting: answer from the fallback and leave the
    // lease, untouched, to the next task, which has time of its own.
    if Instant::now() >= deadline {
        return core
            .fallback_withdraw(upstream, config, Failure::Unknown(RedisStoreError::Timeout))
            .await;
    }
    let outcome = acquire(core, upstream, config, state, deadline).await;
    let (code, answer) = match outcome {
        Ok(Some(left)) => (Acquisition::Acquired, Ok(Some(held.left(left, config)))),
        Ok(None) => (Acquisition::Empty, Ok(None)),
        // Redis is believed down: the tasks that waited for this answer
        // take it too rather than each trying in turn.
        Err(failure) if !core.is_up_for(upstream) => (
            Acquisition::Failed,
            core.fallback_withdraw(upstream, config, failure).await,
        ),
        // Redis is up and only this task ran short of its deadline (it
        // waited long for the lock): the next one tries for itself.
        Err(failure) => return core.fallback_withdraw(upstream, config, failure).await,
    };
    held.last_acquisition.store(code);
    held.acquisitions.fetch_add(1, Ordering::AcqRel);
    answer
}

/// A deposit, counted here and flushed to Redis by the next round
/// (`returns.rs`); while Redis is down, the upstream's policy answers.
pub(super) async fn deposit_batched(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    requests: u64,
    deadline: Instant,
) -> Result<(), StoreError> {
    if is_closed(core) {
        return core
            .direct_deposit(upstream, config, requests, deadline)
            .await;
    }
    // Batched, so no second request of this call waits on the deadline.
    let (state, _) = match core.admitted(upstream, config, deadline).await {
        Ok(admitted) => admitted,
        Err(Ok(failure)) => {
            return core
                .fallback_deposit(upstream, config, requests, failure)
                .await;
        }
        Err(Err(refused)) => return Err(refused),
    };
    if !core.is_up_for(upstream) {
        // Not batched for a Redis that is down: the policy answers.
        return core
            .fallback_deposit(upstream, config, requests, Failure::NotSent)
            .await;
    }
    // Counted under the map's lock, so housekeeping cannot drop the
    // entry between the lookup and the count.
    let entry = core
        .upstreams
        .entry(upstream.into())
        .or_insert_with(|| Arc::clone(&state));
    entry
        .mode
        .pending_requests
        .fetch_add(requests, Ordering::AcqRel);
    Ok(())
}

/// Takes a new lease and spends one token of it. `Ok(Some(left))`: a
/// token was granted; `Ok(None)`: the bucket had no whole token.
async fn acquire(
    core: &Arc<Core<Leased>>,
    upstream: &str,
    config: &BucketConfig,
    state: &Arc<Upstream<LeaseState>>,
    deadline: Instant,
) -> Result<Option<u64>, Failure> {
    let (mode, held) = (&core.mode, &state.mode);
    // The previous lease (dry, or expired with tokens left) goes back in
    // the same script: until then it occupies room in the bucket.
    let previous = lock(&held.lease).take();
    let (previous_member, previous_unused) = match &previous {
        Some(lease) => (
            lease.member.as_str(),
            lease.remaining.swap(0, Ordering::AcqRel),
        ),
        None => ("", 0),
    };
    let taken_at = Instant::now();
    let end = match &previous {
        Some(_) if previous_unused > 0 => LeaseEnd::LeftOver,
        Some(lease) if taken_at.duration_since(lease.taken_at) <= mode.lease_ttl / 4 => {
            LeaseEnd::DrainedQuickly
        }
        _ => LeaseEnd::Drained,
    };
    // Resized even without a previous lease: the capacity may have
    // been lowered since.
    let requested = held
        .lease_size
        .resize(end, mode.lease_units, mode.lease_cap(config));
    let sequence = mode.lease_sequence.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{sequence}", mode.replica);
    let spend_until = taken_at + mode.lease_ttl / 2;
    let lease_units = requested.to_string();
    let ttl_ms = (mode.lease_ttl.as_millis() as u64).max(1).to_string();
    let unused = previous_unused.to_string();
    let result = core
        .run_bucket(
            &core.scripts.acquire,
            upstream,
            config,
            &[&id, &lease_units, &ttl_ms, previous_member, &unused],
            deadline,
        )
        .await;
    let reply = match result {
        Ok(reply) => reply,
        Err(failure) => {
            if let Some(lease) = previous {
                match failure {
                    // Redis saw nothing: return the old lease later.
                    Failure::NotSent => {
                        queue_return(core, upstream, state, &lease, previous_unused)
                    }
                    // It may have been credited back, or not: forfeit.
                    Failure::Unknown(_) => {
                        bump(&core.counters.forfeited_units, previous_unused);
                    }
                }
            }
            return Err(failure);
        }
    };
    bump(&mode.lease_acquisitions, 1);
    core.after_write(upstream, state, &reply);
    let taken = reply.result.max(0) as u64;
    if taken < UNITS_PER_TOKEN {
        return Ok(None);
    }
    let left = taken - UNITS_PER_TOKEN;
    *lock(&held.lease) = Some(Arc::new(Lease {
        member: format!("{id}:{taken}"),
        remaining: AtomicU64::new(left),
        taken_at,
        spend_until,
    }));
    Ok(Some(left))
}
