//! Settings: defaults in code, overridden by `OUTBOX_*` environment variables (`__`
//! separates sections). Loading is a pure function of key/value pairs so tests pass a map,
//! and it reports every bad or unknown variable at once, not just the first.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::outbox::maintenance::MaintenanceConfig;
use crate::outbox::store::BackoffParams;

/// Everything outboxd can be configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// gRPC listen address.
    pub listen_addr: SocketAddr,
    /// External PostgreSQL, as the service role (owns nothing); `None` starts the embedded
    /// cluster.
    pub database_url: Option<String>,
    /// External PostgreSQL, as a member of `outboxd_fleet` (the role granted every tenant):
    /// the pool for work across tenants (docs/tenancy.md). Required with `database_url`.
    pub fleet_url: Option<String>,
    /// The schema owner's URL, for migrations and key management; `None`: do not migrate
    /// at start (external) or use the embedded superuser.
    pub migration_url: Option<String>,
    /// Most pooled connections.
    pub max_connections: u32,
    /// Embedded cluster data directory.
    pub embedded_data_dir: PathBuf,
    /// Embedded cluster port (`None`: a free one).
    pub embedded_port: Option<u16>,
    /// Request limits.
    pub limits: Limits,
    /// Background sweeps and retry backoff.
    pub maintenance: MaintenanceConfig,
    /// Fallback sweep resolving STAGED intents (commits in the outbox's own database are
    /// promoted at once through NOTIFY; this bounds aborts and other databases).
    pub txn_resolve_interval: Duration,
    /// `text` or `json` logs.
    pub log_format: LogFormat,
    /// `tracing` filter directives (like RUST_LOG).
    pub log_filter: String,
    /// How long an API key lookup is cached (revocation takes effect within it).
    pub auth_cache_ttl: Duration,
    /// TLS for the gRPC listener.
    pub tls: Option<TlsSettings>,
    /// Allow a plaintext listener on a non-loopback address (e.g. behind a mesh with mTLS).
    pub allow_plaintext: bool,
    /// Prometheus `/metrics` listen address; `None` disables the endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// How often queue gauges are refreshed from the database.
    pub metrics_refresh_interval: Duration,
    /// Serve gRPC server reflection (v1 and v1alpha).
    pub reflection: bool,
    /// Let a direct Enqueue lease its intents at once to a Claim of this server waiting
    /// for them (`outbox::claim::handoff`), instead of waking it to look.
    pub claim_hand_off: bool,
    /// Ack stores the intents it delivers a batch to a row (`outbox.delivered_batch`); off,
    /// a row each (`outbox.intent_history`), as servers before migration 17 do: for a
    /// rolling upgrade from them, whose reads of the batches are slow.
    pub history_by_batch: bool,
    /// On shutdown, how long to keep serving while health says NOT_SERVING, so load
    /// balancers stop routing here before the listener closes.
    pub shutdown_drain_delay: Duration,
    /// On shutdown, how long in-flight calls may take to finish before they are cut.
    pub shutdown_grace: Duration,
    /// OTLP/gRPC endpoint spans are exported to; `None` exports nothing.
    pub otel_endpoint: Option<String>,
}

/// PEM files for the gRPC listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// Server certificate chain.
    pub cert_file: PathBuf,
    /// Server private key.
    pub key_file: PathBuf,
    /// CA that client certificates must chain to; set, it requires mTLS.
    pub client_ca_file: Option<PathBuf>,
}

/// Limits enforced on every request (see `crate::validate`). Sizes of what a caller sends
/// in bulk (payload bytes, batch items) answer RESOURCE_EXHAUSTED; the shape of one field
/// (string lengths, header count, durations) answers INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most items in one batch (intents, leases, ids, page size).
    pub max_batch: usize,
    /// Largest payload in bytes.
    pub max_payload_bytes: usize,
    /// Largest gRPC request message in bytes, checked by the transport before decoding
    /// (at least `max_payload_bytes`).
    pub max_message_bytes: usize,
    /// Largest Claim (or ListIntents) reply in bytes: a Claim whose leases would pass it
    /// answers with fewer (always at least one) and gives the rest back; a page ends early.
    /// gRPC clients refuse larger messages (4 MiB by default in every official
    /// implementation), and a reply refused after its leases committed would cost their
    /// intents an attempt each, unseen.
    pub max_reply_bytes: usize,
    /// Most headers on one intent.
    pub max_headers: usize,
    /// Longest header name, in bytes (names are ASCII).
    pub max_header_key_length: usize,
    /// Longest header value, in characters.
    pub max_header_value_length: usize,
    /// Longest kind, worker id, idempotency key, request id, content type or actor, in
    /// characters. At most [`Limits::NAME_LENGTH_CEILING`]: several are indexed together.
    pub max_name_length: usize,
    /// Longest region, in bytes (regions are ASCII).
    pub max_region_length: usize,
    /// Longest free text (a failure's error, a resolution's reason), in characters.
    pub max_text_length: usize,
    /// Most kinds in one Claim's filter.
    pub max_kinds: usize,
    /// Longest delay (or furthest `available_at`, or `retry_after`) an intent may be given.
    pub max_delay: Duration,
    /// Lease length when a Claim or ExtendLease does not say.
    pub default_lease: Duration,
    /// Longest lease a worker may ask for.
    pub max_lease: Duration,
    /// Longest Claim long-poll.
    pub max_wait: Duration,
    /// `max_attempts` when an intent does not say.
    pub default_max_attempts: i32,
}

impl Limits {
    /// Highest allowed `max_name_length`: worker id and request id share one btree index
    /// entry (at most 2704 bytes), and a character may take 4 bytes.
    pub const NAME_LENGTH_CEILING: usize = 256;
    /// Highest allowed lease or delay limit: far below PostgreSQL's timestamp range, so
    /// `now() + interval` can never overflow.
    pub const DURATION_CEILING: Duration = Duration::from_secs(10 * 366 * 86_400);
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_batch: 1000,
            max_payload_bytes: 1024 * 1024,
            max_message_bytes: 8 * 1024 * 1024,
            max_reply_bytes: 4 * 1024 * 1024,
            max_headers: 64,
            max_header_key_length: 128,
            max_header_value_length: 4096,
            max_name_length: 200,
            max_region_length: 64,
            max_text_length: 4096,
            max_kinds: 100,
            max_delay: Duration::from_secs(366 * 86_400),
            default_lease: Duration::from_secs(30),
            max_lease: Duration::from_secs(12 * 3600),
            max_wait: Duration::from_secs(60),
            default_max_attempts: 5,
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
            database_url: None,
            fleet_url: None,
            migration_url: None,
            max_connections: 16,
            embedded_data_dir: PathBuf::from(".outboxd/pgdata"),
            embedded_port: None,
            limits: Limits::default(),
            maintenance: MaintenanceConfig::default(),
            txn_resolve_interval: Duration::from_millis(100),
            log_format: LogFormat::Text,
            log_filter: "info".to_owned(),
            auth_cache_ttl: Duration::from_secs(5),
            tls: None,
            allow_plaintext: false,
            metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 9090))),
            metrics_refresh_interval: Duration::from_secs(5),
            reflection: true,
            claim_hand_off: true,
            history_by_batch: true,
            shutdown_drain_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(30),
            otel_endpoint: None,
        }
    }
}

/// Every problem found in the configuration.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  {}", .0.join("\n  "))]
pub struct ConfigError(pub Vec<String>);

/// The documented variables, with what they hold (also printed by `outboxd --help`).
pub const VARIABLES: &[(&str, &str)] = &[
    (
        "OUTBOX_LISTEN_ADDR",
        "gRPC listen address [127.0.0.1:50051]",
    ),
    (
        "OUTBOX_DATABASE__URL",
        "PostgreSQL URL; unset starts the embedded cluster",
    ),
    (
        "OUTBOX_DATABASE__FLEET_URL",
        "PostgreSQL URL of a member of outboxd_fleet, for work across tenants; required with \
         OUTBOX_DATABASE__URL",
    ),
    (
        "OUTBOX_DATABASE__MIGRATION_URL",
        "the schema owner's URL: migrations and grants at start, `migrate`, `keys` [unset]",
    ),
    (
        "OUTBOX_DATABASE__MAX_CONNECTIONS",
        "size of each connection pool, the request-serving and the fleet one (the LISTEN \
         connection is one more) [16]",
    ),
    (
        "OUTBOX_EMBEDDED__DATA_DIR",
        "embedded cluster data directory [.outboxd/pgdata]",
    ),
    (
        "OUTBOX_EMBEDDED__PORT",
        "embedded cluster port on 127.0.0.1 [a free port]",
    ),
    ("OUTBOX_LIMITS__MAX_BATCH", "most items per request [1000]"),
    (
        "OUTBOX_LIMITS__MAX_PAYLOAD_BYTES",
        "largest payload [1048576]",
    ),
    (
        "OUTBOX_LIMITS__MAX_MESSAGE_BYTES",
        "largest gRPC request message, at least the payload limit [8388608]",
    ),
    ("OUTBOX_LIMITS__MAX_HEADERS", "most headers per intent [64]"),
    (
        "OUTBOX_LIMITS__MAX_HEADER_KEY_LENGTH",
        "longest header name [128]",
    ),
    (
        "OUTBOX_LIMITS__MAX_HEADER_VALUE_LENGTH",
        "longest header value, in characters [4096]",
    ),
    (
        "OUTBOX_LIMITS__MAX_NAME_LENGTH",
        "longest kind, worker id, idempotency key, request id, content type or actor, \
         at most 256 [200]",
    ),
    ("OUTBOX_LIMITS__MAX_REGION_LENGTH", "longest region [64]"),
    (
        "OUTBOX_LIMITS__MAX_TEXT_LENGTH",
        "longest failure error or resolution reason, in characters [4096]",
    ),
    (
        "OUTBOX_LIMITS__MAX_KINDS",
        "most kinds in one Claim filter [100]",
    ),
    (
        "OUTBOX_LIMITS__MAX_DELAY",
        "longest delay, available_at or retry_after ahead of now [366d]",
    ),
    (
        "OUTBOX_LEASE__DEFAULT",
        "lease length when a worker does not ask [30s]",
    ),
    (
        "OUTBOX_LEASE__MAX",
        "longest lease a worker may ask for [12h]",
    ),
    ("OUTBOX_CLAIM__MAX_WAIT", "longest Claim long-poll [60s]"),
    (
        "OUTBOX_CLAIM__HAND_OFF",
        "an Enqueue leases its intents at once to a Claim of this server waiting for them [true]",
    ),
    (
        "OUTBOX_RETRY__MAX_ATTEMPTS",
        "attempts when an intent does not say [5]",
    ),
    (
        "OUTBOX_RETRY__BASE",
        "first retry delay, doubling per attempt [1s]",
    ),
    ("OUTBOX_RETRY__CAP", "longest retry delay [5m]"),
    (
        "OUTBOX_MAINTENANCE__RESCUE_INTERVAL",
        "how often expired leases are rescued [1s]",
    ),
    (
        "OUTBOX_MAINTENANCE__PURGE_INTERVAL",
        "how often finished intents are purged [1m]",
    ),
    (
        "OUTBOX_RETENTION__FINISHED",
        "how long delivered intents without an idempotency key are kept; other finished ones \
         the longer of this and OUTBOX_RETENTION__IDEMPOTENCY_KEYS [24h]",
    ),
    (
        "OUTBOX_RETENTION__HISTORY_BY_BATCH",
        "Ack stores delivered intents a batch to a row; false: a row each, as releases \
         before it (for a rolling upgrade from them) [true]",
    ),
    (
        "OUTBOX_RETENTION__IDEMPOTENCY_KEYS",
        "how long, at least, a finished intent with an idempotency key is kept, its key \
         remembered, however short OUTBOX_RETENTION__FINISHED is [24h]",
    ),
    (
        "OUTBOX_TXN__RESOLVE_INTERVAL",
        "fallback sweep resolving staged intents of finished producer transactions [100ms]",
    ),
    (
        "OUTBOX_AUTH__CACHE_TTL",
        "how long API key lookups are cached; revocation delay [5s]",
    ),
    (
        "OUTBOX_TLS__CERT_FILE",
        "PEM certificate chain for TLS [unset: plaintext]",
    ),
    ("OUTBOX_TLS__KEY_FILE", "PEM private key for TLS"),
    (
        "OUTBOX_TLS__CLIENT_CA_FILE",
        "PEM CA for client certificates; set, mTLS is required",
    ),
    (
        "OUTBOX_ALLOW_PLAINTEXT",
        "allow plaintext gRPC on a non-loopback address [false]",
    ),
    (
        "OUTBOX_METRICS__LISTEN_ADDR",
        "Prometheus /metrics address; empty disables it [127.0.0.1:9090]",
    ),
    (
        "OUTBOX_METRICS__REFRESH_INTERVAL",
        "how often queue gauges are read from the database [5s]",
    ),
    (
        "OUTBOX_GRPC__REFLECTION",
        "serve gRPC server reflection [true]",
    ),
    (
        "OUTBOX_SHUTDOWN__DRAIN_DELAY",
        "after SIGTERM, serve this long while health says NOT_SERVING [0s]",
    ),
    (
        "OUTBOX_SHUTDOWN__GRACE",
        "then wait this long for in-flight calls before cutting them [30s]",
    ),
    (
        "OUTBOX_OTEL__ENDPOINT",
        "OTLP/gRPC endpoint for traces, e.g. http://collector:4317 [unset: none]",
    ),
    ("OUTBOX_LOG__FORMAT", "text or json [text]"),
    (
        "OUTBOX_LOG__FILTER",
        "tracing filter, e.g. info,outboxd=debug [info]",
    ),
    (
        "OUTBOX_SERVER",
        "operator commands: server to talk to [http://127.0.0.1:50051]",
    ),
];

impl Settings {
    /// Reads the process environment.
    ///
    /// # Errors
    /// Every malformed or unknown `OUTBOX_*` variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// Builds settings from `OUTBOX_*` pairs; other keys are ignored.
    ///
    /// # Errors
    /// Every malformed or unknown `OUTBOX_*` variable, and inconsistent combinations.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut s = Settings::default();
        let mut errors = Vec::new();
        let (mut cert, mut tls_key, mut client_ca) = (None, None, None);
        for (key, value) in vars {
            if !key.starts_with("OUTBOX_") {
                continue;
            }
            let value = value.trim();
            let applied = match key.as_str() {
                "OUTBOX_LISTEN_ADDR" => parse(value).map(|v| s.listen_addr = v),
                "OUTBOX_DATABASE__URL" => {
                    s.database_url = (!value.is_empty()).then(|| value.to_owned());
                    Ok(())
                }
                "OUTBOX_DATABASE__FLEET_URL" => {
                    s.fleet_url = (!value.is_empty()).then(|| value.to_owned());
                    Ok(())
                }
                "OUTBOX_DATABASE__MIGRATION_URL" => {
                    s.migration_url = (!value.is_empty()).then(|| value.to_owned());
                    Ok(())
                }
                "OUTBOX_AUTH__CACHE_TTL" => duration(value).map(|v| s.auth_cache_ttl = v),
                "OUTBOX_TLS__CERT_FILE" => {
                    cert = (!value.is_empty()).then(|| PathBuf::from(value));
                    Ok(())
                }
                "OUTBOX_TLS__KEY_FILE" => {
                    tls_key = (!value.is_empty()).then(|| PathBuf::from(value));
                    Ok(())
                }
                "OUTBOX_TLS__CLIENT_CA_FILE" => {
                    client_ca = (!value.is_empty()).then(|| PathBuf::from(value));
                    Ok(())
                }
                "OUTBOX_ALLOW_PLAINTEXT" => parse(value).map(|v| s.allow_plaintext = v),
                "OUTBOX_METRICS__LISTEN_ADDR" if value.is_empty() => {
                    s.metrics_addr = None;
                    Ok(())
                }
                "OUTBOX_METRICS__LISTEN_ADDR" => parse(value).map(|v| s.metrics_addr = Some(v)),
                "OUTBOX_METRICS__REFRESH_INTERVAL" => {
                    duration(value).map(|v| s.metrics_refresh_interval = v)
                }
                "OUTBOX_OTEL__ENDPOINT" => {
                    s.otel_endpoint = (!value.is_empty()).then(|| value.to_owned());
                    Ok(())
                }
                "OUTBOX_GRPC__REFLECTION" => parse(value).map(|v| s.reflection = v),
                "OUTBOX_SHUTDOWN__DRAIN_DELAY" => {
                    duration(value).map(|v| s.shutdown_drain_delay = v)
                }
                "OUTBOX_SHUTDOWN__GRACE" => duration(value).map(|v| s.shutdown_grace = v),
                "OUTBOX_DATABASE__MAX_CONNECTIONS" => parse(value).map(|v| s.max_connections = v),
                "OUTBOX_EMBEDDED__DATA_DIR" => {
                    s.embedded_data_dir = PathBuf::from(value);
                    Ok(())
                }
                "OUTBOX_EMBEDDED__PORT" => parse(value).map(|v| s.embedded_port = Some(v)),
                "OUTBOX_LIMITS__MAX_BATCH" => parse(value).map(|v| s.limits.max_batch = v),
                "OUTBOX_LIMITS__MAX_PAYLOAD_BYTES" => {
                    parse(value).map(|v| s.limits.max_payload_bytes = v)
                }
                "OUTBOX_LIMITS__MAX_MESSAGE_BYTES" => {
                    parse(value).map(|v| s.limits.max_message_bytes = v)
                }
                "OUTBOX_LIMITS__MAX_REPLY_BYTES" => {
                    parse(value).map(|v| s.limits.max_reply_bytes = v)
                }
                "OUTBOX_LIMITS__MAX_HEADERS" => parse(value).map(|v| s.limits.max_headers = v),
                "OUTBOX_LIMITS__MAX_HEADER_KEY_LENGTH" => {
                    parse(value).map(|v| s.limits.max_header_key_length = v)
                }
                "OUTBOX_LIMITS__MAX_HEADER_VALUE_LENGTH" => {
                    parse(value).map(|v| s.limits.max_header_value_length = v)
                }
                "OUTBOX_LIMITS__MAX_NAME_LENGTH" => {
                    parse(value).map(|v| s.limits.max_name_length = v)
                }
                "OUTBOX_LIMITS__MAX_REGION_LENGTH" => {
                    parse(value).map(|v| s.limits.max_region_length = v)
                }
                "OUTBOX_LIMITS__MAX_TEXT_LENGTH" => {
                    parse(value).map(|v| s.limits.max_text_length = v)
                }
                "OUTBOX_LIMITS__MAX_KINDS" => parse(value).map(|v| s.limits.max_kinds = v),
                "OUTBOX_LIMITS__MAX_DELAY" => duration(value).map(|v| s.limits.max_delay = v),
                "OUTBOX_LEASE__DEFAULT" => duration(value).map(|v| s.limits.default_lease = v),
                "OUTBOX_LEASE__MAX" => duration(value).map(|v| s.limits.max_lease = v),
                "OUTBOX_CLAIM__MAX_WAIT" => duration(value).map(|v| s.limits.max_wait = v),
                "OUTBOX_CLAIM__HAND_OFF" => parse(value).map(|v| s.claim_hand_off = v),
                "OUTBOX_RETENTION__HISTORY_BY_BATCH" => {
                    parse(value).map(|v| s.history_by_batch = v)
                }
                "OUTBOX_RETRY__MAX_ATTEMPTS" => {
                    parse(value).map(|v| s.limits.default_max_attempts = v)
                }
                "OUTBOX_RETRY__BASE" => duration(value).map(|v| s.maintenance.backoff.base = v),
                "OUTBOX_RETRY__CAP" => duration(value).map(|v| s.maintenance.backoff.cap = v),
                "OUTBOX_MAINTENANCE__RESCUE_INTERVAL" => {
                    duration(value).map(|v| s.maintenance.rescue_interval = v)
                }
                "OUTBOX_MAINTENANCE__PURGE_INTERVAL" => {
                    duration(value).map(|v| s.maintenance.purge_interval = v)
                }
                "OUTBOX_RETENTION__FINISHED" => {
                    duration(value).map(|v| s.maintenance.retention = v)
                }
                "OUTBOX_RETENTION__IDEMPOTENCY_KEYS" => {
                    duration(value).map(|v| s.maintenance.key_retention = v)
                }
                "OUTBOX_TXN__RESOLVE_INTERVAL" => {
                    duration(value).map(|v| s.txn_resolve_interval = v)
                }
                "OUTBOX_LOG__FORMAT" => match value {
                    "text" => Ok(LogFormat::Text),
                    "json" => Ok(LogFormat::Json),
                    _ => Err("expected text or json".to_owned()),
                }
                .map(|v| s.log_format = v),
                // Read by the operator commands (clap), not by the server.
                "OUTBOX_SERVER" | "OUTBOX_API_KEY" | "OUTBOX_TENANT" | "OUTBOX_CA_FILE" => Ok(()),
                "OUTBOX_LOG__FILTER" => {
                    s.log_filter = value.to_owned();
                    Ok(())
                }
                _ => Err("unknown variable (see `outboxd --help` for the list)".to_owned()),
            };
            if let Err(why) = applied {
                errors.push(format!("{key}={value:?}: {why}"));
            }
        }
        match (cert, tls_key, client_ca) {
            (Some(cert_file), Some(key_file), client_ca_file) => {
                s.tls = Some(TlsSettings {
                    cert_file,
                    key_file,
                    client_ca_file,
                });
            }
            (None, None, None) => {}
            _ => errors.push(
                "OUTBOX_TLS__CERT_FILE and OUTBOX_TLS__KEY_FILE go together, and \
                 OUTBOX_TLS__CLIENT_CA_FILE needs both"
                    .to_owned(),
            ),
        }
        errors.extend(s.inconsistencies());
        if errors.is_empty() {
            Ok(s)
        } else {
            Err(ConfigError(errors))
        }
    }

    fn inconsistencies(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let l = &self.limits;
        let mut check = |ok: bool, msg: &str| {
            if !ok {
                errors.push(msg.to_owned());
            }
        };
        check(
            l.max_batch >= 1,
            "OUTBOX_LIMITS__MAX_BATCH must be at least 1",
        );
        check(
            l.max_payload_bytes >= 1,
            "OUTBOX_LIMITS__MAX_PAYLOAD_BYTES must be at least 1",
        );
        check(
            l.max_message_bytes >= l.max_payload_bytes,
            "OUTBOX_LIMITS__MAX_MESSAGE_BYTES must be at least OUTBOX_LIMITS__MAX_PAYLOAD_BYTES",
        );
        check(
            l.max_reply_bytes >= l.max_payload_bytes,
            "OUTBOX_LIMITS__MAX_REPLY_BYTES must be at least OUTBOX_LIMITS__MAX_PAYLOAD_BYTES",
        );
        check(
            l.max_header_key_length >= 1,
            "OUTBOX_LIMITS__MAX_HEADER_KEY_LENGTH must be at least 1",
        );
        check(
            l.max_header_value_length >= 1,
            "OUTBOX_LIMITS__MAX_HEADER_VALUE_LENGTH must be at least 1",
        );
        check(
            (1..=Limits::NAME_LENGTH_CEILING).contains(&l.max_name_length),
            "OUTBOX_LIMITS__MAX_NAME_LENGTH must be between 1 and 256",
        );
        check(
            (1..=Limits::NAME_LENGTH_CEILING).contains(&l.max_region_length),
            "OUTBOX_LIMITS__MAX_REGION_LENGTH must be between 1 and 256",
        );
        check(
            l.max_text_length >= 1,
            "OUTBOX_LIMITS__MAX_TEXT_LENGTH must be at least 1",
        );
        check(
            l.max_kinds >= 1,
            "OUTBOX_LIMITS__MAX_KINDS must be at least 1",
        );
        check(
            l.max_delay <= Limits::DURATION_CEILING,
            "OUTBOX_LIMITS__MAX_DELAY must not exceed 3660d",
        );
        check(
            l.max_lease <= Limits::DURATION_CEILING,
            "OUTBOX_LEASE__MAX must not exceed 3660d",
        );
        check(
            !l.default_lease.is_zero(),
            "OUTBOX_LEASE__DEFAULT must be positive",
        );
        check(
            l.default_lease <= l.max_lease,
            "OUTBOX_LEASE__DEFAULT must not exceed OUTBOX_LEASE__MAX",
        );
        check(
            l.default_max_attempts >= 1,
            "OUTBOX_RETRY__MAX_ATTEMPTS must be at least 1",
        );
        let m = &self.maintenance;
        check(
            !m.rescue_interval.is_zero(),
            "OUTBOX_MAINTENANCE__RESCUE_INTERVAL must be positive",
        );
        check(
            !m.purge_interval.is_zero(),
            "OUTBOX_MAINTENANCE__PURGE_INTERVAL must be positive",
        );
        check(
            m.backoff.base <= m.backoff.cap,
            "OUTBOX_RETRY__BASE must not exceed OUTBOX_RETRY__CAP",
        );
        // A cap past PostgreSQL's timestamps would fail every rescue batch and every Fail
        // that retries, for good.
        check(
            m.backoff.cap <= Limits::DURATION_CEILING,
            "OUTBOX_RETRY__CAP must not exceed 3660d",
        );
        // Past PostgreSQL's timestamps, every purge would fail, for good.
        check(
            m.retention <= MaintenanceConfig::RETENTION_CEILING,
            "OUTBOX_RETENTION__FINISHED must not exceed 36600d",
        );
        check(
            m.key_retention <= MaintenanceConfig::RETENTION_CEILING,
            "OUTBOX_RETENTION__IDEMPOTENCY_KEYS must not exceed 36600d",
        );
        check(
            self.max_connections >= 2,
            "OUTBOX_DATABASE__MAX_CONNECTIONS must be at least 2",
        );
        check(
            !self.txn_resolve_interval.is_zero(),
            "OUTBOX_TXN__RESOLVE_INTERVAL must be positive",
        );
        check(
            !self.metrics_refresh_interval.is_zero(),
            "OUTBOX_METRICS__REFRESH_INTERVAL must be positive",
        );
        check(
            self.tls.is_some() || self.allow_plaintext || self.listen_addr.ip().is_loopback(),
            "OUTBOX_LISTEN_ADDR is not a loopback address: configure TLS (OUTBOX_TLS__CERT_FILE, \
             OUTBOX_TLS__KEY_FILE) or set OUTBOX_ALLOW_PLAINTEXT=true to serve plaintext",
        );
        errors
    }

    /// Backoff between attempts.
    pub fn backoff(&self) -> BackoffParams {
        self.maintenance.backoff
    }
}

fn parse<T: FromStr>(value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.parse().map_err(|e: T::Err| e.to_string())
}

/// Parses `250ms`, `30s`, `5m`, `12h`, `7d`; a bare number is seconds.
pub fn duration(value: &str) -> Result<Duration, String> {
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| "expected a duration such as 250ms, 30s, 5m, 12h or 7d".to_owned())?;
    let ms = match unit {
        "ms" => Some(n),
        "" | "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(format!("unknown unit {unit:?}; use ms, s, m, h or d")),
    };
    ms.map(Duration::from_millis)
        .ok_or_else(|| "duration too large".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_variable_is_documented_in_the_configuration_table() {
        let table = include_str!("../docs/configuration.md");
        for (name, _) in VARIABLES {
            assert!(
                table.contains(&format!("| `{name}` |")),
                "{name} is missing from docs/configuration.md"
            );
        }
    }

    #[test]
    fn defaults_hold_without_variables() {
        assert_eq!(
            Settings::from_vars(vars(&[("HOME", "/root")])).unwrap(),
            Settings::default()
        );
    }

    #[test]
    fn variables_override_defaults() {
        let s = Settings::from_vars(vars(&[
            ("OUTBOX_LEASE__DEFAULT", "45s"),
            ("OUTBOX_RETENTION__FINISHED", "7d"),
            ("OUTBOX_RETENTION__IDEMPOTENCY_KEYS", "30d"),
            ("OUTBOX_DATABASE__URL", "postgres://x@db/outbox"),
        ]))
        .unwrap();
        assert_eq!(s.limits.default_lease, Duration::from_secs(45));
        assert_eq!(s.maintenance.retention, Duration::from_secs(7 * 86_400));
        assert_eq!(
            s.maintenance.key_retention,
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(s.database_url.as_deref(), Some("postgres://x@db/outbox"));
    }

    #[test]
    fn every_bad_variable_is_reported_at_once() {
        let err = Settings::from_vars(vars(&[
            ("OUTBOX_LEASE__DEFAULT", "soon"),
            ("OUTBOX_LISTEN_ADDR", "nowhere"),
            ("OUTBOX_TYPO", "1"),
        ]))
        .unwrap_err();
        assert_eq!(err.0.len(), 3, "{err}");
    }

    #[test]
    fn plaintext_off_loopback_needs_tls_or_an_explicit_opt_in() {
        let exposed = [("OUTBOX_LISTEN_ADDR", "0.0.0.0:50051")];
        assert!(Settings::from_vars(vars(&exposed)).is_err());
        let opted_in = [exposed[0], ("OUTBOX_ALLOW_PLAINTEXT", "true")];
        assert!(
            Settings::from_vars(vars(&opted_in))
                .unwrap()
                .allow_plaintext
        );
        let tls = [
            exposed[0],
            ("OUTBOX_TLS__CERT_FILE", "/tls/tls.crt"),
            ("OUTBOX_TLS__KEY_FILE", "/tls/tls.key"),
        ];
        assert!(Settings::from_vars(vars(&tls)).unwrap().tls.is_some());
        let half = [("OUTBOX_TLS__CERT_FILE", "/tls/tls.crt")];
        assert!(Settings::from_vars(vars(&half)).is_err());
    }
}
