//! The producers' side of lost responses (the workers have the SDK's): a set of outboxd
//! endpoints (the fault proxies in front of every replica) and a call helper that retries a transient failure with the
//! *same* request, moving to the next replica each time. Because the request is the same,
//! a retry carries the same idempotency keys, Claim `request_id` or lease: exactly what the
//! server's replay rules are for.

use std::future::Future;
use std::time::Duration;

use outboxd::client::{Client, Credentials};
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::rng::Rng;

/// Per-attempt deadline of a call that does not long-poll.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A call that ended without success.
#[derive(Debug)]
pub enum CallError {
    /// The server refused the request itself; retrying would not help.
    Definite { status: Status },
    /// No definite answer before the budget ran out.
    Exhausted { last: String, tries: u32 },
}

impl CallError {
    /// A short description for journals.
    pub fn describe(&self) -> String {
        match self {
            Self::Definite { status, .. } => describe(status),
            Self::Exhausted { last, tries } => format!("no answer after {tries} tries: {last}"),
        }
    }
}

/// A successful call and what it took.
#[derive(Debug)]
pub struct Called<T> {
    /// The response message.
    pub value: T,
    /// Attempts made (1 when nothing was lost).
    pub tries: u32,
}

/// Clients for every endpoint, all with the same key.
pub struct Rpc {
    clients: Vec<Client>,
    rng: Rng,
}

impl Rpc {
    /// Lazy channels to `endpoints` (`host:port`), sending `api_key`.
    pub fn new(endpoints: &[String], api_key: &str, seed: u64) -> anyhow::Result<Self> {
        anyhow::ensure!(!endpoints.is_empty(), "no endpoints");
        let credentials = Credentials::new(Some(api_key), None)?;
        let clients = endpoints
            .iter()
            .map(|addr| {
                let channel = Channel::from_shared(format!("http://{addr}"))?
                    .connect_timeout(Duration::from_secs(1))
                    .connect_lazy();
                Ok(outboxd::client::client(channel, credentials.clone()))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            clients,
            rng: Rng::new(seed),
        })
    }

    /// Calls `attempt` on a random replica, retrying transient failures on the next one
    /// with a short backoff until `budget` is spent. `attempt` must build the same request
    /// every time.
    pub async fn call<T, F, Fut>(
        &mut self,
        budget: Duration,
        mut attempt: F,
    ) -> Result<Called<T>, CallError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + budget;
        let mut index = self.rng.below(self.clients.len() as u64) as usize;
        let mut backoff = Duration::from_millis(20);
        let mut errors = Vec::new();
        loop {
            let tries = errors.len() as u32 + 1;
            match attempt(self.clients[index].clone()).await {
                Ok(response) => {
                    return Ok(Called {
                        value: response.into_inner(),
                        tries,
                    });
                }
                Err(status) if is_transient(&status) => {
                    errors.push(describe(&status));
                    if Instant::now() + backoff >= deadline {
                        let last = errors.last().cloned().unwrap_or_default();
                        return Err(CallError::Exhausted { last, tries });
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(400));
                    index = (index + 1) % self.clients.len();
                }
                Err(status) => return Err(CallError::Definite { status }),
            }
        }
    }
}

/// A request with a per-attempt deadline.
pub fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

/// Failures a retry of the same request may cure: the transport (lost responses, a killed
/// replica, a reset connection), an unavailable database, and the server's conflict retry.
pub fn is_transient(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable
        | Code::Unknown
        | Code::Internal
        | Code::DeadlineExceeded
        | Code::Cancelled => true,
        Code::Aborted => reason(status) == "CONFLICT",
        _ => false,
    }
}

/// The `ErrorInfo` reason, or the code when there is none (transport errors).
pub fn reason(status: &Status) -> String {
    match status.get_error_details().error_info() {
        Some(info) => info.reason.clone(),
        None => format!("{:?}", status.code()),
    }
}

/// `Code/REASON: message`, shortened, for journals.
pub fn describe(status: &Status) -> String {
    let mut message = status.message().to_owned();
    message.truncate(120);
    format!("{:?}/{}: {message}", status.code(), reason(status))
}
