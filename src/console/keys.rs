//! `GET /keys` (admin): the API keys this key manages; `POST /keys` mints one (its secret
//! shown once); `POST /keys/{id}/revoke`. A key manages keys within its own reach: an
//! admin of every tenant any key, an admin of some tenants keys of those tenants only, a
//! region-bound admin keys bound to its regions only, so no key mints a wider one.
//!
//! Keys are written through the schema owner's connection (the service role may read keys,
//! never write them), and each change asks for the admin's own key again: a session alone,
//! stolen or forged by whoever can write sessions, cannot mint or revoke a key.

use askama::Template;
use axum::Form;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use uuid::Uuid;

use super::Shared;
use super::session::Session;
use super::view::{self, Chrome};
use crate::auth::{self, Caller, Permission};
use crate::outbox::store::{self, ApiKeyRecord, TenantScope};

#[derive(Template)]
#[template(path = "console/keys.html")]
struct KeysPage {
    chrome: Chrome,
    keys: Vec<Key>,
    created: Option<(String, String)>,
    scopes: [&'static str; 4],
    /// Keys can be written: the server has the owner's connection.
    writable: bool,
}

struct Key {
    id: String,
    name: String,
    prefix: String,
    tenants: String,
    scopes: String,
    regions: String,
    created_at: String,
    revoked_at: String,
}

/// Whether `caller` may see and revoke `key`, or mint one like it.
fn manages(caller: &Caller, key: &ApiKeyRecord) -> bool {
    let tenants_within = match &caller.tenants {
        TenantScope::All => true,
        TenantScope::Tenants(mine) => {
            !key.all_tenants && key.tenants.iter().all(|t| mine.contains(t))
        }
    };
    let regions_within = caller.regions.is_empty()
        || (!key.regions.is_empty() && key.regions.iter().all(|r| caller.regions.contains(r)));
    tenants_within && regions_within
}

fn admin(session: &Session) -> Result<(), Response> {
    session
        .caller
        .require(Permission::Admin)
        .map_err(|e| view::failure(&e.into()))
}

/// `GET /keys`.
pub(super) async fn page(State(console): State<Shared>, session: Session) -> Response {
    if let Err(refused) = admin(&session) {
        return refused;
    }
    render(&console, &session, None).await
}

async fn render(
    console: &Shared,
    session: &Session,
    created: Option<(String, String)>,
) -> Response {
    let keys = match store::list_api_keys(console.pools.tenant()).await {
        Ok(keys) => keys,
        Err(e) => return view::failure(&e.into()),
    };
    let page = KeysPage {
        chrome: session.chrome("keys"),
        keys: keys
            .into_iter()
            .filter(|k| manages(&session.caller, k))
            .map(|k| Key {
                id: k.id.to_string(),
                tenants: if k.all_tenants {
                    "every tenant".to_owned()
                } else {
                    k.tenants.join(", ")
                },
                scopes: k.scopes.join(", "),
                regions: if k.regions.is_empty() {
                    "any".to_owned()
                } else {
                    k.regions.join(", ")
                },
                created_at: view::time(&k.created_at),
                revoked_at: k.revoked_at.map(|t| view::time(&t)).unwrap_or_default(),
                name: k.name,
                prefix: k.prefix,
            })
            .collect(),
        created,
        scopes: Permission::NAMES,
        writable: console.owner.is_some(),
    };
    view::render(StatusCode::OK, &page)
}

/// The owner's connection, once the admin's own key, given again, matches the session's.
async fn authorized<'a>(
    console: &'a Shared,
    session: &Session,
    csrf: &str,
    confirm: &str,
) -> Result<&'a sqlx::PgPool, Response> {
    admin(session)?;
    session.check_csrf(csrf)?;
    let Some(owner) = &console.owner else {
        return Err(view::error_page(
            StatusCode::CONFLICT,
            "this server has no schema owner connection (OUTBOX_DATABASE__MIGRATION_URL), so \
             keys are managed with `outboxd keys`; nothing was changed",
        ));
    };
    let confirmed = console
        .auth
        .resolve_now(confirm.trim())
        .await
        .is_ok_and(|caller| caller.key_id == session.caller.key_id);
    if !confirmed {
        return Err(view::error_page(
            StatusCode::FORBIDDEN,
            "confirm with the API key you signed in with; nothing was changed",
        ));
    }
    Ok(owner)
}

#[derive(Deserialize)]
pub(super) struct NewKey {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    confirm: String,
    #[serde(default)]
    name: String,
    /// Comma-separated; `*` for every tenant.
    #[serde(default)]
    tenants: String,
    #[serde(default)]
    regions: String,
    #[serde(default)]
    produce: Option<String>,
    #[serde(default)]
    consume: Option<String>,
    #[serde(default)]
    operate: Option<String>,
    #[serde(default)]
    admin: Option<String>,
}

fn names(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `POST /keys`.
pub(super) async fn create(
    State(console): State<Shared>,
    session: Session,
    Form(form): Form<NewKey>,
) -> Response {
    let owner = match authorized(&console, &session, &form.csrf, &form.confirm).await {
        Ok(owner) => owner,
        Err(refused) => return refused,
    };
    let bad = |why: &str| {
        view::error_page(
            StatusCode::BAD_REQUEST,
            &format!("{why}; no key was created"),
        )
    };
    let name = form.name.trim();
    if let Some(why) = crate::auth::key_name_problem(name) {
        return bad(why);
    }
    let all_tenants = form.tenants.trim() == "*";
    let tenants = names(&form.tenants);
    let regions = names(&form.regions);
    if !all_tenants
        && (tenants.is_empty() || tenants.iter().any(|t| !crate::outbox::is_name(t, 64)))
    {
        return bad("tenants: one or more names of 1-64 letters, digits or . _ - : /, or *");
    }
    if regions.iter().any(|r| !crate::outbox::is_name(r, 64)) {
        return bad("regions: names of 1-64 letters, digits or . _ - : /");
    }
    let scopes: Vec<String> = [
        ("produce", &form.produce),
        ("consume", &form.consume),
        ("operate", &form.operate),
        ("admin", &form.admin),
    ]
    .into_iter()
    .filter(|(_, on)| on.is_some())
    .map(|(scope, _)| scope.to_owned())
    .collect();
    if scopes.is_empty() {
        return bad("choose at least one scope");
    }
    let tenants = (!all_tenants).then_some(tenants);
    let wanted = ApiKeyRecord {
        id: Uuid::nil(),
        name: name.to_owned(),
        prefix: String::new(),
        all_tenants,
        tenants: tenants.clone().unwrap_or_default(),
        scopes: scopes.clone(),
        regions: regions.clone(),
        created_at: chrono::Utc::now(),
        revoked_at: None,
    };
    if !manages(&session.caller, &wanted) {
        return view::error_page(
            StatusCode::FORBIDDEN,
            "this key may only create keys within its own tenants and regions; no key was \
             created",
        );
    }
    // A form posted again (a reload of its answer) would mint a second key of the name,
    // and a name several active keys share revokes none of them by name. Among the keys
    // this one manages only: another tenant's key names are not this admin's to learn (a
    // name shared across tenants is revoked from the console, by its row).
    match store::list_api_keys(console.pools.tenant()).await {
        Ok(keys)
            if keys.iter().any(|k| {
                k.name == name && k.revoked_at.is_none() && manages(&session.caller, k)
            }) =>
        {
            return view::error_page(
                StatusCode::CONFLICT,
                &format!(
                    "an active key is already named {name} (its secret was shown when it \
                     was created); revoke it or choose another name; no key was created"
                ),
            );
        }
        Ok(_) => {}
        Err(e) => return view::failure(&e.into()),
    }
    match auth::issue_key(owner, name, tenants, scopes, regions).await {
        Ok((record, secret)) => {
            tracing::info!(auth.key = %session.caller.key_name, key.name = %record.name, "console created an API key");
            render(&console, &session, Some((record.name, secret))).await
        }
        Err(e) => view::error_page(StatusCode::BAD_REQUEST, &format!("no key was created: {e}")),
    }
}

#[derive(Deserialize)]
pub(super) struct Revoke {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    confirm: String,
}

/// `POST /keys/{id}/revoke`.
pub(super) async fn revoke(
    State(console): State<Shared>,
    session: Session,
    Path(id): Path<Uuid>,
    Form(form): Form<Revoke>,
) -> Response {
    let owner = match authorized(&console, &session, &form.csrf, &form.confirm).await {
        Ok(owner) => owner,
        Err(refused) => return refused,
    };
    let keys = match store::list_api_keys(console.pools.tenant()).await {
        Ok(keys) => keys,
        Err(e) => return view::failure(&e.into()),
    };
    let Some(key) = keys
        .into_iter()
        .find(|k| k.id == id && manages(&session.caller, k))
    else {
        return view::error_page(
            StatusCode::NOT_FOUND,
            "no such key among the keys you manage",
        );
    };
    match store::revoke_api_key_by_id(owner, id).await {
        Ok(_) => {
            tracing::info!(auth.key = %session.caller.key_name, key.name = %key.name, "console revoked an API key");
            render(&console, &session, None).await
        }
        Err(e) => view::failure(&e.into()),
    }
}
