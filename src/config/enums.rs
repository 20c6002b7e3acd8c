//! The enumerated settings (`store.kind`, `store.mode`, `on_unavailable`, `inside_enclosing_retry`,
//! `backoff.jitter`, `telemetry.log_format`, `server.tls.client_auth`,
//! `permanent_failures`): serde enums, read by name so that a typo is
//! refused with the names accepted, and the mapping of each to the type of
//! the crate that acts on it.
//!
//! Why not plain `#[derive(Deserialize)]`: the `config` crate checks an
//! enum's variant itself and says only "enum StoreMode does not have
//! variant constructor fast", with neither the accepted names nor a word
//! an operator wrote. So each enum derives its serde code as an inherent
//! function (`#[serde(remote = "Self")]`), and its `Deserialize` reads the
//! value as a string first and hands it to that function through serde's
//! own string deserializer, whose unknown-variant error lists the names.
//! The `config` crate then adds the key, and `loading` puts it in front.
//!
//! No value is validated here beyond its name.

use std::fmt;

use serde::de::{self, IntoDeserializer};
use serde::{Deserialize, Deserializer};

use crate::budget::OnUnavailable;
use crate::budget::redis::RedisMode;
use crate::engine::{EnclosingRetry, FailureKind, GrpcCode, Jitter, VariantArray};

/// How every message for a name that is not accepted begins; `loading`
/// recognises it to name the key first.
pub(super) const UNKNOWN_VARIANT: &str = "unknown variant ";

/// `unknown variant "fast", expected "exact" or "leased"`: serde's wording,
/// with the name quoted (and escaped) as Rust prints a string, so that a
/// URL written by mistake is found and redacted like any quoted value.
pub(super) fn unknown_variant(name: &str, expected: &[&str]) -> String {
    let quoted: Vec<String> = expected.iter().map(|name| format!("{name:?}")).collect();
    let expected = match quoted.as_slice() {
        [] => "no value at all".to_owned(),
        [one] => one.clone(),
        [one, two] => format!("{one} or {two}"),
        all => format!("one of {}", all.join(", ")),
    };
    format!("{UNKNOWN_VARIANT}{name:?}, expected {expected}")
}

/// The error of reading a name: serde's derived code reports an unknown
/// name through [`de::Error::unknown_variant`], which here keeps the list.
#[derive(Debug)]
struct NameError(String);

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NameError {}

impl de::Error for NameError {
    fn custom<T: fmt::Display>(message: T) -> Self {
        NameError(message.to_string())
    }

    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        NameError(unknown_variant(variant, expected))
    }
}

/// `Deserialize` for enums whose serde code is derived with
/// `#[serde(remote = "Self")]`: the value as a string, then its variant.
macro_rules! deserialize_by_name {
    ($($name:ident),* $(,)?) => {$(
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let name = String::deserialize(deserializer)?;
                // The inherent function serde derived, not this trait's.
                $name::deserialize(IntoDeserializer::<NameError>::into_deserializer(
                    name.as_str(),
                ))
                .map_err(de::Error::custom)
            }
        }
    )*};
}

deserialize_by_name!(
    StoreKind,
    StoreMode,
    OnUnavailableName,
    JitterName,
    EnclosingRetryName,
    LogFormat,
    ClientAuth
);

/// `store.kind`: which budget store runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum StoreKind {
    /// The embedded in-memory store, one per replica.
    Memory,
    /// The Redis store, shared by the replicas.
    Redis,
}

/// `store.mode`: how the Redis store spends tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum StoreMode {
    /// Every withdrawal is one atomic script call.
    Exact,
    /// Replicas lease small batches of tokens and spend them locally.
    Leased,
}

impl From<StoreMode> for RedisMode {
    fn from(mode: StoreMode) -> RedisMode {
        match mode {
            StoreMode::Exact => RedisMode::Exact,
            StoreMode::Leased => RedisMode::Leased,
        }
    }
}

/// `store.on_unavailable` and an upstream's `on_unavailable`: the spelling
/// of the budget's [`OnUnavailable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum OnUnavailableName {
    /// Decide from a local bucket that starts empty.
    Local,
    /// Deny with BUDGET_UNAVAILABLE.
    Deny,
}

impl From<OnUnavailableName> for OnUnavailable {
    fn from(name: OnUnavailableName) -> OnUnavailable {
        match name {
            OnUnavailableName::Local => OnUnavailable::Local,
            OnUnavailableName::Deny => OnUnavailable::Deny,
        }
    }
}

impl From<OnUnavailable> for OnUnavailableName {
    fn from(on_unavailable: OnUnavailable) -> OnUnavailableName {
        match on_unavailable {
            OnUnavailable::Local => OnUnavailableName::Local,
            OnUnavailable::Deny => OnUnavailableName::Deny,
        }
    }
}

/// `backoff.jitter`: the spelling of the engine's [`Jitter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum JitterName {
    /// Uniform below the exponential step.
    Full,
    /// Uniform from the base to three times the previous backoff.
    Decorrelated,
}

impl From<JitterName> for Jitter {
    fn from(name: JitterName) -> Jitter {
        match name {
            JitterName::Full => Jitter::Full,
            JitterName::Decorrelated => Jitter::Decorrelated,
        }
    }
}

/// `inside_enclosing_retry`: the spelling of the engine's
/// [`EnclosingRetry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum EnclosingRetryName {
    /// Not retried while a layer above retries (DENY INSIDE_ENCLOSING_RETRY).
    Deny,
    /// Retried on this hop's budget, as if not enclosed.
    Allow,
}

impl From<EnclosingRetryName> for EnclosingRetry {
    fn from(name: EnclosingRetryName) -> EnclosingRetry {
        match name {
            EnclosingRetryName::Deny => EnclosingRetry::Deny,
            EnclosingRetryName::Allow => EnclosingRetry::Allow,
        }
    }
}

/// `telemetry.log_format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `server.tls.client_auth`, with a client CA: whether a client
/// certificate is required.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "snake_case")]
pub enum ClientAuth {
    /// Every client presents a certificate that chains to the client CA.
    Required,
    /// A client may authenticate with an API key instead.
    Optional,
}

/// An entry of `permanent_failures`: a [`FailureKind`] by the name
/// [`FailureKind::as_str`] gives it. The engine has no serde, so the names
/// are its own list rather than a derive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureKindName(pub FailureKind);

/// A gRPC status code named in configuration (`"unavailable"`), as
/// [`GrpcCode::as_str`] gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcCodeName(pub GrpcCode);

impl<'de> Deserialize<'de> for GrpcCodeName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        GrpcCode::from_name(&name).map(GrpcCodeName).ok_or_else(|| {
            de::Error::custom(unknown_variant(
                &name,
                &GrpcCode::VARIANTS
                    .iter()
                    .map(|code| code.as_str())
                    .collect::<Vec<_>>(),
            ))
        })
    }
}

impl<'de> Deserialize<'de> for FailureKindName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        FailureKind::from_name(&name)
            .map(FailureKindName)
            .ok_or_else(|| {
                de::Error::custom(unknown_variant(
                    &name,
                    &FailureKind::VARIANTS
                        .iter()
                        .map(|kind| kind.as_str())
                        .collect::<Vec<_>>(),
                ))
            })
    }
}

/// A list of names as the file writes it (`["connect", "dns"]`) or as an
/// environment variable can, which holds one string: comma-separated
/// (`RETRYD__DEFAULTS__PERMANENT_FAILURES=connect,dns`; spaces around a
/// name are ignored, an empty string is the empty list). Each name is then
/// read as `T` reads it, so a typo is refused with the names accepted.
pub(super) fn names_or_commas<'de, D, T>(deserializer: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Names<T>(std::marker::PhantomData<T>);

    impl<'de, T: Deserialize<'de>> de::Visitor<'de> for Names<T> {
        type Value = Vec<T>;

        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("a list of names, or one string of comma-separated names")
        }

        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut names = Vec::new();
            while let Some(name) = seq.next_element::<T>()? {
                names.push(name);
            }
            Ok(names)
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Vec<T>, E> {
            text.split(',')
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(|name| T::deserialize(name.into_deserializer()))
                .collect()
        }
    }

    deserializer
        .deserialize_any(Names(std::marker::PhantomData))
        .map(Some)
}
