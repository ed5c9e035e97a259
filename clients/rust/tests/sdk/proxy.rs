//! A loopback TCP proxy in front of an outboxd replica that loses answers: it resets the
//! connection instead of forwarding a server→client chunk larger than a threshold (a given
//! number of times, shared by every proxy holding the same `Cuts`), or, frozen, forwards
//! nothing at all, or holds every answer for a while. Requests get through, so the server
//! has acted when an answer is lost.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How many large answers to lose.
pub struct Cuts {
    left: AtomicUsize,
    done: AtomicUsize,
    threshold: usize,
}

impl Cuts {
    pub fn new(n: usize, threshold: usize) -> Arc<Self> {
        Arc::new(Self {
            left: AtomicUsize::new(n),
            done: AtomicUsize::new(0),
            threshold,
        })
    }

    pub fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    fn take(&self, size: usize) -> bool {
        if size < self.threshold {
            return false;
        }
        let taken = self
            .left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if taken {
            self.done.fetch_add(1, Ordering::SeqCst);
        }
        taken
    }
}

pub struct Proxy {
    pub addr: String,
    frozen: watch::Sender<bool>,
    delay: watch::Sender<Duration>,
    task: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: &str, cuts: Arc<Cuts>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (frozen, frozen_rx) = watch::channel(false);
        let (delay, delay_rx) = watch::channel(Duration::ZERO);
        let target = target.to_owned();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (frozen, delay) = (frozen_rx.clone(), delay_rx.clone());
                tokio::spawn(relay(client, server, cuts.clone(), frozen, delay));
            }
        });
        Self {
            addr,
            frozen,
            delay,
            task,
        }
    }

    /// Holds each answer (server→client chunk) this long before forwarding it, as a
    /// network that delivers late.
    pub fn delay_answers(&self, delay: Duration) {
        self.delay.send_replace(delay);
    }

    /// Stops (true) or resumes (false) forwarding, in both directions.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    cuts: Arc<Cuts>,
    mut frozen: watch::Receiver<bool>,
    delay: watch::Receiver<Duration>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut up = vec![0u8; 65536];
    let mut down = vec![0u8; 65536];
    // Answers held (delay_answers), each until its own time: delays do not add up.
    let mut held: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    loop {
        while *frozen.borrow_and_update() {
            if frozen.changed().await.is_err() {
                return;
            }
        }
        tokio::select! {
            read = client.read(&mut up) => {
                let n = match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if server.write_all(&up[..n]).await.is_err() {
                    break;
                }
            }
            read = server.read(&mut down) => {
                let n = match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if cuts.take(n) {
                    // Lose this answer: reset both sides, as a dying network would.
                    let _ = client.set_zero_linger();
                    let _ = server.set_zero_linger();
                    return;
                }
                let hold = *delay.borrow();
                if !hold.is_zero() || !held.is_empty() {
                    held.push_back((Instant::now() + hold, down[..n].to_vec()));
                } else if client.write_all(&down[..n]).await.is_err() {
                    break;
                }
            }
            () = sleep_until(held.front().map(|(due, _)| *due)), if !held.is_empty() => {
                let (_, chunk) = held.pop_front().expect("not empty");
                if client.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            changed = frozen.changed() => if changed.is_err() { break },
        }
    }
    let _ = client.shutdown().await;
    let _ = server.shutdown().await;
}

/// Sleeps until `due` (never, without one: the branch is off then).
async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}
