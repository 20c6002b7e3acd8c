//! The connection to Redis: one node or a Cluster behind one type (no
//! `dyn`), opened with the version checked on every node and every script
//! loaded, within 5 s. It owns nothing of the store's state and, once
//! connected, neither times requests out nor retries them: the core does
//! (`shared.rs`).

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, FromRedisValue, RedisResult, Script, ScriptInvocation, Value};

use super::scripts::Scripts;
use super::{RedisConfig, RedisStoreError, RedisUrl, unavailable};
use crate::StoreError;

/// How long `connect` may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The oldest Redis whose scripts may call `TIME` before writing (effects
/// replication by default).
pub(super) const MIN_VERSION: (u32, u32) = (5, 0);

/// One node or a Cluster, behind one type (no `dyn`).
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Opens the connection and loads every script, within 5 s.
    pub(super) async fn open_with_scripts(
        config: &RedisConfig,
    ) -> Result<(Connection, Scripts), StoreError> {
        let setup = async {
            let connection = open(config).await?;
            let scripts = Scripts::new();
            for script in scripts.all() {
                connection.load(script).await?;
            }
            Ok::<_, RedisStoreError>((connection, scripts))
        };
        tokio::time::timeout(CONNECT_TIMEOUT, setup)
            .await
            .map_err(|_| unavailable(RedisStoreError::Timeout))?
            .map_err(unavailable)
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }

    pub(super) async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        // Script::invoke_async sends EVALSHA and, on NOSCRIPT, SCRIPT LOAD
        // (routed to every master in a Cluster) then EVALSHA again.
        match self {
            Connection::Single(connection) => {
                invocation.invoke_async(&mut connection.clone()).await
            }
            Connection::Cluster(connection) => {
                invocation.invoke_async(&mut connection.clone()).await
            }
        }
    }

    pub(super) async fn query<T: FromRedisValue>(&self, command: &Cmd) -> RedisResult<T> {
        match self {
            Connection::Single(connection) => command.query_async(&mut connection.clone()).await,
            Connection::Cluster(connection) => command.query_async(&mut connection.clone()).await,
        }
    }

    async fn load(&self, script: &Script) -> RedisResult<String> {
        match self {
            Connection::Single(connection) => script.load_async(&mut connection.clone()).await,
            Connection::Cluster(connection) => script.load_async(&mut connection.clone()).await,
        }
    }
}

async fn open(config: &RedisConfig) -> Result<Connection, RedisStoreError> {
    let Some(first) = config.urls.first() else {
        return Err(RedisStoreError::Reply("no Redis URL configured".into()));
    };
    // One URL may still name a Cluster node: INFO says so.
    if config.urls.len() == 1 {
        // The one place the password leaves its `RedisUrl`: to connect.
        let client = ::redis::Client::open(first.expose_credentials())?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200))
            .set_number_of_retries(6);
        let manager = ConnectionManager::new_with_config(client, manager_config).await?;
        let connection = Connection::Single(manager);
        let info = text_of(&connection.query::<Value>(&::redis::cmd("INFO")).await?);
        check_version(&info)?;
        if !info.contains("cluster_enabled:1") {
            return Ok(connection);
        }
    }
    let client = ClusterClientBuilder::new(config.urls.iter().map(RedisUrl::expose_credentials))
        .connection_timeout(Duration::from_secs(1))
        .response_timeout(config.timeout.max(Duration::from_millis(100)))
        .retries(3)
        .min_retry_wait(10)
        .max_retry_wait(100)
        .build()?;
    let connection = Connection::Cluster(client.get_async_connection().await?);
    let info = text_of(&connection.query::<Value>(&::redis::cmd("INFO")).await?);
    check_version(&info)?;
    Ok(connection)
}

/// Every string inside a reply (a Cluster answers INFO per node).
fn text_of(value: &Value) -> String {
    fn walk(value: &Value, out: &mut String) {
        match value {
            Value::BulkString(bytes) => out.push_str(&String::from_utf8_lossy(bytes)),
            Value::SimpleString(text) | Value::VerbatimString { text, .. } => out.push_str(text),
            Value::Array(values) | Value::Set(values) => {
                values.iter().for_each(|value| walk(value, out));
            }
            Value::Map(pairs) => pairs.iter().for_each(|(key, value)| {
                walk(key, out);
                out.push('\n');
                walk(value, out);
            }),
            _ => {}
        }
        out.push('\n');
    }
    let mut out = String::new();
    walk(value, &mut out);
    out
}

/// Every node must be recent enough.
fn check_version(info: &str) -> Result<(), RedisStoreError> {
    let mut found = false;
    for line in info.lines() {
        let Some(version) = line.trim().strip_prefix("redis_version:") else {
            continue;
        };
        found = true;
        let mut parts = version
            .split('.')
            .map(|part| part.parse::<u32>().unwrap_or(0));
        let major = parts.next().unwrap_or(0);
        let minor = parts.next().unwrap_or(0);
        if (major, minor) < MIN_VERSION {
            return Err(RedisStoreError::Version {
                found: version.to_owned(),
            });
        }
    }
    if found {
        Ok(())
    } else {
        Err(RedisStoreError::Reply("INFO names no redis_version".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_checked_on_every_node() {
        assert!(check_version("# Server\r\nredis_version:7.0.15\r\n").is_ok());
        assert!(check_version("redis_version:5.0.0\nredis_version:7.2.4\n").is_ok());
        assert!(check_version("redis_version:7.0.0\nredis_version:4.0.9\n").is_err());
        assert!(check_version("nothing here").is_err());
    }
}
