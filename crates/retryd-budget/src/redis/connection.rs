//! The connection to Redis: one node, a Cluster or a primary under
//! Sentinel behind one type (no `dyn`), over TLS for `rediss://` and as the
//! configured ACL user, opened with the version checked on every node and
//! every script loaded, within 5 s. It owns nothing of the store's state and, once
//! connected, neither times requests out nor retries them: the core does
//! (`shared.rs`).

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue,
    IntoConnectionInfo, RedisResult, Script, ScriptInvocation, Value,
};

use super::cluster::ClusterNodes;
use super::config::{RedisAccess, RedisConfig};
use super::error::{RedisStoreError, unavailable};
use super::scripts::Scripts;
use super::sentinel::SentinelConnection;
use super::socket::{certificates, tcp_settings};
use super::url::RedisUrl;
use crate::StoreError;

/// How long `connect` may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The oldest Redis whose scripts may call `TIME` before writing (effects
/// replication by default).
pub(super) const MIN_VERSION: (u32, u32) = (5, 0);

/// One node, a Cluster or a primary under Sentinel, behind one type (no
/// `dyn`).
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterNodes),
    Sentinel(SentinelConnection),
}

impl Connection {
    /// Opens the connection and loads every script, within 5 s.
    pub(super) async fn open_with_scripts(
        config: &RedisConfig,
    ) -> Result<(Connection, Scripts), StoreError> {
        let setup = async {
            let scripts = Scripts::new();
            let connection = open(config, &scripts).await?;
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

    /// Runs a script on the node serving `key` (any node for `None`).
    pub(super) async fn invoke<T: FromRedisValue>(
        &self,
        key: Option<&str>,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        // Script::invoke_async sends EVALSHA and, on NOSCRIPT, SCRIPT LOAD
        // (routed to every master in a Cluster) then EVALSHA again.
        match self {
            Connection::Single(connection) => {
                invocation.invoke_async(&mut connection.clone()).await
            }
            Connection::Cluster(nodes) => invocation.invoke_async(&mut nodes.routed(key)).await,
            Connection::Sentinel(sentinel) => {
                let (generation, mut connection) = sentinel.connection().await?;
                let answer = invocation.invoke_async(&mut connection).await;
                if let Err(error) = &answer {
                    sentinel.failed(generation, error);
                }
                answer
            }
        }
    }

    /// A Cluster's `CLUSTER SLOTS`, read by the core: where each slot's
    /// requests go from now on.
    pub(super) fn learn_slots(&self, reply: &Value) {
        if let Connection::Cluster(nodes) = self {
            if let Err(error) = nodes.learn(reply) {
                tracing::warn!(%error, "cannot read the Redis Cluster's slot map");
            }
        }
    }

    /// A request of the core's timed out: a Sentinel connection is dropped,
    /// since its primary may be gone without a word (the other kinds
    /// reconnect by themselves).
    pub(super) fn timed_out(&self) {
        if let Connection::Sentinel(sentinel) = self {
            sentinel.forget_current();
        }
    }

    /// Sends a command to the node serving `key` (any node for `None`).
    pub(super) async fn query<T: FromRedisValue>(
        &self,
        key: Option<&str>,
        command: &Cmd,
    ) -> RedisResult<T> {
        match self {
            Connection::Single(connection) => command.query_async(&mut connection.clone()).await,
            Connection::Cluster(nodes) => command.query_async(&mut nodes.routed(key)).await,
            Connection::Sentinel(sentinel) => {
                let (generation, mut connection) = sentinel.connection().await?;
                let answer = command.query_async(&mut connection).await;
                if let Err(error) = &answer {
                    sentinel.failed(generation, error);
                }
                answer
            }
        }
    }

    async fn load(&self, script: &Script) -> RedisResult<String> {
        match self {
            Connection::Single(connection) => script.load_async(&mut connection.clone()).await,
            // Every node loads every script before its first request.
            Connection::Cluster(_) => Ok(script.get_hash().to_owned()),
            Connection::Sentinel(sentinel) => {
                let (generation, mut connection) = sentinel.connection().await?;
                let answer = script.load_async(&mut connection).await;
                if let Err(error) = &answer {
                    sentinel.failed(generation, error);
                }
                answer
            }
        }
    }
}

/// The URL's connection details with the configured user, password and
/// verification applied. The one place the password leaves its
/// `RedisUrl` or `RedisPassword`: to connect.
fn connection_info(url: &RedisUrl, access: &RedisAccess) -> RedisResult<ConnectionInfo> {
    let mut info = url.expose_credentials().into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &access.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = &access.password {
        settings = settings.set_password(password.expose());
    }
    info = info
        .set_redis_settings(settings)
        .set_tcp_settings(tcp_settings());
    if access.tls.insecure_skip_verify {
        if let ConnectionAddr::TcpTls {
            host,
            port,
            tls_params,
            ..
        } = info.addr().clone()
        {
            info = info.set_addr(ConnectionAddr::TcpTls {
                host,
                port,
                insecure: true,
                tls_params,
            });
        }
    }
    Ok(info)
}

fn single_client(url: &RedisUrl, access: &RedisAccess) -> RedisResult<Client> {
    let info = connection_info(url, access)?;
    if url.is_tls() {
        Client::build_with_tls(info, certificates(&access.tls))
    } else {
        Client::open(info)
    }
}

async fn open(config: &RedisConfig, scripts: &Scripts) -> Result<Connection, RedisStoreError> {
    let Some(first) = config.urls.first() else {
        return Err(RedisStoreError::Reply("no Redis URL configured".into()));
    };
    let access = &config.access;
    if let Some(sentinel) = &access.sentinel {
        let connection =
            Connection::Sentinel(SentinelConnection::new(config, &sentinel.master_name)?);
        let info = text_of(
            &connection
                .query::<Value>(None, &::redis::cmd("INFO"))
                .await?,
        );
        check_version(&info)?;
        return Ok(connection);
    }
    // One URL may still name a Cluster node: INFO says so.
    if config.urls.len() == 1 {
        let client = single_client(first, access)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200))
            .set_number_of_retries(6)
            // redis-rs's own default is 500 ms; the store's deadline
            // decides, so this only has to be no shorter than it.
            .set_response_timeout(Some(config.timeout.max(Duration::from_millis(100))));
        let manager = ConnectionManager::new_with_config(client, manager_config).await?;
        let connection = Connection::Single(manager);
        let info = text_of(
            &connection
                .query::<Value>(None, &::redis::cmd("INFO"))
                .await?,
        );
        check_version(&info)?;
        if !info.contains("cluster_enabled:1") {
            return Ok(connection);
        }
    }
    // A Cluster: a connection per node, retryd's own (see `cluster.rs`).
    let template = connection_info(first, access)?;
    let seeds = config
        .urls
        .iter()
        .map(|url| {
            let info = connection_info(url, access)?;
            Ok(match info.addr() {
                ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                    format!("{host}:{port}")
                }
                other => other.to_string(),
            })
        })
        .collect::<RedisResult<Vec<_>>>()?;
    let connect = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(config.timeout.max(Duration::from_millis(100))));
    let nodes = ClusterNodes::new(
        seeds,
        template,
        first.is_tls().then(|| access.tls.clone()),
        connect,
        scripts.all().into_iter().cloned().collect(),
    );
    // Every master, each with its own INFO.
    for info in nodes.discover().await? {
        check_version(&text_of(&info))?;
    }
    Ok(Connection::Cluster(nodes))
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
                needed: MIN_VERSION,
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
