//! The daemon's listener: at most [`MAX_CONNECTIONS`] connections at once. Past that, a new
//! connection waits in the kernel's backlog until one closes. A connection that sends nothing
//! within [`FIRST_BYTE_TIMEOUT`] is closed, so that idle ones cannot hold every place.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a new connection has to send its first byte.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(30);

/// A TCP listener that holds a permit per open connection.
#[derive(Debug)]
pub struct Bounded {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    first_byte: Duration,
}

impl Bounded {
    /// `inner`, serving at most `max` connections at once, each closed if it sends nothing
    /// within `first_byte` ([`MAX_CONNECTIONS`] and [`FIRST_BYTE_TIMEOUT`] for the daemon).
    pub fn new(inner: TcpListener, max: usize, first_byte: Duration) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            first_byte,
        }
    }
}

/// A connection and its permit, given back when it closes.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// Until the first byte comes.
    first_byte: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl axum::serve::Listener for Bounded {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (
            Connection {
                stream,
                _permit: permit,
                first_byte: Some(Box::pin(tokio::time::sleep(self.first_byte))),
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        let Some(deadline) = self.first_byte.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.first_byte = None;
                Poll::Ready(Ok(()))
            }
            // (Polled while the read waits, so that the deadline wakes this connection.)
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request within the first-byte timeout",
                )))
            }
            other => other,
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn listener_bounds_connections_and_closes_a_silent_one() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = Bounded::new(tcp, 1, Duration::from_millis(200));
        let _silent = TcpStream::connect(addr).await.expect("connect");
        let (mut first, _) = listener.accept().await;
        // A second connection waits for the first's place.
        let mut talker = TcpStream::connect(addr).await.expect("connect");
        talker.write_all(b"x").await.expect("write");
        let second = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(
            second.is_err(),
            "a second connection was accepted past the bound"
        );
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), first.read(&mut byte))
            .await
            .expect("the deadline ended the read");
        assert_eq!(read.expect_err("timed out").kind(), io::ErrorKind::TimedOut);
        drop(first);
        let (mut second, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("accepted once the first closed");
        // One that talks keeps its connection past the deadline.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(second.read(&mut byte).await.expect("read"), 1);
        assert_eq!(&byte, b"x");
    }
}
