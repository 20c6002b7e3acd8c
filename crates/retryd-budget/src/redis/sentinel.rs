//! A primary watched by Redis Sentinel: one multiplexed connection to the
//! primary the sentinels name, dropped when it fails (an I/O error, a
//! dropped connection, `READONLY` from a demoted primary, or a timeout the
//! core reports), so that the next request asks the sentinels again and
//! follows the failover. It neither times requests out nor retries them:
//! the core does (`shared.rs`), so Sentinel keeps the same deadlines,
//! circuit and fallback as the other topologies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ErrorKind, IntoConnectionInfo, RedisError,
    RedisResult, TlsMode,
};

use super::config::RedisConfig;
use super::socket::{certificates, tcp_settings};
use super::url::RedisUrl;

/// The primary's connection, shared by every clone.
#[derive(Clone)]
pub(super) struct SentinelConnection {
    inner: Arc<Inner>,
}

struct Inner {
    /// Asks the sentinels; one task at a time (it holds connections to
    /// them).
    client: tokio::sync::Mutex<SentinelClient>,
    /// The primary's connection and its generation, `None` after a failure.
    current: RwLock<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    connect: AsyncConnectionConfig,
    /// The first sentinel, reached with its own credentials, to tell whose
    /// password was refused when connecting fails to authenticate.
    first_sentinel: Client,
}

impl SentinelConnection {
    /// A client for the sentinels in `config.urls`, watching
    /// `master_name`. Connects nothing yet.
    pub(super) fn new(config: &RedisConfig, master_name: &str) -> RedisResult<SentinelConnection> {
        let access = &config.access;
        let first_sentinel = sentinel_client(config)?;
        let mut sentinels = Vec::new();
        let mut sentinel_auth = None;
        for url in &config.urls {
            let info = url.expose_credentials().into_connection_info()?;
            let settings = info.redis_settings();
            if let Some(password) = settings.password() {
                sentinel_auth = Some((settings.username().map(str::to_owned), password.to_owned()));
            }
            sentinels.push(info.addr().clone());
        }
        let tls = config.urls.iter().any(RedisUrl::is_tls);
        let mut builder =
            SentinelClientBuilder::new(sentinels, master_name, SentinelServerType::Master)?
                .set_client_to_sentinel_tcp_settings(tcp_settings())
                .set_client_to_redis_tcp_settings(tcp_settings());
        if let Some((username, password)) = sentinel_auth {
            if let Some(username) = username {
                builder = builder.set_client_to_sentinel_username(username);
            }
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(username) = &access.username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = &access.password {
            builder = builder.set_client_to_redis_password(password.expose());
        }
        if tls {
            // The sentinels and the nodes they name are reached alike: one
            // scheme, one CA, one client certificate.
            let mode = if access.tls.insecure_skip_verify {
                TlsMode::Insecure
            } else {
                TlsMode::Secure
            };
            builder = builder
                .set_client_to_sentinel_tls_mode(mode)
                .set_client_to_redis_tls_mode(mode)
                .set_client_to_sentinel_certificates(certificates(&access.tls))
                .set_client_to_redis_certificates(certificates(&access.tls));
        }
        let connect = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(config.timeout.max(Duration::from_millis(100))));
        Ok(SentinelConnection {
            inner: Arc::new(Inner {
                client: tokio::sync::Mutex::new(builder.build()?),
                current: RwLock::new(None),
                generation: AtomicU64::new(0),
                connect,
                first_sentinel,
            }),
        })
    }

    /// The primary's connection: the current one, or a new one to the
    /// primary the sentinels name now.
    pub(super) async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let mut client = self.inner.client.lock().await;
        // Another task may have connected while this one waited.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let connection = match client
            .get_async_connection_with_config(&self.inner.connect)
            .await
        {
            Ok(connection) => connection,
            Err(error) if error.kind() == ErrorKind::AuthenticationFailed => {
                return Err(self.whose_password(error).await);
            }
            Err(error) => return Err(error),
        };
        let generation = self.inner.generation.fetch_add(1, Ordering::AcqRel) + 1;
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some((generation, connection.clone()));
        Ok((generation, connection))
    }

    /// A refused password, said to be the sentinels' (from their URLs) or
    /// the data nodes' (`store.username`, `store.password*`): both fail
    /// alike inside redis-rs, so the first sentinel is asked again, alone.
    async fn whose_password(&self, error: RedisError) -> RedisError {
        let sentinel = self
            .inner
            .first_sentinel
            .get_multiplexed_async_connection_with_config(&self.inner.connect)
            .await;
        let whose = match sentinel {
            Err(refused) if refused.kind() == ErrorKind::AuthenticationFailed => {
                "a sentinel refused the password of the sentinels' URLs"
            }
            _ => {
                "the primary the sentinels name refused the data nodes' credentials \
                 (store.username, store.password)"
            }
        };
        RedisError::from((
            ErrorKind::AuthenticationFailed,
            "Authentication failed",
            format!("{whose}: {error}"),
        ))
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// After `error` on the connection of `generation`: forgets it if the
    /// error says the primary may have moved.
    pub(super) fn failed(&self, generation: u64, error: &RedisError) {
        let moved = error.is_io_error()
            || error.is_connection_dropped()
            || error.is_unrecoverable_error()
            || error.is_timeout()
            || error.code() == Some("READONLY");
        if moved {
            self.forget(generation);
        }
    }

    /// Forgets the connection of `generation` (not a newer one).
    pub(super) fn forget(&self, generation: u64) {
        let mut current = self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if current
            .as_ref()
            .is_some_and(|(known, _)| *known == generation)
        {
            *current = None;
        }
    }

    /// Forgets whatever connection is current (a request on it timed out).
    pub(super) fn forget_current(&self) {
        let mut current = self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *current = None;
    }
}

/// The first sentinel as its URL names it (with its password), over TLS
/// as the sentinel client reaches it.
fn sentinel_client(config: &RedisConfig) -> RedisResult<Client> {
    let Some(url) = config.urls.first() else {
        return Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "no sentinel URL configured",
        )));
    };
    let mut info = url
        .expose_credentials()
        .into_connection_info()?
        .set_tcp_settings(tcp_settings());
    if !url.is_tls() {
        return Client::open(info);
    }
    if config.access.tls.insecure_skip_verify {
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
    Client::build_with_tls(info, certificates(&config.access.tls))
}
