//! `[auth]` validated: principals, their API key hashes decoded and their
//! certificate identities, into the [`Auth`] the edge asks who is calling.
//!
//! A credential belongs to one principal, so duplicates are refused, and
//! compared as what they mean rather than as text: a key hash by its
//! decoded bytes, since `Auth::new` keys its map by them and would let the
//! later holder silently win; a DNS identity case-insensitively, since
//! RFC 6125 says `OPS.example.com` is `ops.example.com`, and one name must
//! not stand for two principals.

use std::collections::{HashMap, HashSet};

use crate::auth::{Auth, Pattern, Principal};

use super::{AuthSettings, InvalidConfig, invalid};

pub(super) fn auth(settings: &AuthSettings) -> Result<Auth, InvalidConfig> {
    if settings.principals.is_empty() {
        return Ok(Auth::disabled());
    }
    let mut principals = Vec::with_capacity(settings.principals.len());
    let mut names = HashSet::new();
    // Each credential, as compared, to the index of the principal that
    // holds it first, for the message.
    let mut keys = HashMap::new();
    let mut identities = HashMap::new();
    for (index, principal) in settings.principals.iter().enumerate() {
        let key = |name: &str| format!("auth.principals[{index}].{name}");
        if principal.name.is_empty() || !names.insert(principal.name.as_str()) {
            return Err(invalid(key("name"), "must be non-empty and unique"));
        }
        if principal.api_keys_sha256.is_empty() && principal.identities.is_empty() {
            return Err(invalid(
                key("api_keys_sha256"),
                "a principal needs an API key hash or an identity",
            ));
        }
        let mut hashes = Vec::new();
        for (entry, hex) in principal.api_keys_sha256.iter().enumerate() {
            let entry_key = key(&format!("api_keys_sha256[{entry}]"));
            let hash = decode_sha256(hex).ok_or_else(|| {
                invalid(
                    &entry_key,
                    "each entry must be 64 hex digits (retryd hash-key)",
                )
            })?;
            // The hash of the empty key: an empty `authorization: Bearer `
            // would be that principal (the server refuses short keys too).
            if hash == crate::auth::hash_key("") {
                return Err(invalid(
                    entry_key,
                    "is the SHA-256 of the empty string, not of a key (retryd hash-key refuses keys under 16 characters)",
                ));
            }
            if let Some(holder) = keys.insert(hash, index) {
                return Err(invalid(
                    entry_key,
                    format!(
                        "a key belongs to one principal only: auth.principals[{holder}] already holds this hash (hex digits compare in either case)"
                    ),
                ));
            }
            hashes.push(hash);
        }
        for (entry, identity) in principal.identities.iter().enumerate() {
            let entry_key = key(&format!("identities[{entry}]"));
            if identity.is_empty() {
                return Err(invalid(
                    entry_key,
                    "identities must be non-empty and belong to one principal only",
                ));
            }
            if let Some(holder) = identities.insert(identity_for_comparison(identity), index) {
                return Err(invalid(
                    entry_key,
                    format!(
                        "an identity belongs to one principal only: auth.principals[{holder}] already holds {identity:?}{}",
                        if identity.contains("://") {
                            ""
                        } else {
                            " (DNS names compare in any case)"
                        }
                    ),
                ));
            }
        }
        principals.push((
            Principal {
                name: principal.name.clone(),
                upstreams: principal.upstreams.iter().map(Pattern::new).collect(),
                admin: principal.admin,
            },
            hashes,
            principal.identities.clone(),
        ));
    }
    Ok(Auth::new(principals))
}

/// An identity as it is compared for duplicates: a URI (a SPIFFE ID, say)
/// as written, since its path is case-sensitive; anything else is a DNS
/// name or a common name, which RFC 6125 compares in any ASCII case.
fn identity_for_comparison(identity: &str) -> String {
    if identity.contains("://") {
        identity.to_owned()
    } else {
        identity.to_ascii_lowercase()
    }
}

fn decode_sha256(hex: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    // Either case: the hex crate reads both.
    hex::decode_to_slice(hex.trim(), &mut out).ok()?;
    Some(out)
}
