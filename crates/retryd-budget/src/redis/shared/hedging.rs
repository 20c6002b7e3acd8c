//! Hedging's window in Redis, merged across replicas: one hash per slot of
//! an upstream's window, `{prefix}:{u:<name>}:hedge:<slot>`, in the
//! upstream's hash slot, with the first attempts (`n`), the hedges granted
//! (`h`) and the latencies per bucket; it expires after two windows. A
//! report adds its counts (`hedge_add.lua`); the background refresh and a
//! report read the window's slots summed, and its most recent ones apart
//! (`hedge_read.lua`). Never on the
//! decision path: a hedge Decide answers from the replica's copy.

use ::redis::Value;
use tokio::time::Instant;

use super::{Core, Operations};
use crate::StoreError;
use crate::hedging::{FleetWindow, HedgeAdd, RECENT_SLOTS, SLOTS};
use crate::redis::error::{Failure, RedisStoreError, unavailable};
use retryd_engine::latency::{Histogram, MAX_BUCKET};

impl<M: Operations> Core<M> {
    /// Adds `add` to its slot.
    pub(in crate::redis) async fn add_hedging(
        &self,
        upstream: &str,
        add: &HedgeAdd<'_>,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let key = self.keys.hedge(upstream, add.slot);
        let mut invocation = self.scripts.hedge_add.prepare_invoke();
        invocation
            .key(&key)
            .arg(add.ttl.as_millis().max(1) as u64)
            .arg(add.first_attempts)
            .arg(add.hedges);
        if let Some(latencies) = add.latencies {
            for (bucket, count) in latencies.buckets() {
                invocation.arg(bucket).arg(count);
            }
        }
        let _: i64 = self
            .call(
                Some(&key),
                deadline,
                self.connection.invoke(Some(&key), &invocation),
            )
            .await
            .map_err(Failure::into_error)?;
        Ok(())
    }

    /// The window ending at slot `last`, summed.
    pub(in crate::redis) async fn read_hedging(
        &self,
        upstream: &str,
        last: u64,
        deadline: Instant,
    ) -> Result<FleetWindow, StoreError> {
        let keys: Vec<String> = (0..SLOTS as u64)
            .filter_map(|back| last.checked_sub(back))
            .map(|slot| self.keys.hedge(upstream, slot))
            .collect();
        let mut invocation = self.scripts.hedge_read.prepare_invoke();
        for key in &keys {
            invocation.key(key);
        }
        invocation.arg(RECENT_SLOTS);
        let first = keys.first().map(String::as_str);
        let reply: Vec<Value> = self
            .call_outside_circuit(first, deadline, self.connection.invoke(first, &invocation))
            .await
            .map_err(Failure::into_error)?;
        let mut window = FleetWindow {
            latencies: Histogram::new(),
            recent: Histogram::new(),
            first_attempts: 0,
            hedges: 0,
        };
        let bad = |what: String| unavailable(RedisStoreError::Reply(format!("hedge_read: {what}")));
        for pair in reply.chunks(2) {
            let [field, total] = pair else {
                return Err(bad("an odd reply".into()));
            };
            let field = match field {
                Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                Value::SimpleString(text) => text.clone(),
                other => return Err(bad(format!("field {other:?}"))),
            };
            let Value::Int(total) = total else {
                return Err(bad(format!("total {total:?}")));
            };
            let total = u64::try_from(*total).unwrap_or(0);
            match field.as_str() {
                "n" => window.first_attempts = total,
                "h" => window.hedges = total,
                field => {
                    let (histogram, bucket) = match field.strip_prefix('r') {
                        Some(bucket) => (&mut window.recent, bucket),
                        None => (&mut window.latencies, field),
                    };
                    match bucket.parse::<u32>() {
                        Ok(bucket) if bucket <= MAX_BUCKET => histogram.add(bucket, total),
                        _ => return Err(bad(format!("field {field:?}"))),
                    }
                }
            }
        }
        Ok(window)
    }
}
