//! Bodies the proxy holds for a slow side: in memory up to a bound, beyond it in an unlinked
//! temporary file, with a proxy-wide cap on the bytes held in memory.
//!
//! A request body is held whole before the upstream is contacted (`Held`, replayable); an
//! upstream response is read ahead as fast as the upstream sends it (`Spool`), so the upstream
//! connection is free while the client reads at its own pace. Temporary files are created
//! unlinked (`tempfile::tempfile_in`): nothing is left behind, even after a crash. The bytes
//! in files have a proxy-wide cap (`Spill`); a response that cannot spill (the cap reached, or
//! `temp_dir` unwritable or full) is streamed with backpressure instead, never cut short.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

/// How much a file read hands out at once: hyper queues body frames for a slow client until
/// it holds `max_buf_size` bytes, so each frame may add up to this much on top of that.
pub(super) const READ_CHUNK: usize = 16 << 10;

mod spool;

pub use spool::{read_ahead, ReadAhead, Spooled};

/// Bytes held in memory by every buffered body together, against `buffering.max_memory`.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            used: AtomicU64::new(0),
        }
    }

    /// Take `n` bytes of the budget, if they fit.
    pub(super) fn reserve(&self, n: u64) -> bool {
        self.reserve_within(n, self.limit)
    }

    /// Take `n` bytes, if the bytes taken stay within `cap` (at most the limit).
    fn reserve_within(&self, n: u64, cap: u64) -> bool {
        let cap = cap.min(self.limit);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + n <= cap).then_some(used + n)
            })
            .is_ok()
    }

    pub(super) fn release(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Bytes held in memory now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// Bytes in temporary files, all bodies together, against `buffering.max_spill`; and what
/// happened to responses that could not spill, counted and logged.
#[derive(Debug)]
pub struct Spill {
    bytes: Budget,
    /// `tollgate_buffer_spilled_bytes`, kept equal to `used`.
    gauge: Gauge,
    /// Responses streamed with backpressure because `temp_dir` refused a file or a write, or
    /// because `max_spill` bytes were in files.
    pub(super) unwritable: Counter,
    pub(super) capped: Counter,
    log: crate::log_gate::LogGate,
    /// The log gate's clock: std's, as files are written from blocking threads too.
    #[allow(clippy::disallowed_types)]
    origin: std::time::Instant,
}

impl Spill {
    pub fn new(limit: u64, handles: SpillHandles) -> Self {
        Self {
            bytes: Budget::new(limit),
            gauge: handles.bytes,
            unwritable: handles.unwritable,
            capped: handles.capped,
            log: crate::log_gate::LogGate::new(std::time::Duration::from_secs(10)),
            #[allow(clippy::disallowed_types)]
            origin: std::time::Instant::now(),
        }
    }

    /// The cap this was built with (a reload keeps it, and what it counts, when unchanged).
    pub fn limit(&self) -> u64 {
        self.bytes.limit
    }

    /// Take `n` bytes of the cap, if they fit. Responses get at most three quarters of it:
    /// a response that cannot spill streams on with backpressure, while a request body that
    /// cannot gets 503, so stalled downloads never leave uploads without room.
    pub(super) fn reserve(&self, n: u64, kind: Way) -> bool {
        let cap = match kind {
            Way::Request => self.bytes.limit,
            Way::Response => self.bytes.limit / 4 * 3,
        };
        let taken = self.bytes.reserve_within(n, cap);
        if taken {
            self.gauge.inc_by(i64::try_from(n).unwrap_or(i64::MAX));
        }
        taken
    }

    pub(super) fn release(&self, n: u64) {
        self.bytes.release(n);
        self.gauge.dec_by(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A response that could not spill goes on with backpressure: counted, and logged at WARN
    /// at most once per 10 s (with how many were not logged).
    pub(super) fn fell_back(&self, dir: &std::path::Path, why: &io::Error, capped: bool) {
        if capped {
            self.capped.inc();
        } else {
            self.unwritable.inc();
        }
        let now = u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        if let Some(held_back) = self.log.open(now) {
            tracing::warn!(
                dir = %dir.display(),
                error = %why,
                more = held_back,
                "a response cannot spill to a file: streaming it with backpressure (the upstream is read as the client reads)"
            );
        }
    }
}

/// Which way a spilled body goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    Request,
    Response,
}

/// The metric handles a `Spill` writes.
#[derive(Debug, Clone, Default)]
pub struct SpillHandles {
    pub bytes: Gauge,
    pub unwritable: Counter,
    pub capped: Counter,
}

/// Where and how much to buffer (the `buffering` settings), with the shared memory budget.
#[derive(Debug, Clone)]
pub struct Store {
    pub temp_dir: PathBuf,
    /// A body stays in memory up to this many bytes; the rest goes to a file.
    pub memory_per_body: u64,
    /// Unread bytes a response's file may hold; past it, the upstream is read as the client
    /// reads.
    pub max_file: u64,
    pub budget: Arc<Budget>,
    pub spill: Arc<Spill>,
}

impl Store {
    /// A new unnamed file in `temp_dir`, readable by this user only: `tempfile` makes an
    /// `O_TMPFILE` one with the umask's mode (0644 under the usual 022), which another user
    /// could open through `/proc` while it exists.
    pub(super) fn temp_file(&self) -> io::Result<File> {
        use std::os::unix::fs::PermissionsExt;
        let file = tempfile::tempfile_in(&self.temp_dir)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        Ok(file)
    }
}

/// Write `data` at `at` of `file` (made in `temp_dir` when there is none yet), under the
/// proxy-wide cap on bytes in files; the error says why not, and whether it was the cap.
pub(super) fn spill<F: From<File> + std::borrow::Borrow<File>>(
    store: &Store,
    kind: Way,
    file: &mut Option<F>,
    at: u64,
    data: &[u8],
) -> Result<(), (io::Error, bool)> {
    let n = data.len() as u64;
    if !store.spill.reserve(n, kind) {
        let full = io::Error::other("buffering.max_spill bytes are in temporary files already");
        return Err((full, true));
    }
    let written = match file {
        Some(f) => f.borrow().write_all_at(data, at),
        None => store.temp_file().and_then(|f| {
            f.write_all_at(data, at)?;
            *file = Some(F::from(f));
            Ok(())
        }),
    };
    written.map_err(|e| {
        store.spill.release(n);
        (e, false)
    })
}

// === Held: a complete body ===

/// A whole body, held: its first bytes in memory, the rest in a file. Replayable: every
/// `HeldReader` reads it from the start.
#[derive(Debug)]
pub struct Held {
    chunks: Vec<Bytes>,
    file: Option<File>,
    file_len: u64,
    /// Memory reserved from `budget`, given back on drop.
    reserved: u64,
    budget: Arc<Budget>,
    /// `file_len` is reserved from it, given back on drop.
    spill: Arc<Spill>,
}

impl Held {
    /// The body's length in bytes.
    pub fn size(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum::<u64>() + self.file_len
    }

    /// A reader from the start.
    pub fn reader(self: &Arc<Self>) -> HeldReader {
        HeldReader {
            held: self.clone(),
            chunk: 0,
            file_pos: 0,
            left: self.size(),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.release(self.reserved);
        self.spill.release(self.file_len);
    }
}

/// Fills a `Held`: memory first, then a file.
#[derive(Debug)]
pub struct Filling {
    store: Store,
    held: Held,
}

impl Filling {
    pub fn new(store: &Store) -> Self {
        Self {
            store: store.clone(),
            held: Held {
                chunks: Vec::new(),
                file: None,
                file_len: 0,
                reserved: 0,
                budget: store.budget.clone(),
                spill: store.spill.clone(),
            },
        }
    }

    /// Add `data` at the end. Kept in memory, it is copied: a frame is often a slice of a
    /// connection's whole read buffer, and held for long it would keep all of it alive.
    pub fn push(&mut self, data: &[u8]) -> io::Result<()> {
        let n = data.len() as u64;
        let h = &mut self.held;
        if h.file.is_none()
            && h.reserved + n <= self.store.memory_per_body
            && self.store.budget.reserve(n)
        {
            h.reserved += n;
            h.chunks.push(Bytes::copy_from_slice(data));
            return Ok(());
        }
        // A request body cannot wait for a reader: past the cap it is refused (503).
        spill(&self.store, Way::Request, &mut h.file, h.file_len, data).map_err(|(e, _)| e)?;
        h.file_len += n;
        Ok(())
    }

    pub fn finish(self) -> Held {
        self.held
    }
}

/// Reads a `Held` body from its start.
#[derive(Debug)]
pub struct HeldReader {
    held: Arc<Held>,
    chunk: usize,
    file_pos: u64,
    left: u64,
}

impl HeldReader {
    /// A reader of the same body from its start.
    pub fn restart(&self) -> Self {
        self.held.reader()
    }

    fn next(&mut self) -> io::Result<Option<Bytes>> {
        if let Some(c) = self.held.chunks.get(self.chunk) {
            self.chunk += 1;
            self.left -= c.len() as u64;
            return Ok(Some(c.clone()));
        }
        let Some(file) = &self.held.file else {
            return Ok(None);
        };
        if self.file_pos >= self.held.file_len {
            return Ok(None);
        }
        let want = (self.held.file_len - self.file_pos).min(READ_CHUNK as u64) as usize;
        let data = read_at(file, self.file_pos, want)?;
        self.file_pos += data.len() as u64;
        self.left -= data.len() as u64;
        Ok(Some(data))
    }
}

impl Body for HeldReader {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        // The file was written moments ago: its pages are in the page cache, so the read does
        // not wait on a disk.
        Poll::Ready(self.next().transpose().map(|r| r.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// `len` bytes of `file` from `at` (fewer at its end).
pub(super) fn read_at(file: &File, at: u64, len: usize) -> io::Result<Bytes> {
    let mut buf = BytesMut::zeroed(len);
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut buf[filled..], at + filled as u64)? {
            0 => break,
            n => filled += n,
        }
    }
    buf.truncate(filled);
    Ok(buf.freeze())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use http_body_util::BodyExt;

    pub(super) fn store(memory_per_body: u64, budget: u64) -> Store {
        Store {
            temp_dir: std::env::temp_dir(),
            memory_per_body,
            max_file: 1 << 20,
            budget: Arc::new(Budget::new(budget)),
            spill: Arc::new(Spill::new(1 << 30, SpillHandles::default())),
        }
    }

    /// Spill files are made with mode 0600 (which a umask can only narrow), unlinked: no
    /// other user can read a body, whatever the umask.
    #[test]
    fn spill_files_are_owner_only_and_unnamed() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let f = store(10, 1 << 20).temp_file().unwrap();
        let meta = f.metadata().unwrap();
        assert_eq!(meta.permissions().mode() & 0o077, 0, "{:o}", meta.mode());
        assert_eq!(meta.nlink(), 0, "a spill file has no name");
    }

    #[tokio::test]
    async fn a_held_body_spills_past_its_memory_and_reads_back_in_order() {
        let s = store(10, 1 << 20);
        let mut f = Filling::new(&s);
        for part in ["hello", "world", "and the rest", "!"] {
            f.push(part.as_bytes()).unwrap();
        }
        let held = Arc::new(f.finish());
        assert_eq!(held.size(), 23);
        assert_eq!(s.budget.used(), 10);
        for _ in 0..2 {
            let body = held.reader().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"helloworldand the rest!");
        }
        drop(held);
        assert_eq!(s.budget.used(), 0);
    }

    #[tokio::test]
    async fn the_budget_sends_bodies_to_files_when_memory_is_taken() {
        let s = store(1 << 20, 8);
        let mut a = Filling::new(&s);
        a.push(b"12345678").unwrap();
        let mut b = Filling::new(&s);
        b.push(b"abc").unwrap();
        let (a, b) = (Arc::new(a.finish()), Arc::new(b.finish()));
        assert_eq!(s.budget.used(), 8);
        assert!(b.file.is_some(), "no budget left: b went to a file");
        let body = b.reader().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"abc");
        drop((a, b));
        assert_eq!(s.budget.used(), 0);
    }
}
