//! The epoll driver (mio): one I/O thread, edge-triggered sockets, vectored reads (payload
//! straight into its segment plus a small read-ahead) and vectored writes (frame headers and
//! segment payloads in one `writev`).
//!
//! With TLS on, a rustls session sits between each socket and its connection: ciphertext is
//! read into the session and the plaintext it yields copied into the connection's read
//! targets; the connection's slices go into the session's writer and its records out in one
//! `writev`. Plain connections take the same paths as without TLS (one branch per event).

use std::collections::HashMap;
use std::io::{self, BufRead, IoSlice, IoSliceMut, Read, Write};
use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::task::Waker;
use std::thread;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use socket2::SockRef;

use super::conn::{Connection, Side};
pub use super::DriverConfig;
use super::{
    client_for, discard_input, listener_failed_for_good, refuse_connection, BusyPoll, Command,
    Discarded, DriverHandle, IoWaker, PendingConnects, RefusedConnects, WakeFn, ACCEPT_BACKOFF,
    SHUTDOWN_REASON,
};
use crate::partition::PartitionManager;
use crate::protocol::{ProtocolError, ServerConnection};
use crate::sync::ArrayQueue;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONNECTION: usize = 2;
/// Longest the thread sleeps without an event (it then checks timeouts).
const MAX_PARK: Duration = Duration::from_millis(100);
/// Bytes one read of a TLS connection's socket takes (four full TLS records).
const CIPHERTEXT_READ: usize = 64 * 1024;
/// Slices handed to one `writev`.
const MAX_SLICES: usize = 64;

/// Most writes one readiness of a socket makes before the loop yields to the others.
const WRITE_PASSES: usize = 1024;

/// A running epoll I/O thread.
pub struct EpollDriver {
    handle: DriverHandle,
}

impl std::fmt::Debug for EpollDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpollDriver")
            .field("local_addr", &self.handle.local_addr)
            .finish()
    }
}

impl EpollDriver {
    /// Starts the I/O thread serving `manager`'s partitions on `listener`.
    pub fn start(
        listener: std::net::TcpListener,
        config: DriverConfig,
        manager: Arc<PartitionManager>,
    ) -> io::Result<Self> {
        let poll = Poll::new()?;
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let local_addr = listener.local_addr()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let mio_waker = mio::Waker::new(poll.registry(), WAKER)?;
        let waker: Arc<IoWaker<WakeFn>> = Arc::new(IoWaker::new(Box::new(move || {
            // A failed wake leaves the thread to its bounded park.
            let _ = mio_waker.wake();
        })));
        let commands = Arc::new(ArrayQueue::new(4096));
        let mut io_loop = Loop {
            tokens: Vec::new(),
            slice_scratch: Vec::with_capacity(MAX_SLICES),
            ciphertext: Box::default(),
            poll,
            listener,
            connections: HashMap::new(),
            peers: HashMap::new(),
            refused: RefusedConnects::default(),
            pending: PendingConnects::default(),
            accepted: 0,
            accept_again_at: None,
            accept_failing: false,
            next_token: FIRST_CONNECTION,
            commands: commands.clone(),
            waker: waker.clone(),
            std_waker: Waker::from(waker.clone()),
            config,
            manager,
            worked: false,
            turns: 0,
            sleeps: 0,
            failed_accepts: 0,
            listener_failed: false,
            refused_connections: 0,
            short_writes: 0,
            protocol_errors: 0,
        };
        let thread = thread::Builder::new()
            .name("fluxgate-io-epoll".into())
            .spawn(move || {
                crate::buffer::mark_io_thread();
                if panic::catch_unwind(AssertUnwindSafe(|| io_loop.run())).is_err() {
                    // The hook reported the panic. The channels must still hear that nothing
                    // serves them any more, or they wait for good.
                    tracing::error!("the epoll I/O thread panicked; its channels fail");
                    io_loop.end();
                }
            })?;
        Ok(Self {
            handle: DriverHandle {
                commands,
                waker,
                thread: Some(thread),
                local_addr,
            },
        })
    }

    /// The running thread's command queue, waker and listening address.
    pub(crate) fn handle(&self) -> &DriverHandle {
        &self.handle
    }

    pub(crate) fn handle_mut(&mut self) -> &mut DriverHandle {
        &mut self.handle
    }
}

struct Conn {
    stream: TcpStream,
    connection: Connection,
    peer: Option<(SocketAddr, usize)>,
    /// The TLS session between the socket and `connection`, when TLS is on.
    tls: Option<Box<TlsLink>>,
    /// Set at a protocol error: input is discarded from then on, and the connection closes
    /// once its queued writes (the ErrorResponse last) are out, or at this deadline.
    close_by: Option<Instant>,
}

/// What a TLS connection adds to a plain one.
struct TlsLink {
    session: rustls::Connection,
    /// When the handshake must be done: a peer that stalls it is closed then.
    handshake_deadline: Instant,
}

impl TlsLink {
    fn new(session: rustls::Connection, handshake_deadline: Instant) -> Box<Self> {
        Box::new(Self {
            session,
            handshake_deadline,
        })
    }

    /// The handshake deadline while the handshake runs.
    fn deadline(&self) -> Option<Instant> {
        self.session
            .is_handshaking()
            .then_some(self.handshake_deadline)
    }
}

struct Loop {
    /// Scratch for the connection tokens of one loop turn.
    tokens: Vec<Token>,
    /// Scratch for the slices of one `writev` (always empty between writes).
    slice_scratch: Vec<IoSlice<'static>>,
    /// The read area of TLS connections (allocated at the first TLS read).
    ciphertext: Box<[u8]>,
    poll: Poll,
    listener: TcpListener,
    connections: HashMap<Token, Conn>,
    /// Outgoing connections by (peer, connection index).
    peers: HashMap<(SocketAddr, usize), Token>,
    /// Channels whose connection was refused, to try again.
    refused: RefusedConnects,
    /// Channels waiting for a connection a helper thread is opening.
    pending: PendingConnects,
    /// Accepted (server-side) connections open now.
    accepted: usize,
    /// When to accept again without a readiness event: the listener is edge-triggered, so the
    /// connections still queued after an accept error or the per-turn bound get none.
    accept_again_at: Option<Instant>,
    /// The last accept failed: the next failures of the streak are logged at debug level.
    accept_failing: bool,
    next_token: usize,
    commands: Arc<ArrayQueue<Command>>,
    waker: Arc<IoWaker<WakeFn>>,
    std_waker: Waker,
    config: DriverConfig,
    manager: Arc<PartitionManager>,
    /// Set when a turn connected a channel or wrote bytes: work for [`BusyPoll`], besides the
    /// sockets' readiness events. Diagnostics (`Stats`, `Dump`) and bare wake-ups are not
    /// work: a flusher that finds nothing to flush wakes a parked thread every buffer
    /// timeout, and counting that would keep a long window open on an idle pipeline.
    worked: bool,
    /// `DriverStats::turns`.
    turns: u64,
    /// Waits that could sleep (`DriverStats::sleeps`).
    sleeps: u64,
    /// `DriverStats::failed_accepts`.
    failed_accepts: u64,
    /// `DriverStats::listener_failed`.
    listener_failed: bool,
    /// `DriverStats::refused_connections`.
    refused_connections: u64,
    /// `DriverStats::short_writes`: writes the send buffer took in part or not at all.
    short_writes: u64,
    /// `DriverStats::protocol_errors`.
    protocol_errors: u64,
}

impl super::ClientConnections for Loop {
    type Handle = Token;

    fn open_connection(&self, peer: SocketAddr, index: usize) -> Option<Token> {
        let token = *self.peers.get(&(peer, index))?;
        self.connections
            .get(&token)
            .is_some_and(|conn| conn.connection.has_room() && conn.close_by.is_none())
            .then_some(token)
    }

    fn add_client(
        &mut self,
        stream: std::net::TcpStream,
        peer: SocketAddr,
        index: usize,
    ) -> io::Result<Token> {
        let client = client_for(peer, &self.config)?;
        stream.set_nonblocking(true)?;
        let tls = match &self.config.tls {
            Some(context) => Some(TlsLink::new(
                context.client_session().map_err(|error| {
                    io::Error::other(format!("starting a TLS session failed: {error}"))
                })?,
                Instant::now() + context.handshake_timeout(),
            )),
            None => None,
        };
        let token = self.add(
            TcpStream::from_std(stream),
            Side::Client(client),
            Some((peer, index)),
            tls,
        )?;
        self.peers.insert((peer, index), token);
        tracing::debug!(%peer, index, "connection opened");
        Ok(token)
    }

    fn client(&mut self, token: Token) -> &mut crate::protocol::ClientConnection {
        let conn = self.connections.get_mut(&token).expect("a live connection");
        conn.connection.client_mut()
    }

    fn connects(&mut self) -> super::Connects<'_> {
        super::Connects {
            config: &self.config,
            commands: &self.commands,
            waker: &self.waker,
            pending: &mut self.pending,
            refused: &mut self.refused,
        }
    }
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut busy_poll = BusyPoll::new(self.config.busy_poll);
        loop {
            self.turns += 1;
            if !self.drain_commands() {
                break;
            }
            let now = Instant::now();
            super::connects_due(self, now);
            if self.accept_again_at.is_some_and(|at| now >= at) {
                self.accept();
            }
            // Reused token list: no allocation per loop turn.
            let mut tokens = std::mem::take(&mut self.tokens);
            tokens.clear();
            tokens.extend(self.connections.keys().copied());
            for token in &tokens {
                self.transmit(*token, now);
            }
            self.tokens = tokens;
            if std::mem::take(&mut self.worked) {
                busy_poll.worked(now);
            }
            // Busy-polling (this turn's drain and transmit saw the work a parked thread would
            // be woken for), or park: announce it, then look once more for work that raced the
            // announcement.
            let wait = self.waker.prepare_wait(&mut busy_poll, now, || {
                // A shutdown asked for without a command (`request_shutdown`) is work too.
                let mut busy = !self.commands.is_empty() || self.waker.is_shutdown_requested();
                for conn in self.connections.values() {
                    // Registered for the wake-up; work only what the next turn can send
                    // (`has_pending`, looked at after the registration): a ready reader behind
                    // a full outgoing queue is no reason not to park, nor is one waiting for
                    // its TLS handshake (whose next step a readable socket brings), or the
                    // thread would spin until the handshake ends or times out.
                    conn.connection.set_waker(&self.std_waker);
                    let handshaking = conn
                        .tls
                        .as_ref()
                        .is_some_and(|link| link.session.is_handshaking());
                    busy |= !handshaking && conn.connection.has_pending();
                }
                busy
            });
            let timeout = if wait.at_once() {
                Duration::ZERO
            } else {
                self.next_timeout(now)
            };
            if !timeout.is_zero() {
                self.sleeps += 1;
            }
            let polled = self.poll.poll(&mut events, Some(timeout));
            self.waker.end_wait(wait);
            if let Err(error) = polled {
                if error.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(%error, "epoll wait failed; the I/O thread stops");
                    break;
                }
            }
            let now = Instant::now();
            if events.iter().any(|event| event.token() != WAKER) {
                busy_poll.worked(now);
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    token => {
                        let closing = event.is_read_closed() || event.is_error();
                        if event.is_readable() || closing {
                            self.read(token, now, closing);
                        }
                        if event.is_writable() {
                            self.transmit(token, now);
                        }
                    }
                }
            }
        }
        self.end();
    }

    /// The loop has ended (shutdown, an OS error, or a panic): commands are refused from now
    /// on, dropping the connections fails their channels and releases their views, and
    /// channels still waiting for a connection fail too.
    fn end(&mut self) {
        super::io_thread_stopped(&self.commands, &self.waker);
        // The waiting channels first: a connection's teardown below may panic.
        self.pending.fail_all(SHUTDOWN_REASON);
        self.refused.fail_all(SHUTDOWN_REASON);
        for (_, connection) in self.connections.drain() {
            super::for_one_at_end("tearing down a connection", || drop(connection));
        }
    }

    fn next_timeout(&self, now: Instant) -> Duration {
        self.connections
            .values()
            .flat_map(|c| {
                [
                    c.connection.poll_timeout(),
                    c.tls.as_ref().and_then(|tls| tls.deadline()),
                    c.close_by,
                ]
            })
            .flatten()
            .chain(self.refused.next_due())
            .chain(self.pending.next_overdue())
            .chain(self.accept_again_at)
            .min()
            .map_or(MAX_PARK, |due| due.saturating_duration_since(now))
            .min(MAX_PARK)
    }

    /// Returns false on shutdown.
    fn drain_commands(&mut self) -> bool {
        if self.waker.is_shutdown_requested() {
            return false;
        }
        while let Some(command) = self.commands.pop() {
            match command {
                Command::Shutdown => return false,
                Command::Stats(reply) => {
                    let _ = reply.send(super::DriverStats {
                        turns: self.turns,
                        sleeps: self.sleeps,
                        open_connections: self.connections.len() as u64,
                        failed_accepts: self.failed_accepts,
                        listener_failed: self.listener_failed,
                        refused_connections: self.refused_connections,
                        short_writes: self.short_writes,
                        protocol_errors: self.protocol_errors,
                        ..super::DriverStats::default()
                    });
                }
                Command::Dump(reply) => {
                    let mut out = String::new();
                    for (token, conn) in &self.connections {
                        conn.connection.describe(token, &mut out);
                    }
                    let _ = reply.send(out);
                }
                Command::Connect {
                    peer,
                    connection_index,
                    channel,
                } => {
                    self.worked = true;
                    let backoff = self.config.request_backoff;
                    let now = Instant::now();
                    super::connect_channel(self, peer, connection_index, channel, backoff, now);
                }
                Command::Connected {
                    peer,
                    connection_index,
                    attempt,
                    result,
                } => {
                    self.worked = true;
                    super::on_connected(
                        self,
                        peer,
                        connection_index,
                        attempt,
                        result,
                        Instant::now(),
                    );
                }
            }
        }
        true
    }

    fn accept(&mut self) {
        self.accept_again_at = None;
        // Edge-triggered: accept until WouldBlock. Bounded per turn (the backlog can hold
        // more): what is left is accepted on the next turn, as no new event will say so.
        for _ in 0..1024 {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    self.accept_failing = false;
                    if self.accepted >= self.config.max_connections {
                        let tls = self.config.tls.is_some();
                        refuse_connection(&stream, tls, self.accepted, self.config.max_connections);
                        self.refused_connections += 1;
                        // Dropping the stream closes it at once.
                        continue;
                    }
                    if let Err(error) = self.config.liveness.apply(&stream) {
                        tracing::debug!(%error, "socket options of an accepted connection");
                    }
                    let tls = match &self.config.tls {
                        Some(context) => match context.server_session() {
                            Ok(session) => Some(TlsLink::new(
                                session,
                                Instant::now() + context.handshake_timeout(),
                            )),
                            Err(error) => {
                                tracing::warn!(%peer, %error, "starting a TLS session failed; closing the connection");
                                continue;
                            }
                        },
                        None => None,
                    };
                    let server =
                        ServerConnection::new(self.config.server.clone(), self.manager.clone());
                    match self.add(stream, Side::Server(server), None, tls) {
                        Ok(_) => self.accepted += 1,
                        Err(error) => {
                            tracing::warn!(%peer, %error, "registering an accepted connection failed")
                        }
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                // The connection went away before it was taken, or a signal: go on.
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
                    ) => {}
                Err(error) if error.raw_os_error().is_some_and(listener_failed_for_good) => {
                    // Retrying would fail the same way every pause for good.
                    self.failed_accepts += 1;
                    self.listener_failed = true;
                    if let Err(error) = self.poll.registry().deregister(&mut self.listener) {
                        tracing::debug!(%error, "deregistering the failed listener");
                    }
                    tracing::error!(
                        %error,
                        "the listener failed for good: no new connection is accepted (open ones go on)"
                    );
                    return;
                }
                Err(error) => {
                    // Out of file descriptors or memory: try again after a pause (logged once
                    // per streak, not every pause).
                    self.failed_accepts += 1;
                    if std::mem::replace(&mut self.accept_failing, true) {
                        tracing::debug!(%error, "accept failed again");
                    } else {
                        tracing::warn!(%error, "accept failed; retrying every 10 ms");
                    }
                    self.accept_again_at = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
        self.accept_again_at = Some(Instant::now());
    }

    fn add(
        &mut self,
        mut stream: TcpStream,
        side: Side,
        peer: Option<(SocketAddr, usize)>,
        tls: Option<Box<TlsLink>>,
    ) -> io::Result<Token> {
        let peer_addr = stream.peer_addr().ok();
        let token = Token(self.next_token);
        self.next_token += 1;
        self.poll.registry().register(
            &mut stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        )?;
        self.connections.insert(
            token,
            Conn {
                stream,
                connection: Connection::new(side, peer_addr),
                peer,
                tls,
                close_by: None,
            },
        );
        Ok(token)
    }

    /// Reads what the socket holds. `closing`: the readiness also reported the peer's end or
    /// an error, which raises no new edge later, so the reads go on to the end or WouldBlock.
    fn read(&mut self, token: Token, now: Instant, closing: bool) {
        let Some(conn) = self.connections.get_mut(&token) else {
            return;
        };
        if conn.close_by.is_some() {
            match discard_input(&conn.stream) {
                // The peer's end: nothing more to read, but the ErrorResponse may still be
                // on its way out (`transmit` or the deadline closes).
                Discarded::Drained | Discarded::Ended => {}
                // Edge-triggered: ask again for what is left.
                Discarded::More => self.rearm_after_the_bound(token),
                Discarded::Failed => self.close(token),
            }
            return;
        }
        if conn.tls.is_some() {
            self.read_tls(token, now);
            return;
        }
        // Readers woken once for this loop's buffers, when it ends (see `hold_wakes`), or
        // every `READS_PER_WAKE` reads of a long loop.
        let _wakes = crate::gate::hold_wakes();
        // Edge-triggered: read until WouldBlock. Bounded per turn so one busy connection
        // cannot starve the others; the rest is read on the next readiness or turn.
        for round in 0..256 {
            if round > 0 && round % super::READS_PER_WAKE == 0 {
                crate::gate::give_held_wakes();
            }
            let (destination, ahead) = conn.connection.read_targets();
            let destination_len = destination.len();
            let asked = destination_len + ahead.len();
            let mut slices = [IoSliceMut::new(destination), IoSliceMut::new(ahead)];
            match conn.stream.read_vectored(&mut slices) {
                Ok(0) => {
                    self.lose(token, "connection closed by the peer");
                    return;
                }
                Ok(n) => {
                    if let Err(error) = conn.connection.on_read(n, destination_len, now) {
                        if conn.connection.was_refused_at_limit() {
                            tracing::info!(%error, "refused; the channels connect again later");
                            self.close(token);
                            return;
                        }
                        tracing::warn!(
                            %error,
                            peer = ?conn.stream.peer_addr().ok(),
                            "protocol error; closing the connection"
                        );
                        self.close_after_error(token, now);
                        return;
                    }
                    if n < asked && !closing {
                        // A short read took everything the socket held: data arriving later
                        // raises a new edge, so the read that would only say WouldBlock is
                        // skipped (one syscall per readiness instead of two). Not when the
                        // end already arrived: it would raise no edge again.
                        return;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => {
                    self.lose(token, &format!("read failed: {error}"));
                    return;
                }
            }
        }
        // More may be waiting: edge-triggered epoll will not tell again.
        self.rearm_after_the_bound(token);
    }

    /// A read or write loop stopped at its bound with more to do: edge-triggered epoll raises
    /// no new edge for a socket that stayed ready, so the registration is renewed (reporting
    /// its readiness again) and the next turn goes on.
    fn rearm_after_the_bound(&mut self, token: Token) {
        if let Some(conn) = self.connections.get_mut(&token) {
            let _ = self.poll.registry().reregister(
                &mut conn.stream,
                token,
                Interest::READABLE | Interest::WRITABLE,
            );
        }
    }

    fn transmit(&mut self, token: Token, now: Instant) {
        let Some(conn) = self.connections.get_mut(&token) else {
            return;
        };
        if conn.close_by.is_some_and(|by| now >= by) {
            self.close_discarding_input(token);
            return;
        }
        if conn.tls.is_some() {
            self.transmit_tls(token, now);
            return;
        }
        conn.connection.poll_transmit(now);
        // The slice vector is reused across writes: no allocation per `writev`.
        let mut scratch = std::mem::take(&mut self.slice_scratch);
        let mut failure = None;
        let mut passes = 0;
        // Bounded: each pass writes something or stops.
        for _ in 0..WRITE_PASSES {
            passes += 1;
            if !conn.connection.wants_write() {
                break;
            }
            let mut slices = reuse_slices(std::mem::take(&mut scratch));
            conn.connection.write_slices(&mut slices, MAX_SLICES);
            let offered: usize = slices.iter().map(|slice| slice.len()).sum();
            let written = NoSignal(&conn.stream).write_vectored(&slices);
            slices.clear();
            scratch = reuse_slices(slices);
            match written {
                Ok(0) => break,
                Ok(n) => {
                    self.worked = true;
                    conn.connection.on_written(n);
                    conn.connection.poll_transmit(now);
                    if n < offered {
                        // The socket's send buffer is full: the next write would only say
                        // WouldBlock. Writable readiness raises a new edge when ACKs free
                        // room, and the loop goes on then.
                        self.short_writes += 1;
                        break;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    self.short_writes += 1;
                    break;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => {
                    failure = Some(format!("write failed: {error}"));
                    break;
                }
            }
        }
        self.slice_scratch = scratch;
        if let Some(reason) = failure {
            self.lose(token, &reason);
            return;
        }
        let conn = self.connections.get_mut(&token).expect("still present");
        if passes == WRITE_PASSES && conn.connection.wants_write() {
            self.rearm_after_the_bound(token);
        }
        let conn = self.connections.get_mut(&token).expect("still present");
        if conn.close_by.is_some() && !conn.connection.wants_write() {
            self.close_discarding_input(token);
        } else if conn.connection.is_closing() && !conn.connection.wants_write() {
            self.close(token);
        }
    }

    /// A protocol error was found on `token`: the ErrorResponse its state machine queued must
    /// still reach the peer, behind whatever the socket's send buffer holds, so the
    /// connection stays until its writes are out (or [`ERROR_RESPONSE_LINGER`](super::ERROR_RESPONSE_LINGER) passed),
    /// reading and discarding what the peer sends meanwhile. Closed at once, it lost the
    /// response whenever the socket was full.
    fn close_after_error(&mut self, token: Token, now: Instant) {
        self.protocol_errors += 1;
        if let Some(conn) = self.connections.get_mut(&token) {
            conn.close_by
                .get_or_insert(now + super::ERROR_RESPONSE_LINGER);
        }
        self.transmit(token, now);
    }

    /// Closes `token` after reading away what the socket still holds: a socket closed with
    /// unread input sends a reset, and a reset can discard the ErrorResponse the peer has not
    /// read yet.
    fn close_discarding_input(&mut self, token: Token) {
        if let Some(conn) = self.connections.get_mut(&token) {
            super::discard_input_before_close(&conn.stream);
        }
        self.close(token);
    }

    /// Reads a TLS connection: ciphertext from the socket in large reads, into its session
    /// in the pieces rustls takes, each piece's plaintext handed to the connection at once.
    fn read_tls(&mut self, token: Token, now: Instant) {
        // One read area for every TLS connection of the thread: rustls copies what it is
        // given, so nothing stays in it between calls.
        let mut ciphertext = std::mem::take(&mut self.ciphertext);
        if ciphertext.is_empty() {
            ciphertext = vec![0; CIPHERTEXT_READ].into_boxed_slice();
        }
        self.read_tls_into(token, now, &mut ciphertext);
        self.ciphertext = ciphertext;
    }

    fn read_tls_into(&mut self, token: Token, now: Instant, ciphertext: &mut [u8]) {
        let conn = self.connections.get_mut(&token).expect("present");
        let Conn {
            stream,
            connection,
            tls,
            ..
        } = conn;
        let TlsLink { session, .. } = &mut **tls.as_mut().expect("a TLS connection");
        let mut drained = false;
        // Edge-triggered: read until WouldBlock, bounded per turn as for plain connections.
        for _ in 0..256 {
            // One syscall for up to CIPHERTEXT_READ bytes: rustls reading the socket itself
            // would take 4 KiB per call.
            let n = match stream.read(ciphertext) {
                Ok(0) => {
                    self.lose(token, "connection closed by the peer");
                    return;
                }
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    drained = true;
                    break;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    self.lose(token, &format!("read failed: {error}"));
                    return;
                }
            };
            let mut pending = &ciphertext[..n];
            // Bounded by the bytes read: each pass hands rustls at least one, or stops.
            for _ in 0..n {
                let taken = match session.read_tls(&mut pending) {
                    Ok(taken) => taken,
                    Err(error) => {
                        self.lose(token, &format!("TLS read failed: {error}"));
                        return;
                    }
                };
                let closed_by_peer = match session.process_new_packets() {
                    Ok(state) => state.peer_has_closed(),
                    Err(error) => {
                        // rustls queued an alert telling the peer why; it goes if the socket
                        // takes it.
                        let _ = session.write_tls(&mut NoSignal(stream));
                        self.fail_tls(token, &error);
                        return;
                    }
                };
                if let Err(error) = deliver_plaintext(session, connection, now) {
                    tracing::warn!(
                        %error,
                        peer = ?stream.peer_addr().ok(),
                        "protocol error; closing the connection"
                    );
                    self.close_after_error(token, now);
                    return;
                }
                // The peer's close_notify ends the stream as its EOF would: a peer that sends
                // it and keeps the socket open must not hold the connection (and its
                // channels) open.
                if closed_by_peer {
                    self.lose(token, "connection closed by the peer (TLS close_notify)");
                    return;
                }
                if taken == 0 || pending.is_empty() {
                    break;
                }
            }
        }
        if !drained {
            // More may be waiting: edge-triggered epoll will not tell again.
            self.rearm_after_the_bound(token);
        }
        // Handshake messages or alerts may be due, and a finished handshake lets the frames
        // queued meanwhile leave.
        self.transmit_tls(token, now);
    }

    /// Writes a TLS connection: its session's records first; plaintext goes into the session
    /// only once they are all out, so at most [`OUTGOING_TLS_LIMIT`](super::tls::OUTGOING_TLS_LIMIT) bytes wait in it.
    fn transmit_tls(&mut self, token: Token, now: Instant) {
        let conn = self.connections.get_mut(&token).expect("present");
        let Conn {
            stream,
            connection,
            tls,
            ..
        } = conn;
        let link = tls.as_mut().expect("a TLS connection");
        if link.deadline().is_some_and(|due| now >= due) {
            let reason = "TLS handshake timed out (security.ssl.internal.handshake-timeout)";
            tracing::warn!(peer = ?stream.peer_addr().ok(), "{reason}; closing the connection");
            self.lose(token, reason);
            return;
        }
        let session = &mut link.session;
        // The protocol's handshake deadline (`fluxgate.network.handshake-timeout`) starts at
        // its first transmit: only once TLS is up, so the TLS handshake has its own budget
        // (`security.ssl.internal.handshake-timeout`), not the smaller of the two. Only a
        // read completes the handshake, and the read path ends here: the turn that completes
        // it transmits. Called on every turn after (before the writes, which may stop at a
        // full socket), it also runs the connection's retries and deadlines.
        if !session.is_handshaking() {
            connection.poll_transmit(now);
        }
        let mut scratch = std::mem::take(&mut self.slice_scratch);
        let mut failure = None;
        let mut passes = 0;
        // Bounded: each pass writes records, takes plaintext, or stops.
        for _ in 0..WRITE_PASSES {
            passes += 1;
            if session.wants_write() {
                match session.write_tls(&mut NoSignal(stream)) {
                    Ok(0) => break,
                    Ok(_) => {
                        self.worked = true;
                        continue;
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                    Err(error) => {
                        failure = Some(format!("write failed: {error}"));
                        break;
                    }
                }
            }
            // Frames wait for the handshake rather than in the session's plaintext buffer.
            if session.is_handshaking() || !connection.wants_write() {
                break;
            }
            let mut slices = reuse_slices(std::mem::take(&mut scratch));
            connection.write_slices(&mut slices, MAX_SLICES);
            let accepted = session.writer().write_vectored(&slices);
            slices.clear();
            scratch = reuse_slices(slices);
            match accepted {
                Ok(0) => break,
                Ok(n) => {
                    self.worked = true;
                    connection.on_written(n);
                    connection.poll_transmit(now);
                }
                Err(error) => {
                    failure = Some(format!("TLS write failed: {error}"));
                    break;
                }
            }
        }
        self.slice_scratch = scratch;
        if let Some(reason) = failure {
            self.lose(token, &reason);
            return;
        }
        let conn = self.connections.get_mut(&token).expect("still present");
        let tls_wants_write = conn
            .tls
            .as_ref()
            .is_some_and(|link| link.session.wants_write());
        if passes == WRITE_PASSES && (tls_wants_write || conn.connection.wants_write()) {
            self.rearm_after_the_bound(token);
        }
        let conn = self.connections.get_mut(&token).expect("still present");
        let session = &mut conn.tls.as_mut().expect("a TLS connection").session;
        if (conn.connection.is_closing() || conn.close_by.is_some())
            && !conn.connection.wants_write()
            && !session.wants_write()
        {
            // Tells the peer the end is deliberate; best effort, as the close itself is.
            session.send_close_notify();
            let _ = session.write_tls(&mut NoSignal(&conn.stream));
            if conn.close_by.is_some() {
                self.close_discarding_input(token);
            } else {
                self.close(token);
            }
        }
    }

    /// The TLS session failed (handshake refused, bad record, a plain-TCP peer): the
    /// connection closes, a certificate refused either way failing its channels as
    /// unauthenticated.
    fn fail_tls(&mut self, token: Token, error: &rustls::Error) {
        let Some(conn) = self.connections.get_mut(&token) else {
            return;
        };
        let reason = format!("TLS failed: {error}");
        let peer = conn.stream.peer_addr().ok();
        if super::tls::is_identity_failure(error) {
            tracing::warn!(?peer, %error, "TLS peer identity refused; closing the connection");
            conn.connection.on_rejected(&reason);
        } else {
            tracing::warn!(?peer, %error, "TLS failed; closing the connection");
            conn.connection.on_lost(&reason);
        }
        self.close(token);
    }

    fn close(&mut self, token: Token) {
        self.lose(token, "connection closed");
    }

    /// Closes `token`; its channels fail with `reason`, but for those the producer refused
    /// at its connection limit, which connect again later ([`super::retry_unanswered`]).
    fn lose(&mut self, token: Token, reason: &str) {
        if let Some(mut conn) = self.connections.remove(&token) {
            if let Some(peer) = conn.peer {
                let unanswered = conn.connection.take_unanswered_channels();
                super::retry_unanswered(self, peer, unanswered, Instant::now());
            }
            let _ = self.poll.registry().deregister(&mut conn.stream);
            match conn.peer {
                Some(peer) => {
                    // Unless a newer connection to the peer took the entry meanwhile.
                    if self.peers.get(&peer) == Some(&token) {
                        self.peers.remove(&peer);
                    }
                }
                None => self.accepted -= 1,
            }
            conn.connection.on_lost(reason);
        }
    }
}

/// Hands the plaintext `session` decrypted to `connection`: straight into its read
/// destination, the rest of a chunk into its read-ahead area.
fn deliver_plaintext(
    session: &mut rustls::Connection,
    connection: &mut Connection,
    now: Instant,
) -> Result<(), ProtocolError> {
    let mut reader = session.reader();
    // Bounded by rustls's received-plaintext limit (16 KiB): each pass consumes at least
    // one byte, or stops.
    for _ in 0..=super::tls::RECEIVED_PLAINTEXT_LIMIT {
        // WouldBlock (nothing decrypted) and the ends (close_notify, EOF) are read_tls's to
        // report; here they only mean nothing more to hand over.
        let Ok(chunk) = reader.fill_buf() else {
            return Ok(());
        };
        if chunk.is_empty() {
            return Ok(());
        }
        // Straight into the state machine's destination: the plaintext is already in memory,
        // so the read-ahead area (which saves socket reads) would only add a second copy.
        let (destination, _) = connection.read_targets();
        let destination_len = destination.len();
        let n = chunk.len().min(destination_len);
        if n == 0 {
            return Err(ProtocolError::Closed);
        }
        destination[..n].copy_from_slice(&chunk[..n]);
        reader.consume(n);
        connection.on_read(n, destination_len, now)?;
    }
    Ok(())
}

/// A socket's writes with `MSG_NOSIGNAL`: a write into a connection its peer reset fails
/// with `EPIPE` instead of raising SIGPIPE, whose default action ends the process. Rust's
/// runtime ignores the signal, but a host that embeds the engine need not; plain `writev`
/// cannot take the flag.
struct NoSignal<'s>(&'s TcpStream);

impl Write for NoSignal<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        SockRef::from(self.0).send_with_flags(buf, libc::MSG_NOSIGNAL)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        SockRef::from(self.0).send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Moves an empty slice vector's allocation to another lifetime (collected in place: same
/// layout, no element, so no reallocation).
fn reuse_slices<'b>(slices: Vec<IoSlice<'_>>) -> Vec<IoSlice<'b>> {
    debug_assert!(slices.is_empty());
    slices
        .into_iter()
        .map(|_| unreachable!("the vector is empty"))
        .collect()
}
