//! One request must not take the server's memory: a real `outboxd` process (the built
//! binary, so that its peak RSS is its own; a new one for each request) gets each hostile
//! request of issue 25, and its peak resident set (`VmHWM`) may pass its idle level by at
//! most 64 MiB; a burst of 8 of each in parallel leaves it answering.
//! `MEMORY_TEST_OUTBOXD` runs another build (an older one, to compare: each request
//! alone, no bursts, which could take tens of GB).
//! Run with `--nocapture` to see the table.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outboxd::client::Credentials;
use outboxd::proto::v1;
use prost::Message;
use prost::bytes::{Buf, BufMut};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use uuid::Uuid;

use crate::helpers::{TENANT, create_key, fleet_url, fresh_database, intent, service_url};

const MIB: u64 = 1024 * 1024;
/// Most a request may add to the server's peak RSS over its idle level.
const BUDGET: u64 = 64 * MIB;
/// The default `OUTBOX_LIMITS__MAX_MESSAGE_BYTES`: a message tonic accepts.
const MESSAGE: usize = 8 * 1024 * 1024 - 64;

/// An `outboxd serve` process, killed when dropped.
pub(crate) struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub(crate) async fn start(url: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let binary = std::env::var("MEMORY_TEST_OUTBOXD")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_outboxd").to_owned());
        let log = crate::helpers::scratch_dir().join(format!("outboxd-memory-{port}.log"));
        let mut command = Command::new(binary);
        // It refuses OUTBOX_* variables it does not know (the tests' own).
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OUTBOX_") {
                command.env_remove(name);
            }
        }
        let child = command
            .arg("serve")
            .env("OUTBOX_DATABASE__URL", service_url(url))
            .env("OUTBOX_DATABASE__FLEET_URL", fleet_url(url))
            .env("OUTBOX_LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("OUTBOX_DATABASE__MAX_CONNECTIONS", "8")
            // Not the default port: another server on this machine may hold it.
            .env("OUTBOX_METRICS__LISTEN_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let server = Self {
            child,
            addr: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(channel) = Channel::from_shared(server.addr.clone())
                .unwrap()
                .connect()
                .await
            {
                let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
                if health
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
                    .is_ok()
                {
                    return server;
                }
            }
            assert!(
                Instant::now() < deadline,
                "outboxd did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn status_field(&self, name: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the server process is gone");
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/…/status"));
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap();
        kib * 1024
    }

    fn rss(&self) -> u64 {
        self.status_field("VmRSS:")
    }

    fn peak(&self) -> u64 {
        self.status_field("VmHWM:")
    }

    /// Resets the peak to the current RSS (Linux 4.0+).
    fn reset_peak(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5")
            .expect("cannot reset VmHWM through /proc/<pid>/clear_refs");
    }

    pub(crate) async fn channel(&self) -> Channel {
        Channel::from_shared(self.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }
}

// ---- bytes as they are on the wire ----------------------------------------------------

struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let bytes = buf.chunk().to_vec();
        buf.advance(bytes.len());
        Ok(Some(bytes))
    }
}

/// One call of `method` with `body` as its message, with `key` (or none); its status code.
async fn raw(channel: Channel, key: Option<&str>, method: &str, body: Vec<u8>) -> tonic::Code {
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(body);
    if let Some(key) = key {
        request.metadata_mut().insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {key}")).unwrap(),
        );
    }
    let path =
        http::uri::PathAndQuery::try_from(format!("/outbox.v1.OutboxService/{method}")).unwrap();
    match grpc.unary(request, path, RawCodec).await {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    }
}

/// A message of field `field` repeated, each empty, up to [`MESSAGE`] bytes: millions of
/// empty items.
fn empty_items(field: u32) -> Vec<u8> {
    let item = [(field << 3 | 2) as u8, 0];
    item.repeat(MESSAGE / 2)
}

/// `inner` as the length-delimited field `field`.
fn nested(field: u32, inner: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(inner.len() + 8);
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(inner.len() as u64, &mut out);
    out.extend(inner);
    out
}

/// 1000 PENDING intents of 1 MiB each for the tenant, written behind the server's back
/// (compressible, so cheap to store; the server reads each as its full MiB).
async fn insert_large_intents(pool: &sqlx::PgPool) {
    let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
    sqlx::query(
        r#"
        INSERT INTO outbox.intent (id, tenant_id, kind, payload, state, max_attempts,
                                   available_at, created_at, updated_at, level_key)
        SELECT id, $2, 'big', convert_to(repeat('x', 1048576), 'UTF8'), 'pending', 5,
               now() - interval '1 minute', now(), now(), hashtextextended($2 || '/big', 0)
        FROM unnest($1::uuid[]) AS id
        "#,
    )
    .bind(&ids)
    .bind(TENANT)
    .execute(pool)
    .await
    .unwrap();
}

/// A call under way: whether it was answered OK.
type Answered = std::pin::Pin<Box<dyn Future<Output = bool> + Send>>;

/// One row of the table: a request, run alone then 8 at once.
struct Row {
    name: &'static str,
    /// Whether it is answered (else refused: over a limit, or without a key).
    answered: bool,
    /// Most it may add to the peak RSS over idle.
    budget: u64,
    /// Expected: refused (any code but OK), or answered.
    call: Box<dyn Fn(Channel) -> Answered>,
}

#[tokio::test]
async fn no_request_raises_the_servers_peak_memory_by_more_than_64_mib() {
    let url = fresh_database().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let produce = create_key(&pool, "produce", &[TENANT], &["produce"], &[]).await;
    let consume = create_key(&pool, "consume", &[TENANT], &["consume"], &[]).await;
    let operate = create_key(&pool, "operate", &[TENANT], &["operate"], &[]).await;
    let admin = create_key(&pool, "admin", &[TENANT], &["admin"], &[]).await;
    insert_large_intents(&pool).await;

    let raw_row = |name, key: Option<String>, method: &'static str, body: Vec<u8>| Row {
        name,
        answered: false,
        budget: BUDGET,
        call: Box::new(move |channel| {
            let (key, body) = (key.clone(), body.clone());
            Box::pin(
                async move { raw(channel, key.as_deref(), method, body).await == tonic::Code::Ok },
            )
        }),
    };
    let claim = {
        let consume = consume.clone();
        move |channel: Channel| {
            let consume = consume.clone();
            Box::pin(async move {
                let mut c = outboxd::client::client(
                    channel,
                    Credentials::new(Some(&consume), None).unwrap(),
                );
                // A fresh worker each time: the leases of the others are not expired, so
                // each claim takes intents no other has (they run out after a few hundred).
                let worker = format!("memory-{}", Uuid::new_v4());
                c.claim(v1::ClaimRequest {
                    worker_id: worker,
                    max_intents: 1000,
                    ..Default::default()
                })
                .await
                .is_ok()
            }) as Answered
        }
    };
    let list = {
        let operate = operate.clone();
        move |channel: Channel| {
            let operate = operate.clone();
            Box::pin(async move {
                let mut c = outboxd::client::client(
                    channel,
                    Credentials::new(Some(&operate), None).unwrap(),
                );
                c.list_intents(v1::ListIntentsRequest {
                    page_size: 1000,
                    include_payload: true,
                    ..Default::default()
                })
                .await
                .is_ok()
            }) as Answered
        }
    };
    let rows = vec![
        raw_row(
            "Enqueue of ~4.2M empty items, no key",
            None,
            "Enqueue",
            empty_items(1),
        ),
        raw_row(
            "Enqueue of ~4.2M empty items, produce key",
            Some(produce.clone()),
            "Enqueue",
            empty_items(1),
        ),
        // A valid Enqueue near the message limit takes ~5 copies of its message (tonic's
        // buffer, prost's payloads, sqlx's bind buffer as it grows): why the limit is 8 MiB.
        Row {
            answered: true,
            ..raw_row(
                "Enqueue of 7 valid intents of 1 MiB",
                Some(produce.clone()),
                "Enqueue",
                v1::EnqueueRequest {
                    intents: vec![
                        v1::NewIntent {
                            payload: vec![b'x'; 1024 * 1024],
                            ..intent("big", "")
                        };
                        7
                    ],
                    txn_token: String::new(),
                }
                .encode_to_vec(),
            )
        },
        raw_row(
            "Ack of ~4.2M empty LeaseRefs",
            Some(consume.clone()),
            "Ack",
            empty_items(1),
        ),
        raw_row(
            "MarkSubmitted of ~4.2M empty LeaseRefs",
            Some(consume.clone()),
            "MarkSubmitted",
            empty_items(1),
        ),
        raw_row(
            "Fail of ~4.2M empty Failures",
            Some(consume.clone()),
            "Fail",
            empty_items(1),
        ),
        raw_row(
            "Claim with ~4.2M empty kinds",
            Some(consume.clone()),
            "Claim",
            empty_items(3),
        ),
        raw_row(
            "Reconcile of ~4.2M empty ids",
            Some(admin.clone()),
            "Reconcile",
            nested(1, empty_items(1)),
        ),
        Row {
            name: "Claim max_intents=1000 over 1 MiB intents",
            answered: true,
            budget: BUDGET,
            call: Box::new(claim),
        },
        Row {
            name: "ListIntents page_size=1000 with payloads",
            answered: true,
            budget: BUDGET,
            call: Box::new(list),
        },
    ];

    let healthy = |channel: Channel| {
        let operate = operate.clone();
        async move {
            let mut c =
                outboxd::client::client(channel, Credentials::new(Some(&operate), None).unwrap());
            c.get_queue_stats(v1::GetQueueStatsRequest {}).await.is_ok()
        }
    };
    let mut table = Vec::new();
    let mut over = Vec::new();
    for row in &rows {
        // A server of its own (memory an allocator keeps after one row is not the next
        // row's), idle after a first ordinary call has set up what every call uses.
        let server = Server::start(&url).await;
        let channel = server.channel().await;
        assert!(healthy(channel.clone()).await);
        let idle = server.rss();
        server.reset_peak();
        let before = server.rss();
        let started = Instant::now();
        let answered = (row.call)(channel.clone()).await;
        let peak = server.peak();
        let (alone, added) = (peak.saturating_sub(idle), peak.saturating_sub(before));
        let took = started.elapsed();
        let other_build = std::env::var_os("MEMORY_TEST_OUTBOXD").is_some();
        server.reset_peak();
        let burst: Vec<_> = (0..if other_build { 0 } else { 8 })
            .map(|_| tokio::spawn((row.call)(channel.clone())))
            .collect();
        for call in burst {
            let _ = call.await;
        }
        let eight = server.peak().saturating_sub(idle);
        let still = healthy(server.channel().await).await;
        table.push(format!(
            "{:<42} idle {:>3} MiB, +{:>5} MiB over idle, +{:>5} over RSS before ({:>4.1} s, {}); 8 at once: +{:>5} MiB over idle; healthy after: {}",
            row.name,
            idle / MIB,
            alone / MIB,
            added / MIB,
            took.as_secs_f64(),
            if answered { "answered" } else { "refused" },
            eight / MIB,
            still,
        ));
        if alone > row.budget || !still || answered != row.answered {
            over.push(row.name);
        }
    }
    println!("{}", table.join("\n"));
    assert!(
        over.is_empty(),
        "over budget, unhealthy after, or not answered as expected: {over:?}\n{}",
        table.join("\n")
    );
}
