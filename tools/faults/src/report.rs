//! The summary table printed at the end of a run: faults injected by kind, what happened
//! to the intents, every guarantee's violation count, and the duplicates by cause.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use crate::checker::{Guarantee, Verdict};
use crate::faults::{FaultKind, FaultRecord};
use crate::processes::UnexpectedExit;

/// Everything the table shows.
pub struct Summary<'a> {
    /// Seed of the run.
    pub seed: u64,
    /// Faults phase length.
    pub duration: Duration,
    /// How long the drain took (None: it did not finish).
    pub drain: Option<Duration>,
    /// Live intents left when the drain gave up.
    pub undrained: Vec<(String, i64)>,
    /// Shape of the run: replicas, workers, producers, small pool.
    pub shape: String,
    /// Every fault injected.
    pub faults: &'a [FaultRecord],
    /// Standing faults: (label, detail).
    pub standing: Vec<(String, String)>,
    /// Proxy counters: connections, resets, bytes dropped.
    pub proxy: (u64, u64, u64),
    /// Exits nobody asked for, by slot kind.
    pub exits: &'a [UnexpectedExit],
    /// The checks.
    pub verdict: &'a Verdict,
    /// NEEDS_RECONCILE resolved after the checks: (delivered, dead, refused).
    pub reconciled: (u64, u64, u64),
    /// Ordered intents the run's operator decided to release their keys.
    pub released: crate::run::Released,
}

impl Summary<'_> {
    /// Whether every guarantee held and the run completed.
    pub fn passed(&self) -> bool {
        self.verdict.violations.is_empty()
            && self.drain.is_some()
            && self.reconciled.2 == 0
            && !self.exits.iter().any(|e| !e.name.starts_with('r'))
    }

    /// The table, as text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let v = self.verdict;
        let c = &v.counts;
        let mut table = Table::default();
        let _ = writeln!(
            out,
            "\noutboxd fault-injection suite: seed {}, {} s of faults under load, drain {}, {}",
            self.seed,
            self.duration.as_secs(),
            match self.drain {
                Some(d) => format!("{:.1} s", d.as_secs_f64()),
                None => "DID NOT FINISH".to_owned(),
            },
            self.shape
        );

        table.section("Faults injected");
        let mut by_kind: BTreeMap<FaultKind, u64> = BTreeMap::new();
        for f in self.faults {
            *by_kind.entry(f.kind).or_default() += 1;
        }
        for kind in FaultKind::INJECTED {
            let n = by_kind.get(&kind).copied().unwrap_or(0);
            let note = match kind {
                FaultKind::LostResponses => format!(
                    "{} connections reset, {} response bytes dropped",
                    self.proxy.1, self.proxy.2
                ),
                _ if n == 0 => "not injected this run".to_owned(),
                _ => String::new(),
            };
            table.row(kind.label(), n.to_string(), note);
        }
        for (label, detail) in &self.standing {
            table.row(label, "whole run".to_owned(), detail.clone());
        }

        table.section("Producer transactions");
        table.row(
            "committed (per the producer's own rows)",
            c.txn_committed.to_string(),
            String::new(),
        );
        table.row(
            "rolled back by the producer",
            c.txn_rolled_back.to_string(),
            String::new(),
        );
        table.row(
            "died after Enqueue (kill, terminated backend, crash)",
            c.txn_died.to_string(),
            String::new(),
        );

        table.section("Intents");
        let state = |s: &str| c.states.get(s).copied().unwrap_or(0);
        let total: u64 = c.states.values().sum();
        table.row(
            "produced (rows in outbox.all_intents)",
            total.to_string(),
            String::new(),
        );
        table.row(
            "  two-phase, transaction committed",
            c.two_phase_committed.to_string(),
            String::new(),
        );
        table.row(
            "  two-phase, transaction aborted",
            c.two_phase_aborted.to_string(),
            String::new(),
        );
        table.row(
            "  direct",
            c.direct.to_string(),
            format!(
                "{} acknowledged, {} enqueues never answered",
                c.direct_acknowledged, c.direct_unknown
            ),
        );
        table.row("delivered", state("delivered").to_string(), String::new());
        table.row(
            "discarded",
            state("discarded").to_string(),
            "= aborted transactions".into(),
        );
        table.row(
            "dead-lettered",
            state("dead_lettered").to_string(),
            "Fail PERMANENT or attempts used up".into(),
        );
        table.row(
            "needing reconcile",
            state("needs_reconcile").to_string(),
            format!(
                "resolved after the checks: {} delivered, {} dead, {} refused",
                self.reconciled.0, self.reconciled.1, self.reconciled.2
            ),
        );
        table.row(
            "  with an ordering key",
            c.ordered.to_string(),
            format!("{} keys", c.ordering_keys),
        );
        let r = &self.released;
        table.row(
            "ordered heads an operator released during the run",
            (r.dead_letters + r.delivered + r.dead).to_string(),
            format!(
                "dead letters released {}, NEEDS_RECONCILE delivered {} / dead {}; {} refused \
                 (moved meanwhile)",
                r.dead_letters, r.delivered, r.dead, r.refused
            ),
        );
        let live: u64 = ["staged", "pending", "leased", "submitted", "waiting"]
            .iter()
            .map(|s| state(s))
            .sum();
        table.row(
            "still live after the drain (must be 0)",
            live.to_string(),
            String::new(),
        );

        table.section("Guarantees (every count must be 0)");
        let count = |g: Guarantee| v.violations.iter().filter(|x| x.guarantee == g).count();
        table.row(
            "lost",
            count(Guarantee::NoneLost).to_string(),
            "committed/acknowledged, not delivered, dead-lettered or reconcile".into(),
        );
        let invalid = count(Guarantee::AbortedNeverClaimed)
            + count(Guarantee::NoOverlappingLeases)
            + count(Guarantee::StaleSettleRejected)
            + count(Guarantee::SubmittedNotReHanded)
            + count(Guarantee::KeyOrder)
            + count(Guarantee::KeyOneAtATime);
        table.row(
            "invalid deliveries",
            invalid.to_string(),
            "sum of the six rows below".into(),
        );
        for g in Guarantee::ALL.into_iter().skip(1) {
            if g == Guarantee::HolderAckRefused {
                table.row("other contract checks", String::new(), String::new());
            }
            let note = match g {
                Guarantee::NoOverlappingLeases => {
                    format!("{} consecutive lease pairs checked", c.lease_pairs)
                }
                Guarantee::StaleSettleRejected => {
                    format!("{} late Acks refused LEASE_LOST", c.acks_lease_lost)
                }
                Guarantee::KeyOrder => {
                    format!("{} pairs of certain commit order checked", c.order_pairs)
                }
                Guarantee::KeyOneAtATime => {
                    format!("{} lease pairs of one key checked", c.key_lease_pairs)
                }
                Guarantee::ConcurrencyLimit => match &c.in_flight {
                    Some(f) => format!(
                        "{}: most in flight {} (max_in_flight {}; {} moves logged by the database)",
                        f.kind, f.most, f.limit, f.moves
                    ),
                    None => "no limit set".to_owned(),
                },
                Guarantee::RateLimit => match &c.rate {
                    Some(f) => format!(
                        "{}: most in 1 s {} (bound {:.0}); run {} in {:.1} s (bound {:.0}); \
                         worst window {:+.1} vs bound (tolerance {:.1}; claims began up to \
                         {:.1} ms before the bucket's time)",
                        f.kind,
                        f.most_in_second,
                        f.bound(1_000_000),
                        f.leases,
                        f.span_us as f64 / 1e6,
                        f.bound(f.span_us),
                        f.worst_excess,
                        f.tolerance,
                        f.lag_us as f64 / 1e3
                    ),
                    None => "no limit set".to_owned(),
                },
                Guarantee::TenantFairness => match &c.fairness {
                    Some(f) => format!(
                        "{} intents claimable while {} of another tenant waited ({:.1} s): first leased p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                        f.checked,
                        f.backlog,
                        f.backlog_span_us as f64 / 1e6,
                        f.p50_us as f64 / 1e3,
                        f.p99_us as f64 / 1e3,
                        f.max_us as f64 / 1e3
                    ),
                    None => "no backlog".to_owned(),
                },
                _ => String::new(),
            };
            table.row(&format!("  {}", g.label()), count(g).to_string(), note);
        }

        table.section("Deliveries");
        table.row(
            "leases taken",
            c.leases.to_string(),
            format!("{} found lost by the worker, then left alone", c.lost),
        );
        table.row(
            "side effects performed",
            c.performed.to_string(),
            String::new(),
        );
        table.row(
            "Acks: OK / LEASE_LOST / no answer",
            format!("{} / {} / {}", c.acks_ok, c.acks_lease_lost, c.acks_unknown),
            String::new(),
        );
        table.row(
            "OKs read back from another session at once",
            c.read_back.to_string(),
            "MarkSubmitted, Ack, Fail: each committed on arrival".into(),
        );
        table.row(
            "duplicates (at-least-once)",
            v.duplicate_total().to_string(),
            "performed again under a later lease, because:".into(),
        );
        for (cause, n) in &v.duplicates {
            table.row(&format!("  {cause}"), n.to_string(), String::new());
        }

        table.section("Ack latency by replica (answered attempts): p50 / p99 / max ms");
        for (replica, samples) in &c.ack_latency {
            let mut samples = samples.clone();
            samples.sort_unstable();
            let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
            table.row(
                &format!("r{}", replica + 1),
                format!("{:.1} / {:.1} / {:.0}", at(0.5), at(0.99), at(1.0)),
                format!("{} Acks", samples.len()),
            );
        }

        table.section("Client retries of the same request (lost responses, replicas down)");
        for (rpc, n) in &c.retried {
            table.row(
                rpc,
                n.to_string(),
                "calls that needed more than one try".into(),
            );
        }
        table.row(
            "Enqueue retries answered from the idempotency key",
            c.enqueue_replays.to_string(),
            "the lost attempt had been applied".into(),
        );
        table.row(
            "leases returned again by a retried Claim's request_id",
            c.claim_replays.to_string(),
            "minted by the attempt whose response was lost".into(),
        );
        table.row(
            "leases handed off by an Enqueue to a waiting Claim",
            c.handed_off.to_string(),
            "minted with the intent, no claim statement".into(),
        );
        for (error, n) in &c.transient_errors {
            table.row(&format!("  {error}"), n.to_string(), String::new());
        }
        if !self.exits.is_empty() {
            table.section("Processes that exited without being asked (restarted)");
            for e in self.exits {
                table.row(&e.name, e.status.clone(), crate::checker::clock(e.at));
            }
        }
        out.push_str(&table.render());
        if !self.undrained.is_empty() {
            let _ = writeln!(
                out,
                "\nDrain did not finish; live intents left: {:?}",
                self.undrained
            );
        }
        if !v.violations.is_empty() {
            let _ = writeln!(out, "\nViolations ({}; first 40):", v.violations.len());
            for violation in v.violations.iter().take(40) {
                let _ = writeln!(out, "  {violation}");
            }
        }
        let _ = writeln!(
            out,
            "\nRESULT: {}",
            if self.passed() { "PASS" } else { "FAIL" }
        );
        out
    }
}

#[derive(Default)]
struct Table {
    rows: Vec<Option<(String, String, String)>>,
    sections: Vec<(usize, String)>,
}

impl Table {
    fn section(&mut self, title: &str) {
        self.sections.push((self.rows.len(), title.to_owned()));
        self.rows.push(None);
    }

    fn row(&mut self, label: &str, value: String, note: String) {
        self.rows.push(Some((label.to_owned(), value, note)));
    }

    fn render(&self) -> String {
        let label_width = self
            .rows
            .iter()
            .flatten()
            .map(|r| r.0.len())
            .max()
            .unwrap_or(0);
        let value_width = self
            .rows
            .iter()
            .flatten()
            .map(|r| r.1.len())
            .max()
            .unwrap_or(0)
            .max(5);
        let rule = "-".repeat(label_width + value_width + 4);
        let mut out = String::new();
        let mut titles = self.sections.iter();
        for row in &self.rows {
            match row {
                None => {
                    let (_, title) = titles.next().expect("one title per section");
                    let _ = writeln!(out, "\n{title}\n{rule}");
                }
                Some((label, value, note)) => {
                    let note = if note.is_empty() {
                        String::new()
                    } else {
                        format!("  {note}")
                    };
                    let _ = writeln!(out, "{label:<label_width$}  {value:>value_width$}{note}");
                }
            }
        }
        out
    }
}
