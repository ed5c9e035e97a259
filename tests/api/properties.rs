//! Property tests of the request validators (pure: no database, no server). No input
//! panics them, with the default limits or tiny ones, whether built field by field or
//! decoded from arbitrary bytes; and what they accept honours every limit.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outboxd::config::Limits;
use outboxd::outbox::store::ReconcileTarget;
use outboxd::outbox::{Error, FieldViolation, LeaseRef, Reason, Schedule};
use outboxd::proto::v1;
use outboxd::validate;
use proptest::collection::{hash_map, vec};
use proptest::prelude::*;
use prost::Message;

/// Limits small enough that generated input crosses every one of them.
fn tiny() -> Limits {
    Limits {
        max_batch: 2,
        max_payload_bytes: 4,
        max_message_bytes: 4,
        max_reply_bytes: 4,
        max_headers: 1,
        max_header_key_length: 3,
        max_header_value_length: 3,
        max_name_length: 4,
        max_region_length: 2,
        max_text_length: 5,
        max_kinds: 1,
        max_delay: Duration::from_secs(10),
        default_lease: Duration::from_secs(1),
        max_lease: Duration::from_secs(2),
        max_wait: Duration::from_secs(1),
        default_max_attempts: 1,
        operator_timeout: Duration::from_secs(1),
        max_connections: 1,
        max_http_connections: 1,
    }
}

fn both_limits() -> [Limits; 2] {
    [Limits::default(), tiny()]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        // Failures are shrunk; no need to persist regressions next to the test binary.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- strategies ----------------------------------------------------------------------

/// Strings that hit every rule: names, unicode, control characters and NUL, UUIDs (nil
/// included), tokens, and long ones.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z0-9._:/-]{0,6}",
        2 => any::<String>(),
        1 => "\\PC{0,8}",
        1 => "[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}a]{1,4}",
        1 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        1 => Just(uuid::Uuid::nil().to_string()),
        1 => "v1\\.[0-9]{0,21}\\.[0-9+]{0,21}",
        1 => "[a-zé]{190,260}",
        1 => Just(String::new()),
    ]
}

/// Mostly `valid`, sometimes anything: accepted requests must be common enough that the
/// "accepted input honours the limits" checks run (see `generators_reach_acceptance`).
fn mostly(valid: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    prop_oneof![3 => valid, 1 => text()]
}

fn name_like() -> impl Strategy<Value = String> {
    mostly("[a-z][a-z0-9._:/-]{0,3}")
}

fn region_like() -> impl Strategy<Value = String> {
    mostly(prop_oneof![Just(String::new()), "[a-z]{1,2}".boxed()])
}

fn printable_text() -> impl Strategy<Value = String> {
    mostly("[^\\p{Cc}]{0,4}")
}

fn optional_printable() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), printable_text().boxed()]
}

fn small_i32() -> impl Strategy<Value = i32> {
    prop_oneof![3 => -2..12i32, 1 => any::<i32>(), 1 => Just(i32::MIN), 1 => Just(i32::MAX)]
}

fn seconds() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => -5..100_000i64,
        1 => any::<i64>(),
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
        1 => Just(-62_135_596_801i64),
        1 => Just(253_402_300_800i64),
    ]
}

fn nanos() -> impl Strategy<Value = i32> {
    prop_oneof![
        3 => 0..1_000_000_000i32,
        1 => any::<i32>(),
        1 => Just(1_000_000_000i32),
        1 => Just(-1i32),
    ]
}

fn duration() -> impl Strategy<Value = Option<prost_types::Duration>> {
    proptest::option::of(
        (seconds(), nanos()).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
    )
}

fn timestamp() -> impl Strategy<Value = prost_types::Timestamp> {
    (seconds(), nanos()).prop_map(|(seconds, nanos)| prost_types::Timestamp { seconds, nanos })
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![3 => vec(any::<u8>(), 0..8), 1 => vec(any::<u8>(), 0..64)]
}

fn new_intent() -> impl Strategy<Value = v1::NewIntent> {
    let schedule = proptest::option::of(prop_oneof![
        duration()
            .prop_filter_map("set", |d| d)
            .prop_map(v1::new_intent::Schedule::Delay),
        timestamp().prop_map(v1::new_intent::Schedule::AvailableAt),
    ]);
    (
        (
            name_like(),
            payload(),
            optional_printable(),
            region_like(),
            optional_printable(),
            optional_printable(),
        ),
        prop_oneof![
            3 => hash_map("[a-z]{1,3}", "[a-z ]{0,3}", 0..2),
            1 => hash_map(text(), text(), 0..4),
        ],
        (
            prop_oneof![3 => 0..4i32, 1 => small_i32()],
            prop_oneof![3 => -12..12i32, 1 => small_i32()],
        ),
        prop_oneof![
            2 => Just(None),
            1 => (0..5i64).prop_map(|s| Some(v1::new_intent::Schedule::Delay(pd(s, 0)))),
            1 => schedule,
        ],
    )
        .prop_map(
            |(
                (kind, payload, content_type, region, idempotency_key, ordering_key),
                headers,
                (max_attempts, priority),
                schedule,
            )| {
                v1::NewIntent {
                    kind,
                    payload,
                    content_type,
                    region,
                    idempotency_key,
                    ordering_key,
                    priority,
                    headers,
                    max_attempts,
                    schedule,
                }
            },
        )
}

fn pd(seconds: i64, nanos: i32) -> prost_types::Duration {
    prost_types::Duration { seconds, nanos }
}

fn enqueue_request() -> impl Strategy<Value = v1::EnqueueRequest> {
    let token = prop_oneof![3 => Just(String::new()), 1 => text()];
    (
        prop_oneof![3 => vec(new_intent(), 1..3), 1 => vec(new_intent(), 0..5)],
        token,
    )
        .prop_map(|(intents, txn_token)| v1::EnqueueRequest { intents, txn_token })
}

fn claim_request() -> impl Strategy<Value = v1::ClaimRequest> {
    let short = prop_oneof![
        2 => Just(None),
        2 => (0..2i64, 0..1_000_000_000i32).prop_map(|(s, n)| Some(pd(s, n))),
        1 => duration(),
    ];
    (
        (
            printable_text(),
            region_like(),
            prop_oneof![3 => vec(name_like(), 0..2), 1 => vec(text(), 0..4)],
        ),
        prop_oneof![3 => 1..3i32, 1 => small_i32()],
        short.clone(),
        short,
        optional_printable(),
    )
        .prop_map(
            |((worker_id, region, kinds), max_intents, lease_duration, wait, request_id)| {
                v1::ClaimRequest {
                    worker_id,
                    region,
                    kinds,
                    max_intents,
                    lease_duration,
                    wait,
                    request_id,
                }
            },
        )
}

fn uuid_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        // A few distinct ids, so batches repeat them.
        1 => (1u128..4).prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        1 => text(),
    ]
}

fn lease_ref() -> impl Strategy<Value = v1::LeaseRef> {
    (uuid_text(), uuid_text()).prop_map(|(intent_id, lease_id)| v1::LeaseRef {
        intent_id,
        lease_id,
    })
}

fn lease_refs() -> impl Strategy<Value = Vec<v1::LeaseRef>> {
    prop_oneof![3 => vec(lease_ref(), 1..3), 1 => vec(lease_ref(), 0..5)]
}

fn fail_request() -> impl Strategy<Value = v1::FailRequest> {
    let failure = (
        prop_oneof![3 => lease_ref().prop_map(Some), 1 => Just(None)],
        optional_printable(),
        prop_oneof![3 => 1..4i32, 1 => small_i32()],
        prop_oneof![3 => Just(None), 1 => duration()],
    )
        .prop_map(|(lease, error, outcome, retry_after)| v1::Failure {
            lease,
            error,
            outcome,
            retry_after,
        });
    let failure = failure.boxed();
    prop_oneof![3 => vec(failure.clone(), 1..3), 1 => vec(failure, 0..5)]
        .prop_map(|failures| v1::FailRequest { failures })
}

fn reconcile_request() -> impl Strategy<Value = v1::ReconcileRequest> {
    let target = proptest::option::weighted(
        0.9,
        prop_oneof![
            prop_oneof![3 => vec(uuid_text(), 1..3), 1 => vec(uuid_text(), 0..5)].prop_map(|ids| {
                v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                    ids,
                    ..Default::default()
                })
            }),
            (
                prop_oneof![3 => vec(6..8i32, 1..3), 1 => vec(small_i32(), 0..4)],
                prop_oneof![Just(String::new()), name_like().boxed()],
                region_like(),
                proptest::option::of(timestamp())
            )
                .prop_map(|(states, kind, region, created_before)| {
                    v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                        states,
                        kind,
                        region,
                        created_before,
                    })
                }),
        ],
    );
    (
        target,
        prop_oneof![3 => 1..4i32, 1 => small_i32()],
        printable_text(),
        printable_text(),
        prop_oneof![3 => Just(0), 1 => small_i32()],
    )
        .prop_map(
            |(target, decision, actor, reason, limit)| v1::ReconcileRequest {
                target,
                decision,
                actor,
                reason,
                limit,
            },
        )
}

fn list_request() -> impl Strategy<Value = v1::ListIntentsRequest> {
    (
        prop_oneof![3 => vec(1..9i32, 0..3), 1 => vec(small_i32(), 0..4)],
        prop_oneof![Just(String::new()), name_like().boxed()],
        region_like(),
        prop_oneof![3 => 0..3i32, 1 => small_i32()],
        prop_oneof![Just(String::new()), uuid_text().boxed()],
        any::<bool>(),
        optional_printable(),
        any::<bool>(),
    )
        .prop_map(
            |(
                states,
                kind,
                region,
                page_size,
                page_token,
                include_payload,
                ordering_key,
                awaiting_decision,
            )| {
                v1::ListIntentsRequest {
                    states,
                    kind,
                    region,
                    page_size,
                    page_token,
                    include_payload,
                    ordering_key,
                    awaiting_decision,
                }
            },
        )
}

// ---- what accepted input must satisfy -------------------------------------------------

fn printable(s: &str, max: usize) -> bool {
    s.chars().count() <= max && !s.chars().any(char::is_control)
}

fn name(s: &str, max: usize) -> bool {
    outboxd::outbox::is_name(s, max)
}

fn std_duration(d: &prost_types::Duration) -> Duration {
    Duration::new(d.seconds as u64, d.nanos as u32)
}

/// A rejection is INVALID_ARGUMENT or a limit, names at least one violation, and stays
/// small whatever the input.
fn check_rejection(e: &Error) {
    let violations: &[FieldViolation] = match e {
        Error::InvalidArgument(v) => v,
        Error::LimitExceeded(reason, v) => {
            assert!(
                matches!(reason, Reason::PayloadTooLarge | Reason::BatchTooLarge),
                "{e}"
            );
            v
        }
        other => panic!("validators only reject with InvalidArgument or LimitExceeded: {other}"),
    };
    assert!(!violations.is_empty(), "{e}");
    assert!(violations.len() <= 33, "{} violations", violations.len());
    let bytes: usize = violations
        .iter()
        .map(|v| v.field.len() + v.description.len())
        .sum();
    assert!(bytes <= 8192, "{bytes} bytes of violations");
    // As a client receives it: grpcio drops a call whose metadata passes 8 KiB (each entry
    // counted as its name, value and 32 bytes), the response's own headers included.
    let same = match e {
        Error::InvalidArgument(v) => Error::InvalidArgument(v.clone()),
        Error::LimitExceeded(reason, v) => Error::LimitExceeded(*reason, v.clone()),
        _ => unreachable!(),
    };
    let status = tonic::Status::from(same);
    let response = status.into_http::<()>();
    let metadata: usize = response
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum();
    assert!(metadata <= 7 * 1024, "{metadata} bytes of trailers");
}

fn check_lease_refs(refs: &[LeaseRef], limits: &Limits) {
    assert!((1..=limits.max_batch).contains(&refs.len()));
    let mut seen = HashSet::new();
    for r in refs {
        assert!(!r.intent_id.0.is_nil() && !r.lease_id.0.is_nil());
        assert!(seen.insert(r.intent_id.0), "duplicate intent accepted");
    }
}

fn check_enqueue(req: &v1::EnqueueRequest, limits: &Limits) {
    match validate::enqueue(req.clone(), limits) {
        Err(e) => check_rejection(&e),
        Ok((intents, token)) => {
            assert_eq!(intents.len(), req.intents.len());
            assert!((1..=limits.max_batch).contains(&intents.len()));
            assert_eq!(token.is_some(), !req.txn_token.is_empty());
            let mut keys = HashSet::new();
            for i in &intents {
                assert!(name(&i.kind, limits.max_name_length), "{:?}", i.kind);
                assert!(i.region.is_empty() || name(&i.region, limits.max_region_length));
                assert!(i.payload.len() <= limits.max_payload_bytes);
                assert!(printable(&i.content_type, limits.max_name_length));
                if let Some(key) = &i.idempotency_key {
                    assert!(!key.is_empty() && printable(key, limits.max_name_length));
                    assert!(keys.insert(key.clone()), "duplicate key accepted");
                }
                assert!(i.headers.len() <= limits.max_headers);
                for (k, v) in &i.headers {
                    assert!(name(k, limits.max_header_key_length), "{k:?}");
                    assert!(printable(v, limits.max_header_value_length), "{v:?}");
                }
                assert!((1..=1000).contains(&i.max_attempts));
                assert!((-10..=10).contains(&i.priority));
                match i.schedule {
                    Schedule::Now => {}
                    Schedule::Delay(d) => assert!(d <= limits.max_delay),
                    Schedule::At(at) => {
                        let latest = chrono::Utc::now()
                            + chrono::TimeDelta::from_std(limits.max_delay).unwrap();
                        assert!(at <= latest && at.timestamp() >= -62_135_596_800, "{at}");
                    }
                }
            }
        }
    }
}

fn check_claim(req: &v1::ClaimRequest, limits: &Limits) {
    match validate::claim(req.clone(), limits) {
        Err(e) => check_rejection(&e),
        Ok(c) => {
            assert!(!c.worker_id.is_empty() && printable(&c.worker_id, limits.max_name_length));
            assert!(c.region.is_empty() || name(&c.region, limits.max_region_length));
            assert!(c.kinds.len() <= limits.max_kinds);
            assert!(c.kinds.iter().all(|k| name(k, limits.max_name_length)));
            assert!(c.max_intents >= 1 && c.max_intents as usize <= limits.max_batch);
            assert!(c.lease_duration >= Duration::from_millis(1));
            assert!(c.lease_duration <= limits.max_lease.max(limits.default_lease));
            assert!(c.wait <= limits.max_wait);
            if let Some(id) = &c.request_id {
                assert!(!id.is_empty() && printable(id, limits.max_name_length));
            }
        }
    }
}

fn check_leases(leases: &[v1::LeaseRef], limits: &Limits) {
    match validate::leases(leases, limits) {
        Err(e) => check_rejection(&e),
        Ok(refs) => check_lease_refs(&refs, limits),
    }
    let extend = v1::ExtendLeaseRequest {
        leases: leases.to_vec(),
        lease_duration: Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        }),
    };
    match validate::extend(&extend, limits) {
        Err(e) => check_rejection(&e),
        Ok((refs, d)) => {
            check_lease_refs(&refs, limits);
            assert!(d <= limits.max_lease);
        }
    }
}

fn check_extend(req: &v1::ExtendLeaseRequest, limits: &Limits) {
    match validate::extend(req, limits) {
        Err(e) => check_rejection(&e),
        Ok((refs, d)) => {
            check_lease_refs(&refs, limits);
            assert!(d >= Duration::from_millis(1));
            match &req.lease_duration {
                Some(asked) => assert_eq!(d, std_duration(asked)),
                None => assert_eq!(d, limits.default_lease),
            }
            assert!(d <= limits.max_lease.max(limits.default_lease));
        }
    }
}

fn check_fail(req: &v1::FailRequest, limits: &Limits) {
    match validate::fail(req.clone(), limits) {
        Err(e) => check_rejection(&e),
        Ok(failures) => {
            let refs: Vec<LeaseRef> = failures.iter().map(|f| f.lease).collect();
            check_lease_refs(&refs, limits);
            for f in &failures {
                assert!(printable(&f.error, limits.max_text_length));
                if let Some(d) = f.retry_after {
                    assert!(d <= limits.max_delay);
                    assert_eq!(f.outcome, outboxd::outbox::FailOutcome::Retry);
                }
            }
        }
    }
}

fn check_reconcile(req: &v1::ReconcileRequest, limits: &Limits) {
    match validate::reconcile(req.clone(), limits) {
        Err(e) => check_rejection(&e),
        Ok(r) => {
            assert!(!r.actor.is_empty() && printable(&r.actor, limits.max_name_length));
            assert!(!r.reason.is_empty() && printable(&r.reason, limits.max_text_length));
            match r.target {
                ReconcileTarget::Ids(ids, _) => {
                    assert!((1..=limits.max_batch).contains(&ids.len()));
                    let unique: HashSet<_> = ids.iter().map(|i| i.0).collect();
                    assert_eq!(unique.len(), ids.len());
                    assert!(ids.iter().all(|i| !i.0.is_nil()));
                }
                ReconcileTarget::Filter {
                    states,
                    kind,
                    region,
                    created_before,
                    limit,
                } => {
                    assert!(!states.is_empty() && states.iter().all(|s| s.awaits_decision()));
                    assert!(kind.is_none_or(|k| name(&k, limits.max_name_length)));
                    assert!(region.is_none_or(|r| name(&r, limits.max_region_length)));
                    assert!(created_before.is_none_or(|t| t.timestamp() >= -62_135_596_800));
                    assert!(limit >= 1 && limit as usize <= limits.max_batch);
                }
            }
        }
    }
}

fn check_list(req: &v1::ListIntentsRequest, limits: &Limits) {
    match validate::list(req.clone(), limits) {
        Err(e) => check_rejection(&e),
        Ok(l) => {
            assert!(l.states.len() <= 8);
            assert!(l.kind.is_none_or(|k| name(&k, limits.max_name_length)));
            assert!(l.region.is_none_or(|r| name(&r, limits.max_region_length)));
            assert!(l.limit >= 1 && l.limit as usize <= limits.max_batch);
            if l.awaiting_decision {
                assert!(!l.states.is_empty());
                assert!(l.states.iter().all(|s| matches!(
                    s,
                    outboxd::outbox::IntentState::NeedsReconcile
                        | outboxd::outbox::IntentState::DeadLettered
                )));
            }
        }
    }
}

fn check_intent_id(id: &str) {
    match validate::intent_id("id", id) {
        Err(e) => check_rejection(&e),
        Ok(id) => assert!(!id.0.is_nil()),
    }
}

// ---- properties -----------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn enqueue_validation_never_panics_and_accepts_only_what_fits(req in enqueue_request()) {
        for limits in both_limits() {
            check_enqueue(&req, &limits);
        }
    }

    #[test]
    fn claim_validation_never_panics_and_accepts_only_what_fits(req in claim_request()) {
        for limits in both_limits() {
            check_claim(&req, &limits);
        }
    }

    #[test]
    fn lease_validation_never_panics_and_accepts_only_what_fits(
        leases in lease_refs(),
        lease_duration in duration(),
    ) {
        for limits in both_limits() {
            check_leases(&leases, &limits);
            check_extend(&v1::ExtendLeaseRequest { leases: leases.clone(), lease_duration }, &limits);
        }
    }

    #[test]
    fn fail_validation_never_panics_and_accepts_only_what_fits(req in fail_request()) {
        for limits in both_limits() {
            check_fail(&req, &limits);
        }
    }

    #[test]
    fn reconcile_validation_never_panics_and_accepts_only_what_fits(req in reconcile_request()) {
        for limits in both_limits() {
            check_reconcile(&req, &limits);
        }
    }

    #[test]
    fn list_and_get_validation_never_panic_and_accept_only_what_fits(
        req in list_request(),
        id in uuid_text(),
    ) {
        for limits in both_limits() {
            check_list(&req, &limits);
        }
        check_intent_id(&id);
    }

    #[test]
    fn arbitrary_bytes_decoded_as_any_request_never_panic_the_validators(
        bytes in vec(any::<u8>(), 0..256),
    ) {
        decode_and_validate(&bytes);
    }

    #[test]
    fn corrupted_encodings_of_real_requests_never_panic_the_validators(
        req in enqueue_request(),
        claim in claim_request(),
        fail in fail_request(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        for mut bytes in [req.encode_to_vec(), claim.encode_to_vec(), fail.encode_to_vec()] {
            if bytes.is_empty() {
                continue;
            }
            for (at, value) in &edits {
                let i = at.index(bytes.len());
                bytes[i] = *value;
            }
            decode_and_validate(&bytes);
            decode_and_validate(&bytes[..cut.index(bytes.len())]);
        }
    }
}

/// Decodes `bytes` as every request type and validates what decodes.
fn decode_and_validate(bytes: &[u8]) {
    for limits in both_limits() {
        if let Ok(r) = v1::EnqueueRequest::decode(bytes) {
            check_enqueue(&r, &limits);
        }
        if let Ok(r) = v1::ClaimRequest::decode(bytes) {
            check_claim(&r, &limits);
        }
        if let Ok(r) = v1::ExtendLeaseRequest::decode(bytes) {
            check_extend(&r, &limits);
        }
        if let Ok(r) = v1::AckRequest::decode(bytes) {
            check_leases(&r.leases, &limits);
        }
        if let Ok(r) = v1::MarkSubmittedRequest::decode(bytes) {
            check_leases(&r.leases, &limits);
        }
        if let Ok(r) = v1::FailRequest::decode(bytes) {
            check_fail(&r, &limits);
        }
        if let Ok(r) = v1::ReconcileRequest::decode(bytes) {
            check_reconcile(&r, &limits);
        }
        if let Ok(r) = v1::ListIntentsRequest::decode(bytes) {
            check_list(&r, &limits);
        }
    }
    if let Ok(r) = v1::GetIntentRequest::decode(bytes) {
        check_intent_id(&r.id);
    }
}

/// Deterministic edge cases the strategies might take long to hit.
#[test]
fn extreme_durations_and_instants_are_rejected_not_panicked_on() {
    let limits = Limits::default();
    for (seconds, nanos) in [
        (i64::MAX, 999_999_999),
        (i64::MIN, 0),
        (0, -1),
        (0, 1_000_000_000),
        (-1, 999_999_999),
        (i64::MAX, i32::MAX),
    ] {
        let d = Some(prost_types::Duration { seconds, nanos });
        let claim = v1::ClaimRequest {
            worker_id: "w".into(),
            max_intents: 1,
            lease_duration: d,
            wait: d,
            ..Default::default()
        };
        assert!(validate::claim(claim, &limits).is_err());
    }
    for (seconds, nanos) in [
        (i64::MAX, 0),
        (i64::MIN, 0),
        (0, -1),
        (0, 1_000_000_000),
        // Year -10000: fine for chrono, out of range for PostgreSQL.
        (-377_705_116_800, 0),
        // One second before the year 1.
        (-62_135_596_801, 0),
        // The year 10000.
        (253_402_300_800, 0),
    ] {
        let t = prost_types::Timestamp { seconds, nanos };
        let enqueue = v1::EnqueueRequest {
            intents: vec![v1::NewIntent {
                kind: "k".into(),
                schedule: Some(v1::new_intent::Schedule::AvailableAt(t)),
                ..Default::default()
            }],
            txn_token: String::new(),
        };
        assert!(validate::enqueue(enqueue, &limits).is_err(), "{t:?}");
        let reconcile = v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Filter(v1::ReconcileFilter {
                states: vec![v1::IntentState::NeedsReconcile as i32],
                created_before: Some(t),
                ..Default::default()
            })),
            decision: v1::Decision::Dead as i32,
            actor: "a".into(),
            reason: "r".into(),
            limit: 0,
        };
        assert!(validate::reconcile(reconcile, &limits).is_err(), "{t:?}");
    }
    // A lease under a millisecond would expire as it is granted.
    let claim = v1::ClaimRequest {
        worker_id: "w".into(),
        max_intents: 1,
        lease_duration: Some(prost_types::Duration {
            seconds: 0,
            nanos: 999_999,
        }),
        ..Default::default()
    };
    assert!(validate::claim(claim, &limits).is_err());
}

/// A thousand bad intents still give a bounded error: every client can receive it.
#[test]
fn errors_stay_small_however_many_fields_are_wrong() {
    let limits = Limits::default();
    let intents = (0..limits.max_batch)
        .map(|_| v1::NewIntent {
            kind: "bad kind\0".into(),
            headers: HashMap::from([("é".repeat(5000), "\0".into())]),
            ..Default::default()
        })
        .collect();
    let e = validate::enqueue(
        v1::EnqueueRequest {
            intents,
            txn_token: String::new(),
        },
        &limits,
    )
    .unwrap_err();
    check_rejection(&e);
    let Error::InvalidArgument(violations) = &e else {
        panic!("{e}")
    };
    let last = violations.last().unwrap();
    assert!(
        last.description.ends_with("more violations not listed"),
        "{last:?}"
    );
    assert!(e.to_string().len() < 8192, "{} bytes", e.to_string().len());

    // Long values quoted in every description: 1000 leases of malformed ids.
    let leases: Vec<v1::LeaseRef> = (0..limits.max_batch)
        .map(|n| v1::LeaseRef {
            intent_id: format!("not-a-uuid-{n}-{}", "x".repeat(40)),
            lease_id: format!("not-a-uuid-either-{n}-{}", "é".repeat(20)),
        })
        .collect();
    check_rejection(&validate::leases(&leases, &limits).unwrap_err());
}

/// The generators are biased towards valid input: with the default limits a fair share of
/// what they produce is accepted, so the checks on accepted input above really run.
#[test]
fn generators_reach_acceptance() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn accepted<T: std::fmt::Debug>(
        strategy: impl Strategy<Value = T>,
        ok: impl Fn(T) -> bool,
    ) -> usize {
        let mut runner = TestRunner::deterministic();
        (0..256)
            .filter(|_| ok(strategy.new_tree(&mut runner).unwrap().current()))
            .count()
    }
    let l = Limits::default();
    let counts = [
        (
            "enqueue",
            accepted(enqueue_request(), |r| validate::enqueue(r, &l).is_ok()),
        ),
        (
            "claim",
            accepted(claim_request(), |r| validate::claim(r, &l).is_ok()),
        ),
        (
            "leases",
            accepted(lease_refs(), |r| validate::leases(&r, &l).is_ok()),
        ),
        (
            "fail",
            accepted(fail_request(), |r| validate::fail(r, &l).is_ok()),
        ),
        (
            "reconcile",
            accepted(reconcile_request(), |r| validate::reconcile(r, &l).is_ok()),
        ),
        (
            "list",
            accepted(list_request(), |r| validate::list(r, &l).is_ok()),
        ),
    ];
    for (name, count) in counts {
        eprintln!("{name}: {count}/256 accepted");
        assert!(
            count >= 16,
            "{name}: only {count}/256 generated requests accepted"
        );
    }
}

/// The OUTBOX_LIMITS__* variables reach `Limits`, and inconsistent ones are all refused.
#[test]
fn limit_variables_override_defaults_and_inconsistent_ones_are_refused() {
    use outboxd::config::Settings;
    let vars = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
    };
    let s = Settings::from_vars(vars(&[
        ("OUTBOX_LIMITS__MAX_MESSAGE_BYTES", "4194304"),
        ("OUTBOX_LIMITS__MAX_REPLY_BYTES", "8388608"),
        ("OUTBOX_LIMITS__MAX_HEADERS", "8"),
        ("OUTBOX_LIMITS__MAX_HEADER_KEY_LENGTH", "16"),
        ("OUTBOX_LIMITS__MAX_HEADER_VALUE_LENGTH", "100"),
        ("OUTBOX_LIMITS__MAX_NAME_LENGTH", "64"),
        ("OUTBOX_LIMITS__MAX_REGION_LENGTH", "16"),
        ("OUTBOX_LIMITS__MAX_TEXT_LENGTH", "512"),
        ("OUTBOX_LIMITS__MAX_KINDS", "10"),
        ("OUTBOX_LIMITS__MAX_DELAY", "7d"),
    ]))
    .unwrap();
    let expected = Limits {
        max_message_bytes: 4 * 1024 * 1024,
        max_reply_bytes: 8 * 1024 * 1024,
        max_headers: 8,
        max_header_key_length: 16,
        max_header_value_length: 100,
        max_name_length: 64,
        max_region_length: 16,
        max_text_length: 512,
        max_kinds: 10,
        max_delay: Duration::from_secs(7 * 86_400),
        ..Limits::default()
    };
    assert_eq!(s.limits, expected);

    let err = Settings::from_vars(vars(&[
        ("OUTBOX_LIMITS__MAX_MESSAGE_BYTES", "1000"),
        ("OUTBOX_LIMITS__MAX_REPLY_BYTES", "1000"),
        ("OUTBOX_LIMITS__MAX_NAME_LENGTH", "1000"),
        ("OUTBOX_LIMITS__MAX_REGION_LENGTH", "0"),
        ("OUTBOX_LIMITS__MAX_KINDS", "0"),
        ("OUTBOX_LIMITS__MAX_DELAY", "100000d"),
        ("OUTBOX_LEASE__MAX", "5000d"),
        ("OUTBOX_RETRY__CAP", "100000d"),
    ]))
    .unwrap_err();
    for variable in [
        "OUTBOX_LIMITS__MAX_MESSAGE_BYTES",
        "OUTBOX_LIMITS__MAX_REPLY_BYTES",
        "OUTBOX_LIMITS__MAX_NAME_LENGTH",
        "OUTBOX_LIMITS__MAX_REGION_LENGTH",
        "OUTBOX_LIMITS__MAX_KINDS",
        "OUTBOX_LIMITS__MAX_DELAY",
        "OUTBOX_LEASE__MAX",
        "OUTBOX_RETRY__CAP",
    ] {
        assert!(
            err.0.iter().any(|e| e.starts_with(variable)),
            "{variable} not refused: {err}"
        );
    }
}
