//! The connection: deadlines, failover for requests that cannot be repeated, TLS.

use std::time::Duration;

use outboxd_client::{CallOptions, Connection, IntentState, NewIntent, Outbox, proto};
use tokio::time::Instant;
use tonic::Code;

use crate::harness::{free_port, kind, stack, state};
use crate::proxy::{Cuts, Proxy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_gets_no_answer_ends_at_its_deadline() {
    let stack = stack();
    let proxy = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    proxy.freeze(true);
    let connection = Connection::builder([proxy.addr.clone()])
        .api_key(&stack.api_key)
        .call_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let started = Instant::now();
    let error = connection
        .get_intent("00000000-0000-0000-0000-000000000000")
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(Code::DeadlineExceeded), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// A frozen replica times out every try: a call whose one try spends its budget there
/// (a heartbeat's) fails, and the next call goes to the next endpoint, not to it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_spent_its_budget_on_a_frozen_endpoint_sends_the_next_elsewhere() {
    let stack = stack();
    let proxy = Proxy::start(&stack.endpoints[0], Cuts::new(0, usize::MAX)).await;
    proxy.freeze(true);
    let connection = Connection::builder([proxy.addr.clone(), stack.endpoints[1].clone()])
        .api_key(&stack.api_key)
        .build()
        .unwrap();
    let one_try =
        || CallOptions::new(Duration::from_millis(300)).budget(Duration::from_millis(300));
    let error = connection
        .call(one_try(), |mut client| async move {
            client.get_queue_stats(proto::GetQueueStatsRequest {}).await
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(Code::DeadlineExceeded), "{error}");
    connection
        .call(one_try(), |mut client| async move {
            client.get_queue_stats(proto::GetQueueStatsRequest {}).await
        })
        .await
        .expect("the next endpoint answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_endpoint_down_a_call_fails_unavailable_once_its_budget_is_spent() {
    let stack = stack();
    let dead = [free_port(), free_port()].map(|p| format!("127.0.0.1:{p}"));
    let connection = Connection::builder(dead)
        .api_key(&stack.api_key)
        .build()
        .unwrap();
    let started = Instant::now();
    let options = CallOptions::new(Duration::from_secs(1)).budget(Duration::from_secs(1));
    let error = connection
        .call(options, |mut client| async move {
            client.get_queue_stats(proto::GetQueueStatsRequest {}).await
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(Code::Unavailable), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_without_keys_moves_on_from_an_endpoint_it_could_not_reach() {
    let stack = stack();
    let dead = format!("127.0.0.1:{}", free_port());
    let connection = Connection::builder([dead, stack.endpoints[0].clone()])
        .api_key(&stack.api_key)
        .build()
        .unwrap();
    // No idempotency key: retried only because the first request was never sent.
    let result = Outbox::new(connection.clone())
        .enqueue_direct(NewIntent::new(kind("unkeyed"), "x"))
        .await
        .unwrap();
    assert_eq!(state(&connection, &result.id).await, IntentState::Pending);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_is_sent_with_every_call() {
    let stack = stack();
    let tenant = |name: &str| {
        Connection::builder(stack.endpoints.clone())
            .api_key(&stack.api_key)
            .tenant(name)
            .build()
            .unwrap()
    };
    let result = Outbox::new(tenant("default"))
        .enqueue_direct(NewIntent::new(kind("tenant"), "x"))
        .await
        .unwrap();
    assert_eq!(
        state(&tenant("default"), &result.id).await,
        IntentState::Pending
    );
    // The key acts for `default` only.
    let refused = tenant("other").get_intent(&result.id).await.unwrap_err();
    assert_eq!(refused.code(), Some(Code::PermissionDenied), "{refused}");
    assert_eq!(refused.reason().as_deref(), Some("TENANT_NOT_ALLOWED"));
}

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_a_server_whose_certificate_a_private_ca_signed() {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use tonic::transport::{Certificate, ClientTlsConfig};

    let stack = stack();
    let dir = stack
        .root
        .join(format!("tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let (cert_path, key_path) = (dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let (addr, _) = stack.start_server(
        "outboxd-tls",
        &[
            ("OUTBOX_TLS__CERT_FILE", cert_path.to_str().unwrap()),
            ("OUTBOX_TLS__KEY_FILE", key_path.to_str().unwrap()),
        ],
    );
    let endpoint = format!("https://{addr}");
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("localhost");
    let connection = Connection::builder([endpoint.clone()])
        .api_key(&stack.api_key)
        .tls(tls)
        .build()
        .unwrap();
    let result = Outbox::new(connection.clone())
        .enqueue_direct(NewIntent::new(kind("tls"), "x").idempotency_key(kind("key")))
        .await
        .unwrap();
    assert_eq!(state(&connection, &result.id).await, IntentState::Pending);

    // Without the CA the server is not trusted; plaintext is not TLS.
    let options = CallOptions::new(Duration::from_secs(2)).budget(Duration::ZERO);
    for connection in [
        Connection::builder([endpoint])
            .api_key(&stack.api_key)
            .tls(ClientTlsConfig::new().domain_name("localhost"))
            .build()
            .unwrap(),
        Connection::builder([addr])
            .api_key(&stack.api_key)
            .build()
            .unwrap(),
    ] {
        let refused = connection
            .call(options, |mut client| async move {
                client.get_queue_stats(proto::GetQueueStatsRequest {}).await
            })
            .await;
        assert!(refused.is_err(), "{refused:?}");
    }
}
