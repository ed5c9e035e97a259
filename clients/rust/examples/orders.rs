//! Produce and work, end to end: an order and its email intent commit together, a worker
//! sends the email, then drains and exits.
//!
//! ```sh
//! OUTBOX_SERVER=127.0.0.1:50051 OUTBOX_API_KEY=obx_… \
//!   DATABASE_URL=postgres://…/app cargo run -p outboxd-client --example orders
//! ```
//!
//! The key needs the `produce` and `consume` scopes; `DATABASE_URL` names any database of
//! the outbox's PostgreSQL cluster.

use std::time::Duration;

use outboxd_client::{CancellationToken, Connection, Failure, Job, NewIntent, Outbox, Worker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = std::env::var("OUTBOX_SERVER").unwrap_or_else(|_| "127.0.0.1:50051".into());
    let connection = Connection::builder([endpoint])
        .api_key(
            std::env::var("OUTBOX_API_KEY")
                .map_err(|_| "set OUTBOX_API_KEY (a key with the produce and consume scopes)")?,
        )
        .build()?;
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL (a database of the outbox's PostgreSQL cluster)")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS email_orders (id bigserial PRIMARY KEY, email text)")
        .execute(&pool)
        .await?;

    // Producer: the order and its intent exist together, or neither does.
    let outbox = Outbox::new(connection.clone());
    let mut tx = pool.begin().await?;
    let order: i64 =
        sqlx::query_scalar("INSERT INTO email_orders (email) VALUES ($1) RETURNING id")
            .bind("ada@example.com")
            .fetch_one(&mut *tx)
            .await?;
    let intent = NewIntent::new("email.send", "ada@example.com")
        .idempotency_key(format!("orders/{order}/welcome-email"));
    let enqueued = outbox.enqueue(&mut tx, intent).await?; // STAGED until the commit
    tx.commit().await?; // a rollback would have discarded it
    println!("order {order}: intent {} enqueued", enqueued.id);

    // Worker: Ok acks, an error retries, Failure::permanent dead-letters.
    let done = CancellationToken::new();
    let worker = Worker::builder(connection)
        .concurrency(8)
        .handler("email.send", {
            let done = done.clone();
            move |job: Job| {
                let done = done.clone();
                async move {
                    let to = std::str::from_utf8(job.payload())?;
                    if to.is_empty() {
                        return Err(Failure::permanent("no address"));
                    }
                    println!("sending to {to} (attempt {})", job.attempt());
                    done.cancel(); // demo only: one email, then drain and exit
                    Ok(())
                }
            }
        })
        .grace(Duration::from_secs(10))
        .build()?;
    // Drains on Ctrl-C or after the first email (`worker.run()` drains on SIGTERM too).
    let shutdown = async {
        tokio::select! {
            () = done.cancelled() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    worker.run_until(shutdown).await?;
    println!("delivered: {}", worker.stats().acked);
    Ok(())
}
