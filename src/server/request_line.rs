//! The request line of each HTTP/1 head, watched as it arrives: one whose target is longer
//! than the listener's `max_uri_bytes` is answered `414 URI Too Long` here, however long it
//! is. hyper sees a head only as a whole: a request line longer than its read buffer
//! (`max_header_bytes`) would be its `431`, and screening's `414` only sees targets that fit.
//! nginx answers `414` to a request line too long for its buffers; RFC 9112 3 asks a server
//! to answer `414` to a target longer than any URI it wishes to parse.
//!
//! Only the first line of a head read while no request is in flight is watched (the watchdog's
//! view of a head in progress): a body is never mistaken for one. A head that hyper read
//! ahead while the previous request was in flight (pipelining) is left to hyper and screening,
//! and a connection that switched protocols (`101`, a WebSocket tunnel) is not watched again.
//! The cost is a scan for the line's end, only until it ends: nothing for the rest of a head,
//! for bodies or for HTTP/2.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The refusal, in the form `response::from_error` gives every error (`reason\n`), and the
/// connection closes after it.
const URI_TOO_LONG: &[u8] = b"HTTP/1.1 414 URI Too Long\r\ncontent-type: text/plain; \
    charset=utf-8\r\ncontent-length: 13\r\nconnection: close\r\n\r\nURI Too Long\n";

/// `" HTTP/1.1\r"`: what follows the target on its line.
const VERSION_TAIL: usize = 10;

/// The most of the refused head read and dropped after the answer, so that the client, still
/// sending, reads the `414` instead of a reset (nginx's lingering close, bounded).
const DISCARD_AT_MOST: usize = 1 << 20;

/// A client's socket, its request lines watched.
pub(super) struct LineGuard<I, F> {
    inner: I,
    /// The number of requests begun so far, when none is in flight on an HTTP/1 connection
    /// (the bytes read now are a head's); `None` otherwise.
    between: F,
    max_uri_bytes: usize,
    /// hyper's read buffer: a request line this long can never be parsed.
    max_line: usize,
    line: Line,
    refusal: Option<Refusal>,
    /// The connection switched protocols (a WebSocket tunnel): no more heads on it.
    switched: bool,
}

/// Where the watch is in the current head's first line.
#[derive(Debug, Default)]
struct Line {
    /// The head being read: the number of requests begun before it.
    head: Option<u64>,
    /// Still in its first line, and that line looks like a request line so far.
    watching: bool,
    /// Bytes of the line so far (leading empty lines not counted).
    len: usize,
    /// Where the method ends (its space).
    method_end: Option<usize>,
}

#[derive(Debug)]
struct Refusal {
    written: usize,
    flushed: bool,
    discarded: usize,
    /// The head's end (an empty line) has been read: nothing more to drop.
    head_ended: bool,
    /// The last bytes dropped, to find an empty line across reads.
    tail: [u8; 3],
}

impl<I, F> LineGuard<I, F> {
    pub(super) fn new(inner: I, max_uri_bytes: usize, max_line: usize, between: F) -> Self {
        Self {
            inner,
            between,
            max_uri_bytes,
            max_line,
            line: Line::default(),
            refusal: None,
            switched: false,
        }
    }

    /// Note a `101` response head going out: what follows is not HTTP/1 any more.
    fn note_write(&mut self, data: &[u8]) {
        self.switched |= data.starts_with(b"HTTP/1.1 101 ");
    }
}

/// RFC 9110 5.6.2 token characters: what a method is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

impl Line {
    /// Follow `bytes` of the current head; `true` when its request line is now too long
    /// (still open, or ended in these bytes).
    fn too_long(&mut self, bytes: &[u8], max_uri_bytes: usize, max_line: usize) -> bool {
        // The usual read: a head's whole first line, shorter than any limit. Request line or
        // not, it cannot be too long, so it is not walked byte by byte.
        if self.len == 0
            && self.method_end.is_none()
            && !matches!(bytes.first(), Some(b'\r' | b'\n'))
        {
            if let Some(n) = memchr::memchr(b'\n', bytes) {
                if n <= max_uri_bytes + VERSION_TAIL && n < max_line.saturating_sub(2) {
                    self.watching = false;
                    return false;
                }
            }
        }
        let mut i = 0;
        let mut ended = false;
        while self.watching && i < bytes.len() {
            let b = bytes[i];
            match self.method_end {
                // A server ignores empty lines before a request line (RFC 9112 2.2).
                _ if self.len == 0 && (b == b'\r' || b == b'\n') => {}
                _ if b == b'\n' => {
                    self.watching = false;
                    ended = true;
                }
                None if b == b' ' && self.len > 0 => {
                    self.method_end = Some(self.len);
                    self.len += 1;
                }
                None if is_tchar(b) => self.len += 1,
                // Not a request line (an HTTP/2 preface has one, and ends the watch at its
                // first line): hyper judges it.
                None => self.watching = false,
                Some(end) if self.len == end + 1 => {
                    // origin-form `/`, asterisk-form `*`, absolute-form `http:`.
                    self.watching = matches!(b, b'/' | b'*') || b.is_ascii_alphabetic();
                    self.len += 1;
                }
                Some(_) => {
                    // The rest of the line: only its end matters.
                    let rest = &bytes[i..];
                    match memchr::memchr(b'\n', rest) {
                        Some(n) => {
                            self.len += n;
                            self.watching = false;
                            ended = true;
                        }
                        None => self.len += rest.len(),
                    }
                    break;
                }
            }
            i += 1;
        }
        let Some(end) = self.method_end else {
            return false;
        };
        // The target is at least what follows the method, less the version.
        let target = self.len.saturating_sub(end + 1);
        (self.watching || ended)
            && (target > max_uri_bytes + VERSION_TAIL || self.len >= max_line.saturating_sub(2))
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin, F: Fn() -> Option<u64> + Unpin> LineGuard<I, F> {
    /// Write the `414`, drop the rest of the head, then tell hyper the connection ended.
    fn poll_refuse(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let Some(r) = self.refusal.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        while r.written < URI_TOO_LONG.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &URI_TOO_LONG[r.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            r.written += n;
        }
        if !r.flushed {
            ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
            r.flushed = true;
        }
        let mut scratch = [0u8; 4096];
        while !r.head_ended && r.discarded < DISCARD_AT_MOST {
            let mut dropped = ReadBuf::new(&mut scratch);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut dropped))?;
            if dropped.filled().is_empty() {
                break;
            }
            r.note_dropped(dropped.filled());
        }
        // End of file for hyper: it has half a head, so it ends the connection without an
        // answer of its own.
        Poll::Ready(Ok(()))
    }
}

impl Refusal {
    /// Count `bytes` as dropped, and look for the empty line that ends the head (also where
    /// it straddles two reads).
    fn note_dropped(&mut self, bytes: &[u8]) {
        self.discarded += bytes.len();
        let ends = |hay: &[u8]| {
            hay.windows(4).any(|w| w == b"\r\n\r\n") || hay.windows(2).any(|w| w == b"\n\n")
        };
        let mut straddle = self.tail.to_vec();
        straddle.extend_from_slice(&bytes[..bytes.len().min(3)]);
        self.head_ended |= ends(&straddle) || ends(bytes);
        let mut last = self.tail.to_vec();
        last.extend_from_slice(&bytes[bytes.len().saturating_sub(3)..]);
        self.tail.copy_from_slice(&last[last.len() - 3..]);
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin, F: Fn() -> Option<u64> + Unpin> AsyncRead
    for LineGuard<I, F>
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.refusal.is_some() {
            return this.poll_refuse(cx);
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if this.switched {
            return Poll::Ready(Ok(()));
        }
        let Some(head) = (this.between)() else {
            return Poll::Ready(Ok(()));
        };
        if this.line.head != Some(head) {
            this.line = Line {
                head: Some(head),
                watching: true,
                ..Line::default()
            };
        }
        if !this.line.watching {
            return Poll::Ready(Ok(()));
        }
        let new = &buf.filled()[before..];
        if !this.line.too_long(new, this.max_uri_bytes, this.max_line) {
            return Poll::Ready(Ok(()));
        }
        tracing::debug!("request line over max_uri_bytes: 414");
        let mut refusal = Refusal {
            written: 0,
            flushed: false,
            discarded: 0,
            head_ended: false,
            tail: [0; 3],
        };
        refusal.note_dropped(new);
        this.refusal = Some(refusal);
        // hyper never sees these bytes: the head ends here for it.
        buf.set_filled(before);
        this.poll_refuse(cx)
    }
}

impl<I: AsyncWrite + Unpin, F: Unpin> AsyncWrite for LineGuard<I, F> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if !self.switched {
            self.note_write(data);
        }
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if let (false, Some(first)) = (self.switched, bufs.first()) {
            self.note_write(first);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `pieces` of one head; whether the line is found too long at some piece.
    fn judged(pieces: &[&[u8]], max_uri: usize) -> bool {
        let mut line = Line {
            head: Some(0),
            watching: true,
            ..Line::default()
        };
        pieces.iter().any(|p| line.too_long(p, max_uri, 65536))
    }

    #[test]
    fn long_targets_are_found_across_reads() {
        let long = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(200));
        assert!(judged(&[long.as_bytes()], 100));
        assert!(!judged(&[long.as_bytes()], 201), "201 bytes of target pass");
        let (a, b) = long.as_bytes().split_at(7);
        assert!(judged(&[a, b], 100));
        let bytes = long.as_bytes();
        let pieces: Vec<&[u8]> = bytes.chunks(1).collect();
        assert!(judged(&pieces, 100));
        assert!(
            judged(&[b"\r\n", long.as_bytes()], 100),
            "after an empty line"
        );
        // Over hyper's buffer, whatever max_uri_bytes says.
        let mut line = Line {
            head: Some(0),
            watching: true,
            ..Line::default()
        };
        assert!(line.too_long(long.as_bytes(), 1 << 20, 100));
    }

    #[test]
    fn a_whole_line_in_one_read_is_judged_as_byte_by_byte() {
        for target in 90..=110 {
            let line = format!(
                "GET /{} HTTP/1.1\r\nHost: a\r\n\r\n",
                "a".repeat(target - 1)
            );
            let bytes = line.as_bytes();
            let pieces: Vec<&[u8]> = bytes.chunks(1).collect();
            for (max_uri, max_line) in [(100, 65536), (1 << 20, 110), (1 << 20, 130)] {
                let whole = Line {
                    head: Some(0),
                    watching: true,
                    ..Line::default()
                }
                .too_long(bytes, max_uri, max_line);
                let mut slow = Line {
                    head: Some(0),
                    watching: true,
                    ..Line::default()
                };
                let by_byte = pieces.iter().any(|p| slow.too_long(p, max_uri, max_line));
                assert_eq!(whole, by_byte, "target {target}, {max_uri}, {max_line}");
            }
        }
    }

    #[test]
    fn what_is_not_a_long_request_line_is_left_alone() {
        let header = format!("X-Big: {}", "a".repeat(500));
        assert!(!judged(&[header.as_bytes()], 100), "a header line");
        let h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        assert!(!judged(&[h2, &[b'a'; 500]], 100));
        assert!(!judged(&[&[0x16, 0x03, 0x01], &[b'a'; 500]], 100), "TLS");
        let odd = format!("GET {} HTTP/1.1", "-".repeat(500));
        assert!(!judged(&[odd.as_bytes()], 100), "not a target");
        let ok = format!("GET /{} HTTP/1.1\r\n{}", "a".repeat(50), "b".repeat(500));
        assert!(!judged(&[ok.as_bytes()], 100), "the line ended in time");
    }

    #[test]
    fn the_end_of_the_refused_head_is_found_across_reads() {
        let mut r = Refusal {
            written: 0,
            flushed: false,
            discarded: 0,
            head_ended: false,
            tail: [0; 3],
        };
        r.note_dropped(b"aaaa\r\nHost: x\r");
        assert!(!r.head_ended);
        r.note_dropped(b"\n\r");
        assert!(!r.head_ended);
        r.note_dropped(b"\nrest");
        assert!(r.head_ended);
    }
}
