//! The TCP fault proxy in front of each outboxd replica, for lost responses. On command it
//! arms every open client connection. From the next bytes that cross an armed connection
//! on, in either direction, everything the server sends back during a short window is
//! thrown away, and then both sides are reset. A request sent in that window is still
//! forwarded (the server executes the call), and the answer of a call already in flight
//! (a long-polling Claim that just leased intents) is lost: the client sees a broken
//! connection after the server acted, which is a lost response, and retries.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long an armed connection waits for a request before it is disarmed.
const ARM_TIMEOUT: Duration = Duration::from_secs(2);

/// What the proxy did, for the report.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Client connections accepted.
    pub connections: AtomicU64,
    /// Connections reset after their responses were dropped.
    pub resets: AtomicU64,
    /// Server→client bytes thrown away.
    pub bytes_dropped: AtomicU64,
}

#[derive(Debug)]
enum Arm {
    Normal,
    /// Start dropping at the next bytes either way, if they come before this instant.
    Armed {
        until: Instant,
        window: Duration,
    },
    /// Responses are being dropped; the connection is reset when the window ends.
    Dropping,
}

#[derive(Debug)]
struct Conn {
    arm: Mutex<Arm>,
    close: CancellationToken,
    reset: AtomicBool,
}

/// A running proxy: `listen` → `upstream`.
pub struct Proxy {
    /// Where clients connect.
    pub listen: SocketAddr,
    conns: Arc<Mutex<HashMap<u64, Arc<Conn>>>>,
    /// Counters.
    pub stats: Arc<ProxyStats>,
    shutdown: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let listen = listener.local_addr()?;
        let conns: Arc<Mutex<HashMap<u64, Arc<Conn>>>> = Arc::default();
        let stats = Arc::new(ProxyStats::default());
        let shutdown = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            upstream,
            conns.clone(),
            stats.clone(),
            shutdown.clone(),
        ));
        Ok(Self {
            listen,
            conns,
            stats,
            shutdown,
        })
    }

    /// Arms every open connection to lose the responses to its next requests for
    /// `window`, then reset. Returns how many connections were armed.
    pub fn drop_responses(&self, window: Duration) -> usize {
        let conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        for conn in conns.values() {
            let mut arm = conn.arm.lock().unwrap_or_else(PoisonError::into_inner);
            if matches!(*arm, Arm::Normal) {
                *arm = Arm::Armed {
                    until: Instant::now() + ARM_TIMEOUT,
                    window,
                };
            }
        }
        conns.len()
    }

    /// Stops accepting and closes every connection.
    pub fn stop(&self) {
        self.shutdown.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    conns: Arc<Mutex<HashMap<u64, Arc<Conn>>>>,
    stats: Arc<ProxyStats>,
    shutdown: CancellationToken,
) {
    let mut next_id = 0u64;
    loop {
        let client = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
        };
        next_id += 1;
        let id = next_id;
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let (conns, stats, shutdown) = (conns.clone(), stats.clone(), shutdown.clone());
        tokio::spawn(async move {
            // A replica that is down refuses the upstream connection: the client's
            // connection is then closed at once, as if the server had refused it.
            let connect = TcpStream::connect(upstream);
            let Ok(Ok(server)) = tokio::time::timeout(Duration::from_secs(1), connect).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let conn = Arc::new(Conn {
                arm: Mutex::new(Arm::Normal),
                close: shutdown.child_token(),
                reset: AtomicBool::new(false),
            });
            lock(&conns).insert(id, conn.clone());
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let upward = tokio::spawn(pump(
                client_read,
                server_write,
                Direction::Requests,
                conn.clone(),
                stats.clone(),
            ));
            let downward = tokio::spawn(pump(
                server_read,
                client_write,
                Direction::Responses,
                conn,
                stats,
            ));
            let _ = tokio::join!(upward, downward);
            lock(&conns).remove(&id);
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Which way bytes flow: only responses (server to client) are ever dropped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Requests,
    Responses,
}

/// Copies `from` to `to` until either side closes or the connection is reset; any traffic
/// starts an armed drop window, and while it is open responses are swallowed.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    direction: Direction,
    conn: Arc<Conn>,
    stats: Arc<ProxyStats>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            _ = conn.close.cancelled() => break,
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
        };
        start_dropping_if_armed(&conn, &stats);
        if direction == Direction::Responses && matches!(*lock(&conn.arm), Arm::Dropping) {
            stats.bytes_dropped.fetch_add(n as u64, Ordering::Relaxed);
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    finish(&conn, to.as_ref());
}

/// Armed and still in time: drop from now on, and reset when the window ends.
fn start_dropping_if_armed(conn: &Arc<Conn>, stats: &Arc<ProxyStats>) {
    let window = {
        let mut arm = lock(&conn.arm);
        match *arm {
            Arm::Armed { until, window } if Instant::now() < until => {
                *arm = Arm::Dropping;
                window
            }
            Arm::Armed { .. } => {
                *arm = Arm::Normal;
                return;
            }
            _ => return,
        }
    };
    let (conn, stats) = (conn.clone(), stats.clone());
    tokio::spawn(async move {
        tokio::time::sleep(window).await;
        conn.reset.store(true, Ordering::SeqCst);
        stats.resets.fetch_add(1, Ordering::Relaxed);
        conn.close.cancel();
    });
}

/// Ends both directions; a reset closes with RST (zero linger) instead of FIN.
fn finish(conn: &Conn, socket: &TcpStream) {
    if conn.reset.load(Ordering::SeqCst) {
        let _ = socket.set_zero_linger();
    }
    conn.close.cancel();
}
