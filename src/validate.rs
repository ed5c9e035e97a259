//! Request validation: converts wire requests into domain inputs, checking every field
//! against the configured limits. A request is either wholly valid or rejected with every
//! violation named (up to a bound that keeps the error small enough for any client's
//! header limits), before anything touches the database. No input panics: a property test
//! (`tests/api/properties.rs`) and a fuzz target (`fuzz/`) hold this to it.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use uuid::Uuid;

use crate::config::Limits;
use crate::outbox::store::{PolicyCursor, ReconcileTarget};
use crate::outbox::token::TxnToken;
use crate::outbox::{
    Decision, Error, FailOutcome, Failure, FieldViolation, IntentId, IntentState, LeaseId,
    LeaseRef, NewIntent, Reason, Result, Schedule,
};
use crate::proto::{from_timestamp, v1};

const MAX_ATTEMPTS: i32 = 1000;
/// Priorities an intent may have (the database's `intent_priority_in_range`).
pub const PRIORITIES: std::ops::RangeInclusive<i16> = -10..=10;
const DEFAULT_RECONCILE_LIMIT: usize = 100;
const DEFAULT_PAGE_SIZE: usize = 50;
/// Most violations listed in one error, and most bytes of field paths and descriptions as
/// they are sent ([`header_bytes`]): the message and the BadRequest (base64, a third more)
/// both travel in HTTP/2 trailers, which clients cap (8 KiB in grpcio, which past it drops
/// the call; 16 KiB in hyper and tonic). A request of 1000 bad intents must still get its
/// INVALID_ARGUMENT, not a protocol error.
const MAX_VIOLATIONS: usize = 32;
const MAX_VIOLATION_BYTES: usize = 1024;
/// Longest list of states a filter may give (each state twice over).
const MAX_STATES_IN_FILTER: usize = 2 * IntentState::ALL.len();
/// Characters of a client-chosen map key quoted in a field path.
const KEY_PREVIEW_CHARS: usize = 32;
/// Earliest instant accepted (0001-01-01T00:00:00Z): PostgreSQL's `timestamptz` refuses
/// far older ones, which would otherwise fail as an internal error.
const EARLIEST_INSTANT_SECONDS: i64 = -62_135_596_800;
/// Latest instant accepted as a filter (9999-12-31T23:59:59Z).
const LATEST_INSTANT_SECONDS: i64 = 253_402_300_799;

/// Bytes `text` takes in the `grpc-message` header, which percent-encodes every non-ASCII
/// byte (`%F0`): three a byte, so a budget of raw bytes would let non-ASCII field paths
/// make an error larger than clients accept.
fn header_bytes(text: &str) -> usize {
    text.len() + 2 * text.bytes().filter(|b| !b.is_ascii()).count()
}

/// Collects violations; invalid input is reported all at once.
#[derive(Default)]
struct Check {
    invalid: Vec<FieldViolation>,
    too_large: Option<(Reason, Vec<FieldViolation>)>,
    /// Violations found but not listed (invalid, over a limit), and bytes listed so far.
    omitted: (usize, usize),
    listed_bytes: usize,
}

impl Check {
    /// Whether one more violation fits in the error; counts its bytes when it does.
    fn room(&mut self, v: &FieldViolation) -> bool {
        let listed = self.invalid.len() + self.too_large.as_ref().map_or(0, |(_, l)| l.len());
        let bytes = header_bytes(&v.field) + header_bytes(&v.description);
        let fits = listed < MAX_VIOLATIONS && self.listed_bytes + bytes <= MAX_VIOLATION_BYTES;
        if fits {
            self.listed_bytes += bytes;
        }
        fits
    }

    fn fail(&mut self, field: impl Into<String>, description: impl Into<String>) {
        let v = FieldViolation::new(field, description);
        // The first one is always listed: an invalid request must say why.
        if self.invalid.is_empty() || self.room(&v) {
            self.invalid.push(v);
        } else {
            self.omitted.0 += 1;
        }
    }

    fn limit(&mut self, reason: Reason, field: impl Into<String>, description: impl Into<String>) {
        let v = FieldViolation::new(field, description);
        if self.too_large.is_none() {
            self.too_large = Some((reason, vec![v]));
        } else if self.room(&v) {
            if let Some((_, list)) = &mut self.too_large {
                list.push(v);
            }
        } else {
            self.omitted.1 += 1;
        }
    }

    fn done<T>(self, value: T) -> Result<T> {
        let listed = |mut violations: Vec<FieldViolation>, omitted: usize| {
            if omitted > 0 {
                violations.push(FieldViolation::new(
                    "",
                    format!("{omitted} more violations not listed"),
                ));
            }
            violations
        };
        if !self.invalid.is_empty() {
            Err(Error::InvalidArgument(listed(self.invalid, self.omitted.0)))
        } else if let Some((reason, violations)) = self.too_large {
            Err(Error::LimitExceeded(
                reason,
                listed(violations, self.omitted.1),
            ))
        } else {
            Ok(value)
        }
    }

    /// A batch must be non-empty and within the limit. Its callers check only the first
    /// `max_batch` items: past the limit the request is refused anyway, and a message of
    /// millions of empty items must not hold a runtime thread for seconds.
    fn batch(&mut self, field: &str, len: usize, limits: &Limits) {
        if len == 0 {
            self.fail(field, "must contain at least one item");
        } else if len > limits.max_batch {
            self.limit(
                Reason::BatchTooLarge,
                field,
                format!("{len} items; at most {} per request", limits.max_batch),
            );
        }
    }

    /// A filter of states names each at most once or twice: a longer list is a mistake (or
    /// an attack), refused without reading past [`MAX_STATES_IN_FILTER`] of it.
    fn states_filter(&mut self, field: &str, len: usize) {
        if len > MAX_STATES_IN_FILTER {
            self.fail(
                field,
                format!(
                    "{len} states; at most {MAX_STATES_IN_FILTER} (there are {})",
                    IntentState::ALL.len()
                ),
            );
        }
    }

    /// Printable text without control characters (PostgreSQL text cannot hold NUL).
    fn text(&mut self, field: &str, value: &str, required: bool, max: usize) {
        if value.is_empty() {
            if required {
                self.fail(field, "is required");
            }
        } else if value.chars().nth(max).is_some() {
            self.fail(field, format!("longer than {max} characters"));
        } else if value.chars().any(char::is_control) {
            self.fail(field, "must not contain control characters");
        }
    }

    /// Identifier-like names: letters, digits and `. _ - : /`.
    fn name(&mut self, field: &str, value: &str, required: bool, max: usize) {
        if value.is_empty() {
            if required {
                self.fail(field, "is required");
            }
        } else if value.len() > max {
            self.fail(field, format!("longer than {max} characters"));
        } else if !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/".contains(&b))
        {
            self.fail(
                field,
                "may only contain ASCII letters, digits and . _ - : /",
            );
        }
    }

    /// A UUID other than the nil one (never assigned, and the placeholder of bad input).
    fn uuid(&mut self, field: &str, value: &str) -> Uuid {
        self.uuid_named(|| field.to_owned(), value)
    }

    /// [`Self::uuid`] for the items of a batch: their field names (`leases[17].lease_id`)
    /// are built only for a bad one, not a few thousand times per valid call.
    fn uuid_named(&mut self, field: impl FnOnce() -> String, value: &str) -> Uuid {
        let problem = match Uuid::parse_str(value) {
            Ok(u) if u.is_nil() => "must not be the nil UUID",
            Ok(u) => return u,
            Err(_) if value.is_empty() => "is required",
            Err(_) => "must be a UUID such as 0190f3c4-8f1e-7d2a-9b3c-2f4e5d6a7b8c",
        };
        self.fail(field(), problem);
        Uuid::nil()
    }

    /// A non-negative duration within `max`; `None` when unset.
    fn duration(
        &mut self,
        field: &str,
        value: Option<&prost_types::Duration>,
        max: Duration,
    ) -> Option<Duration> {
        let d = value?;
        let duration = match (u64::try_from(d.seconds), u32::try_from(d.nanos)) {
            (Ok(seconds), Ok(nanos)) if nanos < 1_000_000_000 => {
                Some(Duration::new(seconds, nanos))
            }
            _ => None,
        };
        match duration {
            None => {
                self.fail(
                    field,
                    "must be a non-negative duration (nanos between 0 and 999999999)",
                );
                None
            }
            Some(d) if d > max => {
                self.fail(field, format!("must not exceed {}s", max.as_secs_f64()));
                None
            }
            Some(d) => Some(d),
        }
    }

    fn state(&mut self, field: &str, value: i32) -> Option<IntentState> {
        let state = match v1::IntentState::try_from(value) {
            Ok(v1::IntentState::Staged) => IntentState::Staged,
            Ok(v1::IntentState::Pending) => IntentState::Pending,
            Ok(v1::IntentState::Leased) => IntentState::Leased,
            Ok(v1::IntentState::Submitted) => IntentState::Submitted,
            Ok(v1::IntentState::Delivered) => IntentState::Delivered,
            Ok(v1::IntentState::NeedsReconcile) => IntentState::NeedsReconcile,
            Ok(v1::IntentState::DeadLettered) => IntentState::DeadLettered,
            Ok(v1::IntentState::Discarded) => IntentState::Discarded,
            Ok(v1::IntentState::Waiting) => IntentState::Waiting,
            Ok(v1::IntentState::Cancelled) => IntentState::Cancelled,
            Ok(v1::IntentState::Unspecified) | Err(_) => {
                self.fail(field, format!("{value} is not a known intent state"));
                return None;
            }
        };
        Some(state)
    }

    /// A valid instant PostgreSQL can store, no later than `latest`.
    fn instant(
        &mut self,
        field: &str,
        value: &prost_types::Timestamp,
        latest: chrono::DateTime<chrono::Utc>,
        description: &str,
    ) -> Option<chrono::DateTime<chrono::Utc>> {
        match from_timestamp(value) {
            Some(at) if value.seconds >= EARLIEST_INSTANT_SECONDS && at <= latest => Some(at),
            _ => {
                self.fail(field, description);
                None
            }
        }
    }
}

/// `now + ahead`, saturating at the latest instant a filter may name.
fn latest_after(ahead: Duration) -> chrono::DateTime<chrono::Utc> {
    let ceiling = chrono::DateTime::from_timestamp(LATEST_INSTANT_SECONDS, 0).unwrap_or_default();
    chrono::TimeDelta::from_std(ahead)
        .ok()
        .and_then(|d| chrono::Utc::now().checked_add_signed(d))
        .map_or(ceiling, |t| t.min(ceiling))
}

/// A map key quoted for a field path: escaped and cut short, so a hostile key cannot
/// bloat the error.
fn quoted_key(key: &str) -> String {
    let mut preview: String = key.chars().take(KEY_PREVIEW_CHARS).collect();
    if preview.len() < key.len() {
        preview.push('…');
    }
    format!("{preview:?}")
}

/// Removes repeated filter values, keeping the first of each (for the few intent states;
/// quadratic in the number of distinct values).
fn dedup<T: PartialEq>(values: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for v in values {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// Validates an Enqueue request into domain intents and the optional transaction token.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn enqueue(
    req: v1::EnqueueRequest,
    limits: &Limits,
) -> Result<(Vec<NewIntent>, Option<TxnToken>)> {
    let mut c = Check::default();
    c.batch("intents", req.intents.len(), limits);
    let mut keys = HashSet::new();
    let mut intents = Vec::with_capacity(req.intents.len());
    for (i, intent) in req.intents.into_iter().take(limits.max_batch).enumerate() {
        let f = |name: &str| format!("intents[{i}].{name}");
        c.name(&f("kind"), &intent.kind, true, limits.max_name_length);
        c.name(
            &f("region"),
            &intent.region,
            false,
            limits.max_region_length,
        );
        c.text(
            &f("content_type"),
            &intent.content_type,
            false,
            limits.max_name_length,
        );
        c.text(
            &f("idempotency_key"),
            &intent.idempotency_key,
            false,
            limits.max_name_length,
        );
        c.text(
            &f("ordering_key"),
            &intent.ordering_key,
            false,
            limits.max_name_length,
        );
        if !intent.idempotency_key.is_empty() && !keys.insert(intent.idempotency_key.clone()) {
            c.fail(
                f("idempotency_key"),
                "repeats a key used earlier in this batch",
            );
        }
        if intent.payload.len() > limits.max_payload_bytes {
            c.limit(
                Reason::PayloadTooLarge,
                f("payload"),
                format!(
                    "{} bytes; at most {} bytes",
                    intent.payload.len(),
                    limits.max_payload_bytes
                ),
            );
        }
        if intent.headers.len() > limits.max_headers {
            c.fail(
                f("headers"),
                format!(
                    "{} headers; at most {}",
                    intent.headers.len(),
                    limits.max_headers
                ),
            );
        }
        for (key, value) in &intent.headers {
            let field = f(&format!("headers[{}]", quoted_key(key)));
            c.name(&field, key, true, limits.max_header_key_length);
            c.text(&field, value, false, limits.max_header_value_length);
        }
        let priority = i16::try_from(intent.priority)
            .ok()
            .filter(|p| PRIORITIES.contains(p))
            .unwrap_or_else(|| {
                c.fail(
                    f("priority"),
                    format!(
                        "must be from {} to {}",
                        PRIORITIES.start(),
                        PRIORITIES.end()
                    ),
                );
                0
            });
        let max_attempts = match intent.max_attempts {
            0 => limits.default_max_attempts,
            n if (1..=MAX_ATTEMPTS).contains(&n) => n,
            n => {
                c.fail(
                    f("max_attempts"),
                    format!("{n}; must be between 1 and {MAX_ATTEMPTS} (0: default)"),
                );
                0
            }
        };
        let schedule = match &intent.schedule {
            None => Schedule::Now,
            Some(v1::new_intent::Schedule::Delay(d)) => c
                .duration(&f("delay"), Some(d), limits.max_delay)
                .map_or(Schedule::Now, Schedule::Delay),
            Some(v1::new_intent::Schedule::AvailableAt(t)) => c
                .instant(
                    &f("available_at"),
                    t,
                    latest_after(limits.max_delay),
                    &format!(
                        "must be a valid instant after the year 1 and at most {}s ahead",
                        limits.max_delay.as_secs()
                    ),
                )
                .map_or(Schedule::Now, Schedule::At),
        };
        intents.push(NewIntent {
            kind: intent.kind,
            payload: intent.payload,
            content_type: intent.content_type,
            region: intent.region,
            idempotency_key: (!intent.idempotency_key.is_empty()).then_some(intent.idempotency_key),
            ordering_key: (!intent.ordering_key.is_empty()).then_some(intent.ordering_key),
            priority,
            headers: intent.headers.into_iter().collect::<BTreeMap<_, _>>(),
            max_attempts,
            schedule,
        });
    }
    let token = if req.txn_token.is_empty() {
        None
    } else {
        match req.txn_token.parse::<TxnToken>() {
            // PostgreSQL reserves 32-bit xids 0-2 (invalid, bootstrap, frozen): no
            // transaction of a producer has one, and pg_xact_status would call them
            // committed or forgotten.
            Ok(t) if t.xid & 0xffff_ffff < 3 => {
                c.fail(
                    "txn_token",
                    "names a reserved transaction id, never an open transaction's",
                );
                None
            }
            Ok(t) => Some(t),
            Err(e) => {
                c.fail("txn_token", e.to_string());
                None
            }
        }
    };
    c.done((intents, token))
}

/// A validated Claim request.
#[derive(Debug, Clone)]
pub struct Claim {
    /// Worker id.
    pub worker_id: String,
    /// Worker region.
    pub region: String,
    /// Kinds filter.
    pub kinds: Vec<String>,
    /// Batch size.
    pub max_intents: i32,
    /// Lease length.
    pub lease_duration: Duration,
    /// Long-poll duration (zero: none).
    pub wait: Duration,
    /// Replay id.
    pub request_id: Option<String>,
}

/// Validates a Claim request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn claim(req: v1::ClaimRequest, limits: &Limits) -> Result<Claim> {
    let mut c = Check::default();
    c.text("worker_id", &req.worker_id, true, limits.max_name_length);
    c.name("region", &req.region, false, limits.max_region_length);
    if req.kinds.len() > limits.max_kinds {
        c.fail(
            "kinds",
            format!("{} kinds; at most {}", req.kinds.len(), limits.max_kinds),
        );
    }
    for (i, kind) in req.kinds.iter().enumerate() {
        c.name(&format!("kinds[{i}]"), kind, true, limits.max_name_length);
    }
    if req.max_intents < 1 {
        c.fail("max_intents", "must be at least 1");
    } else if req.max_intents as usize > limits.max_batch {
        c.limit(
            Reason::BatchTooLarge,
            "max_intents",
            format!("at most {} per request", limits.max_batch),
        );
    }
    let lease_duration = lease(
        &mut c,
        "lease_duration",
        req.lease_duration.as_ref(),
        limits,
    );
    let wait = c
        .duration("wait", req.wait.as_ref(), limits.max_wait)
        .unwrap_or_default();
    c.text("request_id", &req.request_id, false, limits.max_name_length);
    c.done(Claim {
        worker_id: req.worker_id,
        region: req.region,
        kinds: req.kinds,
        max_intents: req.max_intents,
        lease_duration,
        wait,
        request_id: (!req.request_id.is_empty()).then_some(req.request_id),
    })
}

fn lease(
    c: &mut Check,
    field: &str,
    value: Option<&prost_types::Duration>,
    limits: &Limits,
) -> Duration {
    match c.duration(field, value, limits.max_lease) {
        None => limits.default_lease,
        // Leases are stored in milliseconds: less would expire as it is granted.
        Some(d) if d < Duration::from_millis(1) => {
            c.fail(field, "must be at least 1ms (unset: the server default)");
            limits.default_lease
        }
        Some(d) => d,
    }
}

/// The lease reference named `field()` (built only when it is bad).
fn lease_ref(
    c: &mut Check,
    field: &dyn Fn() -> String,
    lease: Option<&v1::LeaseRef>,
    seen: &mut HashSet<Uuid>,
) -> LeaseRef {
    let Some(lease) = lease else {
        c.fail(field(), "is required");
        return LeaseRef {
            intent_id: IntentId(Uuid::nil()),
            lease_id: LeaseId(Uuid::nil()),
        };
    };
    let intent_id = c.uuid_named(|| format!("{}.intent_id", field()), &lease.intent_id);
    let lease_id = c.uuid_named(|| format!("{}.lease_id", field()), &lease.lease_id);
    if !intent_id.is_nil() && !seen.insert(intent_id) {
        c.fail(
            format!("{}.intent_id", field()),
            "names an intent already named in this batch",
        );
    }
    LeaseRef {
        intent_id: IntentId(intent_id),
        lease_id: LeaseId(lease_id),
    }
}

fn lease_refs(c: &mut Check, leases: &[v1::LeaseRef], limits: &Limits) -> Vec<LeaseRef> {
    c.batch("leases", leases.len(), limits);
    let mut seen = HashSet::new();
    leases
        .iter()
        .take(limits.max_batch)
        .enumerate()
        .map(|(i, l)| lease_ref(c, &|| format!("leases[{i}]"), Some(l), &mut seen))
        .collect()
}

/// Validates the leases of an Ack or MarkSubmitted request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn leases(leases: &[v1::LeaseRef], limits: &Limits) -> Result<Vec<LeaseRef>> {
    let mut c = Check::default();
    let refs = lease_refs(&mut c, leases, limits);
    c.done(refs)
}

/// Validates an ExtendLease request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn extend(req: &v1::ExtendLeaseRequest, limits: &Limits) -> Result<(Vec<LeaseRef>, Duration)> {
    let mut c = Check::default();
    let refs = lease_refs(&mut c, &req.leases, limits);
    let duration = lease(
        &mut c,
        "lease_duration",
        req.lease_duration.as_ref(),
        limits,
    );
    c.done((refs, duration))
}

/// Validates a Fail request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn fail(req: v1::FailRequest, limits: &Limits) -> Result<Vec<Failure>> {
    let mut c = Check::default();
    c.batch("failures", req.failures.len(), limits);
    let mut seen = HashSet::new();
    let mut failures = Vec::with_capacity(req.failures.len());
    for (i, f) in req.failures.into_iter().take(limits.max_batch).enumerate() {
        let field = |name: &str| format!("failures[{i}].{name}");
        let lease = lease_ref(&mut c, &|| field("lease"), f.lease.as_ref(), &mut seen);
        c.text(&field("error"), &f.error, false, limits.max_text_length);
        let outcome = match v1::FailOutcome::try_from(f.outcome) {
            Ok(v1::FailOutcome::Retry) => FailOutcome::Retry,
            Ok(v1::FailOutcome::Permanent) => FailOutcome::Permanent,
            Ok(v1::FailOutcome::Unknown) => FailOutcome::Unknown,
            Ok(v1::FailOutcome::Unspecified) | Err(_) => {
                c.fail(field("outcome"), "must be RETRY, PERMANENT or UNKNOWN");
                FailOutcome::Unknown
            }
        };
        let retry_after = c.duration(
            &field("retry_after"),
            f.retry_after.as_ref(),
            limits.max_delay,
        );
        if retry_after.is_some() && outcome != FailOutcome::Retry {
            c.fail(field("retry_after"), "applies only to the RETRY outcome");
        }
        failures.push(Failure {
            lease,
            error: f.error,
            outcome,
            retry_after,
        });
    }
    c.done(failures)
}

/// A validated Reconcile request.
#[derive(Debug, Clone)]
pub struct Reconcile {
    /// What to resolve.
    pub target: ReconcileTarget,
    /// The ruling.
    pub decision: Decision,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
}

/// Validates a Reconcile request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn reconcile(req: v1::ReconcileRequest, limits: &Limits) -> Result<Reconcile> {
    let mut c = Check::default();
    let decision = match v1::Decision::try_from(req.decision) {
        Ok(v1::Decision::Delivered) => Decision::Delivered,
        Ok(v1::Decision::Requeue) => Decision::Requeue,
        Ok(v1::Decision::Dead) => Decision::Dead,
        Ok(v1::Decision::Cancel) => Decision::Cancel,
        Ok(v1::Decision::Unspecified) | Err(_) => {
            c.fail("decision", "must be DELIVERED, REQUEUE, DEAD or CANCEL");
            Decision::Dead
        }
    };
    c.text("actor", &req.actor, true, limits.max_name_length);
    c.text("reason", &req.reason, true, limits.max_text_length);
    let target = match req.target {
        None => {
            c.fail("target", "give either ids or filter");
            ReconcileTarget::Ids(Vec::new(), Vec::new())
        }
        Some(v1::reconcile_request::Target::Ids(ids)) => {
            c.batch("ids.ids", ids.ids.len(), limits);
            let mut seen = HashSet::new();
            let ids_seen = ids
                .ids
                .iter()
                .take(limits.max_batch)
                .enumerate()
                .map(|(i, id)| {
                    let field = format!("ids.ids[{i}]");
                    let id = c.uuid(&field, id);
                    if !id.is_nil() && !seen.insert(id) {
                        c.fail(field, "repeats an id");
                    }
                    IntentId(id)
                })
                .collect();
            if req.limit != 0 {
                c.fail("limit", "applies only to a filter");
            }
            if !ids.updated_at.is_empty() && ids.updated_at.len() != ids.ids.len() {
                c.fail("ids.updated_at", "give none, or one per id");
            }
            let seen = ids
                .updated_at
                .iter()
                .take(limits.max_batch)
                .enumerate()
                .filter_map(|(i, t)| {
                    c.instant(
                        &format!("ids.updated_at[{i}]"),
                        t,
                        latest_after(Duration::MAX),
                        "must be a valid instant between the years 1 and 9999",
                    )
                })
                .collect();
            ReconcileTarget::Ids(ids_seen, seen)
        }
        Some(v1::reconcile_request::Target::Filter(filter)) => {
            let cancel = decision == Decision::Cancel;
            if filter.states.is_empty() {
                let states = if cancel {
                    "name STAGED, WAITING and/or PENDING"
                } else {
                    "name NEEDS_RECONCILE and/or DEAD_LETTERED"
                };
                c.fail("filter.states", states);
            }
            c.states_filter("filter.states", filter.states.len());
            let mut states = Vec::new();
            for (i, s) in filter.states.iter().take(MAX_STATES_IN_FILTER).enumerate() {
                let field = format!("filter.states[{i}]");
                match c.state(&field, *s) {
                    Some(s) if cancel && s.cancellable() => states.push(s),
                    Some(s) if cancel => c.fail(field, format!("{s} cannot be cancelled")),
                    Some(s) if s.awaits_decision() => states.push(s),
                    Some(s) => c.fail(field, format!("{s} does not await a decision")),
                    None => {}
                }
            }
            let states = dedup(states);
            c.name("filter.kind", &filter.kind, false, limits.max_name_length);
            c.name(
                "filter.region",
                &filter.region,
                false,
                limits.max_region_length,
            );
            let created_before = filter.created_before.as_ref().and_then(|t| {
                c.instant(
                    "filter.created_before",
                    t,
                    latest_after(Duration::MAX),
                    "must be a valid instant between the years 1 and 9999",
                )
            });
            let limit = page(&mut c, "limit", req.limit, DEFAULT_RECONCILE_LIMIT, limits);
            ReconcileTarget::Filter {
                states,
                kind: (!filter.kind.is_empty()).then_some(filter.kind),
                region: (!filter.region.is_empty()).then_some(filter.region),
                created_before,
                limit,
            }
        }
    };
    c.done(Reconcile {
        target,
        decision,
        actor: req.actor,
        reason: req.reason,
    })
}

fn page(c: &mut Check, field: &str, value: i32, default: usize, limits: &Limits) -> i64 {
    match value {
        0 => default.min(limits.max_batch) as i64,
        n if n < 0 => {
            c.fail(field, "must not be negative");
            0
        }
        n if n as usize > limits.max_batch => {
            c.limit(
                Reason::BatchTooLarge,
                field,
                format!("at most {}", limits.max_batch),
            );
            0
        }
        n => i64::from(n),
    }
}

/// Validates an intent id.
///
/// # Errors
/// [`Error::InvalidArgument`].
pub fn intent_id(field: &str, id: &str) -> Result<IntentId> {
    let mut c = Check::default();
    let id = c.uuid(field, id);
    c.done(IntentId(id))
}

/// A validated ListIntents request.
#[derive(Debug, Clone)]
pub struct List {
    /// States filter.
    pub states: Vec<IntentState>,
    /// Kind filter.
    pub kind: Option<String>,
    /// Region filter.
    pub region: Option<String>,
    /// Ordering key filter.
    pub ordering_key: Option<String>,
    /// Page size.
    pub limit: i64,
    /// Keyset cursor.
    pub after: Option<IntentId>,
    /// Include payloads.
    pub include_payload: bool,
    /// Only intents an operator can still decide on.
    pub awaiting_decision: bool,
}

/// Validates a ListIntents request.
///
/// # Errors
/// [`Error::InvalidArgument`] or [`Error::LimitExceeded`] naming every bad field.
pub fn list(req: v1::ListIntentsRequest, limits: &Limits) -> Result<List> {
    let mut c = Check::default();
    c.states_filter("states", req.states.len());
    let states = req
        .states
        .iter()
        .take(MAX_STATES_IN_FILTER)
        .enumerate()
        .filter_map(|(i, s)| c.state(&format!("states[{i}]"), *s))
        .collect();
    let mut states = dedup(states);
    if req.awaiting_decision {
        const DECIDABLE: [IntentState; 2] =
            [IntentState::NeedsReconcile, IntentState::DeadLettered];
        if states.is_empty() {
            states = DECIDABLE.to_vec();
        } else if states.iter().any(|s| !DECIDABLE.contains(s)) {
            c.fail(
                "states",
                "with awaiting_decision, only NEEDS_RECONCILE and DEAD_LETTERED",
            );
        }
    }
    c.name("kind", &req.kind, false, limits.max_name_length);
    c.name("region", &req.region, false, limits.max_region_length);
    c.text(
        "ordering_key",
        &req.ordering_key,
        false,
        limits.max_name_length,
    );
    let limit = page(
        &mut c,
        "page_size",
        req.page_size,
        DEFAULT_PAGE_SIZE,
        limits,
    );
    let after = if req.page_token.is_empty() {
        None
    } else {
        match Uuid::parse_str(&req.page_token) {
            Ok(id) => Some(IntentId(id)),
            Err(_) => {
                c.fail("page_token", "is not a token returned by ListIntents");
                None
            }
        }
    };
    c.done(List {
        states,
        kind: (!req.kind.is_empty()).then_some(req.kind),
        region: (!req.region.is_empty()).then_some(req.region),
        ordering_key: (!req.ordering_key.is_empty()).then_some(req.ordering_key),
        limit,
        after,
        include_payload: req.include_payload,
        awaiting_decision: req.awaiting_decision,
    })
}

/// A validated SetQueuePolicy request.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicyChange {
    /// The queue's kind.
    pub kind: String,
    /// No leases while set.
    pub paused: bool,
    /// Most intents in flight.
    pub max_in_flight: Option<i32>,
    /// Leases per second, and the bucket's size.
    pub rate: Option<(f64, i32)>,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// The `updated_at` of the policy the caller read: the change applies only to that
    /// version (None: to whatever policy the queue has).
    pub expected_updated_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Most leases per second a rate limit may allow (the database's CHECK).
const MAX_RATE_PER_SECOND: f64 = 1_000_000.0;

/// Fewest leases per second a rate limit may allow: one a day. A slower bucket's next
/// token would be further away than any wait is measured in.
const MIN_RATE_PER_SECOND: f64 = 1.0 / 86_400.0;

/// Validates a ListQueuePolicies request: the kind to list (None: every kind).
///
/// # Errors
/// [`Error::InvalidArgument`] when the kind is not a valid name.
pub fn queue_policies(
    req: v1::ListQueuePoliciesRequest,
    limits: &Limits,
) -> Result<(Option<String>, Option<PolicyCursor>)> {
    let mut c = Check::default();
    c.name("kind", &req.kind, false, limits.max_name_length);
    let after = if req.page_token.is_empty() {
        None
    } else {
        let cursor = PolicyCursor::from_token(&req.page_token);
        if cursor.is_none() {
            c.fail("page_token", "is not a token returned by ListQueuePolicies");
        }
        cursor
    };
    c.done(((!req.kind.is_empty()).then_some(req.kind), after))
}

/// Validates a SetQueuePolicy request.
///
/// # Errors
/// [`Error::InvalidArgument`] naming every bad field.
pub fn queue_policy(req: v1::SetQueuePolicyRequest, limits: &Limits) -> Result<QueuePolicyChange> {
    let mut c = Check::default();
    c.name("kind", &req.kind, true, limits.max_name_length);
    c.text("actor", &req.actor, true, limits.max_name_length);
    c.text("reason", &req.reason, true, limits.max_text_length);
    if req.max_in_flight < 0 {
        c.fail("max_in_flight", "must be at least 1 (0: no limit)");
    }
    let rate = req.rate_per_second;
    if !rate.is_finite()
        || !(rate == 0.0 || (MIN_RATE_PER_SECOND..=MAX_RATE_PER_SECOND).contains(&rate))
    {
        c.fail(
            "rate_per_second",
            format!(
                "must be 0 (no limit) or a number from 1/86400 (one a day) to \
                 {MAX_RATE_PER_SECOND}"
            ),
        );
    }
    if req.burst < 0 || (rate == 0.0 && req.burst != 0) {
        c.fail(
            "burst",
            "must be at least 1 with a rate, 0 without (0: the rate rounded up)",
        );
    }
    let rate = (rate > 0.0 && rate.is_finite()).then(|| {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "rate <= MAX_RATE_PER_SECOND fits an i32"
        )]
        let burst = if req.burst > 0 {
            req.burst
        } else {
            rate.ceil() as i32
        };
        (rate, burst.max(1))
    });
    let expected_updated_at = req.expected_updated_at.as_ref().and_then(|t| {
        c.instant(
            "expected_updated_at",
            t,
            latest_after(Duration::MAX),
            "must be a valid instant between the years 1 and 9999",
        )
    });
    c.done(QueuePolicyChange {
        kind: req.kind,
        paused: req.paused,
        max_in_flight: (req.max_in_flight > 0).then_some(req.max_in_flight),
        rate,
        actor: req.actor,
        reason: req.reason,
        expected_updated_at,
    })
}
