//! `SingleInputGate`: the channels consuming one intermediate result, read fairly.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::channel::{
    Backoff, ChannelLocation, InputChannel, LocalInputChannel, UnknownInputChannel,
};
use super::queue::ChannelQueue;
use super::remote::{BufferManager, RemoteInputChannel};
use super::{
    partition_error, BufferOrEvent, ChannelRead, ConsumedSubpartition, EndOfDataStatus, GateError,
    GateItem, InputGate,
};
use crate::buffer::{LocalBufferPool, LocalPoolSpec, NetworkBufferPool, PoolError};
use crate::config::NetworkConfig;
use crate::event::{CheckpointBarrier, Event, StopMode};
use crate::metrics::{InputMetricsSnapshot, WaitTime};
use crate::partition::PartitionManager;

/// Task events a gate keeps for its channels not located yet (each gets them when located);
/// more are refused, as a channel refuses more than it keeps for a producer not reached.
const MAX_PENDING_GATE_EVENTS: usize = super::channel::MAX_PENDING_LOCAL_EVENTS;

/// One channel of a gate as the scheduler describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelSpec {
    /// The subpartition it consumes.
    pub consumed: ConsumedSubpartition,
    /// Where its producer runs (if known).
    pub location: ChannelLocation,
}

/// Gate-level metrics (Flink's `inPoolUsage` comes from [`SingleInputGate::pool_usage`]).
#[derive(Debug, Default)]
pub struct GateMetrics {
    /// Time the reader spent waiting for data, blocking or in an async read, the wait under
    /// way included (`accumulatedIdleTimeMs`).
    pub idle: WaitTime,
}

/// The input gate of one task input (Flink's `SingleInputGate`).
pub struct SingleInputGate {
    specs: Vec<ChannelSpec>,
    channels: Vec<InputChannel>,
    queue: Arc<ChannelQueue>,
    manager: Arc<PartitionManager>,
    network: NetworkBufferPool,
    config: NetworkConfig,
    pool: Option<Arc<LocalBufferPool>>,
    backoff: Backoff,
    requested: bool,
    closed: bool,
    finished: Vec<bool>,
    finished_count: usize,
    /// Channels that delivered EndOfData, or ended without it (FLIP-147).
    end_of_data: Vec<bool>,
    end_of_data_count: usize,
    /// An EndOfData said not to drain.
    stop_without_drain: bool,
    /// Task events sent while some channel's location was unknown.
    pending_events: Vec<Event>,
    metrics: GateMetrics,
    /// Wakes a pending `next_async` for a partition request's retry.
    timer: super::WakeTimer,
    /// Per channel whose producer is not located yet: its exclusive segments, taken at setup
    /// and handed to the channel if it turns remote (back to the pool if it turns local).
    /// Left in the pool, the other channels' floating requests could fill it to its maximum,
    /// and the channel turning remote would find none (it cannot wait: only its own task's
    /// reads, the caller's, would free them).
    reserved: Vec<Vec<crate::buffer::PooledSegment>>,
    /// Created by a shuffle environment, which connects the remote channels: one located as
    /// remote here, without the producer's address, would never be connected.
    connected_by_environment: bool,
    /// When a read next looks for partition-request retries that came due (see
    /// [`retry_due_requests`](Self::retry_due_requests)).
    next_retry_look: Instant,
}

impl fmt::Debug for SingleInputGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SingleInputGate")
            .field("channels", &self.channels)
            .field("requested", &self.requested)
            .field("closed", &self.closed)
            .field("finished", &self.finished_count)
            .finish()
    }
}

impl SingleInputGate {
    /// A gate over `specs`, one channel each (channel `i` is `specs[i]`).
    pub fn new(
        specs: Vec<ChannelSpec>,
        manager: Arc<PartitionManager>,
        network: &NetworkBufferPool,
        config: &NetworkConfig,
    ) -> Self {
        let count = specs.len();
        Self {
            queue: ChannelQueue::new(count),
            channels: Vec::with_capacity(count),
            specs,
            manager,
            network: network.clone(),
            config: config.clone(),
            pool: None,
            backoff: config.request_backoff(),
            requested: false,
            closed: false,
            finished: vec![false; count],
            finished_count: 0,
            end_of_data: vec![false; count],
            end_of_data_count: 0,
            stop_without_drain: false,
            pending_events: Vec::new(),
            metrics: GateMetrics::default(),
            timer: super::WakeTimer::default(),
            reserved: (0..count).map(|_| Vec::new()).collect(),
            connected_by_environment: false,
            next_retry_look: Instant::now(),
        }
    }

    /// Marks the gate as one whose remote channels the environment connects.
    pub(crate) fn set_connected_by_environment(&mut self) {
        self.connected_by_environment = true;
    }

    /// Uses `backoff` for partition-request retries instead of the configured one
    /// (`taskmanager.network.request-backoff.*`, Flink's 100 ms … 10 s by default).
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Creates the gate's pool (exclusive buffers for every channel that is or may become
    /// remote, plus the floating ones) and the channels, and takes the exclusive segments of
    /// every channel that is or may become remote (a channel not located yet keeps them until
    /// it is) and one floating segment the pool keeps for the gate. Blocks while the global pool has no segments for them, up to
    /// `exclusive-buffers-request-timeout-ms` per channel (as Flink's setup does), or until
    /// the gate is closed through a [`closer`](Self::closer) (`GateError::Closed`).
    pub fn setup(&mut self) -> Result<(), GateError> {
        if !self.channels.is_empty() || self.pool.is_some() {
            // Flink: "Bug in input gate setup logic: Already registered buffer pool."
            return Err(GateError::AlreadyRequested);
        }
        // The fields are public, and only the network pool's constructor checked them: an
        // absurd `buffers-per-channel` sized a free list past any memory (an abort).
        self.config
            .validate()
            .map_err(|error| PoolError::Config(error.to_string()))?;
        let non_local = self
            .specs
            .iter()
            .filter(|s| s.location != ChannelLocation::Local)
            .count();
        if non_local > 0 {
            let spec = LocalPoolSpec::for_gate(non_local, &self.config);
            let pool = Arc::new(self.network.create_local_pool(spec)?);
            // A closer (task cancellation) then ends a wait for exclusive segments at once.
            self.queue.wake_on_close(pool.waiters());
            self.pool = Some(pool);
        }
        // Flink's `reserveSegments(1)` (FLINK-24035), before the channels as there: one
        // floating segment is the gate's from setup on. Dropped once the channels took their
        // exclusive segments, it stays in the pool, which keeps free segments while it holds
        // no more than its minimum (the exclusive ones plus this one). Else a channel without
        // exclusive segments (`buffers-per-channel = 0`) could wait, for good, for a pool
        // that took every other segment to give one back.
        let floating = match &self.pool {
            Some(pool) => {
                let queue = &self.queue;
                BufferManager::take_exclusive(pool, 1, self.config.buffer_request_timeout, &|| {
                    queue.is_closed()
                })?
            }
            None => Vec::new(),
        };
        for index in 0..self.specs.len() {
            if self.specs[index].location == ChannelLocation::Unknown {
                let pool = self.pool.clone().ok_or(GateError::UnknownChannel(index))?;
                let queue = &self.queue;
                self.reserved[index] = BufferManager::take_exclusive(
                    &pool,
                    self.config.buffers_per_channel,
                    self.config.buffer_request_timeout,
                    &|| queue.is_closed(),
                )?;
            }
            let mut channel = self.make_channel(index, self.specs[index].location.clone())?;
            // Task events sent before setup.
            for event in &self.pending_events {
                send_event(&mut channel, event);
            }
            self.channels.push(channel);
        }
        // Taken before the channels' exclusive segments, kept by the pool from now on.
        drop(floating);
        if !self
            .channels
            .iter()
            .any(|c| matches!(c, InputChannel::Unknown(_)))
        {
            self.pending_events.clear();
        }
        Ok(())
    }

    /// Requests every channel's subpartition, once. A request that fails returns its error
    /// (Flink fails the task then); the gate does not count as requested, so a later call
    /// tries again (channels already requested are left as they are) instead of returning
    /// `Ok` with channels never requested.
    pub fn request_partitions(&mut self, now: Instant) -> Result<(), GateError> {
        if self.closed {
            return Err(GateError::Closed);
        }
        if self.requested {
            return Ok(());
        }
        if self.channels.len() != self.specs.len() {
            // Flink: "mismatch between number of total input channels and the currently set
            // number" — setup did not run.
            return Err(GateError::UnknownChannel(self.channels.len()));
        }
        for channel in self.channels.iter_mut() {
            channel.request(now)?;
        }
        self.requested = true;
        self.next_retry_look = now;
        Ok(())
    }

    /// Retries the partition requests that came due, as every read does first: a gate whose
    /// other channels always have data must not leave a channel waiting for its partition
    /// until the gate goes idle (the retry came only after a blocking read's wait, and never
    /// from `poll_next` or a read that failed), while that partition's producer fills its
    /// pool and blocks; Flink retries from a timer. One clock read per read (a union reads it
    /// once for its members); the channels are looked at when the earliest retry they had is
    /// due, and at least every `RETRY_CHECK`.
    pub(crate) fn retry_due_requests(&mut self, now: Instant) -> Result<(), GateError> {
        if now < self.next_retry_look {
            return Ok(());
        }
        self.next_retry_look = now + super::RETRY_CHECK;
        if self.poll_timeout().is_some_and(|due| due <= now) {
            InputGate::handle_timeout(self, now)?;
        }
        if let Some(due) = self.poll_timeout() {
            self.next_retry_look = self.next_retry_look.min(due);
        }
        Ok(())
    }

    /// The producer of an unknown channel was located: the channel becomes local or remote,
    /// is requested if partitions were, and receives the pending task events. A channel
    /// turning remote gets the exclusive segments [`setup`](Self::setup) took for it (one
    /// turning local gives them back to the pool), so this does not wait for memory.
    ///
    /// A gate a shuffle environment created refuses to locate a channel as remote here
    /// ([`GateError::LocateThroughEnvironment`]): `ShuffleEnvironment::update_channel` does
    /// that, and connects the channel to its producer.
    pub fn update_channel(
        &mut self,
        index: usize,
        location: ChannelLocation,
        now: Instant,
    ) -> Result<(), GateError> {
        // Only a channel this call would locate: a repeated update, or one of a closed gate,
        // changes nothing, as before.
        if self.connected_by_environment
            && location == ChannelLocation::Remote
            && !self.closed
            && matches!(self.channels.get(index), Some(InputChannel::Unknown(_)))
        {
            return Err(GateError::LocateThroughEnvironment(index));
        }
        self.locate_channel(index, location, now)
    }

    /// [`update_channel`](Self::update_channel) without the environment's check: the
    /// environment connects what this locates as remote.
    pub(crate) fn locate_channel(
        &mut self,
        index: usize,
        location: ChannelLocation,
        now: Instant,
    ) -> Result<(), GateError> {
        if self.closed {
            return Ok(());
        }
        let current = self
            .channels
            .get(index)
            .ok_or(GateError::NoSuchChannel(index))?;
        if !matches!(current, InputChannel::Unknown(_)) || location == ChannelLocation::Unknown {
            return Ok(());
        }
        let mut channel = self.make_channel(index, location)?;
        // A request that fails leaves its error on the channel, which takes the Unknown one's
        // place all the same (as Flink's `updateInputChannel` puts the new channel in before
        // it requests): the gate's reads return the error, as for a channel that failed its
        // first request, and the segments reserved for it are not reserved again.
        let requested = if self.requested {
            self.next_retry_look = now;
            channel.request(now)
        } else {
            Ok(())
        };
        for event in &self.pending_events {
            send_event(&mut channel, event);
        }
        self.channels[index] = channel;
        if !self
            .channels
            .iter()
            .any(|c| matches!(c, InputChannel::Unknown(_)))
        {
            self.pending_events.clear();
        }
        requested
    }

    /// Retries the partition request of a channel now (after the producer said it is running).
    pub fn retrigger_partition_request(
        &mut self,
        index: usize,
        now: Instant,
    ) -> Result<(), GateError> {
        if self.closed {
            return Ok(());
        }
        self.channels
            .get_mut(index)
            .ok_or(GateError::NoSuchChannel(index))?
            .request(now)
    }

    /// When the next due partition-request retry is, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.channels.iter().filter_map(|c| c.retry_due()).min()
    }

    /// Sends a task event to every producer; channels not located yet get it on update, and
    /// channels that ended drop it. Fails with [`GateError::Closed`] once the gate is closed.
    /// Fails with [`GateError::TaskEventBacklog`], sending nothing, while a channel (or the
    /// gate, for channels not located yet) holds 1024 events for a producer not reached yet,
    /// or not reading as fast as they come (a connection queues a quarter MiB of them at most).
    /// Fails with [`GateError::TaskEventTooLarge`], sending nothing, when its encoding is
    /// longer than a segment (`taskmanager.memory.segment-size`): a producer refuses a larger
    /// TaskEventRequest frame as malformed and closes the connection, failing every channel on
    /// it.
    pub fn send_task_event(&mut self, event: &Event) -> Result<(), GateError> {
        // Flink's channels refuse to send once released; a closed gate's are.
        if self.closed || self.queue.is_closed() {
            return Err(GateError::Closed);
        }
        let len = event.encoded_len();
        if len > self.config.segment_size {
            return Err(GateError::TaskEventTooLarge {
                len,
                max: self.config.segment_size,
            });
        }
        // Before setup there are no channels yet: every one gets it when created.
        let held_for_later = self.channels.is_empty()
            || self
                .channels
                .iter()
                .any(|c| matches!(c, InputChannel::Unknown(_)));
        // All or none: a channel that holds as many as it may for a producer not found yet
        // refuses the event for every channel (it was dropped for that one alone, logged,
        // while the send said it went out).
        let backlogged = self.channels.iter().position(|c| match c {
            InputChannel::Local(c) => !c.has_task_event_room(),
            InputChannel::Remote(c) => !c.has_task_event_room(),
            InputChannel::Unknown(_) => false,
        });
        if let Some(channel) = backlogged {
            return Err(GateError::TaskEventBacklog {
                channel: Some(channel),
            });
        }
        if held_for_later && self.pending_events.len() >= MAX_PENDING_GATE_EVENTS {
            return Err(GateError::TaskEventBacklog { channel: None });
        }
        for channel in &mut self.channels {
            send_event(channel, event);
        }
        if held_for_later {
            self.pending_events.push(event.clone());
        }
        Ok(())
    }

    /// Releases every channel, destroys the pool lazily and wakes a blocked reader.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        for channel in self.channels.iter_mut() {
            channel.release();
        }
        self.reserved.iter_mut().for_each(Vec::clear);
        self.pool = None;
        self.queue.close();
    }

    /// A handle that closes the gate from another thread (task cancellation): a reader blocked
    /// in [`next`](InputGate::next) wakes with [`GateError::Closed`].
    pub fn closer(&self) -> GateCloser {
        GateCloser::new(self.queue.clone())
    }

    /// The priority-availability signal: a channel waits in the priority lane, normally for a
    /// priority event (an unaligned barrier), which the next read returns ahead of any data.
    /// An entry can outlive its event (a read of the channel from the data lane took the event
    /// first); the next read then returns that channel's next item.
    pub fn priority_available(&self) -> bool {
        self.queue.has_priority()
    }

    /// The channel queue's state, for diagnosing stalls.
    pub fn debug_summary(&self) -> String {
        let mut out = format!(
            "gate: {} finished of {}, queue [{}]",
            self.finished_count,
            self.specs.len(),
            self.queue.debug_summary()
        );
        if let Some(pool) = &self.pool {
            out.push_str(&format!("; pool {pool:?}"));
        }
        for (index, channel) in self.channels.iter().enumerate() {
            if let InputChannel::Local(local) = channel {
                out.push_str(&format!(
                    "; ch{index}: finished {} local [{}]",
                    self.finished[index],
                    local.debug_summary()
                ));
            }
            if let InputChannel::Remote(remote) = channel {
                let shared = remote.shared();
                out.push_str(&format!(
                    "; ch{index}: finished {} queued {} {:?} next-seq {} retries {}",
                    self.finished[index],
                    shared.queued(),
                    shared.buffers(),
                    shared.expected_sequence(),
                    shared.request_retries()
                ));
            }
        }
        out
    }

    /// A local channel (for inspection: its back-off and retry time).
    pub fn local_channel(&self, index: usize) -> Option<&LocalInputChannel> {
        match self.channels.get(index) {
            Some(InputChannel::Local(c)) => Some(c),
            _ => None,
        }
    }

    /// A remote channel (the transport attaches to it).
    pub fn remote_channel(&self, index: usize) -> Option<&RemoteInputChannel> {
        match self.channels.get(index) {
            Some(InputChannel::Remote(c)) => Some(c),
            _ => None,
        }
    }

    /// A channel.
    pub fn channel(&self, index: usize) -> Option<&InputChannel> {
        self.channels.get(index)
    }

    /// `inPoolUsage` as Flink computes it: segments of the gate's pool that hold data, over the
    /// pool's maximum. Segments a remote channel holds free, as credit for data to come, are
    /// not in use (Flink's exclusive and floating usage gauges leave them out too), so a gate
    /// whose channels wait for data reads 0, not `buffers-per-channel` per channel.
    pub fn pool_usage(&self) -> f64 {
        let usage = self.segment_usage();
        if usage.max == 0 {
            return 0.0;
        }
        usage.in_use as f64 / usage.max as f64
    }

    /// How the gate's pool is used, split as Flink's gauges split it: segments holding data,
    /// and of those the remote channels' exclusive ones and the floating ones, each beside
    /// its total. All 0 without a pool. Not holding data: what remote channels hold free as
    /// credit, and the exclusive segments reserved for channels not located yet (an unknown
    /// channel holds no buffers in Flink; here it keeps its remote successor's), which count
    /// in no total but the pool's.
    pub(crate) fn segment_usage(&self) -> SegmentUsage {
        let Some(pool) = &self.pool else {
            return SegmentUsage::default();
        };
        let (mut credit, mut exclusive_used, mut exclusive_total) = (0, 0, 0);
        for channel in &self.channels {
            if let InputChannel::Remote(remote) = channel {
                let buffers = remote.shared().buffers();
                // Each free count read once: a recycle between two reads of one count would
                // count a segment both free and in use.
                let (exclusive_free, total) = buffers.exclusive_free_and_total();
                credit += exclusive_free + buffers.floating_free();
                // A released channel gave its segments back: it has none to count.
                if !remote.shared().is_released() {
                    exclusive_used += total - exclusive_free;
                    exclusive_total += total;
                }
            }
        }
        let reserved: usize = self.reserved.iter().map(Vec::len).sum();
        let in_use = pool.in_use_segments().saturating_sub(credit + reserved);
        let max = pool.spec().max_segments;
        SegmentUsage {
            in_use,
            max,
            exclusive_used,
            exclusive_total,
            floating_total: max.saturating_sub(exclusive_total + reserved),
        }
    }

    /// The gate's pool, if it has remote channels.
    pub fn pool(&self) -> Option<&Arc<LocalBufferPool>> {
        self.pool.as_ref()
    }

    /// Idle time and other gate metrics.
    pub fn metrics(&self) -> &GateMetrics {
        &self.metrics
    }

    /// The gate's metrics now, with Flink's names: `numBytesIn` and `numBuffersIn` summed over
    /// the channels, `inPoolUsage` and the idle time.
    pub fn metrics_snapshot(&self) -> InputMetricsSnapshot {
        let mut snapshot = InputMetricsSnapshot {
            idle_time_ms: self.metrics.idle.total_ms(),
            ..InputMetricsSnapshot::default()
        };
        self.segment_usage().set_usages(&mut snapshot);
        self.add_channel_counts(&mut snapshot);
        snapshot
    }

    /// Adds the channels' counts (`numBytesIn`, `numBuffersIn`, their local and remote
    /// parts, `inputQueueLength`) to `snapshot`.
    pub(crate) fn add_channel_counts(&self, snapshot: &mut InputMetricsSnapshot) {
        for channel in &self.channels {
            let Some(m) = channel.metrics() else {
                continue;
            };
            let (bytes, buffers) = (m.num_bytes_in.get(), m.num_buffers_in.get());
            snapshot.num_bytes_in += bytes;
            snapshot.num_buffers_in += buffers;
            match channel {
                InputChannel::Remote(remote) => {
                    snapshot.num_bytes_in_remote += bytes;
                    snapshot.num_buffers_in_remote += buffers;
                    snapshot.input_queue_length += remote.shared().queued() as u64;
                }
                _ => {
                    snapshot.num_bytes_in_local += bytes;
                    snapshot.num_buffers_in_local += buffers;
                }
            }
        }
    }

    /// True after `close`.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Waits for the next item without blocking the thread (any executor). A partition
    /// request waiting for its retry (a local partition not registered yet) is retried here
    /// when due, as a blocking read's wait retries it.
    pub async fn next_async(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        let timer = self.timer.clone();
        super::read_async(self, timer).await
    }

    pub(crate) fn queue(&self) -> &Arc<ChannelQueue> {
        &self.queue
    }

    fn make_channel(
        &mut self,
        index: usize,
        location: ChannelLocation,
    ) -> Result<InputChannel, GateError> {
        let consumed = self.specs[index].consumed;
        // A located channel's reservation: its own if remote, the pool's again if local.
        let reserved = std::mem::take(&mut self.reserved[index]);
        Ok(match location {
            ChannelLocation::Local => InputChannel::Local(LocalInputChannel::new(
                index,
                consumed,
                self.manager.clone(),
                self.queue.clone(),
                self.backoff,
            )),
            ChannelLocation::Remote => {
                let pool = self.pool.clone().ok_or(GateError::UnknownChannel(index))?;
                let max = pool.spec().max_segments;
                let queue = &self.queue;
                // As in Flink, one channel may borrow every floating segment of its gate (a
                // skewed input's hot channel): `max-buffers-per-channel` bounds subpartitions,
                // not input channels.
                let max_floating = self.config.floating_buffers_per_gate.max(1);
                let buffers = if reserved.is_empty() {
                    BufferManager::new_unless(
                        index,
                        pool,
                        self.config.buffers_per_channel,
                        max_floating,
                        self.config.buffer_request_timeout,
                        &|| queue.is_closed(),
                    )?
                } else {
                    BufferManager::with_segments(index, pool, reserved, max_floating)
                };
                InputChannel::Remote(RemoteInputChannel::new(
                    index,
                    consumed,
                    self.queue.clone(),
                    buffers,
                    max,
                    self.config.buffers_per_channel + self.config.floating_buffers_per_gate,
                ))
            }
            ChannelLocation::Unknown => {
                self.reserved[index] = reserved;
                InputChannel::Unknown(UnknownInputChannel { index, consumed })
            }
        })
    }

    /// A channel read that left more: back to the tail (or the priority lane), so a busy
    /// channel cannot starve the others.
    fn queue_again(&self, index: usize, more_available: bool, next_is_priority: bool) {
        if more_available || next_is_priority {
            self.queue.enqueue(index as u32, next_is_priority);
        }
    }

    /// Turns one channel read into a gate item, handling EndOfPartition.
    fn on_read(&mut self, index: usize, read: ChannelRead) -> Result<BufferOrEvent, GateError> {
        let ChannelRead {
            buffer,
            more_available,
            next_is_priority,
            overtaken,
        } = read;
        let data_type = buffer.data_type();
        let item = if data_type.is_buffer() {
            GateItem::Buffer(buffer)
        } else {
            let decoded = Event::decode(buffer.as_slice())
                .and_then(|event| event.check_buffer_type(data_type).map(|()| event));
            let event = match decoded {
                Ok(event) => event,
                Err(source) => {
                    let error = GateError::Event {
                        channel: index,
                        source,
                    };
                    if data_type.is_blocking_upstream() {
                        // Its producer stopped behind it until a resume that no reader will
                        // ask for (the barrier is lost): the channel could deliver nothing
                        // more, so after this read it fails for good rather than go quiet.
                        self.channels[index].fail_for_good(GateError::Transport {
                            channel: index,
                            reason: format!(
                                "stopped behind a blocking event that did not decode: {error}"
                            ),
                        });
                    } else {
                        // What the channel holds behind the bad event stays readable: queued
                        // again as after any item, or a reader that reads on waits for good.
                        self.queue_again(index, more_available, next_is_priority);
                    }
                    return Err(error);
                }
            };
            GateItem::Event {
                event,
                priority: data_type.has_priority(),
            }
        };
        match &item {
            GateItem::Event {
                event: Event::EndOfPartition,
                ..
            } => {
                if !self.finished[index] {
                    self.finished[index] = true;
                    self.finished_count += 1;
                }
                self.note_end_of_data(index, None);
                self.channels[index].release();
            }
            GateItem::Event {
                event: Event::EndOfData(mode),
                ..
            } => {
                self.note_end_of_data(index, Some(*mode));
                self.queue_again(index, more_available, next_is_priority);
            }
            _ => self.queue_again(index, more_available, next_is_priority),
        }
        Ok(BufferOrEvent {
            channel: index,
            item,
            more_available: self.queue.has_channels(),
            overtaken,
        })
    }
}

/// [`SingleInputGate::segment_usage`]: summed over a union's members, it gives the union's.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SegmentUsage {
    pub(crate) in_use: usize,
    pub(crate) max: usize,
    pub(crate) exclusive_used: usize,
    pub(crate) exclusive_total: usize,
    pub(crate) floating_total: usize,
}

impl SegmentUsage {
    pub(crate) fn add(&mut self, other: SegmentUsage) {
        self.in_use += other.in_use;
        self.max += other.max;
        self.exclusive_used += other.exclusive_used;
        self.exclusive_total += other.exclusive_total;
        self.floating_total += other.floating_total;
    }

    /// `inPoolUsage`, `inputExclusiveBuffersUsage` and `inputFloatingBuffersUsage` (each 0
    /// over a total of 0).
    pub(crate) fn set_usages(&self, snapshot: &mut InputMetricsSnapshot) {
        let ratio = |used: usize, total: usize| {
            if total == 0 {
                0.0
            } else {
                used as f64 / total as f64
            }
        };
        snapshot.in_pool_usage = ratio(self.in_use, self.max);
        snapshot.input_exclusive_buffers_usage = ratio(self.exclusive_used, self.exclusive_total);
        // Segments holding data are the exclusive ones holding data and floating ones.
        let floating_used = self.in_use.saturating_sub(self.exclusive_used);
        snapshot.input_floating_buffers_usage = ratio(floating_used, self.floating_total);
    }
}

fn send_event(channel: &mut InputChannel, event: &Event) {
    match channel {
        InputChannel::Local(c) => {
            c.send_task_event(event);
        }
        InputChannel::Remote(c) => c.send_task_event(event),
        InputChannel::Unknown(_) => {}
    }
}

impl SingleInputGate {
    /// One read of channel `index`; `Ok(None)` when it has nothing now.
    fn read_channel(&mut self, index: usize) -> Result<Option<ChannelRead>, GateError> {
        self.channels[index].next_read().inspect_err(|_| {
            // A failed channel keeps its error (a released view, a failed remote channel):
            // queued again, it fails the next read too, as Flink's channel keeps its cause,
            // instead of leaving that read waiting for good.
            self.queue.enqueue(index as u32, false);
        })
    }

    /// `channel` delivered EndOfData (`mode`), or ended (`None`: no record follows an end
    /// either).
    fn note_end_of_data(&mut self, channel: usize, mode: Option<StopMode>) {
        if mode == Some(StopMode::NoDrain) {
            self.stop_without_drain = true;
        }
        if !self.end_of_data[channel] {
            self.end_of_data[channel] = true;
            self.end_of_data_count += 1;
        }
    }
}

/// Closes a gate from any thread; see [`SingleInputGate::closer`] and
/// [`UnionInputGate::closer`](super::UnionInputGate::closer).
#[derive(Clone, Debug)]
pub struct GateCloser {
    queue: Arc<ChannelQueue>,
    /// A union's member gates: closed too, so a member's wait for exclusive segments (its
    /// setup, a channel turning remote) ends as well.
    members: Vec<Arc<ChannelQueue>>,
}

impl GateCloser {
    pub(crate) fn new(queue: Arc<ChannelQueue>) -> Self {
        Self::with_members(queue, Vec::new())
    }

    pub(crate) fn with_members(queue: Arc<ChannelQueue>, members: Vec<Arc<ChannelQueue>>) -> Self {
        Self { queue, members }
    }

    /// Closes the gate: the reader's next read fails with [`GateError::Closed`] and releases
    /// the channels.
    pub fn close(&self) {
        self.queue.close();
        for member in &self.members {
            member.close();
        }
    }
}

impl InputGate for SingleInputGate {
    fn poll_next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if self.queue.is_closed() {
            self.close();
        }
        if self.closed {
            return Err(GateError::Closed);
        }
        self.retry_due_requests(Instant::now())?;
        // Each channel is in the queue at most once per lane, so this bounds spurious entries.
        for _ in 0..=2 * self.channels.len() {
            let Some((index, _priority)) = self.queue.pop() else {
                return Ok(None);
            };
            let index = index as usize;
            if self.finished[index] {
                continue;
            }
            let Some(read) = self.read_channel(index)? else {
                continue;
            };
            return self.on_read(index, read).map(Some);
        }
        Ok(None)
    }

    fn poll_priority_event(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if self.queue.is_closed() {
            self.close();
        }
        if self.closed {
            return Err(GateError::Closed);
        }
        // Each channel is in the priority lane at most once, so this bounds stale entries.
        for _ in 0..=self.channels.len() {
            let Some(index) = self.queue.pop_priority() else {
                return Ok(None);
            };
            let index = index as usize;
            if self.finished[index] {
                continue;
            }
            if !self.channels[index].has_priority_event() {
                // Stale: the event was read in the channel's turn for data (which queued the
                // channel again for what it still holds), or the channel failed, which its
                // next read reports. Either way it is looked at in the data lane.
                self.queue.enqueue(index as u32, false);
                continue;
            }
            let Some(read) = self.read_channel(index)? else {
                continue;
            };
            return self.on_read(index, read).map(Some);
        }
        Ok(None)
    }

    fn has_priority_event(&self) -> bool {
        self.queue.has_priority()
    }

    fn end_of_data_status(&self) -> EndOfDataStatus {
        if self.end_of_data_count < self.specs.len() {
            EndOfDataStatus::NotEndOfData
        } else if self.stop_without_drain {
            EndOfDataStatus::Stopped
        } else {
            EndOfDataStatus::Drained
        }
    }

    fn acknowledge_all_records_processed(&mut self, channel: usize) -> Result<(), GateError> {
        if self.finished.get(channel).copied().unwrap_or(false) {
            // Ended: its producer finished, and waits for nothing.
            return Ok(());
        }
        match self.channels.get_mut(channel) {
            None => Err(GateError::NoSuchChannel(channel)),
            Some(InputChannel::Local(c)) => {
                c.acknowledge_all_records_processed();
                Ok(())
            }
            Some(InputChannel::Remote(c)) => {
                c.acknowledge_all_records_processed();
                Ok(())
            }
            Some(InputChannel::Unknown(_)) => Err(GateError::UnknownChannel(channel)),
        }
    }

    fn next_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<BufferOrEvent>, GateError> {
        super::read_until(
            self,
            deadline,
            SingleInputGate::poll_timeout,
            |gate, sleep| gate.queue.wait(sleep),
        )
    }

    fn resume_consumption(&mut self, channel: usize) -> Result<(), GateError> {
        let readable = self
            .channels
            .get_mut(channel)
            .ok_or(GateError::NoSuchChannel(channel))?
            .resume_consumption()?;
        if readable {
            self.queue.enqueue(channel as u32, false);
        }
        Ok(())
    }

    fn channel_count(&self) -> usize {
        self.specs.len()
    }

    fn take_unread_before_priority(&mut self, channel: usize) -> usize {
        self.channels
            .get_mut(channel)
            .map_or(0, InputChannel::take_unread_before_priority)
    }

    fn for_each_new_announcement(
        &mut self,
        rescan: bool,
        f: &mut dyn FnMut(usize, CheckpointBarrier),
    ) {
        // The flag is taken on a rescan too: the scan reports what it stood for.
        let announced = self.queue.take_announced();
        if !announced && !rescan {
            return;
        }
        for (index, channel) in self.channels.iter().enumerate() {
            if self.finished.get(index).copied().unwrap_or(true) {
                continue;
            }
            if let Some(barrier) = channel.announced_barrier() {
                f(index, barrier);
            }
        }
    }

    fn convert_barrier_to_priority(&mut self, channel: usize, checkpoint: u64) -> bool {
        !self.finished.get(channel).copied().unwrap_or(true)
            && self
                .channels
                .get_mut(channel)
                .is_some_and(|c| c.convert_barrier_to_priority(checkpoint))
    }

    fn for_each_taken_ahead(&self, channel: usize, f: &mut dyn FnMut(&crate::buffer::Buffer)) {
        if let Some(c) = self.channels.get(channel) {
            c.for_each_taken_ahead(f);
        }
    }

    fn is_finished(&self) -> bool {
        self.finished_count == self.specs.len()
    }

    fn is_channel_finished(&self, channel: usize) -> bool {
        self.finished.get(channel).copied().unwrap_or(true)
    }

    fn poll_timeout(&self) -> Option<Instant> {
        SingleInputGate::poll_timeout(self)
    }

    fn register_waker(&self, waker: &std::task::Waker) -> bool {
        self.queue.register_waker(waker)
    }

    fn idle_time(&self) -> &WaitTime {
        &self.metrics.idle
    }

    fn handle_timeout(&mut self, now: Instant) -> Result<(), GateError> {
        // A closed gate requests nothing more: a cancelled task is not a failed request, and
        // a partition found now would be given a view no one releases. Closed from another
        // thread: the channels are released here, on the reader, as `poll_next` does (the
        // blocking read comes here first after the close woke it).
        if self.queue.is_closed() {
            self.close();
        }
        if self.closed {
            return Err(GateError::Closed);
        }
        for index in 0..self.channels.len() {
            if self.channels[index]
                .retry_due()
                .is_some_and(|due| due <= now)
            {
                self.channels[index].request(now).map_err(|e| match e {
                    GateError::Partition { source, .. } => partition_error(index, source),
                    other => other,
                })?;
            }
        }
        Ok(())
    }
}

impl Drop for SingleInputGate {
    fn drop(&mut self) {
        self.close();
    }
}
