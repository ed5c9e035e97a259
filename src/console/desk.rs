//! `GET /desk`: the reconcile desk, NEEDS_RECONCILE and DEAD_LETTERED intents oldest
//! first; `POST /resolve`: one decision on one or several intents, with a reason, recorded
//! under the signed-in key's name.

use askama::Template;
use axum::Form;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::Shared;
use super::intents::Row;
use super::overview::query_value;
use super::session::Session;
use super::view::{self, Chrome};
use crate::proto::v1::{self, outbox_service_server::OutboxService};

#[derive(Deserialize)]
pub(super) struct Page {
    #[serde(default)]
    after: String,
}

#[derive(Template)]
#[template(path = "console/desk.html")]
struct DeskPage {
    chrome: Chrome,
    rows: Vec<Row>,
    next: Option<String>,
}

/// Intents per page of the desk.
const DESK_PAGE: i32 = 100;

/// `GET /desk`.
pub(super) async fn page(
    State(console): State<Shared>,
    session: Session,
    Query(page): Query<Page>,
) -> Response {
    let request = v1::ListIntentsRequest {
        awaiting_decision: true,
        page_size: DESK_PAGE.min(i32::try_from(console.handler.max_batch()).unwrap_or(DESK_PAGE)),
        page_token: page.after,
        ..Default::default()
    };
    let request = match session.request(request, None) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let listed = match console.handler.list_intents(request).await {
        Ok(listed) => listed.into_inner(),
        Err(status) => return view::failure(&status),
    };
    let next = (!listed.next_page_token.is_empty())
        .then(|| format!("/desk?after={}", query_value(&listed.next_page_token)));
    let page = DeskPage {
        chrome: session.chrome("desk"),
        rows: listed.intents.iter().map(Row::of).collect(),
        next,
    };
    view::render(StatusCode::OK, &page)
}

#[derive(Template)]
#[template(path = "console/resolved.html")]
struct ResolvedPage {
    chrome: Chrome,
    /// What happened, as the page's title says it.
    title: &'static str,
    applied: usize,
    decision: String,
    reason: String,
    actor: String,
    outcomes: Vec<Outcome>,
}

struct Outcome {
    id: String,
    applied: bool,
    state: String,
    message: String,
}

/// Most intents one decision of the console resolves.
const MAX_SELECTED: usize = 100;

/// `POST /resolve`: fields `id` (repeated), `decision`, `reason`, `csrf`.
pub(super) async fn resolve(
    State(console): State<Shared>,
    session: Session,
    Form(fields): Form<Vec<(String, String)>>,
) -> Response {
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_default()
    };
    if let Err(refused) = session.check_csrf(field("csrf")) {
        return refused;
    }
    let ids: Vec<String> = fields
        .iter()
        .filter(|(k, _)| k == "id")
        .map(|(_, v)| v.clone())
        .collect();
    // Each intent's updated_at as the page showed it (`seen=<id> <seconds>.<nanos>`).
    let seen = |id: &str| {
        fields
            .iter()
            .filter(|(k, _)| k == "seen")
            .filter_map(|(_, v)| v.split_once(' '))
            .find(|(seen_id, _)| *seen_id == id)
            .and_then(|(_, at)| view::parse_seen(at))
    };
    let updated_at: Option<Vec<prost_types::Timestamp>> = ids.iter().map(|id| seen(id)).collect();
    let Some(updated_at) = updated_at else {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            "the form did not say when each intent was seen (reload the page); nothing was \
             changed",
        );
    };
    if ids.is_empty() {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            "select at least one intent; nothing was changed",
        );
    }
    let most = MAX_SELECTED.min(console.handler.max_batch());
    if ids.len() > most {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            &format!("at most {most} intents at once; nothing was changed"),
        );
    }
    let Some(decision) = v1::Decision::from_str_name(&format!("DECISION_{}", field("decision")))
        .filter(|d| *d != v1::Decision::Unspecified)
    else {
        return view::error_page(
            StatusCode::BAD_REQUEST,
            "choose a decision: DELIVERED, REQUEUE, DEAD or CANCEL; nothing was changed",
        );
    };
    let actor = session.caller.key_name.clone();
    let reason = super::one_line(field("reason"));
    let request = v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: ids.clone(),
            updated_at,
        })),
        decision: decision as i32,
        actor: actor.clone(),
        reason: reason.clone(),
        limit: 0,
    };
    let request = match session.request(request, None) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let results = match console.handler.reconcile(request).await {
        Ok(answer) => answer.into_inner().results,
        Err(status) => return view::failure(&status),
    };
    let outcomes: Vec<Outcome> = results
        .into_iter()
        .map(|r| Outcome {
            applied: r.error.is_none(),
            // None for an intent not found.
            state: if r.state == v1::IntentState::Unspecified as i32 {
                String::new()
            } else {
                view::state(r.state)
            },
            message: r.error.map(|e| e.message).unwrap_or_default(),
            id: r.intent_id,
        })
        .collect();
    let applied = outcomes.iter().filter(|o| o.applied).count();
    let title = if applied == outcomes.len() {
        "Decision recorded"
    } else if applied == 0 {
        "Decision not applied"
    } else {
        "Decision partly applied"
    };
    let page = ResolvedPage {
        chrome: session.chrome("desk"),
        title,
        applied,
        decision: view::decision(decision as i32),
        reason,
        actor,
        outcomes,
    };
    view::render(StatusCode::OK, &page)
}
