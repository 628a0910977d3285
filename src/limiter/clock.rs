//! The limiter's time: `Moment`, a time on its clock in microseconds, the monotonic `Clock`
//! buckets count on, and the wall clock calendar quotas and windows take their bounds from.

use tokio::time::Instant;

/// A time on the limiter's clock (or, for quotas and replays, the wall clock), in
/// microseconds. The bucket arithmetic and the Redis scripts work in `f64` microseconds; the
/// type keeps a time from being passed where a duration or a count is meant.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default)]
pub struct Moment(f64);

impl Moment {
    /// The time `us` microseconds after the clock's origin.
    pub const fn from_us(us: f64) -> Self {
        Self(us)
    }

    /// Microseconds since the clock's origin (the Unix epoch for the wall clock).
    pub fn us(self) -> f64 {
        self.0
    }
}

/// A monotonic clock in microseconds, on tokio's clock (so a test that pauses time moves it);
/// unit tests construct buckets and pass their own `now`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    /// Now on this clock.
    pub fn now(&self) -> Moment {
        self.at(Instant::now())
    }

    /// `at` on this clock (for a caller that has just read the time).
    pub fn at(&self, at: Instant) -> Moment {
        Moment(at.saturating_duration_since(self.origin).as_secs_f64() * 1e6)
    }
}

/// Wall-clock microseconds since the UNIX epoch at `at`: the system clock as read once per
/// process, moved on by tokio's clock since (so a test that pauses time moves it, and every
/// clock of the process agrees). Calendar quotas take their windows from it.
// Anchored on std's clock: the system clock is read against it once per process.
#[allow(clippy::disallowed_types)]
pub fn wall_at(at: Instant) -> f64 {
    static ANCHOR: std::sync::LazyLock<(std::time::Instant, f64)> =
        std::sync::LazyLock::new(|| {
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64() * 1e6);
            (std::time::Instant::now(), wall)
        });
    let (origin, wall) = *ANCHOR;
    let at = at.into_std();
    match at.checked_duration_since(origin) {
        Some(d) => wall + d.as_secs_f64() * 1e6,
        None => wall - origin.duration_since(at).as_secs_f64() * 1e6,
    }
}

/// `wall_at` now.
pub fn wall_us() -> f64 {
    wall_at(Instant::now())
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
