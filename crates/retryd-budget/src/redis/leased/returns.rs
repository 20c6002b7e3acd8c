//! Leased mode's part of each background round, and of `shutdown`: flush
//! the batched deposits, retire leases (expired ones, or all of them),
//! queue and send their returns. A return is credited once per lease id
//! and capped at capacity; one that fails, or that finds the lease expired,
//! is forfeited: budgets err towards fewer retries. Nothing here answers a
//! caller.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use tokio::time::Instant;

use super::{LeaseState, Leased};
use crate::redis::leases::{Lease, LeaseEnd, Return};
use crate::redis::shared::{Core, FAN_OUT, Upstream, UpstreamState, bump, lock};

/// Flushes batched deposits, retires leases (expired ones, or `all` of
/// them at shutdown) and hands their unspent tokens back to Redis.
pub(super) async fn settle_leases(core: &Arc<Core<Leased>>, all: bool) {
    flush_deposits(core).await;
    let now = Instant::now();
    let holding: Vec<(Box<str>, Arc<Upstream<LeaseState>>)> = core
        .upstreams
        .iter()
        .map(|entry| (entry.key().clone(), Arc::clone(entry.value())))
        .collect();
    for (upstream, state) in holding {
        retire_lease(core, &upstream, &state, now, all);
    }
    return_leases(core).await;
}

async fn flush_deposits(core: &Arc<Core<Leased>>) {
    let due: Vec<(Box<str>, Arc<Upstream<LeaseState>>)> = core
        .upstreams
        .iter()
        .filter(|entry| entry.mode.pending_requests.load(Ordering::Acquire) > 0)
        .map(|entry| (entry.key().clone(), Arc::clone(entry.value())))
        .collect();
    futures::stream::iter(due)
        .for_each_concurrent(FAN_OUT, |(upstream, state)| async move {
            flush_one(core, &upstream, &state).await;
        })
        .await;
}

async fn flush_one(core: &Arc<Core<Leased>>, upstream: &str, state: &Arc<Upstream<LeaseState>>) {
    let held = &state.mode;
    let requests = held.pending_requests.swap(0, Ordering::AcqRel);
    if requests == 0 {
        return;
    }
    let config = state.config();
    let units = config.deposit_units(requests);
    held.in_flight_units.fetch_add(units, Ordering::AcqRel);
    let text = units.to_string();
    let result = core
        .run_bucket(
            &core.scripts.deposit,
            upstream,
            &config,
            &[&text],
            Instant::now() + core.timeout,
        )
        .await;
    match result {
        Ok(reply) => core.after_write(upstream, state, &reply),
        Err(failure) => {
            // Counted inside; nobody waits for this answer.
            let _ = core
                .fallback_deposit(upstream, &config, requests, failure)
                .await;
        }
    }
    held.in_flight_units.fetch_sub(units, Ordering::AcqRel);
}

async fn return_leases(core: &Arc<Core<Leased>>) {
    let due = std::mem::take(&mut *lock(&core.mode.returns));
    if due.is_empty() {
        return;
    }
    futures::stream::iter(due)
        .for_each_concurrent(FAN_OUT, |lease| async move {
            let unused = lease.units.to_string();
            let result = core
                .run_bucket(
                    &core.scripts.release,
                    &lease.upstream,
                    &lease.config,
                    &[&lease.member, &unused],
                    Instant::now() + core.timeout,
                )
                .await;
            let credited = match result {
                Ok(reply) => {
                    if let Some(state) = core.upstreams.get(&*lease.upstream) {
                        state.mode.remember(&reply);
                    }
                    (reply.result.max(0) as u64).min(lease.units)
                }
                Err(_) => 0,
            };
            // Whatever was not credited back (the lease had expired in
            // Redis, the return failed, or capacity capped it) is lost
            // to the budget: fewer retries, never more.
            bump(&core.counters.forfeited_units, lease.units - credited);
        })
        .await;
}

/// Takes the upstream's lease out of use if it has expired (or always,
/// with `all`), queueing what it has left for return.
fn retire_lease(
    core: &Core<Leased>,
    upstream: &str,
    state: &Upstream<LeaseState>,
    now: Instant,
    all: bool,
) {
    let lease = {
        let mut slot = lock(&state.mode.lease);
        match slot.as_ref() {
            Some(lease) if all || now >= lease.spend_until => slot.take(),
            _ => None,
        }
    };
    let Some(lease) = lease else { return };
    // A spender racing with this swap either took its token first or
    // finds nothing: the same unit is never both spent and returned.
    let units = lease.remaining.swap(0, Ordering::AcqRel);
    if units > 0 {
        state.mode.lease_size.resize(
            LeaseEnd::LeftOver,
            core.mode.lease_units,
            core.mode.lease_cap(&state.config()),
        );
    }
    // Returned even when dry: a live lease occupies room in the bucket.
    queue_return(core, upstream, state, &lease, units);
}

pub(super) fn queue_return(
    core: &Core<Leased>,
    upstream: &str,
    state: &Upstream<LeaseState>,
    lease: &Lease,
    units: u64,
) {
    let mut returns = lock(&core.mode.returns);
    if returns.len() >= core.max_upstreams.max(64) {
        bump(&core.counters.forfeited_units, units);
        return;
    }
    returns.push(Return {
        upstream: upstream.into(),
        member: lease.member.clone(),
        units,
        config: state.config(),
    });
}
