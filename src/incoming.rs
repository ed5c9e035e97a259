//! The gRPC listener's connections: at most so many open at once, each to send its first
//! bytes soon after it is accepted.
//!
//! A connection that sends nothing is never pinged (HTTP/2 keep-alive begins after the
//! preface), so without a deadline it would stay open for good; and past the process's
//! file descriptors every accept fails at once, again and again.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::tls::TlsFiles;

/// How long an accepted connection has to send the HTTP/2 preface (or a TLS hello).
const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(10);

/// Bytes of the HTTP/2 client preface: a connection that sent them is past the handshake,
/// where keep-alive pings take over.
const FIRST_BYTES: usize = 24;

/// How long a TLS handshake may take, and how many run at once: past them accepting waits,
/// so clients that stall handshakes delay others by at most this long, never hold them.
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);
const HANDSHAKES: usize = 1024;

/// How long the listener pauses after a failed accept (out of file descriptors, say), so
/// that a failure that lasts is not retried in a busy loop.
const AFTER_FAILED_ACCEPT: Duration = Duration::from_millis(50);

/// The connections of `listener`, at most `max` open at once: past it, a new connection is
/// closed as it is accepted (its client tries again, or another replica).
pub fn admitted(listener: TcpListener, max: usize) -> impl Stream<Item = io::Result<Admitted>> {
    let slots = Arc::new(Semaphore::new(max));
    TcpListenerStream::new(listener).filter_map(move |accepted| {
        let slots = slots.clone();
        async move {
            match accepted {
                Ok(stream) => admit(stream, slots).map(Ok),
                Err(e) => {
                    tracing::warn!(error.message = %e, "accepting a connection failed");
                    tokio::time::sleep(AFTER_FAILED_ACCEPT).await;
                    None
                }
            }
        }
    })
}

/// The connections of `admitted` once their TLS handshake with `tls`'s files of the moment
/// has finished; those that fail it or run out of time are closed.
pub fn handshaken(
    admitted: impl Stream<Item = io::Result<Admitted>>,
    tls: Arc<TlsFiles>,
) -> impl Stream<Item = io::Result<TlsStream<Admitted>>> {
    admitted
        .map(move |connection| {
            let acceptor = tls.acceptor();
            async move {
                let connection = connection.ok()?;
                match tokio::time::timeout(HANDSHAKE_WITHIN, acceptor.accept(connection)).await {
                    Ok(Ok(tls)) => Some(Ok(tls)),
                    Ok(Err(e)) => {
                        tracing::debug!(error.message = %e, "TLS handshake failed");
                        None
                    }
                    Err(_) => {
                        tracing::debug!("TLS handshake not finished in time");
                        None
                    }
                }
            }
        })
        .buffer_unordered(HANDSHAKES)
        .filter_map(std::future::ready)
}

fn admit(stream: TcpStream, slots: Arc<Semaphore>) -> Option<Admitted> {
    let Ok(slot) = slots.try_acquire_owned() else {
        tracing::debug!("connection closed: OUTBOX_LIMITS__MAX_CONNECTIONS are open");
        return None;
    };
    // tonic sets TCP_NODELAY only on listeners it binds itself. Without it, Nagle holds
    // small responses for the peer's delayed ACK (~40 ms a call).
    let _ = stream.set_nodelay(true);
    Some(Admitted {
        stream,
        first_bytes: Some((
            FIRST_BYTES,
            Box::pin(tokio::time::sleep(FIRST_BYTES_WITHIN)),
        )),
        _slot: slot,
    })
}

/// An accepted connection, holding its slot until it closes.
#[derive(Debug)]
pub struct Admitted {
    stream: TcpStream,
    /// Until its first bytes have arrived: how many are still awaited, and by when.
    first_bytes: Option<(usize, Pin<Box<Sleep>>)>,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some((awaited, deadline)) = &mut this.first_bytes {
            if read.is_ready() {
                *awaited = awaited.saturating_sub(buf.filled().len() - before);
                if *awaited == 0 {
                    this.first_bytes = None;
                }
            } else if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent no HTTP/2 preface in time",
                )));
            }
        }
        read
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
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

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl Connected for Admitted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}
