//! The `outboxd` commands a deployment runs as Jobs (charts/outboxd): `migrate` with the
//! owner's and the service's URLs, and `keys create --secret-from-env`, each run as the
//! real binary against a real PostgreSQL, as the chart's Jobs run them; and the client
//! commands' flags.

use std::process::Output;

use outboxd::proto::v1;
use outboxd::startup::{self, Database};
use sqlx::PgPool;
use uuid::Uuid;

use crate::helpers::{TENANT, TestApp, fresh_database, id_of, other_database};

/// `outboxd <args>` with only `env` of the OUTBOX_* variables (it refuses unknown ones,
/// and the tests' own are not its).
pub(crate) async fn outboxd(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_outboxd"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OUTBOX_") {
            command.env_remove(name);
        }
    }
    command.args(args).envs(env.iter().copied());
    command.output().await.expect("run outboxd")
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn as_role(url: &str, role: &str) -> String {
    url.replacen("://postgres@", &format!("://{role}@"), 1)
}

#[tokio::test]
async fn migrate_with_the_owner_and_service_urls_grants_the_service_and_fleet_roles() {
    // An empty database and two login roles nobody granted anything, as a chart install
    // finds them: the migrate Job must leave them ready to serve.
    let owner_url = other_database().await;
    let owner = PgPool::connect(&owner_url).await.unwrap();
    let suffix = &Uuid::new_v4().simple().to_string()[..12];
    let (service, fleet) = (format!("svc_{suffix}"), format!("fleet_{suffix}"));
    for role in [&service, &fleet] {
        sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
            .execute(&owner)
            .await
            .unwrap();
    }
    let (service_url, fleet_url) = (as_role(&owner_url, &service), as_role(&owner_url, &fleet));
    let env = [
        ("OUTBOX_DATABASE__URL", service_url.as_str()),
        ("OUTBOX_DATABASE__FLEET_URL", fleet_url.as_str()),
        ("OUTBOX_DATABASE__MIGRATION_URL", owner_url.as_str()),
    ];
    // Twice: the Job runs on every upgrade.
    for _ in 0..2 {
        let migrated = outboxd(&["migrate"], &env).await;
        assert!(migrated.status.success(), "{}", text(&migrated));
        assert!(String::from_utf8_lossy(&migrated.stdout).contains("migrations applied"));
    }

    let (may_delete, fleet_member, service_in_fleet): (bool, bool, bool) = sqlx::query_as(
        "SELECT has_table_privilege($1, 'outbox.intent', 'DELETE'),
                pg_has_role($2, 'outboxd_fleet', 'MEMBER'),
                pg_has_role($1, 'outboxd_fleet', 'MEMBER')",
    )
    .bind(&service)
    .bind(&fleet)
    .fetch_one(&owner)
    .await
    .unwrap();
    assert!(may_delete, "the service role was not granted");
    assert!(
        fleet_member,
        "the fleet role is not a member of outboxd_fleet"
    );
    assert!(
        !service_in_fleet,
        "the service role must not see every tenant"
    );
    // What a server checks of both roles before it serves.
    let database = Database {
        service_url,
        fleet_url: Some(fleet_url),
        embedded: None,
    };
    let pools = startup::connect_pools(&database, 2).await.unwrap();
    pools.close().await;
    owner.close().await;
}

#[tokio::test]
async fn keys_create_from_an_environment_variable_stores_that_key_once_for_the_server() {
    let url = fresh_database().await;
    let secret = format!("obx_{}", Uuid::new_v4().simple());
    let create = |secret: String| {
        let url = url.clone();
        async move {
            let args = [
                "keys",
                "create",
                "--name",
                "bootstrap",
                "--tenant",
                "acme",
                "--scope",
                "admin",
                "--secret-from-env",
                "BOOTSTRAP_KEY",
                "--json",
            ];
            let env = [
                ("OUTBOX_DATABASE__MIGRATION_URL", url.as_str()),
                ("BOOTSTRAP_KEY", secret.as_str()),
            ];
            outboxd(&args, &env).await
        }
    };
    // The Job runs on every install and upgrade: stored the first time only.
    for expected in [true, false] {
        let created = create(secret.clone()).await;
        assert!(created.status.success(), "{}", text(&created));
        let stdout = String::from_utf8_lossy(&created.stdout);
        assert!(!text(&created).contains(&secret), "the secret was printed");
        let reply: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(reply["stored"], expected, "{stdout}");
    }
    let owner = PgPool::connect(&url).await.unwrap();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.api_key")
        .fetch_one(&owner)
        .await
        .unwrap();
    assert_eq!(stored, 1);

    // A key too short to be a secret is refused, without being echoed or stored.
    let short = create("obx_0123456789abcdef".to_owned()).await;
    assert!(!short.status.success(), "{}", text(&short));
    assert!(
        !text(&short).contains("0123456789abcdef"),
        "{}",
        text(&short)
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.api_key")
        .fetch_one(&owner)
        .await
        .unwrap();
    assert_eq!(stored, 1);
    owner.close().await;

    let app = TestApp::spawn_on(url, |_| {}).await;
    let mut client = app.client_with(Some(&secret), None).await;
    client
        .get_queue_stats(v1::GetQueueStatsRequest {})
        .await
        .expect("the server accepts the stored key");
}

#[tokio::test]
async fn a_client_command_refuses_set_instead_of_ignoring_it() {
    let app = TestApp::spawn().await;
    let key = app.key(&["acme"], &["produce"], &[]).await;
    let server = format!("http://{}", app.addr);
    let env = [
        ("OUTBOX_SERVER", server.as_str()),
        ("OUTBOX_API_KEY", key.as_str()),
    ];
    let args = ["enqueue", "--kind", "email.send", "--payload", "{}"];

    let with_set: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--set", "LISTEN_ADDR=x"])
        .collect();
    let refused = outboxd(&with_set, &env).await;
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--set sets the server's variables"),
        "{}",
        text(&refused)
    );
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(written, 0);

    // The same command without it runs.
    let enqueued = outboxd(&args, &env).await;
    assert!(enqueued.status.success(), "{}", text(&enqueued));
}

/// `outboxd intents list | head -1`: the reader goes away after a line, and the command
/// ends quietly, as a process SIGPIPE kills does (status 141), not with a panic.
#[tokio::test]
async fn a_command_whose_reader_goes_away_ends_quietly() {
    use tokio::io::AsyncBufReadExt;
    let app = crate::helpers::TestApp::spawn().await;
    let key = app.key(&[crate::helpers::TENANT], &["admin"], &[]).await;
    app.enqueue_n("job", 1000).await;
    let server = format!("http://{}", app.addr);
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_outboxd"));
    command
        .args(["intents", "list", "--limit", "1000", "--json"])
        .args(["--server", &server, "--api-key", &key])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().unwrap();
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).await.unwrap();
    // 1000 intents as JSON (some 300 KiB), more than a pipe holds (64 KiB) and the reader
    // took (8 KiB): the command is still writing when the reader goes.
    assert_eq!(first.trim(), "{");
    drop(stdout);
    let output = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(141), "{stderr}");
}

/// Without `OUTBOX_DATABASE__MIGRATION_URL`, `keys` and `migrate` act as the role of
/// `OUTBOX_DATABASE__URL`; when that is the service role, PostgreSQL refuses it, and the
/// error says which variable to set.
#[tokio::test]
async fn keys_and_migrate_as_the_service_role_say_to_set_the_owners_url() {
    let app = crate::helpers::TestApp::spawn().await;
    let service = crate::helpers::service_url(&app.url);
    let fleet = crate::helpers::fleet_url(&app.url);
    let env = [
        ("OUTBOX_DATABASE__URL", service.as_str()),
        ("OUTBOX_DATABASE__FLEET_URL", fleet.as_str()),
    ];
    let args = [
        "keys", "create", "--name", "x", "--tenant", "acme", "--scope", "admin",
    ];
    for args in [&args[..], &["keys", "revoke", "x"], &["migrate"]] {
        let output = outboxd(args, &env).await;
        assert!(!output.status.success(), "{args:?}: {}", text(&output));
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("set OUTBOX_DATABASE__MIGRATION_URL"),
            "{args:?}: {}",
            text(&output)
        );
    }
}

#[tokio::test]
async fn keys_on_a_database_never_migrated_say_to_migrate_first() {
    let url = other_database().await;
    let fleet = url.clone();
    let env = [
        ("OUTBOX_DATABASE__URL", url.as_str()),
        ("OUTBOX_DATABASE__FLEET_URL", fleet.as_str()),
    ];
    let args = [
        "keys", "create", "--name", "x", "--tenant", "acme", "--scope", "admin",
    ];
    for args in [&args[..], &["keys", "list"]] {
        let output = outboxd(args, &env).await;
        assert!(!output.status.success(), "{args:?}: {}", text(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("run `outboxd migrate`") && !stderr.contains("does not exist"),
            "{args:?}: {}",
            text(&output)
        );
    }
}

/// `outboxd <args>` against `app`'s server with `key`, whatever its exit.
async fn client_command(app: &TestApp, key: &str, args: &[&str]) -> Output {
    let server = format!("http://{}", app.addr);
    let args = [args, &["--server", &server, "--api-key", key]].concat();
    outboxd(&args, &[]).await
}

#[tokio::test]
async fn an_empty_api_key_is_named_and_a_key_read_with_its_line_end_works() {
    let app = TestApp::spawn().await;
    let key = app.key(&["acme"], &["operate"], &[]).await;
    let empty = client_command(&app, "", &["stats"]).await;
    assert!(!empty.status.success());
    assert!(
        String::from_utf8_lossy(&empty.stderr).contains("the API key is empty"),
        "{}",
        text(&empty)
    );
    let crlf = client_command(&app, &format!("{key}\r\n"), &["stats"]).await;
    assert!(crlf.status.success(), "{}", text(&crlf));
}

/// Puts `n` intents of `kind` into NEEDS_RECONCILE (Fail UNKNOWN); their ids, sorted.
async fn awaiting_decision(app: &TestApp, kind: &str, n: i32) -> Vec<String> {
    app.enqueue_n(kind, n as usize).await;
    let leases = app.claim_n("w", n).await;
    for lease in &leases {
        app.fail(lease, v1::FailOutcome::Unknown).await;
    }
    let mut ids: Vec<String> = leases.iter().map(|l| id_of(l).to_owned()).collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn reconcile_resolve_by_id_refuses_the_filters_flags_and_sends_nothing() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["operate"], &[]).await;
    let id = awaiting_decision(&app, "charge", 1).await.remove(0);
    let by_id = [
        "reconcile",
        "resolve",
        "--id",
        &id,
        "--decision",
        "delivered",
        "--reason",
        "t",
    ];
    let filters: [&[&str]; 4] = [
        &["--kind", "other.kind", "--region", "eu"],
        &["--kind", "other.kind"],
        &["--region", "eu"],
        &["--limit", "5"],
    ];
    for filter in filters {
        let args = [&by_id[..], filter].concat();
        let refused = client_command(&app, &key, &args).await;
        assert!(!refused.status.success(), "{filter:?}: {}", text(&refused));
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            stderr.contains("cannot be used with") && stderr.contains("--id"),
            "{filter:?}: {}",
            text(&refused)
        );
        let got = app.get(&id).await;
        assert_eq!(got.intent.unwrap().state(), v1::IntentState::NeedsReconcile);
        assert!(
            got.resolutions.is_empty(),
            "{filter:?}: {:?}",
            got.resolutions
        );
    }

    let resolved = client_command(&app, &key, &by_id).await;
    assert!(resolved.status.success(), "{}", text(&resolved));
    let stdout = String::from_utf8_lossy(&resolved.stdout);
    assert!(
        stdout.contains(&format!("{id}  ok  now DELIVERED")),
        "{stdout}"
    );
    assert!(stdout.contains("resolved 1 of 1 intent\n"), "{stdout}");
}

#[tokio::test]
async fn reconcile_list_pages_through_by_the_token_it_prints() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["operate"], &[]).await;
    let ids = awaiting_decision(&app, "charge", 3).await;
    let mut listed = Vec::new();
    let mut next: Option<String> = None;
    for _ in 0..ids.len() + 1 {
        let mut args = vec!["reconcile", "list", "--limit", "1"];
        if let Some(token) = &next {
            args.extend(["--page-token", token]);
        }
        let page = client_command(&app, &key, &args).await;
        assert!(page.status.success(), "{args:?}: {}", text(&page));
        let stdout = String::from_utf8_lossy(&page.stdout).into_owned();
        listed.extend(
            ids.iter()
                .filter(|id| stdout.contains(id.as_str()))
                .cloned(),
        );
        // The hint is the flag and its value, to paste after the same command.
        next = stdout
            .lines()
            .find_map(|l| l.strip_prefix("more: --page-token "))
            .map(str::to_owned);
        if next.is_none() {
            break;
        }
    }
    listed.sort();
    assert_eq!(listed, ids, "each intent once");
    assert_eq!(next, None, "the last page prints no token");
}

#[tokio::test]
async fn a_refused_call_prints_its_code_and_errorinfo_reason_on_one_line() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["admin"], &[]).await;
    let refused = client_command(&app, &key, &["intents", "list", "--limit", "1000000"]).await;
    assert!(!refused.status.success(), "{}", text(&refused));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.starts_with("error: RESOURCE_EXHAUSTED/BATCH_TOO_LARGE: ")
            && stderr.contains("page_size"),
        "{}",
        text(&refused)
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    // A reason that is its code's own name is not repeated.
    let missing = Uuid::now_v7().to_string();
    let refused = client_command(&app, &key, &["intents", "get", &missing]).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.starts_with("error: NOT_FOUND: ") && stderr.contains(&missing),
        "{}",
        text(&refused)
    );
}

#[tokio::test]
async fn reconcile_resolve_by_filter_says_how_many_it_resolved_none_too() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["operate"], &[]).await;
    let ids = awaiting_decision(&app, "charge", 2).await;
    let by_filter = |kind: &'static str| {
        [
            "reconcile",
            "resolve",
            "--state",
            "needs_reconcile",
            "--kind",
            kind,
            "--decision",
            "delivered",
            "--reason",
            "t",
        ]
    };

    let none = client_command(&app, &key, &by_filter("other.kind")).await;
    assert!(none.status.success(), "{}", text(&none));
    assert_eq!(
        String::from_utf8_lossy(&none.stdout),
        "resolved 0 intents: none matched the filter\n"
    );
    // --json keeps its shape: the results, and nothing else.
    let json = [&by_filter("other.kind")[..], &["--json"]].concat();
    let none = client_command(&app, &key, &json).await;
    assert!(none.status.success(), "{}", text(&none));
    let results: serde_json::Value = serde_json::from_slice(&none.stdout).unwrap();
    assert_eq!(results, serde_json::json!([]));

    let both = client_command(&app, &key, &by_filter("charge")).await;
    assert!(both.status.success(), "{}", text(&both));
    let stdout = String::from_utf8_lossy(&both.stdout);
    for id in &ids {
        assert!(
            stdout.contains(&format!("{id}  ok  now DELIVERED")),
            "{stdout}"
        );
    }
    assert!(stdout.ends_with("resolved 2 intents\n"), "{stdout}");
}

#[tokio::test]
async fn reconcile_resolve_cancels_only_the_intents_created_before_an_instant() {
    let app = TestApp::spawn().await;
    let key = app.key(&[TENANT], &["operate"], &[]).await;
    let older = app.enqueue_n("mail", 2).await;
    app.clock.advance(std::time::Duration::from_secs(1));
    let newer = app.enqueue_one("mail", "{}").await;
    let cut = app.intent(&newer).await.created_at.unwrap();
    let cut = chrono::DateTime::from_timestamp(cut.seconds, cut.nanos as u32)
        .unwrap()
        .to_rfc3339();

    let args = [
        "reconcile",
        "resolve",
        "--state",
        "pending",
        "--kind",
        "mail",
        "--created-before",
        &cut,
        "--decision",
        "cancel",
        "--reason",
        "campaign withdrawn",
    ];
    let out = client_command(&app, &key, &args).await;
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.ends_with("resolved 2 intents\n"), "{stdout}");
    for id in &older {
        assert_eq!(app.intent(id).await.state(), v1::IntentState::Cancelled);
    }
    assert_eq!(app.intent(&newer).await.state(), v1::IntentState::Pending);

    let refused = client_command(&app, &key, &[&args[..], &["--id", &newer]].concat()).await;
    assert!(!refused.status.success(), "--id with the filter's flags");
    let refused = client_command(
        &app,
        &key,
        &[&args[..7], &["not a time"], &args[8..]].concat(),
    )
    .await;
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--created-before"),
        "{}",
        text(&refused)
    );
}
