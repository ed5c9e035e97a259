//! The server's certificate, key and client CA, read again when their files change, so that
//! a certificate renewed on disk (a mounted Secret cert-manager renewed) is served without a
//! restart: a handshake at least a second after the last look reads the files again, and
//! new connections get what they now hold. Connections open keep the one they began with.
//! One instance serves both listeners, so they never serve different certificates.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

use crate::config::TlsSettings;

/// How often, at most, the files are read again (on a handshake, not on a timer).
const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// The listeners that speak TLS.
#[derive(Debug, Clone, Copy)]
pub enum Listener {
    /// HTTP/2, with client certificates when a client CA is set (mTLS).
    Grpc,
    /// HTTP/1.1, never asking for a client certificate: the console signs in with a key.
    Console,
}

/// The TLS configuration of the listeners, from the `OUTBOX_TLS__*` files.
pub struct TlsFiles {
    settings: TlsSettings,
    current: Mutex<Current>,
}

struct Current {
    /// What the files held when the configurations were built from them.
    read: Vec<Vec<u8>>,
    grpc: Arc<ServerConfig>,
    console: Arc<ServerConfig>,
    checked: Instant,
    /// The last problem reported, so that one that lasts is logged once; and the files'
    /// contents it was found in, not built again while they stay.
    problem: Option<String>,
    refused: Vec<Vec<u8>>,
}

impl TlsFiles {
    /// Reads the files of `settings`.
    ///
    /// # Errors
    /// The files cannot be read, or are not a certificate chain, its key and a CA.
    pub fn load(settings: &TlsSettings) -> anyhow::Result<Self> {
        let read = read_files(settings)?;
        let (grpc, console) = server_configs(settings, &read)?;
        Ok(Self {
            settings: settings.clone(),
            current: Mutex::new(Current {
                read,
                grpc,
                console,
                checked: Instant::now(),
                problem: None,
                refused: Vec::new(),
            }),
        })
    }

    /// An acceptor for `listener` with what the files hold now. Files that cannot be read
    /// or used (a renewal half written) leave the last good configuration in place, with a
    /// warning.
    pub fn acceptor(&self, listener: Listener) -> TlsAcceptor {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.checked.elapsed() >= RECHECK_EVERY {
            current.checked = Instant::now();
            let problem = match read_files(&self.settings) {
                Ok(read) if read == current.read => None,
                Ok(read) if read == current.refused => current.problem.clone(),
                Ok(read) => match server_configs(&self.settings, &read) {
                    Ok((grpc, console)) => {
                        tracing::info!(
                            tls.cert_file = %self.settings.cert_file.display(),
                            "TLS certificate files changed: new connections use them"
                        );
                        (current.grpc, current.console) = (grpc, console);
                        current.read = read;
                        None
                    }
                    Err(e) => {
                        current.refused = read;
                        Some(format!("{e:#}"))
                    }
                },
                Err(e) => Some(format!("{e:#}")),
            };
            if problem.is_some() && problem != current.problem {
                tracing::warn!(
                    error.message = problem.as_deref(),
                    "TLS certificate files cannot be used; serving the previous ones"
                );
            }
            current.problem = problem;
        }
        TlsAcceptor::from(match listener {
            Listener::Grpc => current.grpc.clone(),
            Listener::Console => current.console.clone(),
        })
    }
}

/// The certificate, the key and the client CA (when set), as they are on disk.
fn read_files(settings: &TlsSettings) -> anyhow::Result<Vec<Vec<u8>>> {
    [
        Some(&settings.cert_file),
        Some(&settings.key_file),
        settings.client_ca_file.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(|path| std::fs::read(path).with_context(|| format!("cannot read {}", path.display())))
    .collect()
}

/// The gRPC listener's configuration and the console's: with a client CA, a gRPC client
/// must present a certificate chaining to it (mTLS).
fn server_configs(
    settings: &TlsSettings,
    read: &[Vec<u8>],
) -> anyhow::Result<(Arc<ServerConfig>, Arc<ServerConfig>)> {
    let [cert, key, client_ca @ ..] = read else {
        unreachable!("read_files reads the certificate and the key");
    };
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .filter(|certs| !certs.is_empty())
        .with_context(|| format!("no certificates in {}", settings.cert_file.display()))?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .with_context(|| format!("no private key in {}", settings.key_file.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = || {
        ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()
    };
    let grpc = match client_ca {
        [] => builder()?.with_no_client_auth(),
        [ca, ..] => {
            // As tonic did: a file that is not PEM is refused, certificates in it that do
            // not parse are skipped.
            let ca = CertificateDer::pem_slice_iter(ca)
                .collect::<Result<Vec<_>, _>>()
                .context("the client CA file is not PEM certificates")?;
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(ca);
            let verifier =
                WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
                    .build()
                    .context("the client CA file holds no usable CA certificate")?;
            builder()?.with_client_cert_verifier(verifier)
        }
    };
    let config = |builder: rustls::ConfigBuilder<ServerConfig, rustls::server::WantsServerCert>,
                  alpn: &[u8]| {
        let mut config = builder
            .with_single_cert(certs.clone(), key.clone_key())
            .context("the certificate and the key do not match")?;
        config.alpn_protocols = vec![alpn.to_vec()];
        anyhow::Ok(Arc::new(config))
    };
    Ok((
        config(grpc, b"h2")?,
        config(builder()?.with_no_client_auth(), b"http/1.1")?,
    ))
}
