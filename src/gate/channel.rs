//! Input channels: local (same process), remote (through the transport) and unknown (the
//! producer's location is not known yet).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::queue::{ChannelNotifier, ChannelQueue};
use super::remote::RemoteInputChannel;
use super::{partition_error, ChannelRead, ConsumedSubpartition, GateError};
use crate::buffer::DataType;
use crate::event::Event;
use crate::metrics::Counter;
use crate::partition::{PartitionError, PartitionManager, SubpartitionView};

/// Where a channel's producer runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChannelLocation {
    /// In this process: read the subpartition view directly.
    Local,
    /// In another process, reached through the transport.
    Remote,
    /// Not known yet (lazy scheduling).
    Unknown,
}

/// Partition-request back-off (Flink's `increaseBackoff`): 0 → initial, then doubling up to
/// the maximum; at the maximum the next increase fails and the request gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// Flink's defaults: 100 ms initial, 10 s maximum.
    pub fn flink_default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// A back-off from `initial` doubling to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            current: Duration::ZERO,
        }
    }

    /// The delay before the next retry.
    pub fn current(&self) -> Duration {
        self.current
    }

    /// Grows the delay; false when it already reached the maximum (give up), or when the
    /// initial delay is zero (no retries: a zero delay would never grow).
    pub fn increase(&mut self) -> bool {
        if self.initial.is_zero() {
            false
        } else if self.current.is_zero() {
            self.current = self.initial;
            true
        } else if self.current < self.max {
            self.current = (self.current * 2).min(self.max);
            true
        } else {
            false
        }
    }
}

/// Counters of one channel (Flink's `numBytesIn`, `numBuffersIn`).
#[derive(Debug, Default)]
pub struct ChannelMetrics {
    /// Bytes of buffers and events read.
    pub num_bytes_in: Counter,
    /// Buffers and events read.
    pub num_buffers_in: Counter,
}

/// A channel of a gate.
#[derive(Debug)]
pub enum InputChannel {
    /// Same process.
    Local(LocalInputChannel),
    /// Other process.
    Remote(RemoteInputChannel),
    /// Location not known yet.
    Unknown(UnknownInputChannel),
}

impl InputChannel {
    /// The subpartition the channel consumes.
    pub fn consumed(&self) -> ConsumedSubpartition {
        match self {
            InputChannel::Local(c) => c.consumed,
            InputChannel::Remote(c) => c.consumed(),
            InputChannel::Unknown(c) => c.consumed,
        }
    }

    /// The channel's counters (none while its location is unknown).
    pub fn metrics(&self) -> Option<&ChannelMetrics> {
        match self {
            InputChannel::Local(c) => Some(&c.metrics),
            InputChannel::Remote(c) => Some(c.metrics()),
            InputChannel::Unknown(_) => None,
        }
    }

    pub(crate) fn request(&mut self, now: Instant) -> Result<(), GateError> {
        match self {
            InputChannel::Local(c) => c.request(now),
            InputChannel::Remote(c) => c.request(),
            InputChannel::Unknown(_) => Ok(()),
        }
    }

    pub(crate) fn next_read(&mut self) -> Result<Option<ChannelRead>, GateError> {
        let read = match self {
            InputChannel::Local(c) => c.next_read()?,
            InputChannel::Remote(c) => c.next_read()?,
            InputChannel::Unknown(_) => None,
        };
        if let (Some(read), Some(metrics)) = (read.as_ref(), self.metrics()) {
            metrics.num_buffers_in.add(1);
            metrics.num_bytes_in.add(read.buffer.len() as u64);
        }
        Ok(read)
    }

    /// True when the channel's next read returns a priority event (a look; it reads nothing).
    pub(crate) fn has_priority_event(&self) -> bool {
        match self {
            InputChannel::Local(c) => {
                c.failed.is_none()
                    && c.view
                        .as_ref()
                        .is_some_and(SubpartitionView::has_priority_event)
            }
            InputChannel::Remote(c) => c.has_priority_event(),
            InputChannel::Unknown(_) => false,
        }
    }

    /// See [`RemoteInputChannel::take_unread_before_priority`]; other channels queue nothing
    /// of their own (a local one reads its producer's queue, where its barrier overtook).
    pub(crate) fn take_unread_before_priority(&mut self) -> usize {
        match self {
            InputChannel::Remote(c) => c.take_unread_before_priority(),
            _ => 0,
        }
    }

    /// See [`RemoteInputChannel::convert_barrier_to_priority`]; a local channel's barrier is
    /// turned in its producer's queue instead (the producer's own timer).
    pub(crate) fn convert_barrier_to_priority(&mut self, checkpoint: u64) -> bool {
        match self {
            InputChannel::Remote(c) => c.convert_barrier_to_priority(checkpoint),
            _ => false,
        }
    }

    /// See [`RemoteInputChannel::announced_barrier`]; a local channel announces nothing (its
    /// producer's own timer turns its barrier).
    pub(crate) fn announced_barrier(&self) -> Option<crate::event::CheckpointBarrier> {
        match self {
            InputChannel::Remote(c) => c.announced_barrier(),
            _ => None,
        }
    }

    /// See [`RemoteInputChannel::for_each_taken_ahead`].
    pub(crate) fn for_each_taken_ahead(&self, f: &mut dyn FnMut(&crate::buffer::Buffer)) {
        if let InputChannel::Remote(c) = self {
            c.for_each_taken_ahead(f);
        }
    }

    pub(crate) fn resume_consumption(&mut self) -> Result<bool, GateError> {
        match self {
            InputChannel::Local(c) => Ok(c.resume_consumption()),
            InputChannel::Remote(c) => {
                c.resume_consumption();
                Ok(false)
            }
            InputChannel::Unknown(c) => Err(GateError::UnknownChannel(c.index)),
        }
    }

    pub(crate) fn release(&mut self) {
        match self {
            InputChannel::Local(c) => c.release(),
            InputChannel::Remote(c) => c.release(),
            InputChannel::Unknown(_) => {}
        }
    }

    /// Fails the channel for good with `error`: every later read returns it, and the channel
    /// lets go of its producer (a local view released, a remote request cancelled).
    pub(crate) fn fail_for_good(&mut self, error: GateError) {
        match self {
            InputChannel::Local(c) => {
                c.release();
                c.failed = Some(error);
                // The next read finds it, as one of a failed request does.
                c.notifier.queue.enqueue(c.index as u32, false);
            }
            InputChannel::Remote(c) => {
                c.shared().fail(error);
                c.release();
            }
            InputChannel::Unknown(_) => {}
        }
    }

    pub(crate) fn retry_due(&self) -> Option<Instant> {
        match self {
            InputChannel::Local(c) => c.retry_at,
            _ => None,
        }
    }
}

/// A channel whose producer runs in this process: it reads the producer's subpartition view
/// directly, so buffers change hands by reference (Flink's `LocalInputChannel`).
pub struct LocalInputChannel {
    index: usize,
    consumed: ConsumedSubpartition,
    manager: Arc<PartitionManager>,
    notifier: Arc<ChannelNotifier>,
    view: Option<SubpartitionView>,
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// Read to its end or released with the gate: never requested again (Flink's
    /// `isReleased` check in `requestSubpartition`).
    released: bool,
    /// Why its partition request failed for good: every later read fails with it.
    failed: Option<GateError>,
    metrics: ChannelMetrics,
    /// Task events sent before the partition was found (its request waits for a retry):
    /// published once it is, in order.
    pending_events: Vec<Event>,
}

/// Task events one local channel keeps for a partition not found yet; the gate refuses more
/// ([`GateError::TaskEventBacklog`](super::GateError::TaskEventBacklog)) rather than hold them
/// without bound.
pub(crate) const MAX_PENDING_LOCAL_EVENTS: usize = 1024;

impl LocalInputChannel {
    /// The view's queue state (or "not requested"), for diagnosing stalls.
    pub fn debug_summary(&self) -> String {
        match &self.view {
            Some(view) => view.debug_summary(),
            None => format!("not requested (retry at {:?})", self.retry_at),
        }
    }
}

impl fmt::Debug for LocalInputChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalInputChannel")
            .field("index", &self.index)
            .field("consumed", &self.consumed)
            .field("requested", &self.view.is_some())
            .field("backoff", &self.backoff)
            .finish()
    }
}

impl LocalInputChannel {
    pub(crate) fn new(
        index: usize,
        consumed: ConsumedSubpartition,
        manager: Arc<PartitionManager>,
        queue: Arc<ChannelQueue>,
        backoff: Backoff,
    ) -> Self {
        Self {
            index,
            consumed,
            manager,
            notifier: Arc::new(ChannelNotifier {
                queue,
                channel: index as u32,
            }),
            view: None,
            backoff,
            retry_at: None,
            released: false,
            failed: None,
            metrics: ChannelMetrics::default(),
            pending_events: Vec::new(),
        }
    }

    /// The delay before the next partition-request retry (zero before the first failure).
    pub fn backoff(&self) -> Duration {
        self.backoff.current()
    }

    /// When the next retry is due, if one is scheduled.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Creates the view on the local producer; a partition not registered yet schedules a
    /// retry after the back-off, and fails once the back-off is exhausted.
    pub(crate) fn request(&mut self, now: Instant) -> Result<(), GateError> {
        if self.view.is_some() || self.released {
            return Ok(());
        }
        self.retry_at = None;
        let listener = self.notifier.clone();
        match self.manager.create_view(
            self.consumed.partition,
            self.consumed.subpartition,
            listener,
        ) {
            Ok(view) => {
                self.failed = None;
                self.view = Some(view);
                for event in std::mem::take(&mut self.pending_events) {
                    self.send_task_event(&event);
                }
                // Data may already be queued: let the gate look once.
                self.notifier.queue.enqueue(self.index as u32, false);
                Ok(())
            }
            Err(PartitionError::PartitionNotFound(id)) => {
                if self.backoff.increase() {
                    self.retry_at = Some(now + self.backoff.current());
                    Ok(())
                } else {
                    Err(self.fail(PartitionError::PartitionNotFound(id)))
                }
            }
            Err(other) => Err(self.fail(other)),
        }
    }

    /// The request failed for good: the error is kept for every later read, and the gate is
    /// told to look (a reader waiting on the gate would otherwise wait for good).
    fn fail(&mut self, source: PartitionError) -> GateError {
        let error = partition_error(self.index, source);
        self.failed = Some(error.clone());
        self.notifier.queue.enqueue(self.index as u32, false);
        error
    }

    fn next_read(&mut self) -> Result<Option<ChannelRead>, GateError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let Some(view) = self.view.as_mut() else {
            return Ok(None);
        };
        if view.is_released() {
            // For good: the view goes now, and with it the buffer it was reading, for which
            // the producer's writer may wait.
            let error = match view.failure_cause() {
                Some(cause) => GateError::ProducerFailed {
                    channel: self.index,
                    cause: cause.to_owned(),
                },
                None => partition_error(self.index, PartitionError::Released),
            };
            self.release();
            self.failed = Some(error.clone());
            return Err(error);
        }
        Ok(view.poll_next().map(|item| ChannelRead {
            more_available: item.next_data_type != DataType::None,
            next_is_priority: item.next_data_type.has_priority(),
            overtaken: item.overtaken,
            buffer: item.buffer,
        }))
    }

    fn resume_consumption(&mut self) -> bool {
        self.view
            .as_mut()
            .is_some_and(|view| view.resume_consumption())
    }

    /// See [`InputGate::acknowledge_all_records_processed`](super::InputGate): straight to
    /// the producer's subpartition.
    pub(crate) fn acknowledge_all_records_processed(&self) {
        if let Some(view) = &self.view {
            view.acknowledge_all_data_processed();
        }
    }

    /// Whether [`send_task_event`](Self::send_task_event) takes one more event now (it holds
    /// at most `MAX_PENDING_LOCAL_EVENTS` for a partition not found yet).
    pub(crate) fn has_task_event_room(&self) -> bool {
        self.view.is_some()
            || self.released
            || self.failed.is_some()
            || self.pending_events.len() < MAX_PENDING_LOCAL_EVENTS
    }

    /// Sends a task event to the producer through the partition manager; before the
    /// partition was found (its request waits for a retry) the event waits for it.
    pub(crate) fn send_task_event(&mut self, event: &Event) {
        if self.released {
            // The channel ended (or was released): its producer hears from this consumer no
            // more, as a remote channel that ended drops them.
            return;
        }
        if self.view.is_none() {
            if self.pending_events.len() < MAX_PENDING_LOCAL_EVENTS {
                self.pending_events.push(event.clone());
            } else {
                tracing::warn!(
                    channel = self.index,
                    "{MAX_PENDING_LOCAL_EVENTS} task events wait for a partition; one dropped"
                );
            }
            return;
        }
        if !self
            .manager
            .publish_task_event(self.consumed.partition, event)
        {
            // Flink fails the task here; the producer never registered for task events.
            tracing::warn!(
                channel = self.index,
                partition = ?self.consumed.partition,
                "no producer listens for task events; one dropped"
            );
        }
    }

    fn release(&mut self) {
        self.view = None;
        self.retry_at = None;
        self.released = true;
        // Events for a producer not found yet go nowhere now.
        self.pending_events.clear();
    }
}

/// A channel whose producer's location is not known yet (Flink's `UnknownInputChannel`); the
/// gate keeps task events for it and replays them once the location is known.
#[derive(Debug)]
pub struct UnknownInputChannel {
    pub(crate) index: usize,
    pub(crate) consumed: ConsumedSubpartition,
}
