//! One connection as a driver sees it: either side's state machine behind one interface, plus
//! the small read-ahead area that lets one read syscall take the end of a payload and the next
//! frame headers together.

use std::io::IoSlice;
use std::task::Waker;
use std::time::Instant;

use crate::buffer::Buffer;
use crate::protocol::outbound::Outbound;
use crate::protocol::{ClientConnection, ProtocolError, ServerConnection};

/// Bytes read past the current destination in one vectored read: headers of the next frames
/// and at most this much payload are copied once; larger payload parts are read in place.
pub(crate) const READ_AHEAD: usize = 512;

/// The protocol side of a connection.
#[derive(Debug)]
pub(crate) enum Side {
    /// We consume (we opened the connection).
    Client(ClientConnection),
    /// We produce (the peer opened it).
    Server(ServerConnection),
}

/// A connection's state machine and read-ahead bytes.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) side: Side,
    ahead: Box<[u8; READ_AHEAD]>,
    /// `connection{side, peer}`: entered while the driver works on this connection, so the
    /// protocol's events (errors, partition requests, retries) say which peer they are about.
    /// Disabled (free to enter) unless `RUST_LOG` asks for fluxgate's debug level.
    span: tracing::Span,
}

impl Connection {
    /// The client side of a connection a driver opened to a peer (the drivers' peer maps
    /// hold only those).
    pub(crate) fn client_mut(&mut self) -> &mut ClientConnection {
        let Side::Client(client) = &mut self.side else {
            unreachable!("peer map holds client connections only");
        };
        client
    }

    pub(crate) fn new(side: Side, peer: Option<std::net::SocketAddr>) -> Self {
        let span = match &side {
            Side::Client(_) => tracing::debug_span!("connection", side = "consumer", peer = ?peer),
            Side::Server(_) => tracing::debug_span!("connection", side = "producer", peer = ?peer),
        };
        Self {
            side,
            ahead: Box::new([0; READ_AHEAD]),
            span,
        }
    }

    /// The destination of the next read and the read-ahead area after it.
    pub(crate) fn read_targets(&mut self) -> (&mut [u8], &mut [u8]) {
        (read_buffer(&mut self.side), &mut self.ahead[..])
    }

    /// `n` bytes arrived: first into the destination, the rest into the read-ahead area,
    /// which is then fed to the state machine piece by piece.
    pub(crate) fn on_read(
        &mut self,
        n: usize,
        destination_len: usize,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        // Fields borrowed apart, so the span is entered without a clone per read.
        let Self { side, ahead, span } = self;
        let _entered = span.enter();
        let direct = n.min(destination_len);
        feed(side, direct, now)?;
        let mut left = n - direct;
        let mut at = 0;
        // Bounded by the read-ahead bytes: each pass consumes at least one.
        while left > 0 {
            let destination = read_buffer(side);
            let take = destination.len().min(left);
            if take == 0 {
                return Err(ProtocolError::Closed);
            }
            destination[..take].copy_from_slice(&ahead[at..at + take]);
            feed(side, take, now)?;
            at += take;
            left -= take;
        }
        Ok(())
    }

    pub(crate) fn poll_transmit(&mut self, now: Instant) {
        let _entered = self.span.enter();
        match &mut self.side {
            Side::Client(c) => c.poll_transmit(now),
            Side::Server(s) => s.poll_transmit(now),
        }
    }

    pub(crate) fn write_slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        match &self.side {
            Side::Client(c) => c.write_slices(out, max),
            Side::Server(s) => s.write_slices(out, max),
        }
    }

    pub(crate) fn on_written(&mut self, n: usize) {
        match &mut self.side {
            Side::Client(c) => c.on_written(n),
            Side::Server(s) => s.on_written(n),
        }
    }

    /// An asynchronous write of the current [`write_slices`](Self::write_slices) was
    /// submitted: their segments stay alive until the next [`on_written`](Self::on_written).
    pub(crate) fn begin_write(&mut self) {
        match &mut self.side {
            Side::Client(c) => c.begin_write(),
            Side::Server(s) => s.begin_write(),
        }
    }

    fn outbound(&mut self) -> &mut Outbound {
        match &mut self.side {
            Side::Client(c) => c.outbound_mut(),
            Side::Server(s) => s.outbound_mut(),
        }
    }

    /// A zero-copy send tagged `tag` was submitted: written segments are held from now on
    /// until [`release_sent`](Self::release_sent) passes `tag`.
    pub(crate) fn retain_sent(&mut self, tag: u64) {
        self.outbound().retain_sent(tag);
    }

    /// Every zero-copy send tagged below `done_below` was notified: their segments go.
    pub(crate) fn release_sent(&mut self, done_below: u64) {
        self.outbound().release_sent(done_below);
    }

    /// Segments held for zero-copy sends not notified yet.
    pub(crate) fn held_segments(&mut self) -> usize {
        self.outbound().held_segments()
    }

    /// After [`on_lost`](Self::on_lost), with zero-copy sends not notified yet: every segment
    /// they may read moves to `out`.
    pub(crate) fn take_held(&mut self, out: &mut Vec<Buffer>) {
        self.outbound().take_held(out);
    }

    pub(crate) fn wants_write(&self) -> bool {
        match &self.side {
            Side::Client(c) => c.wants_write(),
            Side::Server(s) => s.wants_write(),
        }
    }

    pub(crate) fn has_pending(&self) -> bool {
        match &self.side {
            Side::Client(c) => c.has_pending(),
            Side::Server(s) => s.has_pending(),
        }
    }

    pub(crate) fn set_waker(&self, waker: &Waker) -> bool {
        match &self.side {
            Side::Client(c) => c.set_waker(waker),
            Side::Server(s) => s.set_waker(waker),
        }
    }

    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        match &self.side {
            Side::Client(c) => c.poll_timeout(),
            Side::Server(s) => s.poll_timeout(),
        }
    }

    /// True when the connection should close once its queued bytes are written.
    pub(crate) fn is_closing(&self) -> bool {
        match &self.side {
            Side::Client(c) => c.is_closed(),
            Side::Server(s) => s.is_closing(),
        }
    }

    /// Appends this connection's state to a diagnostics dump (both drivers' `Dump`).
    pub(crate) fn describe(&self, label: &dyn std::fmt::Debug, out: &mut String) {
        out.push_str(&format!(
            "connection {label:?} wants write {} pending {}\n",
            self.wants_write(),
            self.has_pending()
        ));
        if let Side::Server(server) = &self.side {
            out.push_str(&server.debug_summary());
        }
    }

    /// The peer refused our certificate or presented one we do not trust (TLS): channels
    /// fail as unauthenticated, views are released.
    pub(crate) fn on_rejected(&mut self, reason: &str) {
        match &mut self.side {
            Side::Client(c) => c.on_peer_rejected(reason),
            Side::Server(s) => s.on_connection_lost(),
        }
    }

    /// True for a client connection its producer refused at its `max-connections`: it ends
    /// as a refused connect does, not as a protocol error.
    pub(crate) fn was_refused_at_limit(&self) -> bool {
        matches!(&self.side, Side::Client(c) if c.was_refused_at_limit())
    }

    /// True for a client connection that takes another channel
    /// ([`ClientConnection::has_room`]).
    pub(crate) fn has_room(&self) -> bool {
        match &self.side {
            Side::Client(c) => c.has_room(),
            Side::Server(_) => false,
        }
    }

    /// A client connection's channels that may ask again elsewhere
    /// ([`ClientConnection::take_unanswered_channels`]); none of a server connection.
    pub(crate) fn take_unanswered_channels(
        &mut self,
    ) -> Vec<(
        std::sync::Arc<crate::gate::RemoteChannelShared>,
        crate::gate::Backoff,
    )> {
        match &mut self.side {
            Side::Client(c) => c.take_unanswered_channels(),
            Side::Server(_) => Vec::new(),
        }
    }

    /// The socket failed or hit EOF: channels fail, views are released.
    pub(crate) fn on_lost(&mut self, reason: &str) {
        let _entered = self.span.enter();
        match &mut self.side {
            Side::Client(c) => c.on_connection_lost(reason),
            Side::Server(s) => s.on_connection_lost(),
        }
    }
}

/// Where the side's next bytes go.
fn read_buffer(side: &mut Side) -> &mut [u8] {
    match side {
        Side::Client(c) => c.read_buffer(),
        Side::Server(s) => s.read_buffer(),
    }
}

/// Hands `n` bytes read into [`read_buffer`] to the side's state machine.
fn feed(side: &mut Side, n: usize, now: Instant) -> Result<(), ProtocolError> {
    if n == 0 {
        return Ok(());
    }
    match side {
        Side::Client(c) => c.on_read(n),
        Side::Server(s) => s.on_read(n, now),
    }
}
