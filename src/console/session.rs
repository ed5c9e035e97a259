//! Sign-in with an API key, the session cookie, and the CSRF token every change carries.

use axum::Form;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use cookie::{Cookie, SameSite};
use serde::Deserialize;

use super::Shared;
use super::view::{self, Chrome};
use crate::auth::{Caller, KEY_PREFIX, Permission, hash_key};
use crate::outbox::store;

const COOKIE: &str = "outboxd_session";

/// A signed-in operator: the key's caller, as the gRPC API would see it.
pub(super) struct Session {
    pub caller: Caller,
    csrf: String,
    token_hash: [u8; 32],
}

impl Session {
    /// The page frame of this session.
    pub fn chrome(&self, active: &'static str) -> Chrome {
        Chrome {
            key_name: self.caller.key_name.clone(),
            admin: self.caller.permissions.contains(&Permission::Admin),
            csrf: self.csrf.clone(),
            active,
        }
    }

    /// Refuses a change whose form did not carry this session's token.
    pub fn check_csrf(&self, sent: &str) -> Result<(), Response> {
        let same = sent.len() == self.csrf.len()
            && sent
                .bytes()
                .zip(self.csrf.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if same {
            Ok(())
        } else {
            Err(view::error_page(
                StatusCode::FORBIDDEN,
                "refused: the form did not carry this session's CSRF token (reload the page \
                 and try again); nothing was changed",
            ))
        }
    }

    /// A gRPC request of this session's caller, for `tenant` (the key's tenants if none).
    pub fn request<T>(
        &self,
        message: T,
        tenant: Option<&str>,
    ) -> Result<tonic::Request<T>, Response> {
        let mut request = tonic::Request::new(message);
        request
            .extensions_mut()
            .insert(crate::gate::Authenticated(self.caller.clone()));
        if let Some(tenant) = tenant.filter(|t| !t.is_empty()) {
            let value = tenant.parse().map_err(|_| {
                view::error_page(StatusCode::BAD_REQUEST, "the tenant is not a valid name")
            })?;
            request
                .metadata_mut()
                .insert(crate::auth::TENANT_HEADER, value);
        }
        Ok(request)
    }
}

impl FromRequestParts<Shared> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, console: &Shared) -> Result<Self, Response> {
        let to_sign_in = || Redirect::to("/sign-in").into_response();
        // Only what `random_hex` mints is looked up.
        let Some(token) = session_cookie(&parts.headers)
            .filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            return Err(to_sign_in());
        };
        let token_hash = hash_key(&token);
        let found = {
            let _permit = console.auth.lookup_permit().await;
            store::find_console_session(console.pools.tenant(), &token_hash).await
        };
        match found {
            Ok(Some((record, csrf))) => Ok(Self {
                caller: Caller::from_record(record),
                csrf,
                token_hash,
            }),
            Ok(None) => Err(to_sign_in()),
            Err(e) => Err(view::failure(&e.into())),
        }
    }
}

fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == COOKIE)
        .map(|c| c.value().to_owned())
}

/// `GET /sign-in`.
pub(super) async fn sign_in_page() -> Response {
    view::sign_in(StatusCode::OK, None)
}

#[derive(Deserialize)]
pub(super) struct SignIn {
    key: String,
}

/// Longest key accepted at sign-in (a minted one has 68 characters).
const MAX_KEY_LENGTH: usize = 512;

/// `POST /sign-in`: a key of scope `operate` or `admin` opens a session.
pub(super) async fn sign_in(State(console): State<Shared>, Form(form): Form<SignIn>) -> Response {
    let key = form.key.trim();
    if key.len() > MAX_KEY_LENGTH || !key.starts_with(KEY_PREFIX) {
        return view::sign_in(
            StatusCode::UNAUTHORIZED,
            Some("an API key starts with obx_ (from `outboxd keys create`)"),
        );
    }
    let caller = match console.auth.resolve_now(key).await {
        Ok(caller) => caller,
        Err(crate::outbox::Error::Unauthenticated(why)) => {
            return view::sign_in(StatusCode::UNAUTHORIZED, Some(&why));
        }
        Err(e) => return view::failure(&e.into()),
    };
    if caller.require(Permission::Operate).is_err() {
        return view::sign_in(
            StatusCode::FORBIDDEN,
            Some("this key lacks the operate or admin scope the console needs"),
        );
    }
    let (Ok(token), Ok(csrf)) = (random_hex(), random_hex()) else {
        return view::error_page(StatusCode::INTERNAL_SERVER_ERROR, "no random source");
    };
    let stored = store::create_console_session(
        console.pools.tenant(),
        key,
        &hash_key(&token),
        &csrf,
        console.session_ttl,
    )
    .await;
    match stored {
        Ok(Some(_)) => {}
        // Revoked between the check and now.
        Ok(None) => {
            return view::sign_in(StatusCode::UNAUTHORIZED, Some("unknown or revoked API key"));
        }
        Err(e) => return view::failure(&e.into()),
    }
    tracing::info!(auth.key = %caller.key_name, "console sign-in");
    let cookie = Cookie::build((COOKIE, token))
        .path("/")
        .http_only(true)
        .secure(console.secure)
        .same_site(SameSite::Strict)
        .max_age(cookie::time::Duration::seconds(
            i64::try_from(console.session_ttl.as_secs()).unwrap_or(i64::MAX),
        ))
        .build();
    with_cookie(Redirect::to("/").into_response(), &cookie)
}

#[derive(Deserialize)]
pub(super) struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

/// `POST /sign-out`: ends the session here and in the database.
pub(super) async fn sign_out(
    State(console): State<Shared>,
    session: Session,
    Form(form): Form<CsrfOnly>,
) -> Response {
    if let Err(refused) = session.check_csrf(&form.csrf) {
        return refused;
    }
    if let Err(e) = store::delete_console_session(console.pools.tenant(), &session.token_hash).await
    {
        return view::failure(&e.into());
    }
    let cookie = Cookie::build((COOKIE, ""))
        .path("/")
        .http_only(true)
        .secure(console.secure)
        .same_site(SameSite::Strict)
        .max_age(cookie::time::Duration::ZERO)
        .build();
    with_cookie(Redirect::to("/sign-in").into_response(), &cookie)
}

fn with_cookie(mut response: Response, cookie: &Cookie<'_>) -> Response {
    if let Ok(value) = HeaderValue::from_str(&cookie.to_string()) {
        response.headers_mut().append(header::SET_COOKIE, value);
    }
    response
}

fn random_hex() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    Ok(hex::encode(bytes))
}
