//! Wakes long-polling claimers and the staged-intent promoter. One LISTEN connection per
//! server turns committed NOTIFYs into wake-ups: on the pending channel (sent by enqueue,
//! promotion, rescue and requeue) a watch counter that claimers wait on instead of polling;
//! on the txn channel (sent by `outbox.txn_token()`, delivered only if the producer
//! commits) a kick to the promoter.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::store::{PENDING_CHANNEL, TXN_COMMITTED_CHANNEL};

/// A counter bumped whenever intents may have become claimable.
#[derive(Debug, Clone)]
pub struct PendingSignal {
    tx: watch::Sender<u64>,
}

impl Default for PendingSignal {
    fn default() -> Self {
        Self {
            tx: watch::Sender::new(0),
        }
    }
}

impl PendingSignal {
    /// A receiver that sees every bump after this call.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }

    /// Wakes every waiting claimer.
    pub fn bump(&self) {
        self.tx.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Listens until `shutdown`, bumping on each pending notification and kicking
    /// `txn_committed` on each producer commit; both after each reconnect too, since
    /// notifications sent while disconnected are lost and everyone must look again.
    pub async fn listen_until_stopped(
        self,
        pool: PgPool,
        txn_committed: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let mut retry = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let mut listener = match PgListener::connect_with(&pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error.message = %e, "cannot LISTEN for new intents; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(retry) => {}
                    }
                    retry = (retry * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let channels = [PENDING_CHANNEL, TXN_COMMITTED_CHANNEL];
            if let Err(e) = listener.listen_all(channels).await {
                tracing::warn!(error.message = %e, "LISTEN failed; retrying");
                continue;
            }
            retry = Duration::from_millis(100);
            self.bump();
            txn_committed.notify_one();
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    received = listener.try_recv() => match received {
                        Ok(Some(n)) if n.channel() == TXN_COMMITTED_CHANNEL => txn_committed.notify_one(),
                        Ok(Some(_)) => self.bump(),
                        Ok(None) => {
                            self.bump();
                            txn_committed.notify_one();
                        }
                        Err(e) => {
                            tracing::warn!(error.message = %e, "LISTEN connection failed; reconnecting");
                            break;
                        }
                    },
                }
            }
        }
    }
}
