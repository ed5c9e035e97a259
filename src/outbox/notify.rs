//! Wakes long-polling claimers. One LISTEN connection per server turns committed
//! NOTIFYs (sent by enqueue, rescue and requeue in their own transactions) into a watch
//! counter; a claimer with nothing to take waits on it instead of polling.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::store::PENDING_CHANNEL;

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

    /// Listens on the pending channel until `shutdown`, bumping on each notification and
    /// after each reconnect (notifications sent while disconnected are lost, so waiters
    /// must look again).
    pub async fn listen_until_stopped(self, pool: PgPool, shutdown: CancellationToken) {
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
            if let Err(e) = listener.listen(PENDING_CHANNEL).await {
                tracing::warn!(error.message = %e, "LISTEN failed; retrying");
                continue;
            }
            retry = Duration::from_millis(100);
            self.bump();
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    received = listener.try_recv() => match received {
                        Ok(_) => self.bump(),
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
