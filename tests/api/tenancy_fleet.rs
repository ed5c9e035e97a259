//! Tenant isolation against outboxd itself: the request-serving role sees only the tenants
//! its transaction names with their proof, whatever else it sets, and only a role granted
//! `outboxd_fleet` (the fleet pool's) sees every tenant (docs/tenancy.md).

use std::time::Duration;

use outboxd::proto::v1::{self, FailOutcome, IntentState};
use outboxd::startup;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::helpers::{
    SERVICE_ROLE, TENANT, TestApp, assert_item_ok, claim_request, duration, failure, id_of, intent,
    lease_ref, populate_globex,
};

/// Every relation a tenant's rows can be read through.
const RELATIONS: &[&str] = &[
    "outbox.intent",
    "outbox.delivered_batch",
    "outbox.resolution",
    "outbox.all_intents",
];

/// What a session of the service role might set to see more than its tenants: the old
/// cross-tenant switch (transaction-local, through the functions' own scope, for the
/// session), tenant lists that name no tenant or look like a wildcard, and globex named
/// without its proof.
const ATTEMPTS: &[&str] = &[
    "SELECT set_config('outbox.cross_tenant', 'on', true)",
    "SELECT set_config('outbox.cross_tenant', 'on', true), set_config('outbox.tenants', 'acme', true)",
    "SELECT outbox.enter_scope('', 'on')",
    "SET outbox.cross_tenant = 'on'",
    "SELECT set_config('outbox.tenants', '', true)",
    "SELECT set_config('outbox.tenants', '*', true)",
    "SELECT set_config('outbox.tenants', '%', true)",
    "SELECT set_config('outbox.tenants', ',', true), set_config('outbox.cross_tenant', 'true', true)",
    "SELECT set_config('outbox.tenants', 'globex', true)",
    "SELECT outbox.enter_scope('globex', '')",
    "SELECT outbox.enter_scope('globex', 'on')",
    "SELECT outbox.enter_scope('globex', repeat('0', 64))",
];

/// The attempts, acme's own proven scope, and acme's proof (which a session may have seen)
/// borrowed for globex, for a list that adds globex, and for a longer list that starts with
/// acme's.
async fn attempts(app: &TestApp) -> Vec<String> {
    let proof = app.scope_proof("acme").await;
    let mut all: Vec<String> = ATTEMPTS.iter().map(|a| (*a).to_owned()).collect();
    // acme's own scope, proven: it shows acme's rows only.
    all.push(app.scope_statement("acme").await);
    for tenants in ["globex", "acme,globex", "globex,acme", "acme,"] {
        all.push(format!("SELECT outbox.enter_scope('{tenants}', '{proof}')"));
        all.push(format!(
            "SELECT set_config('outbox.tenants', '{tenants}', true), \
             set_config('outbox.scope_proof', '{proof}', true)"
        ));
    }
    all
}

/// Globex's rows in every table: a pending, a leased and a NEEDS_RECONCILE intent (through
/// the API), a row of the delivered history (holding no items), an operator's resolution
/// and claims' replay records, globex's and a fleet claim's (as the superuser). Returns globex's tenant rows and its live lease.
async fn globex_everywhere(app: &TestApp) -> (Vec<Uuid>, v1::Lease) {
    let b = populate_globex(app).await;
    sqlx::raw_sql(
        "INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids, items)
         VALUES (0, 'globex', '', now(), '{}', '{}');
         INSERT INTO outbox.resolution (tenant_id, intent_id, from_state, decision, actor, reason, resolved_at)
         VALUES ('globex', gen_random_uuid(), 'needs_reconcile', 'dead', 'op', 'test', now());
         INSERT INTO outbox.claim_request (digest, scope_tenants, intent_ids, expires_at)
         VALUES ('globex-claim', '{globex}', '{}', now() + interval '1 hour'),
                ('fleet-claim', '{}', '{}', now() + interval '1 hour');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let ids = [b.pending.as_str(), b.waiting.as_str(), id_of(&b.leased)]
        .iter()
        .map(|id| id.parse().unwrap())
        .collect();
    (ids, b.leased)
}

/// How many of globex's rows `conn` sees through each relation and lookup.
async fn globex_rows_seen(conn: &mut PgConnection, ids: &[Uuid]) -> Vec<(String, i64)> {
    let mut seen = Vec::new();
    for relation in RELATIONS {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {relation} WHERE tenant_id = 'globex'"
        ))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        seen.push(((*relation).to_owned(), n));
    }
    // A claim's replay record names its scope's tenants; a fleet claim's names none.
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.claim_request
         WHERE 'globex' = ANY (scope_tenants) OR cardinality(scope_tenants) = 0",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    seen.push(("outbox.claim_request".to_owned(), n));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intents_by_id($1)")
        .bind(ids)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    seen.push(("outbox.intents_by_id".to_owned(), n));
    seen
}

#[tokio::test]
async fn the_service_role_cannot_see_another_tenant_whatever_it_sets() {
    let app = TestApp::spawn().await;
    let (ids, leased) = globex_everywhere(&app).await;
    app.enqueue_n("a", 1).await;
    let before = app.snapshot().await;
    let mut conn = app.service_connection().await;

    for attempt in attempts(&app).await {
        let mut tx = conn.begin().await.unwrap();
        sqlx::raw_sql(&attempt).execute(&mut *tx).await.unwrap();
        for (relation, n) in globex_rows_seen(&mut tx, &ids).await {
            assert_eq!(n, 0, "after `{attempt}`, {relation} showed globex's rows");
        }
        let granted: bool = sqlx::query_scalar("SELECT outbox.cross_tenant()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert!(
            !granted,
            "after `{attempt}`, outbox.cross_tenant() said yes"
        );
        // The claim and settle functions set the scope they are given: the same.
        let claimed: Vec<String> = sqlx::query_scalar(
            "SELECT tenant_id FROM outbox.claim(coalesce(current_setting('outbox.tenants', true), ''), \
             coalesce(current_setting('outbox.scope_proof', true), ''), 'thief', '', '{}'::text[], \
             100, 60000, NULL, NULL, '{}', '{}', '{}', '{}', NULL)",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        assert!(
            claimed.iter().all(|t| t == "acme"),
            "after `{attempt}`, the claim leased {claimed:?}"
        );
        for settle in [
            "outbox.extend_leases(T, P, $1, $2, 60000, NULL)",
            "outbox.mark_submitted(T, P, $1, $2, NULL)",
            "outbox.ack_into_batches(T, P, $1, $2, NULL)",
            "outbox.ack_and_delete(T, P, $1, $2, NULL)",
        ] {
            let settle = settle
                .replace("T", "coalesce(current_setting('outbox.tenants', true), '')")
                .replace(
                    "P",
                    "coalesce(current_setting('outbox.scope_proof', true), '')",
                );
            let settled: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {settle}"))
                .bind(vec![id_of(&leased).parse::<Uuid>().unwrap()])
                .bind(vec![leased.lease_id.parse::<Uuid>().unwrap()])
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            assert_eq!(
                settled, 0,
                "after `{attempt}`, {settle} settled globex's lease"
            );
        }
        tx.rollback().await.unwrap();
    }

    // Nor can it take the grant (it may neither become the fleet nor make itself a member)
    // or read the secret that proves a scope.
    for escalation in [
        "SET ROLE outboxd_fleet".to_owned(),
        "SELECT secret FROM outbox.scope_secret".to_owned(),
        format!("GRANT outboxd_fleet TO {SERVICE_ROLE}"),
        format!("SELECT outbox.grant_fleet_role('{SERVICE_ROLE}')"),
    ] {
        let refused = sqlx::raw_sql(&escalation)
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert_eq!(
            refused.as_database_error().unwrap().code().as_deref(),
            Some("42501"),
            "`{escalation}`: {refused}"
        );
    }
    assert_eq!(app.snapshot().await, before, "nothing of globex's changed");
}

#[tokio::test]
async fn the_fleet_role_sees_every_tenant_without_setting_anything() {
    let app = TestApp::spawn().await;
    let (ids, _) = globex_everywhere(&app).await;
    let mut fleet = app.fleet_connection().await;

    let seen = globex_rows_seen(&mut fleet, &ids).await;
    let expected: Vec<(String, i64)> = [
        ("outbox.intent", 3),
        ("outbox.delivered_batch", 1),
        ("outbox.resolution", 1),
        // The batch row holds no items.
        ("outbox.all_intents", 3),
        ("outbox.claim_request", 2),
        ("outbox.intents_by_id", 3),
    ]
    .iter()
    .map(|(r, n)| ((*r).to_owned(), *n))
    .collect();
    assert_eq!(seen, expected);
    let granted: bool = sqlx::query_scalar("SELECT outbox.cross_tenant()")
        .fetch_one(&mut fleet)
        .await
        .unwrap();
    assert!(granted);
    // Naming a tenant narrows nothing for it: its policy is a grant, not a setting.
    let mut tx = fleet.begin().await.unwrap();
    sqlx::query("SELECT set_config('outbox.tenants', 'acme', true)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(globex_rows_seen(&mut tx, &ids).await, expected);
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn every_table_under_row_level_security_opens_to_the_fleet_grant_and_no_setting() {
    let app = TestApp::spawn().await;
    let tables: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT c.relname::text, c.relforcerowsecurity,
                EXISTS (SELECT 1 FROM pg_policy p
                        WHERE p.polrelid = c.oid
                          AND p.polroles = ARRAY['outboxd_fleet'::regrole::oid]
                          AND pg_get_expr(p.polqual, p.polrelid) = 'true'
                          AND pg_get_expr(p.polwithcheck, p.polrelid) = 'true')
         FROM pg_class c
         WHERE c.relnamespace = 'outbox'::regnamespace AND c.relrowsecurity
         ORDER BY 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let names: Vec<&str> = tables.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "claim_request",
            "claim_tally",
            "delivered_batch",
            "intent",
            "queue_level",
            "queue_level_idle",
            "queue_policy",
            "queue_policy_change",
            "resolution"
        ]
    );
    for (table, forced, fleet) in &tables {
        assert!(
            forced,
            "{table}: row-level security not forced on its owner"
        );
        assert!(fleet, "{table}: no policy granting outboxd_fleet every row");
    }
    // The other policies are for everyone and read the tenant list only.
    let others: Vec<(String, String)> = sqlx::query_as(
        "SELECT policyname::text, coalesce(qual, '') || ' ' || coalesce(with_check, '')
         FROM pg_policies
         WHERE schemaname = 'outbox' AND NOT (roles = ARRAY['outboxd_fleet']::name[])",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(others.len(), tables.len(), "{others:?}");
    for (policy, expr) in &others {
        assert!(
            expr.contains("outbox.verified_tenants") && !expr.contains("cross_tenant"),
            "{policy}: {expr}"
        );
    }
}

/// A login role for one test (roles belong to the cluster every test shares), dropped by
/// [`drop_role`].
async fn login_role(app: &TestApp, attributes: &str) -> (String, String) {
    let role = format!("test_role_{}", Uuid::new_v4().simple());
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN {attributes}"))
        .execute(&app.pool)
        .await
        .unwrap();
    let url = app.url.replacen("://postgres@", &format!("://{role}@"), 1);
    (role, url)
}

async fn drop_role(app: &TestApp, role: &str) {
    sqlx::raw_sql(&format!("DROP ROLE {role}"))
        .execute(&app.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn outboxd_refuses_to_serve_requests_through_a_role_that_sees_or_could_grant_itself_every_tenant()
 {
    let app = TestApp::spawn().await;

    let (member, url) = login_role(&app, "").await;
    sqlx::raw_sql(&format!("GRANT outboxd_fleet TO {member}"))
        .execute(&app.pool)
        .await
        .unwrap();
    let pool = startup::connect(&url, 2).await.unwrap();
    let refused = startup::verify_service_role(&pool).await.unwrap_err();
    assert!(
        refused.to_string().contains("member of outboxd_fleet"),
        "{refused}"
    );
    // It is what the fleet pool needs.
    startup::verify_fleet_role(&pool).await.unwrap();
    pool.close().await;
    drop_role(&app, &member).await;

    let (creator, url) = login_role(&app, "CREATEROLE").await;
    let pool = startup::connect(&url, 2).await.unwrap();
    let refused = startup::verify_service_role(&pool).await.unwrap_err();
    assert!(refused.to_string().contains("CREATEROLE"), "{refused}");
    pool.close().await;
    drop_role(&app, &creator).await;

    // A role that may read the secret could prove any tenant's scope.
    let (reader, url) = login_role(&app, "").await;
    sqlx::raw_sql(&format!(
        "GRANT USAGE ON SCHEMA outbox TO {reader}; GRANT SELECT ON outbox.scope_secret TO {reader}"
    ))
    .execute(&app.pool)
    .await
    .unwrap();
    let pool = startup::connect(&url, 2).await.unwrap();
    let refused = startup::verify_service_role(&pool).await.unwrap_err();
    assert!(refused.to_string().contains("scope_secret"), "{refused}");
    pool.close().await;
    sqlx::raw_sql(&format!(
        "REVOKE ALL ON outbox.scope_secret FROM {reader}; REVOKE ALL ON SCHEMA outbox FROM {reader}"
    ))
    .execute(&app.pool)
    .await
    .unwrap();
    drop_role(&app, &reader).await;

    // The service role is no fleet: the sweeps would find nothing through it.
    let service = startup::connect(
        &app.url
            .replacen("://postgres@", &format!("://{SERVICE_ROLE}@"), 1),
        2,
    )
    .await
    .unwrap();
    let refused = startup::verify_fleet_role(&service).await.unwrap_err();
    assert!(
        refused.to_string().contains("no member of outboxd_fleet"),
        "{refused}"
    );
}

#[tokio::test]
async fn a_key_bound_to_all_tenants_claims_settles_and_rescues_across_them_through_the_fleet() {
    let app = TestApp::spawn().await;
    let globex = app.key(&["globex"], &["produce"], &[]).await;
    app.client_with(Some(&globex), None)
        .await
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("b", "1"), intent("b", "2"), intent("b", "3")],
            txn_token: String::new(),
        })
        .await
        .unwrap();
    app.enqueue_n("a", 3).await;
    let all = app.key(&["*"], &["consume"], &[]).await;
    let mut worker = app.client_with(Some(&all), None).await;
    let mut request = claim_request("fleet", 10);
    request.wait = Some(duration(Duration::ZERO));
    let leases = worker.claim(request).await.unwrap().into_inner().leases;
    let kinds = |leases: &[v1::Lease]| {
        let mut k: Vec<String> = leases
            .iter()
            .map(|l| l.intent.as_ref().unwrap().kind.clone())
            .collect();
        k.sort();
        k
    };
    assert_eq!(kinds(&leases), ["a", "a", "a", "b", "b", "b"]);
    // Each intent says whose it is, in a claim, a listing and a read by id.
    let tenant_of_kind = |kind: &str| if kind == "a" { TENANT } else { "globex" };
    for lease in &leases {
        let claimed = lease.intent.as_ref().unwrap();
        assert_eq!(claimed.tenant, tenant_of_kind(&claimed.kind));
    }
    let operator = app.key(&["*"], &["operate"], &[]).await;
    let mut operator = app.client_with(Some(&operator), None).await;
    let listed = operator
        .list_intents(v1::ListIntentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .intents;
    assert_eq!(listed.len(), 6);
    for intent in &listed {
        assert_eq!(intent.tenant, tenant_of_kind(&intent.kind));
        let read = operator
            .get_intent(v1::GetIntentRequest {
                id: intent.id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .intent
            .unwrap();
        assert_eq!(read.tenant, intent.tenant);
    }

    let by_kind = |kind: &str| -> Vec<&v1::Lease> {
        leases
            .iter()
            .filter(|l| l.intent.as_ref().unwrap().kind == kind)
            .collect()
    };
    let (a, b) = (by_kind("a"), by_kind("b"));
    let extended = worker
        .extend_lease(v1::ExtendLeaseRequest {
            leases: vec![lease_ref(a[0]), lease_ref(b[0])],
            lease_duration: Some(duration(Duration::from_secs(60))),
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    extended
        .iter()
        .for_each(|r| assert_item_ok(r, IntentState::Leased));
    let acked = worker
        .ack(v1::AckRequest {
            leases: vec![lease_ref(a[0]), lease_ref(b[0])],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    acked
        .iter()
        .for_each(|r| assert_item_ok(r, IntentState::Delivered));
    let failed = worker
        .fail(v1::FailRequest {
            failures: vec![
                failure(a[1], FailOutcome::Permanent),
                failure(b[1], FailOutcome::Permanent),
            ],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    failed
        .iter()
        .for_each(|r| assert_item_ok(r, IntentState::DeadLettered));

    // The sweep runs on the fleet pool too: both tenants' expired leases go back.
    app.advance(Duration::from_secs(3600));
    let report = app.rescue().await;
    assert_eq!(report.requeued, 2, "{report:?}");
    let states: Vec<(String, String)> = sqlx::query_as(
        "SELECT tenant_id, state::text FROM outbox.all_intents ORDER BY tenant_id, state::text",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let expected: Vec<(String, String)> = ["acme", "globex"]
        .iter()
        .flat_map(|t| {
            ["dead_lettered", "delivered", "pending"].map(|s| ((*t).to_owned(), s.to_owned()))
        })
        .collect();
    assert_eq!(states, expected);
}
