//! The epoll driver (mio): one I/O thread, edge-triggered sockets, vectored reads (payload
//! straight into its segment plus a small read-ahead) and vectored writes (frame headers and
//! segment payloads in one `writev`).

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Waker;
use std::thread;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::conn::{Connection, Side};
pub use super::DriverConfig;
use super::{
    open_client, refuse_connection, Command, ConnectFailure, DriverHandle, IoWaker,
    RefusedConnects, WakeFn,
};
use crate::partition::PartitionManager;
use crate::protocol::ServerConnection;
use crate::sync::ArrayQueue;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONNECTION: usize = 2;
/// Longest the thread sleeps without an event (it then checks timeouts).
const MAX_PARK: Duration = Duration::from_millis(100);
/// Slices handed to one `writev`.
const MAX_SLICES: usize = 64;

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
    /// Binds `bind` and starts the I/O thread serving `manager`'s partitions.
    pub fn start(
        bind: SocketAddr,
        config: DriverConfig,
        manager: Arc<PartitionManager>,
    ) -> io::Result<Self> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::bind(bind)?;
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
            poll,
            listener,
            connections: HashMap::new(),
            peers: HashMap::new(),
            refused: RefusedConnects::default(),
            refused_due: Vec::new(),
            accepted: 0,
            next_token: FIRST_CONNECTION,
            commands: commands.clone(),
            waker: waker.clone(),
            std_waker: Waker::from(waker.clone()),
            config,
            manager,
        };
        let thread = thread::Builder::new()
            .name("fluxgate-io-epoll".into())
            .spawn(move || io_loop.run())?;
        Ok(Self {
            handle: DriverHandle {
                commands,
                waker,
                thread: Some(thread),
                local_addr,
            },
        })
    }

    /// The address the server listens on (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.handle.local_addr
    }

    /// Hands a command to the I/O thread.
    pub(crate) fn submit(&self, command: Command) {
        self.handle.submit(command);
    }
}

struct Conn {
    stream: TcpStream,
    connection: Connection,
    peer: Option<(SocketAddr, usize)>,
}

struct Loop {
    /// Scratch for the connection tokens of one loop turn.
    tokens: Vec<Token>,
    /// Scratch for the slices of one `writev` (always empty between writes).
    slice_scratch: Vec<IoSlice<'static>>,
    poll: Poll,
    listener: TcpListener,
    connections: HashMap<Token, Conn>,
    /// Outgoing connections by (peer, connection index).
    peers: HashMap<(SocketAddr, usize), Token>,
    /// Channels whose connection was refused, to try again.
    refused: RefusedConnects,
    /// Scratch for the refused connections due in one loop turn.
    refused_due: Vec<(Command, crate::gate::Backoff)>,
    /// Accepted (server-side) connections open now.
    accepted: usize,
    next_token: usize,
    commands: Arc<ArrayQueue<Command>>,
    waker: Arc<IoWaker<WakeFn>>,
    std_waker: Waker,
    config: DriverConfig,
    manager: Arc<PartitionManager>,
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            if !self.drain_commands() {
                break;
            }
            let now = Instant::now();
            self.retry_refused(now);
            // Reused token list: no allocation per loop turn.
            let mut tokens = std::mem::take(&mut self.tokens);
            tokens.clear();
            tokens.extend(self.connections.keys().copied());
            for token in &tokens {
                self.transmit(*token, now);
            }
            self.tokens = tokens;
            // Park: announce it, then look once more for work that raced the announcement.
            let busy = self.waker.prepare_park(|| {
                let mut busy = !self.commands.is_empty();
                for conn in self.connections.values() {
                    busy |=
                        conn.connection.set_waker(&self.std_waker) || conn.connection.has_pending();
                }
                busy
            });
            let timeout = if busy {
                Duration::ZERO
            } else {
                self.next_timeout(now)
            };
            let polled = self.poll.poll(&mut events, Some(timeout));
            self.waker.unpark();
            if let Err(error) = polled {
                if error.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(%error, "epoll wait failed; the I/O thread stops");
                    break;
                }
            }
            let now = Instant::now();
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    token => {
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.read(token, now);
                        }
                        if event.is_writable() {
                            self.transmit(token, now);
                        }
                    }
                }
            }
        }
        // Shutdown: dropping the connections fails their channels and releases their views.
        self.connections.clear();
    }

    fn next_timeout(&self, now: Instant) -> Duration {
        self.connections
            .values()
            .filter_map(|c| c.connection.poll_timeout())
            .chain(self.refused.next_due())
            .min()
            .map_or(MAX_PARK, |due| due.saturating_duration_since(now))
            .min(MAX_PARK)
    }

    /// Tries again the connections refused earlier whose back-off ran out.
    fn retry_refused(&mut self, now: Instant) {
        let mut due = std::mem::take(&mut self.refused_due);
        self.refused.take_due(now, &mut due);
        for (command, backoff) in due.drain(..) {
            if let Command::Connect {
                peer,
                connection_index,
                channel,
            } = command
            {
                self.connect_channel(peer, connection_index, channel, backoff, now);
            }
        }
        self.refused_due = due;
    }

    /// Returns false on shutdown.
    fn drain_commands(&mut self) -> bool {
        while let Some(command) = self.commands.pop() {
            match command {
                Command::Shutdown => return false,
                Command::Stats(reply) => {
                    let _ = reply.send(super::DriverStats::default());
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
                    let backoff = self.config.request_backoff;
                    self.connect_channel(peer, connection_index, channel, backoff, Instant::now());
                }
            }
        }
        true
    }

    fn connect_channel(
        &mut self,
        peer: SocketAddr,
        index: usize,
        channel: Arc<crate::gate::RemoteChannelShared>,
        backoff: crate::gate::Backoff,
        now: Instant,
    ) {
        let token = match self.peers.get(&(peer, index)) {
            Some(token) if self.connections.contains_key(token) => *token,
            _ => match self.open(peer, index) {
                Ok(token) => token,
                Err(error) => {
                    let failure =
                        self.refused
                            .on_failure(peer, index, channel.clone(), backoff, &error, now);
                    if let ConnectFailure::Fail(reason) = failure {
                        channel.fail(crate::gate::GateError::Transport {
                            channel: channel.channel(),
                            reason,
                        });
                    }
                    return;
                }
            },
        };
        let conn = self.connections.get_mut(&token).expect("just looked up");
        let Side::Client(client) = &mut conn.connection.side else {
            unreachable!("peer map holds client connections only");
        };
        let attach = |listener| channel.attach(listener);
        if let Err(error) = client.register(channel.clone(), attach) {
            channel.fail(crate::gate::GateError::Transport {
                channel: channel.channel(),
                reason: format!("connection to {peer} has no room: {error}"),
            });
        }
    }

    fn open(&mut self, peer: SocketAddr, index: usize) -> io::Result<Token> {
        let (stream, client) = open_client(peer, &self.config)?;
        stream.set_nonblocking(true)?;
        let token = self.add(
            TcpStream::from_std(stream),
            Side::Client(client),
            Some((peer, index)),
        )?;
        self.peers.insert((peer, index), token);
        tracing::debug!(%peer, index, "connection opened");
        Ok(token)
    }

    fn accept(&mut self) {
        // Edge-triggered: accept until WouldBlock. Bounded by the backlog.
        for _ in 0..1024 {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.accepted >= self.config.max_connections {
                        refuse_connection(Some(peer), self.accepted, self.config.max_connections);
                        // Dropping the stream closes it at once.
                        continue;
                    }
                    if let Err(error) = self.config.liveness.apply(&stream) {
                        tracing::debug!(%error, "socket options of an accepted connection");
                    }
                    let server =
                        ServerConnection::new(self.config.server.clone(), self.manager.clone());
                    match self.add(stream, Side::Server(server), None) {
                        Ok(_) => self.accepted += 1,
                        Err(error) => {
                            tracing::warn!(%peer, %error, "registering an accepted connection failed")
                        }
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    return;
                }
            }
        }
    }

    fn add(
        &mut self,
        mut stream: TcpStream,
        side: Side,
        peer: Option<(SocketAddr, usize)>,
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
            },
        );
        Ok(token)
    }

    fn read(&mut self, token: Token, now: Instant) {
        let Some(conn) = self.connections.get_mut(&token) else {
            return;
        };
        // Edge-triggered: read until WouldBlock. Bounded per turn so one busy connection
        // cannot starve the others; the rest is read on the next readiness or turn.
        for _ in 0..256 {
            let (destination, ahead) = conn.connection.read_targets();
            let destination_len = destination.len();
            let mut slices = [IoSliceMut::new(destination), IoSliceMut::new(ahead)];
            match conn.stream.read_vectored(&mut slices) {
                Ok(0) => {
                    self.lose(token, "connection closed by the peer");
                    return;
                }
                Ok(n) => {
                    if let Err(error) = conn.connection.on_read(n, destination_len, now) {
                        tracing::warn!(
                            %error,
                            peer = ?conn.stream.peer_addr().ok(),
                            "protocol error; closing the connection"
                        );
                        // Send the queued ErrorResponse if the socket takes it, then close.
                        self.transmit(token, now);
                        self.close(token);
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
        let _ = self.poll.registry().reregister(
            &mut self.connections.get_mut(&token).expect("present").stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        );
    }

    fn transmit(&mut self, token: Token, now: Instant) {
        let Some(conn) = self.connections.get_mut(&token) else {
            return;
        };
        conn.connection.poll_transmit(now);
        // The slice vector is reused across writes: no allocation per `writev`.
        let mut scratch = std::mem::take(&mut self.slice_scratch);
        let mut failure = None;
        // Bounded: each pass writes something or stops.
        for _ in 0..1024 {
            if !conn.connection.wants_write() {
                break;
            }
            let mut slices = reuse_slices(std::mem::take(&mut scratch));
            conn.connection.write_slices(&mut slices, MAX_SLICES);
            let written = conn.stream.write_vectored(&slices);
            slices.clear();
            scratch = reuse_slices(slices);
            match written {
                Ok(0) => break,
                Ok(n) => {
                    conn.connection.on_written(n);
                    conn.connection.poll_transmit(now);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
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
        if conn.connection.is_closing() && !conn.connection.wants_write() {
            self.close(token);
        }
    }

    fn lose(&mut self, token: Token, reason: &str) {
        if let Some(conn) = self.connections.get_mut(&token) {
            conn.connection.on_lost(reason);
        }
        self.close(token);
    }

    fn close(&mut self, token: Token) {
        if let Some(mut conn) = self.connections.remove(&token) {
            let _ = self.poll.registry().deregister(&mut conn.stream);
            match conn.peer {
                Some(peer) => {
                    self.peers.remove(&peer);
                }
                None => self.accepted -= 1,
            }
            conn.connection.on_lost("connection closed");
        }
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
