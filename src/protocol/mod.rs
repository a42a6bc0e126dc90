//! The wire protocol and credit-based flow control as pure, IO-free state machines (the
//! quinn-proto shape): a connection is fed the bytes a driver read and tells the driver which
//! bytes to write; time is passed in. Nothing here touches a socket, a thread or the clock.
//!
//! * [`frame`] — the frame layout we own, encoding and validated decoding.
//! * [`auth`] — the authenticated handshake (HMAC-SHA256 challenge–response over a shared
//!   secret) and its [`Secret`].
//! * [`ClientConnection`] — the consumer side of one TCP connection: the remote input channels
//!   on it, incoming BufferResponses received straight into a segment the channel reserved
//!   when it granted the credit, sequence checks, AddCredit when unannounced credit goes from
//!   0 to positive, resume, cancel, close.
//! * [`ServerConnection`] — the producer side: one reader per requested subpartition view with
//!   its credit, a fair queue of readers that can send, data only with credit and events
//!   always, priority first, partition requests that wait for a late partition.
//!
//! # Driving a connection
//!
//! 1. Reading: [`read_buffer`](ClientConnection::read_buffer) names where the next bytes go
//!    (the frame-header buffer, or the segment reserved for a payload); read into it and call
//!    `on_read(n)`.
//! 2. Writing: call `poll_transmit(now)`, then `write_slices` for the ranges to send (frame
//!    headers and segment payloads, ready for one vectored send) and `on_written(n)`; written
//!    segments go back to their pools.
//! 3. Time: `poll_timeout()` says when `handle_timeout(now)` is due.
//! 4. A returned [`ProtocolError`] means: send what is queued (an ErrorResponse), then close.

pub mod auth;
mod client;
pub mod frame;
mod inbound;
pub(crate) mod outbound;
mod server;

pub use auth::Secret;
pub use client::{ClientConfig, ClientConnection};
pub use frame::{DecodeError, ErrorKind, Message, MessageId, ReceiverId};
pub use server::{RequestRate, ServerConfig, ServerConnection};

/// Why a connection must close. Variants say whose fault it is.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The peer sent bytes that are not a valid frame (peer's fault).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The peer sent a message that is not valid in this direction or state (peer's fault).
    #[error("unexpected {0:?} message")]
    UnexpectedMessage(MessageId),
    /// The first frame was not a handshake, or its version is not ours (peer's fault).
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The producer sent a data buffer the channel had no credit for (peer's fault).
    #[error("data buffer for receiver {0:?} without credit")]
    CreditExceeded(ReceiverId),
    /// Credit announced beyond what a channel can hold (peer's fault).
    #[error("credit overflow for receiver {0:?}")]
    CreditOverflow(ReceiverId),
    /// A partition request for a receiver id already in use (peer's fault).
    #[error("duplicate receiver {0:?}")]
    DuplicateReceiver(ReceiverId),
    /// The peer reported an error for the whole connection.
    #[error("remote error ({kind:?}): {message}")]
    Remote {
        /// What kind.
        kind: ErrorKind,
        /// The peer's message.
        message: String,
    },
    /// The peer did not prove it knows the cluster secret, proved it wrong, or refused our
    /// proof; or one side authenticates and the other does not.
    #[error("authentication failed: {0}")]
    Unauthenticated(String),
    /// The peer requested more channels than one connection may carry (peer's fault).
    #[error("too many channels on one connection (limit {limit})")]
    TooManyChannels {
        /// `fluxgate.network.max-channels-per-connection`.
        limit: usize,
    },
    /// The peer sent partition requests faster than allowed (peer's fault).
    #[error("partition requests arrive faster than {per_second} per second (burst {burst})")]
    RequestRateExceeded {
        /// `fluxgate.network.partition-request-rate`.
        per_second: u32,
        /// `fluxgate.network.partition-request-burst`.
        burst: u32,
    },
    /// The peer sends what makes this side queue control messages (cancellations, error
    /// responses) and does not read them: more than [`MAX_QUEUED_CONTROL`] bytes wait
    /// (peer's fault).
    #[error("{bytes} bytes of control messages wait for the peer to read them")]
    ControlBacklog {
        /// Bytes queued when the limit was passed.
        bytes: usize,
    },
    /// The connection was closed (by either side).
    #[error("connection closed")]
    Closed,
}

/// Most bytes of control messages one side queues for a peer that does not read: a stream of
/// frames each answered with a message (a BufferResponse for an unknown receiver answered
/// with a cancellation, a bad partition request with an error response) would otherwise
/// grow the queue without bound. Each side allows for what it queues of its own beyond this:
/// the producer its data frames, the consumer its task events.
pub const MAX_QUEUED_CONTROL: usize = 1 << 20;

impl ProtocolError {
    /// The kind an ErrorResponse reporting this error carries.
    pub fn error_kind(&self) -> ErrorKind {
        match self {
            ProtocolError::Unauthenticated(_) => ErrorKind::Unauthenticated,
            ProtocolError::TooManyChannels { .. }
            | ProtocolError::RequestRateExceeded { .. }
            | ProtocolError::ControlBacklog { .. } => ErrorKind::LimitExceeded,
            ProtocolError::Remote { kind, .. } => *kind,
            _ => ErrorKind::Protocol,
        }
    }

    /// True when the connection failed because authentication failed (on either side).
    pub fn is_authentication_failure(&self) -> bool {
        self.error_kind() == ErrorKind::Unauthenticated
    }
}

/// `fluxgate.network.handshake-timeout` on one side of a connection: the peer must complete
/// its handshake (and, with a secret, its proof) before the deadline, which starts at the
/// first look. Both the client and the server keep one.
#[derive(Debug, Clone, Copy)]
struct HandshakeDeadline {
    timeout: std::time::Duration,
    at: Option<std::time::Instant>,
}

impl HandshakeDeadline {
    fn new(timeout: std::time::Duration) -> Self {
        Self { timeout, at: None }
    }

    /// When it is due, once started.
    fn due(&self) -> Option<std::time::Instant> {
        self.at
    }

    /// The error to fail the connection with once `now` is past the deadline, naming what the
    /// peer (`"the producer"`, `"the consumer"`) did not send.
    fn expired(
        &mut self,
        now: std::time::Instant,
        handshake_received: bool,
        peer: &str,
    ) -> Option<ProtocolError> {
        let timeout = self.timeout;
        if now < *self.at.get_or_insert(now + timeout) {
            return None;
        }
        Some(if handshake_received {
            ProtocolError::Unauthenticated(format!(
                "{peer} sent no proof of the cluster secret within {timeout:?} \
                 (fluxgate.network.handshake-timeout)"
            ))
        } else {
            ProtocolError::Handshake(format!(
                "no handshake from {peer} within {timeout:?} \
                 (fluxgate.network.handshake-timeout)"
            ))
        })
    }
}
