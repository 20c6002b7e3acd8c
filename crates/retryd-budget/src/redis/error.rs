//! The module's one error type, `RedisStoreError` (boxed into
//! [`StoreError::Unavailable`]), and `Failure`, why one request to Redis
//! gave no answer. A leaf: it knows no connection, no core and no mode.

use ::redis::RedisError;

use super::circuit::PROBE_INTERVAL;
use crate::StoreError;

/// Redis-specific failures, boxed into [`StoreError::Unavailable`].
#[derive(Debug, thiserror::Error)]
pub(super) enum RedisStoreError {
    #[error("Redis did not answer in time")]
    Timeout,
    #[error("Redis is believed down (re-probed every {PROBE_INTERVAL:?})")]
    CircuitOpen,
    #[error("Redis: {0}")]
    Redis(#[source] RedisError),
    #[error(
        "Redis {found} is too old: retryd needs {}.{} or later",
        needed.0,
        needed.1
    )]
    Version { found: String, needed: (u32, u32) },
    #[error("unexpected reply from Redis: {0}")]
    Reply(String),
}

impl From<RedisError> for RedisStoreError {
    fn from(error: RedisError) -> Self {
        RedisStoreError::Redis(error)
    }
}

pub(super) fn unavailable(error: RedisStoreError) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// Why a call to Redis gave no answer.
#[derive(Debug)]
pub(super) enum Failure {
    /// Not sent (the circuit is open or no time was left): nothing happened
    /// in Redis.
    NotSent,
    /// Sent without an answer: it may or may not have happened.
    Unknown(RedisStoreError),
}

impl Failure {
    pub(super) fn into_error(self) -> StoreError {
        match self {
            Failure::NotSent => unavailable(RedisStoreError::CircuitOpen),
            Failure::Unknown(error) => unavailable(error),
        }
    }
}
