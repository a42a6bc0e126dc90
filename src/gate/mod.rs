//! The consuming half of the exchange (Flink's `SingleInputGate`, `UnionInputGate`,
//! `InputChannel`s, `CheckpointedInputGate`). IO-free: the transport feeds remote channels
//! through [`RemoteChannelShared`]; local channels read their producer's subpartition view.
//!
//! ```text
//! data source (view / I/O thread) ── notify ──▶ ChannelQueue (lock-free, one entry per channel)
//!                                                  │ priority lane first, then data lane (FIFO)
//! task thread: gate.poll_next() / next() ◀─────────┘ read ONE buffer, requeue at the tail if more
//! ```

mod barrier;
mod channel;
// Public only under `--cfg loom`, for the models in `tests/loom.rs`.
#[cfg(not(loom))]
mod queue;
#[cfg(loom)]
#[doc(hidden)]
pub mod queue;
// Public only under `--cfg loom`, for the models in `tests/loom.rs`.
#[cfg(not(loom))]
mod lane;
#[cfg(loom)]
#[doc(hidden)]
pub mod lane;
mod reader;
mod remote;
mod single;
mod union;

pub use barrier::{AlignmentMode, ChannelStateSink, CheckpointedInputGate, OutputWait};
pub use channel::{Backoff, ChannelLocation, InputChannel, LocalInputChannel, UnknownInputChannel};
pub(crate) use queue::{give_held_wakes, hold_wakes, ChannelQueueHandle};
pub use reader::{BufferRecords, ReaderError, ReaderItem, RecordReader};
pub use remote::{
    BufferManager, CreditListener, RemoteChannelShared, RemoteInputChannel, UNCREDITED_EVENTS,
};
pub use single::{ChannelSpec, GateCloser, GateMetrics, SingleInputGate};
pub use union::UnionInputGate;

use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::buffer::{Buffer, PoolError};
use crate::event::{CheckpointBarrier, Event, EventError};
use crate::metrics::{WaitSpan, WaitTime};
use crate::partition::{PartitionError, ResultPartitionId};

/// Why a gate or channel read failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GateError {
    /// The gate was closed (task cancelled or finished).
    #[error("the input gate is closed")]
    Closed,
    /// A read with a deadline found nothing before it.
    #[error("nothing to read before the deadline")]
    TimedOut,
    /// Partitions were already requested.
    #[error("partitions were already requested")]
    AlreadyRequested,
    /// The producer said it failed ([`ResultPartition::fail`](crate::partition::ResultPartition::fail)),
    /// or, across the wire, released the partition before its end: Flink's
    /// `ProducerFailedException`, after which a task is cancelled rather than failed, the
    /// root cause being the producer's.
    #[error("channel {channel}: the producer failed: {cause}")]
    ProducerFailed {
        /// Gate-local channel index.
        channel: usize,
        /// What the producer gave as the cause.
        cause: String,
    },
    /// A producer partition could not be reached or failed.
    #[error("channel {channel}: {source}")]
    Partition {
        /// Gate-local channel index.
        channel: usize,
        /// What the producer side said.
        source: PartitionError,
    },
    /// A remote channel received sequence number `actual` where `expected` was due: a buffer
    /// was lost or reordered on the way (the sender's or the network's fault).
    #[error(
        "channel {channel}: buffer reordering, expected sequence number {expected}, got {actual}"
    )]
    Reordering {
        /// Gate-local channel index.
        channel: usize,
        /// The sequence number due.
        expected: u64,
        /// The one received.
        actual: u64,
    },
    /// A channel's transport failed (connection lost, protocol error), or its producer
    /// refused the request for a reason of the request's own (a subpartition the partition
    /// does not have, a view taken already: `reason` says which).
    #[error("channel {channel}: remote transport failed: {reason}")]
    Transport {
        /// Gate-local channel index.
        channel: usize,
        /// What happened.
        reason: String,
    },
    /// The connection to the channel's producer broke at the socket level: reset, EOF, the
    /// peer's process died, or keepalive / TCP_USER_TIMEOUT gave up on a silent peer (Flink's
    /// `RemoteTransportException` "Lost connection to task manager").
    #[error("channel {channel}: lost the connection to the producer at {peer}: {reason}")]
    ConnectionLost {
        /// Gate-local channel index.
        channel: usize,
        /// The producer's address.
        peer: std::net::SocketAddr,
        /// What the socket said.
        reason: String,
    },
    /// The channel's connection was refused because one side did not prove it knows the
    /// cluster secret (`fluxgate.security.*`): a wrong or missing secret, or authentication on
    /// one side only; or, with TLS on (`security.ssl.internal.*`), one side's certificate
    /// does not chain to the other's cluster CA. Retrying does not help until the
    /// configuration is fixed.
    #[error("channel {channel}: authentication failed: {reason}")]
    Unauthenticated {
        /// Gate-local channel index.
        channel: usize,
        /// What happened.
        reason: String,
    },
    /// An event's bytes did not decode (the sender's fault).
    #[error("channel {channel}: {source}")]
    Event {
        /// Gate-local channel index.
        channel: usize,
        /// The decoding error.
        source: EventError,
    },
    /// A channel index out of range.
    #[error("no channel {0}")]
    NoSuchChannel(usize),
    /// The operation needs the channel's producer location, which is not known yet.
    #[error("channel {0} has no known producer yet")]
    UnknownChannel(usize),
    /// A channel of a gate a [`ShuffleEnvironment`](crate::env::ShuffleEnvironment) created
    /// was located as remote through the gate itself: the environment connects a remote
    /// channel when it locates it, so such a channel would never be served. Locate it through
    /// `ShuffleEnvironment::update_channel`, which knows the producer's address.
    #[error(
        "channel {0}: a shuffle environment's gate locates remote channels through \
         ShuffleEnvironment::update_channel, which connects them"
    )]
    LocateThroughEnvironment(usize),
    /// The gate's buffer pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// More received buffers than the channel granted credit for (the sender's fault).
    #[error("channel {0}: more buffers received than credit granted")]
    CreditExceeded(usize),
    /// An unaligned barrier reached a gate that aligns only ([`AlignmentMode::Aligned`]): its
    /// sender did not stop behind it, so the checkpoint cannot be aligned, and taking it as
    /// aligned would let records from behind it in before the snapshot. Unaligned
    /// checkpoints, and aligned ones with a timeout (their producer may turn them unaligned),
    /// need [`AlignmentMode::Unaligned`] on every consumer.
    #[error(
        "channel {channel}: an unaligned barrier of checkpoint {checkpoint} reached a gate that aligns only"
    )]
    UnalignedBarrier {
        /// Gate-local channel index.
        channel: usize,
        /// The checkpoint.
        checkpoint: u64,
    },
    /// A task event was to be sent while 1024 wait already for a producer not reached yet or
    /// not keeping up: on `channel` (its partition not found, its connection not up, or a
    /// quarter MiB of task events already queued on it for the producer to read), or, without
    /// one, in the gate for channels not located yet. Nothing of it was sent.
    #[error(
        "task events wait for their producer already (channel {channel:?}); one more is refused"
    )]
    TaskEventBacklog {
        /// The channel holding them, if one does.
        channel: Option<usize>,
    },
    /// A task event longer than a segment was to be sent: a producer would refuse its frame
    /// and close the connection, failing every channel on it.
    #[error("a task event of {len} bytes is longer than a segment ({max} bytes)")]
    TaskEventTooLarge {
        /// The event's encoded length.
        len: usize,
        /// The segment size (`taskmanager.memory.segment-size`).
        max: usize,
    },
}

/// One item read from a gate.
#[derive(Debug)]
pub struct BufferOrEvent {
    /// The channel it came from (gate-local; union gates remap to their own numbering).
    pub channel: usize,
    /// A data buffer or a decoded event.
    pub item: GateItem,
    /// True when more is readable from the gate right now.
    pub more_available: bool,
    /// For a priority event: how many data items of its channel it overtook (those are the
    /// next items the channel delivers).
    pub overtaken: usize,
}

/// Whether a gate's producers all sent EndOfData (Flink's `EndOfDataStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndOfDataStatus {
    /// A channel may still deliver records.
    NotEndOfData,
    /// Every channel delivered EndOfData (or ended), all asking to drain.
    Drained,
    /// Every channel delivered EndOfData (or ended), one asking to stop without draining.
    Stopped,
}

/// A data buffer or an event.
#[derive(Debug)]
pub enum GateItem {
    /// Serialized records.
    Buffer(Buffer),
    /// A decoded event; `priority` when it overtook data.
    Event {
        /// The event.
        event: Event,
        /// True when it came through the priority lane.
        priority: bool,
    },
}

/// What a channel hands the gate per read (Flink's `BufferAndAvailability`).
#[derive(Debug)]
pub struct ChannelRead {
    /// The buffer or event bytes.
    pub buffer: Buffer,
    /// True when the channel has more readable right now.
    pub more_available: bool,
    /// True when the next readable item is a priority event.
    pub next_is_priority: bool,
    /// For priority events: data items overtaken.
    pub overtaken: usize,
}

/// Something a gate of any kind does: read, resume a channel, count channels.
pub trait InputGate {
    /// The next buffer or event without blocking; `Ok(None)` when nothing is readable now or
    /// the gate is finished.
    fn poll_next(&mut self) -> Result<Option<BufferOrEvent>, GateError>;
    /// The next buffer or event, blocking until one is readable or `deadline` passes
    /// ([`GateError::TimedOut`]); `Ok(None)` at the end (a gate closed, by `close` or a
    /// closer, fails with [`GateError::Closed`] instead).
    fn next_until(&mut self, deadline: Option<Instant>)
        -> Result<Option<BufferOrEvent>, GateError>;
    /// The next buffer or event, blocking until one is readable; `Ok(None)` at the end.
    fn next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        self.next_until(None)
    }
    /// [`next`](Self::next) giving up after `timeout` with [`GateError::TimedOut`]; a
    /// timeout beyond what the clock can count (`Duration::MAX`) waits without a deadline.
    fn next_timeout(&mut self, timeout: Duration) -> Result<Option<BufferOrEvent>, GateError> {
        self.next_until(Instant::now().checked_add(timeout))
    }
    /// Unblocks a channel after an aligned barrier.
    fn resume_consumption(&mut self, channel: usize) -> Result<(), GateError>;
    /// Number of channels.
    fn channel_count(&self) -> usize;
    /// True once every channel delivered EndOfPartition.
    fn is_finished(&self) -> bool;
    /// True once `channel` delivered EndOfPartition.
    fn is_channel_finished(&self, channel: usize) -> bool;
    /// Retries due partition requests (`now` from the caller's clock), and for a
    /// [`CheckpointedInputGate`] turns an alignment past its timeout unaligned.
    fn handle_timeout(&mut self, now: Instant) -> Result<(), GateError>;
    /// When [`handle_timeout`](Self::handle_timeout) has something to do next (a partition
    /// request's retry, an alignment's timeout): a task reading from its own event loop
    /// calls it by then.
    fn poll_timeout(&self) -> Option<Instant>;
    /// Asks for `waker` to be woken when a channel has something to read or the gate is
    /// closed (an async read's registration). True when that is so already: read again now.
    fn register_waker(&self, waker: &Waker) -> bool;
    /// The next item only if it is a priority event (an unaligned checkpoint barrier, a
    /// cancellation marker that overtook data), without blocking and without reading any
    /// data: what a task whose output is back-pressured still reads (Flink's
    /// `processPriorityEvents`), so an unaligned checkpoint does not wait for a consumer
    /// downstream to free a buffer. `Ok(None)` when no channel has one at its head.
    fn poll_priority_event(&mut self) -> Result<Option<BufferOrEvent>, GateError>;
    /// True when a channel is queued for a priority event (Flink's
    /// `getPriorityEventAvailableFuture` done). It may stay true for a moment after the
    /// event was read through the channel's turn for data, until a priority read looks.
    fn has_priority_event(&self) -> bool;
    /// FLIP-147 (Flink's `hasReceivedEndOfData`): whether every channel delivered EndOfData
    /// (or ended, after which no record comes either), and whether all of them asked to
    /// drain.
    fn end_of_data_status(&self) -> EndOfDataStatus;
    /// Tells `channel`'s producer that the task processed every record the channel delivered
    /// before its EndOfData (Flink's `acknowledgeAllRecordsProcessed`), over the wire for a
    /// remote channel: the producer waits for every consumer's before it finishes. A channel
    /// that ended already is skipped (its producer waits for nothing any more).
    fn acknowledge_all_records_processed(&mut self, channel: usize) -> Result<(), GateError>;
    /// The gate's idle time, which every read's wait for data counts in.
    fn idle_time(&self) -> &WaitTime;
    /// Where the in-flight data of unaligned checkpoints goes, for a gate that persists it
    /// ([`CheckpointedInputGate`] in unaligned mode with a sink): a record reader on top hands
    /// it the records it holds half-read when a barrier comes out.
    fn channel_state_sink(&self) -> Option<&Arc<dyn ChannelStateSink>> {
        None
    }
    /// Right after a priority barrier of `channel` was read: takes the data the channel
    /// received before it and has not returned yet off its queue, ahead of its turn (it is
    /// read next, in order), to be persisted now
    /// ([`for_each_taken_ahead`](Self::for_each_taken_ahead)). Returns how many items are
    /// taken ahead, events included; 0 for a channel that queues nothing of its own.
    fn take_unread_before_priority(&mut self, _channel: usize) -> usize {
        0
    }
    /// Moves the aligned barrier of `checkpoint` that `channel` received, and nobody read
    /// yet, ahead of the data before it (Flink's `convertToPriorityEvent`): that data is taken
    /// ahead of its turn (read next, in order), the barrier dropped. False when the channel
    /// holds no such barrier.
    fn convert_barrier_to_priority(&mut self, _channel: usize, _checkpoint: u64) -> bool {
        false
    }
    /// The data buffers `channel` took ahead of their turn and has not returned yet, in order.
    fn for_each_taken_ahead(&self, _channel: usize, _f: &mut dyn FnMut(&Buffer)) {}
    /// Calls `f` with each channel's aligned barrier with a timeout received and not read
    /// yet, when a channel announced one since the last call, or always with `rescan`
    /// (Flink's `EventAnnouncement`): a barrier handler starts the alignment's timer at it,
    /// not when the task reads as far as the barrier. Costs one load when nothing was
    /// announced.
    fn for_each_new_announcement(
        &mut self,
        _rescan: bool,
        _f: &mut dyn FnMut(usize, CheckpointBarrier),
    ) {
    }
}

impl GateError {
    /// The same error with its channel index moved by `offset`: a union gate reports a
    /// member's error in its own channel numbering.
    pub(crate) fn offset_channel(mut self, offset: usize) -> Self {
        match &mut self {
            GateError::Partition { channel, .. }
            | GateError::ProducerFailed { channel, .. }
            | GateError::Reordering { channel, .. }
            | GateError::Transport { channel, .. }
            | GateError::ConnectionLost { channel, .. }
            | GateError::Unauthenticated { channel, .. }
            | GateError::Event { channel, .. }
            | GateError::NoSuchChannel(channel)
            | GateError::UnknownChannel(channel)
            | GateError::CreditExceeded(channel)
            | GateError::UnalignedBarrier { channel, .. } => *channel += offset,
            _ => {}
        }
        self
    }
}

fn partition_error(channel: usize, source: PartitionError) -> GateError {
    GateError::Partition { channel, source }
}

/// Identifies the subpartition a channel consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConsumedSubpartition {
    /// The producer's partition.
    pub partition: ResultPartitionId,
    /// Which of its subpartitions.
    pub subpartition: usize,
}

/// How often a blocked reader looks at due partition-request retries at the latest.
pub(crate) const RETRY_CHECK: Duration = Duration::from_millis(100);

pub(crate) use crate::wake_timer::WakeTimer;

/// An async read of any gate kind: [`poll_read`] until an item, idle
/// ([`InputGate::idle_time`]) from its first `Pending` until the item or until the read is
/// dropped, as a blocking read is while it sleeps.
pub(crate) async fn read_async<G: InputGate + ?Sized>(
    gate: &mut G,
    timer: WakeTimer,
) -> Result<Option<BufferOrEvent>, GateError> {
    let mut idle: Option<WaitSpan> = None;
    std::future::poll_fn(|cx| {
        let read = poll_read(gate, &timer, cx);
        match read {
            Poll::Pending => {
                idle.get_or_insert_with(|| gate.idle_time().span());
            }
            Poll::Ready(_) => idle = None,
        }
        read
    })
    .await
}

/// One poll of an async read, for every gate kind: what is due is handled, then the gate
/// is read; with nothing readable the task's waker is registered (and a timer armed for
/// what comes due next) before the future goes `Pending`.
pub(crate) fn poll_read<G: InputGate + ?Sized>(
    gate: &mut G,
    timer: &WakeTimer,
    cx: &mut Context<'_>,
) -> Poll<Result<Option<BufferOrEvent>, GateError>> {
    let now = Instant::now();
    if gate.poll_timeout().is_some_and(|due| now >= due) {
        if let Err(error) = gate.handle_timeout(now) {
            return Poll::Ready(Err(error));
        }
    }
    // Bounded: each round either returns or registers and finds nothing queued.
    for round in 0..2 {
        match gate.poll_next() {
            Ok(None) if !gate.is_finished() => {}
            other => return Poll::Ready(other),
        }
        if !gate.register_waker(cx.waker()) {
            break;
        }
        if round == 1 {
            // Channels still queued after both rounds (notified again while read): nothing
            // else would wake this future for them.
            cx.waker().wake_by_ref();
        }
    }
    if let Some(due) = gate.poll_timeout() {
        timer.wake_at(due, cx.waker());
    }
    Poll::Pending
}

/// The blocking read both gate kinds share: poll, and between polls sleep on `wait` until
/// data, the next due retry (`next_retry`), the deadline or `RETRY_CHECK`, whichever is first.
/// Each sleep counts as idle time.
pub(crate) fn read_until<G: InputGate>(
    gate: &mut G,
    deadline: Option<Instant>,
    next_retry: impl Fn(&G) -> Option<Instant>,
    wait: impl Fn(&G, Duration),
) -> Result<Option<BufferOrEvent>, GateError> {
    loop {
        if let Some(item) = gate.poll_next()? {
            return Ok(Some(item));
        }
        if gate.is_finished() {
            return Ok(None);
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(GateError::TimedOut);
        }
        let until =
            |due: Option<Instant>| due.map_or(RETRY_CHECK, |d| d.saturating_duration_since(now));
        let sleep = until(next_retry(gate))
            .min(until(deadline))
            .min(RETRY_CHECK);
        let idle = gate.idle_time().span();
        wait(gate, sleep);
        drop(idle);
        gate.handle_timeout(Instant::now())?;
    }
}
