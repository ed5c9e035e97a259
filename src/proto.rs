//! Generated gRPC types (`outbox.v1`) and the conversions from domain types to wire types.
//! Conversions from wire to domain, which validate, live in `crate::validate`.

use chrono::{DateTime, Utc};

use crate::outbox::{
    self, Decision, Enqueued, Intent, IntentState, ItemError, ItemResult, Resolution,
};

/// Code generated from `proto/outbox/v1/outbox.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("outbox.v1");
}

/// Encoded descriptors of the API, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/outbox_descriptor.bin"));

/// Wire form of a timestamp.
pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

/// Domain form of a wire timestamp; `None` when out of chrono's range.
pub fn from_timestamp(t: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    let nanos = u32::try_from(t.nanos).ok()?;
    DateTime::from_timestamp(t.seconds, nanos)
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
        }
    }
}

impl From<Decision> for v1::Decision {
    fn from(d: Decision) -> Self {
        match d {
            Decision::Delivered => Self::Delivered,
            Decision::Requeue => Self::Requeue,
            Decision::Dead => Self::Dead,
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
            code: crate::grpc::code_of(e.reason) as i32,
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
        }
    }
}

impl From<outbox::store::QueueStats> for v1::GetQueueStatsResponse {
    fn from(s: outbox::store::QueueStats) -> Self {
        let reconcile_backlog = s
            .counts
            .iter()
            .filter(|c| c.state.awaits_decision())
            .map(|c| c.count)
            .sum();
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
            reconcile_backlog,
        }
    }
}
