//! Redis key names. Every key of one upstream shares one hash tag, so that
//! each script touches a single Redis Cluster slot; the index of upstreams
//! has a tag of its own. Nothing here talks to Redis.

/// The key names of one deployment (one `store.key_prefix`).
#[derive(Clone, Debug)]
pub(super) struct KeySpace {
    prefix: String,
    index: String,
}

/// The keys of one upstream, in the order the bucket scripts expect them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct UpstreamKeys {
    pub(super) bucket: String,
    pub(super) switch: String,
    pub(super) leases: String,
}

impl KeySpace {
    /// `prefix` must contain no braces (the configuration refuses them), so
    /// the first `{` of every key is the one opening its hash tag.
    pub(super) fn new(prefix: &str) -> KeySpace {
        KeySpace {
            prefix: prefix.to_owned(),
            index: format!("{prefix}:{{index}}:upstreams"),
        }
    }

    /// `{prefix}:{u:<name>}:bucket|off|leases`, with `%`, `{` and `}`
    /// percent-escaped in the name: the tag then always closes where it
    /// should, is never empty, and cannot equal the index's `{index}`.
    pub(super) fn upstream(&self, upstream: &str) -> UpstreamKeys {
        let tag = tag("u", upstream);
        let prefix = &self.prefix;
        UpstreamKeys {
            bucket: format!("{prefix}:{tag}:bucket"),
            switch: format!("{prefix}:{tag}:off"),
            leases: format!("{prefix}:{tag}:leases"),
        }
    }

    /// `{prefix}:{u:<name>}:hedge:<slot>`: one slot of the upstream's
    /// hedging window, in the upstream's hash slot.
    pub(super) fn hedge(&self, upstream: &str, slot: u64) -> String {
        format!("{}:{}:hedge:{slot}", self.prefix, tag("u", upstream))
    }

    /// `{prefix}:{r:<id>}:report`: a traffic report id's key, escaped as
    /// upstream names are (a tag of its own, so any slot).
    pub(super) fn report(&self, id: &str) -> String {
        format!("{}:{}:report", self.prefix, tag("r", id))
    }

    /// The deployment's prefix.
    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The sorted set indexing tracked upstreams.
    pub(super) fn index(&self) -> &str {
        &self.index
    }
}

/// `{<kind>:<name>}` with `%`, `{` and `}` percent-escaped in the name.
fn tag(kind: &str, name: &str) -> String {
    let mut tag = String::with_capacity(name.len() + kind.len() + 8);
    tag.push('{');
    tag.push_str(kind);
    tag.push(':');
    for character in name.chars() {
        match character {
            '%' => tag.push_str("%25"),
            '{' => tag.push_str("%7B"),
            '}' => tag.push_str("%7D"),
            other => tag.push(other),
        }
    }
    tag.push('}');
    tag
}

/// The hash tag Redis Cluster would hash for `key`: the text between the
/// first `{` and the next `}`, if that is not empty; else the whole key.
#[cfg(test)]
fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(length) = key[open + 1..].find('}') {
            if length > 0 {
                return &key[open + 1..open + 1 + length];
            }
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tag_per_upstream_whatever_its_name() {
        let keys = KeySpace::new("retryd");
        let names = [
            "payments-api",
            "",
            "{",
            "}",
            "{}",
            "a}b{c",
            "%7B",
            "ünïcødé:ok",
            "x:{y}:z",
            "index",
            "u:",
        ];
        let mut tags = Vec::new();
        for name in names {
            let upstream = keys.upstream(name);
            let tag = hash_tag(&upstream.bucket);
            assert_eq!(hash_tag(&upstream.switch), tag, "{name:?}");
            assert_eq!(hash_tag(&upstream.leases), tag, "{name:?}");
            assert!(tag.starts_with("u:"), "{name:?} gave {tag:?}");
            assert_ne!(tag, hash_tag(keys.index()));
            tags.push(tag.to_owned());
        }
        let mut unique = tags.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), tags.len(), "distinct names, distinct tags");
    }

    #[test]
    fn readable_names_stay_readable() {
        let keys = KeySpace::new("retryd");
        assert_eq!(
            keys.upstream("payments-api").bucket,
            "retryd:{u:payments-api}:bucket"
        );
        assert_eq!(keys.upstream("a{b}").switch, "retryd:{u:a%7Bb%7D}:off");
        assert_eq!(keys.index(), "retryd:{index}:upstreams");
    }
}
