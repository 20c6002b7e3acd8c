//! Where each open connection stands, shared by the accept loop and the
//! request path: handshaking, then unproven (past its handshake, no call
//! authenticated yet), then authenticated; how many calls it has open, and
//! since when it has had none.
//!
//! The [`Registry`] holds every open connection and makes room at the
//! bounds. `server.max_connections` alone let anonymous peers lock every
//! new caller out: a connection kept its permit until it closed, and an
//! HTTP/2 connection with no stream lives as long as it answers PINGs. So
//! at the bound (or at `server.max_connections_per_address` for one
//! address) a newcomer is not refused while some connection can go
//! instead: the oldest that has not sent a byte, else the first to speak
//! that has not authenticated, else the one idle longest. Only when every
//! connection is authenticated and busy is the newcomer closed. A caller
//! that authenticates is safe from eviction once it has made its first
//! call; before that, every silent connection and every connection that
//! spoke before it goes first.
//!
//! This module decides nothing about credentials: the request path says a
//! connection authenticated ([`Standing::authenticated`]).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use tokio::time::Instant;

const HANDSHAKING: u8 = 0;
const UNPROVEN: u8 = 1;
const AUTHENTICATED: u8 = 2;

/// Connections being closed to make room at once, at most: each is gone a
/// moment after it is told, but until then it still holds a descriptor,
/// which the file limit's reserve for everything else pays for. Past it,
/// the accept loop waits for one to go ([`Registry::evicted`]) rather
/// than refusing the newcomer.
const MAX_EVICTING: usize = 16;

/// One connection's standing.
#[derive(Debug)]
pub struct Standing {
    id: u64,
    remote_ip: IpAddr,
    /// When it was accepted; the times below count from here.
    accepted: Instant,
    state: AtomicU8,
    open_calls: AtomicU32,
    /// When it last had no call open, milliseconds after `accepted`.
    idle_since: AtomicU64,
    /// Set to close it: evicted, or past one of its deadlines.
    closing: AtomicBool,
    /// Set under the registry's lock when the registry chose to evict it.
    evicted: AtomicBool,
    /// Set under the registry's lock when its first bytes arrived.
    spoke: AtomicBool,
    /// The task that reads the connection (its handshake first), woken to
    /// close it.
    reader: AtomicWaker,
}

/// What a connection must do by when, once past its handshake.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadlines {
    /// Make a call that authenticates within this of its handshake; `None`
    /// when calls need no credential (no `[auth]`).
    pub(super) authenticate: Option<Duration>,
    /// Be closed after this long with no call open.
    pub(super) idle: Duration,
}

impl Standing {
    /// Marks the connection as having made a call that authenticated (the
    /// request path calls it for every such call; only the first writes).
    pub fn authenticated(&self) {
        if self.state.load(Ordering::Relaxed) != AUTHENTICATED {
            self.state.store(AUTHENTICATED, Ordering::Relaxed);
        }
    }

    /// Whether a call on it has authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.state.load(Ordering::Relaxed) == AUTHENTICATED
    }

    /// A call began on it; the call is counted open until the returned
    /// guard drops (with the response's body).
    pub fn call_opened(self: &Arc<Self>) -> OpenCall {
        self.open_calls.fetch_add(1, Ordering::Relaxed);
        OpenCall(Arc::clone(self))
    }

    pub(super) fn handshake_done(&self) {
        let _ = self.state.compare_exchange(
            HANDSHAKING,
            UNPROVEN,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.idle_since.store(
            self.millis_since_accepted(Instant::now()),
            Ordering::Relaxed,
        );
    }

    fn millis_since_accepted(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.accepted).as_millis()).unwrap_or(u64::MAX)
    }

    fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.reader.wake();
    }

    /// Ready once the connection is to be closed; registers the reading
    /// task to be woken then.
    pub(super) fn poll_closing(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.reader.register(cx.waker());
        if self.is_closing() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// At `now`, for a connection past its handshake at `ready`: `None` if
    /// it must be closed (marked closing), else when to look again.
    pub(super) fn next_check(
        &self,
        now: Instant,
        ready: Instant,
        deadlines: Deadlines,
    ) -> Option<Instant> {
        if self.is_closing() {
            return None;
        }
        // While calls are open it cannot be idle; look again in a period.
        let mut next = now + deadlines.idle;
        if let Some(authenticate) = deadlines.authenticate {
            if !self.is_authenticated() {
                let by = ready + authenticate;
                if now >= by {
                    tracing::debug!(remote_ip = %self.remote_ip, "connection closed: no call authenticated in time (server.authenticate_timeout)");
                    self.closing.store(true, Ordering::Release);
                    return None;
                }
                next = next.min(by);
            }
        }
        if self.open_calls.load(Ordering::Acquire) == 0 {
            let idle_since = Duration::from_millis(self.idle_since.load(Ordering::Acquire));
            let by = self.accepted + idle_since + deadlines.idle;
            if now >= by {
                tracing::debug!(remote_ip = %self.remote_ip, "connection closed: idle (server.idle_timeout)");
                self.closing.store(true, Ordering::Release);
                return None;
            }
            next = next.min(by);
        }
        Some(next)
    }
}

/// A call counted open on its connection until dropped.
#[derive(Debug)]
pub struct OpenCall(Arc<Standing>);

impl Drop for OpenCall {
    fn drop(&mut self) {
        let standing = &self.0;
        // Idle from now if this was the last call: written before the count
        // falls, so that a check seeing no call open sees this time.
        standing.idle_since.store(
            standing.millis_since_accepted(Instant::now()),
            Ordering::Release,
        );
        standing.open_calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Every open connection, and the bounds on them.
#[derive(Debug)]
pub(super) struct Registry {
    inner: Mutex<Open>,
    /// Told when an evicted connection has gone.
    evicted: tokio::sync::Notify,
}

#[derive(Debug)]
struct Open {
    max: usize,
    max_per_address: usize,
    next_id: u64,
    /// Told to close to make room, not yet gone.
    evicting: usize,
    by_id: HashMap<u64, Arc<Standing>>,
    by_address: HashMap<IpAddr, usize>,
    /// Connections that have not sent a byte, in the order they were
    /// accepted, those that have spoken, authenticated or closed dropped
    /// lazily from the front: the first candidates for eviction.
    silent: VecDeque<Arc<Standing>>,
    /// Connections that have spoken but not authenticated, in the order
    /// they spoke, likewise: the next candidates. A caller is at risk of
    /// eviction only between its first byte and its first call, and while
    /// silent connections are left it is not at risk at all, however fast
    /// an attacker opens them (with `client_auth = "required"` an attacker
    /// without a certificate can hold places only by saying nothing).
    spoken: VecDeque<Arc<Standing>>,
}

/// Why a new connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// `server.max_connections`, every connection authenticated and busy.
    Connections,
    /// `server.max_connections_per_address`, likewise for its address.
    Address,
    /// At a bound with [`MAX_EVICTING`] connections still going: wait for
    /// one ([`Registry::evicted`]) and ask again.
    Evicting,
}

impl Registry {
    pub(super) fn new(max: usize, max_per_address: usize) -> Registry {
        Registry {
            inner: Mutex::new(Open {
                max,
                max_per_address,
                next_id: 0,
                evicting: 0,
                by_id: HashMap::new(),
                by_address: HashMap::new(),
                silent: VecDeque::new(),
                spoken: VecDeque::new(),
            }),
            evicted: tokio::sync::Notify::new(),
        }
    }

    /// Completes when an evicted connection has gone (or has gone since
    /// the last call), making room.
    pub(super) async fn evicted(&self) {
        self.evicted.notified().await;
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        // Nothing panics while holding it; a poisoned lock still holds
        // consistent counts.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a connection from `remote_ip`, evicting another to make room
    /// at a bound; refused only when no connection can go.
    pub(super) fn admit(self: &Arc<Self>, remote_ip: IpAddr) -> Result<Slot, Full> {
        let mut open = self.lock();
        let from_address = open.by_address.get(&remote_ip).copied().unwrap_or(0);
        let staying = open.by_id.len() - open.evicting;
        let full = if from_address >= open.max_per_address {
            Some(Full::Address)
        } else if staying >= open.max {
            Some(Full::Connections)
        } else {
            None
        };
        if let Some(full) = full {
            let among = (full == Full::Address).then_some(remote_ip);
            if open.evicting >= MAX_EVICTING {
                return Err(Full::Evicting);
            }
            let victim = open.victim(among).ok_or(full)?;
            victim.evicted.store(true, Ordering::Relaxed);
            victim.close();
            open.evicting += 1;
            tracing::debug!(evicted = %victim.remote_ip, authenticated = victim.is_authenticated(), ?full, "connection evicted to make room");
        }
        let id = open.next_id;
        open.next_id += 1;
        let standing = Arc::new(Standing {
            id,
            remote_ip,
            accepted: Instant::now(),
            state: AtomicU8::new(HANDSHAKING),
            open_calls: AtomicU32::new(0),
            idle_since: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            spoke: AtomicBool::new(false),
            reader: AtomicWaker::new(),
        });
        open.by_id.insert(id, Arc::clone(&standing));
        *open.by_address.entry(remote_ip).or_default() += 1;
        open.silent.push_back(Arc::clone(&standing));
        open.compact();
        Ok(Slot {
            registry: Arc::clone(self),
            standing,
            made_room: full,
        })
    }
}

impl Open {
    /// Connections that moved on behind an old one are not popped from a
    /// queue's front: drop them now and then, so that each queue stays
    /// within a small multiple of the bound.
    fn compact(&mut self) {
        let bound = 2 * self.max + 64;
        if self.silent.len() > bound {
            self.silent.retain(|standing| is_silent(standing));
        }
        if self.spoken.len() > bound {
            self.spoken.retain(|standing| is_unproven(standing));
        }
    }

    /// The connection to close to make room (from `address` only, if
    /// given): the oldest that has said nothing, else the one that spoke
    /// first without authenticating, else the one idle longest.
    fn victim(&mut self, address: Option<IpAddr>) -> Option<Arc<Standing>> {
        let matches = |standing: &Standing| address.is_none_or(|ip| standing.remote_ip == ip);
        for (queue, candidate) in [
            (&mut self.silent, is_silent as fn(&Standing) -> bool),
            (&mut self.spoken, is_unproven),
        ] {
            while queue.front().is_some_and(|front| !candidate(front)) {
                queue.pop_front();
            }
            if let Some(position) = queue
                .iter()
                .position(|standing| candidate(standing) && matches(standing))
            {
                return queue.remove(position);
            }
        }
        // Every candidate has authenticated: only here is the whole table
        // walked, which an anonymous flood cannot bring about.
        self.by_id
            .values()
            .filter(|standing| {
                !standing.is_closing()
                    && standing.open_calls.load(Ordering::Acquire) == 0
                    && matches(standing)
            })
            .min_by_key(|standing| {
                standing.accepted
                    + Duration::from_millis(standing.idle_since.load(Ordering::Acquire))
            })
            .cloned()
    }
}

/// Open, not authenticated.
fn is_unproven(standing: &Standing) -> bool {
    !standing.is_authenticated() && !standing.is_closing()
}

/// Open, not authenticated, and not a byte received.
fn is_silent(standing: &Standing) -> bool {
    is_unproven(standing) && !standing.spoke.load(Ordering::Relaxed)
}

/// A connection's place in the registry, given back when dropped.
#[derive(Debug)]
pub(super) struct Slot {
    registry: Arc<Registry>,
    standing: Arc<Standing>,
    /// The bound at which another connection was evicted to admit this one.
    made_room: Option<Full>,
}

impl Slot {
    pub(super) fn standing(&self) -> &Arc<Standing> {
        &self.standing
    }

    /// Its first bytes have arrived: it moves behind the silent connections
    /// in the order of eviction.
    pub(super) fn spoke(&self) {
        let mut open = self.registry.lock();
        if !self.standing.spoke.swap(true, Ordering::Relaxed) && is_unproven(&self.standing) {
            open.spoken.push_back(Arc::clone(&self.standing));
            open.compact();
        }
    }

    /// The bound that was full when this connection was admitted, if one
    /// was: another connection was evicted to make room.
    pub(super) fn made_room(&self) -> Option<Full> {
        self.made_room
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let standing = &self.standing;
        standing.closing.store(true, Ordering::Release);
        let mut open = self.registry.lock();
        open.by_id.remove(&standing.id);
        if let Some(count) = open.by_address.get_mut(&standing.remote_ip) {
            *count -= 1;
            if *count == 0 {
                open.by_address.remove(&standing.remote_ip);
            }
        }
        if standing.evicted.load(Ordering::Relaxed) {
            open.evicting -= 1;
            drop(open);
            self.registry.evicted.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn at_the_bound_the_oldest_unproven_connection_makes_room() {
        let registry = Arc::new(Registry::new(2, 100));
        let first = registry.admit(HERE).unwrap();
        let second = registry.admit(HERE).unwrap();
        first.standing().handshake_done();
        second.standing().handshake_done();
        second.standing().authenticated();
        let third = registry.admit(HERE).unwrap();
        assert!(first.standing().is_closing(), "the unproven one goes");
        assert!(!second.standing().is_closing());
        // The evicted connection still holds its place until it is gone,
        // and no more than that may be waiting.
        drop(first);
        third.standing().authenticated();
        // Both authenticated; one busy, one idle: the idle one goes.
        let _busy = third.standing().call_opened();
        let fourth = registry.admit(HERE).unwrap();
        assert!(second.standing().is_closing());
        assert!(!third.standing().is_closing());
        drop(second);
        fourth.standing().authenticated();
        let _busy_too = fourth.standing().call_opened();
        assert_eq!(registry.admit(HERE).unwrap_err(), Full::Connections);
    }

    #[tokio::test]
    async fn silent_connections_go_before_those_that_spoke() {
        let registry = Arc::new(Registry::new(2, 100));
        let caller = registry.admit(HERE).unwrap();
        let silent = registry.admit(HERE).unwrap();
        caller.spoke();
        let newcomer = registry.admit(HERE).unwrap();
        assert!(silent.standing().is_closing(), "the silent one goes first");
        assert!(!caller.standing().is_closing());
        drop(silent);
        newcomer.spoke();
        let _last = registry.admit(HERE).unwrap();
        assert!(caller.standing().is_closing(), "then the first to speak");
        assert!(!newcomer.standing().is_closing());
    }

    #[tokio::test]
    async fn one_address_makes_room_only_among_its_own() {
        let registry = Arc::new(Registry::new(10, 1));
        let other: IpAddr = "10.0.0.1".parse().unwrap();
        let theirs = registry.admit(other).unwrap();
        let mine = registry.admit(HERE).unwrap();
        let again = registry.admit(HERE).unwrap();
        assert!(mine.standing().is_closing());
        assert!(!theirs.standing().is_closing());
        again.standing().authenticated();
        let _busy = again.standing().call_opened();
        drop(mine);
        assert_eq!(registry.admit(HERE).unwrap_err(), Full::Address);
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_close_the_unproven_and_the_idle() {
        let registry = Arc::new(Registry::new(10, 10));
        let deadlines = Deadlines {
            authenticate: Some(Duration::from_secs(5)),
            idle: Duration::from_secs(300),
        };
        let slot = registry.admit(HERE).unwrap();
        let standing = slot.standing();
        standing.handshake_done();
        let ready = Instant::now();
        let next = standing.next_check(ready, ready, deadlines).unwrap();
        assert_eq!(next, ready + Duration::from_secs(5));
        assert!(standing.next_check(next, ready, deadlines).is_none());

        let slot = registry.admit(HERE).unwrap();
        let standing = slot.standing();
        standing.handshake_done();
        standing.authenticated();
        let call = standing.call_opened();
        tokio::time::advance(Duration::from_secs(400)).await;
        let now = Instant::now();
        assert!(standing.next_check(now, ready, deadlines).is_some(), "busy");
        drop(call);
        let next = standing.next_check(now, ready, deadlines).unwrap();
        assert_eq!(next, now + Duration::from_secs(300));
        assert!(standing.next_check(next, ready, deadlines).is_none());
    }
}
