//! A response body read ahead: the spool a task fills from the upstream and the client drains.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use parking_lot::Mutex;

use super::{read_at, spill, Store, READ_CHUNK};

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
    // A small body is one frame: kept inline, no allocation for the list.
    let mut ready: crate::Small<Bytes> = crate::Small::new();
    let mut len = 0u64;
    let mut failed = false;
    let mut trailers = None;
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
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    len += data.len() as u64;
                    ready.push(data);
                    if len > store.memory_per_body {
                        break false;
                    }
                }
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
            Poll::Ready(None) => break true,
            Poll::Ready(Some(Err(_))) => {
                failed = true;
                break true;
            }
            Poll::Pending => break false,
        }
    };
    // A body with trailers goes through the spool, which hands them on.
    if ended && !failed && trailers.is_none() {
        return Ok(ReadAhead::Complete(match ready.len() {
            0 => Bytes::new(),
            1 => ready.swap_remove(0),
            _ => ready.concat().into(),
        }));
    }
    let spool = Spool::new(store);
    for data in ready {
        spool.push(&data);
    }
    spool.state.lock().trailers = trailers;
    if ended {
        spool.finish(failed);
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
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => spool.push(&data),
                Err(frame) => spool.state.lock().trailers = frame.into_trailers().ok(),
            },
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

/// A body being read ahead by one side (`push`, `finish`) and read by the other (`Spooled`).
/// What is in memory is always older than the unread part of the file: memory takes new bytes
/// only while the file has nothing unread. Once a file is refused (`max_spill`, or `temp_dir`),
/// new bytes wait in `tail`, read after the file, one frame at a time: the writer pushes again
/// only once the reader took it, so the upstream is read as fast as the client reads.
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
    /// Set once no file takes this response: it is streamed with backpressure through it.
    tail: Option<VecDeque<Bytes>>,
    /// The body's trailers, handed on after its last bytes.
    trailers: Option<http::HeaderMap>,
    done: bool,
    failed: bool,
    reader_gone: bool,
    /// The reader waits for bytes; the writer for room in the file.
    reader: Option<Waker>,
    writer: Option<Waker>,
}

impl Drop for Spool {
    fn drop(&mut self) {
        let s = self.state.get_mut();
        self.store.budget.release(s.in_memory);
        self.store.spill.release(s.written - s.read);
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

    /// Add `data` at the end (copied when kept in memory, as `Filling::push`): in memory, in
    /// the file, or, when no file can take it, in the tail the reader takes next.
    pub fn push(&self, data: &[u8]) {
        let n = data.len() as u64;
        let mut guard = self.state.lock();
        let s = &mut *guard;
        let backlog = s.written - s.read;
        if backlog == 0
            && s.tail.as_ref().is_none_or(VecDeque::is_empty)
            && s.in_memory + n <= self.store.memory_per_body
            && self.store.budget.reserve(n)
        {
            s.in_memory += n;
            s.chunks.push_back(Bytes::copy_from_slice(data));
        } else if let Some(tail) = &mut s.tail {
            tail.push_back(Bytes::copy_from_slice(data));
        } else {
            match spill(
                &self.store,
                super::Way::Response,
                &mut s.file,
                s.written,
                data,
            ) {
                Ok(()) => s.written += n,
                Err((why, capped)) => {
                    let store = &self.store;
                    store.spill.fell_back(&store.temp_dir, &why, capped);
                    s.tail = Some(VecDeque::from([Bytes::copy_from_slice(data)]));
                }
            }
        }
        if let Some(w) = s.reader.take() {
            w.wake();
        }
    }

    /// Whether the writer may push now; pending (woken when there is room) while the file's
    /// unread bytes are at the cap.
    fn poll_room(&self, cx: &mut Context<'_>) -> Poll<Room> {
        let mut s = self.state.lock();
        if s.reader_gone {
            return Poll::Ready(Room::Gone);
        }
        let room = match &s.tail {
            Some(tail) => tail.is_empty(),
            None => s.written - s.read < self.store.max_file,
        };
        if room {
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
            spool.store.spill.release(data.len() as u64);
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
        if let Some(chunk) = s.tail.as_mut().and_then(VecDeque::pop_front) {
            if let Some(w) = s.writer.take() {
                w.wake();
            }
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if s.done {
            if s.failed {
                return Poll::Ready(Some(Err(io::Error::other("upstream body broke off"))));
            }
            return Poll::Ready(s.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        s.reader = Some(cx.waker().clone());
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let s = self.spool.state.lock();
        s.done
            && !s.failed
            && s.trailers.is_none()
            && s.chunks.is_empty()
            && s.written == s.read
            && s.tail.as_ref().is_none_or(VecDeque::is_empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::tests::store;

    #[tokio::test]
    async fn a_spool_keeps_order_across_memory_and_file() {
        let s = store(4, 1 << 20);
        let spool = Spool::new(&s);
        let mut reader = Spooled::new(spool.clone());
        spool.push(b"ab");
        spool.push(b"cd");
        spool.push(b"ef"); // memory full: to the file
        let first = reader.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"ab");
        spool.push(b"gh"); // the file has unread bytes: after them
        spool.finish(false);
        let rest = reader.collect().await.unwrap().to_bytes();
        assert_eq!(&rest[..], b"cdefgh");
        drop(spool);
        assert_eq!(s.budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_read_ahead_keeps_its_trailers() {
        let s = store(1 << 10, 1 << 20);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-cost", http::HeaderValue::from_static("42"));
        let frames: Vec<Result<Frame<Bytes>, io::Error>> = vec![
            Ok(Frame::data(Bytes::from_static(b"hello"))),
            Ok(Frame::trailers(trailers)),
        ];
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let ReadAhead::Spooled(spooled) = read_ahead(body, &s, true).await.unwrap() else {
            panic!("a body with trailers read as complete bytes")
        };
        let collected = spooled.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-cost"], "42");
        assert_eq!(&collected.to_bytes()[..], b"hello");
    }
}
