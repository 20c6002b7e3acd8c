//! Loading: the TOML file, then `RETRYD__` environment variables, layered
//! by the `config` crate into [`Settings`].
//!
//! This is where the environment is read, and where the errors of the
//! TOML parser and of the `config` crate are turned into
//! [`InvalidConfig`]s that never print a secret: neither a line of the
//! file (it may hold a password) nor the credentials of a URL a value
//! quotes. It must not validate values: the section modules do.

use std::collections::HashMap;
use std::path::Path;

use crate::budget::redis::redact_url;

use super::enums::UNKNOWN_VARIANT;
use super::{ENV_PREFIX, InvalidConfig, Secret, Settings, invalid};

#[cfg(test)]
mod tests;

impl Settings {
    /// Loads settings from an optional TOML file and the process
    /// environment. Only `main` should call this.
    pub fn load(path: Option<&Path>) -> Result<Settings, InvalidConfig> {
        let toml = match path {
            Some(path) => std::fs::read_to_string(path).map_err(|err| {
                invalid(path.display().to_string(), format!("cannot read: {err}"))
            })?,
            None => String::new(),
        };
        Settings::from_sources(&toml, None)
    }

    /// Settings from TOML text and, if given, an explicit map of environment
    /// variables (`None` reads the process environment).
    pub fn from_sources(
        toml: &str,
        environment: Option<HashMap<String, String>>,
    ) -> Result<Settings, InvalidConfig> {
        // The config crate reads `a[3]` in a key as an array index and
        // allocates up to it, so a key like `"x[200000000000]"` aborts the
        // process (found by fuzzing). No retryd key has brackets: refuse
        // them, by name, before the config crate sees them.
        // Text that is not TOML is refused here too: the TOML parser's own
        // message quotes the offending line, which may be a `store.url`
        // with its password, so it is placed by line, column and key
        // instead.
        let table = toml
            .parse::<toml::Table>()
            .map_err(|error| syntax_error(toml, &error))?;
        refuse_bracketed_keys("", &table)?;
        let process_environment;
        let variables = match &environment {
            Some(map) => map,
            None => {
                process_environment = std::env::vars().collect::<HashMap<_, _>>();
                &process_environment
            }
        };
        if let Some(name) = variables
            .keys()
            .find(|name| name.starts_with(ENV_PREFIX) && name.contains(['[', ']']))
        {
            return Err(invalid(
                name.clone(),
                "variable names may not contain '[' or ']'",
            ));
        }
        // The OpenTelemetry variables every instrumented service honours;
        // `[telemetry]` resolves them (config/otel.rs).
        let otel = variables
            .iter()
            .filter(|(name, _)| name.starts_with("OTEL_"))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        let builder = config::Config::builder()
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix(ENV_PREFIX)
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    // A copy: `variables` may borrow the map, for the
                    // variable `store.password_env` names.
                    .source(environment.clone()),
            );
        let mut settings: Settings = builder
            .build()
            .and_then(|merged| merged.try_deserialize())
            .map_err(|error| load_error(&error))?;
        settings.otel = otel;
        if let Some(name) = &settings.store.password_env {
            settings.store.password_env_value = variables.get(name).cloned().map(Secret);
        }
        Ok(settings)
    }

    /// Settings from TOML text alone, for tests and `check-config`.
    pub fn from_toml(toml: &str) -> Result<Settings, InvalidConfig> {
        Settings::from_sources(toml, Some(HashMap::new()))
    }
}

/// The `config` crate's error as retryd says it. A name an enumerated
/// setting does not accept is a bad value of a key, so it reads like every
/// other (`store.mode: unknown variant "fast", expected "exact" or
/// "leased"`) rather than with the key at the end; anything else keeps the
/// crate's words. Either way serde quotes the value, which may be a URL
/// with credentials (a `RETRYD__` variable set to the wrong key), so URLs
/// are redacted.
fn load_error(error: &config::ConfigError) -> InvalidConfig {
    if let config::ConfigError::At {
        error: cause,
        key: Some(key),
        ..
    } = error
    {
        if let config::ConfigError::Message(message) = cause.as_ref() {
            if message.starts_with(UNKNOWN_VARIANT) {
                return invalid(redact_urls_in(&dotted_key(key)), redact_urls_in(message));
            }
        }
    }
    InvalidConfig::Load(redact_urls_in(&error.to_string()))
}

/// A key as the other messages write it. The `config` crate joins the
/// path with dots, so `upstreams.Payments.API.on_unavailable` no longer
/// says where the upstream's name ends; retryd quotes the name
/// (`upstreams."Payments.API".on_unavailable`), found from the end since
/// only these keys of an upstream hold a name.
fn dotted_key(key: &str) -> String {
    let Some(rest) = key.strip_prefix("upstreams.") else {
        return key.to_owned();
    };
    let field_at = [
        ".on_unavailable",
        ".inside_enclosing_retry",
        ".backoff.jitter",
    ]
    .into_iter()
    .find_map(|field| rest.strip_suffix(field).map(str::len))
    .or_else(|| {
        // `permanent_failures[3]`
        let at = rest.rfind(".permanent_failures[")?;
        let index = rest[at..].strip_prefix(".permanent_failures[")?;
        let digits = index.strip_suffix(']')?;
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(at)
    });
    match field_at {
        Some(at) => format!("upstreams.{:?}{}", &rest[..at], &rest[at..]),
        None => key.to_owned(),
    }
}

fn refuse_bracketed_keys(prefix: &str, table: &toml::Table) -> Result<(), InvalidConfig> {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        if key.contains(['[', ']']) {
            return Err(invalid(
                path,
                "keys (and upstream names) may not contain '[' or ']'",
            ));
        }
        match value {
            toml::Value::Table(inner) => refuse_bracketed_keys(&path, inner)?,
            toml::Value::Array(items) => {
                for item in items {
                    if let toml::Value::Table(inner) = item {
                        refuse_bracketed_keys(&path, inner)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// `text` (an error message) with every URL in it redacted. A URL inside a
/// quoted string (`string "redis://…"`, as serde quotes values) runs to the
/// closing quote; elsewhere, to the next whitespace.
pub(super) fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(separator) = rest.find("://") {
        let scheme_start = rest[..separator]
            .char_indices()
            .rev()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |(at, c)| at + c.len_utf8());
        let quoted = rest[..scheme_start].ends_with('"');
        let after = &rest[separator..];
        let length = if quoted {
            // To the first quote not escaped by a backslash.
            let mut escaped = false;
            after
                .char_indices()
                .find(|&(_, c)| {
                    let end = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .map_or(after.len(), |(at, _)| at)
        } else {
            after.find(char::is_whitespace).unwrap_or(after.len())
        };
        let url_end = separator + length;
        out.push_str(&rest[..scheme_start]);
        out.push_str(&redact_url(&rest[scheme_start..url_end]));
        rest = &rest[url_end..];
    }
    out.push_str(rest);
    out
}

/// A TOML syntax error, placed by line and column and, when the line (or
/// the table it is in) names a key, by key; the line itself is not quoted.
fn syntax_error(toml: &str, error: &toml::de::Error) -> InvalidConfig {
    let start = error.span().map_or(0, |span| span.start).min(toml.len());
    let before = toml.get(..start).unwrap_or(toml);
    let line_index = before.matches('\n').count();
    let line_start = before.rfind('\n').map_or(0, |at| at + 1);
    let column = before[line_start..].chars().count() + 1;
    let lines: Vec<&str> = toml.lines().collect();
    // Only text made of key characters is shown: never a URL or a value.
    let is_key = |text: &str| {
        !text.is_empty()
            && text.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '"' | '\'' | ' ')
            })
    };
    let table = lines
        .get(..=line_index.min(lines.len().saturating_sub(1)))
        .unwrap_or_default()
        .iter()
        .rev()
        .find_map(|line| {
            let header = line.split('#').next().unwrap_or_default().trim();
            let inner = header.strip_prefix('[')?.strip_suffix(']')?;
            let inner = inner.trim_start_matches('[').trim_end_matches(']').trim();
            is_key(inner).then_some(inner)
        });
    let key = lines
        .get(line_index)
        .and_then(|line| line.split_once('='))
        .map(|(key, _)| key.trim())
        .filter(|key| is_key(key));
    let key = match (table, key) {
        (Some(table), Some(key)) => Some(format!("{table}.{key}")),
        (table, key) => table.or(key).map(str::to_owned),
    };
    InvalidConfig::Syntax {
        key,
        line: line_index + 1,
        column,
        message: redact_urls_in(error.message().trim()),
    }
}
