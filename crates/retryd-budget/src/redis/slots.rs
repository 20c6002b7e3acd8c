//! A Redis Cluster's slots, as values: the slot of a key (CRC16 of its
//! hash tag, as Redis computes it) and the masters `CLUSTER SLOTS` names
//! for each range. A leaf: both the circuits (`reachability.rs`) and the
//! per-node connections (`cluster.rs`) read slots through it.

use ::redis::Value;

/// Slots of a Redis Cluster.
pub(super) const SLOTS: usize = 16384;

/// `[[start, end, [host, port, ...], replicas...], ...]` as
/// `(start, end, "host:port")`.
pub(super) fn parse_slots(reply: &Value) -> Result<Vec<(usize, usize, String)>, String> {
    let Value::Array(entries) = reply else {
        return Err(format!("CLUSTER SLOTS answered {reply:?}"));
    };
    let int = |value: &Value| match value {
        Value::Int(n) if (0..SLOTS as i64).contains(n) => Some(*n as usize),
        _ => None,
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    entries
        .iter()
        .map(|entry| {
            let Value::Array(fields) = entry else {
                return None;
            };
            let (start, end) = (int(fields.first()?)?, int(fields.get(1)?)?);
            let Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let host = text(master.first()?)?;
            let Value::Int(port) = master.get(1)? else {
                return None;
            };
            (start <= end).then(|| (start, end, format!("{host}:{port}")))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| "CLUSTER SLOTS answered an entry of another shape".to_owned())
}

/// The Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, as Redis
/// computes it.
pub(super) fn slot(key: &str) -> usize {
    let bytes = key.as_bytes();
    let tagged = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    usize::from(crc16_xmodem(tagged)) % SLOTS
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_ones_redis_computes() {
        // From the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_eq!(slot("{}x"), usize::from(crc16_xmodem(b"{}x")) % SLOTS);
    }
}
