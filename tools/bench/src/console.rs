//! The operator console's pages (`--only console`): an outbox of `--console-intents`
//! intents seeded by SQL (mostly PENDING over the past day, a delivered history, a few
//! thousand NEEDS_RECONCILE and DEAD_LETTERED, three tenants, six kinds, three regions),
//! a server with the console on a loopback port, and each page requested over HTTP by a
//! signed-in operator: wall time from the request sent to the last byte of the page.

use std::time::Instant;

use anyhow::{Context, bail, ensure};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::harness::{Cluster, TENANT, create_key};
use crate::meter::Meter;
use crate::report::{Hist, Outcome, Row};
use crate::server::ServerProcess;
use crate::suite::{PAYLOAD_PAD, Sizes, Target, prepare_outbox, vacuum};

/// Scenario key of the rows.
const KEY: &str = "console";

/// The issue's target for a page with a million intents in the table.
const TARGET_MS: f64 = 100.0;

/// The tenants of the seeded intents, 70%, 20% and 10% of them: the operate key is the
/// first's.
const TENANTS: [&str; 3] = [TENANT, "bench-billing", "bench-search"];

/// The kinds, evenly.
const KINDS: [&str; 6] = [
    "order.created",
    "order.paid",
    "invoice.issued",
    "email.send",
    "webhook.deliver",
    "search.reindex",
];

/// The regions: '' (any worker) and eu 40% each, us 20%.
const REGIONS: [&str; 5] = ["", "", "eu", "eu", "us"];

/// Intents per row of the delivered history: one Ack of a batch enqueued in one call.
const HISTORY_BATCH: u64 = 100;

/// What the table's console rows are, for its notes.
pub const NOTE: &str = "**console**: an outbox seeded by SQL (INSERT … SELECT \
    generate_series, UUIDv7 ids of their enqueue times, then VACUUM ANALYZE and a \
    CHECKPOINT): 74.4% PENDING enqueued evenly over the past 24 h (3% of them retried once \
    or twice, due within 10 min), 20% delivered in the batch history (Acks of 100 intents \
    enqueued together, over the past 23 h) and 5% delivered with an idempotency key, kept \
    in the live table, 0.2% NEEDS_RECONCILE, 0.3% DEAD_LETTERED (a tenth of each heads an \
    ordering key: a blocked key), 0.1% LEASED; tenants 70/20/10%, six kinds, regions \
    any/eu/us 40/40/20%; two queue policies. outboxd serves the console on a loopback port \
    (`OUTBOX_CONSOLE__LISTEN_ADDR`); this process signs in (`POST /sign-in`) with a key of \
    scope operate for the largest tenant, then with one for every tenant, and GETs each \
    page in turn, the pages round-robin, one request at a time over one keep-alive \
    HTTP/1.1 connection (hyper), timing each from the request sent to the page's last \
    byte; each page's first request (cold connections, and pages of the table not yet \
    in shared buffers) is timed apart from the figures, in the row's text. \
    `/intents/<id>` asks for random ids of the key's tenants: live ones (any state of the \
    live table) and delivered ones (the batch history). The target is the issue's: under \
    100 ms per page with 1M intents.";

/// The line of the run's header that gives the console scenario's sizes.
pub fn describe(sizes: &Sizes) -> String {
    let m = Mix::of(sizes.console_intents);
    format!(
        "console: {} intents seeded ({} PENDING, {} delivered, {} NEEDS_RECONCILE, {} \
         DEAD_LETTERED, {} LEASED), {} requests of each page per key",
        sizes.console_intents,
        m.pending,
        m.history + m.keyed,
        m.reconcile,
        m.dead,
        m.leased,
        sizes.console_requests
    )
}

/// How many intents of each kind the seeded outbox holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mix {
    pending: u64,
    /// Delivered into the batch history, a multiple of [`HISTORY_BATCH`].
    history: u64,
    /// Delivered with an idempotency key, kept in the live table.
    keyed: u64,
    reconcile: u64,
    dead: u64,
    leased: u64,
}

impl Mix {
    fn of(total: u64) -> Self {
        let history = total / 5 / HISTORY_BATCH * HISTORY_BATCH;
        let (keyed, reconcile, dead, leased) =
            (total / 20, total / 500, total * 3 / 1000, total / 1000);
        Self {
            pending: total - history - keyed - reconcile - dead - leased,
            history,
            keyed,
            reconcile,
            dead,
            leased,
        }
    }
}

/// SQL of the `n`th intent's tenant, kind and region (`n` a bigint expression).
fn tenant_of(n: &str) -> String {
    format!(
        "(CASE WHEN {n} % 10 < 7 THEN '{}' WHEN {n} % 10 < 9 THEN '{}' ELSE '{}' END)",
        TENANTS[0], TENANTS[1], TENANTS[2]
    )
}

fn kind_of(n: &str) -> String {
    format!(
        "(ARRAY['{}'])[1 + ({n} / 10) % {}]",
        KINDS.join("', '"),
        KINDS.len()
    )
}

fn region_of(n: &str) -> String {
    format!(
        "(ARRAY['{}'])[1 + ({n} / 60) % {}]",
        REGIONS.join("', '"),
        REGIONS.len()
    )
}

/// SQL of the payload and headers of the `n`th intent: the other scenarios' padded JSON,
/// and a W3C traceparent as the SDKs send.
fn payload_of(n: &str) -> String {
    format!(
        "convert_to('{{\"n\":' || {n} || ',\"pad\":\"' || repeat('x', {PAYLOAD_PAD}) || '\"}}', \
         'UTF8')"
    )
}

fn headers_of(n: &str) -> String {
    format!(
        "jsonb_build_object('traceparent', '00-' || md5({n}::text) || '-' \
         || substr(md5({n}::text || 's'), 1, 16) || '-01')"
    )
}

/// A UUIDv7 of an instant, as outboxd mints them (random after the milliseconds): the
/// overview's chart and the history's buckets read the enqueue time from the id.
const UUID_V7: &str = r#"
    CREATE FUNCTION pg_temp.bench_uuid_v7(at timestamptz) RETURNS uuid
    LANGUAGE sql VOLATILE
    AS $$
        SELECT encode(set_byte(overlay(r PLACING substring(int8send(
                   floor(extract(epoch FROM at) * 1000)::bigint) FROM 3) FROM 1 FOR 6),
                   6, (get_byte(r, 6) & 15) | 112), 'hex')::uuid
        FROM (SELECT uuid_send(gen_random_uuid()) AS r) x
    $$
"#;

/// Fills the outbox at `url` with the [`Mix`] of `total` intents: one INSERT … SELECT
/// generate_series per part, then VACUUM ANALYZE (as autovacuum would have left a table
/// that grew this way, and so that it does not run during the measurement).
async fn seed(url: &str, total: u64) -> anyhow::Result<Mix> {
    let mix = Mix::of(total);
    let mut owner = PgConnection::connect(url).await?;
    sqlx::query(UUID_V7).execute(&mut owner).await?;
    let level =
        |tenant: &str, kind: &str| format!("hashtextextended({tenant} || '/' || {kind}, 0)");

    // PENDING, enqueued evenly over the past day, oldest first (so ids ascend as in a
    // table that grew this way); 3% failed once or twice and wait out a backoff.
    let (tenant, kind, region) = (tenant_of("g"), kind_of("g"), region_of("g"));
    sqlx::query(&format!(
        r#"
        INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, headers,
                                   state, attempts, max_attempts, available_at, created_at,
                                   updated_at, last_error, level_key)
        SELECT pg_temp.bench_uuid_v7(at.t), {tenant}, {kind}, {region}, {payload},
               'application/json', {headers}, 'pending', at.r, 5,
               CASE WHEN at.r > 0 THEN now() + interval '1 second' * (g % 600) ELSE at.t END,
               at.t,
               CASE WHEN at.r > 0 THEN greatest(at.t, now() - interval '1 second' * (g % 60))
                    ELSE at.t END,
               CASE WHEN at.r > 0 THEN 'HTTP 503 Service Unavailable from the downstream' END,
               {level}
        FROM generate_series(1, $1::bigint) AS g,
             LATERAL (SELECT now() - interval '24 hours' * (1 - g::float8 / $1) AS t,
                             CASE WHEN g % 100 < 3 THEN 1 + g % 2 ELSE 0 END AS r) AS at
        "#,
        payload = payload_of("g"),
        headers = headers_of("g"),
        level = level(&tenant, &kind),
    ))
    .bind(mix.pending as i64)
    .execute(&mut owner)
    .await
    .context("inserting the PENDING intents")?;

    // Delivered with an idempotency key: kept in the live table for the key's window.
    sqlx::query(&format!(
        r#"
        INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, headers,
                                   idempotency_key, state, attempts, max_attempts,
                                   available_at, created_at, updated_at, lease_id, worker_id,
                                   finished_at, level_key)
        SELECT pg_temp.bench_uuid_v7(at.t), {tenant}, {kind}, {region}, {payload},
               'application/json', {headers}, 'order-' || g, 'delivered', 1, 5, at.t, at.t,
               at.f, gen_random_uuid(), 'worker-' || g % 8, at.f, {level}
        FROM generate_series(1, $1::bigint) AS g,
             LATERAL (SELECT now() - interval '23 hours' * (1 - g::float8 / $1) AS t) AS t0,
             LATERAL (SELECT t0.t AS t, t0.t + interval '1 ms' * (200 + g % 3000) AS f) AS at
        "#,
        payload = payload_of("g"),
        headers = headers_of("g"),
        level = level(&tenant, &kind),
    ))
    .bind(mix.keyed as i64)
    .execute(&mut owner)
    .await
    .context("inserting the delivered intents with a key")?;

    // The operator's queues and a few live leases, at random times of the day: a tenth
    // of the NEEDS_RECONCILE and DEAD_LETTERED intents head an ordering key (blocked).
    sqlx::query(&format!(
        r#"
        INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, headers,
                                   state, attempts, max_attempts, available_at, created_at,
                                   updated_at, lease_id, lease_expires_at, worker_id,
                                   last_error, ordering_key, txn_xid, order_ts, order_seq,
                                   level_key)
        SELECT pg_temp.bench_uuid_v7(at.t), {tenant}, {kind}, {region}, {payload},
               'application/json', {headers}, s.state, s.attempts, 5, at.t, at.t,
               at.t + interval '1 second' * (30 + g % 600), gen_random_uuid(),
               CASE WHEN s.state = 'leased' THEN now() + interval '1 hour' END,
               'worker-' || g % 8, s.error, o.key,
               CASE WHEN o.key IS NOT NULL THEN pg_current_xact_id() END,
               CASE WHEN o.key IS NOT NULL THEN at.t END,
               CASE WHEN o.key IS NOT NULL THEN g END,
               {level}
        FROM generate_series(1, $1::bigint + $2 + $3) AS g,
             LATERAL (SELECT now() - interval '24 hours' * random() AS t) AS at,
             LATERAL (SELECT CASE WHEN g <= $1 THEN 'needs_reconcile'
                                  WHEN g <= $1 + $2 THEN 'dead_lettered'
                                  ELSE 'leased' END::outbox.intent_state AS state) AS s0,
             LATERAL (SELECT s0.state,
                             CASE s0.state WHEN 'dead_lettered' THEN 5 ELSE 1 END AS attempts,
                             CASE s0.state
                                 WHEN 'needs_reconcile'
                                     THEN 'lease expired after the external call started'
                                 WHEN 'dead_lettered'
                                     THEN 'HTTP 500 Internal Server Error from '
                                          || 'https://hooks.example.com/orders'
                             END AS error) AS s,
             LATERAL (SELECT CASE WHEN s.state <> 'leased' AND g % 10 = 0
                                  THEN 'customer-' || g END AS key) AS o
        "#,
        payload = payload_of("g"),
        headers = headers_of("g"),
        level = level(&tenant, &kind),
    ))
    .bind(mix.reconcile as i64)
    .bind(mix.dead as i64)
    .bind(mix.leased as i64)
    .execute(&mut owner)
    .await
    .context("inserting the operator's queues")?;

    // The delivered history: each row one Ack of a batch enqueued in one call (one tenant
    // and region, the same millisecond, so one bucket), delivered two seconds later.
    let (tenant, region, kind) = (tenant_of("b"), region_of("b"), kind_of("k"));
    sqlx::query(&format!(
        r#"
        INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids, items)
        SELECT outbox.history_bucket(d.id), d.tenant, d.region, d.f,
               array_agg(d.id ORDER BY d.id),
               array_agg(ROW(d.id, d.tenant, d.kind, d.region, d.payload, 'application/json',
                             d.headers, NULL, 'delivered', 1, 5, d.t, d.t, d.f,
                             gen_random_uuid(), NULL, 'worker-' || d.b % 8, NULL, NULL, d.f,
                             NULL)::outbox.delivered_intent_v1 ORDER BY d.id)
        FROM (
            SELECT b, {tenant} AS tenant, {region} AS region, {kind} AS kind, at.t,
                   at.t + interval '2 seconds' AS f, pg_temp.bench_uuid_v7(at.t) AS id,
                   {payload} AS payload, {headers} AS headers
            FROM generate_series(1, $1::bigint) AS b,
                 LATERAL (SELECT date_trunc('milliseconds',
                                            now() - interval '23 hours' * (1 - b::float8 / $1))
                          AS t) AS at,
                 generate_series(1, $2::bigint) AS k
        ) d
        GROUP BY outbox.history_bucket(d.id), d.b, d.tenant, d.region, d.t, d.f
        "#,
        payload = payload_of("(b * 1000 + k)"),
        headers = headers_of("(b * 1000 + k)"),
    ))
    .bind((mix.history / HISTORY_BATCH) as i64)
    .bind(HISTORY_BATCH as i64)
    .execute(&mut owner)
    .await
    .context("inserting the delivered history")?;

    // Two queue policies, as operators set them: a paused kind and a limited one.
    sqlx::query(
        "INSERT INTO outbox.queue_policy (tenant_id, kind, paused, max_in_flight, updated_by,
                                          reason, updated_at)
         VALUES ($1, 'webhook.deliver', true, NULL, 'outboxd-bench', 'downstream outage', now()),
                ($1, 'email.send', false, 50, 'outboxd-bench', 'provider rate limit', now())",
    )
    .bind(TENANT)
    .execute(&mut owner)
    .await?;
    owner.close().await?;
    vacuum(url).await?;
    Ok(mix)
}

/// Random ids of `tenant` (`None`: any) for `/intents/<id>`: `n` of the live table and `n`
/// of the delivered history.
async fn sample_ids(
    url: &str,
    tenant: Option<&str>,
    n: usize,
) -> anyhow::Result<(Vec<Uuid>, Vec<Uuid>)> {
    let mut owner = PgConnection::connect(url).await?;
    let live = sqlx::query_scalar(
        "SELECT id FROM outbox.intent WHERE $1::text IS NULL OR tenant_id = $1
         ORDER BY random() LIMIT $2",
    )
    .bind(tenant)
    .bind(n as i64)
    .fetch_all(&mut owner)
    .await?;
    let delivered = sqlx::query_scalar(
        "SELECT ids[1 + floor(random() * cardinality(ids))::int] FROM outbox.delivered_batch
         WHERE $1::text IS NULL OR tenant_id = $1
         ORDER BY random() LIMIT $2",
    )
    .bind(tenant)
    .bind(n as i64)
    .fetch_all(&mut owner)
    .await?;
    owner.close().await?;
    Ok((live, delivered))
}

type Http = Client<HttpConnector, Full<Bytes>>;

/// A signed-in operator of the console at `base`.
struct Operator {
    http: Http,
    base: String,
    cookie: String,
}

impl Operator {
    /// `POST /sign-in` with `key`; keeps the session cookie of the answer.
    async fn sign_in(base: &str, key: &str) -> anyhow::Result<Self> {
        let http: Http = Client::builder(TokioExecutor::new()).build_http();
        let request = Request::post(format!("{base}/sign-in"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Full::new(Bytes::from(format!("key={key}"))))?;
        let answer = http.request(request).await.context("POST /sign-in")?;
        ensure!(
            answer.status() == StatusCode::SEE_OTHER,
            "POST /sign-in answered {}",
            answer.status()
        );
        let cookie = answer
            .headers()
            .get_all(header::SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| v.split(';').next())
            .find(|c| c.starts_with("outboxd_session="))
            .context("POST /sign-in set no session cookie")?
            .to_owned();
        answer.into_body().collect().await?;
        Ok(Self {
            http,
            base: base.to_owned(),
            cookie,
        })
    }

    /// `GET path`: the page, and the time from the request sent to its last byte.
    async fn get(&self, path: &str) -> anyhow::Result<(Bytes, std::time::Duration)> {
        let request = Request::get(format!("{}{path}", self.base))
            .header(header::COOKIE, &self.cookie)
            .body(Full::default())?;
        let t = Instant::now();
        let answer = self
            .http
            .request(request)
            .await
            .with_context(|| format!("GET {path}"))?;
        let status = answer.status();
        let body = answer.into_body().collect().await?.to_bytes();
        let elapsed = t.elapsed();
        if status != StatusCode::OK {
            let text = String::from_utf8_lossy(&body);
            bail!(
                "GET {path} answered {status}: {}",
                text.chars().take(300).collect::<String>()
            );
        }
        Ok((body, elapsed))
    }
}

/// One page the scenario requests: its row's name and its paths, one per request in turn.
struct Page {
    name: &'static str,
    paths: Vec<String>,
    /// A list of intents, whose rows the row counts.
    listing: bool,
    hist: Hist,
    /// Intent links and bytes of the first answer.
    first: Option<(usize, usize)>,
    /// The first request's time, apart: it pays for cold connections and buffers.
    cold: Option<std::time::Duration>,
}

impl Page {
    fn new(name: &'static str, listing: bool, paths: Vec<String>) -> Self {
        Self {
            name,
            paths,
            listing,
            hist: Hist::new(),
            first: None,
            cold: None,
        }
    }

    /// What the first answer held, for the row: `50 rows, 38 KiB`.
    fn held(&self) -> String {
        let (links, bytes) = self.first.unwrap_or_default();
        let kib = bytes as f64 / 1024.0;
        if self.listing {
            format!("{links} rows, {kib:.0} KiB")
        } else {
            format!("{kib:.0} KiB")
        }
    }
}

/// The console scenario's rows: each page's request time, for an operate key of the
/// largest tenant and one of every tenant.
pub async fn console(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let total = sizes.console_intents;
    let target = prepare_outbox(cluster, admin, database).await?;
    eprintln!("outboxd-bench: outboxd seeding {total} intents for the console");
    let t0 = Instant::now();
    seed(&target.owner_url, total).await?;
    eprintln!(
        "outboxd-bench: seeded and VACUUM ANALYZEd in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let owner = outboxd::startup::connect(&target.owner_url, 2).await?;
    let tenant_key = create_key(&owner, "bench-operator", "operate").await?;
    let (_, every_key) = outboxd::auth::issue_key(
        &owner,
        "bench-operator-all",
        None,
        vec!["operate".to_owned()],
        Vec::new(),
    )
    .await?;
    owner.close().await;

    meter.checkpoint().await?;
    let server = ServerProcess::spawn(
        &target.service_url,
        &target.fleet_url,
        &[("OUTBOX_CONSOLE__LISTEN_ADDR", "127.0.0.1:0")],
    )
    .await?;
    let measured = measure_keys(&server, &target, sizes, &tenant_key, &every_key, rows).await;
    server.stop().await?;
    measured
}

async fn measure_keys(
    server: &ServerProcess,
    target: &Target,
    sizes: &Sizes,
    tenant_key: &str,
    every_key: &str,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let base = server
        .console
        .as_deref()
        .context("the outboxd child serves no console")?;
    for (key, tenant, who) in [
        (
            tenant_key,
            Some(TENANT),
            format!("operate key of tenant {TENANT}"),
        ),
        (every_key, None, "operate key of every tenant".to_owned()),
    ] {
        eprintln!(
            "outboxd-bench: outboxd console pages, {who}, {} requests each",
            sizes.console_requests
        );
        let n = sizes.console_requests;
        let (live, delivered) = sample_ids(&target.owner_url, tenant, n).await?;
        ensure!(
            !live.is_empty() && !delivered.is_empty(),
            "no intent of the seeded outbox to ask for"
        );
        let by_id = |ids: &[Uuid]| -> Vec<String> {
            ids.iter().map(|id| format!("/intents/{id}")).collect()
        };
        let one = |path: &str| vec![path.to_owned()];
        let mut pages = [
            Page::new("GET / (overview)", false, one("/")),
            Page::new("GET /intents", true, one("/intents")),
            Page::new(
                "GET /intents?state=NEEDS_RECONCILE",
                true,
                one("/intents?state=NEEDS_RECONCILE"),
            ),
            Page::new("GET /intents/<id>, live", false, by_id(&live)),
            Page::new(
                "GET /intents/<id>, delivered (history)",
                false,
                by_id(&delivered),
            ),
            Page::new("GET /desk", true, one("/desk")),
            Page::new("GET /queues (blocked keys)", true, one("/queues")),
        ];
        let operator = Operator::sign_in(base, key).await?;
        // Round-robin, so that the machine's moments fall on every page alike; one round
        // more first, timed apart.
        for i in 0..=n {
            for page in &mut pages {
                let path = &page.paths[i % page.paths.len()];
                let (body, elapsed) = operator.get(path).await?;
                if page.cold.is_none() {
                    page.cold = Some(elapsed);
                } else {
                    page.hist.record(elapsed);
                }
                page.first.get_or_insert_with(|| {
                    let links = String::from_utf8_lossy(&body)
                        .matches("href=\"/intents/")
                        .count();
                    (links, body.len())
                });
            }
        }
        for page in pages {
            let within = |ms: f64| if ms < TARGET_MS { "within" } else { "OVER" };
            let p99 = page.hist.ms(0.99);
            let cold = page.cold.unwrap_or_default().as_secs_f64() * 1e3;
            let verdict = format!(
                "p99 {} the {TARGET_MS} ms target; first request {cold:.0} ms, {}",
                within(p99),
                within(cold)
            );
            rows.push(Row {
                system: "outboxd".to_owned(),
                key: KEY.to_owned(),
                scenario: format!("console {}: {}; {who} ({verdict})", page.name, page.held()),
                intents: page.hist.len(),
                seconds: 0.0,
                throughput: false,
                latency: Some(("GET → last byte".to_owned(), page.hist)),
                cost: None,
                outcome: Outcome::Ran,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_adds_up_and_is_mostly_pending() {
        for total in [1_000_000, 20_000, 1_234] {
            let m = Mix::of(total);
            assert_eq!(
                m.pending + m.history + m.keyed + m.reconcile + m.dead + m.leased,
                total
            );
            assert_eq!(m.history % HISTORY_BATCH, 0);
            assert!(m.pending * 2 > total, "{m:?}");
        }
        let m = Mix::of(1_000_000);
        assert_eq!((m.reconcile, m.dead), (2_000, 3_000));
    }
}
