//! Which part of Redis is believed reachable. One node or a primary under
//! Sentinel is one circuit; a Cluster has one circuit per master, found
//! through a slot map (`CLUSTER SLOTS`, refreshed by the background task),
//! so that a failed master opens only its own circuit and only the
//! upstreams whose slots it serves answer from their fallback, while every
//! other upstream stays shared. Each node's circuit re-probes on its own
//! and its state changes are logged once. Nothing here sends a request:
//! the core does (`shared.rs`) and the background task refreshes the map
//! (`shared/rounds.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;
// The store's one clock, tokio's (the same instant as `std` outside tests), so
// that a test pausing it moves probes, deadlines and caches together.
use tokio::time::Instant;

use ::redis::Value;

use super::circuit::{Circuit, Transition};
use super::slots::{SLOTS, parse_slots, slot};

/// The circuits of one store.
pub(super) struct Reachability {
    /// The whole store (one node, Sentinel), and a Cluster's requests that
    /// name no key, or whose slot's owner is not known yet.
    whole: Arc<Circuit>,
    /// A Cluster's slot map; `None` for one node or Sentinel.
    cluster: Option<RwLock<Option<Arc<SlotMap>>>>,
    opened: AtomicU64,
    origin: Instant,
    /// Milliseconds since `origin` of the last slot-map refresh claimed.
    refreshed: AtomicU64,
    /// Milliseconds since `origin` until which a Cluster is taken to be in
    /// a failover: a master was lost, or a slot changed owners, within
    /// `FAILOVER_AFTERMATH` before (0: never).
    failover_until: AtomicU64,
}

/// How long after a slot changed owners (a replica promoted, a slot moved)
/// the surviving masters are still taken to be busy with it: each learns
/// the new configuration by gossip, and saves it, with an `fsync` on its
/// main thread, when it does; the Cluster's bus spreads that over about a
/// second.
const FAILOVER_AFTERMATH: Duration = Duration::from_secs(5);

/// Who serves each slot, and each master's circuit.
struct SlotMap {
    /// Per slot, an index into `nodes` (`u16::MAX`: not served).
    owner: Vec<u16>,
    nodes: Vec<Node>,
}

/// One master of a Cluster.
pub(super) struct Node {
    /// `host:port`, as the Cluster names it.
    pub(super) address: String,
    /// Its slot ranges, for the log (`0-5460`).
    pub(super) slots: String,
    pub(super) circuit: Arc<Circuit>,
    /// A key in one of its slots, to route its probe there.
    pub(super) probe_key: String,
    served: usize,
}

/// The circuit a request goes through, and what to call it in the log.
pub(super) struct Route {
    pub(super) circuit: Arc<Circuit>,
    /// The Cluster node, if the request is routed to one.
    pub(super) node: Option<(String, String)>,
}

impl Reachability {
    pub(super) fn new(is_cluster: bool) -> Reachability {
        Reachability {
            whole: Arc::new(Circuit::new()),
            cluster: is_cluster.then(|| RwLock::new(None)),
            opened: AtomicU64::new(0),
            origin: Instant::now(),
            refreshed: AtomicU64::new(0),
            failover_until: AtomicU64::new(0),
        }
    }

    fn map(&self) -> Option<Arc<SlotMap>> {
        self.cluster
            .as_ref()?
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The circuit of the node serving `key`'s slot (the whole store's if
    /// not a Cluster, or the owner is unknown).
    pub(super) fn route(&self, key: Option<&str>) -> Route {
        if let (Some(key), Some(map)) = (key, self.map()) {
            let owner = map.owner[slot(key)];
            if let Some(node) = map.nodes.get(usize::from(owner)) {
                return Route {
                    circuit: Arc::clone(&node.circuit),
                    node: Some((node.address.clone(), node.slots.clone())),
                };
            }
        }
        Route {
            circuit: Arc::clone(&self.whole),
            node: None,
        }
    }

    /// True if the node serving `key` is believed reachable.
    pub(super) fn is_up_for(&self, key: &str) -> bool {
        self.route(Some(key)).circuit.is_up()
    }

    /// True while every part of the store is believed reachable.
    pub(super) fn is_up(&self) -> bool {
        self.fraction_up() >= 1.0
    }

    /// The share of the store believed reachable: of a Cluster's slots,
    /// those whose master's circuit is closed; else 1 or 0.
    pub(super) fn fraction_up(&self) -> f64 {
        let Some(map) = self.map() else {
            return if self.whole.is_up() { 1.0 } else { 0.0 };
        };
        let up: usize = map
            .nodes
            .iter()
            .filter(|node| node.circuit.is_up())
            .map(|node| node.served)
            .sum();
        up as f64 / SLOTS as f64
    }

    /// Counts a transition to down (for `StoreStats::outages`).
    pub(super) fn count(&self, transition: Transition) {
        if transition == Transition::Opened {
            self.opened.fetch_add(1, Ordering::Relaxed);
            if self.is_cluster() {
                self.note_failover();
            }
        }
    }

    pub(super) fn times_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Every circuit believed down whose probe is due and now claimed, with
    /// the key that routes a probe to it (`None`: the whole store).
    pub(super) fn claim_probes(&self) -> Vec<(Arc<Circuit>, Option<String>)> {
        let mut due = Vec::new();
        if !self.whole.is_up() && self.whole.claim_probe() {
            due.push((Arc::clone(&self.whole), None));
        }
        if let Some(map) = self.map() {
            for node in &map.nodes {
                if !node.circuit.is_up() && node.circuit.claim_probe() {
                    due.push((Arc::clone(&node.circuit), Some(node.probe_key.clone())));
                }
            }
        }
        due
    }

    /// True for a Cluster with a node believed down (the map is then
    /// refreshed more often, to see its replica promoted).
    pub(super) fn is_cluster_degraded(&self) -> bool {
        self.map()
            .is_some_and(|map| map.nodes.iter().any(|node| !node.circuit.is_up()))
    }

    /// True while a Cluster is failing over: a master is believed down, or
    /// one was lost or a slot changed owners within `FAILOVER_AFTERMATH`.
    /// Then every surviving master does the failover's work on its main
    /// thread (the vote for the promoted replica and the new configuration,
    /// each saved to `nodes.conf` with an `fsync`), and a live master's
    /// answer can miss the store timeout without the master being lost.
    pub(super) fn in_failover(&self) -> bool {
        let now = self.origin.elapsed().as_millis() as u64;
        self.is_cluster()
            && (self.is_cluster_degraded() || now < self.failover_until.load(Ordering::Acquire))
    }

    fn note_failover(&self) {
        let until = (self.origin.elapsed() + FAILOVER_AFTERMATH).as_millis() as u64;
        self.failover_until.fetch_max(until, Ordering::AcqRel);
    }

    /// True if the slot map was last refreshed at least `every` ago (and
    /// this caller is the one to refresh it now).
    pub(super) fn claim_refresh(&self, every: Duration) -> bool {
        let now = self.origin.elapsed().as_millis() as u64;
        let last = self.refreshed.load(Ordering::Acquire);
        now.saturating_sub(last) >= every.as_millis() as u64
            && self
                .refreshed
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    pub(super) fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Takes a `CLUSTER SLOTS` answer as the new map, keeping the circuit
    /// of every master that is still one; `prefix` names the probe keys.
    /// A master that no longer serves a slot is forgotten, circuit and all.
    pub(super) fn update(&self, reply: &Value, prefix: &str) -> Result<(), String> {
        let Some(lock) = &self.cluster else {
            return Ok(());
        };
        let ranges = parse_slots(reply)?;
        let previous = self.map();
        let mut owner = vec![u16::MAX; SLOTS];
        let mut nodes: Vec<Node> = Vec::new();
        for (start, end, address) in ranges {
            let index = match nodes.iter().position(|node| node.address == address) {
                Some(index) => index,
                None => {
                    let circuit = previous
                        .as_ref()
                        .and_then(|map| map.nodes.iter().find(|node| node.address == address))
                        .map(|node| Arc::clone(&node.circuit))
                        .unwrap_or_else(|| Arc::new(Circuit::new()));
                    nodes.push(Node {
                        address,
                        slots: String::new(),
                        circuit,
                        probe_key: String::new(),
                        served: 0,
                    });
                    nodes.len() - 1
                }
            };
            let node = &mut nodes[index];
            if !node.slots.is_empty() {
                node.slots.push(',');
            }
            node.slots.push_str(&format!("{start}-{end}"));
            owner[start..=end].fill(index as u16);
            node.served += end + 1 - start;
        }
        for (index, node) in nodes.iter_mut().enumerate() {
            node.probe_key = (0u64..)
                .map(|n| format!("{prefix}:{{probe:{n}}}"))
                .find(|key| usize::from(owner[slot(key)]) == index)
                .unwrap_or_default();
        }
        // A master believed down that serves nothing now was replaced (its
        // replica promoted): said once, here, since its circuit goes.
        for gone in previous.iter().flat_map(|map| map.nodes.iter()) {
            if !gone.circuit.is_up() && !nodes.iter().any(|node| node.address == gone.address) {
                tracing::info!(
                    node = %gone.address,
                    slots = %gone.slots,
                    "Redis Cluster node replaced by a promoted replica; the upstreams in its slots are shared again"
                );
            }
        }
        // A slot whose master changed: a promotion or a slot moved.
        fn address(nodes: &[Node], index: u16) -> Option<&str> {
            nodes
                .get(usize::from(index))
                .map(|node| node.address.as_str())
        }
        let moved = previous.as_ref().is_some_and(|map| {
            owner
                .iter()
                .zip(&map.owner)
                .any(|(&now, &before)| address(&nodes, now) != address(&map.nodes, before))
        });
        if moved {
            self.note_failover();
        }
        *lock.write().unwrap_or_else(PoisonError::into_inner) =
            Some(Arc::new(SlotMap { owner, nodes }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_keeps_the_circuits_of_masters_that_stay() {
        let reachability = Reachability::new(true);
        let entry = |start: i64, end: i64, port: i64| {
            Value::Array(vec![
                Value::Int(start),
                Value::Int(end),
                Value::Array(vec![
                    Value::BulkString(b"127.0.0.1".to_vec()),
                    Value::Int(port),
                ]),
            ])
        };
        let first = Value::Array(vec![entry(0, 8191, 7000), entry(8192, 16383, 7001)]);
        reachability.update(&first, "p").unwrap();
        assert_eq!(reachability.fraction_up(), 1.0);
        let route = reachability.route(Some("foo"));
        assert_eq!(route.node.as_ref().unwrap().0, "127.0.0.1:7001");
        route.circuit.failure();
        assert_eq!(reachability.fraction_up(), 0.5);
        assert!(!reachability.is_up_for("foo"));
        // 7001's slots move to 7002 (its replica promoted): shared again.
        let promoted = Value::Array(vec![entry(0, 8191, 7000), entry(8192, 16383, 7002)]);
        reachability.update(&promoted, "p").unwrap();
        assert_eq!(reachability.fraction_up(), 1.0);
        assert!(reachability.is_up_for("foo"));
        let map = reachability.map().unwrap();
        assert!(map.nodes.iter().all(|node| slot(&node.probe_key) < SLOTS));
        assert!(reachability.update(&Value::Int(1), "p").is_err());
    }

    #[test]
    fn a_lost_master_or_a_moved_slot_is_a_failover() {
        assert!(!Reachability::new(false).in_failover(), "one node");
        let reachability = Reachability::new(true);
        let entry = |start: i64, end: i64, port: i64| {
            Value::Array(vec![
                Value::Int(start),
                Value::Int(end),
                Value::Array(vec![
                    Value::BulkString(b"127.0.0.1".to_vec()),
                    Value::Int(port),
                ]),
            ])
        };
        let first = Value::Array(vec![entry(0, 8191, 7000), entry(8192, 16383, 7001)]);
        reachability.update(&first, "p").unwrap();
        assert!(!reachability.in_failover(), "the first map moves nothing");
        reachability.update(&first, "p").unwrap();
        assert!(!reachability.in_failover(), "nor does the same map again");
        // 7001 lost: a failover while its circuit is open...
        let route = reachability.route(Some("foo"));
        reachability.count(route.circuit.failure());
        assert!(reachability.in_failover());
        // ... and for FAILOVER_AFTERMATH after it, once it is replaced.
        let promoted = Value::Array(vec![entry(0, 8191, 7000), entry(8192, 16383, 7002)]);
        reachability.update(&promoted, "p").unwrap();
        assert!(reachability.is_up());
        assert!(reachability.in_failover());
        let other = Reachability::new(true);
        other.update(&first, "p").unwrap();
        other.update(&promoted, "p").unwrap();
        assert!(other.in_failover(), "a slot that changed owners");
        assert!(
            other.failover_until.load(Ordering::Acquire) >= FAILOVER_AFTERMATH.as_millis() as u64
        );
    }
}
