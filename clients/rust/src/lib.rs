//! The Rust SDK of outboxd, a transactional-outbox service: gRPC over PostgreSQL.
//!
//! - [`Connection`]: one or several outboxd endpoints, the API key, TLS, per-call deadlines,
//!   retries with failover ([`Connection::call`] for any RPC).
//! - [`Outbox`]: the producer. [`Outbox::enqueue`] records intents inside your open
//!   `sqlx::Transaction<'_, Postgres>` with the two-phase token, so they exist if and only
//!   if it commits; [`Outbox::enqueue_direct`] records them at once.
//! - [`Worker`]: the managed worker loop. Handlers are async closures
//!   `Fn(Job) -> impl Future<Output = Result<(), Failure>>`, one per kind; the worker claims
//!   for free slots, replays lost claims, extends leases, marks `SUBMITTED` when asked
//!   ([`Job::submitting`]), settles in batches, fails over, and drains on shutdown. A
//!   [`WorkerObserver`] sees each lease's calls as they are sent and answered.
//!
//! ```no_run
//! use outboxd_client::{Connection, Failure, Job, NewIntent, Outbox, Worker};
//!
//! # async fn f(pool: sqlx::PgPool) -> Result<(), outboxd_client::Error> {
//! let connection = Connection::builder(["127.0.0.1:50051"]).api_key("obx_…").build()?;
//!
//! // Produce: the intent exists iff the transaction commits.
//! let outbox = Outbox::new(connection.clone());
//! let mut tx = pool.begin().await?;
//! outbox.enqueue(&mut tx, NewIntent::new("email.send", b"ada@example.com".to_vec())).await?;
//! tx.commit().await?;
//!
//! // Work: Ok acks; an error retries; Failure::permanent dead-letters.
//! let worker = Worker::builder(connection)
//!     .handler("email.send", |job: Job| async move {
//!         let to = std::str::from_utf8(job.payload())?;
//!         println!("sending to {to}");
//!         Ok::<_, Failure>(())
//!     })
//!     .build()?;
//! worker.run().await?; // until SIGTERM or Ctrl-C, then drains
//! # Ok(()) }
//! ```
//!
//! Features: `sqlx` (default; the transactional producer), `tls` (default; rustls),
//! `otel` (handlers' spans join their producers' traces, calls carry the trace context).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod connection;
mod error;
mod producer;
mod trace;
mod worker;

/// The generated messages and client of `outbox.v1` (`proto/outbox/v1/outbox.proto`).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::allow_attributes_without_reason,
    reason = "generated code"
)]
pub mod proto {
    tonic::include_proto!("outbox.v1");
}

pub use connection::{
    Attempts, CallOptions, Client, Connection, ConnectionBuilder, Credentials, Retry,
};
pub use error::Error;
pub use producer::{
    EnqueueResult, FUNCTION_TOKEN_SQL, NewIntent, Outbox, PLAIN_TOKEN_SQL, TokenSource,
};
pub use proto::IntentState;
// Types of the API that come from these crates (`ClientTlsConfig`, `Status`,
// `CancellationToken`), at the versions this crate is built with.
pub use tokio_util::sync::CancellationToken;
pub use tonic;
pub use worker::{
    Answer, ClaimEvent, Failure, Job, LeaseCall, LeaseId, Worker, WorkerBuilder, WorkerObserver,
    WorkerStats,
};

/// A std duration as a protobuf one.
pub(crate) fn proto_duration(duration: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}
