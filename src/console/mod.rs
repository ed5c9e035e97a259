//! The operator console (`OUTBOX_CONSOLE__LISTEN_ADDR`, docs/console.md): server-rendered
//! pages that call the gRPC handler in-process, so every read and change passes the same
//! scopes, tenant and region rules, validation and audit as the API.

// A refusal is the page answered at once (`Result<_, Response>`), built and moved once per
// request: boxing it would only add an allocation.
#![allow(
    clippy::result_large_err,
    reason = "a refusal is the response, once per request"
)]

mod assets;
mod desk;
mod intents;
mod keys;
mod overview;
mod queues;
mod session;
mod view;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::grpc::OutboxHandler;
use crate::outbox::Clock;
use crate::outbox::store::Pools;
use crate::tls::{self, TlsFiles};
use crate::{http_listener, incoming};

/// What the console's pages work with.
pub struct Console {
    /// The gRPC handler every read and decision goes through.
    pub handler: OutboxHandler,
    /// Resolves the key given at sign-in.
    pub auth: Arc<Authenticator>,
    /// For the console's own statements (sessions, overview, keys).
    pub pools: Pools,
    /// The server's clock (manual in tests).
    pub clock: Clock,
    /// How long a sign-in lasts.
    pub session_ttl: Duration,
    /// Served over TLS: cookies are `Secure`.
    pub secure: bool,
    /// The schema owner's connection, through which an admin mints and revokes keys (the
    /// service role may read keys, never write them); none: the keys page only lists.
    pub owner: Option<sqlx::PgPool>,
}

type Shared = Arc<Console>;

/// Forms are small: a reason, a few dozen ids.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// The console's routes.
pub fn router(console: Console) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route(
            "/sign-in",
            get(session::sign_in_page).post(session::sign_in),
        )
        .route("/sign-out", post(session::sign_out))
        .route("/intents", get(intents::list))
        .route("/intents/{id}", get(intents::one))
        .route("/desk", get(desk::page))
        .route("/resolve", post(desk::resolve))
        .route("/queues", get(queues::page).post(queues::set))
        .route("/keys", get(keys::page).post(keys::create))
        .route("/keys/{id}/revoke", post(keys::revoke))
        .route("/assets/console.css", get(assets::css))
        .route("/assets/console.js", get(assets::js))
        .layer(DefaultBodyLimit::max(MAX_FORM_BYTES))
        .layer(middleware::from_fn(hardened))
        .with_state(Arc::new(console))
}

/// Serves the console on `listener` (through `tls` when given), at most `max_connections`
/// open at once, until `shutdown`.
pub async fn serve(
    console: Console,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<TlsFiles>>,
    max_connections: usize,
    shutdown: CancellationToken,
) {
    let app = router(console);
    let connections = incoming::admitted(listener, max_connections, 0);
    match tls {
        Some(tls) => {
            let connections = incoming::handshaken(connections, tls, tls::Listener::Console, 0);
            http_listener::serve(connections, app, shutdown).await;
        }
        None => http_listener::serve(connections, app, shutdown).await,
    }
}

/// Every answer's security headers, changes from other sites' pages refused, and every
/// request's work in a task of its own: a
/// browser that goes away mid-request must not stop a change half way (the gRPC
/// handler's own rule, `grpc::to_completion`).
async fn hardened(request: Request, next: Next) -> Response {
    let change = !matches!(*request.method(), Method::GET | Method::HEAD);
    let mut response = if from_another_site(&request) {
        view::error_page(
            StatusCode::FORBIDDEN,
            "a change sent from another site's page is refused",
        )
    } else {
        match tokio::spawn(next.run(request)).await {
            Ok(response) => as_page(response, change).await,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => view::error_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            ),
        }
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// Longest plain-text refusal read to be shown on a page.
const REFUSAL_SHOWN: usize = 4096;

/// A refusal axum's extractors answer in plain text (a form over [`MAX_FORM_BYTES`], a
/// form or query that does not parse) as the console's own error page, saying that a
/// change (`change`: not a GET) was not made. Every other answer as it is.
async fn as_page(response: Response, change: bool) -> Response {
    let plain = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/plain"));
    let status = response.status();
    if !(status.is_client_error() && plain) {
        return response;
    }
    let why = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!(
            "the form is larger than the console takes ({} KiB)",
            MAX_FORM_BYTES / 1024
        )
    } else {
        let body = axum::body::to_bytes(response.into_body(), REFUSAL_SHOWN)
            .await
            .unwrap_or_default();
        String::from_utf8_lossy(&body).trim().to_owned()
    };
    let message = if change {
        format!("{why}; nothing was changed")
    } else {
        why
    };
    view::error_page(status, &message)
}

/// A reason typed in a form's text area, as one line: the API refuses control characters,
/// and a browser sends the area's line breaks as CR LF.
fn one_line(text: &str) -> String {
    text.trim()
        .split(['\r', '\n', '\t'])
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A change (any method but GET and HEAD) that a page of another origin sent: a forged
/// form. The CSRF token guards a session's changes; this guards the sign-in form too, which
/// has no session yet (a forged sign-in would put the operator in the forger's session).
/// Browsers say where a request comes from in `Sec-Fetch-Site` (only to secure origins:
/// HTTPS, localhost), else in `Origin`: this console's own forms send its origin
/// (`Referrer-Policy: same-origin`), while `null` is what a sandboxed frame or a page that
/// hides its referrer sends, refused. A client that sends neither is no browser, and no
/// page can make it send anything.
fn from_another_site(request: &Request) -> bool {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return false;
    }
    let headers = request.headers();
    if let Some(site) = headers.get("sec-fetch-site") {
        return !matches!(site.as_bytes(), b"same-origin" | b"none");
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return false;
    };
    if origin.as_bytes() == b"null" {
        return true;
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, host)| host);
    origin_host.is_none() || origin_host != host
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn a_reason_typed_on_several_lines_is_sent_as_one() {
        assert_eq!(
            one_line(" card declined\r\n\r\nby the bank\tagain \n"),
            "card declined by the bank again"
        );
    }
}
