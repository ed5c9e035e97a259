//! What the worker knows about one lease it holds: its local expiry, whether it was
//! submitted, lost or abandoned, and how to stop its handler.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::proto::LeaseRef;

/// One lease: shared by the handler's `Job`, its supervisor, the heartbeats and settles.
#[derive(Debug)]
pub(crate) struct LeaseState {
    pub(crate) intent_id: String,
    pub(crate) lease_id: String,
    /// Local expiry, on this process's clock (no skew): from the Claim's send, or from
    /// when an ExtendLease was sent.
    expires: Mutex<Instant>,
    submitted: AtomicBool,
    /// The server refused it, or its local expiry passed: nothing more is reported.
    lost: AtomicBool,
    /// The shutdown grace ended before its handler did.
    abandoned: AtomicBool,
    /// Its handler returned (or there was none to run).
    finished: AtomicBool,
    /// Its Ack or Fail has been sent: that call's answer, not a heartbeat's, says what
    /// became of it.
    settling: AtomicBool,
    /// Fires on lost and abandoned.
    pub(crate) token: CancellationToken,
    /// The handler's task, aborted when the lease is lost or abandoned.
    handler: Mutex<Option<AbortHandle>>,
}

impl LeaseState {
    pub(crate) fn new(intent_id: String, lease_id: String, expires: Instant) -> Self {
        Self {
            intent_id,
            lease_id,
            expires: Mutex::new(expires),
            submitted: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            settling: AtomicBool::new(false),
            token: CancellationToken::new(),
            handler: Mutex::new(None),
        }
    }

    pub(crate) fn reference(&self) -> LeaseRef {
        LeaseRef {
            intent_id: self.intent_id.clone(),
            lease_id: self.lease_id.clone(),
        }
    }

    /// The ids, for a [`WorkerObserver`](super::WorkerObserver).
    pub(crate) fn id(&self) -> super::LeaseId<'_> {
        super::LeaseId::new(&self.intent_id, &self.lease_id)
    }

    pub(crate) fn expires(&self) -> Instant {
        *self.expires.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves the local expiry later (never earlier: answers may arrive out of order).
    pub(crate) fn extend_to(&self, expires: Instant) {
        let mut current = self.expires.lock().unwrap_or_else(|e| e.into_inner());
        if expires > *current {
            *current = expires;
        }
    }

    pub(crate) fn is_submitted(&self) -> bool {
        self.submitted.load(Ordering::Acquire)
    }

    pub(crate) fn set_submitted(&self) {
        self.submitted.store(true, Ordering::Release);
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn is_abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    pub(crate) fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    pub(crate) fn is_settling(&self) -> bool {
        self.settling.load(Ordering::Acquire)
    }

    pub(crate) fn set_settling(&self) {
        self.settling.store(true, Ordering::Release);
    }

    /// Marks the lease lost and stops its handler; true the first time only.
    pub(crate) fn lose(&self) -> bool {
        if self.lost.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.stop_handler();
        true
    }

    /// Marks the lease abandoned at the end of the grace and stops its handler.
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
        self.stop_handler();
    }

    pub(crate) fn set_handler(&self, handle: AbortHandle) {
        *self.handler.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        // Lost before the handler was registered: stop it now.
        if self.is_lost() || self.is_abandoned() {
            self.stop_handler();
        }
    }

    fn stop_handler(&self) {
        self.token.cancel();
        if let Some(handle) = &*self.handler.lock().unwrap_or_else(|e| e.into_inner()) {
            handle.abort();
        }
    }
}
