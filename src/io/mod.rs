//! Drivers: the only place that touches sockets. Each I/O thread owns a set of connections
//! for their whole life and pumps their protocol state machines (`protocol/`); task threads
//! never touch a socket. Two drivers over the same segments and the same state machines:
//!
//! * [`epoll`] — mio (epoll), vectored reads and writes; works everywhere.
//!   With TLS on ([`tls`]), a rustls session sits between each socket and its connection.
//! * [`uring`] — io_uring: one ring per I/O thread, one read and at most one write chain in
//!   flight per connection, every submission of a loop turn in one `io_uring_enter`.
//!
//! Hand-off from task threads: commands go through a bounded queue; a parked I/O thread is
//! woken through the poller's waker only when its "parked" flag is set, so the busy path makes
//! no syscall.

mod conn;
pub mod epoll;
pub mod tls;
pub mod uring;

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Wake;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use crate::buffer::NetworkBufferPool;
use crate::gate::RemoteChannelShared;
use crate::protocol::{auth, ClientConfig, ClientConnection, ServerConfig};

/// What an I/O thread needs to know (either driver).
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// This process's node identity.
    pub node: u128,
    /// Payload bytes per segment.
    pub segment_size: usize,
    /// Producer-side connection settings.
    pub server: ServerConfig,
    /// Consumer-side connection settings.
    pub client: ClientConfig,
    /// Most accepted connections open at once (`fluxgate.network.max-connections`); one more
    /// is closed as soon as it is accepted.
    pub max_connections: usize,
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// Delays before re-sending a partition request the producer answered with
    /// PartitionNotFound, and before re-opening a refused connection.
    pub request_backoff: crate::gate::Backoff,
    /// The network memory the segments come from. The io_uring driver registers its arenas
    /// as fixed buffers and writes segment bytes in place; without it every byte it writes is
    /// copied first. The epoll driver ignores it.
    pub network: Option<NetworkBufferPool>,
    /// TLS between nodes (`security.ssl.internal.*`): every connection runs over a rustls
    /// session. Only the epoll driver supports it; the environment refuses io_uring with it.
    pub tls: Option<Arc<tls::TlsContext>>,
}

impl DriverConfig {
    /// A consumer-side connection, with a fresh handshake nonce when it authenticates.
    pub(crate) fn new_client(&self) -> std::io::Result<ClientConnection> {
        let nonce = match self.client.secret {
            Some(_) => auth::fresh_nonce().map_err(|error| {
                std::io::Error::other(format!("no random nonce for the handshake: {error}"))
            })?,
            None => [0; auth::NONCE_LEN],
        };
        Ok(ClientConnection::with_config(self.client.clone(), nonce))
    }
}

/// Logs a connection refused because the server has `max_connections` open (both drivers).
pub(crate) fn refuse_connection(peer: Option<SocketAddr>, open: usize, max_connections: usize) {
    tracing::warn!(
        ?peer,
        open,
        max_connections,
        "refusing a connection: fluxgate.network.max-connections reached"
    );
}

/// Which driver moves the bytes (`fluxgate.network.transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Transport {
    /// io_uring where the kernel allows it, else epoll.
    #[default]
    Auto,
    /// io_uring only.
    Uring,
    /// epoll (mio).
    Epoll,
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Transport::Auto),
            "uring" | "io_uring" => Ok(Transport::Uring),
            "epoll" => Ok(Transport::Epoll),
            other => Err(format!(
                "unknown transport `{other}` (auto | uring | epoll)"
            )),
        }
    }
}

/// Work handed to an I/O thread.
pub(crate) enum Command {
    /// Register a remote channel on the connection to `peer` (opened on first use).
    Connect {
        peer: SocketAddr,
        connection_index: usize,
        channel: Arc<RemoteChannelShared>,
    },
    /// Report every connection's state (diagnostics).
    Dump(std::sync::mpsc::Sender<String>),
    /// Close every connection and end the thread.
    Shutdown,
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Connect { peer, .. } => write!(f, "Connect({peer})"),
            Command::Dump(_) => f.write_str("Dump"),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

/// The wake-up action of a parked I/O thread (an eventfd or mio waker write).
pub(crate) type WakeFn = Box<dyn Fn() + Send + Sync>;

/// What task threads hold of a running I/O thread (either driver): its command queue, its
/// waker and the thread. Dropping it shuts the thread down and waits for it.
pub(crate) struct DriverHandle {
    pub(crate) commands: Arc<ArrayQueue<Command>>,
    pub(crate) waker: Arc<IoWaker<WakeFn>>,
    pub(crate) thread: Option<thread::JoinHandle<()>>,
    pub(crate) local_addr: SocketAddr,
}

impl DriverHandle {
    /// Hands a command to the I/O thread. Blocks (bounded) only if its queue is full.
    pub(crate) fn submit(&self, mut command: Command) {
        // Bounded: the I/O thread drains the queue every loop turn.
        for _ in 0..10_000 {
            match self.commands.push(command) {
                Ok(()) => break,
                Err(back) => {
                    command = back;
                    (self.waker.wake)();
                    thread::sleep(Duration::from_millis(1));
                }
            }
        }
        (self.waker.wake)();
    }
}

impl Drop for DriverHandle {
    fn drop(&mut self) {
        self.submit(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Wakes a parked I/O thread; a no-op (no syscall) while it runs.
pub(crate) struct IoWaker<W: Fn() + Send + Sync> {
    pub(crate) parked: AtomicBool,
    pub(crate) wake: W,
}

impl<W: Fn() + Send + Sync> Wake for IoWaker<W> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Pairs with the SeqCst store of `parked` before the thread's last look for work. Only
        // the first waker of a parked thread makes the syscall.
        if self.parked.load(Ordering::SeqCst) && self.parked.swap(false, Ordering::SeqCst) {
            (self.wake)();
        }
    }
}

/// A remote channel whose connection was refused, waiting to try again.
struct RefusedConnect {
    peer: SocketAddr,
    connection_index: usize,
    channel: Arc<RemoteChannelShared>,
    backoff: crate::gate::Backoff,
    due: Instant,
}

/// Channels whose connection attempt failed in a way a later attempt may not: the peer's
/// process is not listening yet (nodes started apart, a producer still starting), or its
/// listen queue overflowed. They try again after the partition-request back-off
/// (`taskmanager.network.request-backoff.*`) and fail once it is exhausted. Shared by both
/// drivers; the I/O thread's timer wakes it.
#[derive(Default)]
pub(crate) struct RefusedConnects {
    waiting: Vec<RefusedConnect>,
}

impl fmt::Debug for RefusedConnects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RefusedConnects")
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

/// What a driver does with a channel whose connection attempt failed.
pub(crate) enum ConnectFailure {
    /// Queued for another attempt.
    Retrying,
    /// Give up: fail the channel with this reason.
    Fail(String),
}

impl RefusedConnects {
    /// Connecting `channel` to `peer` failed with `error` after the delays `backoff` already
    /// went through.
    pub(crate) fn on_failure(
        &mut self,
        peer: SocketAddr,
        connection_index: usize,
        channel: Arc<RemoteChannelShared>,
        mut backoff: crate::gate::Backoff,
        error: &io::Error,
        now: Instant,
    ) -> ConnectFailure {
        let retryable = matches!(
            error.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::TimedOut
                | io::ErrorKind::WouldBlock
        );
        if !retryable || channel.is_released() || !backoff.increase() {
            return ConnectFailure::Fail(format!("connecting to {peer} failed: {error}"));
        }
        tracing::debug!(%peer, %error, delay = ?backoff.current(), "connection refused; trying again after the back-off");
        self.waiting.push(RefusedConnect {
            peer,
            connection_index,
            channel,
            backoff,
            due: now + backoff.current(),
        });
        ConnectFailure::Retrying
    }

    /// Moves the attempts due at `now` into `out` as Connect commands with their back-off;
    /// channels the gate released meanwhile are dropped.
    pub(crate) fn take_due(
        &mut self,
        now: Instant,
        out: &mut Vec<(Command, crate::gate::Backoff)>,
    ) {
        if self.waiting.is_empty() {
            return;
        }
        let mut index = 0;
        // Bounded by the list: each pass removes an entry or steps past one.
        while index < self.waiting.len() {
            let entry = &self.waiting[index];
            if entry.channel.is_released() || entry.due <= now {
                let entry = self.waiting.swap_remove(index);
                if !entry.channel.is_released() {
                    entry.channel.note_retry();
                    out.push((
                        Command::Connect {
                            peer: entry.peer,
                            connection_index: entry.connection_index,
                            channel: entry.channel,
                        },
                        entry.backoff,
                    ));
                }
            } else {
                index += 1;
            }
        }
    }

    /// When the next attempt is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.waiting.iter().map(|e| e.due).min()
    }
}

/// Opens a client connection's socket (blocking connect bounded by the configured timeout,
/// TCP_NODELAY on) and its protocol state, as both drivers do.
pub(crate) fn open_client(
    peer: SocketAddr,
    config: &DriverConfig,
) -> io::Result<(std::net::TcpStream, ClientConnection)> {
    let stream = std::net::TcpStream::connect_timeout(&peer, config.connect_timeout)?;
    stream.set_nodelay(true)?;
    let client = config
        .new_client()?
        .with_request_backoff(config.request_backoff);
    Ok((stream, client))
}
