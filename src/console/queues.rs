//! `GET /queues`: queue policies (paused, limited) with their live figures, and the
//! ordering keys held back by their first intent; `POST /queues`: set a queue's policy.
//!
//! A policy is changed on what the page showed: the form to change one carries the
//! policy's `updated_at`, and the change applies only to that version
//! (`SetQueuePolicyRequest.expected_updated_at`); the blank form gives a queue its first
//! policy, and is refused for a queue that has one. A saved change answers with a
//! redirect to the page (post/redirect/get), so a reload sends nothing again.

use askama::Template;
use axum::Form;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::Shared;
use super::overview::query_value;
use super::session::Session;
use super::view::{self, Chrome};
use crate::outbox::store;
use crate::proto::v1::{self, outbox_service_server::OutboxService};

#[derive(Template)]
#[template(path = "console/queues.html")]
struct QueuesPage {
    chrome: Chrome,
    policies: Vec<Policy>,
    /// The page after this one, when there is one; whether this is not the first.
    next: Option<String>,
    later_page: bool,
    blocked: Vec<Blocked>,
    saved: Option<String>,
    form: PolicyForm,
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
    /// The page that changes this policy: the form filled with it.
    change: String,
}

/// The policy form: blank (a queue's first policy), or filled with the policy it changes.
#[derive(Default)]
struct PolicyForm {
    /// Changes the policy shown (tenant and kind fixed), rather than giving one.
    changing: bool,
    tenant: String,
    kind: String,
    paused: bool,
    max_in_flight: String,
    rate_per_second: String,
    burst: String,
    /// The changed policy's `updated_at` exactly (`seconds.nanos`).
    expected: String,
    /// When and by whom it was set, as shown.
    set: String,
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

/// What `GET /queues` is asked: a page of policies (`page`, a `next_page_token`), a policy
/// to change (`tenant`, `kind`), or the one a saved change set (`saved_tenant`,
/// `saved_kind`, `saved_at`).
#[derive(Deserialize, Default)]
pub(super) struct Shown {
    #[serde(default)]
    page: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    saved_tenant: String,
    #[serde(default)]
    saved_kind: String,
    #[serde(default)]
    saved_at: String,
}

/// `GET /queues`.
pub(super) async fn page(
    State(console): State<Shared>,
    session: Session,
    Query(shown): Query<Shown>,
) -> Response {
    let listing = v1::ListQueuePoliciesRequest {
        page_token: shown.page.clone(),
        ..Default::default()
    };
    let request = match session.request(listing, None) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let (policies, next) = match console.handler.list_queue_policies(request).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            (answer.policies, answer.next_page_token)
        }
        Err(status) => return view::failure(&status),
    };
    // Looked up apart from the page shown, which may not hold them.
    let (changed, saved) = match tokio::join!(
        policy_of(&console, &session, &shown.tenant, &shown.kind),
        policy_of(&console, &session, &shown.saved_tenant, &shown.saved_kind),
    ) {
        (Ok(changed), Ok(saved)) => (changed, saved),
        (Err(e), _) | (_, Err(e)) => return e,
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
    // Said only while the policy is the one that change set: a link names no change that
    // did not happen, and a change made since is shown as it is.
    let saved = saved
        .filter(|p| {
            !shown.saved_at.is_empty() && view::seen(p.updated_at.as_ref()) == shown.saved_at
        })
        .map(|p| format!("policy of {}/{} saved", p.tenant, p.kind));
    let form = match changed {
        Some(p) => PolicyForm {
            changing: true,
            tenant: p.tenant.clone(),
            kind: p.kind.clone(),
            paused: p.paused,
            max_in_flight: positive(f64::from(p.max_in_flight)),
            rate_per_second: positive(p.rate_per_second),
            burst: if p.rate_per_second > 0.0 {
                positive(f64::from(p.burst))
            } else {
                String::new()
            },
            expected: view::seen(p.updated_at.as_ref()),
            set: format!(
                "set by {} at {}",
                p.actor,
                view::timestamp(p.updated_at.as_ref())
            ),
        },
        None => PolicyForm {
            tenant: shown.tenant,
            kind: shown.kind,
            ..PolicyForm::default()
        },
    };
    let page = QueuesPage {
        chrome: session.chrome("queues"),
        next: (!next.is_empty()).then(|| format!("/queues?page={}#policies", query_value(&next))),
        later_page: !shown.page.is_empty(),
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
                change: format!(
                    "/queues?tenant={}&kind={}#policy",
                    query_value(&p.tenant),
                    query_value(&p.kind)
                ),
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
        form,
    };
    view::render(StatusCode::OK, &page)
}

/// A limit as the form shows it: empty for none (0).
fn positive(n: f64) -> String {
    if n > 0.0 {
        n.to_string()
    } else {
        String::new()
    }
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
    /// The changed policy's `updated_at` as the page showed it; empty: the blank form.
    #[serde(default)]
    expected: String,
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

/// `POST /queues`: replaces the policy of one queue (a tenant's kind): the one the form
/// showed, or none; then back to the page.
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
    let expected_updated_at = match form.expected.trim() {
        "" => None,
        seen => match view::parse_seen(seen) {
            Some(at) => Some(at),
            None => {
                return view::error_page(
                    StatusCode::BAD_REQUEST,
                    "the form did not say which policy it changes (reload the page); nothing \
                     was changed",
                );
            }
        },
    };
    let tenant = form.tenant.trim();
    let kind = form.kind.trim().to_owned();
    if expected_updated_at.is_none()
        && let Err(refused) = has_no_policy(&console, &session, tenant, &kind).await
    {
        return refused;
    }
    let request = v1::SetQueuePolicyRequest {
        kind,
        paused: form.paused.is_some(),
        max_in_flight,
        rate_per_second,
        burst,
        actor: session.caller.key_name.clone(),
        reason: super::one_line(&form.reason),
        expected_updated_at,
    };
    let request = match session.request(request, Some(tenant)) {
        Ok(r) => r,
        Err(e) => return e,
    };
    match console.handler.set_queue_policy(request).await {
        Ok(answer) => {
            let policy = answer.into_inner().policy.unwrap_or_default();
            Redirect::to(&format!(
                "/queues?saved_tenant={}&saved_kind={}&saved_at={}",
                query_value(&policy.tenant),
                query_value(&policy.kind),
                query_value(&view::seen(policy.updated_at.as_ref()))
            ))
            .into_response()
        }
        Err(status) => view::failure(&status),
    }
}

/// Refuses the blank form for a queue that has a policy: that form showed none, and
/// would replace it unseen. (Checked just before the change, not with it: two first
/// policies of one queue given at the same instant are both applied, the later standing.)
async fn has_no_policy(
    console: &Shared,
    session: &Session,
    tenant: &str,
    kind: &str,
) -> Result<(), Response> {
    // Without a tenant, a key of several tenants is told to name one by the change itself.
    let Some(tenant) = Some(tenant)
        .filter(|t| !t.is_empty())
        .or_else(|| session.caller.tenants.single())
    else {
        return Ok(());
    };
    match policy_of(console, session, tenant, kind).await? {
        None => Ok(()),
        Some(p) => Err(view::error_page(
            StatusCode::CONFLICT,
            &format!(
                "queue {tenant}/{kind} has a policy (set at {} by {}), which this form did \
                 not show: it gives a queue its first policy. Change that one from its row's \
                 \"change\" link, on the policy as it is; nothing was changed",
                view::timestamp(p.updated_at.as_ref()),
                p.actor
            ),
        )),
    }
}

/// The policy of queue `tenant`/`kind`, if it has one (none asked for: none): listed by
/// its kind in its tenant, whatever page of the table is shown.
async fn policy_of(
    console: &Shared,
    session: &Session,
    tenant: &str,
    kind: &str,
) -> Result<Option<v1::QueuePolicy>, Response> {
    if tenant.is_empty() || kind.is_empty() {
        return Ok(None);
    }
    let listing = v1::ListQueuePoliciesRequest {
        kind: kind.to_owned(),
        ..Default::default()
    };
    let request = session.request(listing, Some(tenant))?;
    match console.handler.list_queue_policies(request).await {
        Ok(answer) => Ok(answer
            .into_inner()
            .policies
            .into_iter()
            .find(|p| p.tenant == tenant && p.kind == kind)),
        Err(status) => Err(view::failure(&status)),
    }
}
