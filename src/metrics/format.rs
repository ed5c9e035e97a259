//! The exposition formats of `/metrics`: which one a scraper's `Accept` asks for, and the
//! OpenMetrics text the registry writes turned into the Prometheus text format 0.0.4.

/// An exposition format of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 (`application/openmetrics-text`).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (`text/plain`), what scrapers that do not ask for
    /// OpenMetrics parse (promtool, prometheus_client's parser, older Prometheus).
    Text004,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a weight (q) above 0 and at least that of any
    /// other type it accepts; text 0.0.4 otherwise (no header, `*/*`, `text/plain`).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut other) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "" => {}
                _ => other = other.max(q),
            }
        }
        match openmetrics > 0.0 && openmetrics >= other {
            true => Self::OpenMetrics,
            false => Self::Text004,
        }
    }

    /// The `Content-Type` of a reply in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::Text004 => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4: a counter's HELP and TYPE name
/// its samples (`x_total`, where OpenMetrics names the family `x`), an info family is a
/// gauge `x_info`, and there are no UNIT lines nor `# EOF`. Without this a 0.0.4 parser
/// sees samples of families it has no HELP nor TYPE for ("no help text"), and counters
/// as untyped.
pub(super) fn text_004(openmetrics: &str) -> String {
    let types: std::collections::HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        let Some((prefix, rest)) = descriptor else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
        let (suffix, tail) = match (types.get(name).copied(), prefix) {
            (Some("counter"), _) => ("_total", tail),
            (Some("info"), "# TYPE ") => ("_info", "gauge"),
            (Some("info"), _) => ("_info", tail),
            _ => ("", tail),
        };
        out.push_str(&format!("{prefix}{name}{suffix} {tail}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn openmetrics_is_served_only_to_a_scraper_that_prefers_it() {
        use Format::*;
        for (accept, format) in [
            (None, Text004),
            (Some(""), Text004),
            (Some("*/*"), Text004),
            (Some("text/plain; version=0.0.4"), Text004),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text;version=1.0.0"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3,*/*;q=0.2"),
                OpenMetrics,
            ),
            (
                Some("text/plain,application/openmetrics-text;q=0.9"),
                Text004,
            ),
            (Some("application/openmetrics-text;q=0"), Text004),
            (Some("Application/OpenMetrics-Text"), OpenMetrics),
            (Some("application/openmetrics-text;q=nonsense"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), format, "{accept:?}");
        }
    }

    #[test]
    fn text_004_names_counter_families_by_their_samples_and_drops_what_it_lacks() {
        let m = Metrics::new();
        m.record_enqueued(["job"].into_iter());
        let openmetrics = m.encode(Format::OpenMetrics);
        assert!(openmetrics.contains("# TYPE outbox_intents_enqueued counter\n"));
        assert!(openmetrics.ends_with("# EOF\n"));
        let text = m.encode(Format::Text004);
        assert!(text.contains("# HELP outbox_intents_enqueued_total Intents recorded"));
        assert!(text.contains("# TYPE outbox_intents_enqueued_total counter\n"));
        assert!(text.contains("outbox_intents_enqueued_total{kind=\"other\"} 1\n"));
        assert!(text.contains("# TYPE outbox_intents gauge\n"));
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"));
        // Only the descriptors change (the process's own figures move between scrapes).
        let samples = |t: &str| {
            t.lines()
                .filter(|l| !l.starts_with('#') && !l.starts_with("process_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(samples(&text), samples(&openmetrics));
        assert_eq!(
            text_004("# HELP x_info Build.\n# TYPE x info\nx_info{v=\"1\"} 1\n# EOF\n"),
            "# HELP x_info Build.\n# TYPE x_info gauge\nx_info{v=\"1\"} 1\n"
        );
    }
}
