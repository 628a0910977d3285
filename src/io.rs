//! Socket wrappers shared by the server and the WebSocket tunnel.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A socket that calls `noted` whenever a read brings bytes: the connection watchdog's view of
/// a request head in progress, and a WebSocket tunnel's idle clock.
pub(crate) struct ReadNoted<I, F> {
    inner: I,
    noted: F,
}

impl<I, F: Fn()> ReadNoted<I, F> {
    pub(crate) fn new(inner: I, noted: F) -> Self {
        Self { inner, noted }
    }
}

impl<I: AsyncRead + Unpin, F: Fn() + Unpin> AsyncRead for ReadNoted<I, F> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            (self.noted)();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin, F: Unpin> AsyncWrite for ReadNoted<I, F> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
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
