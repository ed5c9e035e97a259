//! The gRPC listener's connections are bounded: in number, and in how long one may stay
//! open without speaking HTTP/2.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use outboxd::proto::v1;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tower::Service as _;

use crate::helpers::{TENANT, TestApp};

/// Reads until the server closes the connection (end of stream, or a reset); how long
/// that took. Panics if it is still open after `within`.
async fn closed_by_the_server(stream: &mut TcpStream, within: Duration) -> Duration {
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
