//! The `process_*` metrics: CPU time, memory, threads and file descriptors of this
//! process, read from procfs at each scrape.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The process's CPU time, memory and file descriptors (the `process_*` metrics of the
/// Prometheus client libraries), read from `/proc/self` at each scrape. Written here because
/// no maintained collector exists for prometheus-client (the `metrics` crate's one
/// needs that other library), and the reading is a few files. Elsewhere than Linux it
/// exports nothing.
#[derive(Debug)]
pub(super) struct ProcessCollector;

/// What `/proc/self` says of this process.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    start_time_seconds: i64,
    threads: i64,
    open_fds: i64,
    max_fds: i64,
}

impl ProcessStats {
    /// Reads them, or `None` where there is no `/proc/self/stat` (not Linux).
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        let page = rustix::param::page_size() as i64;
        let mut stats = Self::parse(&stat, &boot_time, &limits, ticks, page)?;
        stats.open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as i64);
        Some(stats)
    }

    /// From the text of `/proc/self/stat`, `/proc/stat` and `/proc/self/limits`.
    fn parse(stat: &str, system: &str, limits: &str, ticks: f64, page: i64) -> Option<Self> {
        // The command name (field 2) may hold spaces and parentheses: fields resume after
        // the last ')'. `fields[0]` is then field 3, the state.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
        let boot: f64 = system
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        let max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Some(Self {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            threads: field(20)? as i64,
            start_time_seconds: (boot + field(22)? / ticks) as i64,
            virtual_bytes: field(23)? as i64,
            resident_bytes: field(24)? as i64 * page,
            open_fds: 0,
            max_fds,
        })
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(p) = ProcessStats::read() else {
            return Ok(());
        };
        ConstCounter::new(p.cpu_seconds).encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                p.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                p.virtual_bytes,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                p.start_time_seconds,
            ),
            (
                "process_threads",
                "Number of OS threads in the process",
                p.threads,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                p.max_fds,
            ),
        ] {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_stats_are_read_from_procfs_text_even_with_a_strange_command_name() {
        let stat = "4242 (out box) d) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 150 0 0 20 0 7 0 12345 1000000 300 18446744073709551615";
        let system = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        let stats = ProcessStats::parse(stat, system, limits, 100.0, 4096).unwrap();
        assert_eq!(
            stats,
            ProcessStats {
                cpu_seconds: 4.0,
                resident_bytes: 300 * 4096,
                virtual_bytes: 1_000_000,
                start_time_seconds: 1_700_000_123,
                threads: 7,
                open_fds: 0,
                max_fds: 1024,
            }
        );
        assert_eq!(
            ProcessStats::parse("garbage", system, limits, 100.0, 4096),
            None
        );
        let live = ProcessStats::read().expect("Linux");
        assert!(live.resident_bytes > 0 && live.open_fds > 0 && live.threads > 0);
    }
}
