//! outboxd: a transactional-outbox service. Producers record delivery intents with their
//! own PostgreSQL transaction; workers lease them over gRPC, perform the side effect and
//! report the outcome. See docs/design.md for the contract and README.md for use.
//!
//! Public are the modules the binary, the tools, the fuzz target and the integration tests
//! build on (the domain, configuration, start-up, the wire types and the client); the
//! transport's inner parts (service handlers, middleware, metrics, the console) are not.

mod admin;
pub mod auth;
pub mod cli;
pub mod client;
pub mod codec;
pub mod config;
mod console;
mod deadline;
pub mod embedded;
mod gate;
mod grpc;
mod http_listener;
mod incoming;
mod metrics;
pub mod outbox;
pub mod proto;
pub mod startup;
mod status;
pub mod telemetry;
mod tls;
pub mod validate;
mod watch;

/// The schema migrations under `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();
