//! Batched settles: Acks and Fails wait `settle_delay` for company and go out as one call
//! each (never naming an intent twice), retried on transient failures with the same items
//! (the server answers a repeat as a replay). Every item's result is applied on its own: a
//! lost lease is counted as lost, a refusal is logged, neither fails its neighbours.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tonic::Code;

use super::lease::LeaseState;
use super::{Answer, LOST_REASONS, LeaseCall, MAX_BATCH, Shared, proto_duration};
use crate::connection::{Attempts, CallOptions};
use crate::error::Error;
use crate::proto::{self, FailOutcome, LeaseResult};

/// The longest `retry_after` sent.
const LONGEST_RETRY_AFTER: Duration = Duration::from_secs(366 * 86_400);

/// Settle calls in flight at once.
const FLUSHES_IN_FLIGHT: usize = 4;

/// Longest `error` text sent with a Fail, in characters: the server's default
/// `OUTBOX_LIMITS__MAX_TEXT_LENGTH` (the Python and TypeScript SDKs cut at the same).
const MAX_ERROR_CHARS: usize = 4096;

/// Most bytes of one settle call: half the server's default request limit for `Fail`
/// (`OUTBOX_LIMITS__MAX_MESSAGE_BYTES`, 8 MiB).
const MAX_CALL_BYTES: usize = 4 * 1024 * 1024;

/// What to report for one lease.
#[derive(Debug)]
pub(crate) enum Outcome {
    Ack,
    Fail {
        outcome: FailOutcome,
        error: String,
        retry_after: Option<Duration>,
    },
}

impl Outcome {
    /// The call that reports it, as a [`WorkerObserver`](super::WorkerObserver) names it.
    fn call(&self) -> LeaseCall {
        match self {
            Self::Ack => LeaseCall::Ack,
            Self::Fail { outcome, .. } => LeaseCall::Fail(*outcome),
        }
    }
}

/// A lease and what to report for it.
#[derive(Debug)]
pub(crate) struct Settle {
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) outcome: Outcome,
}

impl Settle {
    /// About what it adds to its call on the wire: the ids, the error text (at most four
    /// bytes a character) and the framing.
    fn bytes(&self) -> usize {
        let text = match &self.outcome {
            Outcome::Ack => 0,
            Outcome::Fail { error, .. } => error.chars().take(MAX_ERROR_CHARS).count() * 4,
        };
        self.lease.intent_id.len() + self.lease.lease_id.len() + text + 64
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Ack,
    Fail,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Self::Ack => "Ack",
            Self::Fail => "Fail",
        }
    }
}

/// Collects settles until the channel closes, then waits for the calls in flight.
pub(crate) async fn settle_loop(shared: Arc<Shared>, mut settles: mpsc::UnboundedReceiver<Settle>) {
    let in_flight = Arc::new(Semaphore::new(FLUSHES_IN_FLIGHT));
    let mut flushes = JoinSet::new();
    while let Some(first) = settles.recv().await {
        if !shared.config.settle_delay.is_zero() {
            tokio::time::sleep(shared.config.settle_delay).await;
        }
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match settles.try_recv() {
                Ok(settle) => batch.push(settle),
                Err(_) => break,
            }
        }
        while flushes.try_join_next().is_some() {}
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        let shared = shared.clone();
        flushes.spawn(async move {
            shared.flush(batch).await;
            drop(permit);
        });
    }
    while flushes.join_next().await.is_some() {}
}

impl Shared {
    async fn flush(&self, batch: Vec<Settle>) {
        let mut acks = Vec::new();
        let mut fails = Vec::new();
        for settle in batch {
            if settle.lease.is_lost() {
                // Lost while waiting: someone else may hold the intent now.
                self.forget(&settle.lease);
            } else if matches!(settle.outcome, Outcome::Ack) {
                acks.push(settle);
            } else {
                fails.push(settle);
            }
        }
        let acks = async {
            for chunk in distinct_intents(acks) {
                self.settle(Call::Ack, chunk).await;
            }
        };
        let fails = async {
            for chunk in distinct_intents(fails) {
                self.settle(Call::Fail, chunk).await;
            }
        };
        tokio::join!(acks, fails);
    }

    async fn settle(&self, call: Call, items: Vec<Settle>) {
        let mut attempts = Attempts::default();
        match self.send(call, &items, &mut attempts).await {
            Ok(results) => self.apply(call, &items, &results, &attempts),
            // One bad item refuses the whole call: settle each alone, so the others apply.
            Err(error) if error.code() == Some(Code::InvalidArgument) && items.len() > 1 => {
                for item in items {
                    let item = [item];
                    let mut attempts = Attempts::default();
                    match self.send(call, &item, &mut attempts).await {
                        Ok(results) => self.apply(call, &item, &results, &attempts),
                        Err(error) => self.settle_failed(call, &item, &error, &attempts),
                    }
                }
            }
            Err(error) => self.settle_failed(call, &items, &error, &attempts),
        }
    }

    async fn send(
        &self,
        call: Call,
        items: &[Settle],
        attempts: &mut Attempts,
    ) -> Result<Vec<LeaseResult>, Error> {
        for settle in items {
            settle.lease.set_settling();
        }
        self.observe(|o| {
            for settle in items {
                o.sending(settle.lease.id(), settle.outcome.call());
            }
        });
        let timeout = self.connection.call_timeout();
        // Repeating a settle with the same leases is a replay: answered OK if it applied.
        let options =
            CallOptions::new(self.lease_call_timeout()).budget(self.config.lease.max(timeout));
        match call {
            Call::Ack => {
                let request = proto::AckRequest {
                    leases: items.iter().map(|s| s.lease.reference()).collect(),
                };
                let answer = self
                    .connection
                    .call_traced(options, attempts, |mut client| {
                        let request = request.clone();
                        async move { client.ack(request).await }
                    })
                    .await?;
                Ok(answer.results)
            }
            Call::Fail => {
                let request = proto::FailRequest {
                    failures: items.iter().map(failure).collect(),
                };
                let answer = self
                    .connection
                    .call_traced(options, attempts, |mut client| {
                        let request = request.clone();
                        async move { client.fail(request).await }
                    })
                    .await?;
                Ok(answer.results)
            }
        }
    }

    fn apply(&self, call: Call, items: &[Settle], results: &[LeaseResult], attempts: &Attempts) {
        let mut done = 0;
        for (index, settle) in items.iter().enumerate() {
            if let Some(result) = results.get(index) {
                self.observe(|o| {
                    let answer = Answer {
                        result: Ok(result),
                        attempts,
                    };
                    o.answered(settle.lease.id(), settle.outcome.call(), &answer);
                });
            }
            match results.get(index).map(|r| r.error.as_ref()) {
                Some(None) => done += 1,
                Some(Some(error)) if LOST_REASONS.contains(&error.reason.as_str()) => {
                    self.lose(
                        &settle.lease,
                        &format!("{} refused: {}", call.name(), error.reason),
                    );
                }
                Some(Some(error)) => {
                    self.stats.settle_errors.add(1);
                    tracing::error!(
                        worker = %self.config.worker_id,
                        intent = %settle.lease.intent_id,
                        reason = %error.reason,
                        "outboxd {} refused: {}",
                        call.name(),
                        error.message
                    );
                }
                None => {
                    self.stats.settle_errors.add(1);
                    tracing::error!(
                        worker = %self.config.worker_id,
                        intent = %settle.lease.intent_id,
                        "outboxd {} answered without a result for this item",
                        call.name()
                    );
                }
            }
            self.forget(&settle.lease);
        }
        match call {
            Call::Ack => self.stats.acked.add(done),
            Call::Fail => self.stats.failed.add(done),
        }
    }

    /// No answer within the budget: the leases expire and the intents come back (or go to
    /// an operator, once submitted).
    fn settle_failed(&self, call: Call, items: &[Settle], error: &Error, attempts: &Attempts) {
        tracing::error!(
            worker = %self.config.worker_id,
            count = items.len(),
            "outboxd {} failed: {error}",
            call.name()
        );
        self.stats.settle_errors.add(items.len() as u64);
        for settle in items {
            self.observe(|o| {
                let answer = Answer {
                    result: Err(error),
                    attempts,
                };
                o.answered(settle.lease.id(), settle.outcome.call(), &answer);
            });
            self.forget(&settle.lease);
        }
    }
}

fn failure(settle: &Settle) -> proto::Failure {
    let Outcome::Fail {
        outcome,
        error,
        retry_after,
    } = &settle.outcome
    else {
        unreachable!("only Fail outcomes are sent with Fail");
    };
    proto::Failure {
        lease: Some(settle.lease.reference()),
        error: fail_text(error),
        outcome: *outcome as i32,
        retry_after: match outcome {
            // Within the server's default OUTBOX_LIMITS__MAX_DELAY (366 days), as the other
            // SDKs cut it: a longer one would have the whole Fail refused.
            FailOutcome::Retry => retry_after
                .map(|d| proto_duration(d.clamp(Duration::from_millis(1), LONGEST_RETRY_AFTER))),
            _ => None,
        },
    }
}

/// The `error` of a Fail as the server accepts it: every control character (a multi-line
/// message's newlines, tabs) becomes a space and the text is cut to [`MAX_ERROR_CHARS`]
/// characters. Refused text would refuse the Fail, and the intent would wait out its lease.
pub(crate) fn fail_text(error: &str) -> String {
    error
        .chars()
        .take(MAX_ERROR_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Splits settles into calls of at most `MAX_BATCH` items and [`MAX_CALL_BYTES`] that never
/// name one intent twice (a batch naming an intent twice is refused whole, and so is one
/// over the server's request limit: a thousand Fails with long non-ASCII texts would be).
fn distinct_intents(items: Vec<Settle>) -> Vec<Vec<Settle>> {
    let mut batches: Vec<(HashSet<String>, usize, Vec<Settle>)> = Vec::new();
    for item in items {
        let id = item.lease.intent_id.clone();
        let bytes = item.bytes();
        let slot = batches.iter().position(|(ids, size, batch)| {
            batch.len() < MAX_BATCH && size + bytes <= MAX_CALL_BYTES && !ids.contains(&id)
        });
        let index = slot.unwrap_or_else(|| {
            batches.push((HashSet::new(), 0, Vec::new()));
            batches.len() - 1
        });
        batches[index].0.insert(id);
        batches[index].1 += bytes;
        batches[index].2.push(item);
    }
    batches.into_iter().map(|(_, _, batch)| batch).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settle(intent: &str, lease: &str) -> Settle {
        Settle {
            lease: Arc::new(LeaseState::new(
                intent.into(),
                lease.into(),
                tokio::time::Instant::now(),
            )),
            outcome: Outcome::Ack,
        }
    }

    #[test]
    fn fails_with_long_texts_are_split_into_calls_the_server_accepts() {
        let long: String = "é".repeat(MAX_ERROR_CHARS * 2);
        let fails: Vec<Settle> = (0..MAX_BATCH)
            .map(|n| Settle {
                outcome: Outcome::Fail {
                    outcome: FailOutcome::Retry,
                    error: long.clone(),
                    retry_after: None,
                },
                ..settle(&n.to_string(), &n.to_string())
            })
            .collect();
        let batches = distinct_intents(fails);
        assert!(batches.len() > 1);
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), MAX_BATCH);
        for batch in &batches {
            let request = proto::FailRequest {
                failures: batch.iter().map(failure).collect(),
            };
            assert!(prost::Message::encoded_len(&request) <= MAX_CALL_BYTES);
        }
    }

    #[test]
    fn a_call_never_names_one_intent_twice() {
        let batches = distinct_intents(vec![settle("a", "1"), settle("b", "2"), settle("a", "3")]);
        let ids: Vec<Vec<&str>> = batches
            .iter()
            .map(|b| b.iter().map(|s| s.lease.lease_id.as_str()).collect())
            .collect();
        assert_eq!(ids, [vec!["1", "2"], vec!["3"]]);
    }

    #[test]
    fn fail_text_turns_control_characters_into_spaces_and_cuts_on_characters() {
        assert_eq!(
            fail_text("line one\nline\ttwo\r\n\u{7f}\u{85}end"),
            "line one line two    end"
        );
        assert_eq!(fail_text("déjà vu"), "déjà vu");
        let long = "é".repeat(MAX_ERROR_CHARS + 10);
        let cut = fail_text(&long);
        assert_eq!(cut.chars().count(), MAX_ERROR_CHARS);
        assert_eq!(cut, "é".repeat(MAX_ERROR_CHARS));
    }
}
