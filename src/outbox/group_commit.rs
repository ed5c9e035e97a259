//! Group commit: calls that arrive while another call of the same group is in its
//! transaction wait for it and then run together, in one transaction, so that PostgreSQL
//! commits (and flushes its WAL) once for all of them instead of once each.
//!
//! A call that finds its group idle runs at once, alone: nothing waits on a timer, so a
//! quiet server answers as fast as without grouping. Each caller still gets its own answer,
//! only after the shared transaction has committed. When the shared transaction fails, every
//! call in it runs again alone, so one bad call (an idempotency conflict, say) fails only
//! itself and never its neighbours; unless it failed in a way that may have committed it
//! (its COMMIT's answer lost): then every call gets that error, as it would alone, and none
//! runs again, which could record it twice.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

/// A call waiting for its turn, with where to send its answer.
struct Waiter<I, O, E> {
    item: Arc<I>,
    answer: oneshot::Sender<Result<O, E>>,
}

/// The groups with a transaction in flight, and the calls waiting behind it.
type Groups<K, I, O, E> = Arc<Mutex<HashMap<K, Vec<Waiter<I, O, E>>>>>;

/// Groups concurrent calls by key `K`. `fits(batch, item)` says whether `item` may join a
/// batch that already holds `batch` (a size limit, no shared idempotency key, …).
pub struct GroupCommit<K, I, O, E> {
    groups: Groups<K, I, O, E>,
    fits: Fits<I>,
    may_have_committed: MayHaveCommitted<E>,
    waiting: Gauge,
}

/// Whether an item may join a batch that already holds the given ones.
type Fits<I> = fn(&[Arc<I>], &I) -> bool;

/// For an error after which a transaction may have committed, the error each of its calls
/// gets instead of running again alone; `None` for an error that rolled it back.
type MayHaveCommitted<E> = fn(&E) -> Option<E>;

impl<K, I, O, E> std::fmt::Debug for GroupCommit<K, I, O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let busy = lock(&self.groups).len();
        f.debug_struct("GroupCommit")
            .field("busy_groups", &busy)
            .finish()
    }
}

impl<K, I, O, E> GroupCommit<K, I, O, E>
where
    K: Hash + Eq + Clone + Send + 'static,
    I: Send + Sync + 'static,
    O: Send + 'static,
    E: From<sqlx::Error> + Send + 'static,
{
    /// A grouper whose batches take items while `fits` allows, and whose failed batches
    /// run each call again alone unless `may_have_committed` gives the error to answer
    /// them all with; `waiting` counts the calls waiting for their group's transaction in
    /// flight.
    pub fn new(fits: Fits<I>, may_have_committed: MayHaveCommitted<E>, waiting: Gauge) -> Self {
        Self {
            groups: Arc::default(),
            fits,
            may_have_committed,
            waiting,
        }
    }

    /// Runs `item` through `run`, in a batch with the calls of group `key` that are
    /// waiting when its turn comes. `run(items)` must do all of them in one transaction and
    /// return one output per item, in order, only after the commit.
    ///
    /// The batch runs in a task of its own, so a caller that goes away (a cancelled RPC)
    /// does not cancel the calls it was carrying.
    ///
    /// # Errors
    /// What `run` answered for this item alone; the error `may_have_committed` gave for
    /// its whole batch; or, if the task running its batch panicked (it may have committed),
    /// what `may_have_committed` gives for `sqlx::Error::WorkerCrashed`, else that error.
    pub async fn submit<F, Fut>(&self, key: K, item: I, run: F) -> Result<O, E>
    where
        F: Fn(Vec<Arc<I>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<O>, E>> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let waiter = Waiter {
            item: Arc::new(item),
            answer,
        };
        let first = {
            let mut groups = lock(&self.groups);
            match groups.get_mut(&key) {
                Some(waiting) => {
                    waiting.push(waiter);
                    self.waiting.inc();
                    None
                }
                None => {
                    groups.insert(key.clone(), Vec::new());
                    Some(waiter)
                }
            }
        };
        if let Some(first) = first {
            tokio::spawn(drive(
                Arc::clone(&self.groups),
                key,
                vec![first],
                (self.fits, self.may_have_committed),
                self.waiting.clone(),
                run,
            ));
        }
        answered.await.unwrap_or_else(|_| {
            let crashed = E::from(sqlx::Error::WorkerCrashed);
            Err((self.may_have_committed)(&crashed).unwrap_or(crashed))
        })
    }
}

/// Runs `batch`, then batches of whoever waited meanwhile, until the group is idle.
async fn drive<K, I, O, E, F, Fut>(
    groups: Groups<K, I, O, E>,
    key: K,
    mut batch: Vec<Waiter<I, O, E>>,
    (fits, may_have_committed): (Fits<I>, MayHaveCommitted<E>),
    waiting_gauge: Gauge,
    run: F,
) where
    K: Hash + Eq,
    E: From<sqlx::Error>,
    F: Fn(Vec<Arc<I>>) -> Fut,
    Fut: Future<Output = Result<Vec<O>, E>>,
{
    let mut group = Driving {
        groups,
        key,
        waiting_gauge,
        armed: true,
    };
    loop {
        run_batch(batch, may_have_committed, &run).await;
        let mut groups = lock(&group.groups);
        let Some(waiting) = groups.get_mut(&group.key).filter(|w| !w.is_empty()) else {
            groups.remove(&group.key);
            drop(groups);
            group.armed = false;
            return;
        };
        batch = take_batch(waiting, fits);
        group.waiting_gauge.dec_by(batch.len() as i64);
    }
}

/// The group a driver serves. Dropped before the driver emptied it (it panicked), it
/// removes the group: its waiting calls, which never ran, are answered `WorkerCrashed`
/// (the calls of the batch that panicked find their channels closed instead), and the next
/// call starts the group afresh instead of waiting behind a driver that is gone.
struct Driving<K: Hash + Eq, I, O, E: From<sqlx::Error>> {
    groups: Groups<K, I, O, E>,
    key: K,
    waiting_gauge: Gauge,
    armed: bool,
}

impl<K: Hash + Eq, I, O, E: From<sqlx::Error>> Drop for Driving<K, I, O, E> {
    fn drop(&mut self) {
        if self.armed
            && let Some(waiting) = lock(&self.groups).remove(&self.key)
        {
            self.waiting_gauge.dec_by(waiting.len() as i64);
            for waiter in waiting {
                let _ = waiter.answer.send(Err(sqlx::Error::WorkerCrashed.into()));
            }
        }
    }
}

/// The waiting calls that go next: in arrival order, each that fits the batch so far.
fn take_batch<I, O, E>(waiting: &mut Vec<Waiter<I, O, E>>, fits: Fits<I>) -> Vec<Waiter<I, O, E>> {
    let mut items: Vec<Arc<I>> = Vec::new();
    let mut batch = Vec::new();
    let mut later = Vec::new();
    for waiter in waiting.drain(..) {
        if items.is_empty() || fits(&items, &waiter.item) {
            items.push(Arc::clone(&waiter.item));
            batch.push(waiter);
        } else {
            later.push(waiter);
        }
    }
    *waiting = later;
    batch
}

/// One transaction for the whole batch; on a failure that rolled it back, one for each of
/// its calls.
async fn run_batch<I, O, E, F, Fut>(
    batch: Vec<Waiter<I, O, E>>,
    may_have_committed: MayHaveCommitted<E>,
    run: &F,
) where
    E: From<sqlx::Error>,
    F: Fn(Vec<Arc<I>>) -> Fut,
    Fut: Future<Output = Result<Vec<O>, E>>,
{
    if batch.len() > 1 {
        let items = batch.iter().map(|w| Arc::clone(&w.item)).collect();
        match run(items).await {
            Ok(outputs) if outputs.len() == batch.len() => {
                for (waiter, output) in batch.into_iter().zip(outputs) {
                    // A caller that went away no longer wants its answer; its work is done.
                    let _ = waiter.answer.send(Ok(output));
                }
                return;
            }
            Err(e) => {
                let errors: Option<Vec<E>> = batch.iter().map(|_| may_have_committed(&e)).collect();
                if let Some(errors) = errors {
                    for (waiter, error) in batch.into_iter().zip(errors) {
                        let _ = waiter.answer.send(Err(error));
                    }
                    return;
                }
            }
            // Committed, but the answers cannot be matched to the calls: running them
            // again would record them twice.
            Ok(outputs) => {
                let (calls, answers) = (batch.len(), outputs.len());
                for waiter in batch {
                    let _ = waiter.answer.send(Err(sqlx::Error::Protocol(format!(
                        "a batch of {calls} calls committed with {answers} answers"
                    ))
                    .into()));
                }
                return;
            }
        }
    }
    let mut left = NotRun(batch.into());
    while let Some(waiter) = left.0.pop_front() {
        let alone = run(vec![Arc::clone(&waiter.item)]).await.and_then(|mut o| {
            o.pop()
                .ok_or_else(|| sqlx::Error::Protocol("a batch of one gave no answer".into()).into())
        });
        let _ = waiter.answer.send(alone);
    }
}

/// Calls of a failed batch still to run alone. Dropped with some left (the one before them
/// panicked), those are answered `WorkerCrashed`: they never ran, so nothing of theirs was
/// written (the one that panicked finds its channel closed: it may have committed).
struct NotRun<I, O, E: From<sqlx::Error>>(VecDeque<Waiter<I, O, E>>);

impl<I, O, E: From<sqlx::Error>> Drop for NotRun<I, O, E> {
    fn drop(&mut self) {
        for waiter in self.0.drain(..) {
            let _ = waiter.answer.send(Err(sqlx::Error::WorkerCrashed.into()));
        }
    }
}

/// The map stays consistent whatever panicked while holding it (each critical section is
/// a single insert, push or removal).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::Notify;

    type Grouper = GroupCommit<&'static str, u32, u32, sqlx::Error>;

    fn at_most_three(batch: &[Arc<u32>], _: &u32) -> bool {
        batch.len() < 3
    }

    /// An I/O error stands for a COMMIT whose answer was lost; any other rolled back.
    fn lost_commit(e: &sqlx::Error) -> Option<sqlx::Error> {
        matches!(e, sqlx::Error::Io(_)).then(|| sqlx::Error::Io(std::io::Error::other("lost")))
    }

    /// A crashed batch's calls: their outcome unknown (an I/O error stands for it).
    fn crash_unknown(e: &sqlx::Error) -> Option<sqlx::Error> {
        matches!(e, sqlx::Error::WorkerCrashed)
            .then(|| sqlx::Error::Io(std::io::Error::other("outcome unknown")))
    }

    fn waiting(grouper: &Grouper, key: &str) -> usize {
        lock(&grouper.groups).get(key).map_or(0, Vec::len)
    }

    /// Yields until `condition` holds; a grouper that never gets there fails the test
    /// after ten seconds instead of hanging it.
    async fn until(what: &str, condition: impl Fn() -> bool) {
        let wait = async {
            while !condition() {
                tokio::task::yield_now().await;
            }
        };
        if tokio::time::timeout(std::time::Duration::from_secs(10), wait)
            .await
            .is_err()
        {
            panic!("still waiting after 10 s for {what}");
        }
    }

    /// A batch whose task panicked may have committed: its calls get what
    /// `may_have_committed` says of `WorkerCrashed`; the calls waiting behind it never ran
    /// and get `WorkerCrashed` itself.
    #[tokio::test]
    async fn a_panicked_batch_may_have_committed_and_its_waiters_never_ran() {
        let grouper = Arc::new(Grouper::new(|_, _| false, crash_unknown, Gauge::default()));
        let gate = Arc::new(Notify::new());
        let run = {
            let gate = Arc::clone(&gate);
            move |items: Vec<Arc<u32>>| {
                let gate = Arc::clone(&gate);
                async move {
                    gate.notified().await;
                    assert_ne!(*items[0], 1, "a bug in the batch's task");
                    Ok(items.iter().map(|i| **i).collect())
                }
            }
        };
        let submit = |n: u32| {
            let (grouper, run) = (Arc::clone(&grouper), run.clone());
            tokio::spawn(async move { grouper.submit("k", n, run).await })
        };
        let first = submit(1);
        until("the first batch running", || {
            lock(&grouper.groups).contains_key("k")
        })
        .await;
        let second = submit(2);
        until("the second call waiting", || waiting(&grouper, "k") == 1).await;
        gate.notify_one();
        let first = first.await.unwrap();
        assert!(matches!(first, Err(sqlx::Error::Io(_))), "{first:?}");
        let second = second.await.unwrap();
        assert!(
            matches!(second, Err(sqlx::Error::WorkerCrashed)),
            "{second:?}"
        );
    }

    /// A failed batch's calls run again alone, in turn: one that panics may have
    /// committed; those after it never ran.
    #[tokio::test]
    async fn a_panic_running_a_call_alone_leaves_the_calls_after_it_never_run() {
        let grouper = Arc::new(Grouper::new(at_most_three, crash_unknown, Gauge::default()));
        let gate = Arc::new(Notify::new());
        let run = {
            let gate = Arc::clone(&gate);
            move |items: Vec<Arc<u32>>| {
                let gate = Arc::clone(&gate);
                async move {
                    match items.len() {
                        1 if *items[0] == 0 => gate.notified().await,
                        1 => assert_ne!(*items[0], 2, "a bug running a call alone"),
                        // The shared transaction rolled back: each runs again alone.
                        _ => return Err(sqlx::Error::RowNotFound),
                    }
                    Ok(items.iter().map(|i| **i).collect())
                }
            }
        };
        let submit = |n: u32| {
            let (grouper, run) = (Arc::clone(&grouper), run.clone());
            tokio::spawn(async move { grouper.submit("k", n, run).await })
        };
        // 0 holds the group while 2 and 3 queue behind it, to run together.
        let first = submit(0);
        until("the first running", || {
            lock(&grouper.groups).contains_key("k")
        })
        .await;
        let (second, third) = (submit(2), submit(3));
        until("two waiting", || waiting(&grouper, "k") == 2).await;
        gate.notify_one();
        assert!(matches!(first.await.unwrap(), Ok(0)));
        let second = second.await.unwrap();
        assert!(matches!(second, Err(sqlx::Error::Io(_))), "{second:?}");
        let third = third.await.unwrap();
        assert!(
            matches!(third, Err(sqlx::Error::WorkerCrashed)),
            "{third:?}"
        );
    }

    #[tokio::test]
    async fn calls_arriving_during_a_transaction_run_together_in_the_next_one() {
        let grouper = Arc::new(Grouper::new(at_most_three, lost_commit, Gauge::default()));
        let gate = Arc::new(Notify::new());
        let batches: Arc<Mutex<Vec<Vec<u32>>>> = Arc::default();
        let run = {
            let (gate, batches) = (Arc::clone(&gate), Arc::clone(&batches));
            move |items: Vec<Arc<u32>>| {
                let (gate, batches) = (Arc::clone(&gate), Arc::clone(&batches));
                async move {
                    let values: Vec<u32> = items.iter().map(|i| **i).collect();
                    let first = lock(&batches).is_empty();
                    lock(&batches).push(values.clone());
                    if first {
                        // The first transaction stays open until every other call queued.
                        gate.notified().await;
                    }
                    Ok(values.iter().map(|v| v * 10).collect())
                }
            }
        };
        let first = tokio::spawn({
            let (g, run) = (Arc::clone(&grouper), run.clone());
            async move { g.submit("t", 1, run).await }
        });
        until("the first batch to start", || !lock(&batches).is_empty()).await;
        let mut rest = Vec::new();
        for v in 2..=5 {
            let (g, run) = (Arc::clone(&grouper), run.clone());
            rest.push(tokio::spawn(async move { g.submit("t", v, run).await }));
        }
        until("four calls to wait", || waiting(&grouper, "t") >= 4).await;
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap(), 10);
        for (v, call) in (2..=5).zip(rest) {
            assert_eq!(call.await.unwrap().unwrap(), v * 10);
        }
        assert_eq!(
            *lock(&batches),
            vec![vec![1], vec![2, 3, 4], vec![5]],
            "the first runs alone, then up to three of those that waited, then the rest"
        );
        assert!(lock(&grouper.groups).is_empty(), "the group ends idle");
    }

    /// What a run answers, from its number (0 for the first) and its items.
    type Answer = fn(usize, &[Arc<u32>]) -> Result<Vec<u32>, sqlx::Error>;

    /// Submits 1, then `rest` while 1's transaction is held open, so that they run
    /// together next. Returns 1's answer, each of `rest`'s, and how many runs there were.
    async fn one_then_a_batch_of(
        rest: [u32; 3],
        answer: Answer,
    ) -> (
        Result<u32, sqlx::Error>,
        Vec<Result<u32, sqlx::Error>>,
        usize,
    ) {
        let grouper = Arc::new(Grouper::new(at_most_three, lost_commit, Gauge::default()));
        let gate = Arc::new(Notify::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let run = {
            let (gate, runs) = (Arc::clone(&gate), Arc::clone(&runs));
            move |items: Vec<Arc<u32>>| {
                let (gate, runs) = (Arc::clone(&gate), Arc::clone(&runs));
                async move {
                    let number = runs.fetch_add(1, Ordering::SeqCst);
                    if number == 0 {
                        gate.notified().await;
                    }
                    answer(number, &items)
                }
            }
        };
        let first = tokio::spawn({
            let (g, run) = (Arc::clone(&grouper), run.clone());
            async move { g.submit("t", 1, run).await }
        });
        until("the first run to start", || runs.load(Ordering::SeqCst) > 0).await;
        let mut waiting_calls = Vec::new();
        for v in rest {
            let (g, run) = (Arc::clone(&grouper), run.clone());
            waiting_calls.push(tokio::spawn(async move { g.submit("t", v, run).await }));
        }
        until("three calls to wait", || waiting(&grouper, "t") >= 3).await;
        gate.notify_one();
        let first = first.await.unwrap();
        let mut answers = Vec::new();
        for call in waiting_calls {
            answers.push(call.await.unwrap());
        }
        (first, answers, runs.load(Ordering::SeqCst))
    }

    #[tokio::test]
    async fn a_failing_batch_runs_each_call_alone_so_only_the_bad_one_fails() {
        let (first, rest, runs) = one_then_a_batch_of([12, 13, 14], |_, items| {
            if items.iter().any(|i| **i == 13) {
                return Err(sqlx::Error::RowNotFound);
            }
            Ok(items.iter().map(|i| **i).collect())
        })
        .await;
        assert_eq!(first.unwrap(), 1);
        for (v, answer) in [12, 13, 14].into_iter().zip(rest) {
            if v == 13 {
                assert!(matches!(answer, Err(sqlx::Error::RowNotFound)));
            } else {
                assert_eq!(answer.unwrap(), v);
            }
        }
        // 1 alone, the failed batch of three, then each of the three alone.
        assert_eq!(runs, 5);
    }

    #[tokio::test]
    async fn a_batch_that_may_have_committed_answers_each_call_its_error_and_runs_none_again() {
        let (first, rest, runs) = one_then_a_batch_of([2, 3, 4], |number, items| {
            if number == 0 {
                return Ok(items.iter().map(|i| **i).collect());
            }
            Err(sqlx::Error::Io(std::io::Error::other("connection reset")))
        })
        .await;
        assert_eq!(first.unwrap(), 1);
        for answer in rest {
            assert!(matches!(answer, Err(sqlx::Error::Io(_))));
        }
        // 1 alone, then the batch of three, whose calls are not run again.
        assert_eq!(runs, 2);
    }

    #[tokio::test]
    async fn groups_of_other_keys_do_not_wait_for_each_other() {
        let grouper = Arc::new(Grouper::new(at_most_three, lost_commit, Gauge::default()));
        let gate = Arc::new(Notify::new());
        let run_blocked = {
            let gate = Arc::clone(&gate);
            move |items: Vec<Arc<u32>>| {
                let gate = Arc::clone(&gate);
                async move {
                    gate.notified().await;
                    Ok(items.iter().map(|i| **i).collect())
                }
            }
        };
        let blocked = tokio::spawn({
            let g = Arc::clone(&grouper);
            async move { g.submit("a", 1, run_blocked).await }
        });
        let other = grouper
            .submit("b", 2, |items: Vec<Arc<u32>>| async move {
                Ok(items.iter().map(|i| **i).collect())
            })
            .await;
        assert_eq!(other.unwrap(), 2);
        gate.notify_one();
        assert_eq!(blocked.await.unwrap().unwrap(), 1);
    }
}
