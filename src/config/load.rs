//! Reading `OUTBOX_*` variables into [`Settings`] with figment. A variable's name is the key
//! of a field and its value a string the field's type parses: figment's lossy mode reads
//! numbers and booleans from strings, durations are humantime's (`250ms`, `30s`, `5m`,
//! `12h`, `7d`). serde stops at the first bad value, so loading extracts again without each
//! culprit until none is left: every bad variable is reported at once.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::PathBuf;
use std::str::FromStr;

use figment::Figment;
use figment::error::Kind;
use serde::Deserialize;
use serde::de::{Deserializer, Error as _};

use super::{Settings, TlsSettings};

/// Every problem found in the configuration.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  {}", .0.join("\n  "))]
pub struct ConfigError(pub Vec<String>);

/// Read by the operator commands (clap), not by the server.
const CLIENT_ONLY: [&str; 6] = [
    "OUTBOX_SERVER",
    "OUTBOX_API_KEY",
    "OUTBOX_TENANT",
    "OUTBOX_CA_FILE",
    "OUTBOX_CERT_FILE",
    "OUTBOX_KEY_FILE",
];

/// Read by the test suites and the examples (docs/development.md), never by the server: a
/// developer's shell may still export them.
const TESTS_AND_EXAMPLES: [&str; 5] = [
    "OUTBOX_TEST_DATABASE_URL",
    "OUTBOX_SCREENSHOTS_DIR",
    "OUTBOX_ENDPOINTS",
    "OUTBOX_PRODUCER_DATABASE_URL",
    "OUTBOX_WORKER_STOP_AFTER",
];

/// Variables whose field is in another section, as (variable's key, field's key): requests
/// are checked against one [`Limits`](super::Limits) and the sweeps take one
/// `MaintenanceConfig`, while an operator tunes leases, retries and retention.
const MOVED: [(&str, &str); 8] = [
    ("lease.default", "limits.default_lease"),
    ("lease.max", "limits.max_lease"),
    ("claim.max_wait", "limits.max_wait"),
    ("retry.max_attempts", "limits.default_max_attempts"),
    ("retry.base", "maintenance.backoff.base"),
    ("retry.cap", "maintenance.backoff.cap"),
    ("retention.finished", "maintenance.retention"),
    ("retention.idempotency_keys", "maintenance.key_retention"),
];

const UNKNOWN: &str = "unknown variable (see `outboxd --help` for the list)";

/// Whether `name=value` is one of the variables the kubelet sets in every pod for each
/// Service of its namespace ("service links": `{SVC}_SERVICE_HOST`,
/// `{SVC}_SERVICE_PORT[_{NAME}]`, `{SVC}_PORT`, `{SVC}_PORT_{N}_{PROTO}[_PROTO|_PORT|_ADDR]`):
/// a Service named `outbox…` gives `OUTBOX_…` ones, which must not stop the server. Told
/// apart by name and value, so a misspelt variable of outboxd's is still refused.
fn is_service_link(name: &str, value: &str) -> bool {
    // A Service's name ends with a letter or digit, and sections of outboxd's names are
    // joined by `__`.
    let service = |svc: &str| !svc.ends_with('_') && !svc.contains("__");
    let ip = || value.parse::<std::net::IpAddr>().is_ok();
    let port = || value.parse::<u16>().is_ok();
    let protocol = |p: &str| matches!(p, "TCP" | "UDP" | "SCTP");
    let url = || {
        value.split_once("://").is_some_and(|(scheme, _)| {
            protocol(&scheme.to_ascii_uppercase()) && scheme == scheme.to_ascii_lowercase()
        })
    };
    if let Some(svc) = name.strip_suffix("_SERVICE_HOST") {
        return service(svc) && ip();
    }
    if let Some((svc, rest)) = name.split_once("_SERVICE_PORT") {
        return service(svc) && (rest.is_empty() || rest.starts_with('_')) && port();
    }
    let whole = name
        .strip_suffix("_PORT")
        .is_some_and(|svc| service(svc) && url());
    whole
        || name.match_indices("_PORT_").any(|(at, _)| {
            let svc = &name[..at];
            let fields: Vec<&str> = name[at + "_PORT_".len()..].split('_').collect();
            let numbered = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
            service(svc)
                && match fields[..] {
                    [n, p] => numbered(n) && protocol(p) && url(),
                    [n, p, "PROTO"] => {
                        numbered(n) && protocol(p) && protocol(&value.to_ascii_uppercase())
                    }
                    [n, p, "PORT"] => numbered(n) && protocol(p) && port(),
                    [n, p, "ADDR"] => numbered(n) && protocol(p) && ip(),
                    _ => false,
                }
        })
}

impl Settings {
    /// Reads the process environment.
    ///
    /// # Errors
    /// Every malformed or unknown `OUTBOX_*` variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// Builds settings from `OUTBOX_*` pairs (a later pair of a name wins); other names are
    /// ignored.
    ///
    /// # Errors
    /// Every malformed or unknown `OUTBOX_*` variable, and inconsistent combinations.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let given: BTreeMap<String, String> = vars
            .into_iter()
            .filter(|(name, value)| {
                name.starts_with("OUTBOX_")
                    && !CLIENT_ONLY.contains(&&**name)
                    && !TESTS_AND_EXAMPLES.contains(&&**name)
                    && !is_service_link(name, value)
            })
            .map(|(name, value)| (name, value.trim().to_owned()))
            .collect();
        let mut errors = Vec::new();
        let mut keys = BTreeMap::new();
        for name in given.keys() {
            match key_of(name) {
                Some(key) => {
                    keys.insert(name.as_str(), key);
                }
                // Not the value: a misspelt URL variable's holds a password.
                None => errors.push(format!("{name}: {UNKNOWN}")),
            }
        }
        loop {
            let figment = keys.iter().fold(Figment::new(), |f, (name, key)| {
                f.merge((key, &given[*name]))
            });
            let error = match figment.extract_lossy::<Settings>() {
                Ok(settings) => {
                    errors.extend(settings.inconsistencies());
                    return match errors.is_empty() {
                        true => Ok(settings),
                        false => Err(ConfigError(errors)),
                    };
                }
                Err(error) => error,
            };
            for e in error {
                let at = e.path.join(".");
                let culprits: Vec<&str> = keys
                    .iter()
                    .filter(|(_, key)| within(key, &at))
                    .map(|(name, _)| *name)
                    .collect();
                if culprits.is_empty() {
                    // No variable to take away: extracting again would fail the same way.
                    errors.push(e.to_string());
                    return Err(ConfigError(errors));
                }
                let why = match e.kind {
                    Kind::UnknownField(..) => UNKNOWN.to_owned(),
                    kind if kind.to_string().ends_with("expected a duration") => {
                        format!("{kind}: a number and a unit, such as 250ms, 30s, 5m, 12h or 7d")
                    }
                    kind => kind.to_string(),
                };
                for name in culprits {
                    keys.remove(name);
                    errors.push(if why == UNKNOWN {
                        format!("{name}: {UNKNOWN}")
                    } else {
                        problem(name, &given[name], &why)
                    });
                }
            }
        }
    }
}

fn problem(name: &str, value: &str, why: &str) -> String {
    let shown = without_password(value);
    // The loader's own message may quote the value too.
    let why = why.replace(value, &shown);
    format!("{name}={shown:?}: {why}")
}

/// `value` with the password of a URL's user info masked (`postgres://svc:***@db/x`).
fn without_password(value: &str) -> String {
    let Ok(mut url) = url::Url::parse(value) else {
        return value.to_owned();
    };
    if url.password().is_none() || url.set_password(Some("***")).is_err() {
        return value.to_owned();
    }
    url.to_string()
}

/// The key of the field a variable sets (`OUTBOX_DATABASE__URL`: `database.url`), or `None`
/// when no variable has that name.
fn key_of(name: &str) -> Option<String> {
    let sections = name.strip_prefix("OUTBOX_")?.split("__");
    let upper = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
    };
    let sections: Vec<&str> = sections
        .map(|s| (!s.is_empty() && upper(s)).then_some(s))
        .collect::<Option<_>>()?;
    let key = sections.join(".").to_ascii_lowercase();
    // A field that a variable of another section sets is reachable by that name alone.
    if MOVED
        .iter()
        .any(|(_, field)| within(field, &key) || within(&key, field))
    {
        return None;
    }
    Some(match MOVED.iter().find(|(variable, _)| *variable == key) {
        Some((_, field)) => (*field).to_owned(),
        None => key,
    })
}

/// `key` is `at` or a key under it.
fn within(key: &str, at: &str) -> bool {
    key.strip_prefix(at)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// An empty variable is none: unset, or (`OUTBOX_METRICS__LISTEN_ADDR`) disabled.
pub(super) fn empty_is_none<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr<Err: Display>,
{
    match String::deserialize(d)?.as_str() {
        "" => Ok(None),
        value => value.parse().map(Some).map_err(D::Error::custom),
    }
}

/// `OUTBOX_TLS__*`: the certificate and its key go together, and a client CA needs both.
pub(super) fn tls<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TlsSettings>, D::Error> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Files {
        #[serde(default, deserialize_with = "empty_is_none")]
        cert_file: Option<PathBuf>,
        #[serde(default, deserialize_with = "empty_is_none")]
        key_file: Option<PathBuf>,
        #[serde(default, deserialize_with = "empty_is_none")]
        client_ca_file: Option<PathBuf>,
    }
    let files = Files::deserialize(d)?;
    match (files.cert_file, files.key_file, files.client_ca_file) {
        (Some(cert_file), Some(key_file), client_ca_file) => Ok(Some(TlsSettings {
            cert_file,
            key_file,
            client_ca_file,
        })),
        (None, None, None) => Ok(None),
        _ => Err(D::Error::custom(
            "OUTBOX_TLS__CERT_FILE and OUTBOX_TLS__KEY_FILE go together, and \
             OUTBOX_TLS__CLIENT_CA_FILE needs both",
        )),
    }
}

/// The variables' table of docs/configuration.md as (variable, default, meaning) without
/// its Markdown: what `outboxd --help` lists.
pub fn documented() -> Vec<(String, String, String)> {
    let table = include_str!("../../docs/configuration.md").lines();
    let rows = table.filter(|line| line.starts_with("| `OUTBOX_"));
    let cells = rows.map(|row| row.split('|').map(plain).collect::<Vec<_>>());
    cells
        .filter_map(|cells| match &cells[..] {
            [_, name, default, meaning, _] => {
                Some((name.clone(), default.clone(), meaning.clone()))
            }
            _ => None,
        })
        .collect()
}

/// Markdown cell text without backticks and with links as their text.
fn plain(markdown: &str) -> String {
    let mut text = markdown.trim().replace('`', "");
    while let (Some(open), Some(middle)) = (text.find('['), text.find("](")) {
        let Some(close) = text[middle..].find(')').filter(|_| open < middle) else {
            break;
        };
        text.replace_range(middle..=middle + close, "");
        text.remove(open);
    }
    text
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use super::super::LogFormat;
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Settings with every optional section set, so that each variable holds a value.
    fn everything_set() -> Settings {
        let mut s = Settings::default();
        s.database.url = Some("postgres://service@db/outbox".to_owned());
        s.database.fleet_url = Some("postgres://fleet@db/outbox".to_owned());
        s.database.migration_url = Some("postgres://owner@db/outbox".to_owned());
        s.embedded.port = Some(5433);
        s.otel.endpoint = Some("http://collector:4317".to_owned());
        s.tls = Some(TlsSettings {
            cert_file: "/tls/tls.crt".into(),
            key_file: "/tls/tls.key".into(),
            client_ca_file: Some("/tls/ca.crt".into()),
        });
        s
    }

    /// Each field of `settings` as (variable, value as a variable holds it).
    fn as_variables(settings: &Settings) -> Vec<(String, String)> {
        fn walk(value: &serde_json::Value, key: String, out: &mut Vec<(String, String)>) {
            match value {
                serde_json::Value::Object(fields) => {
                    for (name, value) in fields {
                        let key = match key.is_empty() {
                            true => name.clone(),
                            false => format!("{key}.{name}"),
                        };
                        walk(value, key, out);
                    }
                }
                serde_json::Value::String(s) => out.push((key, s.clone())),
                serde_json::Value::Null => out.push((key, String::new())),
                other => out.push((key, other.to_string())),
            }
        }
        let mut fields = Vec::new();
        walk(
            &serde_json::to_value(settings).unwrap(),
            String::new(),
            &mut fields,
        );
        fields
            .into_iter()
            .map(|(key, value)| {
                let moved = MOVED.iter().find(|(_, field)| *field == key);
                let key = moved.map_or(key.as_str(), |(variable, _)| variable);
                let name = format!("OUTBOX_{}", key.replace('.', "__").to_ascii_uppercase());
                (name, value)
            })
            .collect()
    }

    #[test]
    fn every_variable_is_documented_in_the_configuration_table() {
        let table: BTreeSet<String> = documented().into_iter().map(|(name, ..)| name).collect();
        let mut held: BTreeSet<String> = as_variables(&everything_set())
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        held.extend(CLIENT_ONLY.map(String::from));
        assert_eq!(
            table.difference(&held).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "documented in docs/configuration.md, but no setting"
        );
        assert_eq!(
            held.difference(&table).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "settings missing from docs/configuration.md"
        );
    }

    /// The chart's values schema accepts only these names in `env` (outboxd refuses any
    /// other at start, which would crash-loop the pods): a setting added without them fails
    /// here rather than in a cluster.
    #[test]
    fn the_charts_values_schema_lists_exactly_the_documented_variables() {
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../charts/outboxd/values.schema.json"))
                .expect("values.schema.json is JSON");
        let listed: Vec<&str> = schema["definitions"]["outboxVariable"]["enum"]
            .as_array()
            .expect("definitions.outboxVariable.enum")
            .iter()
            .map(|name| name.as_str().expect("a name"))
            .collect();
        let table: Vec<String> = documented().into_iter().map(|(name, ..)| name).collect();
        assert_eq!(
            listed, table,
            "charts/outboxd/values.schema.json definitions.outboxVariable.enum must list the \
             variables of docs/configuration.md, in its order"
        );
    }

    #[test]
    fn every_variable_sets_its_field() {
        let mut expected = everything_set();
        expected.limits.max_batch = 7;
        expected.limits.default_lease = Duration::from_secs(45);
        expected.maintenance.backoff.cap = Duration::from_secs(600);
        expected.maintenance.key_retention = Duration::from_secs(30 * 86_400);
        expected.metrics.listen_addr = None;
        expected.claim.hand_off = false;
        expected.log.format = LogFormat::Json;
        let variables = as_variables(&expected);
        assert!(variables.len() >= 40, "{variables:?}");
        assert_eq!(Settings::from_vars(variables).unwrap(), expected);
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
        assert_eq!(s.database.url.as_deref(), Some("postgres://x@db/outbox"));
    }

    #[test]
    fn the_kubelets_service_links_of_a_service_named_outbox_are_ignored() {
        // A Service `outbox-outboxd` (ports grpc 50051/TCP and metrics 9464/TCP).
        let links = [
            ("OUTBOX_OUTBOXD_SERVICE_HOST", "10.96.0.12"),
            ("OUTBOX_OUTBOXD_SERVICE_PORT", "50051"),
            ("OUTBOX_OUTBOXD_SERVICE_PORT_GRPC", "50051"),
            ("OUTBOX_OUTBOXD_PORT", "tcp://10.96.0.12:50051"),
            ("OUTBOX_OUTBOXD_PORT_50051_TCP", "tcp://10.96.0.12:50051"),
            ("OUTBOX_OUTBOXD_PORT_50051_TCP_PROTO", "tcp"),
            ("OUTBOX_OUTBOXD_PORT_50051_TCP_PORT", "50051"),
            ("OUTBOX_OUTBOXD_PORT_9464_TCP_ADDR", "10.96.0.12"),
            ("OUTBOX_SERVICE_HOST", "fd00::12"),
        ];
        assert_eq!(
            Settings::from_vars(vars(&links)).unwrap(),
            Settings::default()
        );
        // Names or values no Service gives: still refused, and outboxd's own still read.
        let err = Settings::from_vars(vars(&[
            ("OUTBOX_OUTBOXD_SERVICE_HOST", "db.internal"),
            ("OUTBOX_OUTBOXD_PORT", "50051"),
            ("OUTBOX_OUTBOXD_PORT_50051_TCP_ADDR", "somewhere"),
            ("OUTBOX_LISTEN_PORT_1_TCP", "1"),
        ]))
        .unwrap_err();
        assert_eq!(err.0.len(), 4, "{err}");
        let s = Settings::from_vars(vars(&[("OUTBOX_EMBEDDED__PORT", "5433")])).unwrap();
        assert_eq!(s.embedded.port, Some(5433));
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
    fn each_bad_variable_gets_a_line_naming_it_and_what_is_wrong() {
        let err = Settings::from_vars(vars(&[
            ("OUTBOX_LEASE__DEFAULT", "soon"),
            ("OUTBOX_LISTEN_ADDR", "nowhere"),
            ("OUTBOX_LIMITS__MAX_BATCH", "many"),
            ("OUTBOX_CLAIM__HAND_OFF", "maybe"),
            ("OUTBOX_LOG__FORMAT", "xml"),
            ("OUTBOX_EMBEDDED__PORT", "70000"),
            ("OUTBOX_TYPO", "1"),
            ("OUTBOX_LIMITS__DEFAULT_LEASE", "5s"),
            ("OUTBOX_limits__max_batch", "5"),
            ("OUTBOX_RETRY__CAP", "500ms"),
        ]))
        .unwrap_err();
        let lines = err.0.iter().map(String::as_str).collect::<Vec<_>>();
        let expect = [
            ("OUTBOX_LEASE__DEFAULT=\"soon\"", "duration"),
            ("OUTBOX_LISTEN_ADDR=\"nowhere\"", "socket address"),
            ("OUTBOX_LIMITS__MAX_BATCH=\"many\"", "expected usize"),
            ("OUTBOX_CLAIM__HAND_OFF=\"maybe\"", "expected a boolean"),
            ("OUTBOX_LOG__FORMAT=\"xml\"", "`text` or `json`"),
            ("OUTBOX_EMBEDDED__PORT=\"70000\"", "u16"),
            ("OUTBOX_TYPO:", "unknown variable"),
            ("OUTBOX_LIMITS__DEFAULT_LEASE:", "unknown variable"),
            ("OUTBOX_limits__max_batch:", "unknown variable"),
            (
                "OUTBOX_RETRY__BASE must not exceed OUTBOX_RETRY__CAP",
                "OUTBOX_RETRY__BASE",
            ),
        ];
        for (variable, what) in expect {
            assert!(
                lines
                    .iter()
                    .any(|line| line.starts_with(variable) && line.contains(what)),
                "no line for {variable} saying {what:?} in:\n{err}"
            );
        }
        assert_eq!(lines.len(), expect.len(), "{err}");
    }

    #[test]
    fn errors_show_no_password() {
        let err = Settings::from_vars(vars(&[
            ("OUTBOX_DATABASE_URL", "postgres://svc:S3cret@db:5432/x"),
            (
                "OUTBOX_DATABASE__MAX_CONNECTIONS",
                "postgres://svc:S3cret@db/x",
            ),
        ]))
        .unwrap_err();
        let text = err.0.join("\n");
        assert!(!text.contains("S3cret"), "{text}");
        assert!(
            text.contains("OUTBOX_DATABASE_URL: unknown variable"),
            "{text}"
        );
        assert!(text.contains("postgres://svc:***@db/x"), "{text}");
    }

    #[test]
    fn a_log_filter_that_does_not_parse_is_refused() {
        let err =
            Settings::from_vars(vars(&[("OUTBOX_LOG__FILTER", "outboxd=verbose")])).unwrap_err();
        assert_eq!(err.0.len(), 1);
        assert!(err.0[0].starts_with("OUTBOX_LOG__FILTER"), "{err}");
        let s = Settings::from_vars(vars(&[("OUTBOX_LOG__FILTER", "info,outboxd=debug")]));
        assert_eq!(s.unwrap().log.filter, "info,outboxd=debug");
        // Parsed by `Targets` as targets nothing logs under: every line silenced.
        for odd in ["outboxd:debug", "info,[["] {
            let err = Settings::from_vars(vars(&[("OUTBOX_LOG__FILTER", odd)])).unwrap_err();
            assert_eq!(err.0.len(), 1, "{odd}");
            assert!(err.0[0].contains("is not a target"), "{err}");
        }
        let s = Settings::from_vars(vars(&[(
            "OUTBOX_LOG__FILTER",
            "warn,outboxd::grpc=trace,tower_http=off,h2=info",
        )]));
        assert!(s.is_ok(), "{s:?}");
    }

    #[test]
    fn a_console_session_must_last_and_not_past_the_ceiling() {
        for (ttl, problem) in [
            ("0s", "OUTBOX_CONSOLE__SESSION_TTL must be positive"),
            (
                "500000y",
                "OUTBOX_CONSOLE__SESSION_TTL must not exceed 3660d",
            ),
        ] {
            let err =
                Settings::from_vars(vars(&[("OUTBOX_CONSOLE__SESSION_TTL", ttl)])).unwrap_err();
            assert_eq!(err.0, [problem], "{ttl}");
        }
    }

    #[test]
    fn every_database_url_that_does_not_parse_is_reported_with_the_others() {
        let err = Settings::from_vars(vars(&[
            ("OUTBOX_DATABASE__URL", "notaurl"),
            ("OUTBOX_DATABASE__FLEET_URL", "alsonot"),
            (
                "OUTBOX_DATABASE__MIGRATION_URL",
                "postgres://owner:S3cret@db/x",
            ),
            ("OUTBOX_FOO", "1"),
        ]))
        .unwrap_err();
        let text = err.0.join("\n");
        assert_eq!(err.0.len(), 3, "{text}");
        for line in [
            "OUTBOX_DATABASE__URL is not a valid PostgreSQL URL",
            "OUTBOX_DATABASE__FLEET_URL is not a valid PostgreSQL URL",
            "OUTBOX_FOO: unknown variable",
        ] {
            assert!(err.0.iter().any(|l| l.starts_with(line)), "{line}: {text}");
        }
    }

    #[test]
    fn waits_and_intervals_past_the_ceiling_are_refused_not_a_panic_later() {
        let names = [
            "OUTBOX_CLAIM__MAX_WAIT",
            "OUTBOX_SHUTDOWN__DRAIN_DELAY",
            "OUTBOX_SHUTDOWN__GRACE",
            "OUTBOX_MAINTENANCE__RESCUE_INTERVAL",
            "OUTBOX_MAINTENANCE__PURGE_INTERVAL",
            "OUTBOX_TXN__RESOLVE_INTERVAL",
            "OUTBOX_AUTH__CACHE_TTL",
            "OUTBOX_METRICS__REFRESH_INTERVAL",
        ];
        let huge: Vec<(&str, &str)> = names.iter().map(|n| (*n, "500000000000y")).collect();
        let err = Settings::from_vars(vars(&huge)).unwrap_err();
        let expected: Vec<String> = names
            .iter()
            .map(|n| format!("{n} must not exceed 3660d"))
            .collect();
        let mut lines = err.0.clone();
        lines.sort();
        let mut expected_sorted = expected.clone();
        expected_sorted.sort();
        assert_eq!(lines, expected_sorted);
    }

    #[test]
    fn an_operator_timeout_fits_postgresqls_statement_timeout() {
        let err =
            Settings::from_vars(vars(&[("OUTBOX_LIMITS__OPERATOR_TIMEOUT", "25d")])).unwrap_err();
        assert_eq!(
            err.0,
            ["OUTBOX_LIMITS__OPERATOR_TIMEOUT must not exceed 24d"]
        );
        let s = Settings::from_vars(vars(&[("OUTBOX_LIMITS__OPERATOR_TIMEOUT", "24d")]));
        assert_eq!(
            s.unwrap().limits.operator_timeout,
            Duration::from_secs(24 * 86_400)
        );
    }

    #[test]
    fn durations_take_a_unit() {
        for (value, expected) in [
            ("250ms", Duration::from_millis(250)),
            ("5s", Duration::from_secs(5)),
            ("5m", Duration::from_secs(300)),
            ("12h", Duration::from_secs(12 * 3600)),
            ("7d", Duration::from_secs(7 * 86_400)),
            ("1h 30m", Duration::from_secs(5400)),
            ("0s", Duration::ZERO),
        ] {
            let s = Settings::from_vars(vars(&[("OUTBOX_SHUTDOWN__DRAIN_DELAY", value)]));
            assert_eq!(s.unwrap().shutdown.drain_delay, expected, "{value}");
        }
        for value in ["5", "5 parsecs", "-1s", ""] {
            let s = Settings::from_vars(vars(&[("OUTBOX_SHUTDOWN__DRAIN_DELAY", value)]));
            assert!(s.is_err(), "{value:?} was taken as a duration");
        }
    }

    #[test]
    fn an_empty_variable_unsets_an_optional_setting() {
        let s = Settings::from_vars(vars(&[
            ("OUTBOX_DATABASE__URL", ""),
            ("OUTBOX_METRICS__LISTEN_ADDR", ""),
            ("OUTBOX_TLS__CERT_FILE", " "),
            ("OUTBOX_TLS__KEY_FILE", ""),
        ]))
        .unwrap();
        assert_eq!(s.database.url, None);
        assert_eq!(
            s.metrics.listen_addr, None,
            "an empty address disables /metrics"
        );
        assert_eq!(s.tls, None);
    }

    #[test]
    fn a_later_pair_of_a_name_wins() {
        let s = Settings::from_vars(vars(&[
            ("OUTBOX_LIMITS__MAX_BATCH", "oops"),
            ("OUTBOX_LIMITS__MAX_BATCH", "10"),
        ]))
        .unwrap();
        assert_eq!(s.limits.max_batch, 10);
    }

    #[test]
    fn the_operator_commands_test_suites_and_examples_variables_are_left_to_them() {
        let s = Settings::from_vars(vars(&[
            ("OUTBOX_SERVER", "http://elsewhere:50051"),
            ("OUTBOX_API_KEY", "obx_secret"),
            (
                "OUTBOX_TEST_DATABASE_URL",
                "postgres://postgres@localhost/postgres",
            ),
            ("OUTBOX_SCREENSHOTS_DIR", "docs/console"),
            ("OUTBOX_ENDPOINTS", "127.0.0.1:50051,127.0.0.1:50052"),
            (
                "OUTBOX_PRODUCER_DATABASE_URL",
                "postgres://postgres@localhost/shop",
            ),
            ("OUTBOX_WORKER_STOP_AFTER", "2"),
        ]));
        assert_eq!(s.unwrap(), Settings::default());
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

        // The console's sign-in form carries API keys: the same rule.
        let console = [("OUTBOX_CONSOLE__LISTEN_ADDR", "0.0.0.0:8080")];
        let refused = Settings::from_vars(vars(&console)).unwrap_err().to_string();
        assert!(refused.contains("OUTBOX_CONSOLE__LISTEN_ADDR"), "{refused}");
        let opted_in = [console[0], ("OUTBOX_ALLOW_PLAINTEXT", "true")];
        assert!(Settings::from_vars(vars(&opted_in)).is_ok());
        let local = [("OUTBOX_CONSOLE__LISTEN_ADDR", "127.0.0.1:8080")];
        assert!(Settings::from_vars(vars(&local)).is_ok());
    }

    #[test]
    fn the_help_reads_the_table_without_its_markdown() {
        let rows = documented();
        let (_, default, meaning) = rows
            .iter()
            .find(|(name, ..)| name == "OUTBOX_CLAIM__HAND_OFF")
            .unwrap();
        assert_eq!(default, "true");
        assert!(meaning.contains("(see decisions.md)"), "{meaning}");
    }
}
