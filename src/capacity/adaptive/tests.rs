//! The controller against a simulated backend: K workers, a fixed service time, requests
//! beyond K waiting inside it in order, and more offered load than it can serve.

use std::collections::VecDeque;
use std::time::Duration;

use super::{AdaptiveSpec, Gradient};

/// A backend with `workers` workers taking `service` per request, fed by a gate that always
/// has requests waiting.
struct Simulation {
    gradient: Gradient,
    now: Duration,
    workers: usize,
    service: Duration,
    /// Requests a worker is serving: (done at, sent at, generation).
    serving: Vec<(Duration, Duration, u64)>,
    /// Requests waiting inside the backend: (sent at, generation).
    waiting: VecDeque<(Duration, u64)>,
    served: u64,
    /// Served after the run's `settle`.
    served_settled: u64,
}

impl Simulation {
    fn new(workers: usize, service: Duration) -> Self {
        Self {
            gradient: Gradient::new(AdaptiveSpec::default()),
            now: Duration::ZERO,
            workers,
            service,
            serving: Vec::new(),
            waiting: VecDeque::new(),
            served: 0,
            served_settled: 0,
        }
    }

    fn in_flight(&self) -> usize {
        self.serving.len() + self.waiting.len()
    }

    /// Run until `until`; the caps seen after `settle` outside probes.
    fn run(&mut self, until: Duration, settle: Duration) -> Vec<usize> {
        let mut caps = Vec::new();
        while self.now < until {
            while self.in_flight() < self.gradient.cap() {
                let sent = (self.now, self.gradient.generation);
                if self.serving.len() < self.workers {
                    self.serving.push((self.now + self.service, sent.0, sent.1));
                } else {
                    self.waiting.push_back(sent);
                }
            }
            self.gradient.reached();
            let next = (0..self.serving.len())
                .min_by_key(|&i| self.serving[i].0)
                .expect("the gate keeps the backend busy");
            let (done, sent, generation) = self.serving.swap_remove(next);
            self.now = done;
            self.served += 1;
            self.gradient
                .sample(self.now, done.saturating_sub(sent), generation);
            while self.serving.len() < self.workers {
                let Some((sent, generation)) = self.waiting.pop_front() else {
                    break;
                };
                self.serving
                    .push((self.now + self.service, sent, generation));
            }
            if self.now >= settle {
                self.served_settled += 1;
                if self.gradient.probing.is_none() {
                    caps.push(self.gradient.cap());
                }
            }
        }
        caps
    }
}

fn band(caps: &[usize]) -> (usize, usize) {
    let lo = caps.iter().copied().min().unwrap_or(0);
    let hi = caps.iter().copied().max().unwrap_or(0);
    (lo, hi)
}

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

#[test]
fn the_cap_settles_between_k_and_tolerance_times_k_plus_two() {
    for k in [1, 4, 8, 32] {
        let mut sim = Simulation::new(k, 20 * MS);
        let caps = sim.run(20 * S, 5 * S);
        let (lo, hi) = band(&caps);
        let top = (1.1 * k as f64 + 2.0).floor() as usize;
        assert!(
            lo >= k && hi <= top,
            "K={k}: cap in {lo}..={hi}, want {k}..={top}"
        );
        // Goodput: the backend's workers stay busy (probes cost a little).
        let capacity = 15.0 * k as f64 / 0.020;
        let served = sim.served_settled as f64;
        assert!(
            served > 0.97 * capacity,
            "K={k}: served {served} of {capacity}"
        );
    }
}

#[test]
fn the_cap_follows_the_backend_down_and_back_up() {
    let mut sim = Simulation::new(8, 20 * MS);
    sim.run(10 * S, 5 * S);
    // Half the workers go away: the cap follows within a few windows.
    sim.workers = 4;
    let caps = sim.run(15 * S, 11 * S);
    let (lo, hi) = band(&caps);
    assert!(lo >= 4 && hi <= 6, "cap in {lo}..={hi}");
    // They come back: the cap grows to them again.
    sim.workers = 8;
    let caps = sim.run(20 * S, 17 * S);
    let (lo, hi) = band(&caps);
    assert!(lo >= 8 && hi <= 10, "cap in {lo}..={hi}");
}

#[test]
fn a_slower_backend_is_relearned_at_the_next_probe_and_a_faster_one_at_once() {
    let mut sim = Simulation::new(8, 20 * MS);
    sim.run(10 * S, 5 * S);
    // Each request takes three times as long: until the next probe measures it, latency
    // looks like overload and the cap stays low.
    sim.service = 60 * MS;
    let caps = sim.run(75 * S, 70 * S);
    let (lo, hi) = band(&caps);
    assert!(lo >= 8 && hi <= 10, "after the probe: cap in {lo}..={hi}");
    // Fast again: a window faster than min_rtt lowers it, and the cap grows back.
    sim.service = 20 * MS;
    let caps = sim.run(80 * S, 78 * S);
    let (lo, hi) = band(&caps);
    assert!(lo >= 8 && hi <= 10, "sped up: cap in {lo}..={hi}");
}
