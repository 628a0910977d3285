//! The response statuses a `count_when` limit counts.

/// A set of HTTP status codes (100 to 599), as `count_when.status` lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    /// Whether `status` is in the set.
    pub fn contains(&self, status: u16) -> bool {
        let i = usize::from(status);
        i < 640 && self.0[i / 64] & (1 << (i % 64)) != 0
    }

    /// The set with `code` (100 to 599) in it.
    #[must_use]
    pub fn with(mut self, code: u16) -> Self {
        let i = usize::from(code);
        if (100..600).contains(&code) {
            self.0[i / 64] |= 1 << (i % 64);
        }
        self
    }
}
