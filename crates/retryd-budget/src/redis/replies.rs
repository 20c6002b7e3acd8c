//! What the scripts answer, parsed strictly: a bucket script's ten
//! integers, and the index's admission answers. Anything else is an
//! unexpected reply (`RedisStoreError::Reply`), never a guess. Nothing here
//! talks to Redis or acts on a reply.

use super::error::RedisStoreError;

/// Local marker for the `+inf` score of an upstream whose retries are off
/// (a reply carries it as a negative number).
pub(super) const INF_SCORE: u64 = u64::MAX;

/// What every bucket script answers. Public only in name, as
/// [`super::shared::UpstreamState`] names it.
#[derive(Clone, Copy, Debug)]
pub struct Reply {
    /// Granted (1/0), units leased or returned, or the previous switch.
    pub(super) result: i64,
    /// Units in the shared bucket afterwards.
    pub(super) tokens: u64,
    pub(super) enabled: bool,
    pub(super) tracked: bool,
    /// -1 retries off, -2 nothing saved, -3 saved without expiry, else the
    /// bucket's expiry in server milliseconds.
    pub(super) index: i64,
    pub(super) now_ms: i64,
    /// The upstream's fleet-wide pushback as the script read it, before
    /// its own announcement: the earliest-retry time and a stop window's
    /// end, in server milliseconds (0 or past: none).
    pub(super) pushback_ms: i64,
    pub(super) stop_ms: i64,
    /// When the last recovery ramp began (server ms, 0: never), and the
    /// adaptive level last noted, in millionths.
    pub(super) ramp_ms: i64,
    pub(super) level: i64,
}

impl Reply {
    /// The pushback in force when the script ran.
    pub(super) fn pushback(&self) -> crate::FleetPushback {
        let (after, stop, now) = self.pushback_clock();
        crate::pushback::in_force(after, stop, now, 1_000_000)
    }

    /// How long from when the script ran no retry may land.
    pub(super) fn pushback_remaining(&self) -> Option<std::time::Duration> {
        let (after, stop, now) = self.pushback_clock();
        crate::pushback::remaining(after, stop, now, 1_000_000)
    }

    /// How long before the script ran the last recovery ramp began.
    pub(super) fn ramp_elapsed(&self) -> Option<std::time::Duration> {
        (self.ramp_ms > 0).then(|| {
            std::time::Duration::from_millis(self.now_ms.saturating_sub(self.ramp_ms).max(0) as u64)
        })
    }

    /// The adaptive level last noted, 0 to 1.
    pub(super) fn adaptive_level(&self) -> f64 {
        (self.level as f64 / 1e6).clamp(0.0, 1.0)
    }

    fn pushback_clock(&self) -> (u64, u64, u64) {
        let ms = |value: i64| value.max(0) as u64;
        (ms(self.pushback_ms), ms(self.stop_ms), ms(self.now_ms))
    }
}

impl Reply {
    pub(super) fn parse(values: &[i64]) -> Result<Reply, RedisStoreError> {
        match *values {
            [
                result,
                tokens,
                enabled,
                tracked,
                index,
                now_ms,
                pushback_ms,
                stop_ms,
                ramp_ms,
                level,
            ] => Ok(Reply {
                result,
                tokens: tokens.max(0) as u64,
                enabled: enabled == 1,
                tracked: tracked == 1,
                index,
                now_ms,
                pushback_ms,
                stop_ms,
                ramp_ms,
                level,
            }),
            _ => Err(RedisStoreError::Reply(format!(
                "a bucket script answered {values:?}"
            ))),
        }
    }
}

/// An index score as the scripts answer it (-1 for `+inf`), as this
/// replica keeps it.
fn index_score(score: i64) -> u64 {
    if score < 0 { INF_SCORE } else { score as u64 }
}

/// What `admit.lua` (one upstream) and `admit_all.lua` (a report's) answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Admission {
    /// Admitted: each asked upstream's index score, and the server's clock.
    Admitted { scores: Vec<u64>, now_ms: i64 },
    /// Refused: the index holds `max_upstreams` already.
    Full,
}

impl Admission {
    /// `admit.lua`: `{admitted, score, now_ms}`.
    pub(super) fn parse_one(values: &[i64]) -> Result<Admission, RedisStoreError> {
        match *values {
            [1, score, now_ms] => Ok(Admission::Admitted {
                scores: vec![index_score(score)],
                now_ms,
            }),
            [_, _, _] => Ok(Admission::Full),
            _ => Err(RedisStoreError::Reply(format!(
                "admission answered {values:?}"
            ))),
        }
    }

    /// `admit_all.lua` for `asked` upstreams: `{1, now_ms, score…}` with a
    /// score for each, or `{0, now_ms}`.
    pub(super) fn parse_all(values: &[i64], asked: usize) -> Result<Admission, RedisStoreError> {
        match *values {
            [0, _] => Ok(Admission::Full),
            [1, now_ms, ref scores @ ..] if scores.len() == asked => Ok(Admission::Admitted {
                scores: scores.iter().copied().map(index_score).collect(),
                now_ms,
            }),
            _ => Err(RedisStoreError::Reply(format!(
                "admission answered {values:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_parsed_strictly() {
        let reply = Reply::parse(&[1, 5_000_000, 1, 1, 42, 7, 2007, 0, 0, 1_000_000]).unwrap();
        assert_eq!(
            reply.pushback().wait,
            std::time::Duration::from_millis(2000)
        );
        assert!(!reply.pushback().stop);
        assert_eq!(reply.result, 1);
        assert_eq!(reply.tokens, 5_000_000);
        assert!(reply.enabled && reply.tracked);
        assert!(Reply::parse(&[1, 2, 3]).is_err());
    }

    #[test]
    fn admissions_are_parsed_strictly() {
        assert_eq!(
            Admission::parse_one(&[1, -1, 7]).unwrap(),
            Admission::Admitted {
                scores: vec![INF_SCORE],
                now_ms: 7
            }
        );
        assert_eq!(Admission::parse_one(&[0, 0, 7]).unwrap(), Admission::Full);
        assert!(Admission::parse_one(&[1, 2]).is_err());
        assert_eq!(
            Admission::parse_all(&[1, 7, 10, -1], 2).unwrap(),
            Admission::Admitted {
                scores: vec![10, INF_SCORE],
                now_ms: 7
            }
        );
        assert_eq!(Admission::parse_all(&[0, 7], 2).unwrap(), Admission::Full);
        assert!(Admission::parse_all(&[1, 7, 10], 2).is_err());
    }
}
