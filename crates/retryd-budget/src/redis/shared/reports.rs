//! Traffic-report ids in Redis, so that a report re-sent to any replica is
//! applied at most once: one key per id, `{prefix}:{r:<id>}:report`, which
//! expires with the id's window. The states are those of
//! [`crate::reports`]; here they live in the key's value (see
//! `claim_report.lua`).

use std::time::Duration;

use ::redis::cmd;
use tokio::time::Instant;

use super::{Core, Operations};
use crate::StoreError;
use crate::redis::error::{Failure, RedisStoreError, unavailable};
use crate::reports::{CLAIM_LEASE_NANOS, ReportClaim};

impl<M: Operations> Core<M> {
    /// Claims `id` in Redis. An unreachable Redis is an error: the report
    /// is then refused before any deposit, and its re-send applies it once
    /// Redis is back (deposits are late, never doubled).
    pub(in crate::redis) async fn claim_report(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        window: Duration,
        deadline: Instant,
    ) -> Result<ReportClaim, StoreError> {
        let key = self.keys.report(id);
        let mut invocation = self.scripts.claim_report.prepare_invoke();
        invocation
            .key(&key)
            .arg(format!("{digest:016x}"))
            .arg(entries)
            .arg(window_ms(window))
            .arg(CLAIM_LEASE_NANOS / 1_000_000);
        let reply: Vec<i64> = self
            .call(
                Some(&key),
                deadline,
                self.connection.invoke(Some(&key), &invocation),
            )
            .await
            .map_err(Failure::into_error)?;
        match reply.as_slice() {
            [0, _] => Ok(ReportClaim::Fresh),
            [1, applied] => Ok(ReportClaim::Applied(
                u32::try_from(*applied).unwrap_or(entries).min(entries),
            )),
            [2, _] => Ok(ReportClaim::InProgress),
            [3, _] => Ok(ReportClaim::Conflict),
            other => Err(unavailable(RedisStoreError::Reply(format!(
                "claim_report: {other:?}"
            )))),
        }
    }

    /// Settles a claimed id. `XX`: an id whose window ran out meanwhile is
    /// not brought back without an expiry.
    pub(in crate::redis) async fn settle_report(
        &self,
        id: &str,
        digest: u64,
        applied: u32,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let key = self.keys.report(id);
        let mut command = cmd("SET");
        command
            .arg(&key)
            .arg(format!("d:{digest:016x}:{applied}"))
            .arg("XX")
            .arg("KEEPTTL");
        let _: Option<String> = self
            .call(
                Some(&key),
                deadline,
                self.connection.query(Some(&key), &command),
            )
            .await
            .map_err(Failure::into_error)?;
        Ok(())
    }
}

fn window_ms(window: Duration) -> u64 {
    u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1)
}
