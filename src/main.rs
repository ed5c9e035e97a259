//! The `outboxd` binary: parses the command line and hands over to `outboxd::cli`.

use clap::Parser;

fn main() -> std::process::ExitCode {
    outboxd::cli::run(outboxd::cli::Cli::parse())
}
