//! The operator and walkthrough commands: a gRPC client of a running server.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use super::output::{
    decision_name, intent_json, print, print_intent_detail, print_results, state_name, time,
    time_json, who,
};
use super::queues::{policy_json, print_policy_table};
use super::{
    ClientArgs, Command, DecisionArg, IntentsCommand, LeaseArgs, Outcome, ReconcileCommand,
};
use crate::client::{self, Client, Credentials};
use crate::outbox::IntentState;
use crate::proto::v1;

/// Runs one operator command against the server.
pub(super) async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Enqueue {
            kind,
            payload,
            content_type,
            region,
            key,
            ordering_key,
            priority,
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
                        ordering_key,
                        priority,
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
                            "lease_expires_at": time_json(l.lease_expires_at.as_ref()),
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
                            super::output::printable(&i.payload)
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
                    ordering_key,
                    limit,
                    page_token,
                    client,
                },
        } => {
            let request = v1::ListIntentsRequest {
                states: state
                    .into_iter()
                    .map(|s| v1::IntentState::from(s) as i32)
                    .collect(),
                kind,
                region,
                ordering_key,
                page_size: limit,
                page_token,
                include_payload: false,
                awaiting_decision: false,
            };
            let response = connect(&client).await?.list_intents(request).await?;
            print_list(&client, &response.into_inner(), || {})
        }
        Command::Intents {
            command:
                IntentsCommand::Key {
                    key,
                    limit,
                    page_token,
                    client,
                },
        } => {
            let mut service = connect(&client).await?;
            // Its live intents that are not WAITING (the first, and dead letters given up),
            // whatever their number; then one page of those WAITING behind them.
            let mut heads = Vec::new();
            let mut token = String::new();
            loop {
                let request = v1::ListIntentsRequest {
                    states: [
                        IntentState::Staged,
                        IntentState::Pending,
                        IntentState::Leased,
                        IntentState::Submitted,
                        IntentState::NeedsReconcile,
                        IntentState::DeadLettered,
                    ]
                    .into_iter()
                    .map(|s| v1::IntentState::from(s) as i32)
                    .collect(),
                    ordering_key: key.clone(),
                    page_token: token,
                    ..Default::default()
                };
                let page = service.list_intents(request).await?.into_inner();
                heads.extend(page.intents);
                token = page.next_page_token;
                if token.is_empty() {
                    break;
                }
            }
            let after_token = !page_token.is_empty();
            let request = v1::ListIntentsRequest {
                states: vec![v1::IntentState::Waiting as i32],
                ordering_key: key.clone(),
                page_size: limit,
                page_token,
                ..Default::default()
            };
            let waiting = service.list_intents(request).await?.into_inner();
            one_tenant(&key, heads.iter().chain(&waiting.intents))?;
            // A DEAD_LETTERED intent given up by an operator (DEAD) no longer holds its
            // key; only its resolutions tell it from one that does.
            let mut given_up = HashSet::new();
            for intent in &heads {
                if intent.state != v1::IntentState::DeadLettered as i32 {
                    continue;
                }
                let request = v1::GetIntentRequest {
                    id: intent.id.clone(),
                };
                let got = service.get_intent(request).await?.into_inner();
                if got
                    .resolutions
                    .iter()
                    .any(|r| r.decision() == v1::Decision::Dead)
                {
                    given_up.insert(intent.id.clone());
                }
            }
            let listed = Listed {
                count: waiting.intents.len(),
                more: !waiting.next_page_token.is_empty(),
                after_token,
            };
            let holder = key_holder(&heads, &given_up);
            let hold = match holder {
                Some(head) if head.state == v1::IntentState::Pending as i32 => {
                    // One kind's policies: one a tenant, a page for all but thousands.
                    let request = v1::ListQueuePoliciesRequest {
                        kind: head.kind.clone(),
                        ..Default::default()
                    };
                    let policies = service.list_queue_policies(request).await?.into_inner();
                    queue_hold(&policies.policies, &head.tenant, &head.kind)
                }
                _ => None,
            };
            let summary = why_key_waits(holder, &listed, hold);
            let response = v1::ListIntentsResponse {
                intents: heads.into_iter().chain(waiting.intents).collect(),
                next_page_token: waiting.next_page_token,
            };
            print_list(&client, &response, || println!("{summary}"))
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
                "actor": r.actor, "api_key": r.api_key, "reason": r.reason,
                "resolved_at": time_json(r.resolved_at.as_ref()),
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
                            who(&r.actor, &r.api_key),
                            time(r.resolved_at.as_ref()),
                            r.reason
                        );
                    }
                },
            )
        }
        Command::Reconcile {
            command:
                ReconcileCommand::List {
                    limit,
                    page_token,
                    client,
                },
        } => {
            let request = v1::ListIntentsRequest {
                awaiting_decision: true,
                page_size: limit,
                page_token,
                ..Default::default()
            };
            let response = connect(&client).await?.list_intents(request).await?;
            print_list(&client, &response.into_inner(), || {})
        }
        Command::Reconcile {
            command:
                ReconcileCommand::Resolve {
                    ids,
                    state,
                    kind,
                    region,
                    created_before,
                    limit,
                    decision,
                    actor,
                    reason,
                    client,
                },
        } => {
            // clap refuses the filter's flags with --id: none is dropped here.
            let by_filter = ids.is_empty();
            let asked = ids.len();
            let target = if by_filter {
                v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                    states: state
                        .into_iter()
                        .map(|s| v1::IntentState::from(s) as i32)
                        .collect(),
                    kind,
                    region,
                    created_before: created_before.map(crate::proto::timestamp),
                })
            } else {
                v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                    ids,
                    updated_at: Vec::new(),
                })
            };
            let decision = match decision {
                DecisionArg::Delivered => v1::Decision::Delivered,
                DecisionArg::Requeue => v1::Decision::Requeue,
                DecisionArg::Dead => v1::Decision::Dead,
                DecisionArg::Cancel => v1::Decision::Cancel,
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
            let printed = print_results(&client, &results);
            if !client.json {
                println!("{}", resolve_summary(&results, by_filter, asked, limit));
            }
            printed
        }
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
                    "regions_left_out": stats.regions_left_out,
                    "oldest_pending_at": time_json(stats.oldest_pending_at.as_ref()),
                    "oldest_staged_at": time_json(stats.oldest_staged_at.as_ref()),
                    "reconcile_backlog": stats.reconcile_backlog,
                    "blocked_keys": stats.blocked_keys,
                    "oldest_blocked_at": time_json(stats.oldest_blocked_at.as_ref()),
                    "policies": stats.policies.iter().map(policy_json).collect::<Vec<_>>(),
                    "policies_left_out": stats.policies_left_out,
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
                    if stats.regions_left_out {
                        println!("(of each state, the 100 regions with the most intents)");
                    }
                    println!("reconcile backlog: {}", stats.reconcile_backlog);
                    println!(
                        "blocked ordering keys: {} (oldest since {})",
                        stats.blocked_keys,
                        time(stats.oldest_blocked_at.as_ref())
                    );
                    println!(
                        "oldest claimable pending since: {}",
                        time(stats.oldest_pending_at.as_ref())
                    );
                    println!(
                        "oldest staged since: {}",
                        time(stats.oldest_staged_at.as_ref())
                    );
                    if !stats.policies.is_empty() {
                        println!();
                        print_policy_table(&stats.policies);
                    }
                    if stats.policies_left_out {
                        println!("(more policies than fit the reply: `outboxd queues list`)");
                    }
                },
            )
        }
        Command::Queues { command } => super::queues::run(command).await,
        Command::Serve | Command::Migrate | Command::Keys { .. } => {
            unreachable!("server and key commands are dispatched by cli::dispatch")
        }
    }
}

/// `--server` as a URL: `host:port`, as the SDKs and examples take it, gets the scheme of
/// its transport (`https` when a CA file or a client certificate is given).
fn server_url(args: &ClientArgs) -> String {
    if args.server.contains("://") {
        args.server.clone()
    } else if args.ca_file.is_some() || args.cert_file.is_some() {
        format!("https://{}", args.server)
    } else {
        format!("http://{}", args.server)
    }
}

/// A PEM file of the TLS options, refused here when it holds no `what` block (a key given
/// as the CA would otherwise fail the handshake as the server's fault).
fn pem_file(path: &std::path::Path, flag: &str, what: &str) -> anyhow::Result<Vec<u8>> {
    let pem =
        std::fs::read(path).with_context(|| format!("{flag}: cannot read {}", path.display()))?;
    let text = String::from_utf8_lossy(&pem);
    anyhow::ensure!(
        text.contains("-----BEGIN ") && text.contains(what),
        "{flag}: {} holds no PEM {what}",
        path.display()
    );
    Ok(pem)
}

pub(super) async fn connect(args: &ClientArgs) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(server_url(args))
        .with_context(|| format!("{:?} is not a server address", args.server))?;
    let tls_asked = args.ca_file.is_some() || args.cert_file.is_some();
    if endpoint.uri().scheme_str() == Some("https") {
        let mut tls = ClientTlsConfig::new();
        tls = match &args.ca_file {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(pem_file(
                ca,
                "--ca-file",
                "CERTIFICATE",
            )?)),
            // A certificate of a public CA (an ingress's): the system's trust store.
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&args.cert_file, &args.key_file) {
            tls = tls.identity(Identity::from_pem(
                pem_file(cert, "--cert-file", "CERTIFICATE")?,
                pem_file(key, "--key-file", "PRIVATE KEY")?,
            ));
        }
        endpoint = endpoint.tls_config(tls)?;
    } else {
        // The key would travel in the clear to a server the flags meant to verify.
        anyhow::ensure!(
            !tls_asked,
            "--ca-file and --cert-file are for an https:// server, not {}",
            args.server
        );
    }
    let channel = endpoint.connect().await.with_context(|| {
        format!(
            "cannot reach outboxd at {} (is `outboxd serve` running?)",
            args.server
        )
    })?;
    // A key read from a file may end in a newline (or CRLF); keys hold no whitespace.
    let api_key = args.api_key.as_deref().map(str::trim);
    anyhow::ensure!(
        api_key != Some(""),
        "the API key is empty: pass --api-key or set OUTBOX_API_KEY (`outboxd keys create` \
         prints one)"
    );
    let credentials = Credentials::new(api_key, args.tenant.as_deref())
        .map_err(|s| anyhow::anyhow!("--api-key or --tenant: {}", s.message()))?;
    Ok(client::client(channel, credentials))
}

/// Prints a page of intents, then `summary` (text output only).
fn print_list(
    client: &ClientArgs,
    response: &v1::ListIntentsResponse,
    summary: impl FnOnce(),
) -> anyhow::Result<()> {
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
            summary();
        },
    )
}

/// The line after `reconcile resolve`'s results: how many intents it resolved, 0 too (a
/// filter that matched nothing prints no result), and whether a filter may match more.
fn resolve_summary(
    results: &[v1::LeaseResult],
    by_filter: bool,
    asked: usize,
    limit: i32,
) -> String {
    let resolved = results.iter().filter(|r| r.error.is_none()).count();
    let plural = |n: usize| if n == 1 { "intent" } else { "intents" };
    if !by_filter {
        return format!("resolved {resolved} of {asked} {}", plural(asked));
    }
    let intents = plural(resolved);
    // The server's default when no --limit is given.
    let limit = if limit > 0 { limit as usize } else { 100 };
    if results.is_empty() {
        "resolved 0 intents: none matched the filter".to_owned()
    } else if results.len() >= limit {
        format!("resolved {resolved} {intents} (the limit, {limit}: more may match; run it again)")
    } else {
        format!("resolved {resolved} {intents}")
    }
}

/// The WAITING intents of a key that one page listed.
struct Listed {
    count: usize,
    /// The list goes on past this page.
    more: bool,
    /// This page came after a page token (earlier pages are not counted).
    after_token: bool,
}

/// The intent that holds an ordering key: of its live intents that are not WAITING
/// (`heads`), not one of `given_up` (DEAD_LETTERED, given up by an operator's DEAD, no
/// longer holds the key); a STAGED one only if no other does (an open transaction's intent,
/// whatever its id, comes after a committed one).
fn key_holder<'a>(heads: &'a [v1::Intent], given_up: &HashSet<String>) -> Option<&'a v1::Intent> {
    let holding = || heads.iter().filter(|i| !given_up.contains(&i.id));
    holding()
        .find(|i| i.state != v1::IntentState::Staged as i32)
        .or_else(|| holding().next())
}

/// An ordering key is a tenant's: a key acting for several tenants may find the same key
/// in more than one, whose queues are apart.
fn one_tenant<'a>(key: &str, intents: impl Iterator<Item = &'a v1::Intent>) -> anyhow::Result<()> {
    let tenants: std::collections::BTreeSet<&str> = intents.map(|i| i.tenant.as_str()).collect();
    if tenants.len() > 1 {
        let tenants: Vec<&str> = tenants.into_iter().collect();
        anyhow::bail!(
            "ordering key {key:?} has intents in the tenants {}: name one with --tenant",
            tenants.join(", ")
        );
    }
    Ok(())
}

/// Why a PENDING intent of `tenant`'s `kind` is not leased though due: its queue's policy,
/// if one holds it back now.
fn queue_hold(policies: &[v1::QueuePolicy], tenant: &str, kind: &str) -> Option<String> {
    let of_kind: Vec<_> = policies
        .iter()
        .filter(|p| p.tenant == tenant && p.kind == kind)
        .collect();
    if of_kind.is_empty() {
        None
    } else if of_kind.iter().all(|p| p.paused) {
        Some(format!(
            "its queue {kind:?} is paused (outboxd queues list)"
        ))
    } else if of_kind
        .iter()
        .all(|p| p.max_in_flight > 0 && p.in_flight >= i64::from(p.max_in_flight))
    {
        Some(format!(
            "its queue {kind:?} is at its concurrency limit (outboxd queues list)"
        ))
    } else if of_kind
        .iter()
        .all(|p| p.rate_per_second > 0.0 && p.tokens < 1.0)
    {
        Some(format!(
            "its queue {kind:?} is at its rate limit (outboxd queues list)"
        ))
    } else {
        None
    }
}

/// Why an ordering key's later intents wait: what the intent that holds it (`holder`, see
/// [`key_holder`]) is doing, `hold` the reason its queue's policy gives, if any.
fn why_key_waits(holder: Option<&v1::Intent>, listed: &Listed, hold: Option<String>) -> String {
    use v1::IntentState as S;
    let mut waiting = if listed.more {
        format!("more than {}", listed.count)
    } else {
        listed.count.to_string()
    };
    if listed.after_token {
        waiting.push_str(" (after the page token)");
    }
    let Some(head) = holder else {
        return if listed.count == 0 && !listed.more {
            "nothing live under this key".to_owned()
        } else {
            format!(
                "{waiting} waiting and no first intent (not expected: a key moves on in the transaction that finishes its first)"
            )
        };
    };
    let now = std::time::SystemTime::now();
    let due_later = head
        .available_at
        .as_ref()
        .is_some_and(|t| std::time::SystemTime::try_from(*t).is_ok_and(|t| t > now));
    let state = S::try_from(head.state).unwrap_or(S::Unspecified);
    if state == S::Staged {
        // Its place among the waiting ones is its commit's, not known yet.
        return format!(
            "held by: {} STAGED: its producer transaction is still open; {waiting} waiting until it ends",
            head.id
        );
    }
    let why = match state {
        S::Pending if head.attempts > 0 && due_later => format!(
            "retrying, attempt {}/{} failed ({}); next try at {}",
            head.attempts,
            head.max_attempts,
            head.last_error,
            time(head.available_at.as_ref())
        ),
        S::Pending if due_later => {
            format!("not due until {}", time(head.available_at.as_ref()))
        }
        S::Pending => hold.unwrap_or_else(|| "claimable".to_owned()),
        S::Leased | S::Submitted => format!(
            "being delivered by {}, lease until {}",
            head.worker_id,
            time(head.lease_expires_at.as_ref())
        ),
        S::NeedsReconcile => {
            "blocks the key until an operator decides (outboxd reconcile resolve)".to_owned()
        }
        S::DeadLettered => format!(
            "blocks the key until an operator decides (outboxd reconcile resolve); last error: {}",
            head.last_error
        ),
        _ => String::new(),
    };
    format!(
        "first: {} {}: {why}; {waiting} waiting behind it",
        head.id,
        state_name(head.state)
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

fn duration(d: Duration) -> prost_types::Duration {
    // Past i64 seconds: the longest the wire holds, which the server refuses as too long.
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intent(id: &str, state: v1::IntentState) -> v1::Intent {
        v1::Intent {
            id: id.to_owned(),
            state: state as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_keys_first_intent_is_a_committed_one_before_an_open_transactions() {
        let heads = [
            intent("a", v1::IntentState::Staged),
            intent("b", v1::IntentState::Pending),
        ];
        let listed = Listed {
            count: 2,
            more: false,
            after_token: false,
        };
        let given_up = HashSet::new();
        let why = why_key_waits(key_holder(&heads, &given_up), &listed, None);
        assert!(why.starts_with("first: b PENDING: claimable"), "{why}");
        let why = why_key_waits(key_holder(&heads[..1], &given_up), &listed, None);
        assert_eq!(
            why,
            "held by: a STAGED: its producer transaction is still open; 2 waiting until it ends"
        );
    }

    #[test]
    fn a_first_intent_not_due_or_held_by_its_queue_says_so() {
        let listed = Listed {
            count: 1,
            more: false,
            after_token: false,
        };
        let later = std::time::SystemTime::now() + Duration::from_secs(600);
        let delayed = v1::Intent {
            available_at: Some(later.into()),
            ..intent("d", v1::IntentState::Pending)
        };
        let why = why_key_waits(Some(&delayed), &listed, None);
        assert!(why.starts_with("first: d PENDING: not due until "), "{why}");

        let policy = |paused, max_in_flight, in_flight| v1::QueuePolicy {
            tenant: "acme".to_owned(),
            kind: "mail".to_owned(),
            paused,
            max_in_flight,
            in_flight,
            ..Default::default()
        };
        let paused = queue_hold(&[policy(true, 0, 0)], "acme", "mail");
        let due = intent("p", v1::IntentState::Pending);
        let why = why_key_waits(Some(&due), &listed, paused);
        assert!(
            why.contains("PENDING: its queue \"mail\" is paused"),
            "{why}"
        );
        assert!(
            queue_hold(&[policy(false, 4, 4)], "acme", "mail")
                .is_some_and(|h| h.contains("concurrency limit"))
        );
        assert_eq!(queue_hold(&[policy(false, 4, 3)], "acme", "mail"), None);
        assert_eq!(queue_hold(&[policy(true, 0, 0)], "acme", "sms"), None);
        // Another tenant's pause of the same kind holds nothing back here.
        assert_eq!(queue_hold(&[policy(true, 0, 0)], "globex", "mail"), None);
    }

    #[test]
    fn resolve_says_how_many_it_resolved_none_too() {
        let ok = |id: &str| v1::LeaseResult {
            intent_id: id.to_owned(),
            ..Default::default()
        };
        let refused = v1::LeaseResult {
            error: Some(v1::ItemError::default()),
            ..ok("c")
        };
        assert_eq!(
            resolve_summary(&[], true, 0, 0),
            "resolved 0 intents: none matched the filter"
        );
        assert_eq!(resolve_summary(&[ok("a")], true, 0, 0), "resolved 1 intent");
        assert_eq!(
            resolve_summary(&[ok("a"), ok("b")], true, 0, 2),
            "resolved 2 intents (the limit, 2: more may match; run it again)"
        );
        assert_eq!(
            resolve_summary(&[ok("a"), ok("b"), refused], false, 3, 0),
            "resolved 2 of 3 intents"
        );
    }

    #[test]
    fn a_server_given_as_host_and_port_gets_its_transports_scheme() {
        let args = |server: &str, ca: Option<&str>| ClientArgs {
            server: server.to_owned(),
            json: false,
            api_key: None,
            tenant: None,
            ca_file: ca.map(Into::into),
            cert_file: None,
            key_file: None,
        };
        assert_eq!(
            server_url(&args("127.0.0.1:50051", None)),
            "http://127.0.0.1:50051"
        );
        assert_eq!(
            server_url(&args("outboxd:50051", Some("ca.pem"))),
            "https://outboxd:50051"
        );
        assert_eq!(
            server_url(&args("https://outboxd:50051", None)),
            "https://outboxd:50051"
        );
    }
}
