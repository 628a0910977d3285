//! Bodies the proxy holds for a slow side: in memory up to a bound, beyond it in an unlinked
//! temporary file, with a proxy-wide cap on the bytes held in memory.
//!
//! A request body is held whole before the upstream is contacted (`Held`, replayable); an
//! upstream response is read ahead as fast as the upstream sends it (`Spool`), so the upstream
//! connection is free while the client reads at its own pace. Temporary files are created
//! unlinked (`tempfile::tempfile_in`): nothing is left behind, even after a crash.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use parking_lot::Mutex;

/// How much a file read hands out at once.
const READ_CHUNK: usize = 64 << 10;

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
    fn reserve(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + n <= self.limit).then_some(used + n)
            })
            .is_ok()
    }

    fn release(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Bytes held in memory now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
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
}

impl Store {
    fn temp_file(&self) -> io::Result<File> {
        tempfile::tempfile_in(&self.temp_dir)
    }
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
        if h.file.is_none() {
            h.file = Some(self.store.temp_file()?);
        }
        if let Some(file) = &h.file {
            file.write_all_at(data, h.file_len)?;
        }
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
fn read_at(file: &File, at: u64, len: usize) -> io::Result<Bytes> {
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

// === Read ahead: a response body taken as fast as the upstream sends it ===

/// A response body read ahead: all of it already (small bodies, the common case: no task, no
/// file), or the rest still coming in through a task of its own.
#[derive(Debug)]
pub enum ReadAhead {
    Complete(Bytes),
    Spooled(Spooled),
}

/// Read `body` ahead: what is ready now inline (`wait`: until it ends or passes the memory
/// bound); if it does not end there, the rest by a task on this thread that reads it into a
/// `Spool` for as long as the spool has room, so the upstream is done with this response as
/// soon as it has sent it.
pub async fn read_ahead<B>(mut body: B, store: &Store, wait: bool) -> io::Result<ReadAhead>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
{
    let mut ready: Vec<Bytes> = Vec::new();
    let mut len = 0u64;
    let mut failed = false;
    let ended = loop {
        if body.is_end_stream() {
            break true;
        }
        let polled = if wait {
            Poll::Ready(body.frame().await)
        } else {
            let mut cx = Context::from_waker(Waker::noop());
            Pin::new(&mut body).poll_frame(&mut cx)
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    len += data.len() as u64;
                    ready.push(data);
                    if len > store.memory_per_body {
                        break false;
                    }
                }
            }
            Poll::Ready(None) => break true,
            Poll::Ready(Some(Err(_))) => {
                failed = true;
                break true;
            }
            Poll::Pending => break false,
        }
    };
    if ended && !failed {
        return Ok(ReadAhead::Complete(match ready.len() {
            0 => Bytes::new(),
            1 => ready.swap_remove(0),
            _ => ready.concat().into(),
        }));
    }
    let spool = Spool::new(store);
    for data in ready {
        spool.push(&data)?;
    }
    if failed {
        spool.finish(true);
    } else {
        tokio::spawn(pump(body, spool.clone()));
    }
    Ok(ReadAhead::Spooled(Spooled::new(spool)))
}

/// Move `body` into `spool` until it ends, the reader goes away, or it fails.
async fn pump<B>(mut body: B, spool: Arc<Spool>)
where
    B: Body<Data = Bytes> + Unpin,
{
    loop {
        if std::future::poll_fn(|cx| spool.poll_room(cx)).await == Room::Gone {
            // Dropping the body closes the upstream connection: nobody wants the rest.
            return;
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if spool.push(&data).is_err() {
                        spool.finish(true);
                        return;
                    }
                }
            }
            Some(Err(_)) => {
                spool.finish(true);
                return;
            }
            None => {
                spool.finish(false);
                return;
            }
        }
    }
}

// === Spool: a body read ahead ===

/// A body being read ahead by one side (`push`, `finish`) and read by the other (`Spooled`).
/// What is in memory is always older than the unread part of the file: memory takes new bytes
/// only while the file has nothing unread.
#[derive(Debug)]
pub struct Spool {
    store: Store,
    state: Mutex<SpoolState>,
}

#[derive(Debug, Default)]
struct SpoolState {
    chunks: VecDeque<Bytes>,
    in_memory: u64,
    file: Option<Arc<File>>,
    written: u64,
    read: u64,
    done: bool,
    failed: bool,
    reader_gone: bool,
    /// The reader waits for bytes; the writer for room in the file.
    reader: Option<Waker>,
    writer: Option<Waker>,
}

impl Drop for Spool {
    fn drop(&mut self) {
        self.store.budget.release(self.state.get_mut().in_memory);
    }
}

/// What the writer may do next (it waits while the file is at its cap).
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// Push more.
    Yes,
    /// The reader is gone: stop reading the upstream.
    Gone,
}

impl Spool {
    pub fn new(store: &Store) -> Arc<Self> {
        Arc::new(Self {
            store: store.clone(),
            state: Mutex::new(SpoolState::default()),
        })
    }

    /// Add `data` at the end (copied when kept in memory, as `Filling::push`).
    pub fn push(&self, data: &[u8]) -> io::Result<()> {
        let n = data.len() as u64;
        let mut s = self.state.lock();
        let backlog = s.written - s.read;
        if backlog == 0
            && s.in_memory + n <= self.store.memory_per_body
            && self.store.budget.reserve(n)
        {
            s.in_memory += n;
            s.chunks.push_back(Bytes::copy_from_slice(data));
        } else {
            if s.file.is_none() {
                s.file = Some(Arc::new(self.store.temp_file()?));
            }
            if let Some(file) = &s.file {
                file.write_all_at(data, s.written)?;
            }
            s.written += n;
        }
        if let Some(w) = s.reader.take() {
            w.wake();
        }
        Ok(())
    }

    /// Whether the writer may push now; pending (woken when there is room) while the file's
    /// unread bytes are at the cap.
    fn poll_room(&self, cx: &mut Context<'_>) -> Poll<Room> {
        let mut s = self.state.lock();
        if s.reader_gone {
            return Poll::Ready(Room::Gone);
        }
        if s.written - s.read < self.store.max_file {
            return Poll::Ready(Room::Yes);
        }
        s.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// No more bytes: `failed` when the upstream body broke off.
    pub fn finish(&self, failed: bool) {
        let mut s = self.state.lock();
        s.done = true;
        s.failed = failed;
        if let Some(w) = s.reader.take() {
            w.wake();
        }
    }
}

/// The reading side of a `Spool`.
#[derive(Debug)]
pub struct Spooled {
    spool: Arc<Spool>,
}

impl Spooled {
    pub fn new(spool: Arc<Spool>) -> Self {
        Self { spool }
    }
}

impl Drop for Spooled {
    fn drop(&mut self) {
        let mut s = self.spool.state.lock();
        s.reader_gone = true;
        if let Some(w) = s.writer.take() {
            w.wake();
        }
    }
}

impl Body for Spooled {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let spool = &self.spool;
        let mut s = spool.state.lock();
        if let Some(chunk) = s.chunks.pop_front() {
            let n = chunk.len() as u64;
            s.in_memory -= n;
            spool.store.budget.release(n);
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if s.written > s.read {
            let Some(file) = s.file.clone() else {
                return Poll::Ready(Some(Err(io::Error::other("spool file missing"))));
            };
            let want = (s.written - s.read).min(READ_CHUNK as u64) as usize;
            let at = s.read;
            let data = match read_at(&file, at, want) {
                Ok(d) => d,
                Err(e) => return Poll::Ready(Some(Err(e))),
            };
            s.read += data.len() as u64;
            if s.read == s.written {
                // All caught up: the file's space can be used again from the start.
                s.read = 0;
                s.written = 0;
                let _ = file.set_len(0);
            }
            if let Some(w) = s.writer.take() {
                w.wake();
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if s.done {
            return Poll::Ready(
                s.failed
                    .then(|| Err(io::Error::other("upstream body broke off"))),
            );
        }
        s.reader = Some(cx.waker().clone());
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let s = self.spool.state.lock();
        s.done && !s.failed && s.chunks.is_empty() && s.written == s.read
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(memory_per_body: u64, budget: u64) -> Store {
        Store {
            temp_dir: std::env::temp_dir(),
            memory_per_body,
            max_file: 1 << 20,
            budget: Arc::new(Budget::new(budget)),
        }
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

    #[tokio::test]
    async fn a_spool_keeps_order_across_memory_and_file() {
        let s = store(4, 1 << 20);
        let spool = Spool::new(&s);
        let mut reader = Spooled::new(spool.clone());
        spool.push(b"ab").unwrap();
        spool.push(b"cd").unwrap();
        spool.push(b"ef").unwrap(); // memory full: to the file
        let first = reader.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"ab");
        spool.push(b"gh").unwrap(); // the file has unread bytes: after them
        spool.finish(false);
        let rest = reader.collect().await.unwrap().to_bytes();
        assert_eq!(&rest[..], b"cdefgh");
        drop(spool);
        assert_eq!(s.budget.used(), 0);
    }
}
