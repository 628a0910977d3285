//! The last ten minutes of counters, a sample a second, for the dashboard: each series keeps
//! the per-second increase of its counters in a ring.
//!
//! A series is named by its source and a (route, limit) pair, not by the runtime that counted
//! it, so it goes on across reloads; one no source reports for `SECONDS` is dropped.
//! Memory: `MAX_SERIES × channels × SECONDS × 4` bytes at most (256 series of 4 channels:
//! 2.4 MiB); a config of ten limits keeps about 100 KiB.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Samples kept per series: ten minutes of seconds.
pub const SECONDS: usize = 600;

/// Series kept at most; a source's series past it are not sampled.
pub const MAX_SERIES: usize = 256;

/// What a series is about: its source (`decisions`, `bans`, `redis`...) and the route and limit
/// (empty for sources of the whole proxy).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub source: &'static str,
    pub route: Arc<str>,
    pub limit: Arc<str>,
}

/// A source's counters now (totals since start), one per channel.
#[derive(Debug, Clone)]
pub struct Reading {
    pub key: Key,
    pub channels: &'static [&'static str],
    pub totals: Vec<u64>,
}

/// One series: the last totals seen and a ring of per-second increases per channel.
#[derive(Debug)]
struct Series {
    channels: &'static [&'static str],
    last: Vec<u64>,
    rings: Vec<Box<[u32]>>,
    /// The tick a source last reported it.
    seen: u64,
}

/// A series as the dashboard reads it: per channel, the rate (per second) of each `step`
/// seconds, oldest first, and the increase over the whole span.
#[derive(Debug, Clone)]
pub struct Rates {
    pub key: Key,
    /// (channel, rates, increase over the span)
    pub channels: Vec<(&'static str, Vec<f64>, u64)>,
}

#[derive(Debug, Default)]
struct Inner {
    series: HashMap<Key, Series>,
    /// The last totals of series dropped: one that comes back (its route restored by a reload)
    /// counts from there, not its whole total again in one second.
    retired: HashMap<Key, Vec<u64>>,
    /// The last tick recorded.
    tick: Option<u64>,
}

/// The rings of every series.
#[derive(Debug, Default)]
pub struct History(Mutex<Inner>);

impl History {
    /// Record `readings` as sampled at `tick` (seconds since the sampler started). Seconds a
    /// series missed count as no increase; its increase since its last sample goes in `tick`.
    pub fn record(&self, tick: u64, readings: Vec<Reading>) {
        let mut inner = self.0.lock();
        inner.tick = Some(tick);
        for r in readings {
            if !inner.series.contains_key(&r.key) {
                if inner.series.len() >= MAX_SERIES {
                    continue;
                }
                // A series new to the sampler counts from zero: its counters were made with
                // the runtime that brought it, at most a second ago.
                let last =
                    (inner.retired.remove(&r.key)).unwrap_or_else(|| vec![0; r.totals.len()]);
                let series = Series {
                    channels: r.channels,
                    last,
                    rings: r.channels.iter().map(|_| zeros()).collect(),
                    seen: tick,
                };
                inner.series.insert(r.key.clone(), series);
            }
            let Some(s) = inner.series.get_mut(&r.key) else {
                continue;
            };
            let from = s.seen + 1;
            s.seen = tick;
            for (i, total) in r.totals.iter().enumerate().take(s.rings.len()) {
                let last = s.last.get(i).copied().unwrap_or(*total);
                let ring = &mut s.rings[i];
                for t in from.max(tick.saturating_sub(SECONDS as u64 - 1))..tick {
                    ring[slot(t)] = 0;
                }
                // A counter reset (a route removed and made again) counts from its new total.
                let increase = total.checked_sub(last).unwrap_or(*total);
                ring[slot(tick)] = u32::try_from(increase).unwrap_or(u32::MAX);
            }
            s.last.clone_from(&r.totals);
        }
        let Inner {
            series, retired, ..
        } = &mut *inner;
        series.retain(|k, s| {
            let kept = tick.saturating_sub(s.seen) < SECONDS as u64;
            if !kept && retired.len() < MAX_SERIES * 4 {
                retired.insert(k.clone(), std::mem::take(&mut s.last));
            }
            kept
        });
    }

    /// Every series of `source`, as rates over steps of `step` seconds (the last partial
    /// step dropped), sorted by key.
    pub fn rates(&self, source: &str, step: usize) -> Vec<Rates> {
        let step = step.clamp(1, SECONDS);
        let inner = self.0.lock();
        let Some(now) = inner.tick else {
            return Vec::new();
        };
        let mut out: Vec<Rates> = inner
            .series
            .iter()
            .filter(|(k, _)| k.source == source)
            .map(|(k, s)| Rates {
                key: k.clone(),
                channels: s
                    .channels
                    .iter()
                    .zip(&s.rings)
                    .map(|(c, ring)| {
                        let (rates, sum) = steps(ring, now, s.seen, step);
                        (*c, rates, sum)
                    })
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// The sources that have series, sorted.
    pub fn sources(&self) -> Vec<&'static str> {
        let mut all: Vec<_> = self.0.lock().series.keys().map(|k| k.source).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// The last tick recorded.
    pub fn tick(&self) -> Option<u64> {
        self.0.lock().tick
    }
}

/// The ring's slot of `tick`.
fn slot(tick: u64) -> usize {
    (tick % SECONDS as u64) as usize
}

fn zeros() -> Box<[u32]> {
    vec![0; SECONDS].into_boxed_slice()
}

/// The averages of `step`-second steps ending at `now`, oldest first, and the increase over
/// them all. Seconds before a series began are zeros; so are those since `seen`, its last
/// sample (their slots still hold what the ring had ten minutes before).
fn steps(ring: &[u32], now: u64, seen: u64, step: usize) -> (Vec<f64>, u64) {
    let n = SECONDS / step;
    let mut rates = Vec::with_capacity(n);
    let mut total = 0u64;
    for i in (0..n).rev() {
        let mut sum = 0u64;
        for j in 0..step {
            let back = (i * step + j) as u64;
            if let Some(t) = now.checked_sub(back).filter(|t| *t <= seen) {
                sum += u64::from(ring[slot(t)]);
            }
        }
        total += sum;
        rates.push(sum as f64 / step as f64);
    }
    (rates, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(limit: &str, totals: [u64; 2]) -> Reading {
        Reading {
            key: Key {
                source: "decisions",
                route: "r".into(),
                limit: limit.into(),
            },
            channels: &["admitted", "limited"],
            totals: totals.to_vec(),
        }
    }

    #[test]
    fn increases_become_rates() {
        let h = History::default();
        h.record(0, vec![reading("l", [10, 0])]);
        h.record(1, vec![reading("l", [15, 2])]);
        h.record(2, vec![reading("l", [25, 2])]);
        let r = h.rates("decisions", 1);
        assert_eq!(r.len(), 1);
        let (name, admitted, sum) = &r[0].channels[0];
        assert_eq!(*name, "admitted");
        assert_eq!(&admitted[SECONDS - 3..], &[10.0, 5.0, 10.0]);
        assert_eq!(*sum, 25, "a new series counts from zero");
        assert_eq!(r[0].channels[1].2, 2);
        let r = h.rates("decisions", 2);
        assert_eq!(r[0].channels[0].1.last(), Some(&7.5));
    }

    #[test]
    fn a_missed_tick_is_a_quiet_second_and_old_samples_expire() {
        let h = History::default();
        h.record(0, vec![reading("l", [0, 0])]);
        h.record(1, vec![reading("l", [4, 0])]);
        h.record(3, vec![reading("l", [6, 0])]);
        let r = h.rates("decisions", 1);
        assert_eq!(&r[0].channels[0].1[SECONDS - 3..], &[4.0, 0.0, 2.0]);
        h.record(1 + SECONDS as u64, vec![reading("l", [6, 0])]);
        assert_eq!(
            h.rates("decisions", 1)[0].channels[0].2,
            2,
            "tick 1 is gone"
        );
    }

    #[test]
    fn series_nobody_reports_are_dropped() {
        let h = History::default();
        h.record(0, vec![reading("gone", [1, 1])]);
        h.record(SECONDS as u64, vec![reading("kept", [1, 1])]);
        let r = h.rates("decisions", 10);
        assert_eq!(r.len(), 1);
        assert_eq!(&*r[0].key.limit, "kept");
        // Back again: only what it counted since it went.
        h.record(SECONDS as u64 + 1, vec![reading("gone", [4, 1])]);
        let r = h.rates("decisions", 1);
        assert_eq!(r[0].channels[0].2, 3);
    }
}
