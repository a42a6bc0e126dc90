//! The producer side of a connection.

use std::collections::HashMap;
use std::fmt;
use std::io::IoSlice;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use super::auth::{Nonce, Proof, Secret, Transcript};
use super::client::encode;
use super::frame::{
    encode_buffer_response, BufferResponseHeader, ErrorKind, FrameHeader, Message, MessageId,
    ReceiverId, BUFFER_RESPONSE_HEADER, VERSION,
};
use super::inbound::{FrameReader, Step};
use super::outbound::Outbound;
use super::{HandshakeDeadline, ProtocolError};
use crate::buffer::HEADROOM;
use crate::event::Event;
use crate::gate::ChannelQueueHandle;
use crate::partition::{PartitionError, PartitionManager, ResultPartitionId, SubpartitionView};

/// Limits and timeouts of a producer-side connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// This process's node identity (sent in the handshake).
    pub node: u128,
    /// Payload bytes per segment (the largest BufferResponse payload).
    pub segment_size: usize,
    /// Most channels one connection may request (`fluxgate.network.max-channels-per-connection`).
    pub max_channels: usize,
    /// How long a request for a partition not registered yet waits before PartitionNotFound
    /// (`taskmanager.network.partition-request-timeout`, 10 s).
    pub partition_request_timeout: Duration,
    /// How often such a request looks again.
    pub partition_request_retry: Duration,
    /// Bytes queued for writing after which a poll stops taking more buffers.
    pub max_queued_bytes: usize,
    /// Longest frame accepted, header included (`fluxgate.network.max-frame-size`).
    pub max_frame_size: usize,
    /// How fast partition requests may come (`fluxgate.network.partition-request-rate` and
    /// `-burst`).
    pub request_rate: RequestRate,
    /// The cluster secret: with one, a consumer must prove it knows it before any request is
    /// served.
    pub secret: Option<Arc<Secret>>,
    /// Longest the consumer may take to send its handshake and, with a secret, its proof
    /// (`fluxgate.network.handshake-timeout`); then the connection is closed.
    pub handshake_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            node: 0,
            segment_size: 32 * 1024,
            max_channels: 4096,
            partition_request_timeout: Duration::from_secs(10),
            partition_request_retry: Duration::from_millis(50),
            max_queued_bytes: 1 << 20,
            max_frame_size: usize::MAX,
            request_rate: RequestRate::default(),
            secret: None,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// A token bucket's parameters: `burst` requests at once, refilled at `per_second`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestRate {
    /// Requests per second, sustained; 0 switches the limit off.
    pub per_second: u32,
    /// Requests at once (the bucket's size).
    pub burst: u32,
}

impl Default for RequestRate {
    fn default() -> Self {
        Self {
            per_second: 1000,
            burst: 4096,
        }
    }
}

/// Millionths of a request: refills of less than one request per elapsed interval add up.
const MICRO: u64 = 1_000_000;

/// The partition-request budget of one connection (time passed in).
#[derive(Debug)]
struct TokenBucket {
    rate: RequestRate,
    micro_tokens: u64,
    last: Option<Instant>,
}

impl TokenBucket {
    fn new(rate: RequestRate) -> Self {
        Self {
            rate,
            micro_tokens: u64::from(rate.burst) * MICRO,
            last: None,
        }
    }

    /// Takes one request's token; false when the bucket is empty.
    fn take(&mut self, now: Instant) -> bool {
        if self.rate.per_second == 0 {
            return true;
        }
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last);
            // ns × requests/s ÷ 1000 = millionths of a request.
            let refill = elapsed
                .as_nanos()
                .saturating_mul(self.rate.per_second.into())
                / 1000;
            let capacity = u128::from(self.rate.burst) * u128::from(MICRO);
            self.micro_tokens = (u128::from(self.micro_tokens) + refill).min(capacity) as u64;
        }
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
        if self.micro_tokens < MICRO {
            return false;
        }
        self.micro_tokens -= MICRO;
        true
    }
}

/// The producer's side of an authenticated handshake.
#[derive(Debug)]
struct ServerAuth {
    secret: Arc<Secret>,
    nonce: Nonce,
    /// Known once the consumer's handshake arrived.
    transcript: Option<Transcript>,
}

/// One requested subpartition and its credit (Flink's
/// `CreditBasedSequenceNumberingViewReader`).
struct Reader {
    receiver: ReceiverId,
    view: SubpartitionView,
    /// Data buffers the consumer can take now.
    credit: u32,
    /// The credit the partition request brought: the consumer's exclusive buffers.
    initial_credit: u32,
    /// The last backlog the consumer heard of (announced, or in a response's header) was above
    /// 0 and no credit or resume came since: a consumer without exclusive buffers answers it
    /// with credit, so a sender at zero credit need not announce again. Set by every response,
    /// as the consumer takes each header as the truth: a priority event can report less than
    /// the announcement before it, and a sender trusting that announcement waited for ever.
    consumer_heard_backlog: bool,
}

/// A partition request waiting for its partition to be registered.
struct PendingRequest {
    partition: ResultPartitionId,
    subpartition: u32,
    receiver: ReceiverId,
    credit: u32,
    deadline: Instant,
    /// Looked for before (a retry): its wait was logged then.
    retried: bool,
    /// Task events its consumer sent while it waited, which no producer heard yet (none
    /// listens before its partition is set up): delivered, in order, once it is found.
    task_events: Vec<Event>,
    /// What `task_events` count against [`HELD_TASK_EVENT_BYTES`].
    task_event_bytes: usize,
}

/// Most bytes of task events a connection holds for requests waiting for their partition;
/// one more fails its channel (the consumer's task events are not dropped unseen).
const HELD_TASK_EVENT_BYTES: usize = 1 << 20;

/// What a held event counts against [`HELD_TASK_EVENT_BYTES`]: the memory it takes, its
/// payload and its place in the list (an empty event is not free).
fn held_cost(event: &Event) -> usize {
    event.encoded_len() + std::mem::size_of::<Event>()
}

/// The producer side of one connection (Flink's `PartitionRequestServerHandler` and
/// `PartitionRequestQueue`), IO-free.
pub struct ServerConnection {
    config: ServerConfig,
    manager: Arc<PartitionManager>,
    readers: Vec<Option<Reader>>,
    by_receiver: HashMap<ReceiverId, u32>,
    /// Readers that may be able to send, fed by their views' listeners from any thread.
    ready: ReadyReaders,
    /// Requests waiting for their partition, by receiver: a peer may keep `max_channels` of
    /// them and cancel at will, so a cancel is a lookup, not a scan.
    pending: HashMap<ReceiverId, PendingRequest>,
    /// Bytes of the task events the pending requests hold.
    held_task_event_bytes: usize,
    next_retry: Option<Instant>,
    reader: FrameReader,
    outbound: Outbound,
    /// Bytes went out: our handshake, queued first, left (in part at least).
    began_writing: bool,
    /// The connection failed while the write holding our handshake, its first bytes, was in
    /// flight, with this ErrorResponse: if that write sends nothing, the handshake goes again
    /// ahead of it (alone it would read as a refusal before any handshake).
    error_behind_handshake: Option<Message>,
    handshake_received: bool,
    /// When the consumer's handshake (and proof) must be complete; started at the first poll.
    handshake_deadline: HandshakeDeadline,
    auth: Option<ServerAuth>,
    /// Requests are served: no authentication, or the consumer proved the secret.
    authenticated: bool,
    requests: TokenBucket,
    closing: bool,
}

impl fmt::Debug for ServerConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConnection")
            .field("readers", &self.by_receiver.len())
            .field("pending", &self.pending.len())
            .field("closing", &self.closing)
            .finish()
    }
}

impl ServerConnection {
    /// A connection serving partitions of `manager`. With a secret in `config`, its nonce
    /// comes from the OS's random source; if that fails, the connection is refused at once.
    pub fn new(config: ServerConfig, manager: Arc<PartitionManager>) -> Self {
        let nonce = match &config.secret {
            Some(secret) => secret.fresh_nonce().map_err(|error| error.to_string()),
            None => Ok([0; 32]),
        };
        match nonce {
            Ok(nonce) => Self::with_nonce(config, manager, nonce),
            Err(reason) => {
                let mut connection = Self::with_nonce(config, manager, [0; 32]);
                // A guessable nonce would let a recorded proof be replayed: refuse.
                connection.fail(&ProtocolError::Unauthenticated(format!(
                    "no random nonce for the handshake: {reason}"
                )));
                connection
            }
        }
    }

    /// A connection whose handshake nonce is `nonce` (fresh random bytes when `config` has a
    /// secret; a fixed one only in tests).
    pub fn with_nonce(config: ServerConfig, manager: Arc<PartitionManager>, nonce: Nonce) -> Self {
        let auth = config.secret.clone().map(|secret| ServerAuth {
            secret,
            nonce,
            transcript: None,
        });
        let mut outbound = Outbound::default();
        encode(&mut outbound, &handshake(&config, auth.as_ref()));
        Self {
            ready: ReadyReaders { queue: None },
            reader: FrameReader::new(config.segment_size, config.max_frame_size),
            readers: Vec::new(),
            by_receiver: HashMap::new(),
            pending: HashMap::new(),
            held_task_event_bytes: 0,
            next_retry: None,
            outbound,
            began_writing: false,
            error_behind_handshake: None,
            handshake_received: false,
            handshake_deadline: HandshakeDeadline::new(config.handshake_timeout),
            authenticated: auth.is_none(),
            auth,
            requests: TokenBucket::new(config.request_rate),
            closing: false,
            config,
            manager,
        }
    }

    /// True once requests are served: no authentication, or the consumer proved the secret.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    /// Where the next bytes read from the socket go.
    pub fn read_buffer(&mut self) -> &mut [u8] {
        self.reader.destination()
    }

    /// `n` bytes were read into [`read_buffer`](Self::read_buffer). An error closes the
    /// connection: an ErrorResponse is queued (write it, then close) and every view released.
    pub fn on_read(&mut self, n: usize, now: Instant) -> Result<(), ProtocolError> {
        if self.closing {
            // Closed, failed, or refused at creation (no nonce could be drawn): what still
            // arrives is dropped unread, so nothing is served or answered any more.
            return Ok(());
        }
        let result = match self.reader.advance(n) {
            Ok(Step::Incomplete) => Ok(()),
            Ok(Step::Header(frame)) => {
                self.admit(frame.id)
                    .and_then(|()| match self.reader.read_body(frame) {
                        Some(Step::Body(frame)) => self.on_message(frame, now),
                        _ => Ok(()),
                    })
            }
            Ok(Step::Body(frame)) => self.on_message(frame, now),
            Err(error) => Err(error),
        };
        let result = result.and_then(|()| {
            // Data frames stop at `max_queued_bytes` (the last one may pass it by a segment's
            // frame); what lies beyond is control messages the consumer does not read.
            let bytes = self.outbound.queued_bytes();
            let limit = self
                .config
                .max_queued_bytes
                .saturating_add(self.config.segment_size + super::frame::BUFFER_RESPONSE_HEADER)
                .saturating_add(super::MAX_QUEUED_CONTROL);
            if bytes > limit {
                return Err(ProtocolError::ControlBacklog { bytes });
            }
            Ok(())
        });
        if let Err(error) = &result {
            self.fail(error);
        }
        result
    }

    /// Moves what can be sent into the outbound queue: for each ready reader in turn one
    /// buffer if it has credit, or an event regardless of credit; priority events first.
    pub fn poll_transmit(&mut self, now: Instant) {
        self.check_handshake_deadline(now);
        self.handle_timeout(now);
        // Each reader is queued at most once; a reader that sent goes back to the tail.
        let mut budget = self.readers.len() * 2 + 1;
        while budget > 0 && self.outbound.queued_bytes() < self.config.max_queued_bytes {
            budget -= 1;
            let Some(slot) = self.ready.pop() else {
                break;
            };
            self.send_one(slot);
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) (or the handshake deadline) is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        // Not once closing: the deadline has done its work, and an expired one would make the
        // driver poll without waiting until the socket is gone.
        let handshake = self
            .handshake_deadline
            .due()
            .filter(|_| !self.closing && !self.is_established());
        self.next_retry.into_iter().chain(handshake).min()
    }

    /// True once the consumer's handshake arrived and, with a secret, its proof held.
    fn is_established(&self) -> bool {
        self.handshake_received && self.authenticated
    }

    /// Closes a connection whose consumer stays silent or never proves the secret.
    fn check_handshake_deadline(&mut self, now: Instant) {
        if self.closing || self.is_established() {
            return;
        }
        if let Some(error) =
            self.handshake_deadline
                .expired(now, self.handshake_received, "the consumer")
        {
            // `fail` logs it.
            self.fail(&error);
        }
    }

    /// Retries partition requests waiting for their partition; answers PartitionNotFound
    /// to those past their deadline.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.next_retry.is_none_or(|due| now < due) {
            return;
        }
        let waiting = std::mem::take(&mut self.pending);
        // Counted again for those that go on waiting.
        self.held_task_event_bytes = 0;
        for request in waiting.into_values() {
            self.request(request, now);
        }
        self.next_retry =
            (!self.pending.is_empty()).then(|| now + self.config.partition_request_retry);
    }

    /// The ranges to write next (at most `max`), in order.
    pub fn write_slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        self.outbound.slices(out, max);
    }

    /// `n` bytes of the ranges were written; written segments go back to their pools.
    pub fn on_written(&mut self, n: usize) {
        self.outbound.on_written(n);
        if n > 0 {
            self.began_writing = true;
            self.error_behind_handshake = None;
        } else if let Some(error) = self.error_behind_handshake.take() {
            // Our handshake never left, and the stream is at its start: the handshake, then
            // the error (alone it would read as a refusal before any handshake, a connection
            // limit's).
            self.outbound.clear();
            encode(
                &mut self.outbound,
                &handshake(&self.config, self.auth.as_ref()),
            );
            encode(&mut self.outbound, &error);
        }
    }

    /// An asynchronous write of the current [`write_slices`](Self::write_slices) was
    /// submitted: the segments they point into stay alive until the next
    /// [`on_written`](Self::on_written), even if the connection fails meanwhile. Control bytes
    /// may move; copy them before submitting.
    pub(crate) fn begin_write(&mut self) {
        self.outbound.begin_write();
    }

    /// The outbound queue, for a driver's zero-copy sends (segments held until notified).
    pub(crate) fn outbound_mut(&mut self) -> &mut Outbound {
        &mut self.outbound
    }

    /// True when bytes wait to be written.
    pub fn wants_write(&self) -> bool {
        !self.outbound.is_empty()
    }

    /// True when a reader may be able to send ([`poll_transmit`](Self::poll_transmit)) and
    /// the outbound queue has room for it; a full queue waits for the socket, not a busy loop.
    pub fn has_pending(&self) -> bool {
        !self.ready.is_empty() && self.outbound.queued_bytes() < self.config.max_queued_bytes
    }

    /// True once the peer sent CloseRequest or an error closed the connection: write what is
    /// queued, then close the socket.
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// Registers the waker of the I/O thread driving this connection: woken when a view has
    /// data.
    pub fn set_waker(&self, waker: &Waker) -> bool {
        self.ready.register_waker(waker)
    }

    /// A summary of every reader, for diagnosing stalls.
    pub fn debug_summary(&self) -> String {
        let mut out = format!(
            "server: {} readers, ready queue empty {}, outbound {} bytes\n",
            self.by_receiver.len(),
            self.ready.is_empty(),
            self.outbound.queued_bytes()
        );
        for reader in self.readers.iter().flatten() {
            out.push_str(&format!(
                "  receiver {:?} credit {} heard-backlog {} view [{}]\n",
                reader.receiver,
                reader.credit,
                reader.consumer_heard_backlog,
                reader.view.debug_summary()
            ));
        }
        out
    }

    /// Readers (requested subpartitions) on this connection.
    pub fn reader_count(&self) -> usize {
        self.by_receiver.len()
    }

    /// Credit the consumer granted `receiver`, if it has a reader here.
    pub fn credit_of(&self, receiver: ReceiverId) -> Option<u32> {
        let slot = *self.by_receiver.get(&receiver)?;
        self.readers[slot as usize].as_ref().map(|r| r.credit)
    }

    /// The connection broke: every view is released (its segments go back to the pool).
    pub fn on_connection_lost(&mut self) {
        self.release_all();
        self.outbound.clear();
        self.closing = true;
    }

    /// Refuses a frame by its header, before its body is read into memory: one no consumer
    /// sends, anything but a handshake first, and a task event (whose body may be a segment
    /// long) before the consumer proved the secret. A peer that never gets that far holds no
    /// more than a control frame's bytes.
    fn admit(&self, id: MessageId) -> Result<(), ProtocolError> {
        if !id.sent_by_consumer() {
            return Err(ProtocolError::UnexpectedMessage(id));
        }
        if !self.handshake_received && id != MessageId::Handshake {
            return Err(ProtocolError::Handshake(format!(
                "expected a handshake, got {id:?}"
            )));
        }
        if !self.authenticated && id == MessageId::TaskEventRequest {
            return Err(ProtocolError::Unauthenticated(format!(
                "{id:?} before the consumer proved it knows the secret"
            )));
        }
        Ok(())
    }

    fn on_message(&mut self, frame: FrameHeader, now: Instant) -> Result<(), ProtocolError> {
        let message = Message::decode(&frame, &self.reader.body)?;
        if !self.handshake_received {
            let Message::Handshake {
                version,
                node,
                authenticate,
                nonce,
            } = message
            else {
                return Err(ProtocolError::Handshake(format!(
                    "expected a handshake, got {:?}",
                    frame.id
                )));
            };
            if version != VERSION {
                return Err(ProtocolError::Handshake(format!(
                    "peer speaks version {version}, we speak {VERSION}"
                )));
            }
            self.handshake_received = true;
            return self.on_consumer_handshake(node, authenticate, nonce);
        }
        if !self.authenticated {
            return self.before_authentication(message, frame.id);
        }
        match message {
            Message::PartitionRequest {
                partition,
                subpartition,
                receiver,
                credit,
            } => {
                if !self.requests.take(now) {
                    return Err(ProtocolError::RequestRateExceeded {
                        per_second: self.config.request_rate.per_second,
                        burst: self.config.request_rate.burst,
                    });
                }
                if self.by_receiver.contains_key(&receiver) || self.pending.contains_key(&receiver)
                {
                    return Err(ProtocolError::DuplicateReceiver(receiver));
                }
                if self.by_receiver.len() + self.pending.len() >= self.config.max_channels {
                    return Err(ProtocolError::TooManyChannels {
                        limit: self.config.max_channels,
                    });
                }
                // The same bound as AddCredit's: a starting credit beyond it is no consumer's.
                if credit > MAX_CREDIT {
                    return Err(ProtocolError::CreditOverflow(receiver));
                }
                let request = PendingRequest {
                    partition,
                    subpartition,
                    receiver,
                    credit,
                    deadline: now + self.config.partition_request_timeout,
                    retried: false,
                    task_events: Vec::new(),
                    task_event_bytes: 0,
                };
                self.request(request, now);
            }
            Message::AddCredit { receiver, credit } => {
                if let Some(&slot) = self.by_receiver.get(&receiver) {
                    let reader = self.readers[slot as usize].as_mut().expect("mapped");
                    reader.credit = reader
                        .credit
                        .checked_add(credit)
                        .filter(|c| *c <= MAX_CREDIT)
                        .ok_or(ProtocolError::CreditOverflow(receiver))?;
                    reader.consumer_heard_backlog = false;
                    self.ready.enqueue(slot);
                }
            }
            Message::AckAllUserRecordsProcessed { receiver } => {
                if let Some(&slot) = self.by_receiver.get(&receiver) {
                    let reader = self.readers[slot as usize].as_ref().expect("mapped");
                    reader.view.acknowledge_all_data_processed();
                }
            }
            Message::ResumeConsumption { receiver } => {
                if let Some(&slot) = self.by_receiver.get(&receiver) {
                    let reader = self.readers[slot as usize].as_mut().expect("mapped");
                    if reader.initial_credit == 0 && reader.view.is_blocked() {
                        // A consumer without exclusive buffers gave its floating ones back
                        // when this reader blocked: the credit they stood for is gone
                        // (Flink's `CreditBasedSequenceNumberingViewReader::resumeConsumption`).
                        // A resume of a reader that never blocked changes nothing: that
                        // consumer still holds its segments.
                        reader.credit = 0;
                        reader.consumer_heard_backlog = false;
                    }
                    reader.view.resume_consumption();
                    self.ready.enqueue(slot);
                }
            }
            Message::TaskEventRequest {
                partition,
                receiver,
                event,
            } => {
                let event = Event::decode(&event).map_err(|_| {
                    ProtocolError::Decode(super::DecodeError::InvalidField {
                        field: "task event",
                        value: event.len() as u64,
                    })
                })?;
                // Behind events held for the same request, in order: those go first if their
                // producer listens by now.
                let behind_held = !self.deliver_held_task_events(receiver);
                if behind_held || !self.manager.publish_task_event(partition, &event) {
                    self.hold_task_event(partition, receiver, event);
                }
            }
            // An error for one receiver ends it as a cancellation does: a request still
            // waiting for its partition goes too, or it would take the subpartition's view
            // once the partition registers.
            Message::CancelPartitionRequest { receiver }
            | Message::ErrorResponse {
                receiver: Some(receiver),
                ..
            } => {
                if let Some(request) = self.withdraw_pending(receiver) {
                    // Sent before the cancel: delivered if their producer listens by now.
                    self.publish_held(request);
                }
                self.remove_reader(receiver);
            }
            Message::CloseRequest => {
                self.release_all();
                self.closing = true;
            }
            Message::ErrorResponse {
                receiver: None,
                kind,
                message,
            } => return Err(ProtocolError::Remote { kind, message }),
            Message::Handshake { .. }
            | Message::AuthProof { .. }
            | Message::BufferResponse(_)
            | Message::BacklogAnnouncement { .. } => {
                return Err(ProtocolError::UnexpectedMessage(frame.id))
            }
        }
        Ok(())
    }

    /// With a secret, the consumer must authenticate too; our proof goes out at once.
    fn on_consumer_handshake(
        &mut self,
        consumer: u128,
        authenticate: bool,
        nonce: Nonce,
    ) -> Result<(), ProtocolError> {
        let Some(auth) = &mut self.auth else {
            // Authentication is off here. A consumer that requires it refuses us when it
            // reads our handshake, and says so.
            return Ok(());
        };
        if !authenticate {
            return Err(ProtocolError::Unauthenticated(
                "the consumer did not authenticate (no secret configured on its side?)".into(),
            ));
        }
        if auth.secret.drew(&nonce) {
            // Our proof would prove this environment to itself: see `auth`'s documentation.
            return Err(ProtocolError::Unauthenticated(
                "the consumer's nonce was drawn in this environment: its own consumer's \
                 handshake, passed back to it (a remote channel to its own environment, or a \
                 man in the middle)"
                    .into(),
            ));
        }
        let transcript = Transcript {
            client_nonce: nonce,
            server_nonce: auth.nonce,
            client_node: consumer,
            server_node: self.config.node,
        };
        auth.transcript = Some(transcript);
        let proof = transcript.server_proof(&auth.secret);
        encode(&mut self.outbound, &Message::AuthProof { proof });
        Ok(())
    }

    /// Until the consumer proved it knows the secret only its proof, a close or an error is
    /// accepted; anything else (a request without a proof) closes the connection.
    fn before_authentication(
        &mut self,
        message: Message,
        id: MessageId,
    ) -> Result<(), ProtocolError> {
        match message {
            Message::AuthProof { proof } => self.on_consumer_proof(&proof),
            Message::CloseRequest => {
                self.closing = true;
                Ok(())
            }
            Message::ErrorResponse {
                receiver: None,
                kind: ErrorKind::Unauthenticated,
                message,
            } => Err(ProtocolError::Unauthenticated(format!(
                "the consumer refused our proof: {message}"
            ))),
            Message::ErrorResponse {
                receiver: None,
                kind,
                message,
            } => Err(ProtocolError::Remote { kind, message }),
            _ => Err(ProtocolError::Unauthenticated(format!(
                "{id:?} before the consumer proved it knows the secret"
            ))),
        }
    }

    fn on_consumer_proof(&mut self, proof: &Proof) -> Result<(), ProtocolError> {
        let Some(ServerAuth {
            secret,
            transcript: Some(transcript),
            ..
        }) = &self.auth
        else {
            return Err(ProtocolError::UnexpectedMessage(MessageId::AuthProof));
        };
        if !transcript.verify_client(secret, proof) {
            return Err(ProtocolError::Unauthenticated(
                "the consumer's proof is wrong: its secret differs from ours".into(),
            ));
        }
        self.authenticated = true;
        tracing::debug!(consumer = transcript.client_node, "consumer authenticated");
        Ok(())
    }

    /// Creates the view for a request, or keeps the request waiting until its deadline.
    fn request(&mut self, mut request: PendingRequest, now: Instant) {
        // The partition first: a request waiting for it costs each retry a lookup, not a
        // slot search and a listener (a peer may keep `max_channels` of them waiting).
        // A released partition's failure cause is read from the handle found here: looked up
        // again, it may be gone (the manager forgets released partitions) or another.
        let mut failure_cause = None;
        let view = self
            .manager
            .partition(request.partition)
            .and_then(|partition| {
                failure_cause = partition.failure_cause().map(str::to_owned);
                // Within `max_channels`: checked (readers and pending together) when it arrived.
                let slot = match self.readers.iter().position(Option::is_none) {
                    Some(slot) => slot,
                    None => {
                        self.readers.push(None);
                        self.readers.len() - 1
                    }
                } as u32;
                let listener = self.ready.listener(slot, self.config.max_channels);
                partition
                    .create_view(request.subpartition as usize, listener)
                    .map(|view| (slot, view))
            });
        match view {
            Ok((slot, mut view)) => {
                if request.credit == 0 {
                    // No exclusive buffers: every credit is a floating buffer lent for the
                    // backlog, and a buffer that ends empty must spend it (Flink's
                    // `receiverExclusiveBuffersPerChannel == 0`).
                    view.send_empty_buffers();
                }
                tracing::debug!(
                    receiver = ?request.receiver,
                    partition = ?request.partition,
                    subpartition = request.subpartition,
                    credit = request.credit,
                    "partition request served"
                );
                self.readers[slot as usize] = Some(Reader {
                    receiver: request.receiver,
                    view,
                    credit: request.credit,
                    initial_credit: request.credit,
                    consumer_heard_backlog: false,
                });
                self.by_receiver.insert(request.receiver, slot);
                // Data may already be queued.
                self.ready.enqueue(slot);
                // Its partition is set up now, and with it whatever listens to its events.
                self.publish_held(request);
            }
            Err(PartitionError::PartitionNotFound(_)) if now < request.deadline => {
                if !request.retried {
                    tracing::debug!(
                        partition = ?request.partition,
                        "partition request waits for its partition to be registered"
                    );
                }
                request.retried = true;
                let due = now + self.config.partition_request_retry;
                self.next_retry = Some(self.next_retry.map_or(due, |d| d.min(due)));
                self.held_task_event_bytes += request.task_event_bytes;
                self.pending.insert(request.receiver, request);
            }
            Err(PartitionError::PartitionNotFound(_)) => {
                tracing::warn!(
                    partition = ?request.partition,
                    "partition not found within the partition-request timeout"
                );
                self.error_for(
                    request.receiver,
                    ErrorKind::PartitionNotFound,
                    "partition not found",
                );
                self.publish_held(request);
            }
            Err(PartitionError::Released) => {
                // Released before the request came: its producer's cause, if it gave one.
                let cause = failure_cause.unwrap_or_else(|| PartitionError::Released.to_string());
                self.error_for(request.receiver, ErrorKind::ProducerFailed, &cause);
                self.publish_held(request);
            }
            Err(other) => {
                // The request's own fault (no such subpartition, a view taken already): not
                // the producer failing.
                self.error_for(request.receiver, ErrorKind::Other, &other.to_string());
                self.publish_held(request);
            }
        }
    }

    /// Sends at most one item of the reader in `slot`.
    fn send_one(&mut self, slot: u32) {
        let Some(Some(reader)) = self.readers.get_mut(slot as usize) else {
            return;
        };
        let (available, backlog) = reader.view.availability_and_backlog(reader.credit > 0);
        if !available {
            if reader.view.is_released() {
                let receiver = reader.receiver;
                let cause = reader
                    .view
                    .failure_cause()
                    .unwrap_or("the partition was released")
                    .to_owned();
                self.error_for(receiver, ErrorKind::ProducerFailed, &cause);
                self.remove_reader(receiver);
            } else if reader.credit == 0 {
                // Flink's `needAnnounceBacklog`: only a consumer without exclusive buffers
                // (initial credit 0) is told. One with exclusive buffers learns the backlog
                // from every BufferResponse and gets its exclusive credit back as it reads, so
                // an announcement would only cost it a packet and a wake-up per credit stall.
                // An announced backlog is answered by AddCredit, which requeues the reader.
                if reader.initial_credit == 0 && !reader.consumer_heard_backlog {
                    if backlog > 0 {
                        // No credit to send with: tell the consumer so it can find floating
                        // buffers.
                        reader.consumer_heard_backlog = true;
                        let message = Message::BacklogAnnouncement {
                            receiver: reader.receiver,
                            backlog: backlog as u32,
                        };
                        encode(&mut self.outbound, &message);
                    } else if !reader.view.is_blocked() && reader.view.wait_for_data() {
                        // Nothing to announce yet, and no credit will come for it: the next
                        // readable buffer must wake this reader to announce it (Flink's
                        // subpartition notifies on every first buffer; ours only a reader
                        // that waits). Data came in between: look again. (A blocked reader
                        // waits for ResumeConsumption, which requeues it.)
                        self.ready.enqueue(slot);
                    }
                }
            } else if reader.view.wait_for_data() {
                // Woken for nothing new (a flush of nothing): wait again, unless data came
                // in between.
                self.ready.enqueue(slot);
            }
            return;
        }
        let Some(item) = reader.view.poll_next() else {
            return;
        };
        let data_type = item.buffer.data_type();
        if data_type.is_buffer() {
            let Some(credit) = reader.credit.checked_sub(1) else {
                // The view handed out data it did not announce (a bug): sent, the consumer
                // would find no segment for it and fail every channel on the connection.
                tracing::error!(
                    receiver = ?reader.receiver,
                    "a data buffer without credit; dropping its reader"
                );
                let receiver = reader.receiver;
                self.error_for(
                    receiver,
                    ErrorKind::ProducerFailed,
                    "the producer's reader handed out data without credit",
                );
                self.remove_reader(receiver);
                return;
            };
            reader.credit = credit;
        }
        let header = BufferResponseHeader {
            receiver: reader.receiver,
            sequence_number: item.sequence_number,
            backlog: item.backlog as u32,
            data_type,
            compressed: item.buffer.is_compressed(),
            size: item.buffer.len() as u32,
            overtaken: item.overtaken as u32,
        };
        let more = item.next_data_type.is_event()
            || (reader.credit > 0 && item.next_data_type != crate::buffer::DataType::None);
        let next_priority = item.next_data_type.has_priority();
        reader.consumer_heard_backlog = item.backlog > 0;
        let mut buffer = item.buffer;
        match buffer.headroom_mut() {
            Some(room) => {
                // The header goes right before the payload: one contiguous range.
                let at: &mut [u8; BUFFER_RESPONSE_HEADER] = (&mut room
                    [HEADROOM - BUFFER_RESPONSE_HEADER..])
                    .try_into()
                    .expect("the header fits the headroom");
                encode_buffer_response(at, &header, data_type.has_priority());
                self.outbound.push_buffer(0, buffer, BUFFER_RESPONSE_HEADER);
            }
            None => {
                let mut bytes = [0u8; BUFFER_RESPONSE_HEADER];
                encode_buffer_response(&mut bytes, &header, data_type.has_priority());
                self.outbound.control_bytes().extend_from_slice(&bytes);
                self.outbound.push_buffer(BUFFER_RESPONSE_HEADER, buffer, 0);
            }
        }
        if next_priority {
            self.ready.enqueue_priority(slot);
        } else if more {
            self.ready.enqueue(slot);
        }
    }

    /// A task event no producer heard: one for a request still waiting for its partition is
    /// kept for it (its producer listens once its partition is set up, as Flink registers
    /// the partition's event handler with it); any other goes nowhere, as no producer listens.
    fn hold_task_event(
        &mut self,
        partition: ResultPartitionId,
        receiver: ReceiverId,
        event: Event,
    ) {
        let size = held_cost(&event);
        let Some(request) = self
            .pending
            .get_mut(&receiver)
            .filter(|request| request.partition == partition)
        else {
            tracing::debug!(?partition, "a task event no producer listens to; dropped");
            return;
        };
        if self.held_task_event_bytes + size > HELD_TASK_EVENT_BYTES {
            if let Some(request) = self.withdraw_pending(receiver) {
                self.publish_held(request);
            }
            self.error_for(
                receiver,
                ErrorKind::LimitExceeded,
                "too many task events wait for the partition",
            );
            return;
        }
        self.held_task_event_bytes += size;
        request.task_event_bytes += size;
        request.task_events.push(event);
    }

    /// Delivers the task events held for `receiver`'s waiting request if their producer
    /// listens by now (its first event is heard: so are the rest, in order). True when none
    /// are held any more.
    fn deliver_held_task_events(&mut self, receiver: ReceiverId) -> bool {
        let Some(request) = self.pending.get_mut(&receiver) else {
            return true;
        };
        let Some(first) = request.task_events.first() else {
            return true;
        };
        if !self.manager.publish_task_event(request.partition, first) {
            return false;
        }
        for event in request.task_events.drain(1..) {
            self.manager.publish_task_event(request.partition, &event);
        }
        request.task_events = Vec::new();
        self.held_task_event_bytes -= std::mem::take(&mut request.task_event_bytes);
        true
    }

    /// Publishes what a request leaving `pending` held, in order; events no producer hears
    /// are dropped, as any event without a listener is.
    fn publish_held(&self, request: PendingRequest) {
        for event in &request.task_events {
            if !self.manager.publish_task_event(request.partition, event) {
                tracing::debug!(
                    partition = ?request.partition,
                    "a held task event no producer listens to; dropped"
                );
            }
        }
    }

    /// Takes a waiting request out of `pending`, its held task events with it.
    fn withdraw_pending(&mut self, receiver: ReceiverId) -> Option<PendingRequest> {
        let request = self.pending.remove(&receiver)?;
        self.held_task_event_bytes -= request.task_event_bytes;
        Some(request)
    }

    fn error_for(&mut self, receiver: ReceiverId, kind: ErrorKind, message: &str) {
        let message = Message::ErrorResponse {
            receiver: Some(receiver),
            kind,
            message: message.to_owned(),
        };
        encode(&mut self.outbound, &message);
    }

    fn remove_reader(&mut self, receiver: ReceiverId) {
        if let Some(slot) = self.by_receiver.remove(&receiver) {
            // Dropping the view releases the subpartition and its segments.
            self.readers[slot as usize] = None;
        }
    }

    fn release_all(&mut self) {
        self.by_receiver.clear();
        self.readers.clear();
        for (_, request) in std::mem::take(&mut self.pending) {
            self.publish_held(request);
        }
        self.held_task_event_bytes = 0;
        self.next_retry = None;
    }

    fn fail(&mut self, error: &ProtocolError) {
        let kind = match error {
            // The peer's own error: ours is that it broke the connection.
            ProtocolError::Remote { .. } => ErrorKind::Protocol,
            other => other.error_kind(),
        };
        match error.error_kind() {
            ErrorKind::Unauthenticated => {
                tracing::warn!(%error, "refusing a connection: authentication failed")
            }
            ErrorKind::LimitExceeded => {
                tracing::warn!(%error, "closing a connection that went past a limit")
            }
            _ => tracing::warn!(%error, "closing a connection after a protocol error"),
        }
        let write_in_flight = self.outbound.write_in_flight();
        self.release_all();
        self.outbound.clear_keeping_partial();
        let message = Message::ErrorResponse {
            receiver: None,
            kind,
            message: error.to_string(),
        };
        if !self.began_writing {
            if write_in_flight {
                // The write in flight holds our handshake: see `on_written`.
                self.error_behind_handshake = Some(message.clone());
            } else {
                // Nothing went out yet, our handshake neither: it goes first still, or the
                // consumer would take the error for a refusal before any handshake (a
                // connection limit's, whose channels it places again instead of failing
                // them).
                encode(
                    &mut self.outbound,
                    &handshake(&self.config, self.auth.as_ref()),
                );
            }
        }
        encode(&mut self.outbound, &message);
        self.closing = true;
    }
}

/// The producer's handshake: its node, and its nonce when it authenticates.
fn handshake(config: &ServerConfig, auth: Option<&ServerAuth>) -> Message {
    Message::Handshake {
        version: VERSION,
        node: config.node,
        authenticate: auth.is_some(),
        nonce: auth.map_or([0; 32], |auth| auth.nonce),
    }
}

/// Most credit a reader may accumulate; more is a broken or hostile consumer.
const MAX_CREDIT: u32 = 1 << 20;

impl Drop for ServerConnection {
    fn drop(&mut self) {
        self.release_all();
    }
}

// A BufferResponse header must fit the headroom every segment reserves for it.
const _: () = assert!(BUFFER_RESPONSE_HEADER <= HEADROOM);

/// The ready-reader queue of one connection, made with its first reader. It has a slot for
/// each of `max_channels` readers (about 34 bytes each), which a connection that never asks
/// for a partition (a silent or unauthenticated peer) should not hold: at the defaults,
/// 1024 such connections would pin 140 MB.
struct ReadyReaders {
    queue: Option<ChannelQueueHandle>,
}

impl ReadyReaders {
    /// The listener a new reader's view queues `slot` through; makes the queue, with room
    /// for `capacity` readers.
    fn listener(
        &mut self,
        slot: u32,
        capacity: usize,
    ) -> Arc<dyn crate::partition::AvailabilityListener> {
        self.queue
            .get_or_insert_with(|| ChannelQueueHandle::new(capacity))
            .notifier(slot)
    }

    /// Queues `slot`, a reader's: the queue was made with the first reader.
    fn enqueue(&self, slot: u32) {
        self.made().enqueue(slot);
    }

    /// Queues `slot` (a reader's) ahead of data.
    fn enqueue_priority(&self, slot: u32) {
        self.made().enqueue_priority(slot);
    }

    fn made(&self) -> &ChannelQueueHandle {
        self.queue
            .as_ref()
            .expect("readers exist only after the queue was made")
    }

    fn pop(&self) -> Option<u32> {
        self.queue.as_ref()?.pop()
    }

    fn is_empty(&self) -> bool {
        self.queue.as_ref().is_none_or(ChannelQueueHandle::is_empty)
    }

    /// See [`ChannelQueueHandle::register_waker`]; with no queue yet nothing can be queued
    /// before this thread makes it (on its own turn, awake).
    fn register_waker(&self, waker: &Waker) -> bool {
        self.queue
            .as_ref()
            .is_some_and(|queue| queue.register_waker(waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::ResultPartitionId;
    use crate::protocol::frame::{decode_header, FRAME_HEADER};
    use crate::protocol::ReceiverId;

    /// A server of one channel at most, and the consumer's handshake with two requests: the
    /// second crosses the limit.
    fn server_and_two_requests() -> (ServerConnection, Vec<u8>) {
        let server = ServerConnection::new(
            ServerConfig {
                max_channels: 1,
                ..ServerConfig::default()
            },
            Arc::new(PartitionManager::new()),
        );
        let mut bytes = Vec::new();
        Message::Handshake {
            version: VERSION,
            node: 9,
            authenticate: false,
            nonce: [0; 32],
        }
        .encode(&mut bytes);
        for receiver in [5, 6] {
            Message::PartitionRequest {
                partition: ResultPartitionId {
                    partition: 0,
                    producer: 1,
                },
                subpartition: 0,
                receiver: ReceiverId(receiver),
                credit: 2,
            }
            .encode(&mut bytes);
        }
        (server, bytes)
    }

    /// Feeds `bytes` to `server`; returns the result of the read that failed, if one did.
    fn feed(server: &mut ServerConnection, bytes: &[u8]) -> Result<(), ProtocolError> {
        let mut at = 0;
        while at < bytes.len() {
            let buffer = server.read_buffer();
            let n = buffer.len().min(bytes.len() - at);
            buffer[..n].copy_from_slice(&bytes[at..at + n]);
            server.on_read(n, Instant::now())?;
            at += n;
        }
        Ok(())
    }

    /// The ids of the frames queued to go out, in order.
    fn queued_ids(server: &ServerConnection) -> Vec<u8> {
        let mut slices = Vec::new();
        server.write_slices(&mut slices, 64);
        let bytes: Vec<u8> = slices.iter().flat_map(|s| s.iter().copied()).collect();
        let mut ids = Vec::new();
        let mut at = 0;
        while at + FRAME_HEADER <= bytes.len() {
            let header: &[u8; FRAME_HEADER] = bytes[at..at + FRAME_HEADER].try_into().unwrap();
            let frame = decode_header(header, 1 << 20).unwrap();
            ids.push(frame.id as u8);
            at += frame.length as usize;
        }
        ids
    }

    /// A write the kernel refused (io_uring: submitted, then nothing written) sent nothing:
    /// a failure after it still puts the handshake ahead of the ErrorResponse.
    #[test]
    fn a_refused_write_leaves_the_handshake_to_go_first() {
        let (mut server, bytes) = server_and_two_requests();
        server.begin_write();
        server.on_written(0);
        assert!(feed(&mut server, &bytes).is_err());
        assert_eq!(
            queued_ids(&server),
            [MessageId::Handshake as u8, MessageId::ErrorResponse as u8]
        );
    }

    /// A failure while the write holding the handshake is in flight: if that write sends
    /// nothing, the handshake goes again ahead of the ErrorResponse (alone it would read as a
    /// refusal before any handshake); if it sent the handshake, the ErrorResponse follows.
    #[test]
    fn an_error_behind_a_handshake_in_flight_goes_only_after_it() {
        for sent in [false, true] {
            let (mut server, bytes) = server_and_two_requests();
            let handshake_len = {
                let mut slices = Vec::new();
                server.write_slices(&mut slices, 64);
                slices.iter().map(|s| s.len()).sum::<usize>()
            };
            server.begin_write();
            assert!(feed(&mut server, &bytes).is_err());
            server.on_written(if sent { handshake_len } else { 0 });
            let expected: &[u8] = if sent {
                &[MessageId::ErrorResponse as u8]
            } else {
                &[MessageId::Handshake as u8, MessageId::ErrorResponse as u8]
            };
            assert_eq!(queued_ids(&server), expected, "handshake sent: {sent}");
        }
    }
}
