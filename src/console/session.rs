//! Sign-in with an API key, the session cookie, and the CSRF token every change carries.

use axum::Form;
use axum::extract::{FromRequestParts, Query, State};
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
    max_text: usize,
}

impl Session {
    /// The page frame of this session.
    pub fn chrome(&self, active: &'static str) -> Chrome {
        Chrome {
            key_name: self.caller.key_name.clone(),
            admin: self.caller.permissions.contains(&Permission::Admin),
            csrf: self.csrf.clone(),
            active,
            max_text: self.max_text,
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
        // Back to this page after signing in; a session that ended is said to have (the
        // change it was sent with, if any, was not made).
        let to_sign_in =
            |ended: bool| Redirect::to(&sign_in_path(ended, &page_of(parts))).into_response();
        // Only what `random_hex` mints is looked up.
        let Some(token) = session_cookie(&parts.headers)
            .filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            return Err(to_sign_in(false));
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
                max_text: console.handler.max_text_length(),
            }),
            Ok(None) => Err(to_sign_in(true)),
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

/// The page a request was made from, to return to after signing in: a page asked for, or
/// the page of this console a form was sent from (its `Referer`; a form's own address
/// answers only its POST). None when neither is a page to return to.
fn page_of(parts: &Parts) -> Option<String> {
    use axum::http::Method;
    if matches!(parts.method, Method::GET | Method::HEAD) {
        return parts.uri.path_and_query().map(ToString::to_string);
    }
    let referer: axum::http::Uri = parts
        .headers
        .get(header::REFERER)?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    let host = parts.headers.get(header::HOST)?.to_str().ok()?;
    (referer.authority()?.as_str() == host)
        .then(|| referer.path_and_query().map(ToString::to_string))
        .flatten()
}

/// `/sign-in`, saying that the session ended (`ended`), and where to go back to.
fn sign_in_path(ended: bool, back_to: &Option<String>) -> String {
    let mut query = Vec::new();
    if ended {
        query.push("expired=1".to_owned());
    }
    if let Some(next) = back_to.as_deref().and_then(safe_next).filter(|n| *n != "/") {
        query.push(format!("next={}", super::overview::query_value(next)));
    }
    if query.is_empty() {
        "/sign-in".to_owned()
    } else {
        format!("/sign-in?{}", query.join("&"))
    }
}

/// Longest page address returned to after signing in.
const MAX_NEXT_LENGTH: usize = 2048;

/// `next` if it is a page of this console to go back to: a path of this origin (`/…`,
/// not `//host` nor `/\host`, which browsers read as another host), of printable ASCII
/// only (no space, control character or backslash, which browsers drop or read as `/`),
/// and not the sign-in or sign-out. Anything else is no address to follow: no link to the
/// sign-in page can send an operator to another site.
pub(super) fn safe_next(next: &str) -> Option<&str> {
    let path = next.strip_prefix('/')?;
    let own_page = next.len() <= MAX_NEXT_LENGTH
        && !path.starts_with('/')
        && next.bytes().all(|b| b.is_ascii_graphic() && b != b'\\')
        && !next.starts_with("/sign-in")
        && !next.starts_with("/sign-out");
    own_page.then_some(next)
}

#[derive(Deserialize, Default)]
pub(super) struct SignInQuery {
    /// Set when a session ended: the sign-in page says so.
    #[serde(default)]
    expired: Option<String>,
    /// The page to return to.
    #[serde(default)]
    next: String,
}

/// `GET /sign-in`.
pub(super) async fn sign_in_page(Query(query): Query<SignInQuery>) -> Response {
    let next = safe_next(&query.next).unwrap_or_default();
    let said = query.expired.is_some().then_some(if next.is_empty() {
        "Your session has expired (or was ended): nothing was changed. Sign in again."
    } else {
        "Your session has expired (or was ended): nothing was changed. Sign in again to go \
         back to the page you were on."
    });
    view::sign_in(StatusCode::OK, said, next)
}

#[derive(Deserialize)]
pub(super) struct SignIn {
    key: String,
    /// The page to return to.
    #[serde(default)]
    next: String,
}

/// Longest key accepted at sign-in (a minted one has 68 characters).
const MAX_KEY_LENGTH: usize = 512;

/// `POST /sign-in`: a key of scope `operate` or `admin` opens a session.
pub(super) async fn sign_in(State(console): State<Shared>, Form(form): Form<SignIn>) -> Response {
    let next = safe_next(&form.next).unwrap_or_default();
    let sign_in = |status, error: &str| view::sign_in(status, Some(error), next);
    let key = form.key.trim();
    if key.len() > MAX_KEY_LENGTH || !key.starts_with(KEY_PREFIX) {
        return sign_in(
            StatusCode::UNAUTHORIZED,
            "an API key starts with obx_ (from `outboxd keys create`)",
        );
    }
    let caller = match console.auth.resolve_now(key).await {
        Ok(caller) => caller,
        Err(crate::outbox::Error::Unauthenticated(why)) => {
            return sign_in(StatusCode::UNAUTHORIZED, &why);
        }
        Err(e) => return view::failure(&e.into()),
    };
    if caller.require(Permission::Operate).is_err() {
        return sign_in(
            StatusCode::FORBIDDEN,
            "this key lacks the operate or admin scope the console needs",
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
            return sign_in(StatusCode::UNAUTHORIZED, "unknown or revoked API key");
        }
        Err(e) => return view::failure(&e.into()),
    }
    tracing::info!(auth.key = %caller.key_name, "console sign-in");
    // No Max-Age: the browser keeps sending the cookie past the session's expiry, so the
    // sign-in page can say that the session expired (the database decides when it does).
    let cookie = Cookie::build((COOKIE, token))
        .path("/")
        .http_only(true)
        .secure(console.secure)
        .same_site(SameSite::Strict)
        .build();
    let page = if next.is_empty() { "/" } else { next };
    with_cookie(Redirect::to(page).into_response(), &cookie)
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

#[cfg(test)]
mod tests {
    use super::{safe_next, sign_in_path};

    #[test]
    fn only_a_path_of_the_console_is_returned_to() {
        for own in [
            "/desk",
            "/intents/abc?x=1&y=%2F",
            "/queues?tenant=acme#policy",
        ] {
            assert_eq!(safe_next(own), Some(own));
        }
        for elsewhere in [
            "",
            "desk",
            "//attacker.example/x",
            "/\\attacker.example",
            "https://attacker.example/",
            "/\t/attacker.example",
            "/ /x",
            "/caf\u{e9}",
            "/sign-in?next=/desk",
            "/sign-out",
        ] {
            assert_eq!(safe_next(elsewhere), None, "{elsewhere:?}");
        }
        assert_eq!(safe_next(&format!("/{}", "a".repeat(3000))), None);
    }

    #[test]
    fn the_sign_in_path_says_the_session_ended_and_where_to_return() {
        assert_eq!(sign_in_path(false, &None), "/sign-in");
        assert_eq!(sign_in_path(false, &Some("/".to_owned())), "/sign-in");
        assert_eq!(
            sign_in_path(true, &Some("/intents?kind=a b".to_owned())),
            "/sign-in?expired=1"
        );
        assert_eq!(
            sign_in_path(true, &Some("/intents?kind=mail".to_owned())),
            "/sign-in?expired=1&next=%2Fintents%3Fkind%3Dmail"
        );
    }
}
