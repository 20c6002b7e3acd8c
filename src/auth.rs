//! Authentication and authorization: who is calling, and which upstreams
//! and admin calls they may use.
//!
//! A principal is recognised by an API key (a bearer token in the
//! `authorization` metadata, configured only as its SHA-256 hash, so the
//! configuration holds no secret) or by an identity in its mTLS client
//! certificate (a DNS or URI subject alternative name, or the common name).
//! Each principal may decide and report for the upstreams matching its
//! patterns, and call `RetryAdmin` only with the admin role.
//!
//! This module knows nothing of gRPC: the edge passes in what it read from
//! the request and maps [`Denied`] to a status.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// An upstream name pattern: `*` matches any run of characters, everything
/// else matches itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern(String);

impl Pattern {
    /// A pattern from its text.
    pub fn new(text: impl Into<String>) -> Pattern {
        Pattern(text.into())
    }

    /// Whether `name` matches.
    pub fn matches(&self, name: &str) -> bool {
        glob(self.0.as_bytes(), name.as_bytes())
    }
}

/// Iterative wildcard match with backtracking to the last `*`: linear in
/// practice, and without recursion an attacker could deepen.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((star_p, star_t)) = star {
            p = star_p + 1;
            t = star_t + 1;
            star = Some((star_p, star_t + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&b| b == b'*')
}

/// A caller retryd knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Its name, for logs and audit.
    pub name: String,
    /// Upstreams it may decide and report for.
    pub upstreams: Vec<Pattern>,
    /// Whether it may call `RetryAdmin`.
    pub admin: bool,
}

impl Principal {
    /// Whether it may decide and report for `upstream`.
    pub fn may_use(&self, upstream: &str) -> bool {
        self.upstreams
            .iter()
            .any(|pattern| pattern.matches(upstream))
    }
}

/// A principal, its key hashes and its identities.
type Held<'a> = (&'a Arc<Principal>, BTreeSet<[u8; 32]>, BTreeSet<&'a str>);

/// Who may call, changed: principals by name. A principal is changed when
/// its upstreams, its admin role or any of its credentials differ.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrincipalChanges {
    /// Principals only the new configuration names (`anonymous` when
    /// authentication would be switched off).
    pub added: Vec<String>,
    /// Principals only the old configuration names.
    pub removed: Vec<String>,
    /// Principals both name, with different rights or credentials.
    pub changed: Vec<String>,
}

impl PrincipalChanges {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// Why a call is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// No credential, or one nobody was given.
    #[error("unauthenticated: {0}")]
    Unauthenticated(&'static str),
    /// A known caller asking for what it may not have.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
}

/// The callers retryd accepts. With none configured, authentication is off
/// and every caller is an all-powerful anonymous principal (config refuses
/// that beyond loopback unless the operator insists).
#[derive(Clone, Debug)]
pub struct Auth {
    anonymous: Option<Arc<Principal>>,
    by_key_hash: HashMap<[u8; 32], Arc<Principal>>,
    by_identity: HashMap<String, Arc<Principal>>,
}

impl Default for Auth {
    fn default() -> Self {
        Auth::disabled()
    }
}

impl Auth {
    /// Authentication off.
    pub fn disabled() -> Auth {
        Auth {
            anonymous: Some(Arc::new(Principal {
                name: "anonymous".into(),
                upstreams: vec![Pattern::new("*")],
                admin: true,
            })),
            by_key_hash: HashMap::new(),
            by_identity: HashMap::new(),
        }
    }

    /// Authentication on, with these principals and their credentials:
    /// API key hashes and certificate identities.
    pub fn new(principals: Vec<(Principal, Vec<[u8; 32]>, Vec<String>)>) -> Auth {
        let mut by_key_hash = HashMap::new();
        let mut by_identity = HashMap::new();
        for (principal, key_hashes, identities) in principals {
            let principal = Arc::new(principal);
            for hash in key_hashes {
                by_key_hash.insert(hash, Arc::clone(&principal));
            }
            for identity in identities {
                by_identity.insert(identity_key(&identity), Arc::clone(&principal));
            }
        }
        Auth {
            anonymous: None,
            by_key_hash,
            by_identity,
        }
    }

    /// The names of every principal (`anonymous` without authentication),
    /// for the metrics' principal labels.
    pub fn principal_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .anonymous
            .iter()
            .chain(self.by_key_hash.values())
            .chain(self.by_identity.values())
            .map(|principal| principal.name.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// What changes from these principals to `new`'s, by name: for the
    /// audit line a reload writes whenever who may call changes.
    pub fn changes_to(&self, new: &Auth) -> PrincipalChanges {
        let (old, new) = (self.by_name(), new.by_name());
        let mut changes = PrincipalChanges::default();
        for (name, held) in &old {
            match new.get(name) {
                None => changes.removed.push((*name).to_owned()),
                Some(now) if now != held => changes.changed.push((*name).to_owned()),
                Some(_) => {}
            }
        }
        changes.added = new
            .keys()
            .filter(|name| !old.contains_key(*name))
            .map(|name| (*name).to_owned())
            .collect();
        changes
    }

    /// Each principal by name with what it may do and the credentials that
    /// name it, in an order that compares.
    fn by_name(&self) -> BTreeMap<&str, Held<'_>> {
        let mut principals: BTreeMap<&str, Held<'_>> = BTreeMap::new();
        if let Some(anonymous) = &self.anonymous {
            principals.insert(
                &anonymous.name,
                (anonymous, BTreeSet::new(), BTreeSet::new()),
            );
        }
        for (hash, principal) in &self.by_key_hash {
            let held = principals
                .entry(&principal.name)
                .or_insert_with(|| (principal, BTreeSet::new(), BTreeSet::new()));
            held.1.insert(*hash);
        }
        for (identity, principal) in &self.by_identity {
            let held = principals
                .entry(&principal.name)
                .or_insert_with(|| (principal, BTreeSet::new(), BTreeSet::new()));
            held.2.insert(identity);
        }
        principals
    }

    /// Whether callers must authenticate.
    pub fn is_enabled(&self) -> bool {
        self.anonymous.is_none()
    }

    /// Who is calling, from the `authorization` metadata value (if any) and
    /// the identities in the client certificate (if any). An API key, when
    /// presented, must be valid: a wrong key is refused even if the
    /// certificate alone would do, so a leaked certificate cannot be paired
    /// with guessed keys unnoticed.
    pub fn authenticate<'a>(
        &self,
        authorization: Option<&str>,
        certificate_identities: impl IntoIterator<Item = &'a str>,
    ) -> Result<&Arc<Principal>, Denied> {
        if let Some(anonymous) = &self.anonymous {
            return Ok(anonymous);
        }
        if let Some(value) = authorization {
            let token = value
                .strip_prefix("Bearer ")
                .or_else(|| value.strip_prefix("bearer "))
                .ok_or(Denied::Unauthenticated(
                    "authorization must be \"Bearer <api key>\"",
                ))?;
            // No key this short is ever issued (`retryd hash-key` refuses
            // one), and the configuration refuses the hash of the empty
            // key: refused before any hashing, so an empty `Bearer ` can
            // never match.
            let token = normalize_key(token);
            if token.len() < MIN_KEY_LEN {
                return Err(Denied::Unauthenticated(
                    "API key too short: keys have at least 16 characters",
                ));
            }
            return self
                .by_key_hash
                .get(&hash_key(token))
                .ok_or(Denied::Unauthenticated("unknown API key"));
        }
        certificate_identities
            .into_iter()
            .find_map(|identity| self.by_identity.get(identity))
            .ok_or(Denied::Unauthenticated(
                "no credential: send \"authorization: Bearer <api key>\" or a known client certificate",
            ))
    }
}

/// The fewest characters an API key has (after [`normalize_key`]):
/// `retryd hash-key` refuses shorter keys, and the server refuses them
/// before hashing.
pub const MIN_KEY_LEN: usize = 16;

/// An API key as it is hashed: without leading or trailing whitespace
/// (`str::trim`). The server trims what follows `Bearer `, and
/// `retryd hash-key` the line it reads: [`hash_key`] trims through this
/// one function, so that the two can never disagree.
pub fn normalize_key(key: &str) -> &str {
    key.trim()
}

/// How an identity is compared: DNS names and common names in any case (RFC
/// 6125: DNS names are case-insensitive), URIs (a SPIFFE ID, say) exactly,
/// since their path is not. Applied to configured identities and to the
/// certificate's, so that lookup is one exact match.
pub fn identity_key(identity: &str) -> String {
    if identity.contains("://") {
        identity.to_owned()
    } else {
        identity.to_ascii_lowercase()
    }
}

/// The SHA-256 of an API key, as configured in `api_keys_sha256`: of the
/// UTF-8 bytes of [`normalize_key`]`(key)`, so surrounding whitespace never
/// changes the hash. Keys are printable ASCII without spaces, since they
/// travel in an HTTP/2 header; `retryd hash-key` refuses anything else, and
/// a key outside that set cannot be presented as typed.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(normalize_key(key).as_bytes()).into()
}

/// The identities a DER-encoded client certificate vouches for, as RFC 6125
/// reads them: its DNS and URI subject alternative names; its common names
/// only when it has no subject alternative name at all (a certificate with
/// SANs vouches for those alone, whatever its subject says). Nothing for a
/// certificate that does not parse.
///
/// Pass only the leaf: the handshake verifies that the leaf chains to the
/// client CA, not that the other certificates a client sends do, so their
/// names prove nothing.
pub fn certificate_identities(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok((_, certificate)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    match certificate.subject_alternative_name() {
        Ok(Some(names)) => names
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::DNSName(dns) => Some(identity_key(dns)),
                GeneralName::URI(uri) => Some(identity_key(uri)),
                _ => None,
            })
            .collect(),
        Ok(None) => certificate
            .subject()
            .iter_common_name()
            .filter_map(|common_name| common_name.as_str().ok())
            .map(identity_key)
            .collect(),
        // A malformed or duplicated SAN extension: trust no name in it.
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let cases = [
            ("*", "anything", true),
            ("payments-*", "payments-api", true),
            ("payments-*", "payments-", true),
            ("payments-*", "ledger", false),
            ("*-api", "payments-api", true),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("ledger", "ledger", true),
            ("ledger", "ledger2", false),
            ("", "", true),
            ("", "x", false),
        ];
        for (pattern, name, expected) in cases {
            assert_eq!(
                Pattern::new(pattern).matches(name),
                expected,
                "{pattern} ~ {name}"
            );
        }
    }

    fn principal(name: &str, upstreams: &[&str], admin: bool) -> Principal {
        Principal {
            name: name.into(),
            upstreams: upstreams.iter().map(|p| Pattern::new(*p)).collect(),
            admin,
        }
    }

    #[test]
    fn keys_and_certificates() {
        let auth = Auth::new(vec![
            (
                principal("checkout", &["payments-*"], false),
                vec![hash_key("s3cret-0123456789")],
                vec![],
            ),
            (
                principal("ops", &["*"], true),
                vec![],
                vec!["ops.example".into()],
            ),
        ]);
        assert!(auth.is_enabled());
        let checkout = auth
            .authenticate(Some("Bearer s3cret-0123456789"), [])
            .unwrap();
        assert_eq!(checkout.name, "checkout");
        assert!(checkout.may_use("payments-api") && !checkout.may_use("ledger"));
        assert_eq!(
            auth.authenticate(Some("Bearer wrong-0123456789"), ["ops.example"]),
            Err(Denied::Unauthenticated("unknown API key"))
        );
        assert!(matches!(
            auth.authenticate(Some("Basic x"), []),
            Err(Denied::Unauthenticated(_))
        ));
        assert!(matches!(
            auth.authenticate(None, []),
            Err(Denied::Unauthenticated(_))
        ));
        assert_eq!(
            auth.authenticate(None, ["nobody", "ops.example"])
                .unwrap()
                .name,
            "ops"
        );
    }

    #[test]
    fn a_key_hashes_the_same_whatever_whitespace_surrounds_it() {
        assert_eq!(
            hash_key("k3y-0123456789ab \t\r\n"),
            hash_key("k3y-0123456789ab")
        );
        assert_eq!(hash_key("  k3y-0123456789ab"), hash_key("k3y-0123456789ab"));
        assert_ne!(hash_key("k3y 0123456789ab"), hash_key("k3y0123456789ab"));
        // What `retryd hash-key` prints for a line with a trailing space is
        // what the server accepts for the key without it.
        let auth = Auth::new(vec![(
            principal("checkout", &["*"], false),
            vec![hash_key("k3y-0123456789ab \n")],
            vec![],
        )]);
        assert_eq!(
            auth.authenticate(Some("Bearer k3y-0123456789ab"), [])
                .unwrap()
                .name,
            "checkout"
        );
    }

    #[test]
    fn dns_identities_match_in_any_case_uris_exactly() {
        let auth = Auth::new(vec![(
            principal("ops", &["*"], true),
            vec![],
            vec!["Ops.Example".into(), "spiffe://Example/Ops".into()],
        )]);
        let presented = identity_key("OPS.example");
        assert_eq!(
            auth.authenticate(None, [presented.as_str()]).unwrap().name,
            "ops"
        );
        let uri = identity_key("spiffe://Example/Ops");
        assert!(auth.authenticate(None, [uri.as_str()]).is_ok());
        let other_case = identity_key("spiffe://example/ops");
        assert!(auth.authenticate(None, [other_case.as_str()]).is_err());
    }

    #[test]
    fn empty_and_short_keys_are_refused_before_hashing() {
        // Even a principal holding the hash of the empty key (which the
        // configuration refuses) or of a short one is never matched.
        let auth = Auth::new(vec![(
            principal("empty", &["*"], true),
            vec![hash_key(""), hash_key("short")],
            vec![],
        )]);
        for presented in [
            "Bearer ",
            "Bearer    ",
            "Bearer short",
            "bearer 0123456789abcde",
        ] {
            assert_eq!(
                auth.authenticate(Some(presented), []),
                Err(Denied::Unauthenticated(
                    "API key too short: keys have at least 16 characters"
                )),
                "{presented:?}"
            );
        }
    }

    #[test]
    fn disabled_lets_everyone_do_everything() {
        let auth = Auth::disabled();
        let anonymous = auth.authenticate(None, []).unwrap();
        assert!(anonymous.admin && anonymous.may_use("anything"));
    }
}
