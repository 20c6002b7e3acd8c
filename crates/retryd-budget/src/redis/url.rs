//! Redis URLs that cannot print their credentials, and the redaction that
//! every URL shown in a message or a log goes through.

use std::fmt;

/// A Redis URL that cannot print its credentials: `Debug` and `Display`
/// show `redis://***@host:port/db`, hiding the whole userinfo (user name
/// too, since a password written without its `:` lands there), any query
/// and any port that is not a number. The URL itself is reachable only
/// through [`RedisUrl::expose_credentials`], for the store to connect with.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl RedisUrl {
    /// The URL as configured, password included: only for connecting.
    pub fn expose_credentials(&self) -> &str {
        &self.0
    }
}

impl RedisUrl {
    /// True for `rediss://`: TLS.
    pub fn is_tls(&self) -> bool {
        self.0.starts_with("rediss://")
    }
}

impl From<String> for RedisUrl {
    fn from(url: String) -> RedisUrl {
        RedisUrl(url)
    }
}

impl From<&str> for RedisUrl {
    fn from(url: &str) -> RedisUrl {
        RedisUrl(url.to_owned())
    }
}

/// Compares the whole URL, without printing it (for tests).
impl PartialEq<&str> for RedisUrl {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisUrl")
            .field(&redact_url(&self.0))
            .finish()
    }
}

impl RedisUrl {
    /// A URL the client can connect to:
    /// `redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB]` (`rediss` for TLS).
    /// The reason for a refusal shows the URL redacted. What the client
    /// would refuse only at connect time is refused here.
    pub fn parse(url: &str) -> Result<RedisUrl, String> {
        let shown = redact_url(url);
        if !url.starts_with("redis://") && !url.starts_with("rediss://") {
            return Err(format!("{shown:?} is not a redis:// or rediss:// URL"));
        }
        match UrlParts::of(url).filter(|parts| !parts.host.is_empty()) {
            None => Err(format!(
                "{shown:?} names no host (redis://[:PASSWORD@]HOST[:PORT][/DB])"
            )),
            Some(parts) if !parts.is_numeric_port() => Err(format!(
                "{shown:?}: the port is not a number (a password goes before an @: redis://:PASSWORD@HOST:PORT)"
            )),
            Some(_) => Ok(RedisUrl(url.to_owned())),
        }
    }
}

/// The parts of `scheme://[userinfo@]host[:port][/path][?query|#fragment]`
/// that redaction and validation look at. The userinfo runs to the *last*
/// `@`, so that a password with a raw `@`, `/`, `?` or `#` in it is still
/// all userinfo, hidden (at worst an `@` in a path hides the host too).
struct UrlParts<'a> {
    scheme: &'a str,
    has_userinfo: bool,
    host: &'a str,
    port: Option<&'a str>,
    path: &'a str,
    /// From the first `?` or `#` after the host, delimiter included.
    query: &'a str,
}

impl UrlParts<'_> {
    /// `None` without `://`: then nothing says which part is safe to show.
    fn of(url: &str) -> Option<UrlParts<'_>> {
        let (scheme, rest) = url.split_once("://")?;
        let (has_userinfo, rest) = match rest.rsplit_once('@') {
            Some((_, after)) => (true, after),
            None => (false, rest),
        };
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        // `[::1]:6379`: the port follows the bracketed IPv6 address.
        let port_start = match authority.strip_prefix('[') {
            Some(inner) => inner.find(']').map(|end| end + 2),
            None => Some(0),
        }
        .and_then(|from| authority.get(from..)?.find(':').map(|at| from + at));
        let (host, port) = match port_start {
            Some(at) => (&authority[..at], Some(&authority[at + 1..])),
            None => (authority, None),
        };
        let query_start = tail.find(['?', '#']).unwrap_or(tail.len());
        let (path, query) = tail.split_at(query_start);
        Some(UrlParts {
            scheme,
            has_userinfo,
            host,
            port,
            path,
            query,
        })
    }

    fn is_numeric_port(&self) -> bool {
        self.port
            .is_none_or(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
    }
}

/// `url` as it may be shown: its userinfo, query and any port that is not
/// a number replaced by `***` (see [`RedisUrl`]); a text without `://` is
/// not shown at all.
pub fn redact_url(url: &str) -> String {
    let Some(parts) = UrlParts::of(url) else {
        return "***".to_owned();
    };
    let mut shown = format!("{}://", parts.scheme);
    if parts.has_userinfo {
        shown.push_str("***@");
    }
    shown.push_str(parts.host);
    match parts.port {
        // Not a port: perhaps a password written without its host,
        // `redis://:secret`.
        Some(_) if !parts.is_numeric_port() => shown.push_str(":***"),
        Some(port) => {
            shown.push(':');
            shown.push_str(port);
        }
        None => {}
    }
    shown.push_str(parts.path);
    if let Some(delimiter) = parts.query.chars().next() {
        shown.push(delimiter);
        shown.push_str("***");
    }
    shown
}
