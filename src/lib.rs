//! outboxd: a transactional-outbox service. Producers record delivery intents with their
//! own PostgreSQL transaction; workers lease them over gRPC, perform the side effect and
//! report the outcome. See docs/design.md for the contract and README.md for use.

pub mod admin;
pub mod auth;
pub mod cli;
pub mod client;
pub mod codec;
pub mod config;
pub mod console;
pub mod deadline;
pub mod embedded;
pub mod gate;
pub mod grpc;
pub mod metrics;
pub mod outbox;
pub mod proto;
pub mod startup;
pub mod status;
pub mod telemetry;
pub mod validate;
pub mod watch;

/// The schema migrations under `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();
