//! Transport security: TLS with certificates generated in the test, and mTLS refusing
//! clients without a certificate from the configured CA.

use std::path::{Path, PathBuf};

use outboxd::client::{self, Credentials};
use outboxd::config::TlsSettings;
use outboxd::proto::v1;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::helpers::TestApp;

/// A CA and certificates it signed, written as PEM files in a fresh directory.
struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Self {
        // In the run's scratch directory, removed at its end even if this test fails.
        let dir =
            crate::helpers::scratch_dir().join(format!("tls-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Self { dir, ca }
    }

    /// Writes `<name>.pem` and `<name>.key` for a leaf certificate; returns (cert, key) paths.
    fn leaf(&self, name: &str, purpose: ExtendedKeyUsagePurpose) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (cert_path, key_path) = (
            self.dir.join(format!("{name}.pem")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pem(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

/// A server with TLS from a leaf of `pki`, asking clients for a certificate of `pki`'s CA
/// with `mtls`, and its console on a loopback port with `console`; the leaf's files.
async fn tls_app(pki: &Pki, mtls: bool, console: bool) -> (TestApp, PathBuf, PathBuf) {
    let (cert_file, key_file) = pki.leaf("server", ExtendedKeyUsagePurpose::ServerAuth);
    let tls = TlsSettings {
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        client_ca_file: mtls.then(|| pki.ca_path()),
    };
    let app = TestApp::spawn_with(|s| {
        s.tls = Some(tls);
        if console {
            s.console.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        }
    })
    .await;
    (app, cert_file, key_file)
}

/// Calls GetQueueStats over a channel built from `tls` (None: plaintext); Ok if it answered.
async fn call(app: &TestApp, key: &str, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint =
        Channel::from_shared(format!("{scheme}://localhost:{}", app.addr.port())).unwrap();
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut c = client::client(channel, Credentials::new(Some(key), None).unwrap());
    c.get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .map(|_| ())
        .map_err(|s| format!("{s:?}"))
}

#[tokio::test]
async fn tls_serves_clients_that_trust_its_ca_and_refuses_plaintext() {
    let pki = Pki::new();
    let (app, _, server_key) = tls_app(&pki, false, false).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;

    let trusted = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pem(&pki.ca_path())))
        .domain_name("localhost");
    call(&app, &key, Some(trusted)).await.unwrap();
    assert!(
        call(&app, &key, None).await.is_err(),
        "plaintext must be refused"
    );
    let stranger = Pki::new();
    let untrusted = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pem(&stranger.ca_path())))
        .domain_name("localhost");
    assert!(
        call(&app, &key, Some(untrusted)).await.is_err(),
        "a server the client cannot verify"
    );

    // The CLI: trusting the CA given, or else the system's trust store, which knows
    // nothing of this test's CA.
    let server = format!("https://localhost:{}", app.addr.port());
    let ca = pki.ca_path();
    let cli = |ca: Option<&Path>| {
        let mut args = vec!["stats", "--server", &server, "--api-key", &key];
        if let Some(ca) = ca {
            args.extend(["--ca-file", ca.to_str().unwrap()]);
        }
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            crate::commands::outboxd(&args, &[]).await
        }
    };
    let trusted = cli(Some(&ca)).await;
    assert!(
        trusted.status.success(),
        "{}",
        String::from_utf8_lossy(&trusted.stderr)
    );
    let system = cli(None).await;
    let stderr = String::from_utf8_lossy(&system.stderr);
    assert!(!system.status.success());
    assert!(stderr.contains("certificate"), "{stderr}");

    // A CA file that is no certificate (the server's key), or one given for a plaintext
    // server (where the key would travel in the clear), is refused before any call.
    let not_a_ca = cli(Some(&server_key)).await;
    let stderr = String::from_utf8_lossy(&not_a_ca.stderr);
    assert!(
        !not_a_ca.status.success() && stderr.contains("holds no PEM CERTIFICATE"),
        "{stderr}"
    );
    let plain = format!("http://localhost:{}", app.addr.port());
    let args = [
        "stats",
        "--server",
        &plain,
        "--api-key",
        &key,
        "--ca-file",
        ca.to_str().unwrap(),
    ];
    let in_the_clear = crate::commands::outboxd(&args, &[]).await;
    let stderr = String::from_utf8_lossy(&in_the_clear.stderr);
    assert!(
        !in_the_clear.status.success() && stderr.contains("are for an https:// server"),
        "{stderr}"
    );
}

#[tokio::test]
async fn mtls_refuses_clients_without_a_certificate_from_the_configured_ca() {
    let pki = Pki::new();
    let (app, _, _) = tls_app(&pki, true, true).await;
    // The console asks for no client certificate: it signs in with a key.
    handshake(app.console_addr.unwrap(), &pki).await.unwrap();
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let base = || {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(pem(&pki.ca_path())))
            .domain_name("localhost")
    };

    let (client_cert, client_key) = pki.leaf("client", ExtendedKeyUsagePurpose::ClientAuth);
    let with_cert = base().identity(Identity::from_pem(pem(&client_cert), pem(&client_key)));
    call(&app, &key, Some(with_cert)).await.unwrap();

    assert!(
        call(&app, &key, Some(base())).await.is_err(),
        "no client certificate"
    );
    let rogue = Pki::new();
    let (rogue_cert, rogue_key) = rogue.leaf("client", ExtendedKeyUsagePurpose::ClientAuth);
    let forged = base().identity(Identity::from_pem(pem(&rogue_cert), pem(&rogue_key)));
    assert!(
        call(&app, &key, Some(forged)).await.is_err(),
        "a certificate from another CA"
    );

    // The CLI presents its certificate with --cert-file and --key-file.
    let server = format!("https://localhost:{}", app.addr.port());
    let (ca, cert, cert_key) = (pki.ca_path(), client_cert, client_key);
    let base_args = [
        "stats",
        "--server",
        &server,
        "--api-key",
        &key,
        "--ca-file",
        ca.to_str().unwrap(),
    ];
    let with = [
        &base_args[..],
        &[
            "--cert-file",
            cert.to_str().unwrap(),
            "--key-file",
            cert_key.to_str().unwrap(),
        ],
    ]
    .concat();
    let output = crate::commands::outboxd(&with, &[]).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = crate::commands::outboxd(&base_args, &[]).await;
    assert!(!output.status.success(), "no client certificate");
}

#[tokio::test]
async fn the_console_serves_https_with_the_grpc_certificate_and_a_secure_cookie() {
    let pki = Pki::new();
    let (app, _, _) = tls_app(&pki, false, true).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = crate::browser::Browser::open_https(app.console_addr.unwrap()).await;
    browser.sign_in(&key).await;
    assert_eq!(browser.path().await, "/");
    let cookies = browser.client.get_all_cookies().await.unwrap();
    let session = cookies
        .iter()
        .find(|c| c.name() == "outboxd_session")
        .expect("signed in");
    assert_eq!(session.secure(), Some(true));
    assert_eq!(session.http_only(), Some(true));
    browser.close().await;
}

/// A TLS handshake with `addr` by a client trusting only `pki`'s CA, presenting no
/// certificate and speaking nothing after it: what certificate the listener serves.
async fn handshake(addr: std::net::SocketAddr, pki: &Pki) -> Result<(), String> {
    tls_connection(addr, pki).await.map(drop)
}

/// The connection of [`handshake`], open.
async fn tls_connection(
    addr: std::net::SocketAddr,
    pki: &Pki,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(
            pki.ca.der().to_vec(),
        ))
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())
}

/// A certificate renewed on disk (a mounted Secret that cert-manager renewed) is served to
/// new connections without a restart, on the gRPC listener and the console's; files caught
/// half written leave the last good ones in place; connections open keep working.
#[tokio::test]
async fn a_certificate_renewed_on_disk_is_served_to_new_connections_without_a_restart() {
    let pki = Pki::new();
    let (app, cert_file, key_file) = tls_app(&pki, false, true).await;
    let console = app.console_addr.unwrap();
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let trusting = |pki: &Pki| {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(pem(&pki.ca_path())))
            .domain_name("localhost")
    };
    call(&app, &key, Some(trusting(&pki))).await.unwrap();
    let open = Channel::from_shared(format!("https://localhost:{}", app.addr.port()))
        .unwrap()
        .tls_config(trusting(&pki))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut open = client::client(open, Credentials::new(Some(&key), None).unwrap());

    // Half written: the files are read again (a second after the last look), found
    // unusable, and the previous certificate is served on.
    std::fs::write(&cert_file, "-----BEGIN CERTIFICATE-----\nMIIB").unwrap();
    let written = std::time::Instant::now();
    while written.elapsed() < std::time::Duration::from_millis(1500) {
        call(&app, &key, Some(trusting(&pki))).await.unwrap();
        handshake(console, &pki).await.unwrap();
    }

    // Renewed, here by another CA so that which certificate a connection got is plain.
    let renewed = Pki::new();
    let (new_cert, new_key) = renewed.leaf("server", ExtendedKeyUsagePurpose::ServerAuth);
    std::fs::copy(&new_key, &key_file).unwrap();
    std::fs::copy(&new_cert, &cert_file).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while call(&app, &key, Some(trusting(&renewed))).await.is_err()
        || handshake(console, &renewed).await.is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the renewed certificate is not served"
        );
    }
    assert!(call(&app, &key, Some(trusting(&pki))).await.is_err());
    assert!(handshake(console, &pki).await.is_err());
    open.get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .expect("a connection open before the renewal goes on");
}

/// A client that begins a handshake and stalls it (past the 24 bytes the listener awaits
/// of every connection), or finishes it and then sends nothing (no HTTP/2 preface, so no
/// keep-alive ping either), is closed after ten seconds, not held.
#[tokio::test]
async fn a_tls_connection_stalled_in_or_after_its_handshake_is_closed_after_ten_seconds() {
    use tokio::io::AsyncWriteExt as _;
    let pki = Pki::new();
    let (app, _, _) = tls_app(&pki, false, false).await;
    let mut stalled = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    // A handshake record announcing 512 bytes, of which 27 come.
    let mut hello = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
    hello.resize(32, 0);
    stalled.write_all(&hello).await.unwrap();
    let mut silent = tls_connection(app.addr, &pki).await.unwrap();
    let within = std::time::Duration::from_secs(30);
    let (in_handshake, after_it) = tokio::join!(
        crate::connections::closed_by_the_server(&mut stalled, within),
        crate::connections::closed_by_the_server(&mut silent, within),
    );
    for took in [in_handshake, after_it] {
        assert!(took >= std::time::Duration::from_secs(9), "{took:?}");
    }
}
