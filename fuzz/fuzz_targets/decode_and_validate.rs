//! Fuzz target: the first byte picks a request type, the rest is decoded with prost as the
//! server's codec does and, when it decodes, validated with the default limits. Neither
//! step may panic; a decode failure must map to a status (`outboxd::codec::decode_error`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use outboxd::config::Limits;
use outboxd::proto::v1;
use outboxd::validate;
use prost::Message;

/// Decodes `bytes` as `M`; on failure builds the status the server would send.
fn decode<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    match M::decode(bytes) {
        Ok(m) => Some(m),
        Err(e) => {
            let status = outboxd::codec::decode_error(outboxd::codec::message_name::<M>(), &e);
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            None
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let limits = Limits::default();
    match which % 9 {
        0 => {
            if let Some(r) = decode::<v1::EnqueueRequest>(bytes) {
                let _ = validate::enqueue(r, &limits);
            }
        }
        1 => {
            if let Some(r) = decode::<v1::ClaimRequest>(bytes) {
                let _ = validate::claim(r, &limits);
            }
        }
        2 => {
            if let Some(r) = decode::<v1::ExtendLeaseRequest>(bytes) {
                let _ = validate::extend(&r, &limits);
            }
        }
        3 => {
            if let Some(r) = decode::<v1::MarkSubmittedRequest>(bytes) {
                let _ = validate::leases(&r.leases, &limits);
            }
        }
        4 => {
            if let Some(r) = decode::<v1::AckRequest>(bytes) {
                let _ = validate::leases(&r.leases, &limits);
            }
        }
        5 => {
            if let Some(r) = decode::<v1::FailRequest>(bytes) {
                let _ = validate::fail(r, &limits);
            }
        }
        6 => {
            if let Some(r) = decode::<v1::ReconcileRequest>(bytes) {
                let _ = validate::reconcile(r, &limits);
            }
        }
        7 => {
            if let Some(r) = decode::<v1::GetIntentRequest>(bytes) {
                let _ = validate::intent_id("id", &r.id);
            }
        }
        _ => {
            if let Some(r) = decode::<v1::ListIntentsRequest>(bytes) {
                let _ = validate::list(r, &limits);
            }
        }
    }
});
