//! HTTPS for the console with the gRPC listener's certificate. Handshakes run in tasks of
//! their own, at most [`HANDSHAKES`] at once and each within [`HANDSHAKE_TIMEOUT`], so a
//! client that stalls one cannot hold the others up.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, pki_types::pem::PemObject};
use tokio_rustls::server::TlsStream;

use crate::config::TlsSettings;

const HANDSHAKES: usize = 64;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS acceptor for the certificate and key of `tls` (client certificates are not
/// asked for: the console signs in with an API key).
///
/// # Errors
/// The files cannot be read or are not a certificate chain and its key.
pub fn tls_acceptor(tls: &TlsSettings) -> anyhow::Result<TlsAcceptor> {
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(&tls.cert_file)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("cannot read certificates from {}", tls.cert_file.display()))?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&tls.key_file)
        .with_context(|| format!("cannot read a private key from {}", tls.key_file.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the console's certificate and key do not match")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Connections whose handshake finished, for `axum::serve`.
pub(super) struct TlsListener {
    done: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
}

impl TlsListener {
    pub fn new(mut listener: TcpListener, acceptor: TlsAcceptor) -> Self {
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
                let (acceptor, sender) = (acceptor.clone(), send.clone());
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
