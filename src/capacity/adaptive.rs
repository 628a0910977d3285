//! The adaptive cap of a target: a gradient controller on the latency of its responses, as
//! Envoy's adaptive concurrency filter and Netflix's Gradient2 learn one.
//!
//! Every `window` (once it holds enough responses) the cap is multiplied by the gradient
//! `clamp(tolerance * min_rtt / average, 0.5, 2)`: the average response time over the window
//! against the no-load one. A backend that keeps up answers in about `min_rtt`, so the cap
//! grows (by `tolerance`, plus one slot when the cap was reached); a backend whose workers are
//! all busy makes requests wait inside it, its latency grows with the requests in flight, and
//! the cap shrinks back to what it serves at `min_rtt * tolerance`. Behind a backend with K
//! workers that settles between K and `tolerance * K + 2`.
//!
//! `min_rtt` is measured, not configured: at start and every `probe_every` the cap drops to
//! `min` until `PROBE_SAMPLES` responses of requests sent during the probe came back; their
//! average is the new `min_rtt`. A window over 10% faster than `min_rtt` starts a probe at once (the
//! backend sped up).

use std::time::Duration;

/// `max_in_flight: adaptive`'s parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveSpec {
    pub min: usize,
    pub max: usize,
    pub window: Duration,
    pub tolerance: f64,
    pub probe_every: Duration,
}

impl Default for AdaptiveSpec {
    fn default() -> Self {
        Self {
            min: 1,
            max: 1000,
            window: Duration::from_millis(100),
            tolerance: 1.1,
            probe_every: Duration::from_secs(30),
        }
    }
}

/// Responses a window needs before the cap moves: fewer are noise.
const WINDOW_SAMPLES: u32 = 5;
/// A window lasts at least this many no-load response times.
const WINDOW_RTTS: u32 = 5;
/// Responses a probe takes to measure `min_rtt`.
pub const PROBE_SAMPLES: u32 = 8;

/// The learned cap of one target. Time is the gate's: a `Duration` since it was made.
#[derive(Debug)]
pub(super) struct Gradient {
    spec: AdaptiveSpec,
    limit: f64,
    min_rtt: Option<Duration>,
    /// The probe in progress: the limit to go back to.
    probing: Option<f64>,
    next_probe: Duration,
    /// Bumped when a probe starts or ends: only responses to requests sent since then count.
    pub generation: u64,
    window_start: Duration,
    sum: Duration,
    count: u32,
    /// The cap was reached in this window: growing it is worth something.
    saturated: bool,
}

impl Gradient {
    pub fn new(spec: AdaptiveSpec) -> Self {
        let limit = spec.min as f64;
        Self {
            spec,
            limit,
            min_rtt: None,
            // The first thing learned is the no-load latency.
            probing: Some(limit),
            next_probe: Duration::ZERO,
            generation: 0,
            window_start: Duration::ZERO,
            sum: Duration::ZERO,
            count: 0,
            saturated: false,
        }
    }

    /// Parameters changed by a reload: the learned state stays, held to the new bounds.
    pub fn respec(&mut self, spec: AdaptiveSpec) {
        self.limit = self.limit.clamp(spec.min as f64, spec.max as f64);
        self.spec = spec;
    }

    pub fn cap(&self) -> usize {
        if self.probing.is_some() {
            return self.spec.min;
        }
        (self.limit.round() as usize).clamp(self.spec.min, self.spec.max)
    }

    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// The cap was reached at `now` (a request found it full).
    pub fn reached(&mut self) {
        self.saturated = true;
    }

    /// A response came back at `now`, `rtt` after its request was sent, to a request sent
    /// under `generation`.
    pub fn sample(&mut self, now: Duration, rtt: Duration, generation: u64) {
        if generation != self.generation {
            return;
        }
        self.sum += rtt;
        self.count += 1;
        if let Some(restore) = self.probing {
            if self.count >= PROBE_SAMPLES {
                self.min_rtt = Some(self.sum / self.count);
                self.limit = restore;
                self.probing = None;
                self.next_probe = now + self.spec.probe_every;
                self.restart(now, true);
            }
            return;
        }
        // A window spans a few response times, or it judges requests sent at another cap.
        let window = self
            .spec
            .window
            .max(self.min_rtt.unwrap_or_default() * WINDOW_RTTS);
        if now.saturating_sub(self.window_start) < window || self.count < WINDOW_SAMPLES {
            return;
        }
        let average = self.sum / self.count;
        let Some(min_rtt) = self
            .min_rtt
            .filter(|m| average.as_secs_f64() > 0.9 * m.as_secs_f64())
        else {
            // Clearly faster than the no-load latency: the backend sped up, measure it again.
            self.probing = Some(self.limit);
            self.restart(now, true);
            return;
        };
        let min_rtt = min_rtt.min(average);
        self.min_rtt = Some(min_rtt);
        let gradient =
            (self.spec.tolerance * min_rtt.as_secs_f64() / average.as_secs_f64()).clamp(0.5, 2.0);
        let next = if self.saturated {
            self.limit * gradient + 1.0
        } else {
            // A cap nobody reaches says nothing about the backend: it may only come down.
            self.limit * gradient.min(1.0)
        };
        self.limit = next.clamp(self.spec.min as f64, self.spec.max as f64);
        if now >= self.next_probe {
            self.probing = Some(self.limit);
            self.restart(now, true);
        } else {
            self.restart(now, false);
        }
    }

    fn restart(&mut self, now: Duration, new_generation: bool) {
        if new_generation {
            self.generation += 1;
        }
        self.window_start = now;
        self.sum = Duration::ZERO;
        self.count = 0;
        self.saturated = false;
    }
}

#[cfg(test)]
mod tests;
