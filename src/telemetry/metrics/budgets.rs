//! The budgets the `/metrics` gauges show: a snapshot of the store's
//! `list`, refreshed at most once per [`BUDGET_GAUGES_INTERVAL`] and by one
//! scrape at a time, so that scrapers (anonymous, on a port with no
//! authentication) cannot make the store list every upstream once per
//! request. With Redis that was three commands per upstream per scrape.
//!
//! It holds no store: the caller passes the listing to run. It must not be
//! used on the decision path.

use std::future::Future;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::budget::BudgetSnapshot;

/// How old a snapshot may be before a scrape refreshes it.
pub const BUDGET_GAUGES_INTERVAL: Duration = Duration::from_secs(5);

/// The last listing of the budgets, and the lock of the scrape that lists.
#[derive(Debug, Default)]
pub struct BudgetGauges {
    /// Held by the one scrape that lists.
    listing: Mutex<()>,
    /// The last listing and when it was taken. A plain lock, never held
    /// across an await: scrapes read it while another lists.
    last: std::sync::Mutex<Option<Listing>>,
}

/// When a listing was taken, and what it said.
type Listing = (Instant, Arc<Vec<BudgetSnapshot>>);

impl BudgetGauges {
    /// No snapshot yet: the first scrape lists.
    pub fn new() -> BudgetGauges {
        BudgetGauges::default()
    }

    /// The last listing, if it is younger than `interval` (or any age,
    /// with `None`).
    fn last(&self, interval: Option<Duration>) -> Option<Arc<Vec<BudgetSnapshot>>> {
        let last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let (taken, budgets) = last.as_ref()?;
        match interval {
            Some(interval) if taken.elapsed() >= interval => None,
            _ => Some(Arc::clone(budgets)),
        }
    }

    /// The budgets to render. Lists (by running `list`) only when the
    /// snapshot is older than the interval; while one scrape lists, the
    /// others render the previous snapshot rather than wait or list too
    /// (the first scrapes, with none yet, wait for the one listing). A
    /// failed listing keeps the previous snapshot until the next interval.
    pub async fn budgets<F, Fut, E>(&self, list: F) -> Arc<Vec<BudgetSnapshot>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<BudgetSnapshot>, E>>,
        E: std::fmt::Display,
    {
        if let Some(fresh) = self.last(Some(BUDGET_GAUGES_INTERVAL)) {
            return fresh;
        }
        let _listing = match self.listing.try_lock() {
            Ok(listing) => listing,
            Err(_) => match self.last(None) {
                Some(previous) => return previous,
                None => self.listing.lock().await,
            },
        };
        // Another scrape may have listed while this one waited.
        if let Some(fresh) = self.last(Some(BUDGET_GAUGES_INTERVAL)) {
            return fresh;
        }
        let taken = Instant::now();
        let budgets = match list().await {
            Ok(budgets) => Arc::new(budgets),
            Err(error) => {
                tracing::debug!(%error, "cannot list the budgets for /metrics; showing the last listing");
                self.last(None).unwrap_or_default()
            }
        };
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((taken, Arc::clone(&budgets)));
        budgets
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn snapshot(tokens: f64) -> Vec<BudgetSnapshot> {
        vec![BudgetSnapshot {
            upstream: "a".into(),
            tokens,
            retries_enabled: true,
            tracked: true,
            shared_unavailable: false,
            pushback_remaining: None,
            adaptive_level: 1.0,
            ramp_elapsed: None,
        }]
    }

    #[tokio::test(start_paused = true)]
    async fn lists_at_most_once_per_interval_and_one_at_a_time() {
        let gauges = Arc::new(BudgetGauges::new());
        let listings = Arc::new(AtomicUsize::new(0));
        let list = |listings: Arc<AtomicUsize>| async move {
            let n = listings.fetch_add(1, Ordering::SeqCst);
            // A slow store: every concurrent scrape overlaps this one.
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, String>(snapshot(n as f64))
        };
        let scrapes: Vec<_> = (0..50)
            .map(|_| {
                let (gauges, listings) = (Arc::clone(&gauges), Arc::clone(&listings));
                tokio::spawn(async move { gauges.budgets(|| list(listings)).await })
            })
            .collect();
        for scrape in scrapes {
            assert_eq!(scrape.await.unwrap()[0].tokens, 0.0);
        }
        assert_eq!(
            listings.load(Ordering::SeqCst),
            1,
            "50 scrapes, one listing"
        );
        tokio::time::advance(BUDGET_GAUGES_INTERVAL).await;
        let fresh = gauges.budgets(|| list(Arc::clone(&listings))).await;
        assert_eq!(fresh[0].tokens, 1.0, "refreshed after the interval");
        // While one scrape lists (slowly), another renders the last
        // snapshot at once.
        tokio::time::advance(BUDGET_GAUGES_INTERVAL).await;
        let slow = {
            let (gauges, listings) = (Arc::clone(&gauges), Arc::clone(&listings));
            tokio::spawn(async move { gauges.budgets(|| list(listings)).await })
        };
        tokio::task::yield_now().await;
        let started = Instant::now();
        let meanwhile = gauges.budgets(|| list(Arc::clone(&listings))).await;
        assert_eq!(started.elapsed(), Duration::ZERO, "no wait for the listing");
        assert_eq!(meanwhile[0].tokens, 1.0);
        assert_eq!(slow.await.unwrap()[0].tokens, 2.0);
        // A failed listing shows the last one.
        tokio::time::advance(BUDGET_GAUGES_INTERVAL).await;
        let kept = gauges
            .budgets(|| async { Err::<Vec<BudgetSnapshot>, _>("down") })
            .await;
        assert_eq!(kept[0].tokens, 2.0);
    }
}
