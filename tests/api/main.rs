//! The one integration-test binary: every test gets its own database (copied from a
//! migrated template) and a real outboxd server on 127.0.0.1:0, driven through the
//! generated gRPC client.

mod browser;
mod cancel;
mod cancellation;
mod claim;
mod commands;
mod connections;
mod console;
mod console_indexes;
mod empty_queues;
mod enqueue;
mod flow_control;
mod group_commit;
mod handoff;
mod helpers;
mod hostile;
mod inspect;
mod long_poll;
mod maintenance;
mod memory;
mod migrations;
mod model;
mod observability;
mod ordering;
mod outage;
mod properties;
mod protocol;
mod reconcile;
mod settle;
mod tenancy;
mod tenancy_fleet;
mod tls;
mod traces;
mod two_phase;
