//! `GET /intents`: intents filtered and paged; `GET /intents/{id}`: one intent whole.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use super::Shared;
use super::overview::query_value;
use super::session::Session;
use super::view::{self, Chrome, Payload};
use crate::outbox::store;
use crate::proto::v1::{self, outbox_service_server::OutboxService};

/// The filters of the intents page, as the form sends them.
#[derive(Deserialize, Default)]
pub(super) struct Filter {
    #[serde(default)]
    state: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    region: String,
    /// An intent id or an idempotency key.
    #[serde(default)]
    q: String,
    /// Enqueued at or after (UTC, `2026-12-05T04:00` or RFC 3339).
    #[serde(default)]
    since: String,
    /// Enqueued at or before.
    #[serde(default)]
    until: String,
    /// The page token (the last id of the previous page).
    #[serde(default)]
    after: String,
}

/// Intents per page.
const PAGE_SIZE: i32 = 50;

/// One intent as a row of a listing.
pub(super) struct Row {
    pub id: String,
    /// Whose: a key of several tenants sees intents of each side by side.
    pub tenant: String,
    pub state: String,
    pub kind: String,
    pub region: String,
    pub attempts: String,
    pub created_at: String,
    pub updated_at: String,
    /// `updated_at` exactly, `seconds.nanos`: what a decision form sends back, so that a
    /// decision is not taken on an intent changed since the page was read.
    pub seen: String,
    pub worker: String,
    pub last_error: String,
}

impl Row {
    pub fn of(i: &v1::Intent) -> Self {
        Self {
            id: i.id.clone(),
            tenant: i.tenant.clone(),
            state: view::state(i.state),
            kind: i.kind.clone(),
            region: i.region.clone(),
            attempts: format!("{}/{}", i.attempts, i.max_attempts),
            created_at: view::timestamp(i.created_at.as_ref()),
            updated_at: view::timestamp(i.updated_at.as_ref()),
            seen: view::seen(i.updated_at.as_ref()),
            worker: i.worker_id.clone(),
            last_error: i.last_error.chars().take(300).collect(),
        }
    }
}

#[derive(Template)]
#[template(path = "console/intents.html")]
struct ListPage {
    chrome: Chrome,
    states: Vec<String>,
    state: String,
    tenant: String,
    kind: String,
    region: String,
    q: String,
    since: String,
    until: String,
    rows: Vec<Row>,
    next: Option<String>,
}

fn instant(field: &str, value: &str) -> Result<Option<DateTime<Utc>>, Response> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&Utc))
        .or_else(|_| NaiveDateTime::parse_from_str(value, "%Y-%m-%dT%H:%M").map(|t| t.and_utc()))
        .or_else(|_| NaiveDateTime::parse_from_str(value, "%Y-%m-%dT%H:%M:%S").map(|t| t.and_utc()))
        .map(Some)
        .map_err(|_| {
            view::error_page(
                StatusCode::BAD_REQUEST,
                &format!("{field} must be a UTC time such as 2026-12-05T04:00"),
            )
        })
}

/// `GET /intents`.
pub(super) async fn list(
    State(console): State<Shared>,
    session: Session,
    Query(filter): Query<Filter>,
) -> Response {
    let q = filter.q.trim();
    if !q.is_empty() {
        return find(&console, &session, &filter.tenant, q).await;
    }
    let (since, until) = match (
        instant("since", &filter.since),
        instant("until", &filter.until),
    ) {
        (Ok(since), Ok(until)) => (since, until),
        (Err(e), _) | (_, Err(e)) => return e,
    };
    let states = match filter.state.as_str() {
        "" => Vec::new(),
        name => match v1::IntentState::from_str_name(&format!("INTENT_STATE_{name}")) {
            Some(state) => vec![state as i32],
            None => return view::error_page(StatusCode::BAD_REQUEST, "unknown state"),
        },
    };
    let page_token = match (filter.after.as_str(), since) {
        ("", Some(since)) => store::first_id_at(since).to_string(),
        (after, _) => after.to_owned(),
    };
    let request = v1::ListIntentsRequest {
        states,
        kind: filter.kind.clone(),
        region: filter.region.clone(),
        page_size: PAGE_SIZE.min(i32::try_from(console.handler.max_batch()).unwrap_or(PAGE_SIZE)),
        page_token,
        include_payload: false,
        ordering_key: String::new(),
        awaiting_decision: false,
    };
    let request = match session.request(request, Some(&filter.tenant)) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let page = match console.handler.list_intents(request).await {
        Ok(page) => page.into_inner(),
        Err(status) => return view::failure(&status),
    };
    let before_until = |i: &v1::Intent| match (until, i.created_at.as_ref()) {
        (Some(until), Some(t)) => t.seconds <= until.timestamp(),
        _ => true,
    };
    let shown: Vec<&v1::Intent> = page
        .intents
        .iter()
        .take_while(|i| before_until(i))
        .collect();
    let next = (shown.len() == page.intents.len() && !page.next_page_token.is_empty()).then(|| {
        format!(
            "/intents?state={}&tenant={}&kind={}&region={}&until={}&after={}",
            query_value(&filter.state),
            query_value(&filter.tenant),
            query_value(&filter.kind),
            query_value(&filter.region),
            query_value(&filter.until),
            query_value(&page.next_page_token)
        )
    });
    let page = ListPage {
        chrome: session.chrome("intents"),
        states: state_names(),
        rows: shown.into_iter().map(Row::of).collect(),
        next,
        state: filter.state,
        tenant: filter.tenant,
        kind: filter.kind,
        region: filter.region,
        q: String::new(),
        since: filter.since,
        until: filter.until,
    };
    view::render(StatusCode::OK, &page)
}

/// The intent named by `q`: its id, or its idempotency key (one per tenant).
async fn find(console: &Shared, session: &Session, tenant: &str, q: &str) -> Response {
    if let Ok(id) = Uuid::parse_str(q) {
        return Redirect::to(&format!("/intents/{id}")).into_response();
    }
    if q.len() > 1024 {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            "an idempotency key is at most 1024 bytes",
        );
    }
    if q.chars().any(char::is_control) {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            "an idempotency key has no control characters",
        );
    }
    let request = match session.request((), Some(tenant)) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let scope = match session.caller.scope(request.metadata()) {
        Ok(scope) => scope,
        Err(e) => return view::failure(&e.into()),
    };
    let read = async {
        let mut tx = console.handler.begin_operator(&scope).await?;
        let ids = store::ids_by_idempotency_key(&mut tx, q, &session.caller.regions).await?;
        tx.commit().await?;
        Ok::<_, crate::outbox::Error>(ids)
    };
    match read.await {
        Ok(ids) if ids.len() == 1 => Redirect::to(&format!("/intents/{}", ids[0])).into_response(),
        Ok(ids) if ids.is_empty() => view::error_page(
            StatusCode::NOT_FOUND,
            "no intent has this id or idempotency key",
        ),
        Ok(ids) => {
            let list = ids
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            view::error_page(
                StatusCode::CONFLICT,
                &format!(
                    "this idempotency key names intents of several tenants ({list}): name the \
                     tenant"
                ),
            )
        }
        Err(e) => view::failure(&e.into()),
    }
}

#[derive(Template)]
#[template(path = "console/intent.html")]
struct IntentPage {
    chrome: Chrome,
    row: Row,
    priority: i32,
    content_type: String,
    idempotency_key: String,
    ordering_key: String,
    available_at: String,
    lease_expires_at: String,
    headers: Vec<(String, String)>,
    trace_id: String,
    payload: Payload,
    resolutions: Vec<Resolution>,
    /// An ordered dead letter given up with DEAD: final, whatever its state says.
    given_up: bool,
    decisions: Vec<&'static str>,
}

struct Resolution {
    decision: String,
    from_state: String,
    actor: String,
    /// The API key that made the call, when the actor names someone else.
    key: String,
    reason: String,
    at: String,
}

/// `GET /intents/{id}`.
pub(super) async fn one(
    State(console): State<Shared>,
    session: Session,
    Path(id): Path<String>,
) -> Response {
    let request = match session.request(v1::GetIntentRequest { id }, None) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let found = match console.handler.get_intent(request).await {
        Ok(found) => found.into_inner(),
        Err(status) => return view::failure(&status),
    };
    let Some(intent) = found.intent else {
        return view::error_page(StatusCode::NOT_FOUND, "no such intent");
    };
    let given_up = given_up(&intent, &found.resolutions);
    let mut headers: Vec<(String, String)> = intent.headers.clone().into_iter().collect();
    headers.sort();
    // The list cuts the last error; its own page shows it whole.
    let mut row = Row::of(&intent);
    row.last_error.clone_from(&intent.last_error);
    let page = IntentPage {
        chrome: session.chrome("intents"),
        row,
        priority: intent.priority,
        content_type: intent.content_type.clone(),
        idempotency_key: intent.idempotency_key.clone(),
        ordering_key: intent.ordering_key.clone(),
        available_at: view::timestamp(intent.available_at.as_ref()),
        lease_expires_at: view::timestamp(intent.lease_expires_at.as_ref()),
        trace_id: view::trace_id(&intent.headers),
        headers,
        payload: Payload::of(&intent.payload),
        resolutions: found
            .resolutions
            .iter()
            .map(|r| Resolution {
                decision: view::decision(r.decision),
                from_state: view::state(r.from_state),
                actor: r.actor.clone(),
                key: if r.api_key == r.actor {
                    String::new()
                } else {
                    r.api_key.clone()
                },
                reason: r.reason.clone(),
                at: view::timestamp(r.resolved_at.as_ref()),
            })
            .collect(),
        given_up,
        decisions: if given_up {
            Vec::new()
        } else {
            decisions_for(intent.state, !intent.ordering_key.is_empty())
        },
    };
    view::render(StatusCode::OK, &page)
}

/// The decisions an operator may take on an intent in `state`: DEAD on a dead letter only
/// releases an ordered one's key (on an unordered one it would change nothing).
pub(super) fn decisions_for(state: i32, ordered: bool) -> Vec<&'static str> {
    use v1::IntentState as S;
    match S::try_from(state) {
        Ok(S::NeedsReconcile) => vec!["DELIVERED", "REQUEUE", "DEAD"],
        Ok(S::DeadLettered) if ordered => vec!["DELIVERED", "REQUEUE", "DEAD"],
        Ok(S::DeadLettered) => vec!["DELIVERED", "REQUEUE"],
        Ok(S::Staged | S::Waiting | S::Pending) => vec!["CANCEL"],
        _ => Vec::new(),
    }
}

/// Whether `intent` is an ordered dead letter given up with DEAD: its key moved on, it is
/// final, and every decision on it is refused (`INVALID_STATE`). The API does not show its
/// finish time, but only that decision finishes an ordered intent and leaves it
/// DEAD_LETTERED, and nothing is decided after it: so its last decision is DEAD.
/// (`resolutions` oldest first, as GetIntent answers them.)
fn given_up(intent: &v1::Intent, resolutions: &[v1::Resolution]) -> bool {
    intent.state == v1::IntentState::DeadLettered as i32
        && !intent.ordering_key.is_empty()
        && resolutions
            .last()
            .is_some_and(|r| r.decision == v1::Decision::Dead as i32)
}

/// Every state's name, in the API's order.
fn state_names() -> Vec<String> {
    (1..=20)
        .filter_map(|n| v1::IntentState::try_from(n).ok())
        .map(|s| view::state(s as i32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_is_offered_on_a_dead_letter_only_when_it_releases_an_ordering_key() {
        use v1::IntentState as S;
        let offered = |state: S, ordered| decisions_for(state as i32, ordered);
        assert_eq!(offered(S::DeadLettered, false), ["DELIVERED", "REQUEUE"]);
        assert_eq!(
            offered(S::DeadLettered, true),
            ["DELIVERED", "REQUEUE", "DEAD"]
        );
        assert_eq!(
            offered(S::NeedsReconcile, false),
            ["DELIVERED", "REQUEUE", "DEAD"]
        );
        assert_eq!(offered(S::Pending, true), ["CANCEL"]);
        assert!(offered(S::Leased, false).is_empty());
    }

    #[test]
    fn an_ordered_dead_letter_whose_last_decision_is_dead_is_given_up() {
        let intent = |state: v1::IntentState, key: &str| v1::Intent {
            state: state as i32,
            ordering_key: key.to_owned(),
            ..Default::default()
        };
        let decided = |decisions: &[v1::Decision]| -> Vec<v1::Resolution> {
            decisions
                .iter()
                .map(|d| v1::Resolution {
                    decision: *d as i32,
                    ..Default::default()
                })
                .collect()
        };
        use v1::{Decision as D, IntentState as S};
        let dead = decided(&[D::Requeue, D::Dead]);
        assert!(given_up(&intent(S::DeadLettered, "k"), &dead));
        // Unordered: DEAD changes nothing, and REQUEUE still applies.
        assert!(!given_up(&intent(S::DeadLettered, ""), &dead));
        // Requeued since, and dead-lettered again: it holds its key.
        let requeued = decided(&[D::Dead, D::Requeue]);
        assert!(!given_up(&intent(S::DeadLettered, "k"), &requeued));
        assert!(!given_up(&intent(S::DeadLettered, "k"), &[]));
        assert!(!given_up(&intent(S::Pending, "k"), &dead));
    }
}
