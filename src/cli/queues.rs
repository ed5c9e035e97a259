//! `outboxd queues`: set and list queue policies (docs/flow-control.md).

use serde_json::{Value, json};

use super::operator::connect;
use super::output::{print, time, time_json, who};
use super::{ClientArgs, QueuesCommand};
use crate::proto::v1;

/// Runs one queues command against the server.
pub(super) async fn run(command: QueuesCommand) -> anyhow::Result<()> {
    match command {
        QueuesCommand::Set {
            kind,
            paused,
            max_in_flight,
            rate,
            burst,
            actor,
            reason,
            expected_updated_at,
            client,
        } => {
            let policy = connect(&client)
                .await?
                .set_queue_policy(v1::SetQueuePolicyRequest {
                    kind,
                    paused,
                    max_in_flight: max_in_flight.unwrap_or(0),
                    rate_per_second: rate.unwrap_or(0.0),
                    burst: burst.unwrap_or(0),
                    actor,
                    reason,
                    expected_updated_at: expected_updated_at.map(crate::proto::timestamp),
                })
                .await?
                .into_inner()
                .policy
                .unwrap_or_default();
            print_policies(&client, &[policy])
        }
        QueuesCommand::List { kind, client } => {
            let mut service = connect(&client).await?;
            let mut policies = Vec::new();
            let mut page_token = String::new();
            loop {
                let request = v1::ListQueuePoliciesRequest {
                    kind: kind.clone(),
                    page_token,
                };
                let page = service.list_queue_policies(request).await?.into_inner();
                policies.extend(page.policies);
                page_token = page.next_page_token;
                if page_token.is_empty() {
                    break;
                }
            }
            print_policies(&client, &policies)
        }
    }
}

fn print_policies(client: &ClientArgs, policies: &[v1::QueuePolicy]) -> anyhow::Result<()> {
    let json = Value::Array(policies.iter().map(policy_json).collect());
    print(client, json, || print_policy_table(policies))
}

/// A policy as `--json` prints it.
pub(super) fn policy_json(p: &v1::QueuePolicy) -> Value {
    json!({
        "tenant": p.tenant, "kind": p.kind, "paused": p.paused,
        "max_in_flight": p.max_in_flight, "rate_per_second": p.rate_per_second,
        "burst": p.burst, "in_flight": p.in_flight, "tokens": p.tokens,
        "actor": p.actor, "api_key": p.api_key, "reason": p.reason,
        "updated_at": time_json(p.updated_at.as_ref()),
    })
}

/// Policies as a table.
pub(super) fn print_policy_table(policies: &[v1::QueuePolicy]) {
    println!(
        "{:<16} {:<20} {:<6} {:>13} {:>8} {:>12}  SET BY",
        "TENANT", "KIND", "PAUSED", "IN FLIGHT/MAX", "RATE/S", "TOKENS/BURST"
    );
    for p in policies {
        let max = if p.max_in_flight == 0 {
            "-".to_owned()
        } else {
            p.max_in_flight.to_string()
        };
        let (rate, bucket) = if p.rate_per_second > 0.0 {
            (
                p.rate_per_second.to_string(),
                format!("{:.1}/{}", p.tokens, p.burst),
            )
        } else {
            ("-".to_owned(), "-".to_owned())
        };
        println!(
            "{:<16} {:<20} {:<6} {:>13} {:>8} {:>12}  {} at {}: {}",
            p.tenant,
            p.kind,
            if p.paused { "yes" } else { "no" },
            format!("{}/{max}", p.in_flight),
            rate,
            bucket,
            who(&p.actor, &p.api_key),
            time(p.updated_at.as_ref()),
            p.reason,
        );
    }
}
