//! `GET /`: live counts by state, tenant, kind and region, the oldest waiting intents, and
//! the last hour's enqueued, claimed and delivered intents a minute at a time.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use super::Shared;
use super::session::Session;
use super::view::{self, Chrome};
use crate::outbox::IntentState;
use crate::outbox::store::{self, Minute};

#[derive(Template)]
#[template(path = "console/overview.html")]
struct OverviewPage {
    chrome: Chrome,
    states: Vec<Tally>,
    tenants: Vec<Tally>,
    kinds: Vec<Tally>,
    regions: Vec<Tally>,
    groups: Vec<Group>,
    oldest_pending: String,
    oldest_staged: String,
    chart: Chart,
    /// Some count stopped at its cap: the page says where counts stop.
    at_least: bool,
    /// The caps, as the note says them (`10,000`).
    count_cap: String,
    pending_cap: String,
}

/// A count and the intents page that lists what it counts (none for intents of any
/// region: a filter cannot name them apart).
struct Tally {
    label: String,
    count: String,
    href: Option<String>,
}

struct Group {
    state: String,
    tenant: String,
    kind: String,
    region: String,
    /// `≥ n` when the group's state stopped at its cap.
    count: String,
    /// None for intents without a region: the list filters by one region or by none.
    href: Option<String>,
}

/// The last hour as three polylines in a `WIDTH` × `HEIGHT` box.
struct Chart {
    enqueued: String,
    claimed: String,
    delivered: String,
    max: i64,
    enqueued_total: i64,
    claimed_total: i64,
    delivered_total: i64,
    from: String,
    to: String,
}

const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 120.0;

impl Chart {
    fn of(minutes: &[Minute]) -> Self {
        let max = minutes
            .iter()
            .map(|m| m.enqueued.max(m.claimed).max(m.delivered))
            .max()
            .unwrap_or(0)
            .max(1);
        let step = WIDTH / (minutes.len().max(2) - 1) as f64;
        let line = |value: fn(&Minute) -> i64| {
            minutes
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let y = HEIGHT - (value(m) as f64 / max as f64) * (HEIGHT - 4.0) - 2.0;
                    format!("{:.1},{:.1}", i as f64 * step, y)
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        Self {
            enqueued: line(|m| m.enqueued),
            claimed: line(|m| m.claimed),
            delivered: line(|m| m.delivered),
            max,
            enqueued_total: minutes.iter().map(|m| m.enqueued).sum(),
            claimed_total: minutes.iter().map(|m| m.claimed).sum(),
            delivered_total: minutes.iter().map(|m| m.delivered).sum(),
            from: minutes
                .first()
                .map(|m| view::time(&m.at))
                .unwrap_or_default(),
            to: minutes
                .last()
                .map(|m| view::time(&m.at))
                .unwrap_or_default(),
        }
    }
}

/// `GET /`.
pub(super) async fn page(State(console): State<Shared>, session: Session) -> Response {
    let caller = &session.caller;
    let now = console.clock.now();
    // Two transactions at once: the counts and the chart each take tens of milliseconds
    // at 1M intents.
    let counts = async {
        let mut tx = console.handler.begin_operator(&caller.tenants).await?;
        let overview = store::overview(&mut tx, &caller.regions, now).await?;
        tx.commit().await?;
        Ok::<_, crate::outbox::Error>(overview)
    };
    let chart = async {
        let mut tx = console.handler.begin_operator(&caller.tenants).await?;
        let minutes = store::overview_minutes(&mut tx, &caller.regions, now).await?;
        tx.commit().await?;
        Ok::<_, crate::outbox::Error>(minutes)
    };
    let (overview, minutes) = match tokio::try_join!(counts, chart) {
        Ok(read) => read,
        Err(e) => return view::failure(&e.into()),
    };
    // A count is "at least" when it counts a state whose rows stopped at their cap; the
    // others are exact.
    let capped = |state: IntentState| overview.capped.contains(&state);
    let shown = |n: i64, cut: bool| {
        if cut {
            format!("≥ {n}")
        } else {
            n.to_string()
        }
    };
    let name = |s: IntentState| view::state(crate::proto::v1::IntentState::from(s) as i32);
    let mut by_state: BTreeMap<String, (IntentState, i64)> = BTreeMap::new();
    let mut by = [BTreeMap::new(), BTreeMap::new(), BTreeMap::new()];
    for g in &overview.counts {
        by_state.entry(name(g.state)).or_insert((g.state, 0)).1 += g.count;
        for (map, key) in by.iter_mut().zip([&g.tenant, &g.kind, &g.region]) {
            let (count, cut) = map.entry(key.clone()).or_insert((0i64, false));
            *count += g.count;
            *cut |= capped(g.state);
        }
    }
    let at_least = !overview.capped.is_empty();
    let [tenants, kinds, regions] = by;
    let tally = |param: &str, map: BTreeMap<String, (i64, bool)>| -> Vec<Tally> {
        map.into_iter()
            .map(|(label, (count, cut))| Tally {
                href: (!label.is_empty())
                    .then(|| format!("/intents?{param}={}", query_value(&label))),
                count: shown(count, cut),
                label: if label.is_empty() {
                    "(any)".to_owned()
                } else {
                    label
                },
            })
            .collect()
    };
    let page = OverviewPage {
        chrome: session.chrome("overview"),
        states: by_state
            .into_iter()
            .map(|(label, (state, count))| Tally {
                href: Some(format!("/intents?state={label}")),
                count: shown(count, capped(state)),
                label,
            })
            .collect(),
        tenants: tally("tenant", tenants),
        kinds: tally("kind", kinds),
        regions: tally("region", regions),
        groups: overview
            .counts
            .iter()
            .map(|g| Group {
                state: name(g.state),
                href: (!g.region.is_empty()).then(|| {
                    format!(
                        "/intents?state={}&tenant={}&kind={}&region={}",
                        name(g.state),
                        query_value(&g.tenant),
                        query_value(&g.kind),
                        query_value(&g.region)
                    )
                }),
                tenant: g.tenant.clone(),
                kind: g.kind.clone(),
                region: g.region.clone(),
                count: shown(g.count, capped(g.state)),
            })
            .collect(),
        oldest_pending: overview
            .oldest_pending_at
            .map(|t| view::time(&t))
            .unwrap_or_else(|| "none".to_owned()),
        oldest_staged: overview
            .oldest_staged_at
            .map(|t| view::time(&t))
            .unwrap_or_else(|| "none".to_owned()),
        chart: Chart::of(&minutes),
        at_least,
        count_cap: thousands(store::OVERVIEW_COUNT_CAP),
        pending_cap: thousands(store::OVERVIEW_PENDING_CAP),
    };
    view::render(StatusCode::OK, &page)
}

/// `n` with its thousands set apart: `10,000`.
fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// A value for a URL's query (escaped for HTML by the template).
pub(super) fn query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn thousands_are_set_apart() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(5_000), "5,000");
        assert_eq!(thousands(10_000), "10,000");
        assert_eq!(thousands(-1_234_567), "-1,234,567");
    }
}
