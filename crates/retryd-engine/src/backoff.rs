//! Exponential backoff with full or decorrelated jitter.

use std::time::Duration;

/// How the random part of a backoff is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in `0..min(max, base * 2^(attempt - 1))`.
    Full,
    /// Uniform in `base..3 * previous`, capped at `max`.
    Decorrelated,
}

/// The backoff part of a policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    /// The first step of the exponential.
    pub base: Duration,
    /// No backoff is longer than this (before a Retry-After floor).
    pub max: Duration,
    /// How the random part is drawn.
    pub jitter: Jitter,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_secs(5),
            jitter: Jitter::Full,
        }
    }
}

impl Backoff {
    /// The longest backoff [`Backoff::compute`] can draw after attempt
    /// `attempt` (its draw close to 1): the window a fleet pushback's
    /// spread is at least as wide as.
    pub fn ceiling(&self, attempt: u32, previous: Option<Duration>) -> Duration {
        match self.jitter {
            Jitter::Full => {
                let exponent = attempt.saturating_sub(1).min(63);
                self.base
                    .checked_mul(1u32.checked_shl(exponent).unwrap_or(u32::MAX))
                    .unwrap_or(Duration::MAX)
                    .min(self.max)
            }
            Jitter::Decorrelated => {
                let previous = previous.filter(|p| !p.is_zero()).unwrap_or(self.base);
                previous.saturating_mul(3).min(self.max)
            }
        }
    }

    /// The backoff after attempt `attempt` failed, for a uniform draw
    /// `jitter` in `[0, 1)`. Never above `max`.
    pub fn compute(&self, attempt: u32, previous: Option<Duration>, jitter: f64) -> Duration {
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        match self.jitter {
            Jitter::Full => {
                // 2^(attempt-1) saturates long before u32::MAX attempts.
                let exponent = attempt.saturating_sub(1).min(63);
                let ceiling = self
                    .base
                    .checked_mul(1u32.checked_shl(exponent).unwrap_or(u32::MAX))
                    .unwrap_or(Duration::MAX)
                    .min(self.max);
                ceiling.mul_f64(jitter)
            }
            Jitter::Decorrelated => {
                let previous = previous.filter(|p| !p.is_zero()).unwrap_or(self.base);
                let high = previous.saturating_mul(3).min(self.max);
                let low = self.base.min(high);
                (low + (high - low).mul_f64(jitter)).min(self.max)
            }
        }
    }
}
