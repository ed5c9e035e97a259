//! The command line: `serve` (default) and `migrate` run the service; the other commands
//! are an operator and walkthrough client speaking gRPC to a running server.

mod keys;
mod operator;
mod output;
mod queues;
mod server;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::auth::Permission;
use crate::outbox::IntentState;

use crate::config::{self, Settings};

/// outboxd: a transactional outbox over PostgreSQL, served over gRPC.
///
/// Without a command it serves. The server is configured by OUTBOX_* environment
/// variables (see docs/configuration.md); with no OUTBOX_DATABASE__URL it starts an embedded
/// PostgreSQL cluster under .outboxd/pgdata.
#[derive(Debug, Parser)]
#[command(version, after_help = variables_help())]
pub struct Cli {
    /// Set a server configuration variable (serve, migrate, keys), overriding the
    /// environment: `--set LISTEN_ADDR=127.0.0.1:50052`
    /// (the `OUTBOX_` prefix is optional). Repeatable.
    #[arg(long = "set", value_name = "NAME=VALUE", global = true)]
    pub overrides: Vec<String>,
    /// What to do (default: serve).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Client options shared by the operator commands.
#[derive(Debug, Args, Clone)]
pub struct ClientArgs {
    /// Server address: a URL, or `host:port` (`https` with `--ca-file`, else `http`).
    #[arg(
        long,
        env = "OUTBOX_SERVER",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    pub server: String,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// API key (`obx_…`; create one with `outboxd keys create`).
    #[arg(long, env = "OUTBOX_API_KEY", hide_env_values = true, global = true)]
    pub api_key: Option<String>,
    /// Tenant to act for, when the key is bound to several.
    #[arg(long, env = "OUTBOX_TENANT", global = true)]
    pub tenant: Option<String>,
    /// CA certificate (PEM) to trust for an https:// server.
    #[arg(long, env = "OUTBOX_CA_FILE", global = true)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for a server that requires one (mTLS); with `--key-file`.
    #[arg(long, env = "OUTBOX_CERT_FILE", global = true, requires = "key_file")]
    pub cert_file: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "OUTBOX_KEY_FILE", global = true, requires = "cert_file")]
    pub key_file: Option<std::path::PathBuf>,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gRPC server (the default).
    Serve,
    /// Apply database migrations and exit.
    Migrate,
    /// Record an intent (direct mode).
    Enqueue {
        /// Routing key.
        #[arg(long)]
        kind: String,
        /// Payload text.
        #[arg(long, default_value = "")]
        payload: String,
        /// Media type of the payload.
        #[arg(long, default_value = "application/json")]
        content_type: String,
        /// Region ('' = any).
        #[arg(long, default_value = "")]
        region: String,
        /// Idempotency key.
        #[arg(long, default_value = "")]
        key: String,
        /// Ordering key: intents with the same one are delivered one at a time, in order.
        #[arg(long, default_value = "")]
        ordering_key: String,
        /// Priority from -10 to 10: higher first among its kind's claimable intents.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        priority: i32,
        /// Claims allowed before dead-lettering (0 = server default).
        #[arg(long, default_value_t = 0)]
        max_attempts: i32,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Lease intents as a worker.
    Claim {
        /// Worker id.
        #[arg(long, default_value = "cli")]
        worker: String,
        /// Worker region.
        #[arg(long, default_value = "")]
        region: String,
        /// Only these kinds (repeatable).
        #[arg(long)]
        kind: Vec<String>,
        /// Most intents.
        #[arg(long, default_value_t = 10)]
        max: i32,
        /// Lease length, e.g. 30s.
        #[arg(long, value_parser = humantime::parse_duration)]
        lease: Option<Duration>,
        /// Long-poll up to this long, e.g. 5s.
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Tell outboxd a lease's external call is starting.
    MarkSubmitted {
        #[command(flatten)]
        lease: LeaseArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Report a lease's side effect as done.
    Ack {
        #[command(flatten)]
        lease: LeaseArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Report a lease's side effect as failed.
    Fail {
        #[command(flatten)]
        lease: LeaseArgs,
        /// What is known about the side effect.
        #[arg(long, value_enum)]
        outcome: Outcome,
        /// What went wrong.
        #[arg(long, default_value = "")]
        error: String,
        /// RETRY only: wait this long instead of the backoff, e.g. 10s.
        #[arg(long, value_parser = humantime::parse_duration)]
        retry_after: Option<Duration>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Inspect intents.
    Intents {
        #[command(subcommand)]
        command: IntentsCommand,
    },
    /// List and resolve intents awaiting an operator (NEEDS_RECONCILE, DEAD_LETTERED).
    Reconcile {
        #[command(subcommand)]
        command: ReconcileCommand,
    },
    /// Pause, resume and limit queues (a tenant's kind), and list their policies.
    Queues {
        #[command(subcommand)]
        command: QueuesCommand,
    },
    /// Queue statistics.
    Stats {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Create, list and revoke API keys (connects to the database as the schema owner).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
}

/// Queue policy commands.
#[derive(Debug, Subcommand)]
pub enum QueuesCommand {
    /// Set a queue's whole policy, recorded with who and why: what is not given is lifted
    /// (a pause or limit set before ends unless given again).
    Set {
        /// The queue's kind.
        #[arg(long)]
        kind: String,
        /// No leases until set again without --paused. Left out: not paused (a pause set
        /// before is lifted).
        #[arg(long)]
        paused: bool,
        /// At most this many intents LEASED or SUBMITTED at once. 0 or left out: no limit
        /// (a limit set before is lifted).
        #[arg(long)]
        max_in_flight: Option<i32>,
        /// At most this many leases per second on average. 0 or left out: no rate limit
        /// (a rate set before is lifted).
        #[arg(long)]
        rate: Option<f64>,
        /// With --rate: leases allowed at once. 0 or left out: the rate rounded up.
        #[arg(long, requires = "rate")]
        burst: Option<i32>,
        /// Who decides.
        #[arg(long)]
        actor: String,
        /// Why.
        #[arg(long)]
        reason: String,
        /// Change the policy only if it is still the one last updated at this instant
        /// (RFC 3339, its `updated_at` as `queues list --json` prints it): a policy
        /// changed since is left as it is (ABORTED, CONFLICT). Left out: whatever it is.
        #[arg(long, value_parser = parse_instant)]
        expected_updated_at: Option<chrono::DateTime<chrono::Utc>>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the queues that have a policy, with their live figures.
    List {
        /// Only this kind.
        #[arg(long, default_value = "")]
        kind: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// API key commands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret (shown only this once).
    Create {
        /// Label, e.g. "billing-worker".
        #[arg(long)]
        name: String,
        /// Tenant the key acts for (repeatable).
        #[arg(long = "tenant", required_unless_present = "all_tenants")]
        tenants: Vec<String>,
        /// Act for every tenant (fleet workers, admins).
        #[arg(long, conflicts_with = "tenants")]
        all_tenants: bool,
        /// Scope: produce, consume, operate, admin (repeatable).
        #[arg(long = "scope", required = true, value_parser = clap::builder::PossibleValuesParser::new(Permission::NAMES))]
        scopes: Vec<String>,
        /// Limit the key to these regions (repeatable; default: any).
        #[arg(long = "region")]
        regions: Vec<String>,
        /// Store the key held by this environment variable instead of minting one (`obx_`
        /// and 32 or more letters, digits, - or _: `obx_$(openssl rand -hex 32)`). Prints
        /// no secret, and leaves a key already stored (even revoked) as it is, so a
        /// Kubernetes Job may run it from a Secret on every install and upgrade.
        #[arg(long, value_name = "VARIABLE")]
        secret_from_env: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets).
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id or name.
    Revoke {
        /// Key id or name.
        key: String,
    },
}

/// A lease on the command line.
#[derive(Debug, Args)]
pub struct LeaseArgs {
    /// Intent id.
    #[arg(long)]
    pub intent: String,
    /// Lease id from claim.
    #[arg(long)]
    pub lease: String,
}

/// Intent inspection commands.
#[derive(Debug, Subcommand)]
pub enum IntentsCommand {
    /// List intents, oldest first.
    List {
        /// Only these states (repeatable), e.g. needs_reconcile.
        #[arg(long, value_parser = parse_state)]
        state: Vec<IntentState>,
        /// Only this kind.
        #[arg(long, default_value = "")]
        kind: String,
        /// Only this region.
        #[arg(long, default_value = "")]
        region: String,
        /// Only this ordering key.
        #[arg(long, default_value = "")]
        ordering_key: String,
        /// Most intents.
        #[arg(long, default_value_t = 50)]
        limit: i32,
        /// Continue after this page token.
        #[arg(long, default_value = "")]
        page_token: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show an ordering key's queue: its first intent, and why the others wait.
    Key {
        /// The ordering key.
        key: String,
        /// Most WAITING intents to list.
        #[arg(long, default_value_t = 50)]
        limit: i32,
        /// List the WAITING intents after this page token.
        #[arg(long, default_value = "")]
        page_token: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one intent with its payload and decisions.
    Get {
        /// Intent id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Reconcile commands.
#[derive(Debug, Subcommand)]
pub enum ReconcileCommand {
    /// List the intents awaiting an operator: NEEDS_RECONCILE and DEAD_LETTERED (not an
    /// ordered one already given up with DEAD, which is finished).
    List {
        /// Most intents.
        #[arg(long, default_value_t = 50)]
        limit: i32,
        /// Continue after this page token (the `more:` line of the previous page).
        #[arg(long, default_value = "")]
        page_token: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Record a decision, by id (--id, repeatable) or by filter (--state, with --kind,
    /// --region, --created-before, --limit); the filter's flags are refused with --id.
    Resolve {
        /// Intents to resolve (not with the filter's flags: --state, --kind, --region,
        /// --created-before, --limit).
        #[arg(
            long = "id",
            conflicts_with_all = ["state", "kind", "region", "created_before", "limit"]
        )]
        ids: Vec<String>,
        /// Filter: resolve every intent in these states (needs_reconcile, dead_lettered;
        /// for cancel: staged, waiting, pending).
        #[arg(long, value_parser = parse_state)]
        state: Vec<IntentState>,
        /// Filter: only this kind.
        #[arg(long, default_value = "")]
        kind: String,
        /// Filter: only this region.
        #[arg(long, default_value = "")]
        region: String,
        /// Filter: only intents created before this instant (RFC 3339, e.g.
        /// 2026-12-08T09:00:00Z).
        #[arg(long, value_parser = parse_instant)]
        created_before: Option<chrono::DateTime<chrono::Utc>>,
        /// Filter: most intents in this call (0: the server's default, 100).
        #[arg(long, default_value_t = 0)]
        limit: i32,
        /// The ruling.
        #[arg(long, value_enum)]
        decision: DecisionArg,
        /// Who decides (defaults to $USER).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
        /// Why (recorded).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Fail outcomes.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Outcome {
    /// Did not happen; retry.
    Retry,
    /// Did not happen; never will.
    Permanent,
    /// May have happened.
    Unknown,
}

/// Operator decisions.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DecisionArg {
    /// It happened.
    Delivered,
    /// Deliver again.
    Requeue,
    /// Give up.
    Dead,
    /// Never deliver (STAGED, WAITING or PENDING intents).
    Cancel,
}

/// Parses an instant given in RFC 3339.
fn parse_instant(value: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("not an RFC 3339 instant (2026-12-05T04:22:18.123456Z): {e}"))
}

/// Parses a state name as the CLI shows it (`needs_reconcile` or `needs-reconcile`).
fn parse_state(name: &str) -> Result<IntentState, String> {
    let wanted = name.to_ascii_lowercase().replace('-', "_");
    IntentState::ALL
        .into_iter()
        .find(|s| s.as_str() == wanted)
        .ok_or_else(|| {
            let names: Vec<&str> = IntentState::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown state {name:?}; one of {}", names.join(", "))
        })
}

fn variables_help() -> String {
    let mut help = String::from("Environment variables:\n");
    for (name, default, meaning) in config::documented() {
        help.push_str(&format!("  {name:<38} {meaning} [{default}]\n"));
    }
    help
}

/// Runs a parsed command line; the exit code reports success.
pub fn run(cli: Cli) -> ExitCode {
    quiet_on_broken_pipe();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let command = cli.command.unwrap_or(Command::Serve);
    match runtime.block_on(dispatch(command, &cli.overrides)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", output::error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// `outboxd intents list | head -1`: std's print macros panic once the reader has gone
/// (Rust ignores SIGPIPE); end quietly instead, with the status of a process SIGPIPE
/// killed.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// Settings from the environment, then the `--set NAME=VALUE` flags on top.
fn load_settings(overrides: &[String]) -> anyhow::Result<Settings> {
    let mut vars: Vec<(String, String)> = std::env::vars().collect();
    for o in overrides {
        let (name, value) = o
            .split_once('=')
            .with_context(|| format!("--set {o:?}: expected NAME=VALUE"))?;
        // A flag is typed, not exported: `lease__default` names LEASE__DEFAULT.
        let name = name.to_ascii_uppercase();
        let name = if name.starts_with("OUTBOX_") {
            name
        } else {
            format!("OUTBOX_{name}")
        };
        // Later pairs win: the flags override the environment.
        vars.push((name, value.to_owned()));
    }
    Ok(Settings::from_vars(vars)?)
}

async fn dispatch(command: Command, overrides: &[String]) -> anyhow::Result<()> {
    match command {
        Command::Serve => server::serve(load_settings(overrides)?).await,
        Command::Migrate => server::migrate(load_settings(overrides)?).await,
        Command::Keys { command } => keys::run(load_settings(overrides)?, command).await,
        // Client commands take their server and key from their own flags; a --set would
        // be silently ignored.
        _ if !overrides.is_empty() => anyhow::bail!(
            "--set sets the server's variables (serve, migrate, keys); this command takes \
             --server, --api-key, --tenant and --ca-file (or OUTBOX_SERVER, OUTBOX_API_KEY, …)"
        ),
        other => operator::run(other).await,
    }
}

#[cfg(test)]
mod tests {
    use super::{Cli, load_settings};
    use clap::Parser;
    use clap::error::ErrorKind;
    use std::time::Duration;

    #[test]
    fn resolve_by_id_refuses_the_filters_flags_instead_of_dropping_them() {
        let by_id = [
            "outboxd",
            "reconcile",
            "resolve",
            "--id",
            "0193a8f2-5c1e-7b3a-9d4e-2f6a1b7c8d90",
            "--decision",
            "delivered",
            "--reason",
            "t",
        ];
        let filters: [&[&str]; 4] = [
            &["--kind", "other.kind"],
            &["--region", "eu"],
            &["--limit", "5"],
            &["--state", "needs_reconcile"],
        ];
        for filter in filters {
            let args = by_id.iter().chain(filter);
            let refused = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(refused.kind(), ErrorKind::ArgumentConflict, "{filter:?}");
        }
        assert!(Cli::try_parse_from(by_id).is_ok());
        let by_filter = [
            "outboxd",
            "reconcile",
            "resolve",
            "--state",
            "needs_reconcile",
            "--kind",
            "k",
            "--region",
            "eu",
            "--limit",
            "5",
            "--decision",
            "delivered",
            "--reason",
            "t",
        ];
        assert!(Cli::try_parse_from(by_filter).is_ok());
    }

    #[test]
    fn queues_set_help_says_what_0_and_a_left_out_flag_mean() {
        let help = Cli::try_parse_from(["outboxd", "queues", "set", "--help"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        let help = help.to_string();
        for line in [
            "a pause or limit set before ends unless given again",
            "Left out: not paused (a pause set before is lifted)",
            "LEASED or SUBMITTED at once. 0 or left out: no limit",
            "on average. 0 or left out: no rate limit",
            "leases allowed at once. 0 or left out: the rate rounded up",
        ] {
            assert!(help.contains(line), "{line:?} not in:\n{help}");
        }
    }

    #[test]
    fn reconcile_list_takes_the_page_token_it_prints() {
        let args = ["outboxd", "reconcile", "list", "--limit", "1"];
        let paged = args.iter().chain(&["--page-token", "x"]);
        assert!(Cli::try_parse_from(paged).is_ok());
    }

    #[test]
    fn a_set_flag_names_its_variable_with_or_without_prefix_in_any_case() {
        for flag in [
            "OUTBOX_LEASE__DEFAULT=45s",
            "LEASE__DEFAULT=45s",
            "lease__default=45s",
        ] {
            let settings = load_settings(&[flag.to_owned()]).unwrap();
            assert_eq!(
                settings.limits.default_lease,
                Duration::from_secs(45),
                "{flag}"
            );
        }
    }
}
