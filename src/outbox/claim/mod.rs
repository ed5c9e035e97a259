//! The Claim use case: lease claimable intents to a worker, or wait for some (a long
//! poll) until the caller's deadline. Each look goes to the store from its group's floor
//! (`floor`); a long poll may skip its first look while its group is known to have drained
//! the queue (`drained`), and while it waits, a direct Enqueue of this server may hand it
//! intents (`handoff`).

pub mod drained;
pub mod floor;
pub mod handoff;
pub mod tally;

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::drained::{DrainedGroups, Seen};
use self::floor::{ClaimFloors, Leased};
use self::handoff::{Handoffs, Wanted};
use self::tally::ClaimTally;
use super::notify::PendingSignal;
use super::store::{self, ClaimParams, Pools, TenantScope};
use super::{Clock, Intent, Result};

/// The Claim calls of one server: their groups' floors and drained state, and the
/// hand-off from this server's direct enqueues.
#[derive(Debug)]
pub struct Claims {
    pools: Pools,
    clock: Clock,
    pending: PendingSignal,
    shutdown: CancellationToken,
    handoffs: Arc<Handoffs>,
    settings: ClaimSettings,
    counters: ClaimCounters,
    floors: ClaimFloors,
    drained: DrainedGroups,
}

/// How Claim calls wait.
#[derive(Debug, Clone, Copy)]
pub struct ClaimSettings {
    /// How often a long poll looks again without a notification (a safety net for
    /// notifications lost while the LISTEN connection was down).
    pub recheck: Duration,
    /// Whether waiting claims may be handed intents by direct enqueues.
    pub hand_off: bool,
}

/// What Claim calls count: those waiting now, intents handed to them by enqueues, leases
/// queue limits refused them, and (when the console is served) their leases per minute.
#[derive(Debug, Clone, Default)]
pub struct ClaimCounters {
    pub waiting: Gauge,
    pub handed_off: Counter,
    pub refused_by_limit: Counter,
    pub tally: Option<Arc<ClaimTally>>,
}

/// A Claim call: what to lease, and until when it may wait.
#[derive(Debug, Clone, Copy)]
pub struct ClaimCall<'a> {
    pub scope: &'a TenantScope,
    pub params: ClaimParams<'a>,
    /// How long the worker asked to wait for intents (zero: look once).
    pub wait: Duration,
    /// When to answer at the latest, found or not.
    pub deadline: Instant,
}

/// A Claim call's answer.
#[derive(Debug)]
pub enum ClaimAnswer {
    /// Leased to the caller (maybe none), or an earlier call's leases (same request id).
    Leased {
        intents: Vec<Intent>,
        replayed: bool,
    },
    /// The caller went away; what it was leased has been given back.
    CallerGone,
}

/// What one look found.
struct Look {
    intents: Vec<Intent>,
    /// Whether it leased as many as asked (there may be more).
    filled: bool,
    /// How long its claimer (or the next of its group) may wait before looking again: the
    /// recheck, or the next delayed intent's due time if sooner.
    again_in: Duration,
    /// Its intents are an earlier call's leases (same request id), not newly claimed.
    replayed: bool,
    /// Leases a queue's limit refused it (see `outbox_leases_refused_by_limit_total`).
    refused_by_limit: u64,
}

impl Claims {
    /// `shutdown` ends waiting long polls early (they answer with no leases).
    pub fn new(
        pools: Pools,
        clock: Clock,
        pending: PendingSignal,
        shutdown: CancellationToken,
        handoffs: Arc<Handoffs>,
        settings: ClaimSettings,
        counters: ClaimCounters,
    ) -> Self {
        Self {
            pools,
            clock,
            pending,
            shutdown,
            handoffs,
            settings,
            counters,
            floors: ClaimFloors::default(),
            drained: DrainedGroups::default(),
        }
    }

    /// Leases what `call` asks for, waiting until its deadline if there is nothing yet.
    /// `gone` says the caller went away: the call stops waiting, and gives back what it
    /// leased (attempts uncounted) instead of leaving it to expire.
    ///
    /// # Errors
    /// [`super::Error::Database`].
    pub async fn claim(
        &self,
        call: ClaimCall<'_>,
        gone: &CancellationToken,
    ) -> Result<ClaimAnswer> {
        let ClaimCall {
            scope,
            params,
            wait,
            deadline,
        } = call;
        let mut woken = self.pending.subscribe();
        let group = format!("{scope:?} {:?} {:?}", params.region, params.kinds);
        let turn = self.pending.turn(group.clone());
        // A look after a wait that no wake-up ended (a recheck, the due time, the deadline)
        // is of the whole queue: a waiting claimer finds intents behind the floor by then.
        let mut whole_look = false;
        // A long poll that is not a replay (which must find its first attempt's leases) may
        // begin by waiting, without a look of its own, while its group is known to have
        // drained the queue; while it waits, an enqueue of this server may hand it intents.
        let long_poll = !wait.is_zero() && params.request_id.is_none();
        let mut may_skip_look = long_poll;
        let wanted = (self.settings.hand_off && long_poll).then(|| Wanted {
            scope: scope.clone(),
            region: params.region.to_owned(),
            kinds: params.kinds.to_vec(),
            worker_id: params.worker_id.to_owned(),
            lease_duration: params.lease_duration,
            max_intents: usize::try_from(params.max_intents).unwrap_or(0),
        });
        // Answering an earlier call's leases again (same request id): not claimed anew.
        let mut replayed = false;
        // The looks of one Claim refused it the same leases again and again: counted once,
        // their most, when it answers.
        let mut refused_by_limit = 0;
        let intents = loop {
            // Mark the signal and the turns seen before looking, so a commit landing in
            // between still wakes us.
            let seen = Seen {
                signal: *woken.borrow_and_update(),
                turns: turn.mark(),
            };
            let skipped_until = if may_skip_look && !self.shutdown.is_cancelled() {
                self.drained.wait_until(&group, seen, Instant::now())
            } else {
                None
            };
            may_skip_look = false;
            let until = match skipped_until {
                Some(until) => until,
                None => {
                    let look = self.look(scope, &group, params, whole_look, seen).await?;
                    refused_by_limit = refused_by_limit.max(look.refused_by_limit);
                    let now = Instant::now();
                    if !look.intents.is_empty()
                        || now >= deadline
                        || self.shutdown.is_cancelled()
                        || gone.is_cancelled()
                    {
                        replayed = look.replayed;
                        if look.filled && !replayed {
                            // There may be more: the next waiting claimer of the group looks too.
                            turn.pass();
                        }
                        break look.intents;
                    }
                    now + look.again_in
                }
            };
            let until = deadline.min(until);
            // Registered before it counts as waiting: whoever sees it waiting may hand it
            // intents.
            let mut waiter = wanted.clone().map(|w| self.handoffs.wait(w));
            let _waiting = Waiting::count(&self.counters.waiting);
            let handed = async {
                match &mut waiter {
                    Some(waiter) => waiter.handed().await,
                    None => std::future::pending().await,
                }
            };
            whole_look = tokio::select! {
                handed = handed => match handed {
                    Some(intents) if !intents.is_empty() => {
                        break self.received_handed_off(intents);
                    }
                    // The enqueue that took this claim failed, or leased it nothing (its
                    // queue has a policy, which only a claim applies): look again.
                    _ => false,
                },
                _ = woken.changed() => false,
                _ = turn.given_since(seen.turns) => false,
                () = tokio::time::sleep_until(until) => true,
                () = self.shutdown.cancelled() => false,
                () = gone.cancelled() => false,
            };
            // An enqueue may have taken this claim just now: then its intents are ours, and
            // the turn that may have woken it goes to the next claimer of the group (it was
            // given for other intents).
            if let Some(waiter) = waiter
                && let Some(intents) = waiter.withdraw().await
                && !intents.is_empty()
            {
                turn.pass();
                break self.received_handed_off(intents);
            }
            // Shutting down: answer without leasing more, as the README promises. Or nobody
            // waits for an answer any more.
            if self.shutdown.is_cancelled() || gone.is_cancelled() {
                break Vec::new();
            }
        };
        self.counters.refused_by_limit.inc_by(refused_by_limit);
        // The caller went away (while we looked, or as an enqueue handed it intents): nobody
        // receives these leases, so they go back at once, attempts uncounted, instead of
        // waiting out their expiry. A replay's belong to an earlier call that may have had
        // its answer. Nor those of a call with a request id: its retry may be collecting
        // them (a replay waits for this call's statement, then returns them), and leases
        // given back under that answer would be leased twice; they expire instead.
        if gone.is_cancelled() {
            if !replayed && params.request_id.is_none() {
                self.give_back(scope, intents);
            }
            return Ok(ClaimAnswer::CallerGone);
        }
        Ok(ClaimAnswer::Leased { intents, replayed })
    }

    /// Gives back leases taken for a caller that will not receive them, attempts
    /// uncounted.
    pub fn give_back(&self, scope: &TenantScope, intents: Vec<Intent>) {
        self.handoffs.release(scope, intents);
    }

    /// One look for intents of `group` (the whole queue, or from the group's floor), which
    /// began having seen `seen`; notes what it found for the group's floor and drained state
    /// (a replay, which did not look at the queue, notes nothing).
    async fn look(
        &self,
        scope: &TenantScope,
        group: &str,
        params: ClaimParams<'_>,
        whole_look: bool,
        seen: Seen,
    ) -> Result<Look> {
        let look_from = if whole_look {
            None
        } else {
            self.floors.look_from(group, Instant::now())
        };
        let params = ClaimParams {
            now: self.clock.now(),
            floors: look_from.as_deref().unwrap_or_default(),
            ..params
        };
        let store::Claimed {
            intents,
            next_due_in,
            replayed,
            ran_out,
            refused_by_limit,
        } = store::claim_intents(&self.pools, scope, params).await?;
        let recheck = self.settings.recheck;
        let again_in = next_due_in.map_or(recheck, |due| due.min(recheck));
        let filled = !ran_out;
        if !replayed {
            let now = Instant::now();
            self.floors
                .record(group, look_from.is_none(), Leased::by_level(&intents), now);
            // A queue a limit held back is not drained: a slot or token freed since
            // (an Ack, say) is for the group's next claim to find at once.
            let drained = !filled && refused_by_limit == 0;
            self.drained.record(group, seen, drained, again_in, now);
            if let Some(tally) = &self.counters.tally {
                tally.count(&intents);
            }
        }
        Ok(Look {
            intents,
            filled,
            again_in,
            replayed,
            refused_by_limit,
        })
    }

    /// Intents an enqueue handed this claim, counted as they reach it (not as they are
    /// sent: a claim cancelled before reading them has them given back instead).
    fn received_handed_off(&self, intents: Vec<Intent>) -> Vec<Intent> {
        self.counters.handed_off.inc_by(intents.len() as u64);
        intents
    }
}

/// Counts a Claim as waiting until dropped, however the wait ends (a cancelled call too).
struct Waiting(Gauge);

impl Waiting {
    fn count(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}
