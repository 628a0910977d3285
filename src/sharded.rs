//! Counters and histograms the request path writes without sharing a cache line between worker
//! threads: one slot per thread (threads take slots in turn as they first count), summed when
//! Prometheus scrapes.
//!
//! prometheus-client's `Counter` is one atomic and its `Histogram` a mutex, both written by every
//! worker for every request: each write then first has to take the line back from the core that
//! wrote it last. Here each worker writes its own line, and only a scrape reads them all.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Slots per metric: one per core and one more (for the control thread and tests), at most 16,
/// as each takes a cache line (64 bytes) in every counter. Threads beyond that share slots:
/// still correct, only contended again, by a few threads instead of all.
static SLOTS: LazyLock<usize> = LazyLock::new(|| {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get() + 1)
        .min(16)
});

/// How many slots each metric has.
pub(crate) fn slots() -> usize {
    *SLOTS
}

/// This thread's slot.
pub(crate) fn slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static SLOT: Cell<Option<usize>> = const { Cell::new(None) });
    SLOT.with(|s| {
        s.get().unwrap_or_else(|| {
            let n = NEXT.fetch_add(1, Ordering::Relaxed) % *SLOTS;
            s.set(Some(n));
            n
        })
    })
}

/// One thread's counter, on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Line(AtomicU64);

/// A Prometheus counter written per thread.
#[derive(Debug, Clone)]
pub struct Counter(Arc<[Line]>);

impl Default for Counter {
    fn default() -> Self {
        Self((0..*SLOTS).map(|_| Line::default()).collect())
    }
}

impl Counter {
    pub fn inc(&self) {
        self.0[slot()].0.fetch_add(1, Ordering::Relaxed);
    }

    /// The total over all threads.
    pub fn get(&self) -> u64 {
        self.0.iter().map(|l| l.0.load(Ordering::Relaxed)).sum()
    }
}

impl TypedMetric for Counter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for Counter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// One thread's observations: the sum (an `f64`'s bits) and a count per bucket, each on a line of
/// its own (few histograms exist: one per upstream, and the Redis checks').
#[derive(Debug)]
struct Observations {
    sum: Line,
    buckets: Box<[Line]>,
}

/// A Prometheus histogram (classic buckets) written per thread.
#[derive(Debug, Clone)]
pub struct Histogram {
    /// Upper bounds, the last one `+Inf`.
    bounds: Arc<[f64]>,
    slots: Arc<[Observations]>,
}

impl Histogram {
    /// A histogram with these upper bounds, and `+Inf`.
    pub fn new(bounds: impl Iterator<Item = f64>) -> Self {
        let bounds: Arc<[f64]> = bounds.chain(std::iter::once(f64::INFINITY)).collect();
        let slots = (0..*SLOTS)
            .map(|_| Observations {
                sum: Line(AtomicU64::new(0f64.to_bits())),
                buckets: bounds.iter().map(|_| Line::default()).collect(),
            })
            .collect();
        Self { bounds, slots }
    }

    pub fn observe(&self, v: f64) {
        let mine = &self.slots[slot()];
        // Only this thread writes its slot (bar slot sharing): the update succeeds at once.
        let _ = mine
            .sum
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((f64::from_bits(s) + v).to_bits())
            });
        // NaN counts in the last bucket, as prometheus-client counts it.
        let i = self
            .bounds
            .iter()
            .position(|b| *b >= v)
            .unwrap_or(self.bounds.len() - 1);
        mine.buckets[i].0.fetch_add(1, Ordering::Relaxed);
    }

    /// Sum, count and per-bucket counts over all threads.
    fn totals(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut sum = 0.0;
        let mut buckets: Vec<(f64, u64)> = self.bounds.iter().map(|b| (*b, 0)).collect();
        for s in self.slots.iter() {
            sum += f64::from_bits(s.sum.0.load(Ordering::Relaxed));
            for (total, n) in buckets.iter_mut().zip(s.buckets.iter()) {
                total.1 += n.0.load(Ordering::Relaxed);
            }
        }
        let count = buckets.iter().map(|b| b.1).sum();
        (sum, count, buckets)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.totals();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn counts_from_many_threads_add_up() {
        let c = Counter::default();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| (0..1000).for_each(|_| c.inc()));
            }
        });
        assert_eq!(c.get(), 8000);
        let mut r = Registry::default();
        r.register("hits", "Hits", c.clone());
        assert!(text(&r).contains("hits_total 8000\n"), "{}", text(&r));
    }

    #[test]
    fn a_histogram_encodes_as_prometheus_client_would() {
        let ours = Histogram::new([0.1, 1.0].into_iter());
        let theirs = prometheus_client::metrics::histogram::Histogram::new([0.1, 1.0]);
        std::thread::scope(|s| {
            for v in [0.05, 0.1, 0.5, 2.0, f64::NAN, 0.7] {
                let ours = &ours;
                s.spawn(move || ours.observe(v));
                theirs.observe(v);
            }
        });
        let mut a = Registry::default();
        // NaN makes both sums NaN; the rest of the text must be the same.
        a.register("lat", "Latency", ours.clone());
        let mut b = Registry::default();
        b.register("lat", "Latency", theirs);
        assert_eq!(text(&a), text(&b));
        assert!(
            text(&a).contains("lat_bucket{le=\"+Inf\"} 6\n"),
            "{}",
            text(&a)
        );
    }

    #[test]
    fn works_in_a_family() {
        let f: Family<Vec<(String, String)>, Counter> = Family::default();
        f.get_or_create(&vec![("route".into(), "a".into())]).inc();
        f.get_or_create(&vec![("route".into(), "a".into())]).inc();
        let mut r = Registry::default();
        r.register("requests", "Requests", f);
        assert!(
            text(&r).contains("requests_total{route=\"a\"} 2\n"),
            "{}",
            text(&r)
        );
    }
}
