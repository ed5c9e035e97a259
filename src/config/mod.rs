//! Settings: defaults in code, overridden by `OUTBOX_*` environment variables, which name
//! the fields of these structs (`__` separates sections: `OUTBOX_DATABASE__URL` is
//! `database.url`). `load` reads them with figment; docs/configuration.md documents each.

mod load;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use crate::outbox::maintenance::MaintenanceConfig;
use crate::outbox::store::BackoffParams;

pub use load::{ConfigError, documented};

/// Everything outboxd can be configured with.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// gRPC listen address.
    #[default(SocketAddr::from(([127, 0, 0, 1], 50051)))]
    pub listen_addr: SocketAddr,
    /// Allow a plaintext listener on a non-loopback address (e.g. behind a mesh with mTLS).
    pub allow_plaintext: bool,
    /// PostgreSQL.
    pub database: Database,
    /// The cluster started when `database.url` is unset.
    pub embedded: Embedded,
    /// Request limits; also what `OUTBOX_LEASE__*`, `OUTBOX_CLAIM__MAX_WAIT` and
    /// `OUTBOX_RETRY__MAX_ATTEMPTS` set.
    pub limits: Limits,
    /// Claims.
    pub claim: Claim,
    /// Background sweeps and retry backoff: `OUTBOX_MAINTENANCE__*`, `OUTBOX_RETRY__BASE`
    /// and `__CAP`, `OUTBOX_RETENTION__FINISHED` and `__IDEMPOTENCY_KEYS`.
    pub maintenance: MaintenanceConfig,
    /// Producer transactions.
    pub txn: Txn,
    /// API keys.
    pub auth: Auth,
    /// TLS for the gRPC listener.
    #[serde(deserialize_with = "load::tls")]
    pub tls: Option<TlsSettings>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The operator console.
    pub console: Console,
    /// gRPC services.
    pub grpc: Grpc,
    /// Graceful shutdown.
    pub shutdown: Shutdown,
    /// OpenTelemetry traces.
    pub otel: Otel,
    /// Logs.
    pub log: Log,
}

/// `OUTBOX_DATABASE__*`: the PostgreSQL roles (docs/tenancy.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Database {
    /// External PostgreSQL, as the service role (owns nothing); `None` starts the embedded
    /// cluster.
    #[serde(deserialize_with = "load::empty_is_none")]
    pub url: Option<String>,
    /// External PostgreSQL, as a member of `outboxd_fleet` (the role granted every tenant):
    /// the pool for work across tenants. Required with `url`.
    #[serde(deserialize_with = "load::empty_is_none")]
    pub fleet_url: Option<String>,
    /// The schema owner's URL, for migrations and key management; `None`: do not migrate
    /// at start (external) or use the embedded superuser.
    #[serde(deserialize_with = "load::empty_is_none")]
    pub migration_url: Option<String>,
    /// Most connections of each pool.
    #[default(16)]
    pub max_connections: u32,
}

/// `OUTBOX_EMBEDDED__*`: the embedded cluster.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Embedded {
    /// Data directory.
    #[default(PathBuf::from(".outboxd/pgdata"))]
    pub data_dir: PathBuf,
    /// Port on 127.0.0.1 (`None`: a free one).
    pub port: Option<u16>,
}

/// Limits enforced on every request (see `crate::validate`). Sizes of what a caller sends
/// in bulk (payload bytes, batch items) answer RESOURCE_EXHAUSTED; the shape of one field
/// (string lengths, header count, durations) answers INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Most items in one batch (intents, leases, ids, page size).
    #[default(1000)]
    pub max_batch: usize,
    /// Largest payload in bytes.
    #[default(1024 * 1024)]
    pub max_payload_bytes: usize,
    /// Largest gRPC request message in bytes, checked by the transport before decoding
    /// (at least `max_payload_bytes`).
    #[default(8 * 1024 * 1024)]
    pub max_message_bytes: usize,
    /// Largest Claim (or ListIntents) reply in bytes: a Claim whose leases would pass it
    /// answers with fewer (always at least one) and gives the rest back; a page ends early.
    /// gRPC clients refuse larger messages (4 MiB by default in every official
    /// implementation), and a reply refused after its leases committed would cost their
    /// intents an attempt each, unseen.
    #[default(4 * 1024 * 1024)]
    pub max_reply_bytes: usize,
    /// Most headers on one intent.
    #[default(64)]
    pub max_headers: usize,
    /// Longest header name, in bytes (names are ASCII).
    #[default(128)]
    pub max_header_key_length: usize,
    /// Longest header value, in characters.
    #[default(4096)]
    pub max_header_value_length: usize,
    /// Longest kind, worker id, idempotency key, request id, content type or actor, in
    /// characters. At most [`Limits::NAME_LENGTH_CEILING`]: several are indexed together.
    #[default(200)]
    pub max_name_length: usize,
    /// Longest region, in bytes (regions are ASCII).
    #[default(64)]
    pub max_region_length: usize,
    /// Longest free text (a failure's error, a resolution's reason), in characters.
    #[default(4096)]
    pub max_text_length: usize,
    /// Most kinds in one Claim's filter.
    #[default(100)]
    pub max_kinds: usize,
    /// Longest delay (or furthest `available_at`, or `retry_after`) an intent may be given.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(366 * 86_400))]
    pub max_delay: Duration,
    /// Lease length when a Claim or ExtendLease does not say (`OUTBOX_LEASE__DEFAULT`).
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(30))]
    pub default_lease: Duration,
    /// Longest lease a worker may ask for (`OUTBOX_LEASE__MAX`).
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(12 * 3600))]
    pub max_lease: Duration,
    /// Longest Claim long-poll (`OUTBOX_CLAIM__MAX_WAIT`).
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(60))]
    pub max_wait: Duration,
    /// `max_attempts` when an intent does not say (`OUTBOX_RETRY__MAX_ATTEMPTS`).
    #[default(5)]
    pub default_max_attempts: i32,
    /// Longest statement of an operator call (Reconcile, GetIntent, ListIntents,
    /// GetQueueStats, the policy calls): their filters may match nothing in a large table,
    /// and a call keeps running after its caller gave up.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(30))]
    pub operator_timeout: Duration,
    /// Most gRPC connections open at once: past it a new one is closed as it is accepted,
    /// before the process runs out of file descriptors.
    #[default(10_000)]
    pub max_connections: usize,
    /// Most connections each HTTP listener (the console, the admin endpoint) keeps open at
    /// once: browsers and scrapers need a few.
    #[default(512)]
    pub max_http_connections: usize,
}

impl Limits {
    /// Highest allowed `max_name_length`: worker id and request id share one btree index
    /// entry (at most 2704 bytes), and a character may take 4 bytes.
    pub const NAME_LENGTH_CEILING: usize = 256;
    /// Highest allowed lease or delay limit: far below PostgreSQL's timestamp range, so
    /// `now() + interval` can never overflow.
    pub const DURATION_CEILING: Duration = Duration::from_secs(10 * 366 * 86_400);

    /// PostgreSQL's largest `statement_timeout` is 2^31 - 1 ms (24.8 days); a larger one
    /// would fail the BEGIN of every operator call.
    pub const STATEMENT_TIMEOUT_CEILING: Duration = Duration::from_secs(24 * 86_400);
}

/// `OUTBOX_CLAIM__HAND_OFF` (`OUTBOX_CLAIM__MAX_WAIT` is a limit).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Claim {
    /// Let a direct Enqueue lease its intents at once to a Claim of this server waiting
    /// for them (`outbox::claim::handoff`), instead of waking it to look.
    #[default(true)]
    pub hand_off: bool,
}

/// `OUTBOX_TXN__*`: producer transactions.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Txn {
    /// Fallback sweep resolving STAGED intents (commits in the outbox's own database are
    /// promoted at once through NOTIFY; this bounds aborts and other databases).
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_millis(100))]
    pub resolve_interval: Duration,
}

/// `OUTBOX_AUTH__*`: API keys.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Auth {
    /// How long an API key lookup is cached (revocation takes effect within it).
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(5))]
    pub cache_ttl: Duration,
}

/// PEM files for the gRPC listener (`OUTBOX_TLS__*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TlsSettings {
    /// Server certificate chain.
    pub cert_file: PathBuf,
    /// Server private key.
    pub key_file: PathBuf,
    /// CA that client certificates must chain to; set, it requires mTLS.
    pub client_ca_file: Option<PathBuf>,
}

/// `OUTBOX_METRICS__*`: the Prometheus endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Metrics {
    /// `/metrics` listen address; `None` (an empty variable) disables the endpoint.
    #[serde(deserialize_with = "load::empty_is_none")]
    #[default(Some(SocketAddr::from(([127, 0, 0, 1], DEFAULT_METRICS_PORT))))]
    pub listen_addr: Option<SocketAddr>,
    /// How often queue gauges are refreshed from the database.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(5))]
    pub refresh_interval: Duration,
    /// Intent kinds that get a `kind` label of their own; the others count as `other`.
    pub kinds: KindList,
}

/// `OUTBOX_CONSOLE__*`: the operator console, a web page (docs/console.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Console {
    /// The console's listen address; `None` (unset or empty) serves no console.
    #[serde(deserialize_with = "load::empty_is_none")]
    pub listen_addr: Option<SocketAddr>,
    /// How long a sign-in lasts.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(8 * 3600))]
    pub session_ttl: Duration,
}

/// The default port of the admin listener (`/metrics`, `/livez`, `/readyz`): the
/// OpenTelemetry SDKs' Prometheus exporter port, an application's metrics port by
/// convention, where 9090 is Prometheus' own and 9100-9999 are the exporters'.
pub const DEFAULT_METRICS_PORT: u16 = 9464;

/// `OUTBOX_METRICS__KINDS`: comma-separated intent kinds, each labelled on its own in the
/// metrics. An allow-list, not every kind seen: kinds are the producers' strings, and a
/// label of each would grow the series without bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KindList(pub Vec<String>);

impl KindList {
    /// Most kinds listed: each multiplies the series of the counters by kind.
    pub const MAX: usize = 100;
    /// Longest kind listed.
    pub const MAX_LENGTH: usize = 200;
}

impl std::str::FromStr for KindList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let kinds: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect();
        if kinds.len() > Self::MAX {
            return Err(format!(
                "lists {} kinds; at most {} may have a label of their own",
                kinds.len(),
                Self::MAX
            ));
        }
        for kind in &kinds {
            // Label values are written unescaped: a quote or backslash would break the page.
            if kind.len() > Self::MAX_LENGTH
                || kind
                    .chars()
                    .any(|c| c.is_control() || c == '"' || c == '\\')
            {
                return Err(format!(
                    "kind {kind:?} must be at most {} bytes without quotes, backslashes or \
                     control characters",
                    Self::MAX_LENGTH
                ));
            }
        }
        Ok(Self(kinds))
    }
}

impl Serialize for KindList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.join(","))
    }
}

impl<'de> Deserialize<'de> for KindList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `OUTBOX_GRPC__*`: optional gRPC services.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Grpc {
    /// Serve gRPC server reflection (v1 and v1alpha).
    #[default(true)]
    pub reflection: bool,
}

/// `OUTBOX_SHUTDOWN__*`: what SIGTERM does.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Shutdown {
    /// How long to keep serving while health says NOT_SERVING, so load balancers stop
    /// routing here before the listener closes.
    #[serde(with = "humantime_serde")]
    pub drain_delay: Duration,
    /// Then how long in-flight calls may take to finish before they are cut.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(30))]
    pub grace: Duration,
}

/// `OUTBOX_OTEL__*`: trace export.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Otel {
    /// OTLP/gRPC endpoint spans are exported to; `None` exports nothing.
    #[serde(deserialize_with = "load::empty_is_none")]
    pub endpoint: Option<String>,
}

/// `OUTBOX_LOG__*`: log output.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Log {
    /// `text` or `json`.
    pub format: LogFormat,
    /// `tracing` filter directives (like RUST_LOG).
    #[default("info".to_owned())]
    pub filter: String,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A directive whose target is no Rust path (`outboxd:debug`, `[[`): `Targets` takes it as a
/// target nothing logs under, which would silence every line it was meant to enable.
fn odd_log_target(directive: &str) -> Option<String> {
    let directive = directive.trim();
    let target = match directive.split_once('=') {
        Some((target, _)) => target,
        None if directive.is_empty()
            || directive
                .parse::<tracing_subscriber::filter::LevelFilter>()
                .is_ok() =>
        {
            return None;
        }
        None => directive,
    };
    let is_ident = |s: &str| {
        s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    (!target.split("::").all(is_ident))
        .then(|| format!("{target:?} is not a target (a module path such as `outboxd::grpc`)"))
}

impl Settings {
    /// Backoff between attempts.
    pub fn backoff(&self) -> BackoffParams {
        self.maintenance.backoff
    }

    /// What no single variable's type rules out, named by the variables to change.
    fn inconsistencies(&self) -> Vec<String> {
        let (l, m) = (&self.limits, &self.maintenance);
        let mut problems = Vec::new();
        let filter = &self.log.filter;
        let unparsed = filter
            .parse::<tracing_subscriber::filter::Targets>()
            .err()
            .map(|e| e.to_string());
        if let Some(why) = unparsed.or_else(|| filter.split(',').find_map(odd_log_target)) {
            problems.push(format!(
                "OUTBOX_LOG__FILTER={filter:?}: {why} (directives as `info,outboxd=debug`)"
            ));
        }
        let urls = [
            (&self.database.url, "OUTBOX_DATABASE__URL"),
            (&self.database.fleet_url, "OUTBOX_DATABASE__FLEET_URL"),
            (
                &self.database.migration_url,
                "OUTBOX_DATABASE__MIGRATION_URL",
            ),
        ];
        for (url, name) in urls {
            if let Some(Err(e)) = url
                .as_deref()
                .map(str::parse::<sqlx::postgres::PgConnectOptions>)
            {
                problems.push(format!("{name} is not a valid PostgreSQL URL: {e}"));
            }
        }
        let at_least_one = [
            (l.max_batch, "OUTBOX_LIMITS__MAX_BATCH"),
            (l.max_payload_bytes, "OUTBOX_LIMITS__MAX_PAYLOAD_BYTES"),
            (
                l.max_header_key_length,
                "OUTBOX_LIMITS__MAX_HEADER_KEY_LENGTH",
            ),
            (
                l.max_header_value_length,
                "OUTBOX_LIMITS__MAX_HEADER_VALUE_LENGTH",
            ),
            (l.max_text_length, "OUTBOX_LIMITS__MAX_TEXT_LENGTH"),
            (l.max_kinds, "OUTBOX_LIMITS__MAX_KINDS"),
            (l.max_connections, "OUTBOX_LIMITS__MAX_CONNECTIONS"),
            (
                l.max_http_connections,
                "OUTBOX_LIMITS__MAX_HTTP_CONNECTIONS",
            ),
            (
                usize::try_from(l.default_max_attempts).unwrap_or(0),
                "OUTBOX_RETRY__MAX_ATTEMPTS",
            ),
        ];
        for (_, name) in at_least_one.into_iter().filter(|(n, _)| *n < 1) {
            problems.push(format!("{name} must be at least 1"));
        }
        let positive = [
            (l.default_lease, "OUTBOX_LEASE__DEFAULT"),
            (m.rescue_interval, "OUTBOX_MAINTENANCE__RESCUE_INTERVAL"),
            (m.purge_interval, "OUTBOX_MAINTENANCE__PURGE_INTERVAL"),
            (self.txn.resolve_interval, "OUTBOX_TXN__RESOLVE_INTERVAL"),
            (
                self.metrics.refresh_interval,
                "OUTBOX_METRICS__REFRESH_INTERVAL",
            ),
            (self.console.session_ttl, "OUTBOX_CONSOLE__SESSION_TTL"),
            (l.operator_timeout, "OUTBOX_LIMITS__OPERATOR_TIMEOUT"),
        ];
        for (_, name) in positive.into_iter().filter(|(d, _)| d.is_zero()) {
            problems.push(format!("{name} must be positive"));
        }
        // Past PostgreSQL's timestamps, a cap would fail every rescue batch and every Fail
        // that retries, for good; a retention, every purge.
        let (limit, retention) = (
            Limits::DURATION_CEILING,
            MaintenanceConfig::RETENTION_CEILING,
        );
        let ceilings = [
            (l.max_delay, limit, "OUTBOX_LIMITS__MAX_DELAY"),
            (l.max_lease, limit, "OUTBOX_LEASE__MAX"),
            (m.backoff.cap, limit, "OUTBOX_RETRY__CAP"),
            (
                self.console.session_ttl,
                limit,
                "OUTBOX_CONSOLE__SESSION_TTL",
            ),
            (
                l.operator_timeout,
                Limits::STATEMENT_TIMEOUT_CEILING,
                "OUTBOX_LIMITS__OPERATOR_TIMEOUT",
            ),
            // Waits and intervals: past it, a timer's deadline overflows (a panic).
            (l.max_wait, limit, "OUTBOX_CLAIM__MAX_WAIT"),
            (
                self.shutdown.drain_delay,
                limit,
                "OUTBOX_SHUTDOWN__DRAIN_DELAY",
            ),
            (self.shutdown.grace, limit, "OUTBOX_SHUTDOWN__GRACE"),
            (
                m.rescue_interval,
                limit,
                "OUTBOX_MAINTENANCE__RESCUE_INTERVAL",
            ),
            (
                m.purge_interval,
                limit,
                "OUTBOX_MAINTENANCE__PURGE_INTERVAL",
            ),
            (
                self.txn.resolve_interval,
                limit,
                "OUTBOX_TXN__RESOLVE_INTERVAL",
            ),
            (self.auth.cache_ttl, limit, "OUTBOX_AUTH__CACHE_TTL"),
            (
                self.metrics.refresh_interval,
                limit,
                "OUTBOX_METRICS__REFRESH_INTERVAL",
            ),
            (m.retention, retention, "OUTBOX_RETENTION__FINISHED"),
            (
                m.key_retention,
                retention,
                "OUTBOX_RETENTION__IDEMPOTENCY_KEYS",
            ),
        ];
        for (_, ceiling, name) in ceilings.into_iter().filter(|(d, c, _)| d > c) {
            let days = ceiling.as_secs() / 86_400;
            problems.push(format!("{name} must not exceed {days}d"));
        }
        let names = 1..=Limits::NAME_LENGTH_CEILING;
        let exposed = !self.listen_addr.ip().is_loopback();
        // The console's sign-in form posts API keys: the same rule as gRPC's.
        let console_exposed = self
            .console
            .listen_addr
            .is_some_and(|addr| !addr.ip().is_loopback());
        let others = [
            (
                l.max_message_bytes >= l.max_payload_bytes,
                "OUTBOX_LIMITS__MAX_MESSAGE_BYTES must be at least \
                 OUTBOX_LIMITS__MAX_PAYLOAD_BYTES",
            ),
            (
                l.max_reply_bytes >= l.max_payload_bytes,
                "OUTBOX_LIMITS__MAX_REPLY_BYTES must be at least OUTBOX_LIMITS__MAX_PAYLOAD_BYTES",
            ),
            (
                names.contains(&l.max_name_length),
                "OUTBOX_LIMITS__MAX_NAME_LENGTH must be between 1 and 256",
            ),
            (
                names.contains(&l.max_region_length),
                "OUTBOX_LIMITS__MAX_REGION_LENGTH must be between 1 and 256",
            ),
            (
                l.default_lease <= l.max_lease,
                "OUTBOX_LEASE__DEFAULT must not exceed OUTBOX_LEASE__MAX",
            ),
            (
                m.backoff.base <= m.backoff.cap,
                "OUTBOX_RETRY__BASE must not exceed OUTBOX_RETRY__CAP",
            ),
            (
                self.database.max_connections >= 2,
                "OUTBOX_DATABASE__MAX_CONNECTIONS must be at least 2",
            ),
            (
                self.tls.is_some() || self.allow_plaintext || !exposed,
                "OUTBOX_LISTEN_ADDR is not a loopback address: configure TLS \
                 (OUTBOX_TLS__CERT_FILE, OUTBOX_TLS__KEY_FILE) or set \
                 OUTBOX_ALLOW_PLAINTEXT=true to serve plaintext",
            ),
            (
                self.tls.is_some() || self.allow_plaintext || !console_exposed,
                "OUTBOX_CONSOLE__LISTEN_ADDR is not a loopback address: configure TLS \
                 (OUTBOX_TLS__CERT_FILE, OUTBOX_TLS__KEY_FILE) or set \
                 OUTBOX_ALLOW_PLAINTEXT=true to serve plaintext",
            ),
        ];
        let failed = others.into_iter().filter(|(ok, _)| !ok);
        problems.extend(failed.map(|(_, problem)| problem.to_owned()));
        problems
    }
}
