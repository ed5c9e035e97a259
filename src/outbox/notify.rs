//! Wakes long-polling claimers and the staged-intent promoter. One LISTEN connection per
//! server turns committed NOTIFYs into wake-ups: on the pending channel (sent by
//! promotion, rescue, requeue, and other replicas' enqueues, retries and ordered Acks) a
//! watch counter that claimers wait on instead of polling; on the txn channel (sent by
//! `outbox.txn_token()`, delivered only if the producer commits) a kick to the promoter.
//!
//! An enqueue does not NOTIFY in its own transaction: PostgreSQL commits notifying
//! transactions one at a time (the notify queue lock is held across the commit), which cost
//! one-per-call enqueues ~3× their throughput. Instead the server wakes its own claimers at
//! once after the commit, and [`PendingSignal::announce_until_stopped`] tells the other
//! replicas with a NOTIFY of its own, at most one in flight, so a burst of enqueues costs a
//! NOTIFY or two; and none while no other server listens (each one's LISTEN connection holds
//! a shared advisory lock, `store::others_listen`): a lone server's NOTIFYs were a third of
//! its commits at a steady 1,000 intents/s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::store::{self, LISTENER_PROBE_CHANNEL, PENDING_CHANNEL, TXN_COMMITTED_CHANNEL};

/// Wakes claimers when intents may have become claimable: all of them (a counter bumped
/// on notifications from PostgreSQL), or, for this server's own enqueues, one waiting
/// claimer per group of claimers with the same tenants and filters (their "turn"). Waking
/// every waiting worker for each intent cost a claim transaction per worker per intent,
/// all but one empty: most of the database's work at a steady trickle. A claimer that
/// fills its batch passes the turn on, so a burst still reaches as many as it needs.
#[derive(Debug, Clone)]
pub struct PendingSignal {
    tx: watch::Sender<u64>,
    /// Claimer groups (by tenants and filters) and the turn they wait on.
    turns: Arc<Mutex<HashMap<String, Weak<Notify>>>>,
    /// Turns given so far (announcements and passes), to tell a fresh turn from a stale one.
    turns_given: Arc<AtomicU64>,
    /// Asks the announcer for a NOTIFY to the other replicas.
    announce: Arc<Notify>,
    /// This server's payload on the pending channel, so it skips its own announcements.
    replica: Arc<str>,
    /// Backend pid of this server's LISTEN connection, 0 while it has none.
    listener_pid: Arc<AtomicI32>,
}

impl Default for PendingSignal {
    fn default() -> Self {
        Self {
            tx: watch::Sender::new(0),
            turns: Arc::default(),
            turns_given: Arc::default(),
            announce: Arc::new(Notify::new()),
            replica: uuid::Uuid::new_v4().to_string().into(),
            listener_pid: Arc::default(),
        }
    }
}

/// How long the announcer trusts its last look at who else listens. A server that starts
/// listening meanwhile misses at most this long of another's announcements, and its
/// waiting claimers find those intents at their next recheck (every 2 s) instead.
const OTHERS_LOOKED_AT_FOR: Duration = Duration::from_secs(1);

/// Whether another server listens, as the announcer last looked.
#[derive(Debug, Default)]
struct OtherListeners {
    last_look: Option<(Instant, bool)>,
}

impl OtherListeners {
    /// The last look's answer, if it is recent enough at `now`.
    fn known(&self, now: Instant) -> Option<bool> {
        self.last_look
            .filter(|(at, _)| now.saturating_duration_since(*at) < OTHERS_LOOKED_AT_FOR)
            .map(|(_, others)| others)
    }

    /// Whether another server listens: the last look's answer, or a new look. A look that
    /// fails answers yes (an announcement too many costs a NOTIFY; one too few, a wait).
    async fn present(&mut self, pool: &PgPool, own_pid: i32) -> bool {
        if let Some(others) = self.known(Instant::now()) {
            return others;
        }
        let others = store::others_listen(pool, own_pid)
            .await
            .inspect_err(
                |e| tracing::warn!(error.message = %e, "cannot tell whether other replicas listen"),
            )
            .unwrap_or(true);
        self.last_look = Some((Instant::now(), others));
        others
    }
}

/// The turn of one group of claimers. A turn given while none of them waits is kept for
/// the next to wait; most such turns are stale: given (for intents committed) before that
/// claimer's last look, which already saw those intents. A claimer notes [`Self::mark`]
/// before it looks and then waits in [`Self::given_since`], which lets stale turns go:
/// each one had cost an empty claim, a round trip. The count is shared by all
/// groups: a turn given to another group lets a stale one through, at worst one more look.
#[derive(Debug)]
pub struct Turn {
    notify: Arc<Notify>,
    given: Arc<AtomicU64>,
}

/// How many turns had been given when a claimer began to look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark(u64);

#[cfg(test)]
impl Mark {
    /// A mark of `given` turns, for tests.
    pub fn at(given: u64) -> Self {
        Self(given)
    }
}

impl Turn {
    /// Notes the turns given so far; take it before looking.
    pub fn mark(&self) -> Mark {
        Mark(self.given.load(Ordering::SeqCst))
    }

    /// Returns once this group is given a turn that came after `mark`. A turn given while
    /// the claimer looked counts (its intents may have been committed after the look's
    /// snapshot); one given before `mark` is dropped.
    pub async fn given_since(&self, mark: Mark) {
        loop {
            self.notify.notified().await;
            if self.given.load(Ordering::SeqCst) != mark.0 {
                return;
            }
        }
    }

    /// Passes the turn to the next waiting claimer of the group: there may be more (the
    /// last look filled its batch).
    pub fn pass(&self) {
        self.given.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_one();
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

    /// The turn claimers of `group` (their tenants and filters, as a string) wait on.
    /// Kept while one of them holds it.
    pub fn turn(&self, group: String) -> Turn {
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        turns.retain(|_, turn| turn.strong_count() > 0);
        let notify = match turns.get(&group).and_then(Weak::upgrade) {
            Some(notify) => notify,
            None => {
                let notify = Arc::new(Notify::new());
                turns.insert(group, Arc::downgrade(&notify));
                notify
            }
        };
        Turn {
            notify,
            given: Arc::clone(&self.turns_given),
        }
    }

    /// Intents became claimable through this server (committed already): wakes one waiting
    /// claimer of each group now (or the next to wait, if none is waiting) and has the
    /// announcer tell the other replicas.
    pub fn announce(&self) {
        self.turns_given.fetch_add(1, Ordering::SeqCst);
        let turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        for turn in turns.values().filter_map(Weak::upgrade) {
            turn.notify_one();
        }
        drop(turns);
        self.announce.notify_one();
    }

    /// Sends a NOTIFY on the pending channel for each [`Self::announce`], coalesced: the
    /// announcements made while one NOTIFY is in flight are covered by the next one. None
    /// while no other server listens.
    pub async fn announce_until_stopped(self, pool: PgPool, shutdown: CancellationToken) {
        let mut others = OtherListeners::default();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.announce.notified() => {}
            }
            let own_pid = self.listener_pid.load(Ordering::SeqCst);
            if !others.present(&pool, own_pid).await {
                continue;
            }
            if let Err(e) = store::announce_pending(&pool, &self.replica).await {
                // The other replicas' claimers still look again within their recheck.
                tracing::warn!(error.message = %e, "cannot announce new intents to other replicas");
            }
        }
    }

    /// Whether a LISTEN connection is up, and the claimers have been woken for what was
    /// announced before it.
    pub fn is_listening(&self) -> bool {
        self.listener_pid.load(Ordering::SeqCst) != 0
    }

    /// Listens until `shutdown`, bumping on each pending notification and kicking
    /// `txn_committed` on each producer commit; both after each reconnect too, since
    /// notifications sent while disconnected are lost and everyone must look again.
    ///
    /// Every `probe_every` the connection must prove it still delivers: a NOTIFY this
    /// server sends itself through the pool must be sent and back within [`PROBE_TIMEOUT`]
    /// (or `probe_every`, if shorter), else its session is ended and a new connection
    /// listens. Without that, a connection a network dropped silently (half-open; a load
    /// balancer's idle timeout) would be waited on for ever, and this server's claimers
    /// would learn of other replicas' work only at their recheck. While the connection
    /// works, the probes' traffic also keeps an idle timeout longer than `probe_every`
    /// from dropping it.
    pub async fn listen_until_stopped(
        self,
        pool: PgPool,
        txn_committed: Arc<Notify>,
        probe_every: Duration,
        shutdown: CancellationToken,
    ) {
        let mut retry = Duration::from_millis(100);
        // Numbers every probe of this server's life, so that one sent on an earlier
        // connection never passes for an answer on this one.
        let probes = Arc::new(AtomicU64::new(0));
        while !shutdown.is_cancelled() {
            // Bounded: a connection that hangs while it starts to listen is as silent.
            let connected = tokio::time::timeout(PROBE_TIMEOUT, listening(&pool))
                .await
                .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut.into()));
            let (mut listener, pid) = match connected {
                Ok(connected) => connected,
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
            retry = Duration::from_millis(100);
            self.bump();
            txn_committed.notify_one();
            // After the wake-ups: whoever sees this server listening sees them given.
            self.listener_pid.store(pid, Ordering::SeqCst);
            let (answered, seen) = watch::channel(0);
            let silent = CancellationToken::new();
            // Ends the watchdog with this connection, however the loop below ends.
            let _connection = silent.clone().drop_guard();
            tokio::spawn(watchdog(
                pool.clone(),
                Probes {
                    replica: Arc::clone(&self.replica),
                    every: probe_every,
                    numbers: Arc::clone(&probes),
                },
                seen,
                silent.clone(),
            ));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    () = silent.cancelled() => {
                        tracing::warn!("LISTEN connection stopped delivering; reconnecting");
                        // Its session may live on, holding the listener lock (other
                        // servers would count it) and, until TCP gives up, a connection.
                        let ended = tokio::time::timeout(
                            PROBE_TIMEOUT,
                            store::terminate_backend(&pool, pid),
                        );
                        if !matches!(ended.await, Ok(Ok(_))) {
                            tracing::warn!(pid, "cannot end the silent LISTEN session");
                        }
                        break;
                    }
                    received = listener.try_recv() => match received {
                        Ok(Some(n)) if n.channel() == LISTENER_PROBE_CHANNEL => {
                            // Other servers' probes pass by on the same channel.
                            if let Some(number) = probe_number(n.payload(), &self.replica) {
                                answered.send_if_modified(|seen| {
                                    let newer = number > *seen;
                                    *seen = (*seen).max(number);
                                    newer
                                });
                            }
                        }
                        Ok(Some(n)) if n.channel() == TXN_COMMITTED_CHANNEL => txn_committed.notify_one(),
                        // Our own announcement: our claimers had their turn before it was sent.
                        Ok(Some(n)) if n.payload() == &*self.replica => {}
                        Ok(Some(_)) => self.bump(),
                        // The connection was lost. PgListener would reconnect on the next
                        // call, but without the listener lock: start over instead.
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error.message = %e, "LISTEN connection failed; reconnecting");
                            break;
                        }
                    },
                }
            }
            self.listener_pid.store(0, Ordering::SeqCst);
        }
    }
}

/// A LISTEN connection on the three channels, holding the listener lock (taken first, so
/// that other servers count this one as soon as it listens), and its backend pid.
///
/// The connection has a pool of its own, with the settings of `pool`: one this server
/// stops listening on (failed, or silent) then closes when dropped instead of going back
/// to the server's pool still holding the listener lock (other servers would count a
/// listener that is not there), and a silent one holds none of the server's connections
/// while TCP gives up on it.
async fn listening(pool: &PgPool) -> crate::outbox::Result<(PgListener, i32)> {
    let own = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = PgListener::connect_with(&own).await?;
    let pid = store::hold_listener_lock(&mut listener).await?;
    listener
        .listen_all([
            PENDING_CHANNEL,
            TXN_COMMITTED_CHANNEL,
            LISTENER_PROBE_CHANNEL,
        ])
        .await?;
    Ok((listener, pid))
}

/// Longest a probe of the LISTEN connection may take to come back.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a server's probes of its LISTEN connection are: `<replica>:<number>`, every
/// `every`, numbered from `numbers` across the server's connections.
struct Probes {
    replica: Arc<str>,
    every: Duration,
    numbers: Arc<AtomicU64>,
}

/// The number of a probe `payload` of `replica`'s (others' probes: `None`).
fn probe_number(payload: &str, replica: &str) -> Option<u64> {
    payload
        .strip_prefix(replica)?
        .strip_prefix(':')?
        .parse()
        .ok()
}

/// The watchdog of one LISTEN connection: every `probes.every`, a probe through `pool`,
/// whose number the listener publishes on `seen` when it comes back; cancels `silent` when
/// one is not back in time, counting its sending (a pooled connection a network dropped
/// hangs as the listener's does), and ends when `silent` is cancelled otherwise. A probe
/// that fails to be sent (the database is down) proves nothing either way: the
/// connection then fails on its own.
async fn watchdog(
    pool: PgPool,
    probes: Probes,
    mut seen: watch::Receiver<u64>,
    silent: CancellationToken,
) {
    let limit = probes.every.min(PROBE_TIMEOUT);
    loop {
        tokio::select! {
            () = silent.cancelled() => return,
            () = tokio::time::sleep(probes.every) => {}
        }
        let number = probes.numbers.fetch_add(1, Ordering::Relaxed) + 1;
        let payload = format!("{}:{number}", probes.replica);
        let probe = async {
            store::probe_listener(&pool, &payload).await?;
            // An error here: the listener is gone, and `silent` with it.
            let _ = seen.wait_for(|seen| *seen >= number).await;
            Ok::<(), crate::outbox::Error>(())
        };
        let outcome = tokio::select! {
            () = silent.cancelled() => return,
            outcome = tokio::time::timeout(limit, probe) => outcome,
        };
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error.message = %e, "cannot probe the LISTEN connection"),
            Err(_) => {
                silent.cancel();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    /// Whether a claimer waiting since `mark` would be woken now (one poll, no timing).
    fn woken_now(turn: &Turn, mark: Mark) -> bool {
        turn.given_since(mark).now_or_never().is_some()
    }

    #[test]
    fn only_this_servers_numbered_probes_count_as_its_answers() {
        assert_eq!(probe_number("r1:5", "r1"), Some(5));
        assert_eq!(probe_number("r10:5", "r1"), None, "another server's");
        assert_eq!(
            probe_number("r1", "r1"),
            None,
            "an announcement, not a probe"
        );
        assert_eq!(probe_number("r1:x", "r1"), None);
    }

    #[test]
    fn a_turn_given_before_the_claimer_looked_is_dropped_as_stale() {
        let pending = PendingSignal::default();
        let turn = pending.turn("g".into());
        pending.announce();
        let mark = turn.mark();
        assert!(!woken_now(&turn, mark));
        pending.announce();
        assert!(woken_now(&turn, mark));
    }

    #[test]
    fn a_turn_given_while_the_claimer_looked_wakes_it_when_it_waits() {
        let pending = PendingSignal::default();
        let turn = pending.turn("g".into());
        let mark = turn.mark();
        pending.announce();
        assert!(woken_now(&turn, mark));
    }

    #[test]
    fn who_else_listens_is_looked_at_again_once_the_last_look_is_a_second_old() {
        let at = Instant::now();
        let mut others = OtherListeners::default();
        assert_eq!(others.known(at), None, "never looked");
        others.last_look = Some((at, false));
        assert_eq!(others.known(at + Duration::from_millis(999)), Some(false));
        assert_eq!(others.known(at + OTHERS_LOOKED_AT_FOR), None);
    }

    #[test]
    fn a_passed_turn_wakes_the_next_claimer_of_the_group() {
        let pending = PendingSignal::default();
        let (first, next) = (pending.turn("g".into()), pending.turn("g".into()));
        let mark = next.mark();
        first.pass();
        assert!(woken_now(&next, mark));
    }
}
