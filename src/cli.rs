//! The command line: `serve` (default) and `migrate` run the service; the other commands
//! are an operator and walkthrough client speaking gRPC to a running server.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

use crate::auth::{self, Permission};
use crate::client::{self, Client, Credentials};
use crate::outbox::{IntentState, store};

use crate::config::{self, Settings};
use crate::proto::{from_timestamp, v1};
use crate::startup::{self, Application, Runtime};
use crate::telemetry;

/// outboxd: a transactional outbox over PostgreSQL, served over gRPC.
///
/// Without a command it serves. The server is configured by OUTBOX_* environment
/// variables (see README.md); with no OUTBOX_DATABASE__URL it starts an embedded
/// PostgreSQL cluster under .outboxd/pgdata.
#[derive(Debug, Parser)]
#[command(version, after_help = variables_help())]
pub struct Cli {
    /// Set a configuration variable, overriding the environment: `--set LISTEN_ADDR=0.0.0.0:50051`
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
    /// Server address.
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
        #[arg(long, value_parser = config::duration)]
        lease: Option<Duration>,
        /// Long-poll up to this long, e.g. 5s.
        #[arg(long, value_parser = config::duration)]
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
        #[arg(long, value_parser = config::duration)]
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
        /// Most intents.
        #[arg(long, default_value_t = 50)]
        limit: i32,
        /// Continue after this page token.
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
    /// List intents awaiting a decision.
    List {
        /// Most intents.
        #[arg(long, default_value_t = 50)]
        limit: i32,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Record a decision, by id (--id, repeatable) or by filter (--state ...).
    Resolve {
        /// Intents to resolve.
        #[arg(long = "id", conflicts_with = "state")]
        ids: Vec<String>,
        /// Resolve every intent in these states (needs_reconcile, dead_lettered).
        #[arg(long, value_parser = parse_state)]
        state: Vec<IntentState>,
        /// Filter: only this kind.
        #[arg(long, default_value = "")]
        kind: String,
        /// Filter: only this region.
        #[arg(long, default_value = "")]
        region: String,
        /// Filter: most intents in this call.
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
    for (name, what) in config::VARIABLES {
        help.push_str(&format!("  {name:<38} {what}\n"));
    }
    help
}

/// Runs a parsed command line; the exit code reports success.
pub fn run(cli: Cli) -> ExitCode {
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
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Settings from the environment, then the `--set NAME=VALUE` flags on top.
fn load_settings(overrides: &[String]) -> anyhow::Result<Settings> {
    let mut vars: Vec<(String, String)> = std::env::vars().collect();
    for o in overrides {
        let (name, value) = o
            .split_once('=')
            .with_context(|| format!("--set {o:?}: expected NAME=VALUE"))?;
        let name = if name.starts_with("OUTBOX_") {
            name.to_owned()
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
        Command::Serve => serve(load_settings(overrides)?).await,
        Command::Migrate => migrate(load_settings(overrides)?).await,
        Command::Enqueue {
            kind,
            payload,
            content_type,
            region,
            key,
            max_attempts,
            client,
        } => {
            let response = connect(&client)
                .await?
                .enqueue(v1::EnqueueRequest {
                    intents: vec![v1::NewIntent {
                        kind,
                        payload: payload.into_bytes(),
                        content_type,
                        region,
                        idempotency_key: key,
                        max_attempts,
                        ..Default::default()
                    }],
                    txn_token: String::new(),
                })
                .await?
                .into_inner();
            print(
                &client,
                json!(response.results.iter().map(|r| json!({
                "id": r.id, "state": state_name(r.state), "deduplicated": r.deduplicated,
            })).collect::<Vec<_>>()),
                || {
                    for r in &response.results {
                        let dedup = if r.deduplicated {
                            " (deduplicated)"
                        } else {
                            ""
                        };
                        println!("{}  {}{dedup}", r.id, state_name(r.state));
                    }
                },
            )
        }
        Command::Claim {
            worker,
            region,
            kind,
            max,
            lease,
            wait,
            client,
        } => {
            let response = connect(&client)
                .await?
                .claim(v1::ClaimRequest {
                    worker_id: worker,
                    region,
                    kinds: kind,
                    max_intents: max,
                    lease_duration: lease.map(duration),
                    wait: wait.map(duration),
                    request_id: String::new(),
                })
                .await?
                .into_inner();
            print(
                &client,
                json!(
                    response
                        .leases
                        .iter()
                        .map(|l| json!({
                            "lease_id": l.lease_id, "attempt": l.attempt,
                            "lease_expires_at": time(l.lease_expires_at.as_ref()),
                            "intent": l.intent.as_ref().map(intent_json),
                        }))
                        .collect::<Vec<_>>()
                ),
                || {
                    if response.leases.is_empty() {
                        println!("no intents available");
                    }
                    for l in &response.leases {
                        let i = l.intent.clone().unwrap_or_default();
                        println!(
                            "intent {}  lease {}  attempt {}  kind {}  payload {}",
                            i.id,
                            l.lease_id,
                            l.attempt,
                            i.kind,
                            String::from_utf8_lossy(&i.payload)
                        );
                    }
                },
            )
        }
        Command::MarkSubmitted { lease, client } => {
            let response = connect(&client)
                .await?
                .mark_submitted(v1::MarkSubmittedRequest {
                    leases: vec![lease.into()],
                })
                .await?
                .into_inner();
            print_results(&client, &response.results)
        }
        Command::Ack { lease, client } => {
            let response = connect(&client)
                .await?
                .ack(v1::AckRequest {
                    leases: vec![lease.into()],
                })
                .await?
                .into_inner();
            print_results(&client, &response.results)
        }
        Command::Fail {
            lease,
            outcome,
            error,
            retry_after,
            client,
        } => {
            let outcome = match outcome {
                Outcome::Retry => v1::FailOutcome::Retry,
                Outcome::Permanent => v1::FailOutcome::Permanent,
                Outcome::Unknown => v1::FailOutcome::Unknown,
            };
            let response = connect(&client)
                .await?
                .fail(v1::FailRequest {
                    failures: vec![v1::Failure {
                        lease: Some(lease.into()),
                        error,
                        outcome: outcome as i32,
                        retry_after: retry_after.map(duration),
                    }],
                })
                .await?
                .into_inner();
            print_results(&client, &response.results)
        }
        Command::Intents {
            command:
                IntentsCommand::List {
                    state,
                    kind,
                    region,
                    limit,
                    page_token,
                    client,
                },
        } => {
            list(
                &client,
                state
                    .into_iter()
                    .map(|s| v1::IntentState::from(s) as i32)
                    .collect(),
                kind,
                region,
                limit,
                page_token,
            )
            .await
        }
        Command::Intents {
            command: IntentsCommand::Get { id, client },
        } => {
            let response = connect(&client)
                .await?
                .get_intent(v1::GetIntentRequest { id })
                .await?
                .into_inner();
            let intent = response.intent.unwrap_or_default();
            let resolutions: Vec<Value> = response.resolutions.iter().map(|r| json!({
                "decision": decision_name(r.decision), "from_state": state_name(r.from_state),
                "actor": r.actor, "reason": r.reason, "resolved_at": time(r.resolved_at.as_ref()),
            })).collect();
            print(
                &client,
                json!({ "intent": intent_json(&intent), "resolutions": resolutions }),
                || {
                    print_intent_detail(&intent);
                    for r in &response.resolutions {
                        println!(
                            "resolution:      {} (was {}) by {} at {}: {}",
                            decision_name(r.decision),
                            state_name(r.from_state),
                            r.actor,
                            time(r.resolved_at.as_ref()),
                            r.reason
                        );
                    }
                },
            )
        }
        Command::Reconcile {
            command: ReconcileCommand::List { limit, client },
        } => {
            let states = vec![
                v1::IntentState::NeedsReconcile as i32,
                v1::IntentState::DeadLettered as i32,
            ];
            list(
                &client,
                states,
                String::new(),
                String::new(),
                limit,
                String::new(),
            )
            .await
        }
        Command::Reconcile {
            command:
                ReconcileCommand::Resolve {
                    ids,
                    state,
                    kind,
                    region,
                    limit,
                    decision,
                    actor,
                    reason,
                    client,
                },
        } => {
            let target = if ids.is_empty() {
                v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                    states: state
                        .into_iter()
                        .map(|s| v1::IntentState::from(s) as i32)
                        .collect(),
                    kind,
                    region,
                    created_before: None,
                })
            } else {
                v1::reconcile_request::Target::Ids(v1::ReconcileIds { ids })
            };
            let decision = match decision {
                DecisionArg::Delivered => v1::Decision::Delivered,
                DecisionArg::Requeue => v1::Decision::Requeue,
                DecisionArg::Dead => v1::Decision::Dead,
            };
            let response = connect(&client)
                .await?
                .reconcile(v1::ReconcileRequest {
                    target: Some(target),
                    decision: decision as i32,
                    actor,
                    reason,
                    limit,
                })
                .await?
                .into_inner();
            let results: Vec<v1::LeaseResult> = response
                .results
                .into_iter()
                .map(|r| v1::LeaseResult {
                    intent_id: r.intent_id,
                    error: r.error,
                    state: r.state,
                    lease_expires_at: None,
                })
                .collect();
            print_results(&client, &results)
        }
        Command::Keys { command } => keys(load_settings(overrides)?, command).await,
        Command::Stats { client } => {
            let stats = connect(&client)
                .await?
                .get_queue_stats(v1::GetQueueStatsRequest {})
                .await?
                .into_inner();
            let counts: Vec<Value> = stats
                .counts
                .iter()
                .map(|c| {
                    json!({
                        "state": state_name(c.state), "region": c.region, "count": c.count,
                    })
                })
                .collect();
            print(
                &client,
                json!({
                    "counts": counts,
                    "oldest_pending_at": time(stats.oldest_pending_at.as_ref()),
                    "oldest_staged_at": time(stats.oldest_staged_at.as_ref()),
                    "reconcile_backlog": stats.reconcile_backlog,
                }),
                || {
                    println!("{:<16} {:<12} {:>10}", "STATE", "REGION", "COUNT");
                    for c in &stats.counts {
                        let region = if c.region.is_empty() {
                            "(any)"
                        } else {
                            &c.region
                        };
                        println!("{:<16} {:<12} {:>10}", state_name(c.state), region, c.count);
                    }
                    println!("reconcile backlog: {}", stats.reconcile_backlog);
                    println!(
                        "oldest claimable pending since: {}",
                        time(stats.oldest_pending_at.as_ref())
                    );
                    println!(
                        "oldest staged since: {}",
                        time(stats.oldest_staged_at.as_ref())
                    );
                },
            )
        }
    }
}

async fn serve(settings: Settings) -> anyhow::Result<()> {
    let _telemetry = telemetry::init(
        settings.log_format,
        &settings.log_filter,
        settings.otel_endpoint.as_deref(),
    )?;
    let database = startup::prepare_database(&settings).await?;
    let pool = startup::connect(&database.service_url, settings.max_connections).await?;
    startup::verify_service_role(&pool).await?;
    let listener = tokio::net::TcpListener::bind(settings.listen_addr)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen_addr))?;
    let app = Application::start(&settings, pool.clone(), listener, Runtime::default()).await?;
    let served = app.run_until_stopped().await;
    pool.close().await;
    stop_embedded(database.embedded).await?;
    served
}

async fn stop_embedded(cluster: Option<crate::embedded::EmbeddedPostgres>) -> anyhow::Result<()> {
    if let Some(mut cluster) = cluster {
        tokio::task::spawn_blocking(move || cluster.stop()).await??;
        tracing::info!("embedded PostgreSQL stopped");
    }
    Ok(())
}

async fn migrate(settings: Settings) -> anyhow::Result<()> {
    telemetry::install(settings.log_format, &settings.log_filter, None);
    let both_or_neither = settings.database_url.is_some() == settings.migration_url.is_some();
    if both_or_neither {
        // As a server start does: the embedded cluster, or the owner's URL, is migrated and
        // the service role (of OUTBOX_DATABASE__URL) granted what it needs.
        let database = startup::prepare_database(&settings).await?;
        stop_embedded(database.embedded).await?;
    } else {
        let (embedded, url) = startup::owner_database(&settings).await?;
        let pool = startup::connect(&url, 2).await?;
        startup::migrate(&pool).await?;
        pool.close().await;
        stop_embedded(embedded).await?;
    }
    println!("migrations applied");
    Ok(())
}

async fn keys(settings: Settings, command: KeysCommand) -> anyhow::Result<()> {
    let (embedded, url) = startup::owner_database(&settings).await?;
    let pool = startup::connect(&url, 2).await?;
    let result = run_keys(&pool, command).await;
    pool.close().await;
    stop_embedded(embedded).await?;
    result
}

async fn run_keys(pool: &sqlx::PgPool, command: KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::Create {
            name,
            tenants,
            all_tenants,
            scopes,
            regions,
            json,
        } => {
            for tenant in &tenants {
                anyhow::ensure!(
                    crate::validate::is_name(tenant, 64),
                    "tenant {tenant:?} must be 1-64 ASCII letters, digits or . _ - : /"
                );
            }
            for region in &regions {
                anyhow::ensure!(
                    crate::validate::is_name(region, 64),
                    "region {region:?} is not a valid name"
                );
            }
            let key = auth::generate_key()?;
            let record = store::ApiKeyRecord {
                id: uuid::Uuid::now_v7(),
                name,
                prefix: key.prefix.clone(),
                tenants,
                all_tenants,
                scopes,
                regions,
                created_at: chrono::Utc::now(),
                revoked_at: None,
            };
            store::insert_api_key(pool, &record, &key.hash).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "id": record.id, "name": record.name, "api_key": key.secret,
                    }))?
                );
            } else {
                println!("{}", key.secret);
                eprintln!(
                    "created key {:?} ({}); the secret above is shown only once",
                    record.name, record.id
                );
            }
            Ok(())
        }
        KeysCommand::List { json } => {
            let keys = store::list_api_keys(pool).await?;
            if json {
                let keys: Vec<Value> = keys
                    .iter()
                    .map(|k| {
                        json!({
                            "id": k.id, "name": k.name, "prefix": k.prefix, "tenants": k.tenants,
                            "all_tenants": k.all_tenants, "scopes": k.scopes, "regions": k.regions,
                            "created_at": k.created_at, "revoked_at": k.revoked_at,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&keys)?);
            } else {
                println!(
                    "{:<36}  {:<20} {:<14} {:<24} {:<28} STATUS",
                    "ID", "NAME", "PREFIX", "TENANTS", "SCOPES"
                );
                for k in keys {
                    let tenants = if k.all_tenants {
                        "*".to_owned()
                    } else {
                        k.tenants.join(",")
                    };
                    let status = if k.revoked_at.is_some() {
                        "revoked"
                    } else {
                        "active"
                    };
                    println!(
                        "{:<36}  {:<20} {:<14} {:<24} {:<28} {status}",
                        k.id,
                        k.name,
                        k.prefix,
                        tenants,
                        k.scopes.join(",")
                    );
                }
            }
            Ok(())
        }
        KeysCommand::Revoke { key } => {
            let n = store::revoke_api_key(pool, &key).await?;
            anyhow::ensure!(n > 0, "no active key with id or name {key:?}");
            println!("revoked {n} key(s); servers stop accepting it within OUTBOX_AUTH__CACHE_TTL");
            Ok(())
        }
    }
}

async fn connect(args: &ClientArgs) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(args.server.clone())
        .with_context(|| format!("{:?} is not a server URL", args.server))?;
    if let Some(ca) = &args.ca_file {
        let pem = std::fs::read(ca).with_context(|| format!("cannot read {}", ca.display()))?;
        endpoint = endpoint
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))?;
    }
    let channel = endpoint.connect().await.with_context(|| {
        format!(
            "cannot reach outboxd at {} (is `outboxd serve` running?)",
            args.server
        )
    })?;
    let credentials = Credentials::new(args.api_key.as_deref(), args.tenant.as_deref())?;
    Ok(client::client(channel, credentials))
}

async fn list(
    client: &ClientArgs,
    states: Vec<i32>,
    kind: String,
    region: String,
    limit: i32,
    page_token: String,
) -> anyhow::Result<()> {
    let response = connect(client)
        .await?
        .list_intents(v1::ListIntentsRequest {
            states,
            kind,
            region,
            page_size: limit,
            page_token,
            include_payload: false,
        })
        .await?
        .into_inner();
    print(
        client,
        json!({
            "intents": response.intents.iter().map(intent_json).collect::<Vec<_>>(),
            "next_page_token": response.next_page_token,
        }),
        || {
            println!(
                "{:<36}  {:<16} {:<24} {:<8} {:>8}  LAST ERROR",
                "ID", "STATE", "KIND", "REGION", "ATTEMPTS"
            );
            for i in &response.intents {
                println!(
                    "{:<36}  {:<16} {:<24} {:<8} {:>4}/{:<3}  {}",
                    i.id,
                    state_name(i.state),
                    i.kind,
                    i.region,
                    i.attempts,
                    i.max_attempts,
                    i.last_error
                );
            }
            if !response.next_page_token.is_empty() {
                println!("more: --page-token {}", response.next_page_token);
            }
        },
    )
}

impl From<LeaseArgs> for v1::LeaseRef {
    fn from(l: LeaseArgs) -> Self {
        Self {
            intent_id: l.intent,
            lease_id: l.lease,
        }
    }
}

fn print(args: &ClientArgs, value: Value, text: impl FnOnce()) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        text();
    }
    Ok(())
}

/// Prints per-item results; fails the command when any item failed, so scripts notice.
fn print_results(args: &ClientArgs, results: &[v1::LeaseResult]) -> anyhow::Result<()> {
    print(args, json!(results.iter().map(|r| json!({
        "intent_id": r.intent_id,
        "state": state_name(r.state),
        "error": r.error.as_ref().map(|e| json!({"code": e.code, "reason": e.reason, "message": e.message})),
    })).collect::<Vec<_>>()), || {
        for r in results {
            match &r.error {
                None => println!("{}  ok  now {}", r.intent_id, state_name(r.state)),
                Some(e) => println!("{}  {}  {}", r.intent_id, e.reason, e.message),
            }
        }
    })?;
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} items were not applied",
        results.len()
    );
    Ok(())
}

fn print_intent_detail(i: &v1::Intent) {
    println!("id:              {}", i.id);
    println!("state:           {}", state_name(i.state));
    println!("kind:            {}", i.kind);
    println!(
        "region:          {}",
        if i.region.is_empty() {
            "(any)"
        } else {
            &i.region
        }
    );
    println!("attempts:        {}/{}", i.attempts, i.max_attempts);
    println!("idempotency key: {}", i.idempotency_key);
    println!("created at:      {}", time(i.created_at.as_ref()));
    println!("available at:    {}", time(i.available_at.as_ref()));
    println!("worker:          {}", i.worker_id);
    println!("last error:      {}", i.last_error);
    println!("content type:    {}", i.content_type);
    println!("payload:         {}", String::from_utf8_lossy(&i.payload));
}

fn intent_json(i: &v1::Intent) -> Value {
    json!({
        "id": i.id,
        "state": state_name(i.state),
        "kind": i.kind,
        "region": i.region,
        "payload": String::from_utf8_lossy(&i.payload),
        "content_type": i.content_type,
        "idempotency_key": i.idempotency_key,
        "headers": i.headers,
        "attempts": i.attempts,
        "max_attempts": i.max_attempts,
        "available_at": time(i.available_at.as_ref()),
        "created_at": time(i.created_at.as_ref()),
        "updated_at": time(i.updated_at.as_ref()),
        "lease_expires_at": time(i.lease_expires_at.as_ref()),
        "worker_id": i.worker_id,
        "last_error": i.last_error,
    })
}

fn state_name(state: i32) -> String {
    v1::IntentState::try_from(state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("INTENT_STATE_")
                .to_owned()
        })
        .unwrap_or_else(|_| state.to_string())
}

fn decision_name(decision: i32) -> String {
    v1::Decision::try_from(decision)
        .map(|d| d.as_str_name().trim_start_matches("DECISION_").to_owned())
        .unwrap_or_else(|_| decision.to_string())
}

fn time(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(from_timestamp)
        .map(|t| t.to_rfc3339())
        .unwrap_or_else(|| "-".to_owned())
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}
