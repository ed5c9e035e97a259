//! The server's certificate, key and client CA, read again when their files change, so that
//! a certificate renewed on disk (a mounted Secret cert-manager renewed) is served without a
//! restart: a handshake at least a second after the last look reads the files again, and
//! new connections get what they now hold. Connections open keep the one they began with.

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

/// The TLS configuration of one listener, from `OUTBOX_TLS__*` files.
pub struct TlsFiles {
    settings: TlsSettings,
    /// The application protocol the listener speaks (`h2`, `http/1.1`).
    alpn: &'static [u8],
    current: Mutex<Current>,
}

struct Current {
    /// What the files held when `config` was built from them.
    read: Vec<Vec<u8>>,
    config: Arc<ServerConfig>,
    checked: Instant,
}

impl TlsFiles {
    /// Reads the files of `settings` for a listener speaking `alpn`.
    ///
    /// # Errors
    /// The files cannot be read, or are not a certificate chain, its key and a CA.
    pub fn load(settings: &TlsSettings, alpn: &'static [u8]) -> anyhow::Result<Self> {
        let read = read_files(settings)?;
        let config = Arc::new(server_config(settings, &read, alpn)?);
        Ok(Self {
            settings: settings.clone(),
            alpn,
            current: Mutex::new(Current {
                read,
                config,
                checked: Instant::now(),
            }),
        })
    }

    /// An acceptor with what the files hold now. Files that cannot be read or used (a
    /// renewal half written) leave the last good configuration in place, with a warning.
    pub fn acceptor(&self) -> TlsAcceptor {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.checked.elapsed() >= RECHECK_EVERY {
            current.checked = Instant::now();
            match read_files(&self.settings) {
                Ok(read) if read != current.read => {
                    match server_config(&self.settings, &read, self.alpn) {
                        Ok(config) => {
                            tracing::info!(
                                tls.cert_file = %self.settings.cert_file.display(),
                                "TLS certificate files changed: new connections use them"
                            );
                            current.config = Arc::new(config);
                        }
                        Err(e) => tracing::warn!(
                            error.message = format!("{e:#}"),
                            "TLS certificate files changed but cannot be used; \
                             serving the previous ones"
                        ),
                    }
                    current.read = read;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    error.message = format!("{e:#}"),
                    "TLS certificate files cannot be read; serving the previous ones"
                ),
            }
        }
        TlsAcceptor::from(current.config.clone())
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

/// With a client CA, a client must present a certificate chaining to it (mTLS).
fn server_config(
    settings: &TlsSettings,
    read: &[Vec<u8>],
    alpn: &[u8],
) -> anyhow::Result<ServerConfig> {
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
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        [] => builder.with_no_client_auth(),
        [ca, ..] => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca) {
                roots
                    .add(cert.context("the client CA file is not PEM certificates")?)
                    .context("the client CA file holds an unusable certificate")?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .context("the client CA file holds no usable CA")?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .context("the certificate and the key do not match")?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}
