//! Reporting: exact percentiles of small samples ([`Summary`]), HDR histograms of large
//! ones ([`Hist`]), and the combined table of `all` ([`Row`]).

use std::time::Duration;

use hdrhistogram::Histogram;

use crate::meter::Cost;

/// Percentiles of one scenario, nearest-rank over the sorted samples (exact, and the
/// sample counts here are small enough that no histogram is needed).
pub struct Summary {
    pub name: &'static str,
    pub iterations: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    pub max: f64,
    /// Samples below zero (see [`signed_ms`](crate::txn_latency::signed_ms)).
    pub negative: usize,
}

impl Summary {
    pub fn of(name: &'static str, mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let rank = |p: f64| samples[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            name,
            iterations: n,
            p50: rank(50.0),
            p90: rank(90.0),
            p99: rank(99.0),
            max: samples[n - 1],
            negative: samples.iter().filter(|&&s| s < 0.0).count(),
        }
    }

    pub fn print_table(rows: &[Self]) {
        println!("| scenario | iterations | p50 ms | p90 ms | p99 ms | max ms |");
        println!("|---|---:|---:|---:|---:|---:|");
        for r in rows {
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.name, r.iterations, r.p50, r.p90, r.p99, r.max
            );
        }
    }
}

/// A latency histogram in microseconds (1 µs to 1 h, 3 significant digits), with the
/// count of negative samples (an answer that arrived before the instant it is measured
/// from), which are recorded as 0.
pub struct Hist {
    h: Histogram<u64>,
    pub negative: u64,
}

impl Hist {
    pub fn new() -> Self {
        Self {
            h: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            negative: 0,
        }
    }

    pub fn record(&mut self, d: Duration) {
        self.record_us(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    pub fn record_us(&mut self, us: u64) {
        self.h.saturating_record(us.max(1));
    }

    /// Records a signed latency in milliseconds (see `txn_latency::signed_ms`).
    pub fn record_signed_ms(&mut self, ms: f64) {
        if ms < 0.0 {
            self.negative += 1;
            self.h.saturating_record(1);
        } else {
            self.record_us((ms * 1e3).round() as u64);
        }
    }

    pub fn merge(&mut self, other: &Self) {
        self.h.add(&other.h).expect("same bounds");
        self.negative += other.negative;
    }

    pub fn len(&self) -> u64 {
        self.h.len()
    }

    /// Value at quantile `q` (0..=1), in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.h.value_at_quantile(q) as f64 / 1e3
    }

    pub fn max_ms(&self) -> f64 {
        self.h.max() as f64 / 1e3
    }
}

/// Whether a row has figures or says why not.
pub enum Outcome {
    Ran,
    NotRun(String),
}

/// One line of the combined table.
pub struct Row {
    /// outboxd, raw SQL (pgbench), graphile-worker, pg-boss.
    pub system: String,
    /// Scenario key: rows of the same key are compared with outboxd's.
    pub key: String,
    /// Human-readable scenario.
    pub scenario: String,
    /// Intents handled (enqueued, drained or delivered).
    pub intents: u64,
    /// Wall-clock seconds of the measured section; throughput = intents / seconds.
    pub seconds: f64,
    /// Report the throughput (throughput scenarios) or leave it blank (latency ones).
    pub throughput: bool,
    /// What the latency measures, and the samples.
    pub latency: Option<(String, Hist)>,
    pub cost: Option<Cost>,
    pub outcome: Outcome,
}

impl Row {
    pub fn not_run(system: &str, key: &str, scenario: &str, why: impl Into<String>) -> Self {
        Self {
            system: system.to_owned(),
            key: key.to_owned(),
            scenario: scenario.to_owned(),
            intents: 0,
            seconds: 0.0,
            throughput: false,
            latency: None,
            cost: None,
            outcome: Outcome::NotRun(why.into()),
        }
    }

    fn rate(&self) -> Option<f64> {
        (self.throughput && self.seconds > 0.0 && matches!(self.outcome, Outcome::Ran))
            .then(|| self.intents as f64 / self.seconds)
    }
}

/// `x` with a precision suited to its size.
fn num(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 0.1 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "n/a".to_owned(), num)
}

/// Prints the combined markdown table; ratios compare each row's throughput with
/// outboxd's row of the same key.
pub fn print_rows(rows: &[Row]) {
    println!(
        "| system | scenario | intents | intents/s | × outboxd | latency of | p50 ms | p99 ms | \
         max ms | app CPU s/1k | PG CPU s/1k | commits/1k | write txns/1k | WAL KiB/1k |"
    );
    println!("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        if let Outcome::NotRun(why) = &row.outcome {
            println!(
                "| {} | {} | | | | not run: {why} | | | | | | | | |",
                row.system, row.scenario
            );
            continue;
        }
        let rate = row.rate();
        let base = rows
            .iter()
            .find(|r| r.system == "outboxd" && r.key == row.key)
            .and_then(Row::rate);
        let ratio = match (rate, base) {
            (Some(r), Some(b)) if row.system != "outboxd" => format!("{:.2}", r / b),
            _ => String::new(),
        };
        let (what, p50, p99, max) = match &row.latency {
            Some((what, h)) if h.len() > 0 => (
                what.clone(),
                num(h.ms(0.5)),
                num(h.ms(0.99)),
                num(h.max_ms()),
            ),
            _ => ("–".to_owned(), String::new(), String::new(), String::new()),
        };
        let per_k = |x: Option<f64>| {
            opt(x
                .filter(|_| row.intents > 0)
                .map(|x| x * 1000.0 / row.intents as f64))
        };
        let (app, pg, commits, writes, wal) = match &row.cost {
            Some(c) => (
                per_k(c.app_cpu),
                per_k(c.pg_cpu),
                per_k(c.commits),
                per_k(c.writes),
                per_k(c.wal_bytes.map(|b| b / 1024.0)),
            ),
            None => Default::default(),
        };
        println!(
            "| {} | {} | {} | {} | {ratio} | {what} | {p50} | {p99} | {max} | {app} | {pg} | \
             {commits} | {writes} | {wal} |",
            row.system,
            row.scenario,
            row.intents,
            rate.map(|r| format!("{r:.0}")).unwrap_or_default(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Summary::of("x", (1..=100).rev().map(f64::from).collect());
        assert_eq!((s.p50, s.p90, s.p99, s.max), (50.0, 90.0, 99.0, 100.0));
        let one = Summary::of("x", vec![3.0]);
        assert_eq!((one.p50, one.p99, one.max), (3.0, 3.0, 3.0));
    }

    #[test]
    fn histogram_reports_milliseconds_and_counts_negatives() {
        let mut h = Hist::new();
        for us in 1..=1000 {
            h.record_us(us);
        }
        h.record_signed_ms(-0.5);
        assert_eq!(h.negative, 1);
        assert_eq!(h.len(), 1001);
        assert!((h.ms(0.5) - 0.5).abs() < 0.01, "{}", h.ms(0.5));
        assert!((h.max_ms() - 1.0).abs() < 0.01);
    }
}
