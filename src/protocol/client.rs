//! The consumer side of a connection.

use std::fmt;
use std::io::IoSlice;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use super::auth::{Nonce, Proof, Secret, Transcript};
use super::frame::{
    decode_buffer_response, BufferResponseHeader, DecodeError, ErrorKind, FrameHeader, Message,
    MessageId, ReceiverId, BUFFER_RESPONSE_BODY, VERSION,
};
use super::inbound::{FrameReader, Step};
use super::outbound::Outbound;
use super::{HandshakeDeadline, ProtocolError};
use crate::buffer::BufferBuilder;
use crate::gate::{
    Backoff, ChannelQueueHandle, CreditListener, GateError, RemoteChannelShared, UNCREDITED_EVENTS,
};
use crate::partition::{PartitionError, ResultPartitionId};

/// Task events move from their channels into the outbound queue only while it holds fewer
/// bytes than this. A gate may queue 1024 events of up to a segment on each channel; moved all
/// at once they would sit in the queue as if the producer did not read
/// ([`ProtocolError::ControlBacklog`]), and fail the connection for this side's own burst.
const TASK_EVENT_QUEUE_BYTES: usize = 256 << 10;

/// Bytes of discarded payload read per step (payloads for channels already gone).
const DISCARD_CHUNK: usize = 4096;

/// Settings of a consumer-side connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientConfig {
    /// This process's node identity (sent in the handshake).
    pub node: u128,
    /// Most channels this connection carries.
    pub max_channels: usize,
    /// Payload bytes per segment (the largest BufferResponse payload).
    pub segment_size: usize,
    /// Longest frame accepted, header included (`fluxgate.network.max-frame-size`).
    pub max_frame_size: usize,
    /// The cluster secret: with one, the connection authenticates (and requires the producer
    /// to); without, it does not (and fails against a producer that requires it).
    pub secret: Option<Arc<Secret>>,
    /// Longest the producer may take to send its handshake and, with a secret, its proof
    /// (`fluxgate.network.handshake-timeout`); then every channel of the connection fails.
    pub handshake_timeout: Duration,
}

impl ClientConfig {
    /// A connection without authentication and only the per-message frame limits.
    pub fn new(node: u128, max_channels: usize, segment_size: usize) -> Self {
        Self {
            node,
            max_channels,
            segment_size,
            max_frame_size: usize::MAX,
            secret: None,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The consumer's side of an authenticated handshake.
struct ClientAuth {
    secret: Arc<Secret>,
    nonce: Nonce,
    /// Known once the producer's handshake arrived.
    transcript: Option<Transcript>,
}

/// A remote channel registered on this connection.
struct ClientChannel {
    shared: Arc<RemoteChannelShared>,
    partition: ResultPartitionId,
    receiver: ReceiverId,
    /// Delay before re-sending the request after the producer said PartitionNotFound.
    backoff: Backoff,
    retry: Retry,
    /// The delays its connects went through (refused, or refused at the producer's
    /// connection limit): a refusal of this connection goes on from there, so the channel
    /// fails once they are exhausted instead of trying for good.
    connect_backoff: Backoff,
}

/// Where a channel is in re-requesting its partition (Flink's partition-request back-off:
/// the producer's task may simply not have registered it yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retry {
    /// The request stands (or was answered).
    No,
    /// PartitionNotFound arrived; the delay starts at the next `poll_transmit`.
    Due,
    /// Re-send the request at this time.
    At(Instant),
}

/// What the reader is doing.
enum ReadStage {
    /// Frame headers and control bodies.
    Frames,
    /// The fixed header of a BufferResponse.
    BufferHeader {
        frame: FrameHeader,
        bytes: [u8; BUFFER_RESPONSE_BODY],
        have: usize,
    },
    /// A BufferResponse payload, into the reserved segment (or discarded).
    Payload {
        header: BufferResponseHeader,
        slot: usize,
        builder: Option<BufferBuilder>,
        remaining: usize,
    },
}

/// The consumer side of one connection (Flink's `CreditBasedPartitionRequestClientHandler`
/// plus the client's outbound queue), IO-free.
pub struct ClientConnection {
    node: u128,
    channels: Vec<Option<ClientChannel>>,
    /// Channels with something to send (credit, resume, release), fed from any thread.
    ready: ChannelQueueHandle,
    reader: FrameReader,
    stage: ReadStage,
    discard: Box<[u8; DISCARD_CHUNK]>,
    outbound: Outbound,
    handshake_received: bool,
    /// When the producer's handshake (and proof) must have come; started at the first poll.
    handshake_deadline: HandshakeDeadline,
    auth: Option<ClientAuth>,
    /// Requests may be sent: no authentication, or the producer proved itself and our proof
    /// is queued.
    authenticated: bool,
    /// Frames (partition requests, task events) encoded before authentication completed;
    /// they follow our proof.
    deferred: Vec<u8>,
    closed: bool,
    generation: u64,
    /// The back-off each channel starts with.
    request_backoff: Backoff,
    /// Channels waiting to re-send their request.
    retrying: usize,
    /// A channel left since `poll_transmit` last looked whether any is left: the look
    /// scans every slot, so it is made only then, not on every turn.
    channel_left: bool,
    /// The producer's address, named in the channels' error when the socket breaks.
    peer: Option<std::net::SocketAddr>,
    /// The producer refused the connection before its handshake for its `max-connections`:
    /// the channels are kept, to connect again ([`Self::take_unanswered_channels`]).
    refused_at_limit: bool,
    /// A channel kept task events back for a full outbound queue: the channels holding
    /// events are looked at again once writes drain it below [`TASK_EVENT_QUEUE_BYTES`].
    task_events_held: bool,
    /// Bytes queued for the producer beyond which it is taken not to read: the control
    /// limit, plus what this side's own task events may take (their share and one more).
    max_queued_bytes: usize,
}

impl fmt::Debug for ClientConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConnection")
            .field("channels", &self.channels.iter().flatten().count())
            .field("closed", &self.closed)
            .finish()
    }
}

/// Tells the connection that a channel has something to send.
struct ReadyNotifier {
    ready: ChannelQueueHandle,
    slot: u32,
}

impl CreditListener for ReadyNotifier {
    fn on_channel_ready(&self, _channel: usize) {
        self.ready.enqueue(self.slot);
    }
}

impl ClientConnection {
    /// A connection for up to `max_channels` channels, reading payloads of at most
    /// `segment_size` bytes; `node` identifies this process in the handshake. Without
    /// authentication.
    pub fn new(node: u128, max_channels: usize, segment_size: usize) -> Self {
        Self::with_config(ClientConfig::new(node, max_channels, segment_size), [0; 32])
    }

    /// A connection as `config` says. With a secret, `nonce` must be fresh random bytes
    /// ([`Secret::fresh_nonce`](super::auth::Secret::fresh_nonce)); partition requests then
    /// wait until the producer proved it knows the secret, and follow our proof.
    pub fn with_config(config: ClientConfig, nonce: Nonce) -> Self {
        let auth = config.secret.map(|secret| ClientAuth {
            secret,
            nonce,
            transcript: None,
        });
        let mut outbound = Outbound::default();
        encode(
            &mut outbound,
            &Message::Handshake {
                version: VERSION,
                node: config.node,
                authenticate: auth.is_some(),
                nonce: if auth.is_some() { nonce } else { [0; 32] },
            },
        );
        Self {
            node: config.node,
            channels: Vec::new(),
            ready: ChannelQueueHandle::new(config.max_channels),
            reader: FrameReader::new(config.segment_size, config.max_frame_size),
            stage: ReadStage::Frames,
            discard: Box::new([0; DISCARD_CHUNK]),
            outbound,
            handshake_received: false,
            handshake_deadline: HandshakeDeadline::new(config.handshake_timeout),
            authenticated: auth.is_none(),
            auth,
            deferred: Vec::new(),
            closed: false,
            generation: 0,
            request_backoff: Backoff::flink_default(),
            retrying: 0,
            channel_left: false,
            peer: None,
            refused_at_limit: false,
            task_events_held: false,
            max_queued_bytes: super::MAX_QUEUED_CONTROL
                + TASK_EVENT_QUEUE_BYTES
                + super::frame::TASK_EVENT_REQUEST_HEADER
                + config.segment_size,
        }
    }

    /// Retries a request the producer answered with PartitionNotFound after `backoff`'s
    /// delays (`taskmanager.network.request-backoff.*`) instead of Flink's 100 ms … 10 s; the
    /// channel fails once the delay is at its maximum.
    pub fn with_request_backoff(mut self, backoff: Backoff) -> Self {
        self.request_backoff = backoff;
        self
    }

    /// The connection goes to the producer at `peer`: a broken socket fails the channels
    /// with [`GateError::ConnectionLost`] naming it.
    pub fn with_peer(mut self, peer: std::net::SocketAddr) -> Self {
        self.peer = Some(peer);
        self
    }

    /// True once requests may flow: no authentication, or both sides proved the secret
    /// (ours is queued).
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    /// This side's node identity.
    pub fn node(&self) -> u128 {
        self.node
    }

    /// Registers a remote channel and queues its PartitionRequest with the initial credit.
    /// Fails when the connection has no room for another channel or is closing.
    pub fn register(
        &mut self,
        shared: Arc<RemoteChannelShared>,
        attach: impl FnOnce(Arc<dyn CreditListener>),
    ) -> Result<ReceiverId, ProtocolError> {
        if self.closed {
            // Closing (its last channel left, or it failed): the driver opens a new one.
            return Err(ProtocolError::Closed);
        }
        let slot = match self.channels.iter().position(Option::is_none) {
            Some(slot) => slot,
            None if self.channels.len() < self.ready.capacity() => {
                self.channels.push(None);
                self.channels.len() - 1
            }
            None => return Err(ProtocolError::Closed),
        };
        let receiver = self.next_receiver(slot);
        attach(Arc::new(ReadyNotifier {
            ready: self.ready.clone(),
            slot: slot as u32,
        }));
        let consumed = shared.consumed();
        self.channels[slot] = Some(ClientChannel {
            shared,
            partition: consumed.partition,
            receiver,
            backoff: self.request_backoff,
            retry: Retry::No,
            connect_backoff: self.request_backoff,
        });
        self.send_request(slot);
        // A channel released before the listener was attached told no one: its slot is
        // queued now, and the next `poll_transmit` cancels the request. (Released after the
        // attach, the release queues it itself.) Task events sent before it had a connection
        // go out the same way, after the request. The fence pairs with the gate's after its
        // flag (a Dekker pair; the listener's store alone does not promise it).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.channels[slot]
            .as_ref()
            .is_some_and(|c| c.shared.is_released() || c.shared.has_task_events())
        {
            self.ready.enqueue(slot as u32);
        }
        Ok(receiver)
    }

    /// Slot in the low half, a never-reused generation in the high half: a late frame for a
    /// channel that left (or for an earlier request of a retried one) cannot reach the channel
    /// that now holds the slot.
    fn next_receiver(&mut self, slot: usize) -> ReceiverId {
        self.generation += 1;
        ReceiverId(slot as u128 | (u128::from(self.generation) << 64))
    }

    /// Queues the PartitionRequest of the channel in `slot` with its free segments as credit.
    fn send_request(&mut self, slot: usize) {
        let Some(Some(channel)) = self.channels.get(slot) else {
            return;
        };
        let consumed = channel.shared.consumed();
        let message = Message::PartitionRequest {
            partition: consumed.partition,
            subpartition: consumed.subpartition as u32,
            receiver: channel.receiver,
            credit: channel.shared.buffers().initial_credit(),
        };
        self.send_after_authentication(&message);
    }

    /// Re-sends the requests whose back-off ran out (each under a new receiver id).
    fn retry_requests(&mut self, now: Instant) {
        for slot in 0..self.channels.len() {
            let Some(Some(channel)) = self.channels.get_mut(slot) else {
                continue;
            };
            match channel.retry {
                Retry::No => {}
                Retry::Due => channel.retry = Retry::At(now + channel.backoff.current()),
                Retry::At(due) if due <= now => {
                    channel.retry = Retry::No;
                    self.retrying -= 1;
                    if channel.shared.is_released() {
                        // The producer holds nothing for it: leave without a cancel.
                        self.remove_channel(slot);
                        continue;
                    }
                    tracing::debug!(partition = ?channel.partition, "re-requesting a partition");
                    channel.shared.note_retry();
                    let receiver = self.next_receiver(slot);
                    if let Some(Some(channel)) = self.channels.get_mut(slot) {
                        channel.receiver = receiver;
                    }
                    self.send_request(slot);
                    // Credit or a resume asked for while waiting goes out now.
                    self.ready.enqueue(slot as u32);
                }
                Retry::At(_) => {}
            }
        }
    }

    /// When a re-request or the handshake deadline is next due (for the driver's timer).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let handshake = self
            .handshake_deadline
            .due()
            .filter(|_| !self.closed && !self.is_established());
        if self.retrying == 0 {
            return handshake;
        }
        self.channels
            .iter()
            .flatten()
            .filter_map(|c| match c.retry {
                Retry::At(due) => Some(due),
                _ => None,
            })
            .chain(handshake)
            .min()
    }

    /// True once the producer's handshake arrived and, with a secret, its proof held.
    fn is_established(&self) -> bool {
        self.handshake_received && self.authenticated
    }

    /// Fails the channels of a connection whose producer stays silent or never proves the
    /// secret (their requests would otherwise wait forever).
    fn check_handshake_deadline(&mut self, now: Instant) {
        if self.closed || self.is_established() {
            return;
        }
        if let Some(error) =
            self.handshake_deadline
                .expired(now, self.handshake_received, "the producer")
        {
            self.fail_all(&error);
        }
    }

    /// Sends a task event to the producer of `receiver`'s partition.
    pub fn send_task_event(&mut self, receiver: ReceiverId, event: &crate::event::Event) {
        let Some(channel) = self.channel(receiver) else {
            return;
        };
        let mut bytes = Vec::with_capacity(event.encoded_len());
        event.encode(&mut bytes);
        let message = Message::TaskEventRequest {
            partition: channel.partition,
            receiver,
            event: bytes,
        };
        self.send_after_authentication(&message);
    }

    /// Queues `message`, or keeps it until authentication completed.
    fn send_after_authentication(&mut self, message: &Message) {
        if self.authenticated {
            encode(&mut self.outbound, message);
        } else {
            message.encode(&mut self.deferred);
        }
    }

    /// Where the next bytes read from the socket go.
    pub fn read_buffer(&mut self) -> &mut [u8] {
        match &mut self.stage {
            ReadStage::Frames => self.reader.destination(),
            ReadStage::BufferHeader { bytes, have, .. } => &mut bytes[*have..],
            ReadStage::Payload {
                builder, remaining, ..
            } => match builder {
                Some(builder) => &mut builder.unfilled_mut()[..*remaining],
                None => {
                    let n = (*remaining).min(DISCARD_CHUNK);
                    &mut self.discard[..n]
                }
            },
        }
    }

    /// `n` bytes were read into [`read_buffer`](Self::read_buffer). An error closes the
    /// connection: every channel on it fails.
    pub fn on_read(&mut self, n: usize) -> Result<(), ProtocolError> {
        if self.closed {
            // Failed (e.g. at the handshake deadline) while a read was in flight: its bytes
            // were aimed at a reader `fail_all` has since reset, so they are dropped unread,
            // as a closing server drops them.
            return Ok(());
        }
        let result = self.advance(n).and_then(|()| {
            let bytes = self.outbound.queued_bytes();
            if bytes > self.max_queued_bytes {
                return Err(ProtocolError::ControlBacklog { bytes });
            }
            Ok(())
        });
        if result.is_err() && self.refused_at_limit {
            // The connection ends; its channels wait for the driver to place them again.
            self.closed = true;
            return result;
        }
        if let Err(error) = &result {
            self.fail_all(error);
            if let ProtocolError::Unauthenticated(reason) = error {
                // Tell the producer why, so its log says what is wrong on which side.
                encode(
                    &mut self.outbound,
                    &Message::ErrorResponse {
                        receiver: None,
                        kind: ErrorKind::Unauthenticated,
                        message: reason.clone(),
                    },
                );
            }
        }
        result
    }

    /// Moves what channels want sent (credit, resume, cancel) into the outbound queue.
    pub fn poll_transmit(&mut self, now: Instant) {
        self.check_handshake_deadline(now);
        // Credit and the like wait for authentication (their channels' requests do too).
        if self.authenticated {
            self.transmit_channels(now);
        }
        // A connection no channel uses closes (CloseRequest after whatever was queued, the
        // last channel's cancellation included), as Flink's client closes its connection
        // when the last channel goes: else every consumer that ever read from a producer
        // would keep a socket there, and descriptors and the producer's `max-connections`
        // would run out. The driver opens a new connection for a channel that comes later.
        if std::mem::take(&mut self.channel_left)
            && !self.closed
            && self.channels.iter().all(Option::is_none)
        {
            self.close();
        }
    }

    /// The requests due again, cancellations, credit and resumes of the channels.
    fn transmit_channels(&mut self, now: Instant) {
        if self.retrying > 0 {
            self.retry_requests(now);
        }
        // Each slot is in the queue at most once: bounded by the channel count.
        while let Some(slot) = self.ready.pop() {
            let Some(Some(channel)) = self.channels.get(slot as usize) else {
                continue;
            };
            let receiver = channel.receiver;
            if channel.retry != Retry::No {
                // No request stands: credit and resume wait for the new one. A released
                // channel leaves now, without a cancel (the producer holds nothing for it):
                // it does not keep its slot, or the connection, until its retry is due.
                if channel.shared.is_released() {
                    self.remove_channel(slot as usize);
                }
                continue;
            }
            let released = channel.shared.is_released();
            if !released {
                let resume = channel.shared.take_resume_request();
                let credit = channel.shared.buffers().take_unannounced_credit();
                if resume {
                    encode(&mut self.outbound, &Message::ResumeConsumption { receiver });
                }
                if credit > 0 {
                    encode(&mut self.outbound, &Message::AddCredit { receiver, credit });
                }
            }
            // On a released channel too, ahead of its cancel: a task that acknowledged and
            // then closed its gate did process every record, and the producer waits for it.
            if channel.shared.take_acknowledgement() {
                encode(
                    &mut self.outbound,
                    &Message::AckAllUserRecordsProcessed { receiver },
                );
            }
            // Task events go out on a released channel too, ahead of its cancel, as Flink
            // writes them at once: the producer may be waiting for one.
            let room = TASK_EVENT_QUEUE_BYTES.saturating_sub(self.outbound.queued_bytes());
            if !send_task_events_within(&mut self.outbound, channel, room) {
                // The rest follow as writes drain the queue; a released channel's cancel and
                // its leaving wait for them.
                self.task_events_held = true;
                continue;
            }
            if released {
                encode(
                    &mut self.outbound,
                    &Message::CancelPartitionRequest { receiver },
                );
                self.remove_channel(slot as usize);
            }
        }
    }

    /// The ranges to write next (at most `max`), in order.
    pub fn write_slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        self.outbound.slices(out, max);
    }

    /// `n` bytes of the ranges were written.
    pub fn on_written(&mut self, n: usize) {
        self.outbound.on_written(n);
        if self.task_events_held && self.outbound.queued_bytes() < TASK_EVENT_QUEUE_BYTES {
            self.task_events_held = false;
            // Bounded by the channel count; only after a burst of task events.
            for (slot, channel) in self.channels.iter().enumerate() {
                if channel.as_ref().is_some_and(|c| c.shared.has_task_events()) {
                    self.ready.enqueue(slot as u32);
                }
            }
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

    /// True when a channel has something for [`poll_transmit`](Self::poll_transmit).
    pub fn has_pending(&self) -> bool {
        self.authenticated && !self.ready.is_empty()
    }

    /// True once closed (by `close` or an error).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The transport below refused the peer's identity or the peer refused ours (a TLS
    /// certificate not from the cluster CA): every channel fails as unauthenticated.
    pub fn on_peer_rejected(&mut self, reason: &str) {
        self.fail_all(&ProtocolError::Unauthenticated(reason.to_owned()));
    }

    /// Registers the waker of the I/O thread driving this connection: woken when a channel
    /// has something to send.
    pub fn set_waker(&self, waker: &Waker) -> bool {
        self.ready.register_waker(waker)
    }

    /// Queues CloseRequest; the driver closes after writing it.
    pub fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            encode(&mut self.outbound, &Message::CloseRequest);
        }
    }

    /// The connection broke (reset, EOF): every channel fails with
    /// [`GateError::ConnectionLost`] (or a transport error when the peer is not known).
    pub fn on_connection_lost(&mut self, reason: &str) {
        let error = ProtocolError::Remote {
            kind: ErrorKind::Other,
            message: reason.to_owned(),
        };
        self.fail_all_with(&error, Some(reason));
    }

    /// The channels of a connection the producer refused before its handshake for its
    /// `max-connections` (an ErrorResponse of kind LimitExceeded), taken out; none for any other
    /// end. The producer served none of them, so they hold only their initial credit and can
    /// ask again on another connection, once a slot frees there.
    pub fn take_unanswered_channels(&mut self) -> Vec<(Arc<RemoteChannelShared>, Backoff)> {
        if !self.refused_at_limit {
            return Vec::new();
        }
        (0..self.channels.len())
            .filter_map(|slot| self.remove_channel(slot))
            .filter(|channel| !channel.shared.is_released())
            .map(|channel| (channel.shared, channel.connect_backoff))
            .collect()
    }

    /// True once the producer refused this connection at its `max-connections`.
    pub fn was_refused_at_limit(&self) -> bool {
        self.refused_at_limit
    }

    /// The delays the connects of the channel registered as `receiver` went through (see
    /// [`take_unanswered_channels`](Self::take_unanswered_channels)).
    pub fn set_connect_backoff(&mut self, receiver: ReceiverId, backoff: Backoff) {
        if let Some(slot) = self.slot_of(receiver) {
            if let Some(Some(channel)) = self.channels.get_mut(slot) {
                channel.connect_backoff = backoff;
            }
        }
    }

    /// Takes the segment a payload is being read into, out of the connection's reach: for a
    /// driver whose read into it may still be in flight when the connection must go (its
    /// cancellation never completed), so that the segment is leaked rather than given back
    /// under the kernel's write. The payload's frame can no longer complete.
    pub fn take_payload_destination(&mut self) -> Option<BufferBuilder> {
        match &mut self.stage {
            ReadStage::Payload { builder, .. } => builder.take(),
            _ => None,
        }
    }

    /// True while [`register`](Self::register) would take another channel: not closing, and
    /// under `max-channels-per-connection`. A full connection sends its driver to open
    /// another one to the same producer.
    pub fn has_room(&self) -> bool {
        !self.closed
            && (self.channels.len() < self.ready.capacity()
                || self.channels.iter().any(Option::is_none))
    }

    /// Channels registered now.
    pub fn channel_count(&self) -> usize {
        self.channels.iter().flatten().count()
    }

    fn channel(&self, receiver: ReceiverId) -> Option<&ClientChannel> {
        let slot = (receiver.0 & u128::from(u64::MAX)) as usize;
        self.channels
            .get(slot)?
            .as_ref()
            .filter(|c| c.receiver == receiver)
    }

    fn slot_of(&self, receiver: ReceiverId) -> Option<usize> {
        let slot = (receiver.0 & u128::from(u64::MAX)) as usize;
        self.channel(receiver).map(|_| slot)
    }

    /// The slot of the channel whose partition request `receiver` stands: a channel that
    /// waits to ask again after PartitionNotFound has none, so what the producer sends for
    /// that request (it has no view for it) is a stale or forged frame, as for a channel gone.
    fn requested_slot(&self, receiver: ReceiverId) -> Option<usize> {
        self.slot_of(receiver)
            .filter(|&slot| matches!(&self.channels[slot], Some(c) if c.retry == Retry::No))
    }

    fn advance(&mut self, n: usize) -> Result<(), ProtocolError> {
        match &mut self.stage {
            ReadStage::Frames => match self.reader.advance(n)? {
                Step::Incomplete => Ok(()),
                Step::Header(frame) => {
                    if frame.id == MessageId::BufferResponse {
                        if !self.handshake_received {
                            return Err(ProtocolError::Handshake("data before handshake".into()));
                        }
                        if !self.authenticated {
                            return Err(ProtocolError::Unauthenticated(
                                "the producer sent data before proving it knows the secret".into(),
                            ));
                        }
                        self.stage = ReadStage::BufferHeader {
                            frame,
                            bytes: [0; BUFFER_RESPONSE_BODY],
                            have: 0,
                        };
                        return Ok(());
                    }
                    // Refused by its header, before its body is read into memory.
                    if !frame.id.sent_by_producer() {
                        return Err(ProtocolError::UnexpectedMessage(frame.id));
                    }
                    match self.reader.read_body(frame) {
                        Some(Step::Body(frame)) => self.on_control(frame),
                        _ => Ok(()),
                    }
                }
                Step::Body(frame) => self.on_control(frame),
            },
            ReadStage::BufferHeader { frame, bytes, have } => {
                *have += n;
                if *have < BUFFER_RESPONSE_BODY {
                    return Ok(());
                }
                let header = decode_buffer_response(frame, bytes)?;
                self.begin_payload(header)
            }
            ReadStage::Payload {
                builder, remaining, ..
            } => {
                if let Some(builder) = builder {
                    builder.advance(n);
                }
                *remaining -= n;
                if *remaining == 0 {
                    self.finish_payload()
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Names the payload's destination before any payload byte is read: a segment the
    /// channel reserved when it granted credit (data), or an overdraft segment (events).
    fn begin_payload(&mut self, header: BufferResponseHeader) -> Result<(), ProtocolError> {
        if header.compressed {
            // No codec is configured on either side (Flink compresses only blocking
            // partitions, never a pipelined one): read as records, its bytes would be garbage.
            return Err(ProtocolError::Decode(DecodeError::InvalidField {
                field: "buffer flags (compressed, and no codec is configured)",
                value: 1,
            }));
        }
        let mut slot = self.requested_slot(header.receiver);
        // A channel whose gate was released may still receive what was in flight: it leaves
        // now, and the payload is discarded like one for a channel already gone, without
        // failing the connection's other channels.
        let mut cancel = true;
        if let Some(released) = slot.filter(|&s| {
            self.channels[s]
                .as_ref()
                .is_some_and(|c| c.shared.is_released())
        }) {
            // Its task events still go out, ahead of the cancel below, as they would have
            // had the transmit come before this read.
            cancel = self.leave_after_task_events(released);
            slot = None;
        }
        let builder = match slot.and_then(|s| self.channels[s].as_ref()) {
            None => {
                // A channel already gone: discard the payload, tell the producer to stop.
                if cancel {
                    encode(
                        &mut self.outbound,
                        &Message::CancelPartitionRequest {
                            receiver: header.receiver,
                        },
                    );
                }
                None
            }
            Some(channel) => {
                // Events come without credit: a sender that sends more than a channel holds
                // unread is flooding it, and gets no memory for it.
                let flooded = !header.data_type.is_buffer()
                    && channel.shared.unread_events() >= UNCREDITED_EVENTS;
                let segment = if header.data_type.is_buffer() {
                    channel.shared.buffers().take_segment()
                } else if flooded {
                    None
                } else {
                    channel.shared.buffers().event_segment(header.size as usize)
                };
                match segment {
                    // A gate whose segments are smaller than this connection reads (a
                    // `ClientConfig` not matching the pool's memory) cannot take the payload.
                    Some(segment) if segment.capacity() < header.size as usize => {
                        return Err(ProtocolError::Decode(DecodeError::BadLength {
                            id: MessageId::BufferResponse as u8,
                            length: header.size.into(),
                            limit: segment.capacity() as u64,
                        }));
                    }
                    Some(segment) => Some(segment.into_builder(header.data_type)),
                    None if header.data_type.is_buffer() && !channel.shared.is_released() => {
                        return Err(ProtocolError::CreditExceeded(header.receiver));
                    }
                    // The gate closed between the look above and this one (its release empties
                    // the channel's segments), or the process could not map an event's few
                    // bytes: this channel leaves and the payload is discarded, as for a channel
                    // gone. Neither is the connection's fault, so its other channels go on.
                    None if !flooded && channel.shared.is_released() => {
                        let receiver = channel.receiver;
                        let released = slot.take().expect("a channel was found in it");
                        if self.leave_after_task_events(released) {
                            encode(
                                &mut self.outbound,
                                &Message::CancelPartitionRequest { receiver },
                            );
                        }
                        None
                    }
                    None => {
                        let receiver = channel.receiver;
                        let channel = slot
                            .take()
                            .and_then(|s| self.remove_channel(s))
                            .expect("a channel was found in it");
                        if flooded {
                            tracing::warn!(
                                ?receiver,
                                "{UNCREDITED_EVENTS} events unread and one more; failing its channel"
                            );
                            channel
                                .shared
                                .fail(GateError::CreditExceeded(channel.shared.channel()));
                        } else {
                            tracing::warn!(
                                ?receiver,
                                "no memory for an incoming event; failing its channel"
                            );
                            channel.shared.fail(GateError::Transport {
                                channel: channel.shared.channel(),
                                reason: "no memory for an incoming event".to_owned(),
                            });
                        }
                        // A failed channel's task is failing: what its events would take
                        // beyond the queue's room for them is dropped, not queued.
                        let room =
                            TASK_EVENT_QUEUE_BYTES.saturating_sub(self.outbound.queued_bytes());
                        if !send_task_events_within(&mut self.outbound, &channel, room) {
                            tracing::warn!(
                                ?receiver,
                                "task events of a channel that failed were dropped"
                            );
                        }
                        encode(
                            &mut self.outbound,
                            &Message::CancelPartitionRequest { receiver },
                        );
                        None
                    }
                }
            }
        };
        self.stage = ReadStage::Payload {
            header,
            slot: slot.unwrap_or(usize::MAX),
            builder,
            remaining: header.size as usize,
        };
        if header.size == 0 {
            return self.finish_payload();
        }
        Ok(())
    }

    fn finish_payload(&mut self) -> Result<(), ProtocolError> {
        let stage = std::mem::replace(&mut self.stage, ReadStage::Frames);
        self.reader.expect_header();
        let ReadStage::Payload {
            header,
            slot,
            builder,
            ..
        } = stage
        else {
            unreachable!("called in the payload stage");
        };
        let Some(mut builder) = builder else {
            return Ok(());
        };
        let mut consumer = builder.create_consumer_from_beginning();
        builder.finish();
        drop(builder);
        let mut buffer = consumer.build();
        // The buffer holds the segment alone now (an empty one goes back as it drops).
        drop(consumer);
        buffer.set_compressed(header.compressed);
        // By receiver id, not by slot alone: the channel may have left while its payload was
        // read (its gate closed) and a new channel taken the slot; the payload is then
        // discarded (its segment goes back), never delivered to the newcomer.
        let Some(channel) = self
            .channels
            .get(slot)
            .and_then(Option::as_ref)
            .filter(|c| c.receiver == header.receiver)
        else {
            return Ok(());
        };
        let delivered = if header.data_type.is_buffer() && buffer.is_empty() {
            // An empty buffer spent a credit and carries none of its own: the segment taken
            // for it goes back first (a floating one to the gate, where another channel may
            // wait for it; an exclusive one becomes credit again), as Flink's decoder
            // recycles it before `onEmptyBuffer`.
            drop(buffer);
            channel
                .shared
                .on_empty_buffer(header.sequence_number, header.backlog as usize)
        } else {
            channel.shared.on_buffer(
                buffer,
                header.sequence_number,
                header.backlog as usize,
                header.overtaken as usize,
            )
        };
        if delivered.is_err() {
            // The channel failed (reordering, overflow): the gate reports it; stop its data.
            let receiver = channel.receiver;
            self.remove_channel(slot);
            encode(
                &mut self.outbound,
                &Message::CancelPartitionRequest { receiver },
            );
        }
        Ok(())
    }

    fn on_control(&mut self, frame: FrameHeader) -> Result<(), ProtocolError> {
        let message = Message::decode(&frame, &self.reader.body)?;
        // A producer refusing the connection may say why before its handshake.
        let refusal = matches!(message, Message::ErrorResponse { receiver: None, .. });
        if refusal && !self.handshake_received {
            self.refused_at_limit = matches!(
                message,
                Message::ErrorResponse {
                    kind: ErrorKind::LimitExceeded,
                    ..
                }
            );
        }
        if !self.handshake_received && !refusal && !matches!(message, Message::Handshake { .. }) {
            return Err(ProtocolError::Handshake(format!(
                "expected a handshake, got {:?}",
                frame.id
            )));
        }
        match message {
            Message::Handshake {
                version,
                node,
                authenticate,
                nonce,
            } => {
                if self.handshake_received {
                    return Err(ProtocolError::UnexpectedMessage(frame.id));
                }
                if version != VERSION {
                    return Err(ProtocolError::Handshake(format!(
                        "peer speaks version {version}, we speak {VERSION}"
                    )));
                }
                self.handshake_received = true;
                self.on_producer_handshake(node, authenticate, nonce)?;
            }
            Message::AuthProof { proof } => self.on_producer_proof(&proof)?,
            Message::ErrorResponse {
                receiver: None,
                kind,
                message,
            } => return Err(ProtocolError::Remote { kind, message }),
            _ if !self.authenticated => {
                return Err(ProtocolError::Unauthenticated(format!(
                    "the producer sent {:?} before proving it knows the secret",
                    frame.id
                )))
            }
            Message::BacklogAnnouncement { receiver, backlog } => {
                if let Some(slot) = self.requested_slot(receiver) {
                    if let Some(channel) = &self.channels[slot] {
                        channel.shared.buffers().on_sender_backlog(backlog as usize);
                    }
                }
            }
            Message::ErrorResponse {
                receiver: Some(receiver),
                kind,
                message,
            } => {
                if kind == ErrorKind::PartitionNotFound && self.schedule_retry(receiver) {
                    return Ok(());
                }
                // An error for a channel that is gone (cancelled meanwhile) is no news: only a
                // live channel's is a warning, and the peer's text goes out escaped (`?`), so
                // a producer flooding errors for unknown receivers cannot fill or forge the log.
                let Some(slot) = self.requested_slot(receiver) else {
                    tracing::debug!(?receiver, ?kind, ?message, "error for an unknown receiver");
                    return Ok(());
                };
                tracing::warn!(
                    ?receiver,
                    ?kind,
                    ?message,
                    "the producer reported a channel error"
                );
                let channel = self.remove_channel(slot).expect("slot_of checked it");
                let error = match kind {
                    ErrorKind::PartitionNotFound => GateError::Partition {
                        channel: channel.shared.channel(),
                        source: PartitionError::PartitionNotFound(channel.partition),
                    },
                    ErrorKind::ProducerFailed => GateError::ProducerFailed {
                        channel: channel.shared.channel(),
                        cause: message,
                    },
                    _ => GateError::Transport {
                        channel: channel.shared.channel(),
                        reason: message,
                    },
                };
                channel.shared.fail(error);
            }
            _ => return Err(ProtocolError::UnexpectedMessage(frame.id)),
        }
        Ok(())
    }

    /// PartitionNotFound for `receiver`: true when its channel will ask again after its
    /// back-off, false when the back-off is exhausted (the channel then fails).
    fn schedule_retry(&mut self, receiver: ReceiverId) -> bool {
        let Some(slot) = self.slot_of(receiver) else {
            return false;
        };
        let Some(Some(channel)) = self.channels.get_mut(slot) else {
            return false;
        };
        // A producer that already sent this channel data has the partition: PartitionNotFound
        // now contradicts it (a broken or forged peer). Asking again would announce the
        // exclusive credit a second time while those segments hold unread data, so the
        // channel fails here, with the producer's answer, instead of later with a credit or
        // sequence error.
        if channel.retry != Retry::No
            || channel.shared.is_released()
            || channel.shared.expected_sequence() > 0
            || !channel.backoff.increase()
        {
            return false;
        }
        tracing::debug!(
            partition = ?channel.partition,
            delay = ?channel.backoff.current(),
            "partition not found yet; requesting again after the back-off"
        );
        channel.retry = Retry::Due;
        self.retrying += 1;
        true
    }

    /// A released channel's task events go out ahead of its cancel, those the outbound queue
    /// has room for now. If that was all, the channel leaves and this returns true (the
    /// caller queues the cancel); else it stays, and once writes drain the queue
    /// `transmit_channels` sends the rest, then the cancel.
    fn leave_after_task_events(&mut self, slot: usize) -> bool {
        let room = TASK_EVENT_QUEUE_BYTES.saturating_sub(self.outbound.queued_bytes());
        let all = self.channels[slot]
            .as_ref()
            .is_none_or(|channel| send_task_events_within(&mut self.outbound, channel, room));
        if all {
            self.remove_channel(slot);
        } else {
            self.task_events_held = true;
        }
        all
    }

    /// Takes the channel in `slot` out, keeping the count of retrying channels exact.
    fn remove_channel(&mut self, slot: usize) -> Option<ClientChannel> {
        let channel = self.channels.get_mut(slot)?.take()?;
        if channel.retry != Retry::No {
            self.retrying -= 1;
        }
        self.channel_left = true;
        Some(channel)
    }

    /// The producer's handshake says whether it authenticates; both sides must agree.
    fn on_producer_handshake(
        &mut self,
        producer: u128,
        authenticate: bool,
        nonce: Nonce,
    ) -> Result<(), ProtocolError> {
        match (&mut self.auth, authenticate) {
            (None, false) => Ok(()),
            (None, true) => Err(ProtocolError::Unauthenticated(
                "the producer requires authentication and this node has no secret \
                 (fluxgate.security.secret-file or FLUXGATE_SECRET)"
                    .into(),
            )),
            (Some(_), false) => Err(ProtocolError::Unauthenticated(
                "this node requires authentication and the producer does not authenticate \
                 (its fluxgate.security.auth is off)"
                    .into(),
            )),
            (Some(auth), true) => {
                auth.transcript = Some(Transcript {
                    client_nonce: auth.nonce,
                    server_nonce: nonce,
                    client_node: self.node,
                    server_node: producer,
                });
                Ok(())
            }
        }
    }

    /// The producer proved it knows the secret: our proof follows, then the requests that
    /// waited for it.
    fn on_producer_proof(&mut self, proof: &Proof) -> Result<(), ProtocolError> {
        let Some(ClientAuth {
            secret,
            transcript: Some(transcript),
            ..
        }) = &self.auth
        else {
            return Err(ProtocolError::UnexpectedMessage(MessageId::AuthProof));
        };
        if self.authenticated {
            return Err(ProtocolError::UnexpectedMessage(MessageId::AuthProof));
        }
        if !transcript.verify_server(secret, proof) {
            return Err(ProtocolError::Unauthenticated(
                "the producer's proof is wrong: the two nodes have different secrets".into(),
            ));
        }
        let ours = transcript.client_proof(secret);
        encode(&mut self.outbound, &Message::AuthProof { proof: ours });
        let deferred = std::mem::take(&mut self.deferred);
        // After our CloseRequest nothing more may follow.
        if !deferred.is_empty() && !self.closed {
            // Whole frames, in order: one range of the control bytes.
            self.outbound.control_bytes().extend_from_slice(&deferred);
            self.outbound.push_control(deferred.len());
        }
        self.authenticated = true;
        tracing::debug!("connection authenticated");
        Ok(())
    }

    fn fail_all(&mut self, error: &ProtocolError) {
        self.fail_all_with(error, None);
    }

    /// Fails every channel; `lost` is the socket's reason when the connection itself broke.
    fn fail_all_with(&mut self, error: &ProtocolError, lost: Option<&str>) {
        let channels = self.channel_count();
        if channels > 0 {
            tracing::warn!(%error, channels, "connection failed; failing its channels");
        } else {
            tracing::debug!(%error, "connection closed");
        }
        self.retrying = 0;
        let authentication = error.is_authentication_failure();
        for channel in self.channels.iter_mut().filter_map(Option::take) {
            let index = channel.shared.channel();
            let reason = error.to_string();
            channel.shared.fail(if authentication {
                GateError::Unauthenticated {
                    channel: index,
                    reason,
                }
            } else if let (Some(lost), Some(peer)) = (lost, self.peer) {
                GateError::ConnectionLost {
                    channel: index,
                    peer,
                    reason: lost.to_owned(),
                }
            } else {
                GateError::Transport {
                    channel: index,
                    reason,
                }
            });
        }
        // Drops any payload builder: its segment goes back to the channel.
        self.stage = ReadStage::Frames;
        self.reader.expect_header();
        // A frame partly written stays whole: an error response may follow it.
        self.outbound.clear_keeping_partial();
        self.deferred = Vec::new();
        self.closed = true;
    }
}

impl Drop for ClientConnection {
    fn drop(&mut self) {
        if self.channels.iter().any(Option::is_some) {
            self.on_connection_lost("connection dropped");
        }
    }
}

/// Writes task events queued on `channel` as TaskEventRequests, oldest first, while fewer
/// than `room` bytes of them were written (the last may pass it by one event). Returns
/// whether none is left.
fn send_task_events_within(outbound: &mut Outbound, channel: &ClientChannel, room: usize) -> bool {
    let (events, all) = channel.shared.take_task_events_within(room);
    for event in events {
        encode(
            outbound,
            &Message::TaskEventRequest {
                partition: channel.partition,
                receiver: channel.receiver,
                event,
            },
        );
    }
    all
}

/// Appends one control frame to the outbound queue.
pub(crate) fn encode(outbound: &mut Outbound, message: &Message) {
    let bytes = outbound.control_bytes();
    let start = bytes.len();
    message.encode(bytes);
    let len = bytes.len() - start;
    outbound.push_control(len);
}
