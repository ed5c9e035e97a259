//! The operator console, in a real browser (headless chromium): sign-in, the reconcile
//! desk, tenancy, CSRF, hostile payloads, keys; each decision checked through the gRPC API.

use outboxd::proto::v1::{self, Decision, FailOutcome, IntentState};

use crate::browser::Browser;
use crate::helpers::{TestApp, http_exchange, id_of, intent};

/// A server with the console on, and no schema owner's connection: no migration URL, and
/// no embedded cluster to find (a developer's `cargo run` may have one running).
async fn console_app() -> TestApp {
    TestApp::spawn_with(|s| {
        s.console.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        s.embedded.data_dir = crate::helpers::scratch_dir().join("no-embedded-cluster");
    })
    .await
}

/// Intents a worker left in NEEDS_RECONCILE: claimed, then failed with an unknown outcome.
async fn left_unknown(app: &TestApp, kind: &str, n: usize) -> Vec<String> {
    app.enqueue_n(kind, n).await;
    let leases = app.claim_n("worker-7", n as i32).await;
    for lease in &leases {
        app.fail_with(v1::Failure {
            lease: Some(crate::helpers::lease_ref(lease)),
            outcome: FailOutcome::Unknown as i32,
            error: "timeout after the provider accepted the request".to_owned(),
            ..Default::default()
        })
        .await;
    }
    leases.iter().map(|l| id_of(l).to_owned()).collect()
}

#[tokio::test]
async fn an_operator_resolves_an_intent_a_worker_left_unknown_and_sees_the_audit() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 2).await;
    let key =
        crate::helpers::create_key(&app.pool, "alice-desk", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    assert_eq!(browser.path().await, "/");
    assert_eq!(browser.text("#who").await, "alice-desk");
    assert!(browser.text("#states").await.contains("NEEDS_RECONCILE"));
    browser.screenshot("overview").await;

    browser.submit("a[href='/desk']").await;
    let desk = browser.text("#intents").await;
    assert!(desk.contains(&ids[0]) && desk.contains(&ids[1]), "{desk}");
    assert!(desk.contains("timeout after the provider accepted the request"));
    browser.screenshot("desk").await;
    browser.click(&format!("input[value='{}']", ids[0])).await;
    browser.select("#decision", "DELIVERED").await;
    browser
        .fill("#reason", "the PSP dashboard shows the charge")
        .await;
    browser.submit("#resolve").await;
    let outcome = browser.text("#outcomes").await;
    assert!(
        outcome.contains(&ids[0]) && outcome.contains("applied"),
        "{outcome}"
    );
    assert!(
        !outcome.contains(&ids[1]),
        "only the selected intent is decided"
    );
    assert_eq!(
        browser.client.title().await.unwrap(),
        "Decision recorded · outboxd"
    );

    browser.goto(&format!("/intents/{}", ids[0])).await;
    assert_eq!(browser.text("#intent-state").await, "DELIVERED");
    let audit = browser.text("#resolutions").await;
    assert!(audit.contains("alice-desk") && audit.contains("the PSP dashboard shows the charge"));
    browser.screenshot("intent").await;

    let got = app.get(&ids[0]).await;
    assert_eq!(got.intent.unwrap().state(), IntentState::Delivered);
    assert_eq!(got.resolutions.len(), 1);
    assert_eq!(got.resolutions[0].actor, "alice-desk");
    assert_eq!(got.resolutions[0].decision(), Decision::Delivered);
    assert_eq!(app.state(&ids[1]).await, IntentState::NeedsReconcile);

    browser.goto("/intents?state=NEEDS_RECONCILE").await;
    let listed = browser.text("#intents").await;
    assert!(listed.contains(&ids[1]) && !listed.contains(&ids[0]));
    browser.screenshot("intents").await;
    browser.close().await;
}

#[tokio::test]
async fn a_key_of_another_tenant_sees_none_of_it() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let other =
        crate::helpers::create_key(&app.pool, "globex-ops", &["globex"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &other).await;
    assert!(!browser.text("#states").await.contains("NEEDS_RECONCILE"));
    browser.goto("/desk").await;
    assert!(browser.body().await.contains("Nothing awaits a decision"));
    browser.goto(&format!("/intents/{}", ids[0])).await;
    assert!(
        browser.text("h1").await.contains("404"),
        "another tenant's intent is not found"
    );
    browser.goto("/intents").await;
    assert!(!browser.body().await.contains(&ids[0]));
    browser.close().await;
}

#[tokio::test]
async fn a_key_of_two_tenants_sees_whose_each_intent_is() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let globex = crate::helpers::populate_globex(&app).await;
    let key = crate::helpers::create_key(
        &app.pool,
        "fleet-ops",
        &["acme", "globex"],
        &["operate"],
        &[],
    )
    .await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto("/desk").await;
    let desk = browser.text("#intents").await;
    assert!(desk.contains("tenant") && desk.contains("acme"), "{desk}");
    browser.goto("/intents").await;
    let listed = browser.text("#intents").await;
    assert!(
        listed.contains("acme") && listed.contains("globex"),
        "{listed}"
    );
    for (id, tenant) in [(&ids[0], "acme"), (&globex.pending, "globex")] {
        browser.goto(&format!("/intents/{id}")).await;
        assert_eq!(browser.text("#intent-tenant").await, tenant);
    }
    browser.close().await;
}

#[tokio::test]
async fn signing_out_ends_the_session_and_a_revoked_key_ends_its_sessions() {
    let app = console_app().await;
    let key = crate::helpers::create_key(&app.pool, "bob", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    assert_eq!(browser.path().await, "/");
    let cookies = browser.client.get_all_cookies().await.unwrap();
    let session = cookies
        .iter()
        .find(|c| c.name() == "outboxd_session")
        .unwrap()
        .clone();
    assert_eq!(session.http_only(), Some(true));
    assert_eq!(session.same_site(), Some(cookie::SameSite::Strict));
    browser.submit("#sign-out").await;
    assert_eq!(browser.path().await, "/sign-in");
    // The old cookie, put back, no longer opens anything.
    browser
        .client
        .add_cookie(session.into_owned())
        .await
        .unwrap();
    browser.goto("/desk").await;
    assert_eq!(browser.path().await, "/sign-in");

    browser.sign_in(&key).await;
    assert_eq!(browser.path().await, "/");
    sqlx::query("UPDATE outbox.api_key SET revoked_at = now() WHERE name = 'bob'")
        .execute(&app.pool)
        .await
        .unwrap();
    browser.goto("/desk").await;
    assert_eq!(
        browser.path().await,
        "/sign-in",
        "a revoked key's session ends at once"
    );
    browser.sign_in(&key).await;
    assert!(browser.text("#error").await.contains("unknown or revoked"));
    browser.close().await;
}

#[tokio::test]
async fn a_key_without_the_operate_scope_cannot_sign_in() {
    let app = console_app().await;
    let producer = app.key(&["acme"], &["produce", "consume"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &producer).await;
    assert!(browser.text("#error").await.contains("operate or admin"));
    browser.goto("/").await;
    assert_eq!(browser.path().await, "/sign-in");
    browser.sign_in("obx_not-a-key-at-all").await;
    assert!(browser.text("#error").await.contains("unknown or revoked"));
    browser.close().await;
}

/// Waits until the claim tally holds `n` leases of acme (it is added every second), and
/// checks that it holds no more.
async fn tallied(app: &TestApp, n: i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let claimed: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(claimed), 0)::bigint FROM outbox.claim_tally \
             WHERE tenant_id = 'acme'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if claimed >= n {
            assert_eq!(claimed, n);
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{claimed} of {n} tallied"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The chart's claimed line: what Claims lease, and what enqueues hand to waiting Claims.
#[tokio::test]
async fn claims_and_hand_offs_show_on_the_chart_as_claimed() {
    let app = console_app().await;
    app.enqueue_n("charge", 3).await;
    assert_eq!(app.claim_n("worker-1", 3).await.len(), 3);
    let waiting = crate::handoff::waiting_claim(&app, app.client(), "worker-2", 1, &[]).await;
    app.enqueue_n("charge", 1).await;
    assert_eq!(crate::handoff::answered(waiting).await.len(), 1);
    app.wait_for_metric("outbox_intents_handed_off_total 1")
        .await;
    tallied(&app, 4).await;

    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    assert_eq!(browser.text("#enqueued").await, "enqueued 4");
    assert_eq!(browser.text("#claimed").await, "claimed 4");
    browser.close().await;
}

/// A forged form: another site's page that posts the forger's key to the console, so that
/// the operator would work in the forger's session. No browser: the headers are those
/// browsers send for such a page.
#[tokio::test]
async fn a_sign_in_sent_from_another_sites_page_is_refused_and_opens_no_session() {
    let app = console_app().await;
    let addr = app.console_addr.unwrap();
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let sign_in = |from: &str| {
        let form = format!("key={key}");
        format!(
            "POST /sign-in HTTP/1.1\r\nHost: {addr}\r\n{from}\
             Content-Type: application/x-www-form-urlencoded\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        )
    };
    for forged in [
        "Sec-Fetch-Site: cross-site\r\nOrigin: https://attacker.example\r\n",
        "Sec-Fetch-Site: same-site\r\nOrigin: null\r\n",
        "Origin: https://attacker.example\r\n",
        // Plain HTTP to a non-local address: no Sec-Fetch-Site; a sandboxed frame's form.
        "Origin: null\r\n",
    ] {
        let (status, headers, body) = http_exchange(addr, &sign_in(forged)).await;
        assert_eq!(status, 403, "{forged}: {body}");
        assert!(body.contains("another site"), "{body}");
        assert!(!headers.iter().any(|(name, _)| name == "set-cookie"));
    }
    let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.console_session")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(sessions, 0);

    // The console's own form, as chromium sends it to a secure origin, and to a plain-HTTP
    // one, where it sends no Sec-Fetch-Site (its origin, under `same-origin`).
    for own in [
        "Sec-Fetch-Site: same-origin\r\nOrigin: null\r\n".to_owned(),
        format!("Origin: http://{addr}\r\n"),
    ] {
        let (status, headers, body) = http_exchange(addr, &sign_in(&own)).await;
        assert_eq!(status, 303, "{body}");
        assert!(
            headers
                .iter()
                .any(|(name, value)| name == "set-cookie" && value.starts_with("outboxd_session="))
        );
    }
}

#[tokio::test]
async fn hostile_payloads_render_inert() {
    let app = console_app().await;
    let script = "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 1\">";
    let mut binary = intent("binary", "");
    binary.payload = vec![0xff, 0xfe, 0x00, b'<', b's', 0xc3, 0x28];
    binary.content_type = "application/octet-stream".to_owned();
    let mut huge = intent("huge", "");
    huge.payload = "<b>".repeat(300_000).into_bytes();
    huge.content_type = "text/plain".to_owned();
    let mut hostile = intent("hostile", script);
    hostile.content_type = "text/html".to_owned();
    hostile.headers.insert(
        "x-evil".to_owned(),
        "\"><script>window.pwned = 1</script>".to_owned(),
    );
    let ids = app.enqueue_ids(vec![hostile, binary, huge]).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;

    browser.goto(&format!("/intents/{}", ids[0])).await;
    assert_eq!(browser.text("#payload").await, script, "shown as text");
    assert!(browser.text("#headers").await.contains("<script>"));
    let injected = browser
        .client
        .execute(
            "return [window.pwned === undefined, document.querySelectorAll('main script, main img').length]",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(injected, serde_json::json!([true, 0]));

    browser.goto(&format!("/intents/{}", ids[1])).await;
    let shown = browser.text("#payload").await;
    assert!(
        shown.starts_with("00000000  ff fe 00 3c 73 c3 28"),
        "{shown}"
    );
    assert!(browser.body().await.contains("hex, 7 bytes"));

    browser.goto(&format!("/intents/{}", ids[2])).await;
    assert!(
        browser
            .body()
            .await
            .contains("900000 bytes, the first part shown")
    );
    let shown = browser.text("#payload").await.len();
    assert!(
        shown <= 64 * 1024,
        "at most 64 KiB of a payload is shown ({shown})"
    );
    browser.close().await;
}

#[tokio::test]
async fn a_change_without_the_csrf_token_is_refused_and_changes_nothing() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto(&format!("/intents/{}", ids[0])).await;
    browser
        .run("document.querySelector('#decide input[name=csrf]').remove()")
        .await;
    browser.select("#decision", "REQUEUE").await;
    browser.fill("#reason", "forged").await;
    browser.submit("#resolve").await;
    assert!(browser.text("h1").await.contains("403"));
    assert!(browser.text("#error").await.contains("CSRF"));
    assert_eq!(app.state(&ids[0]).await, IntentState::NeedsReconcile);
    assert!(app.get(&ids[0]).await.resolutions.is_empty());
    browser.close().await;
}

#[tokio::test]
async fn a_refused_field_is_said_once_and_nothing_changes() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto(&format!("/intents/{}", ids[0])).await;
    browser
        .run("document.querySelector('#reason').removeAttribute('required')")
        .await;
    browser.select("#decision", "REQUEUE").await;
    browser.fill("#reason", "   ").await;
    browser.submit("#resolve").await;
    assert!(browser.text("h1").await.contains("400"));
    let body = browser.body().await;
    assert!(body.contains("reason"), "{body}");
    assert_eq!(body.matches("is required").count(), 1, "{body}");
    assert_eq!(app.state(&ids[0]).await, IntentState::NeedsReconcile);
    browser.close().await;
}

#[tokio::test]
async fn a_decision_another_operator_took_first_answers_clearly_and_applies_once() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto("/desk").await;
    browser.click(&format!("input[value='{}']", ids[0])).await;
    // Meanwhile, a second later, another operator decides it through the API.
    app.advance(std::time::Duration::from_secs(1));
    let mut other = app.client();
    other
        .reconcile(v1::ReconcileRequest {
            target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                ids: ids.clone(),
                updated_at: Vec::new(),
            })),
            decision: Decision::Dead as i32,
            actor: "carol".to_owned(),
            reason: "refunded by hand".to_owned(),
            limit: 0,
        })
        .await
        .unwrap();
    browser.select("#decision", "REQUEUE").await;
    browser.fill("#reason", "deliver again").await;
    browser.submit("#resolve").await;
    let outcome = browser.text("#outcomes").await;
    assert!(outcome.contains("not applied"), "{outcome}");
    assert!(outcome.contains("changed after it was read"), "{outcome}");
    assert!(outcome.contains("DEAD_LETTERED"), "{outcome}");
    assert_eq!(
        browser.client.title().await.unwrap(),
        "Decision not applied · outboxd"
    );
    let got = app.get(&ids[0]).await;
    assert_eq!(got.intent.unwrap().state(), IntentState::DeadLettered);
    assert_eq!(got.resolutions.len(), 1, "one decision applied");
    assert_eq!(got.resolutions[0].actor, "carol");
    browser.close().await;
}

/// Fills the keys page's creation form (one scope) and submits it, confirmed with `confirm`.
async fn submit_key_form(browser: &Browser, name: &str, tenants: &str, scope: &str, confirm: &str) {
    browser.fill("#new-key input[name=name]", name).await;
    browser.fill("#new-key input[name=tenants]", tenants).await;
    browser
        .click(&format!("#new-key input[name={scope}]"))
        .await;
    browser.fill("#new-key input[name=confirm]", confirm).await;
    browser.submit("#new-key button").await;
}

#[tokio::test]
async fn an_admin_creates_a_key_whose_secret_is_shown_once_and_revokes_it() {
    let url = crate::helpers::fresh_database().await;
    let owner = url.clone();
    let app = TestApp::spawn_on(url, |s| {
        s.console.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        s.database.migration_url = Some(owner);
    })
    .await;
    let admin = crate::helpers::create_key(&app.pool, "root-ops", &["acme"], &["admin"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &admin).await;
    browser.goto("/keys").await;
    submit_key_form(
        &browser,
        "billing-worker",
        "acme",
        "produce",
        "obx_a-key-that-is-not-mine",
    )
    .await;
    assert!(
        browser.text("h1").await.contains("403"),
        "a change asks for the admin's own key"
    );
    browser.goto("/keys").await;
    submit_key_form(&browser, "billing-worker", "acme", "produce", &admin).await;
    let secret = browser.text("#secret").await;
    assert!(secret.starts_with("obx_"));
    browser.screenshot("keys").await;
    let mut worker = app.client_with(Some(&secret), None).await;
    worker
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("mail", "{}")],
            txn_token: String::new(),
        })
        .await
        .expect("the new key works");
    browser.goto("/keys").await;
    assert!(
        !browser.body().await.contains(&secret),
        "the secret is shown once"
    );

    // The same form again (as a reload of its answer posts it) mints no second key.
    submit_key_form(&browser, "billing-worker", "acme", "produce", &admin).await;
    assert!(browser.text("h1").await.contains("409"));
    let named: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.api_key WHERE name = 'billing-worker'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(named, 1);
    browser.goto("/keys").await;

    // A key for another tenant is beyond this admin's reach.
    submit_key_form(&browser, "sneaky", "*", "admin", &admin).await;
    assert!(browser.text("h1").await.contains("403"));

    // Another tenant's key names are not this admin's to learn: a name taken there is
    // free here.
    crate::helpers::create_key(&app.pool, "beta-ops", &["beta"], &["operate"], &[]).await;
    browser.goto("/keys").await;
    submit_key_form(&browser, "beta-ops", "acme", "consume", &admin).await;
    assert!(browser.text("#secret").await.starts_with("obx_"));

    browser.goto("/keys").await;
    let row = "//tr[td[text()='billing-worker']]";
    let confirm = browser
        .client
        .find(fantoccini::Locator::XPath(&format!(
            "{row}//input[@name='confirm']"
        )))
        .await
        .unwrap();
    confirm.send_keys(&admin).await.unwrap();
    browser.submit_xpath(&format!("{row}//button")).await;
    assert!(!browser.text("#keys").await.is_empty());
    let revoked: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT revoked_at FROM outbox.api_key WHERE name = 'billing-worker'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(revoked.is_some());
    browser.close().await;
}

#[tokio::test]
async fn without_the_owners_connection_the_keys_page_only_lists() {
    let app = console_app().await;
    let admin = crate::helpers::create_key(&app.pool, "root-ops", &["acme"], &["admin"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &admin).await;
    browser.goto("/keys").await;
    assert!(browser.text("#keys").await.contains("root-ops"));
    assert!(browser.text("#read-only").await.contains("outboxd keys"));
    assert!(
        browser
            .client
            .find(fantoccini::Locator::Css("#new-key"))
            .await
            .is_err()
    );
    browser.close().await;
}

async fn queue_policies(app: &TestApp) -> Vec<v1::QueuePolicy> {
    let listed = app
        .client()
        .list_queue_policies(v1::ListQueuePoliciesRequest::default())
        .await
        .unwrap();
    listed.into_inner().policies
}

#[tokio::test]
async fn an_operator_pauses_a_queue_and_sees_the_blocked_ordering_keys() {
    let app = console_app().await;
    let mut head = v1::NewIntent {
        ordering_key: "customer-42".to_owned(),
        max_attempts: 1,
        ..intent("order.event", "{}")
    };
    head.priority = 0;
    let next = v1::NewIntent {
        ordering_key: "customer-42".to_owned(),
        ..intent("order.event", "{}")
    };
    let ids = app.enqueue_ids(vec![head, next]).await;
    let leases = app.claim_n("w", 10).await;
    app.fail(&leases[0], FailOutcome::Retry).await;
    assert_eq!(app.state(&ids[0]).await, IntentState::DeadLettered);

    let key = crate::helpers::create_key(&app.pool, "dora-ops", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto("/queues").await;
    let blocked = browser.text("#blocked").await;
    assert!(
        blocked.contains("customer-42") && blocked.contains(&ids[0]),
        "{blocked}"
    );
    browser.fill("#policy input[name=kind]", "mail").await;
    browser.click("#policy input[name=paused]").await;
    browser.fill("#policy input[name=max_in_flight]", "5").await;
    browser
        .fill("#policy textarea[name=reason]", "the relay is down")
        .await;
    browser.submit("#policy button").await;
    assert!(browser.text("#saved").await.contains("acme/mail"));
    let shown = browser.text("#policies").await;
    assert!(
        shown.contains("paused") && shown.contains("the relay is down"),
        "{shown}"
    );
    browser.screenshot("queues").await;

    let policies = queue_policies(&app).await;
    assert_eq!(policies.len(), 1);
    assert!(policies[0].paused);
    assert_eq!(policies[0].max_in_flight, 5);
    assert_eq!(policies[0].actor, "dora-ops");

    // A bad policy is refused with the API's own message, and changes nothing.
    browser.goto("/queues").await;
    change_policy(&browser, "mail").await;
    browser.fill("#policy input[name=burst]", "3").await;
    browser
        .fill("#policy textarea[name=reason]", "burst without a rate")
        .await;
    browser.submit("#policy button").await;
    assert!(browser.text("h1").await.contains("400"));
    let policies = queue_policies(&app).await;
    assert!(policies[0].paused, "unchanged");
    browser.close().await;
}

#[tokio::test]
async fn an_intent_is_found_by_its_id_or_idempotency_key_and_listed_by_filter() {
    let app = console_app().await;
    let mut keyed = intent("invoice.send", "{}");
    keyed.idempotency_key = "invoices/2026-0042".to_owned();
    let in_eu = v1::NewIntent {
        region: "eu".to_owned(),
        ..intent("mail", "{}")
    };
    let ids = app
        .enqueue_ids(vec![
            keyed,
            intent("mail", "{}"),
            intent("mail", "{}"),
            in_eu,
        ])
        .await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    // The overview's groups link to their list; the list filters by one region or by
    // none, so a group of intents without a region has no link (it would list every region).
    let groups = browser.html("#groups").await;
    assert!(groups.contains("kind=mail&amp;region=eu\""), "{groups}");
    assert!(!groups.contains("region=\""), "{groups}");
    browser.goto("/intents").await;
    browser.fill("#q", "invoices/2026-0042").await;
    browser.submit("#filter").await;
    assert_eq!(browser.path().await, format!("/intents/{}", ids[0]));
    browser.goto("/intents").await;
    browser.fill("#q", &ids[1]).await;
    browser.submit("#filter").await;
    assert_eq!(browser.path().await, format!("/intents/{}", ids[1]));
    browser.goto("/intents?kind=mail&state=PENDING").await;
    let listed = browser.text("#intents").await;
    assert!(listed.contains(&ids[1]) && listed.contains(&ids[2]) && !listed.contains(&ids[0]));
    browser
        .goto("/intents?kind=mail&state=PENDING&region=eu")
        .await;
    let listed = browser.text("#intents").await;
    assert!(
        listed.contains(&ids[3]) && !listed.contains(&ids[1]),
        "{listed}"
    );
    browser
        .goto("/intents?since=2000-01-01T00:00&until=2000-01-02T00:00")
        .await;
    assert!(browser.body().await.contains("No intents match"));
    browser.goto("/intents?since=yesterday").await;
    assert!(browser.text("h1").await.contains("400"));
    browser.close().await;
}

#[tokio::test]
async fn an_intents_page_shows_its_whole_last_error() {
    let app = console_app().await;
    app.enqueue_n("charge", 1).await;
    let leases = app.claim_n("worker-7", 1).await;
    // Longer than the 300 characters a list shows.
    let error = "card declined by the issuer; ".repeat(30);
    app.fail_with(v1::Failure {
        lease: Some(crate::helpers::lease_ref(&leases[0])),
        outcome: FailOutcome::Permanent as i32,
        error: error.clone(),
        ..Default::default()
    })
    .await;
    let key = crate::helpers::create_key(&app.pool, "alice", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser
        .goto(&format!("/intents/{}", id_of(&leases[0])))
        .await;
    assert_eq!(browser.text("#last-error").await.trim(), error.trim());
    browser.close().await;
}

/// Rows of `outbox.queue_policy_change` for `kind`: one per change applied.
async fn policy_changes(app: &TestApp, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox.queue_policy_change WHERE kind = $1")
        .bind(kind)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Another operator's policy change, through the API, a second after the last one.
async fn set_by_carol(app: &TestApp, kind: &str, paused: bool) {
    app.advance(std::time::Duration::from_secs(1));
    app.client()
        .set_queue_policy(v1::SetQueuePolicyRequest {
            kind: kind.to_owned(),
            paused,
            actor: "carol".to_owned(),
            reason: "carol's call".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();
}

/// Sets the policy form's pause and concurrency limit (over what it showed), gives a
/// reason, and sends it.
async fn send_policy(browser: &Browser, paused: bool, max_in_flight: &str) {
    let find = |css: &'static str| browser.client.find(fantoccini::Locator::Css(css));
    let paused_box = find("#policy input[name=paused]").await.unwrap();
    if paused_box.is_selected().await.unwrap() != paused {
        paused_box.click().await.unwrap();
    }
    let max = find("#policy input[name=max_in_flight]").await.unwrap();
    max.clear().await.unwrap();
    max.send_keys(max_in_flight).await.unwrap();
    browser
        .fill("#policy textarea[name=reason]", "the relay is down")
        .await;
    browser.submit("#policy button").await;
}

/// The blank form (a queue's first policy), for `kind`.
async fn submit_policy(browser: &Browser, kind: &str, paused: bool, max_in_flight: &str) {
    browser.fill("#policy input[name=kind]", kind).await;
    send_policy(browser, paused, max_in_flight).await;
}

/// Opens the form that changes `kind`'s policy, from its row on the queues page.
async fn change_policy(browser: &Browser, kind: &str) {
    browser
        .submit_xpath(&format!(
            "//table[@id='policies']//tr[td[2][text()='{kind}']]//a[@class='change']"
        ))
        .await;
    let changing = browser.text("#changing").await;
    assert!(changing.contains(&format!("acme/{kind}")), "{changing}");
}

/// Policies past the first page (each page within the reply limit) are reached by the
/// page's links, and each can be changed from its row there.
#[tokio::test]
async fn policies_past_the_first_page_are_listed_and_changed_from_their_page() {
    let app = TestApp::spawn_with(|s| {
        s.console.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        s.embedded.data_dir = crate::helpers::scratch_dir().join("no-embedded-cluster");
        s.limits.max_payload_bytes = 1024;
        s.limits.max_reply_bytes = 20_000;
    })
    .await;
    let mut kinds = app.pause_with_long_reasons(10).await;
    let key = crate::helpers::create_key(&app.pool, "dora-ops", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto("/queues").await;
    let (mut listed, mut pages) = (Vec::new(), 1);
    loop {
        let rows = browser
            .client
            .find_all(fantoccini::Locator::XPath(
                "//table[@id='policies']//tr/td[2]",
            ))
            .await
            .unwrap();
        for row in rows {
            listed.push(row.text().await.unwrap());
        }
        if browser
            .client
            .find(fantoccini::Locator::Id("next"))
            .await
            .is_err()
        {
            break;
        }
        browser.submit("#next").await;
        pages += 1;
        assert!(browser.html("#first").await.contains("/queues"));
    }
    kinds.sort();
    assert_eq!(listed, kinds, "each policy once, by kind");
    assert!(pages >= 3, "{pages} pages");

    // The last page's policy, changed from its row there.
    change_policy(&browser, "kind-9").await;
    send_policy(&browser, false, "3").await;
    assert!(browser.text("#saved").await.contains("acme/kind-9"));
    let listed = app
        .client()
        .list_queue_policies(v1::ListQueuePoliciesRequest {
            kind: "kind-9".to_owned(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .policies;
    assert!(
        matches!(listed.as_slice(), [p] if !p.paused && p.max_in_flight == 3),
        "{listed:?}"
    );
    browser.close().await;
}

#[tokio::test]
async fn a_reload_after_saving_a_policy_sends_nothing_and_a_stale_page_overwrites_no_newer_policy()
{
    let app = console_app().await;
    let key = crate::helpers::create_key(&app.pool, "dora-ops", &["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto("/queues").await;
    submit_policy(&browser, "mail", true, "").await;
    assert!(browser.text("#saved").await.contains("acme/mail"));
    assert_eq!(policy_changes(&app, "mail").await, 1);
    // A reload of the answer asks for the page again: the form is not sent twice.
    tokio::time::timeout(std::time::Duration::from_secs(30), browser.client.refresh())
        .await
        .expect("the reload answers")
        .expect("the reload shows a page");
    assert_eq!(browser.path().await, "/queues");
    assert!(
        browser
            .text("#policies")
            .await
            .contains("the relay is down")
    );
    assert_eq!(
        policy_changes(&app, "mail").await,
        1,
        "a reload sends nothing again"
    );

    // The form to change it shows it as it is.
    change_policy(&browser, "mail").await;
    let paused_box = browser
        .client
        .find(fantoccini::Locator::Css("#policy input[name=paused]"))
        .await
        .unwrap();
    assert!(paused_box.is_selected().await.unwrap());
    // Meanwhile another operator resumes the queue: this page, read before, still shows
    // the pause, and a change made on it is refused rather than undoing carol's.
    set_by_carol(&app, "mail", false).await;
    send_policy(&browser, true, "2").await;
    assert!(browser.text("h1").await.contains("409"));
    let error = browser.text("#error").await;
    assert!(error.contains("changed after it was read"), "{error}");
    assert!(error.contains("nothing was changed"), "{error}");
    let policies = queue_policies(&app).await;
    assert!(!policies[0].paused, "carol's policy stands");
    assert_eq!(policies[0].actor, "carol");
    assert_eq!(policy_changes(&app, "mail").await, 2);

    // Read again, the same change applies.
    browser.goto("/queues").await;
    change_policy(&browser, "mail").await;
    send_policy(&browser, true, "2").await;
    assert!(browser.text("#saved").await.contains("acme/mail"));
    let policies = queue_policies(&app).await;
    assert!(policies[0].paused);
    assert_eq!(policies[0].max_in_flight, 2);

    // The blank form gives a queue its first policy: one set meanwhile is not overwritten.
    browser.goto("/queues").await;
    set_by_carol(&app, "sms", true).await;
    submit_policy(&browser, "sms", false, "5").await;
    assert!(browser.text("h1").await.contains("409"));
    let error = browser.text("#error").await;
    assert!(
        error.contains("has a policy") && error.contains("nothing was changed"),
        "{error}"
    );
    let policies = queue_policies(&app).await;
    let sms = policies.iter().find(|p| p.kind == "sms").unwrap();
    assert!(sms.paused && sms.max_in_flight == 0, "{sms:?}");
    browser.close().await;
}

#[tokio::test]
async fn an_ordered_dead_letter_given_up_offers_no_decision() {
    let app = console_app().await;
    let head = v1::NewIntent {
        ordering_key: "customer-42".to_owned(),
        max_attempts: 1,
        ..intent("order.event", "{}")
    };
    let ids = app.enqueue_ids(vec![head]).await;
    let leases = app.claim_n("w", 1).await;
    app.fail(&leases[0], FailOutcome::Retry).await;
    assert_eq!(app.state(&ids[0]).await, IntentState::DeadLettered);
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto(&format!("/intents/{}", ids[0])).await;
    let offered = browser.text("#decision").await;
    assert!(offered.contains("DEAD"), "it holds its key: {offered}");

    app.reconcile(v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids: ids.clone(),
            updated_at: Vec::new(),
        })),
        decision: Decision::Dead as i32,
        actor: "carol".to_owned(),
        reason: "the customer closed the account".to_owned(),
        limit: 0,
    })
    .await
    .unwrap();
    browser.goto(&format!("/intents/{}", ids[0])).await;
    assert_eq!(browser.text("#intent-state").await, "DEAD_LETTERED");
    assert!(
        browser
            .client
            .find(fantoccini::Locator::Css("#decide"))
            .await
            .is_err(),
        "every decision on it would be refused"
    );
    assert!(browser.text("#final").await.contains("Given up (DEAD)"));
    browser.close().await;
}

#[tokio::test]
async fn a_decision_sent_after_the_session_expired_says_so_and_a_new_sign_in_returns_to_the_page() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    let page = format!("/intents/{}", ids[0]);
    browser.goto(&page).await;
    // The browser keeps the cookie until it closes: past the session's expiry, it still
    // sends it, and the server can tell an expired session from none.
    let cookie = browser
        .client
        .get_named_cookie("outboxd_session")
        .await
        .unwrap();
    assert_eq!(cookie.expires(), None, "{cookie:?}");
    assert_eq!(cookie.max_age(), None, "{cookie:?}");
    sqlx::query("UPDATE outbox.console_session SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    browser.select("#decision", "REQUEUE").await;
    browser.fill("#reason", "the provider lost it").await;
    browser.submit("#resolve").await;
    assert_eq!(browser.path().await, "/sign-in");
    let notice = browser.text("#error").await;
    assert!(
        notice.contains("expired") && notice.contains("nothing was changed"),
        "{notice}"
    );
    assert_eq!(app.state(&ids[0]).await, IntentState::NeedsReconcile);
    assert!(app.get(&ids[0]).await.resolutions.is_empty());
    browser.fill("#key", &key).await;
    browser.submit("#sign-in").await;
    assert_eq!(
        browser.path().await,
        page,
        "back on the page of the decision"
    );

    // A sign-in link that names another site leads to the overview, never away.
    for next in [
        "%2F%2Fattacker.example%2Fx",
        "https%3A%2F%2Fattacker.example%2F",
        "%2F%5Cattacker.example%2F",
        "%2F%09%2Fattacker.example%2F",
    ] {
        browser.goto(&format!("/sign-in?next={next}")).await;
        browser.fill("#key", &key).await;
        browser.submit("#sign-in").await;
        let url = browser.client.current_url().await.unwrap();
        assert_eq!(url.host_str(), Some("127.0.0.1"), "{next}: {url}");
        assert_eq!(url.path(), "/", "{next}: {url}");
    }
    browser.close().await;
}

/// A table's visible text, its cells separated by one space.
async fn table_text(browser: &Browser, xpath: &str) -> String {
    let table = browser
        .client
        .find(fantoccini::Locator::XPath(xpath))
        .await
        .unwrap_or_else(|e| panic!("{xpath}: {e}"));
    table.text().await.unwrap().replace('\t', " ")
}

#[tokio::test]
async fn the_overview_says_where_its_counts_stop_and_marks_only_the_counts_cut_short() {
    let app = console_app().await;
    left_unknown(&app, "charge", 1).await;
    // Two queues: each one's PENDING backlog is counted up to 2,000 (of 5,000 in all).
    for _ in 0..2 {
        app.enqueue_n("bulk", 1000).await;
    }
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    let note = browser.text("#capped").await;
    assert!(
        note.contains("PENDING") && note.contains("5,000") && note.contains("10,000"),
        "{note}"
    );
    let kinds = table_text(&browser, "//div[h2='By kind']//table").await;
    let kinds: Vec<&str> = kinds.lines().collect();
    assert_eq!(
        kinds,
        ["bulk ≥ 2000", "charge 1"],
        "an exact count has no ≥"
    );
    let groups = table_text(&browser, "//table[@id='groups']").await;
    assert!(groups.contains("PENDING acme bulk ≥ 2000"), "{groups}");
    assert!(groups.contains("NEEDS_RECONCILE acme charge 1"), "{groups}");
    browser.close().await;
}

#[tokio::test]
async fn a_kinds_backlog_over_two_priorities_each_within_its_share_is_counted_exactly() {
    let app = console_app().await;
    left_unknown(&app, "charge", 1).await;
    // Three levels (charge, bulk at priorities 0 and 1): each counted up to 1,000.
    for priority in [0, 1] {
        let intents = (0..600)
            .map(|_| v1::NewIntent {
                priority,
                ..intent("bulk", "{}")
            })
            .collect();
        app.enqueue(intents).await.unwrap();
    }
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    let kinds = table_text(&browser, "//div[h2='By kind']//table").await;
    let kinds: Vec<&str> = kinds.lines().collect();
    assert_eq!(kinds, ["bulk 1200", "charge 1"], "no level was cut short");
    browser.close().await;
}

#[tokio::test]
async fn a_reason_box_takes_as_long_a_reason_as_the_api_allows() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    let intent_page = format!("/intents/{}", ids[0]);
    for (page, css) in [
        ("/desk", "#reason"),
        (intent_page.as_str(), "#reason"),
        ("/queues", "#policy textarea[name=reason]"),
    ] {
        browser.goto(page).await;
        let element = browser
            .client
            .find(fantoccini::Locator::Css(css))
            .await
            .unwrap();
        assert_eq!(
            element.attr("maxlength").await.unwrap().as_deref(),
            Some("4096"),
            "{page}: OUTBOX_LIMITS__MAX_TEXT_LENGTH"
        );
    }

    // A reason of 4,096 characters is recorded whole.
    browser.goto(&intent_page).await;
    browser
        .run("document.querySelector('#reason').value = 'r'.repeat(4096)")
        .await;
    browser.select("#decision", "DELIVERED").await;
    browser.submit("#resolve").await;
    assert!(browser.text("#outcomes").await.contains("applied"));
    assert_eq!(app.get(&ids[0]).await.resolutions[0].reason.len(), 4096);
    browser.close().await;
}

#[tokio::test]
async fn a_form_over_the_size_limit_gets_the_consoles_error_page_and_changes_nothing() {
    let app = console_app().await;
    let ids = left_unknown(&app, "charge", 1).await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let browser = Browser::signed_in(app.console_addr.unwrap(), &key).await;
    browser.goto(&format!("/intents/{}", ids[0])).await;
    browser
        .run(
            "const r = document.querySelector('#reason'); r.removeAttribute('maxlength'); \
             r.value = 'x'.repeat(70000)",
        )
        .await;
    browser.select("#decision", "REQUEUE").await;
    browser.submit("#resolve").await;
    assert!(browser.text("h1").await.contains("413"));
    let error = browser.text("#error").await;
    assert!(
        error.contains("64 KiB") && error.contains("nothing was changed"),
        "{error}"
    );
    assert_eq!(app.state(&ids[0]).await, IntentState::NeedsReconcile);
    browser.close().await;
}
