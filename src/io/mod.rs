//! Drivers: the only place that touches sockets. Each I/O thread owns a set of connections
//! for their whole life and pumps their protocol state machines (`protocol/`); task threads
//! never touch a socket. Two drivers over the same segments and the same state machines:
//!
//! * [`epoll`] — mio (epoll), vectored reads and writes; works everywhere.
//!   With TLS on ([`tls`]), a rustls session sits between each socket and its connection.
//! * [`uring`] — io_uring: one ring per I/O thread, one read and at most one write chain in
//!   flight per connection, the submissions of a loop turn entered together.
//!
//! Hand-off from task threads: commands go through a bounded queue; a parked I/O thread is
//! woken through the poller's waker only when its "parked" flag is set, so the busy path makes
//! no syscall. With `fluxgate.network.io-thread.busy-poll-us` set, a thread out of work keeps
//! looking for that long before it parks (`BusyPoll`), so work arriving within the
//! window needs no wake-up at all.

mod conn;
pub mod epoll;
pub mod tls;
pub mod uring;
// Public only under `--cfg loom`, for the models in `tests/loom.rs`.
#[cfg(not(loom))]
mod waker;
#[cfg(loom)]
#[doc(hidden)]
pub mod waker;

pub(crate) use waker::{BusyPoll, IoWaker};

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::buffer::NetworkBufferPool;
use crate::gate::RemoteChannelShared;
use crate::protocol::{auth, ClientConfig, ClientConnection, ServerConfig};
use crate::sync::ArrayQueue;

/// How long a connection closing after a protocol error may take to write the ErrorResponse
/// it queued for its peer, behind what its socket already held (a peer that stopped reading
/// fills it), before it is closed anyway.
pub(crate) const ERROR_RESPONSE_LINGER: Duration = Duration::from_secs(5);

/// Reads after which an I/O thread gives the gate wake-ups it holds (see
/// `gate::hold_wakes`): at 32 KiB buffers, half a MiB, so a reader whose buffer came first in
/// a long read loop waits for at most that much more reading, not for the whole loop.
pub(crate) const READS_PER_WAKE: usize = 16;

/// Pause before accepting again after an accept error other than a transient one (out of
/// file descriptors or memory): the connections the kernel queued meanwhile are taken then.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Whether an accept that failed with `errno` can never succeed on this listener: the socket
/// is not (or no longer) a listening socket. Everything else passes: no descriptors, no
/// memory, a connection that went away, the firewall refusing one peer, and the pending
/// network errors Linux hands back from `accept` for one new connection (`EOPNOTSUPP` among
/// them, which accept(2) says to retry like `EAGAIN`).
pub(crate) fn listener_failed_for_good(errno: i32) -> bool {
    matches!(errno, libc::EBADF | libc::EINVAL | libc::ENOTSOCK)
}

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
    /// Keepalive and user-timeout settings of every socket.
    pub liveness: Liveness,
    /// The network memory the segments come from. The io_uring driver registers its arenas
    /// as fixed buffers and writes segment bytes in place; without it every byte it writes is
    /// copied first. The epoll driver ignores it.
    pub network: Option<NetworkBufferPool>,
    /// TLS between nodes (`security.ssl.internal.*`): every connection runs over a rustls
    /// session. Only the epoll driver supports it; the environment refuses io_uring with it.
    pub tls: Option<Arc<tls::TlsContext>>,
    /// Zero-copy sends to non-loopback peers (`fluxgate.network.zero-copy-send`; io_uring
    /// only).
    pub zero_copy_send: crate::ZeroCopySend,
    /// How long the thread keeps looking for work before it sleeps
    /// (`fluxgate.network.io-thread.busy-poll-us`; zero: it sleeps at once).
    pub busy_poll: Duration,
}

impl DriverConfig {
    /// A consumer-side connection, with a fresh handshake nonce when it authenticates.
    pub(crate) fn new_client(&self) -> std::io::Result<ClientConnection> {
        let nonce = match &self.client.secret {
            Some(secret) => secret.fresh_nonce().map_err(|error| {
                std::io::Error::other(format!("no random nonce for the handshake: {error}"))
            })?,
            None => [0; auth::NONCE_LEN],
        };
        Ok(ClientConnection::with_config(self.client.clone(), nonce))
    }
}

/// What [`discard_input`] left.
pub(crate) enum Discarded {
    /// Everything the socket held.
    Drained,
    /// Its bound was reached with input left.
    More,
    /// The peer's end came.
    Ended,
    /// The socket failed.
    Failed,
}

/// Reads and drops what the socket holds now, without waiting (both drivers, for a connection
/// closing after a protocol error: a socket closed with unread input sends a reset, and a
/// reset can discard the ErrorResponse its peer has not read yet). Bounded: at most 1 MiB
/// per call.
pub(crate) fn discard_input(stream: &impl std::os::fd::AsFd) -> Discarded {
    let socket = socket2::SockRef::from(stream);
    let mut sink = [std::mem::MaybeUninit::<u8>::uninit(); 16 * 1024];
    for _ in 0..64 {
        match socket.recv_with_flags(&mut sink, libc::MSG_DONTWAIT) {
            Ok(0) => return Discarded::Ended,
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Discarded::Drained,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Discarded::Failed,
        }
    }
    Discarded::More
}

/// [`discard_input`] until the socket is drained, for a close: at most 8 MiB (a receive
/// buffer's autotuned size is 6 MiB by default), so only a peer still flooding leaves input.
pub(crate) fn discard_input_before_close(stream: &impl std::os::fd::AsFd) {
    for _ in 0..8 {
        if !matches!(discard_input(stream), Discarded::More) {
            return;
        }
    }
}

/// Refuses a connection because the server has `max_connections` open (both drivers): logs
/// it and, on a plain connection, says so in an ErrorResponse of kind LimitExceeded before
/// the close, so the consumer connects again later instead of failing its channels (under
/// TLS a plaintext frame would only break the handshake: such a consumer sees the close).
/// The caller drops the stream.
pub(crate) fn refuse_connection(
    stream: &impl std::os::fd::AsFd,
    tls: bool,
    open: usize,
    max_connections: usize,
) {
    let socket = socket2::SockRef::from(stream);
    let peer = socket.peer_addr().ok().and_then(|a| a.as_socket());
    tracing::warn!(
        ?peer,
        open,
        max_connections,
        "refusing a connection: fluxgate.network.max-connections reached"
    );
    if tls {
        return;
    }
    let mut frame = Vec::new();
    crate::protocol::Message::ErrorResponse {
        receiver: None,
        kind: crate::protocol::ErrorKind::LimitExceeded,
        message: format!("fluxgate.network.max-connections ({max_connections}) reached"),
    }
    .encode(&mut frame);
    // Best effort: a new socket's send buffer takes the one small frame whole. The input the
    // consumer sent already is read away, so the close is a FIN, not a reset that could
    // discard the frame before the consumer reads it.
    let _ = socket.send_with_flags(&frame, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
    let _ = socket.shutdown(std::net::Shutdown::Write);
    discard_input_before_close(stream);
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
    /// A connect a helper thread made (see [`start_connect`]) finished.
    Connected {
        peer: SocketAddr,
        connection_index: usize,
        /// Which attempt for (`peer`, `connection_index`) this is ([`PendingConnects`]).
        attempt: u64,
        result: io::Result<std::net::TcpStream>,
    },
    /// Report every connection's state (diagnostics).
    Dump(std::sync::mpsc::Sender<String>),
    /// Report the I/O thread's operation counts (diagnostics and tests).
    Stats(std::sync::mpsc::Sender<DriverStats>),
    /// Close every connection and end the thread.
    Shutdown,
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Connect { peer, .. } => write!(f, "Connect({peer})"),
            Command::Connected { peer, result, .. } => {
                write!(f, "Connected({peer}, ok {})", result.is_ok())
            }
            Command::Dump(_) => f.write_str("Dump"),
            Command::Stats(_) => f.write_str("Stats"),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

/// Operation counts of one I/O thread since it started
/// ([`ShuffleEnvironment::driver_stats`](crate::ShuffleEnvironment::driver_stats)). The epoll
/// driver counts only `turns`, `sleeps`, `open_connections`, `failed_accepts`,
/// `refused_connections`, `short_writes` and `protocol_errors`; its
/// other counts (io_uring's operations) are zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverStats {
    /// Turns of the event loop: each looks at commands, due timers and every connection's
    /// writes, then waits. An idle thread takes about ten per second (it parks for at most
    /// 100 ms); a thread that counts many more than it sleeps is busy, or busy-polling.
    pub turns: u64,
    /// Waits that could sleep: the thread ran out of work (and out of its busy-poll window)
    /// and parked until woken or its next deadline.
    pub sleeps: u64,
    /// Connections open now (accepted and opened, closing ones included).
    pub open_connections: u64,
    /// Accepts that failed: for want of resources (descriptors, memory), whose connections
    /// left in the listener's backlog are accepted 10 ms later, or for good
    /// (`listener_failed`).
    pub failed_accepts: u64,
    /// Connections closed at once for `fluxgate.network.max-connections` (their consumers
    /// connect again after the request back-off).
    pub refused_connections: u64,
    /// The listener failed for good (the kernel refused it with an error no retry mends,
    /// such as a socket that stopped listening): no new connection is accepted, while the
    /// open ones go on. Consumers then find the port refused.
    pub listener_failed: bool,
    /// `io_uring_enter` calls.
    pub enters: u64,
    /// Reads submitted.
    pub reads: u64,
    /// Writes submitted (zero-copy sends included).
    pub writes: u64,
    /// Writes from a registered buffer (`WriteFixed`, or `SendZc` with a buffer index).
    pub fixed_writes: u64,
    /// Writes that completed with fewer bytes than asked for: the socket's send buffer was
    /// full (epoll counts a write refused with `WouldBlock` too).
    pub short_writes: u64,
    /// Protocol errors found in what peers sent: each closes its connection once the
    /// ErrorResponse queued for the peer is written.
    pub protocol_errors: u64,
    /// Control bytes copied into a staging area before a write.
    pub copied_bytes: u64,
    /// Zero-copy sends submitted (`SendZc` / `SendMsgZc`).
    pub zc_sends: u64,
    /// Zero-copy notifications received (the kernel let go of the sent bytes).
    pub zc_notifications: u64,
    /// Notifications reporting that the kernel copied the bytes anyway.
    pub zc_copied: u64,
    /// Connections whose zero-copy sends were switched off because the kernel copied.
    pub zc_switched_off: u64,
    /// Connections that closed with zero-copy sends unnotified (their segments waited).
    pub zc_orphaned_connections: u64,
    /// Segments of closed connections waiting for zero-copy notifications now.
    pub zc_orphaned_segments: u64,
    /// Whether this thread may use zero-copy sends at all (config `auto` and the kernel has
    /// `IORING_OP_SEND_ZC` and `IORING_OP_SENDMSG_ZC`).
    pub zc_available: bool,
    /// Socket operations through a registered file (`types::Fixed`).
    pub fixed_file_ops: u64,
    /// Socket operations through a plain descriptor.
    pub plain_fd_ops: u64,
    /// Slots of the ring's file table (0: files could not be registered).
    pub file_table_size: u64,
    /// Sockets put into the file table so far.
    pub files_registered: u64,
    /// File-table slots in use now.
    pub file_slots_in_use: u64,
    /// Highest file-table slot used so far, plus one.
    pub file_slots_high_water: u64,
}

/// The wake-up action of a parked I/O thread (an eventfd or mio waker write).
pub(crate) type WakeFn = Box<dyn Fn() + Send + Sync>;

/// What task threads hold of a running I/O thread (either driver): its command queue, its
/// waker and the thread. Dropping it shuts the thread down and waits for it (a thread stuck
/// with a full command queue is told to end at its next turn, not waited for).
pub(crate) struct DriverHandle {
    pub(crate) commands: Arc<ArrayQueue<Command>>,
    pub(crate) waker: Arc<IoWaker<WakeFn>>,
    pub(crate) thread: Option<thread::JoinHandle<()>>,
    pub(crate) local_addr: SocketAddr,
}

impl DriverHandle {
    /// Hands a command to the I/O thread. Blocks (bounded) only if its queue is full.
    /// False when the command was dropped: the queue stayed full (the I/O thread is stuck),
    /// or the thread has stopped.
    pub(crate) fn submit(&self, command: Command) -> bool {
        match self.waker.submit(&self.commands, command) {
            Ok(()) => !self
                .waker
                .take_back_if_stopped(&self.commands, |command| refuse(command, STOPPED_REASON)),
            Err(command) if self.waker.is_stopped() => {
                refuse(command, STOPPED_REASON);
                false
            }
            Err(command) => {
                tracing::error!(
                    ?command,
                    "the I/O thread's command queue stayed full; command dropped"
                );
                refuse(command, "the I/O thread's command queue stayed full");
                false
            }
        }
    }
}

impl Drop for DriverHandle {
    fn drop(&mut self) {
        self.shut_down();
    }
}

impl DriverHandle {
    /// Stops the I/O thread and waits for it (once; later calls do nothing): its connections
    /// close, their channels fail, their views are released.
    pub(crate) fn shut_down(&mut self) {
        if self.thread.is_none() {
            return;
        }
        let queued = self.submit(Command::Shutdown);
        if !queued && !self.waker.is_stopped() {
            // A stuck thread that never took the shutdown is left behind, not waited for; it
            // ends (closing its listener and connections) once it comes back to its loop.
            tracing::error!("the I/O thread did not take its shutdown; it ends when it can");
            self.waker.request_shutdown();
        }
        if let Some(thread) = self
            .thread
            .take()
            .filter(|_| queued || self.waker.is_stopped())
        {
            let _ = thread.join();
        }
    }
}

/// Why a command met an I/O thread whose loop had ended (an OS error stopped it).
const STOPPED_REASON: &str = "the I/O thread has stopped";

/// A command no I/O thread will take, for `reason`: a channel waiting to connect fails (it
/// would wait for good); anything else is dropped (a finished connect's socket closes, a
/// diagnostics request gets no answer).
fn refuse(command: Command, reason: &str) {
    if let Command::Connect { peer, channel, .. } = command {
        channel.fail(crate::gate::GateError::Transport {
            channel: channel.channel(),
            reason: format!("{reason} (connecting to {peer})"),
        });
    }
}

/// The end of an I/O thread's loop (either driver): commands still queued, or queued from now
/// on, are refused.
pub(crate) fn io_thread_stopped(commands: &ArrayQueue<Command>, waker: &IoWaker<WakeFn>) {
    waker.stop(commands, |command| refuse(command, STOPPED_REASON));
}

/// A remote channel whose connection was refused, waiting to try again.
pub(crate) struct RefusedConnect {
    pub(crate) peer: SocketAddr,
    pub(crate) connection_index: usize,
    pub(crate) channel: Arc<RemoteChannelShared>,
    /// The delays it went through so far.
    pub(crate) backoff: crate::gate::Backoff,
    due: Instant,
}

/// Channels whose connection attempt failed in a way a later attempt may not: the peer's
/// process is not listening yet (nodes started apart, a producer still starting: refused), or
/// it reset the attempt (a listen queue overflowing with `tcp_abort_on_overflow`). They try again after the partition-request back-off
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

impl RefusedConnects {
    /// Connecting `channel` to `peer` failed with `error` after the delays `backoff` already
    /// went through: queues another attempt, or fails the channel once the back-off is
    /// exhausted or the error is not one a later attempt may get past.
    ///
    /// Only a refusal or a reset is retried: a peer that did not answer within the connect
    /// timeout is taken as down (the channel fails, as Flink's connect failure fails the
    /// task), rather than holding the task for another timeout per back-off step.
    pub(crate) fn on_failure(
        &mut self,
        peer: SocketAddr,
        connection_index: usize,
        channel: Arc<RemoteChannelShared>,
        mut backoff: crate::gate::Backoff,
        error: &io::Error,
        now: Instant,
    ) {
        let retryable = matches!(
            error.kind(),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
        );
        if !retryable || channel.is_released() || !backoff.increase() {
            channel.fail(crate::gate::GateError::Transport {
                channel: channel.channel(),
                reason: format!("connecting to {peer} failed: {error}"),
            });
            return;
        }
        tracing::debug!(%peer, %error, delay = ?backoff.current(), "connection refused; trying again after the back-off");
        self.waiting.push(RefusedConnect {
            peer,
            connection_index,
            channel,
            backoff,
            due: now + backoff.current(),
        });
    }

    /// The next attempt due at `now`, with the back-off it went through; channels the gate
    /// released meanwhile are dropped. A driver calls it until `None`: an attempt that fails
    /// again is queued with a later due time, so the loop ends.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<RefusedConnect> {
        // Bounded by the list: each pass removes an entry or steps past one.
        let mut index = 0;
        while index < self.waiting.len() {
            let entry = &self.waiting[index];
            if entry.channel.is_released() {
                self.waiting.swap_remove(index);
            } else if entry.due <= now {
                let entry = self.waiting.swap_remove(index);
                entry.channel.note_retry();
                return Some(entry);
            } else {
                index += 1;
            }
        }
        None
    }

    /// When the next attempt is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.waiting.iter().map(|e| e.due).min()
    }

    /// The I/O thread ends: no attempt will be made for the waiting channels.
    pub(crate) fn fail_all(&mut self, reason: &str) {
        for entry in self.waiting.drain(..) {
            fail_at_shutdown(&entry.channel, reason);
        }
    }
}

/// How a connection notices a peer that went silent (host down, cable cut, a process
/// stopped without its kernel closing the socket): TCP keepalive on idle connections,
/// TCP_USER_TIMEOUT on connections with unacknowledged data. A peer whose process dies on a
/// live host needs neither: its kernel sends FIN or RST at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// Idle time before the first probe.
    pub keepalive_idle: Duration,
    /// Time between probes.
    pub keepalive_interval: Duration,
    /// Unanswered probes that end the connection.
    pub keepalive_count: u32,
    /// Longest time sent data may stay unacknowledged (zero: the kernel's default).
    pub user_timeout: Duration,
}

impl Liveness {
    /// The settings of `config` (`taskmanager.network.netty.client.tcp.keep*`,
    /// `fluxgate.network.tcp.user-timeout-ms`).
    pub fn from_config(config: &crate::NetworkConfig) -> Self {
        Self {
            keepalive_idle: config.keepalive_idle,
            keepalive_interval: config.keepalive_interval,
            keepalive_count: config.keepalive_count,
            user_timeout: config.tcp_user_timeout,
        }
    }

    /// Sets TCP_NODELAY, keepalive and the user timeout on a connected socket (either side).
    pub(crate) fn apply(&self, stream: &impl std::os::fd::AsFd) -> io::Result<()> {
        let socket = socket2::SockRef::from(stream);
        socket.set_tcp_nodelay(true)?;
        socket.set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(self.keepalive_idle)
                .with_interval(self.keepalive_interval)
                .with_retries(self.keepalive_count),
        )?;
        socket.set_tcp_user_timeout((!self.user_timeout.is_zero()).then_some(self.user_timeout))
    }
}

impl Default for Liveness {
    fn default() -> Self {
        Self::from_config(&crate::NetworkConfig::default())
    }
}

/// The protocol state of a new client connection to `peer`, as both drivers make it.
pub(crate) fn client_for(peer: SocketAddr, config: &DriverConfig) -> io::Result<ClientConnection> {
    Ok(config
        .new_client()?
        .with_request_backoff(config.request_backoff)
        .with_peer(peer))
}

/// Starts connecting to `peer` on a helper thread of `helpers`: a connect bounded by the
/// environment's `connect_timeout`, then the socket options (TCP_NODELAY, keepalive, user
/// timeout). Its result comes back to the I/O thread as [`Command::Connected`]. The I/O thread
/// never waits for a peer: one that drops SYNs would stall every other connection of the
/// thread for the whole timeout, once per channel wanting it. A thread per connection being
/// opened, not per channel ([`PendingConnects`] keeps the channels).
pub(crate) fn start_connect(
    peer: SocketAddr,
    connection_index: usize,
    attempt: u64,
    config: &DriverConfig,
    commands: &Arc<ArrayQueue<Command>>,
    waker: &Arc<IoWaker<WakeFn>>,
    helpers: &mut ConnectHelpers,
) -> io::Result<()> {
    helpers.join_finished();
    let timeout = config.connect_timeout;
    let liveness = config.liveness;
    let commands = commands.clone();
    let waker = waker.clone();
    let cancelled = helpers.cancelled.clone();
    // The helper waits on its own poll, which the I/O thread's end wakes through `cancel`.
    let poll = mio::Poll::new()?;
    let cancel = mio::Waker::new(poll.registry(), CONNECT_CANCELLED)?;
    let thread = thread::Builder::new()
        .name("fluxgate-connect".into())
        .spawn(move || {
            let result = connect_cancellable(peer, timeout, poll, &cancelled).and_then(|stream| {
                liveness.apply(&stream)?;
                Ok(stream)
            });
            if cancelled.load(Ordering::Acquire) {
                return; // nobody reads the command queue any more
            }
            let connected = Command::Connected {
                peer,
                connection_index,
                attempt,
                result,
            };
            // A queue full for `SUBMIT_PATIENCE` means a stuck I/O thread, and a cancelled
            // helper's thread has stopped draining it: either way the stream is closed with
            // the dropped command.
            if waker
                .submit_unless(&commands, connected, || cancelled.load(Ordering::Acquire))
                .is_ok()
            {
                waker.take_back_if_stopped(&commands, |command| refuse(command, STOPPED_REASON));
            }
        })?;
    helpers.running.push(ConnectHelper { cancel, thread });
    Ok(())
}

const CONNECT_CANCELLED: mio::Token = mio::Token(0);
const CONNECTING: mio::Token = mio::Token(1);

/// Connects to `peer` without blocking in the kernel: a non-blocking connect whose socket is
/// polled on `poll` with the cancellation waker, up to `timeout`. The stream it returns is in
/// blocking mode, as `TcpStream::connect_timeout`'s is.
fn connect_cancellable(
    peer: SocketAddr,
    timeout: Duration,
    mut poll: mio::Poll,
    cancelled: &AtomicBool,
) -> io::Result<std::net::TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut stream = mio::net::TcpStream::connect(peer)?;
    poll.registry()
        .register(&mut stream, CONNECTING, mio::Interest::WRITABLE)?;
    let mut events = mio::Events::with_capacity(4);
    // Bounded by the deadline: each pass waits until it, or returns.
    loop {
        if cancelled.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "the I/O thread ended before the connection was made",
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection timed out",
            ));
        }
        match poll.poll(&mut events, Some(deadline - now)) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
        if !events.iter().any(|event| event.token() == CONNECTING) {
            continue;
        }
        // Writable: connected, or failed (mio's way of telling them apart).
        if let Some(error) = stream.take_error()? {
            return Err(error);
        }
        match stream.peer_addr() {
            Ok(_) => {
                poll.registry().deregister(&mut stream)?;
                let stream = std::net::TcpStream::from(std::os::fd::OwnedFd::from(stream));
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(error) if error.kind() == io::ErrorKind::NotConnected => continue,
            Err(error) => return Err(error),
        }
    }
}

/// The helper threads opening connections for one I/O thread: the I/O thread's end cancels
/// them (each waits on its own poll, which the cancellation wakes) and joins them, so none
/// outlives its environment.
#[derive(Default)]
pub(crate) struct ConnectHelpers {
    cancelled: Arc<AtomicBool>,
    running: Vec<ConnectHelper>,
}

struct ConnectHelper {
    cancel: mio::Waker,
    thread: thread::JoinHandle<()>,
}

impl Drop for ConnectHelpers {
    fn drop(&mut self) {
        // Also when the I/O thread unwinds: no helper outlives it.
        self.stop();
    }
}

impl ConnectHelpers {
    /// Joins the helpers that are done (each ends soon after it submitted its result).
    pub(crate) fn join_finished(&mut self) {
        let mut index = 0;
        while index < self.running.len() {
            if self.running[index].thread.is_finished() {
                let _ = self.running.swap_remove(index).thread.join();
            } else {
                index += 1;
            }
        }
    }

    /// Cancels every helper and waits for them.
    fn stop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
        for helper in &self.running {
            let _ = helper.cancel.wake();
        }
        for helper in self.running.drain(..) {
            let _ = helper.thread.join();
        }
    }
}

/// The channels waiting for a connection being opened, per (peer, connection index), with
/// the back-off each went through (a refused connect is tried again, see
/// [`RefusedConnects`]). Shared by both drivers.
#[derive(Default)]
pub(crate) struct PendingConnects {
    waiting: std::collections::HashMap<(SocketAddr, usize), PendingConnect>,
    /// The number the next connect started gets. A result names its attempt, so one that
    /// comes after its attempt was given up as overdue (a helper thread held up past the
    /// grace) is not taken for a newer attempt to the same peer: it would fail that
    /// attempt's channels before their own connect finished.
    next_attempt: u64,
    /// The threads making the connects.
    helpers: ConnectHelpers,
}

/// One connection being opened.
struct PendingConnect {
    attempt: u64,
    channels: Vec<WaitingChannel>,
    /// When its result is overdue: the connect timeout, plus the time the helper thread may
    /// wait for room in the command queue before it gives up. A result that never came
    /// (the queue stayed full) must not leave the channels waiting for good.
    overdue: Instant,
}

/// How much longer than the connect timeout a connect's result may take to arrive: the
/// helper thread gives up on a full command queue after [`waker::SUBMIT_PATIENCE`].
const CONNECT_RESULT_GRACE: Duration = Duration::from_secs(waker::SUBMIT_PATIENCE.as_secs() + 5);

/// A channel waiting for its connection, with the back-off its connects went through.
pub(crate) type WaitingChannel = (Arc<RemoteChannelShared>, crate::gate::Backoff);

impl fmt::Debug for PendingConnects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingConnects")
            .field("connections", &self.waiting.len())
            .finish()
    }
}

impl PendingConnects {
    /// Queues `channel` for the connection to (`peer`, `index`). When no connect is under
    /// way for it yet, the attempt number of the one the caller starts, bounded by `timeout`.
    pub(crate) fn wait(
        &mut self,
        peer: SocketAddr,
        index: usize,
        channel: Arc<RemoteChannelShared>,
        backoff: crate::gate::Backoff,
        timeout: Duration,
        now: Instant,
    ) -> Option<u64> {
        let next_attempt = &mut self.next_attempt;
        let pending = self.waiting.entry((peer, index)).or_insert_with(|| {
            *next_attempt += 1;
            PendingConnect {
                attempt: *next_attempt,
                channels: Vec::new(),
                overdue: now + timeout + CONNECT_RESULT_GRACE,
            }
        });
        pending.channels.push((channel, backoff));
        (pending.channels.len() == 1).then_some(pending.attempt)
    }

    /// Connect `attempt` to (`peer`, `index`) finished: the channels that waited for it (none
    /// when it was given up as overdue before, whether or not a newer attempt waits now).
    pub(crate) fn take(
        &mut self,
        peer: SocketAddr,
        index: usize,
        attempt: u64,
    ) -> Vec<WaitingChannel> {
        match self.waiting.entry((peer, index)) {
            std::collections::hash_map::Entry::Occupied(pending)
                if pending.get().attempt == attempt =>
            {
                pending.remove().channels
            }
            _ => Vec::new(),
        }
    }

    /// A connect whose result is overdue at `now`, given up: its key and channels.
    pub(crate) fn pop_overdue(
        &mut self,
        now: Instant,
    ) -> Option<(SocketAddr, usize, Vec<WaitingChannel>)> {
        let key = *self
            .waiting
            .iter()
            .find(|(_, pending)| pending.overdue <= now)?
            .0;
        let pending = self.waiting.remove(&key)?;
        Some((key.0, key.1, pending.channels))
    }

    /// When the next result becomes overdue.
    pub(crate) fn next_overdue(&self) -> Option<Instant> {
        self.waiting.values().map(|pending| pending.overdue).min()
    }

    /// The I/O thread ends: no connect will finish for the waiting channels, and the helper
    /// threads making them are cancelled and joined.
    pub(crate) fn fail_all(&mut self, reason: &str) {
        self.helpers.stop();
        for (peer, _) in self.waiting.keys() {
            tracing::debug!(%peer, "the I/O thread ends while connecting");
        }
        for (channel, _) in self
            .waiting
            .drain()
            .flat_map(|(_, pending)| pending.channels)
        {
            fail_at_shutdown(&channel, reason);
        }
    }
}

/// The error of a connect given up because its result never came.
pub(crate) fn overdue_connect() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the connect's result never reached the I/O thread",
    )
}

/// What the connection manager needs of a driver's loop, so that placing channels on
/// connections, opening connections and retrying refused ones is written once for both
/// drivers. `Handle` names a client connection of the loop (an epoll token, a ring slot).
pub(crate) trait ClientConnections {
    type Handle: Copy;

    /// The client connection to (`peer`, `index`) that takes new channels: open, not
    /// closing, and under `max-channels-per-connection` (one whose last channel left, that
    /// failed, or that is full takes none: a new one opens, and takes the key; a full one
    /// goes on serving its channels and closes when they leave).
    fn open_connection(&self, peer: SocketAddr, index: usize) -> Option<Self::Handle>;
    /// Makes a connected stream a client connection of the loop, reachable by
    /// [`open_connection`](Self::open_connection).
    fn add_client(
        &mut self,
        stream: std::net::TcpStream,
        peer: SocketAddr,
        index: usize,
    ) -> io::Result<Self::Handle>;
    /// The protocol state of a client connection.
    fn client(&mut self, handle: Self::Handle) -> &mut ClientConnection;
    /// The loop's state that connects use.
    fn connects(&mut self) -> Connects<'_>;
}

/// What connects use of a driver's loop, borrowed together.
pub(crate) struct Connects<'a> {
    /// The loop's configuration (`connect_timeout`, socket options).
    pub(crate) config: &'a DriverConfig,
    /// Where a connect's result comes back ([`start_connect`]), and the waker to tell.
    pub(crate) commands: &'a Arc<ArrayQueue<Command>>,
    pub(crate) waker: &'a Arc<IoWaker<WakeFn>>,
    /// The channels waiting for connects.
    pub(crate) pending: &'a mut PendingConnects,
    /// The channels waiting to try a refused connect again.
    pub(crate) refused: &'a mut RefusedConnects,
}

/// Places `channel` on its connection to (`peer`, `index`), or queues it for a connect
/// (starting one when none is under way). A released channel is dropped.
pub(crate) fn connect_channel<L: ClientConnections>(
    driver: &mut L,
    peer: SocketAddr,
    index: usize,
    channel: Arc<RemoteChannelShared>,
    backoff: crate::gate::Backoff,
    now: Instant,
) {
    if channel.is_released() {
        return; // its gate closed before the connection was asked for
    }
    if let Some(handle) = driver.open_connection(peer, index) {
        register_channel(driver, handle, peer, &channel, backoff);
        return;
    }
    let c = driver.connects();
    let timeout = c.config.connect_timeout;
    if let Some(attempt) = c.pending.wait(peer, index, channel, backoff, timeout, now) {
        let (config, commands, waker) = (c.config, c.commands, c.waker);
        let helpers = &mut c.pending.helpers;
        if let Err(error) = start_connect(peer, index, attempt, config, commands, waker, helpers) {
            on_connected(driver, peer, index, attempt, Err(error), now);
        }
    }
}

/// A helper thread's connect `attempt` to (`peer`, `index`) finished with `result`.
pub(crate) fn on_connected<L: ClientConnections>(
    driver: &mut L,
    peer: SocketAddr,
    index: usize,
    attempt: u64,
    result: io::Result<std::net::TcpStream>,
    now: Instant,
) {
    let waiting = driver.connects().pending.take(peer, index, attempt);
    finish_connect(driver, peer, index, waiting, result, now);
}

/// The loop's turn: refused connects whose back-off ran out are tried again, and connects
/// whose result is overdue (see [`PendingConnects`]) are given up.
pub(crate) fn connects_due<L: ClientConnections>(driver: &mut L, now: Instant) {
    // Helpers that delivered their result are joined (their threads and descriptors freed)
    // on the next turn, not only at the next connect.
    driver.connects().pending.helpers.join_finished();
    // Bounded: an attempt that fails again is queued with a later due time.
    while let Some(due) = driver.connects().refused.pop_due(now) {
        connect_channel(
            driver,
            due.peer,
            due.connection_index,
            due.channel,
            due.backoff,
            now,
        );
    }
    while let Some((peer, index, waiting)) = driver.connects().pending.pop_overdue(now) {
        finish_connect(driver, peer, index, waiting, Err(overdue_connect()), now);
    }
}

/// The channels that waited for a connect: registered on the new connection, or to the
/// refused list (tried again or failed, by the error). A connection no waiting channel wants
/// any more (all released, or given up as overdue) is not opened.
fn finish_connect<L: ClientConnections>(
    driver: &mut L,
    peer: SocketAddr,
    index: usize,
    waiting: Vec<WaitingChannel>,
    result: io::Result<std::net::TcpStream>,
    now: Instant,
) {
    if waiting.iter().all(|(channel, _)| channel.is_released()) {
        return; // a stream that came is closed by the drop
    }
    // Each channel leaves `waiting` only once placed, so a panic placing it fails it too.
    let mut waiting = Unplaced(waiting.into_iter());
    match result.and_then(|stream| driver.add_client(stream, peer, index)) {
        Ok(handle) => {
            let mut placed = false;
            while let Some((channel, backoff)) = waiting.0.as_slice().first() {
                let (channel, backoff) = (channel.clone(), *backoff);
                // More channels may wait than one connection takes
                // (`max-channels-per-connection`): the rest wait for another.
                match (channel.is_released(), driver.client(handle).has_room()) {
                    (true, _) => {}
                    (false, true) => {
                        register_channel(driver, handle, peer, &channel, backoff);
                        placed = true;
                    }
                    (false, false) => connect_channel(driver, peer, index, channel, backoff, now),
                }
                waiting.0.next();
            }
            // Every channel was released since the look above (a gate closed meanwhile): no
            // channel will leave this connection to close it, so it closes now, not holding
            // a socket and one of the producer's connections until the next channel's.
            if !placed {
                driver.client(handle).close();
            }
        }
        Err(error) => {
            let refused = driver.connects().refused;
            while let Some((channel, backoff)) = waiting.0.as_slice().first() {
                refused.on_failure(peer, index, channel.clone(), *backoff, &error, now);
                waiting.0.next();
            }
        }
    }
}

/// A client connection to (`peer`, `index`) closed before the producer's handshake came (a
/// producer at its `max-connections` closes new connections at once): its `channels`
/// ([`ClientConnection::take_unanswered_channels`]) connect again after the request back-off,
/// as after a refused connect, instead of failing.
pub(crate) fn retry_unanswered<L: ClientConnections>(
    driver: &mut L,
    (peer, index): (SocketAddr, usize),
    channels: Vec<(Arc<RemoteChannelShared>, crate::gate::Backoff)>,
    now: Instant,
) {
    if channels.is_empty() {
        return;
    }
    let error = io::Error::new(
        io::ErrorKind::ConnectionReset,
        "the producer refused the connection at its max-connections",
    );
    let refused = driver.connects().refused;
    for (channel, backoff) in channels {
        refused.on_failure(peer, index, channel, backoff, &error, now);
    }
}

/// Registers `channel` on a connection, with the delays its connects went through.
fn register_channel<L: ClientConnections>(
    driver: &mut L,
    handle: L::Handle,
    peer: SocketAddr,
    channel: &Arc<RemoteChannelShared>,
    backoff: crate::gate::Backoff,
) {
    let attach = |listener| channel.attach(listener);
    let client = driver.client(handle);
    match client.register(channel.clone(), attach) {
        Ok(receiver) => client.set_connect_backoff(receiver, backoff),
        Err(error) => channel.fail(crate::gate::GateError::Transport {
            channel: channel.channel(),
            reason: format!("connection to {peer} has no room: {error}"),
        }),
    }
}

/// Why the channels an ending I/O thread still held fail.
pub(crate) const SHUTDOWN_REASON: &str = "the network environment shut down";

/// Runs `work` on one connection as its I/O thread ends, catching a panic of it (a channel's
/// or a view's code run by it): one connection that panics must not keep the others from
/// being torn down, their channels failed and their views released. (A `HashMap`'s `clear`
/// leaks every entry after one whose drop panics.)
pub(crate) fn for_one_at_end(what: &str, work: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
        tracing::error!("{what} panicked; going on with the others");
    }
}

/// Channels taken off a waiting list and not yet placed: if placing one panics (the I/O
/// thread then ends), the rest are in no list its end fails, so they fail here.
struct Unplaced(std::vec::IntoIter<WaitingChannel>);

impl Drop for Unplaced {
    fn drop(&mut self) {
        for (channel, _) in self.0.by_ref() {
            fail_at_shutdown(&channel, STOPPED_REASON);
        }
    }
}

/// Fails a channel the ending I/O thread will never serve.
fn fail_at_shutdown(channel: &RemoteChannelShared, reason: &str) {
    channel.fail(crate::gate::GateError::Transport {
        channel: channel.channel(),
        reason: reason.to_owned(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::{
        Backoff, ChannelLocation, ChannelSpec, ConsumedSubpartition, SingleInputGate,
    };
    use crate::partition::{PartitionManager, ResultPartitionId};
    use crate::NetworkConfig;

    /// What a remote channel of a set-up gate gives the transport, for a channel list.
    fn remote_channels(count: usize) -> (SingleInputGate, Vec<Arc<RemoteChannelShared>>) {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.memory.segment-size", "4kb")
            .unwrap();
        config.set("taskmanager.memory.network.max", "1mb").unwrap();
        config.set("fluxgate.memory.arena-size", "1mb").unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let specs = (0..count)
            .map(|i| ChannelSpec {
                consumed: ConsumedSubpartition {
                    partition: ResultPartitionId {
                        partition: i as u64,
                        producer: 0,
                    },
                    subpartition: 0,
                },
                location: ChannelLocation::Remote,
            })
            .collect();
        let manager = Arc::new(PartitionManager::new());
        let mut gate = SingleInputGate::new(specs, manager, &network, &config);
        gate.setup().unwrap();
        let shared = (0..count)
            .map(|i| gate.remote_channel(i).unwrap().shared().clone())
            .collect();
        (gate, shared)
    }

    #[test]
    fn a_result_of_a_connect_given_up_as_overdue_is_not_taken_for_a_newer_attempt() {
        let (_gate, channels) = remote_channels(2);
        let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let timeout = Duration::from_secs(1);
        let backoff = Backoff::flink_default();
        let start = Instant::now();
        let mut pending = PendingConnects::default();

        let first = pending
            .wait(peer, 0, channels[0].clone(), backoff, timeout, start)
            .expect("the first channel starts a connect");
        let later = start + timeout + CONNECT_RESULT_GRACE;
        let (_, _, given_up) = pending.pop_overdue(later).expect("the connect is overdue");
        assert_eq!(given_up.len(), 1);

        let second = pending
            .wait(peer, 0, channels[1].clone(), backoff, timeout, later)
            .expect("a channel after the give-up starts a new connect");
        assert!(
            pending.take(peer, 0, first).is_empty(),
            "the late result of the given-up connect took the new attempt's channels"
        );
        let waited = pending.take(peer, 0, second);
        assert_eq!(waited.len(), 1);
        assert!(Arc::ptr_eq(&waited[0].0, &channels[1]));
    }
}
