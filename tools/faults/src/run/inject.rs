//! The fault scheduler: shuffled rounds of every fault kind under load, and how each one
//! is injected and recovered from (restarts, SIGCONT, lock release), recorded on the
//! timeline when it is over.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::Suite;
use crate::faults::{FaultKind, FaultRecord};
use crate::journal::now_us;
use crate::processes::Supervised;
use crate::producer;

impl Suite {
    /// Injects faults, one kind after another in shuffled rounds, for `duration`.
    pub(super) async fn inject_for(self: &Arc<Self>, duration: Duration) {
        let end = Instant::now() + duration;
        let mut round = Vec::new();
        while Instant::now() < end {
            if round.is_empty() {
                round = FaultKind::INJECTED.to_vec();
                // Lost responses are the commonest fault in production: twice per round.
                round.push(FaultKind::LostResponses);
                round.retain(|k| !self.args.without.contains(k));
                if round.is_empty() {
                    tokio::time::sleep_until(end).await;
                    break;
                }
                self.rng().shuffle(&mut round);
            }
            let kind = round.pop().expect("refilled above");
            match self.inject(kind).await {
                Ok(Some(what)) => self.say(format!("fault: {} ({what})", kind.label())),
                Ok(None) => {}
                Err(e) => self.say(format!("fault {kind:?} could not be injected: {e:#}")),
            }
            let mean = self.args.fault_interval.as_millis() as u64;
            let pause = self.rng().millis(mean / 2, mean * 3 / 2);
            tokio::time::sleep_until((Instant::now() + pause).min(end)).await;
        }
    }

    /// Runs the recovery half of a fault in the background; the drain waits for it.
    fn recover(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.recoveries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(tokio::spawn(task));
    }

    /// Puts a fault that is over on the timeline.
    fn record(&self, kind: FaultKind, target: &str, start: i64, detail: String) {
        self.timeline.record(FaultRecord {
            kind,
            target: target.to_owned(),
            start,
            end: now_us(),
            detail,
        });
    }

    /// Injects one fault; Ok(None) when no target was available right now.
    async fn inject(self: &Arc<Self>, kind: FaultKind) -> anyhow::Result<Option<String>> {
        let start = now_us();
        match kind {
            FaultKind::OutboxdKill => {
                let Some(i) = self.pick_replica().await else {
                    return Ok(None);
                };
                let slot = self.replicas[i].supervised.slot.clone();
                self.replicas[i].supervised.kill().await;
                let down = self.rng().millis(300, 1500);
                let said = format!("{slot}, restart in {} ms", down.as_millis());
                let suite = self.clone();
                self.recover(async move {
                    tokio::time::sleep(down).await;
                    let restarted = suite.replicas[i].supervised.start().await;
                    let detail = format!("down {} ms, restart {restarted:?}", down.as_millis());
                    suite.record(kind, &slot, start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::OutboxdStop => {
                let Some(i) = self.pick_replica().await else {
                    return Ok(None);
                };
                let slot = self.replicas[i].supervised.slot.clone();
                if self.replicas[i].supervised.pause(true).await.is_none() {
                    return Ok(None);
                }
                let frozen = self.rng().millis(1000, 4000);
                let said = format!("{slot} for {} ms", frozen.as_millis());
                let suite = self.clone();
                self.recover(async move {
                    tokio::time::sleep(frozen).await;
                    suite.replicas[i].supervised.pause(false).await;
                    let detail = format!("frozen {} ms", frozen.as_millis());
                    suite.record(kind, &slot, start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::CancelStorm => {
                let how_long = self.rng().millis(2000, 4000);
                let seed = self.rng().next_u64();
                let said = format!("{} ms on every replica", how_long.as_millis());
                let suite = self.clone();
                self.recover(async move {
                    let endpoints = suite.direct_endpoints();
                    let keys = &suite.cluster.keys;
                    let storm = crate::storm::storm(&endpoints, keys, how_long, seed).await;
                    let detail = format!(
                        "{} calls given up after 1-4 ms, {} answered in time",
                        storm.calls, storm.answered
                    );
                    suite.record(kind, "every replica", start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::LockStall => {
                // Past the 5 s pool acquire timeout at times: calls queued on the small
                // pool behind blocked ones then fail with UNAVAILABLE.
                let hold = self.rng().millis(3000, 7000);
                let said = format!("{} ms", hold.as_millis());
                let suite = self.clone();
                self.recover(async move {
                    let detail = match suite.cluster.lock_rows(30, hold).await {
                        Ok(n) => format!("{n} rows locked {} ms", hold.as_millis()),
                        Err(e) => format!("ended early: {e}"),
                    };
                    suite.record(kind, "outbox.intent", start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::PostgresCrash => {
                let Ok(busy) = self.postgres_busy.clone().try_lock_owned() else {
                    return Ok(None);
                };
                self.cluster.crash().await?;
                let down = self.rng().millis(300, 2000);
                let suite = self.clone();
                self.recover(async move {
                    tokio::time::sleep(down).await;
                    let mut restarted = suite.cluster.restart().await;
                    for _ in 0..3 {
                        if restarted.is_ok() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        restarted = suite.cluster.restart().await;
                    }
                    if let Err(e) = &restarted {
                        suite.say(format!("PostgreSQL did not restart: {e:#}"));
                    }
                    let detail = format!("down {} ms (+ recovery)", down.as_millis());
                    suite.record(kind, "postgres", start, detail);
                    drop(busy);
                });
                Ok(Some(format!("restart in {} ms", down.as_millis())))
            }
            FaultKind::OutboxdSessionsKilled => {
                let n = self
                    .cluster
                    .terminate_backends("outboxd", false, 1000)
                    .await?;
                if n == 0 {
                    return Ok(None);
                }
                self.record(kind, "outboxd", start, format!("{n} sessions"));
                Ok(Some(format!("{n} sessions")))
            }
            FaultKind::WorkerKill | FaultKind::ProducerKill => {
                let slots = if kind == FaultKind::WorkerKill {
                    &self.workers
                } else {
                    &self.producers
                };
                let Some(slot) = self.pick_running(slots).await else {
                    return Ok(None);
                };
                let Some(killed) = slot.kill().await else {
                    return Ok(None);
                };
                let replacement = slot.start().await?;
                self.record(kind, &killed, start, format!("replaced by {replacement}"));
                Ok(Some(format!("{killed}, replaced by {replacement}")))
            }
            FaultKind::WorkerStop => {
                let Some(slot) = self.pick_running(&self.workers).await else {
                    return Ok(None);
                };
                let Some(stopped) = slot.pause(true).await else {
                    return Ok(None);
                };
                let pause = self.args.lease * 2 + self.rng().millis(200, 1500);
                let said = format!("{stopped} for {} ms", pause.as_millis());
                let (suite, index) = (self.clone(), self.slot_index(&slot.slot));
                self.recover(async move {
                    tokio::time::sleep(pause).await;
                    suite.workers[index].pause(false).await;
                    let detail = format!("stopped {} ms", pause.as_millis());
                    suite.record(kind, &stopped, start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::LostResponses => {
                let i = self.rng().below(self.replicas.len() as u64) as usize;
                let window = self.rng().millis(100, 300);
                let armed = self.replicas[i].proxy.drop_responses(window);
                if armed == 0 {
                    return Ok(None);
                }
                let slot = self.replicas[i].supervised.slot.clone();
                let said = format!("{armed} connections to {slot}");
                let suite = self.clone();
                self.recover(async move {
                    tokio::time::sleep(Duration::from_secs(2) + window).await;
                    let detail = format!("{armed} connections armed, {} ms", window.as_millis());
                    suite.record(kind, &slot, start, detail);
                });
                Ok(Some(said))
            }
            FaultKind::ProducerBackendKilled => {
                for _ in 0..20 {
                    let n = self
                        .cluster
                        .terminate_backends(producer::APPLICATION_NAME, true, 1)
                        .await?;
                    if n > 0 {
                        self.record(kind, "producer session", start, String::new());
                        return Ok(Some("one idle-in-transaction producer session".to_owned()));
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                Ok(None)
            }
        }
    }

    /// A replica to kill or freeze, keeping at least one other serving so the load never
    /// stops entirely.
    async fn pick_replica(&self) -> Option<usize> {
        let mut serving = Vec::new();
        for (i, r) in self.replicas.iter().enumerate() {
            if r.supervised.running().await.is_some() && !r.supervised.is_stopped().await {
                serving.push(i);
            }
        }
        if serving.len() < 2 {
            return None;
        }
        Some(*self.rng().pick(&serving))
    }

    fn slot_index(&self, slot: &str) -> usize {
        self.workers
            .iter()
            .position(|w| w.slot == slot)
            .expect("a worker slot")
    }

    async fn pick_running<'a>(&self, slots: &'a [Supervised]) -> Option<&'a Supervised> {
        let mut candidates = Vec::new();
        for slot in slots {
            if slot.running().await.is_some() && !slot.is_stopped().await {
                candidates.push(slot);
            }
        }
        if candidates.is_empty() {
            return None;
        }
        Some(*self.rng().pick(&candidates))
    }
}
