//! Generated gRPC types (`outbox.v1`) and the conversions from domain types to wire types.
//! Conversions from wire to domain, which validate, live in `crate::validate`.

use chrono::{DateTime, Utc};

use crate::outbox::{
    self, Decision, Enqueued, Intent, IntentState, ItemError, ItemResult, Resolution,
};

/// Code generated from `proto/outbox/v1/outbox.proto`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::allow_attributes_without_reason,
    reason = "generated code"
)]
pub mod v1 {
    tonic::include_proto!("outbox.v1");
}

/// Encoded descriptors of the API, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/outbox_descriptor.bin"));

/// The descriptors reflection serves: the API's, and the `google.rpc` error details every
/// error carries (`ErrorInfo`, `BadRequest`, …) as `google/rpc/error_details.proto`, which
/// the API's file is given as a dependency. Reflection clients (buf curl, grpcurl) decode
/// only types they reach from the service's file through its dependencies, and showed
/// the details as base64 when merely registered beside it. The proto itself does not
/// import them: that would make every generated SDK depend on googleapis' types.
///
/// # Errors
/// A descriptor set that does not decode (a build gone wrong).
pub fn reflection_descriptors() -> Result<Vec<u8>, prost::DecodeError> {
    use prost::Message;
    let mut api = prost_types::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET)?;
    let details = prost_types::FileDescriptorSet::decode(tonic_types::pb::FILE_DESCRIPTOR_SET)?;
    // tonic-types names its files without their googleapis directory.
    let canonical = |name: &str| match name {
        "error_details.proto" | "status.proto" => format!("google/rpc/{name}"),
        other => other.to_owned(),
    };
    for mut file in details.file {
        file.name = Some(canonical(file.name()));
        for dependency in &mut file.dependency {
            *dependency = canonical(dependency);
        }
        if !api.file.iter().any(|f| f.name == file.name) {
            api.file.push(file);
        }
    }
    for file in &mut api.file {
        if file.package() == "outbox.v1" {
            for needed in ["google/rpc/error_details.proto", "google/rpc/status.proto"] {
                file.dependency.push(needed.to_owned());
            }
        }
    }
    Ok(api.encode_to_vec())
}

/// Wire form of a timestamp.
pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

/// Domain form of a wire timestamp; `None` when out of chrono's range or when `nanos` is
/// not in 0..=999,999,999 as protobuf requires (chrono would read 1e9 and above as a leap
/// second, and store the next second).
pub fn from_timestamp(t: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    let nanos = u32::try_from(t.nanos).ok().filter(|n| *n < 1_000_000_000)?;
    DateTime::from_timestamp(t.seconds, nanos)
}

/// At most how many bytes `intent` takes in a reply: in a `ClaimResponse` as its
/// [`v1::Lease`] (in a `ListIntentsResponse`, as a bare [`v1::Intent`], fewer), the repeated
/// field's tag and length included; its variable parts as they are, its fixed ones at their
/// largest. An upper bound, so that a reply cut by it never passes its budget, read from the
/// domain type so that only a reply's size, not a copy of it, is computed.
pub fn reply_bytes_at_most(i: &Intent) -> usize {
    // A length-delimited field: a tag (2 bytes for field numbers up to 2047) and a varint
    // length (up to 10 bytes); varints up to 10 bytes; a Timestamp, two varints.
    const FIELD: usize = 2 + 10;
    const VARINT: usize = 2 + 10;
    const TIMESTAMP: usize = FIELD + 2 * VARINT;
    const UUID: usize = FIELD + 36;
    // Lease: the repeated field, the intent, lease_id, attempt, lease_expires_at.
    const LEASE: usize = FIELD + FIELD + UUID + VARINT + TIMESTAMP;
    // Intent: id, state, attempts, max_attempts and four timestamps.
    const INTENT: usize = UUID + 3 * VARINT + 4 * TIMESTAMP;
    let bytes = |s: usize| FIELD + s;
    let headers: usize = i
        .headers
        .0
        .iter()
        .map(|(k, v)| FIELD + bytes(k.len()) + bytes(v.len()))
        .sum();
    LEASE
        + INTENT
        + bytes(i.kind.len())
        + bytes(i.payload.len())
        + bytes(i.content_type.len())
        + bytes(i.region.len())
        + bytes(i.idempotency_key.as_ref().map_or(0, String::len))
        + headers
        + bytes(i.worker_id.as_ref().map_or(0, String::len))
        + bytes(i.last_error.as_ref().map_or(0, String::len))
        + bytes(i.ordering_key.as_ref().map_or(0, String::len))
        + bytes(i.tenant.len())
}

impl From<IntentState> for v1::IntentState {
    fn from(s: IntentState) -> Self {
        match s {
            IntentState::Staged => Self::Staged,
            IntentState::Pending => Self::Pending,
            IntentState::Leased => Self::Leased,
            IntentState::Submitted => Self::Submitted,
            IntentState::Delivered => Self::Delivered,
            IntentState::NeedsReconcile => Self::NeedsReconcile,
            IntentState::DeadLettered => Self::DeadLettered,
            IntentState::Discarded => Self::Discarded,
            IntentState::Waiting => Self::Waiting,
            IntentState::Cancelled => Self::Cancelled,
        }
    }
}

impl From<Decision> for v1::Decision {
    fn from(d: Decision) -> Self {
        match d {
            Decision::Delivered => Self::Delivered,
            Decision::Requeue => Self::Requeue,
            Decision::Dead => Self::Dead,
            Decision::Cancel => Self::Cancel,
        }
    }
}

fn state(s: IntentState) -> i32 {
    v1::IntentState::from(s) as i32
}

impl From<Intent> for v1::Intent {
    fn from(i: Intent) -> Self {
        Self {
            id: i.id.to_string(),
            state: state(i.state),
            kind: i.kind,
            payload: i.payload,
            content_type: i.content_type,
            region: i.region,
            idempotency_key: i.idempotency_key.unwrap_or_default(),
            headers: i.headers.0.into_iter().collect(),
            attempts: i.attempts,
            max_attempts: i.max_attempts,
            available_at: Some(timestamp(i.available_at)),
            created_at: Some(timestamp(i.created_at)),
            updated_at: Some(timestamp(i.updated_at)),
            lease_expires_at: i.lease_expires_at.map(timestamp),
            worker_id: i.worker_id.unwrap_or_default(),
            last_error: i.last_error.unwrap_or_default(),
            ordering_key: i.ordering_key.unwrap_or_default(),
            priority: i32::from(i.priority),
            tenant: i.tenant,
        }
    }
}

/// A claimed intent as a lease; the claim always sets the lease columns.
impl From<Intent> for v1::Lease {
    fn from(i: Intent) -> Self {
        Self {
            lease_id: i.lease_id.map(|l| l.to_string()).unwrap_or_default(),
            attempt: i.attempts,
            lease_expires_at: i.lease_expires_at.map(timestamp),
            intent: Some(i.into()),
        }
    }
}

impl From<Enqueued> for v1::EnqueueResult {
    fn from(e: Enqueued) -> Self {
        Self {
            id: e.id.to_string(),
            state: state(e.state),
            deduplicated: e.deduplicated,
        }
    }
}

impl From<ItemError> for v1::ItemError {
    fn from(e: ItemError) -> Self {
        Self {
            code: crate::status::code_of(e.reason) as i32,
            reason: e.reason.as_str().to_owned(),
            message: e.message,
        }
    }
}

impl From<ItemResult> for v1::LeaseResult {
    fn from(r: ItemResult) -> Self {
        Self {
            intent_id: r.intent_id.to_string(),
            error: r.error.map(Into::into),
            state: r.state.map_or(0, state),
            lease_expires_at: r.lease_expires_at.map(timestamp),
        }
    }
}

impl From<ItemResult> for v1::ReconcileResult {
    fn from(r: ItemResult) -> Self {
        Self {
            intent_id: r.intent_id.to_string(),
            error: r.error.map(Into::into),
            state: r.state.map_or(0, state),
        }
    }
}

impl From<Resolution> for v1::Resolution {
    fn from(r: Resolution) -> Self {
        Self {
            decision: v1::Decision::from(r.decision) as i32,
            from_state: state(r.from_state),
            actor: r.actor,
            reason: r.reason,
            resolved_at: Some(timestamp(r.resolved_at)),
            api_key: r.api_key,
        }
    }
}

impl From<outbox::store::QueueStats> for v1::GetQueueStatsResponse {
    fn from(s: outbox::store::QueueStats) -> Self {
        Self {
            counts: s
                .counts
                .into_iter()
                .map(|c| v1::StateCount {
                    state: state(c.state),
                    region: c.region,
                    count: c.count,
                })
                .collect(),
            oldest_pending_at: s.oldest_pending_at.map(timestamp),
            oldest_staged_at: s.oldest_staged_at.map(timestamp),
            reconcile_backlog: s.reconcile_backlog,
            regions_left_out: s.regions_left_out,
            blocked_keys: s.blocked_keys,
            oldest_blocked_at: s.oldest_blocked_at.map(timestamp),
            policies: s.policies.into_iter().map(Into::into).collect(),
            policies_left_out: s.policies_left_out,
        }
    }
}

impl From<outbox::store::QueuePolicy> for v1::QueuePolicy {
    fn from(p: outbox::store::QueuePolicy) -> Self {
        Self {
            tenant: p.tenant_id,
            kind: p.kind,
            paused: p.paused,
            max_in_flight: p.max_in_flight.unwrap_or(0),
            rate_per_second: p.rate_per_second.unwrap_or(0.0),
            burst: p.burst.unwrap_or(0),
            actor: p.updated_by,
            api_key: p.updated_by_key.unwrap_or_default(),
            reason: p.reason,
            updated_at: Some(timestamp(p.updated_at)),
            in_flight: p.in_flight,
            tokens: p.tokens.unwrap_or(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::outbox::{IntentId, leased_intent};

    #[test]
    fn a_lease_never_encodes_larger_than_its_bound() {
        let bare = leased_intent(IntentId(uuid::Uuid::new_v4()));
        let mut full = leased_intent(IntentId(uuid::Uuid::new_v4()));
        full.kind = "k".repeat(200);
        full.payload = vec![7; 300_000];
        full.content_type = "application/json".into();
        full.region = "eu-west-1".into();
        full.idempotency_key = Some("é".repeat(200));
        full.headers.0 = (0..64)
            .map(|n| (format!("header-{n}"), "v".repeat(4096)))
            .collect();
        full.attempts = i32::MAX;
        full.max_attempts = i32::MIN;
        full.worker_id = Some("w".repeat(200));
        full.last_error = Some("x".repeat(4096));
        for intent in [bare, full] {
            let bound = reply_bytes_at_most(&intent);
            let reply = v1::ClaimResponse {
                leases: vec![intent.into()],
            };
            let encoded = reply.encoded_len();
            assert!(encoded <= bound, "{encoded} bytes encoded, bound {bound}");
            // Tight enough to cut a reply where it would pass the budget, not far before.
            assert!(
                bound - encoded <= 512.max(encoded / 100),
                "{encoded} bytes encoded, bound {bound}"
            );
        }
    }
}
