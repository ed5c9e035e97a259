//! `GET /queues`: queue policies (paused, limited) with their live figures, and the
//! ordering keys held back by their first intent; `POST /queues`: set a queue's policy.

use askama::Template;
use axum::Form;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::Shared;
use super::session::Session;
use super::view::{self, Chrome};
use crate::outbox::store;
use crate::proto::v1::{self, outbox_service_server::OutboxService};

#[derive(Template)]
#[template(path = "console/queues.html")]
struct QueuesPage {
    chrome: Chrome,
    policies: Vec<Policy>,
    blocked: Vec<Blocked>,
    saved: Option<String>,
}

struct Policy {
    tenant: String,
    kind: String,
    paused: bool,
    max_in_flight: i32,
    in_flight: i64,
    rate: String,
    actor: String,
    reason: String,
    updated_at: String,
}

struct Blocked {
    id: String,
    tenant: String,
    kind: String,
    ordering_key: String,
    state: String,
    since: String,
}

/// Blocked keys shown, the longest blocked first.
const BLOCKED_SHOWN: i64 = 100;

/// `GET /queues`.
pub(super) async fn page(State(console): State<Shared>, session: Session) -> Response {
    render(&console, &session, None).await
}

async fn render(console: &Shared, session: &Session, saved: Option<String>) -> Response {
    let request = match session.request(v1::ListQueuePoliciesRequest::default(), None) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let policies = match console.handler.list_queue_policies(request).await {
        Ok(answer) => answer.into_inner().policies,
        Err(status) => return view::failure(&status),
    };
    let caller = &session.caller;
    let read = async {
        let mut tx = console.handler.begin_operator(&caller.tenants).await?;
        let keys =
            store::blocked_keys(&mut tx, &caller.regions, console.clock.now(), BLOCKED_SHOWN)
                .await?;
        tx.commit().await?;
        Ok::<_, crate::outbox::Error>(keys)
    };
    let blocked = match read.await {
        Ok(keys) => keys,
        Err(e) => return view::failure(&e.into()),
    };
    let page = QueuesPage {
        chrome: session.chrome("queues"),
        policies: policies
            .into_iter()
            .map(|p| Policy {
                rate: if p.rate_per_second > 0.0 {
                    format!(
                        "{}/s, burst {}, {:.1} tokens now",
                        p.rate_per_second, p.burst, p.tokens
                    )
                } else {
                    String::new()
                },
                updated_at: view::timestamp(p.updated_at.as_ref()),
                tenant: p.tenant,
                kind: p.kind,
                paused: p.paused,
                max_in_flight: p.max_in_flight,
                in_flight: p.in_flight,
                actor: p.actor,
                reason: p.reason,
            })
            .collect(),
        blocked: blocked
            .into_iter()
            .map(|k| Blocked {
                id: k.id.to_string(),
                state: view::state(crate::proto::v1::IntentState::from(k.state) as i32),
                since: view::time(&k.since),
                tenant: k.tenant,
                kind: k.kind,
                ordering_key: k.ordering_key,
            })
            .collect(),
        saved,
    };
    view::render(StatusCode::OK, &page)
}

#[derive(Deserialize)]
pub(super) struct SetPolicy {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    paused: Option<String>,
    #[serde(default)]
    max_in_flight: String,
    #[serde(default)]
    rate_per_second: String,
    #[serde(default)]
    burst: String,
    #[serde(default)]
    reason: String,
}

fn number<T: std::str::FromStr + Default>(field: &str, value: &str) -> Result<T, Response> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(T::default());
    }
    value.parse().map_err(|_| {
        view::error_page(
            StatusCode::BAD_REQUEST,
            &format!("{field} must be a number (empty: no limit); nothing was changed"),
        )
    })
}

/// `POST /queues`: replaces the policy of one queue (a tenant's kind).
pub(super) async fn set(
    State(console): State<Shared>,
    session: Session,
    Form(form): Form<SetPolicy>,
) -> Response {
    if let Err(refused) = session.check_csrf(&form.csrf) {
        return refused;
    }
    let parsed = (
        number::<i32>("max in flight", &form.max_in_flight),
        number::<f64>("rate per second", &form.rate_per_second),
        number::<i32>("burst", &form.burst),
    );
    let (max_in_flight, rate_per_second, burst) = match parsed {
        (Ok(m), Ok(r), Ok(b)) => (m, r, b),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
    };
    let request = v1::SetQueuePolicyRequest {
        kind: form.kind.trim().to_owned(),
        paused: form.paused.is_some(),
        max_in_flight,
        rate_per_second,
        burst,
        actor: session.caller.key_name.clone(),
        reason: super::one_line(&form.reason),
    };
    let request = match session.request(request, Some(form.tenant.trim())) {
        Ok(r) => r,
        Err(e) => return e,
    };
    match console.handler.set_queue_policy(request).await {
        Ok(answer) => {
            let policy = answer.into_inner().policy.unwrap_or_default();
            let saved = format!("policy of {}/{} saved", policy.tenant, policy.kind);
            render(&console, &session, Some(saved)).await
        }
        Err(status) => view::failure(&status),
    }
}
