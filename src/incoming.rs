//! The listeners' connections: at most so many open at once, each to send its first bytes
//! soon after it is accepted (and again after its TLS handshake), handshakes so many at
//! once and each within a deadline.
//!
//! A gRPC connection that sends nothing is never pinged (HTTP/2 keep-alive begins after
//! the preface), so without a deadline it would stay open for good; and past the process's
//! file descriptors every accept fails at once, again and again.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::tls::{Listener, TlsFiles};

/// How long an accepted connection has to send its first bytes, and a TLS handshake to
/// finish.
const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(10);

/// Bytes of the HTTP/2 client preface: a gRPC connection that sent them is past the
/// handshake, where keep-alive pings take over. (After a TLS handshake they count as they
/// come over the wire, in records.)
pub const HTTP2_PREFACE: usize = 24;

/// TLS handshakes under way at once: past them accepting waits, so that clients stalling
/// handshakes delay others by at most [`FIRST_BYTES_WITHIN`], never hold them.
const HANDSHAKES: usize = 1024;

/// How long the listener pauses after a failed accept (out of file descriptors, say), so
/// that a failure that lasts is not retried in a busy loop.
const AFTER_FAILED_ACCEPT: Duration = Duration::from_millis(50);

/// The connections of `listener`, at most `max` open at once (past it, a new connection is
/// closed as it is accepted: its client tries again, or another replica), each closed if
/// it has not sent `first_bytes` within 10 s (0: no deadline).
pub fn admitted(
    listener: TcpListener,
    max: usize,
    first_bytes: usize,
) -> impl Stream<Item = io::Result<Admitted>> {
    let slots = Arc::new(Semaphore::new(max));
    TcpListenerStream::new(listener)
        .then(move |accepted| {
            let slots = slots.clone();
            async move {
                match accepted {
                    Ok(stream) => admit(stream, slots, first_bytes),
                    Err(e) => {
                        tracing::warn!(error.message = %e, "accepting a connection failed");
                        tokio::time::sleep(AFTER_FAILED_ACCEPT).await;
                        None
                    }
                }
            }
        })
        .filter_map(|admitted| admitted.map(Ok))
}

/// The connections of `admitted` once their TLS handshake as `listener` has finished, each
/// in a task of its own and within 10 s; each then closed if it has not sent `first_bytes`
/// within 10 s more. Those that fail are closed.
pub fn handshaken(
    admitted: impl Stream<Item = io::Result<Admitted>> + Send + 'static,
    tls: Arc<TlsFiles>,
    listener: Listener,
    first_bytes: usize,
) -> impl Stream<Item = io::Result<TlsStream<Admitted>>> {
    let (done, handshaken) = mpsc::channel(HANDSHAKES);
    let under_way = Arc::new(Semaphore::new(HANDSHAKES));
    tokio::spawn(async move {
        tokio::pin!(admitted);
        loop {
            // Ends with the stream's reader, whatever it waits for, so that the listener is
            // closed with it.
            let permit = tokio::select! {
                biased;
                () = done.closed() => return,
                permit = under_way.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let connection = tokio::select! {
                biased;
                () = done.closed() => return,
                next = admitted.next() => match next {
                    Some(Ok(connection)) => connection,
                    Some(Err(_)) => continue,
                    None => return,
                },
            };
            let (acceptor, done) = (tls.acceptor(listener), done.clone());
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(FIRST_BYTES_WITHIN, acceptor.accept(connection));
                match handshake.await {
                    Ok(Ok(mut tls)) => {
                        tls.get_mut().0.await_bytes(first_bytes);
                        let _ = done.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error.message = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake not finished in time"),
                }
                drop(permit);
            });
        }
    });
    ReceiverStream::new(handshaken)
}

fn admit(stream: TcpStream, slots: Arc<Semaphore>, first_bytes: usize) -> Option<Admitted> {
    let Ok(slot) = slots.try_acquire_owned() else {
        tracing::debug!("connection closed: its listener's most connections are open");
        return None;
    };
    // tonic sets TCP_NODELAY only on listeners it binds itself. Without it, Nagle holds
    // small responses for the peer's delayed ACK (~40 ms a call).
    let _ = stream.set_nodelay(true);
    let mut admitted = Admitted {
        stream,
        first_bytes: None,
        _slot: slot,
    };
    admitted.await_bytes(first_bytes);
    Some(admitted)
}

/// An accepted connection, holding its slot until it closes.
#[derive(Debug)]
pub struct Admitted {
    stream: TcpStream,
    /// Until its first bytes have arrived: how many are still awaited, and by when.
    first_bytes: Option<(usize, Pin<Box<Sleep>>)>,
    _slot: OwnedSemaphorePermit,
}

impl Admitted {
    /// From now, closes the connection unless `n` bytes arrive within 10 s (0: none
    /// awaited).
    fn await_bytes(&mut self, n: usize) {
        self.first_bytes = (n > 0).then(|| (n, Box::pin(tokio::time::sleep(FIRST_BYTES_WITHIN))));
    }
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
                    "the client sent too little in time",
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
