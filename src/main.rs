//! The `outboxd` binary: parses the command line and hands over to `outboxd::cli`.

use clap::Parser;

/// mimalloc, not glibc's malloc: the server allocates per row and per message, and glibc's
/// arenas spent ~4% of the machine on it in a burn-down (see README, Performance).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    outboxd::cli::run(outboxd::cli::Cli::parse())
}
