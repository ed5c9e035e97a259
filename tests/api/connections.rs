//! The listeners' connections are bounded: in number, and in how long one may stay open
//! without speaking (HTTP/2 on the gRPC listener, a request's head on the HTTP/1 ones).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use outboxd::proto::v1;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::Service as _;

use crate::helpers::{TENANT, TestApp};

/// Reads until the server closes the connection (end of stream, or a reset); how long
/// that took. Panics if it is still open after `within`.
pub(crate) async fn closed_by_the_server(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    within: Duration,
) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at((started + within).into(), stream.read(&mut buf)).await {
            Err(_) => panic!("the connection is still open after {within:?}"),
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {} // the server's SETTINGS, say
        }
    }
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_ten_seconds() {
    let app = TestApp::spawn().await;
    let mut silent = TcpStream::connect(app.addr).await.unwrap();
    let took = closed_by_the_server(&mut silent, Duration::from_secs(20)).await;
    assert!(took >= Duration::from_secs(9), "closed after {took:?}");
    // A client that speaks is served as before.
    app.client()
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
}

#[tokio::test]
async fn past_the_connection_limit_a_new_connection_is_closed_and_the_open_ones_are_served() {
    let app = TestApp::spawn_with(|s| s.limits.max_connections = 1).await;
    let mut client = app.client();
    client
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
    let mut second = TcpStream::connect(app.addr).await.unwrap();
    let took = closed_by_the_server(&mut second, Duration::from_secs(5)).await;
    assert!(took < Duration::from_secs(5));
    client
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .unwrap();
}

/// A call whose request never ends (a message announced, none of it sent) is cut past
/// twice the longest a call may take (the longest wait and operator statement), not held.
#[tokio::test]
async fn a_call_whose_request_never_ends_is_cut() {
    let app = TestApp::spawn_with(|s| {
        s.limits.max_wait = Duration::from_secs(1);
        s.limits.operator_timeout = Duration::from_secs(1);
    })
    .await;
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let announced = prost::bytes::Bytes::from_static(&[0, 0, 0, 0, 100]);
    let frames =
        futures::stream::once(
            async move { Ok::<_, Infallible>(http_body::Frame::data(announced)) },
        )
        .chain(futures::stream::pending());
    let request = http::Request::builder()
        .method("POST")
        .uri("/outbox.v1.OutboxService/GetQueueStats")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {key}"))
        .body(tonic::body::Body::new(http_body_util::StreamBody::new(
            frames,
        )))
        .unwrap();
    let mut channel = app.client_channel().await;
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    let started = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(20), channel.call(request))
        .await
        .expect("the stalled call was never cut")
        .unwrap();
    let status = tonic::Status::from_header_map(response.headers()).expect("a status");
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// The console and the admin endpoint, both on, each keeping at most 4 connections open.
async fn http_listeners() -> (TestApp, [std::net::SocketAddr; 2]) {
    let app = TestApp::spawn_with(|s| {
        s.console.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        s.limits.max_http_connections = 4;
    })
    .await;
    let addrs = [app.metrics_addr.unwrap(), app.console_addr.unwrap()];
    (app, addrs)
}

/// On the HTTP/1 listeners a request's head must arrive within ten seconds of the
/// connection being ready for it: accepted, or done with its last answer.
#[tokio::test]
async fn an_http_connection_that_stalls_its_request_or_idles_is_closed_after_ten_seconds() {
    let (app, addrs) = http_listeners().await;
    let mut cases = Vec::new();
    for addr in addrs {
        cases.push(("silent", addr, String::new()));
        cases.push((
            "head cut short",
            addr,
            "GET /livez HTTP/1.1\r\nHost: x\r\n".to_owned(),
        ));
        cases.push((
            "answered, then idle",
            addr,
            "GET /livez HTTP/1.1\r\nHost: x\r\n\r\n".to_owned(),
        ));
    }
    let closed = cases.into_iter().map(|(case, addr, sent)| async move {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(sent.as_bytes()).await.unwrap();
        let took = closed_by_the_server(&mut stream, Duration::from_secs(30)).await;
        assert!(
            took >= Duration::from_secs(9),
            "{case} on {addr}: closed after {took:?}"
        );
    });
    futures::future::join_all(closed).await;
    assert_eq!(app.admin_get("/livez", None).await.0, 200);
}

/// Each HTTP/1 listener keeps at most `OUTBOX_LIMITS__MAX_HTTP_CONNECTIONS` open: past them
/// a new one is closed as it is accepted, and once one closes the listener serves again.
#[tokio::test]
async fn past_the_http_connection_limit_a_new_one_is_closed_until_one_closes() {
    let (app, addrs) = http_listeners().await;
    for addr in addrs {
        let mut open = Vec::new();
        for _ in 0..4 {
            open.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut one_more = TcpStream::connect(addr).await.unwrap();
        let took = closed_by_the_server(&mut one_more, Duration::from_secs(5)).await;
        assert!(took < Duration::from_secs(5), "{addr}");
        drop(open.pop());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !answers(addr).await {
            assert!(
                Instant::now() < deadline,
                "{addr} serves nobody after one closed"
            );
        }
    }
    drop(app);
}

/// Whether a GET of `/livez` on a new connection to `addr` is answered (the admin
/// endpoint's 200, the console's 404).
async fn answers(addr: std::net::SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return false;
    };
    let request = format!("GET /livez HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let mut answer = Vec::new();
    stream.write_all(request.as_bytes()).await.is_ok()
        && stream.read_to_end(&mut answer).await.is_ok()
        && answer.starts_with(b"HTTP/1.1 ")
}
