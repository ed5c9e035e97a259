//! HTTPS for the console with the gRPC listener's certificate files. Handshakes run in tasks of
//! their own, at most [`HANDSHAKES`] at once and each within [`HANDSHAKE_TIMEOUT`], so a
//! client that stalls one cannot hold the others up.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;

use crate::tls::TlsFiles;

const HANDSHAKES: usize = 64;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections whose handshake finished, for `axum::serve`.
pub(super) struct TlsListener {
    done: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
}

impl TlsListener {
    pub fn new(mut listener: TcpListener, tls: Arc<TlsFiles>) -> Self {
        let local_addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (send, done) = mpsc::channel(HANDSHAKES);
        let permits = Arc::new(Semaphore::new(HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (stream, addr) = Listener::accept(&mut listener).await;
                let (acceptor, sender) = (tls.acceptor(), send.clone());
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                    if let Ok(Ok(tls)) = handshake.await {
                        let _ = sender.send((tls, addr)).await;
                    }
                    drop(permit);
                });
                if send.is_closed() {
                    return;
                }
            }
        });
        Self { done, local_addr }
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.done.recv().await {
            Some(accepted) => accepted,
            // The accepting task ends only with the listener's owner gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}
