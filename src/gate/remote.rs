//! The consumer's side of a remote channel, IO-free: the buffers it may receive into (its
//! credit), the buffers received, and the sequence check. The transport (I/O thread) calls
//! [`RemoteChannelShared`]; the gate (task thread) reads through [`RemoteInputChannel`].
//!
//! Credit as Flink counts it: the channel owns `buffers-per-channel` exclusive segments and
//! borrows floating ones from the gate's pool when the sender announces a backlog. Every
//! segment it holds free is one credit. Credit is *unannounced* until the transport sends it
//! in an AddCredit message; exactly one announcement is due when it goes from 0 to positive.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use super::channel::ChannelMetrics;
use super::lane::SpillQueue;
use super::queue::ChannelQueue;
use super::{ChannelRead, ConsumedSubpartition, GateError};
use crate::buffer::segment_internals::{FreeList, SegmentMemory};
use crate::buffer::{Buffer, BufferListener, LocalBufferPool, PooledSegment, Recycler, Segment};
use crate::event::{CheckpointBarrier, Event};
use crate::sync::{
    fence, ArrayQueue, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Mutex, Ordering,
};

/// Told when a channel has something for the transport to send: credit to announce, a
/// resume-consumption request, or a release.
pub trait CreditListener: Send + Sync {
    /// Channel `channel` wants the transport's attention.
    fn on_channel_ready(&self, channel: usize);
}

struct ListenerSlot(Arc<dyn CreditListener>);

/// A remote channel's segments and credit (Flink's `BufferManager` plus the channel's
/// unannounced credit).
pub struct BufferManager {
    me: Weak<BufferManager>,
    channel: usize,
    /// The gate's pool, for floating segments. Weak on purpose: the gate owns the pool and
    /// drops it on close, which destroys it (its free segments and guaranteed minimum go back
    /// to the global pool). A strong reference here kept a closed gate's pool alive for as
    /// long as anyone held the channel (the transport's `Arc<RemoteChannelShared>`, a buffer
    /// still in flight), pinning up to its minimum of segments in the global pool.
    pool: Weak<LocalBufferPool>,
    /// Where exclusive segments came from and go back to on release (the gate's pool).
    origin: Arc<dyn Recycler>,
    exclusive_free: FreeList,
    exclusive_total: usize,
    floating: ArrayQueue<PooledSegment>,
    /// Segments wanted: the sender's backlog plus the exclusive ones.
    required: AtomicUsize,
    /// Registered at the gate's pool as a listener for a floating segment, or about to ask:
    /// claimed by exchange, so the channel never has two registrations (the pool has one
    /// listener slot per channel). Cleared only before `required` is read again (see
    /// [`on_segment_available`](BufferListener::on_segment_available)), or once the pool is
    /// gone.
    waiting_for_floating: AtomicBool,
    unannounced_credit: AtomicU32,
    /// Held (only by a channel without exclusive segments) while floating segments become
    /// credit and while [`release_floating`](Self::release_floating) stops that, so no
    /// segment slips in as credit after the release.
    floating_credit: Mutex<()>,
    /// The floating segments were given back for a blocked sender and consumption has not
    /// resumed since (changed under `floating_credit`).
    floating_released: AtomicBool,
    released: AtomicBool,
    listener: ArcSwapOption<ListenerSlot>,
}

/// A manager dropped without [`release`](BufferManager::release) (the gate always releases
/// first; a caller of the public constructor may not) gives its free exclusive segments back
/// too: they are bare segment handles, which nothing else returns. Leased ones come back
/// before: each lease holds the manager.
impl Drop for BufferManager {
    fn drop(&mut self) {
        while let Some(segment) = self.exclusive_free.pop() {
            self.origin.recycle(segment);
        }
    }
}

impl fmt::Debug for BufferManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferManager")
            .field("channel", &self.channel)
            .field("exclusive_free", &self.exclusive_free.len())
            .field("floating", &self.floating.len())
            .field("unannounced_credit", &self.unannounced_credit())
            .field("required", &self.required.load(Ordering::Relaxed))
            .field("waiting_for_floating", &self.is_waiting_for_floating())
            .field(
                "floating_released",
                &self.floating_released.load(Ordering::Relaxed),
            )
            .finish()
    }
}

impl BufferManager {
    /// Takes `exclusive` segments from the gate's pool for channel `channel`, waiting up to
    /// `timeout` in all (Flink's `exclusive-buffers-request-timeout-ms`) while the global
    /// pool has none: the gate's pool is admitted for them, but other pools may hold the
    /// global pool's segments for a while (a back-pressured partition grown past its minimum
    /// gives them back as it drains). A gate pool at its own maximum (its other channels hold
    /// floating segments) fails at once instead: only this gate's task, the caller, could
    /// return those.
    pub fn new(
        channel: usize,
        pool: Arc<LocalBufferPool>,
        exclusive: usize,
        max_floating: usize,
        timeout: Duration,
    ) -> Result<Arc<Self>, GateError> {
        Self::new_unless(channel, pool, exclusive, max_floating, timeout, &|| false)
    }

    /// [`new`](Self::new), whose wait ends with [`GateError::Closed`] once `closed` holds
    /// (the gate was closed from another thread, which wakes the pool's waiters).
    pub(crate) fn new_unless(
        channel: usize,
        pool: Arc<LocalBufferPool>,
        exclusive: usize,
        max_floating: usize,
        timeout: Duration,
        closed: &dyn Fn() -> bool,
    ) -> Result<Arc<Self>, GateError> {
        let segments = Self::take_exclusive(&pool, exclusive, timeout, closed)?;
        Ok(Self::with_segments(channel, pool, segments, max_floating))
    }

    /// The `exclusive` segments of one channel, taken from the gate's pool as
    /// [`new`](Self::new) takes them.
    pub(crate) fn take_exclusive(
        pool: &LocalBufferPool,
        exclusive: usize,
        timeout: Duration,
        closed: &dyn Fn() -> bool,
    ) -> Result<Vec<crate::buffer::PooledSegment>, GateError> {
        let mut segments = Vec::with_capacity(exclusive);
        // A timeout beyond what the clock can count waits without a deadline.
        let deadline = Instant::now().checked_add(timeout);
        for _ in 0..exclusive {
            let segment = if pool.requested_segments() >= pool.spec().max_segments {
                pool.request_segment()
            } else {
                match pool.request_segment_blocking_unless(
                    deadline.map_or(timeout, |deadline| {
                        deadline.saturating_duration_since(Instant::now())
                    }),
                    closed,
                ) {
                    Ok(segment) => Some(segment),
                    Err(
                        crate::buffer::PoolError::Destroyed | crate::buffer::PoolError::Cancelled,
                    ) => return Err(GateError::Closed),
                    Err(_) => None,
                }
            };
            // None, or none after the wait: "insufficient network buffers", as Flink reports
            // it. Segments already taken go back to the pool when `segments` drops.
            let Some(segment) = segment else {
                return Err(GateError::Pool(crate::buffer::PoolError::Insufficient {
                    required: exclusive,
                    available: segments.len(),
                    total: pool.spec().max_segments,
                    segment_size: segments
                        .first()
                        .map_or(0, crate::buffer::PooledSegment::capacity),
                }));
            };
            segments.push(segment);
        }
        Ok(segments)
    }

    /// A channel's manager over its exclusive `segments`, taken already.
    pub(crate) fn with_segments(
        channel: usize,
        pool: Arc<LocalBufferPool>,
        segments: Vec<crate::buffer::PooledSegment>,
        max_floating: usize,
    ) -> Arc<Self> {
        let exclusive = segments.len();
        let origin = pool.recycler();
        let manager = Arc::new_cyclic(|me| {
            let exclusive_free = FreeList::with_capacity(exclusive);
            for segment in segments {
                if exclusive_free.push(segment.into_segment()).is_err() {
                    unreachable!("sized for every exclusive segment");
                }
            }
            BufferManager {
                me: me.clone(),
                channel,
                pool: Arc::downgrade(&pool),
                origin,
                exclusive_free,
                exclusive_total: exclusive,
                floating: ArrayQueue::new(max_floating.max(1)),
                required: AtomicUsize::new(exclusive),
                waiting_for_floating: AtomicBool::new(false),
                unannounced_credit: AtomicU32::new(0),
                floating_credit: Mutex::new(()),
                floating_released: AtomicBool::new(false),
                released: AtomicBool::new(false),
                listener: ArcSwapOption::empty(),
            }
        });
        manager
    }

    /// Credit to announce in the partition request: the exclusive segments.
    pub fn initial_credit(&self) -> u32 {
        self.exclusive_total as u32
    }

    /// Segments free to receive into now.
    pub fn available(&self) -> usize {
        self.exclusive_free.len() + self.floating.len()
    }

    /// The channel's exclusive segments free now (as credit), and all of them (Flink's
    /// `getInitialCredit`; the difference is its `unsynchronizedGetExclusiveBuffersUsed`).
    pub fn exclusive_free_and_total(&self) -> (usize, usize) {
        let free = self.exclusive_free.len().min(self.exclusive_total);
        (free, self.exclusive_total)
    }

    /// Floating segments the channel holds free now (as credit).
    pub fn floating_free(&self) -> usize {
        self.floating.len()
    }

    /// True while the channel is registered at the gate's pool for a floating segment (or
    /// asking for one right now).
    pub fn is_waiting_for_floating(&self) -> bool {
        self.waiting_for_floating.load(Ordering::SeqCst)
    }

    /// Credit granted but not yet announced to the sender.
    pub fn unannounced_credit(&self) -> u32 {
        self.unannounced_credit.load(Ordering::Acquire)
    }

    /// Takes the unannounced credit for an AddCredit message (the transport's call).
    pub fn take_unannounced_credit(&self) -> u32 {
        self.unannounced_credit.swap(0, Ordering::AcqRel)
    }

    /// A free segment to receive the next buffer into: floating first (so it returns to the
    /// shared pool sooner), then exclusive. `None` means the sender exceeded its credit.
    pub fn take_segment(&self) -> Option<PooledSegment> {
        if let Some(segment) = self.floating.pop() {
            return Some(segment);
        }
        let segment = self.exclusive_free.pop()?;
        let me: Arc<dyn Recycler> = self.me.upgrade()?;
        Some(PooledSegment::new(me, segment))
    }

    /// A segment for an incoming event of `size` bytes: events need no credit, so it comes
    /// from outside the gate's quota, as Flink reads events into unpooled memory: an
    /// overdraft segment of the global pool, or with the whole network memory in use, memory
    /// mapped for this event alone (not the gate's own free segments: its channels waiting for
    /// floating ones need those). A barrier that arrives while back pressure holds every
    /// segment must not fail its channel. That memory stays bounded: the transport takes it
    /// only while the channel holds fewer than [`UNCREDITED_EVENTS`] events unread.
    pub fn event_segment(&self, size: usize) -> Option<PooledSegment> {
        // `None` once the gate closed (the pool is gone; the channel takes nothing more).
        let pool = self.pool.upgrade()?;
        pool.request_overdraft_segment()
            .or_else(|| match PooledSegment::unpooled(size) {
                Ok(segment) => Some(segment),
                Err(error) => {
                    tracing::warn!(%error, size, "no memory for an incoming event");
                    None
                }
            })
    }

    /// The sender has `backlog` buffers queued: ask the gate's pool for floating segments up to
    /// backlog + exclusive, registering as a listener when it has none. A backlog of 0 only
    /// lowers what the channel wants (surplus floating segments go back as they come free);
    /// its exclusive segments are the credit for whatever the sender queues next.
    pub fn on_sender_backlog(&self, backlog: usize) {
        // SeqCst, with the flag's SeqCst compare_exchange in `request_floating`: either this
        // thread finds the flag cleared and asks itself, or the thread that cleared it reads
        // this store (store then load on both sides, Dekker's pattern).
        self.required.store(
            backlog.saturating_add(self.exclusive_total),
            Ordering::SeqCst,
        );
        if backlog > 0 {
            self.request_floating();
        }
    }

    /// The sender blocked after an aligned barrier. A channel without exclusive segments gives
    /// its floating ones back to the gate's pool, as Flink's `onBlockingUpstream` does: the
    /// blocked sender cannot use the credit they stand for, and the other channels may need
    /// them to bring their own barriers (with one floating segment and no exclusive ones, at
    /// once). The credit is taken back when consumption resumes: see
    /// [`forget_unannounced_credit`](Self::forget_unannounced_credit) and the sender's reset.
    pub fn release_floating(&self) {
        if self.exclusive_total > 0 {
            return;
        }
        {
            let _guard = self.floating_credit.lock().expect("not poisoned");
            // From here no segment becomes credit: `keep_floating` finds enough.
            self.required.store(0, Ordering::SeqCst);
            self.floating_released.store(true, Ordering::Release);
        }
        // Dropped outside the lock: a recycle may offer a segment to this channel again.
        while let Some(segment) = self.floating.pop() {
            drop(segment);
        }
    }

    /// Consumption resumes after an aligned barrier: credit counted before the floating
    /// segments were released and not announced yet stands for segments no longer held, so a
    /// channel without exclusive segments drops it (the sender resets its credit to 0 on
    /// ResumeConsumption). Flink's `RemoteInputChannel::resumeConsumption`. A resume with no
    /// release before it (the sender never blocked) keeps the credit: the segments are held.
    pub fn forget_unannounced_credit(&self) {
        if self.exclusive_total > 0 {
            return;
        }
        let _guard = self.floating_credit.lock().expect("not poisoned");
        if self.floating_released.swap(false, Ordering::AcqRel) {
            self.unannounced_credit.store(0, Ordering::Release);
        }
    }

    /// Returns every segment; later recycles go straight back to the gate's pool.
    pub fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        while self.floating.pop().is_some() {}
        while let Some(segment) = self.exclusive_free.pop() {
            self.origin.recycle(segment);
        }
    }

    pub(crate) fn set_listener(&self, listener: Arc<dyn CreditListener>) {
        self.listener.store(Some(Arc::new(ListenerSlot(listener))));
    }

    fn request_floating(&self) {
        let mut announce = false;
        while !self.released.load(Ordering::SeqCst)
            && self.available() < self.required.load(Ordering::SeqCst)
        {
            let me: Option<Arc<dyn BufferListener>> =
                self.me.upgrade().map(|m| m as Arc<dyn BufferListener>);
            let Some(me) = me else { break };
            // Gone once the gate closed: no more floating segments.
            let Some(pool) = self.pool.upgrade() else {
                break;
            };
            // Claimed, not just looked at: the transport (a backlog) and a recycling task (a
            // listener told of a segment, still short) both get here, and two that both found
            // the flag clear registered twice. The pool has one listener slot per channel, so
            // another channel's registration then found the slots taken and that channel
            // stopped asking, with a segment free in the pool and its sender out of credit.
            if self
                .waiting_for_floating
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                break; // registered already, or another thread is asking right now
            }
            match pool.request_segment_or_listen(&me) {
                Ok(Some(segment)) => {
                    self.waiting_for_floating.store(false, Ordering::SeqCst);
                    match self.keep_floating(segment) {
                        Ok(first) => announce |= first,
                        Err(segment) => {
                            drop(segment);
                            break;
                        }
                    }
                }
                // Registered: the pool calls `on_segment_available` later.
                Ok(None) => break,
                Err(error) => {
                    // Only a destroyed pool: with one registration per channel the listener
                    // slots cannot run out.
                    debug_assert!(
                        matches!(error, crate::buffer::PoolError::Destroyed),
                        "channel {}: {error}",
                        self.channel
                    );
                    self.waiting_for_floating.store(false, Ordering::SeqCst);
                    break;
                }
            }
        }
        if announce {
            self.notify_credit();
        }
    }

    /// Keeps `segment` as one more floating segment and counts it as credit, unless the
    /// channel wants no more (released, enough held, or its floating segments were released
    /// for a blocked sender). Returns whether the unannounced credit went from 0 to positive.
    /// The segment comes back unkept, so it is dropped outside the lock.
    fn keep_floating(&self, segment: PooledSegment) -> Result<bool, PooledSegment> {
        // Only a channel without exclusive segments can meet `release_floating` here: the
        // others take no lock.
        let _guard =
            (self.exclusive_total == 0).then(|| self.floating_credit.lock().expect("not poisoned"));
        if self.released.load(Ordering::SeqCst)
            || self.available() >= self.required.load(Ordering::SeqCst)
        {
            return Err(segment);
        }
        self.floating.push(segment)?;
        // `release` may have emptied the queue between the check above and the push (it takes
        // no lock): look again, after the push, as `release` pops after its store. What it
        // missed is handed back here instead of staying in a released channel for good.
        if self.released.load(Ordering::SeqCst) {
            return match self.floating.pop() {
                Some(segment) => Err(segment),
                None => Ok(false),
            };
        }
        Ok(self.unannounced_credit.fetch_add(1, Ordering::AcqRel) == 0)
    }

    fn add_credit(&self, credit: u32) {
        if credit > 0 && self.unannounced_credit.fetch_add(credit, Ordering::AcqRel) == 0 {
            self.notify_credit();
        }
    }

    /// Unannounced credit went from 0 to positive: the transport sends it.
    fn notify_credit(&self) {
        if let Some(slot) = self.listener.load().as_ref() {
            slot.0.on_channel_ready(self.channel);
        }
    }
}

impl Recycler for BufferManager {
    fn memory(&self) -> &SegmentMemory {
        self.origin.memory()
    }

    /// An exclusive segment came back: it is credit again, unless the channel now holds more
    /// than it needs, in which case a floating segment goes back to the pool instead.
    fn recycle(&self, segment: Segment) {
        if self.released.load(Ordering::SeqCst) {
            self.origin.recycle(segment);
            return;
        }
        if let Err(segment) = self.exclusive_free.push(segment) {
            self.origin.recycle(segment);
            return;
        }
        if self.released.load(Ordering::SeqCst) {
            // Released while pushing: hand everything back.
            while let Some(segment) = self.exclusive_free.pop() {
                self.origin.recycle(segment);
            }
            return;
        }
        if self.available() > self.required.load(Ordering::Acquire) {
            if let Some(floating) = self.floating.pop() {
                drop(floating);
                return;
            }
        }
        self.add_credit(1);
    }
}

impl BufferListener for BufferManager {
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
        // Cleared before `required` is read (in `keep_floating`), both SeqCst: a backlog that
        // arrived while the flag was still set, and so did not ask for itself, is seen here.
        self.waiting_for_floating.store(false, Ordering::SeqCst);
        if self.keep_floating(segment)? {
            self.notify_credit();
        }
        // Still short: ask again (or register again).
        self.request_floating();
        Ok(())
    }

    fn on_pool_destroyed(&self) {
        self.waiting_for_floating.store(false, Ordering::SeqCst);
    }
}

/// Events a remote channel holds unread beyond the segments of its gate's pool: events (end
/// of partition, barriers) are sent without credit, so a channel whose every credited segment
/// waits in its queue must still take them. One more fails the channel with
/// [`GateError::CreditExceeded`] before its memory is taken (a sender flooding events).
pub const UNCREDITED_EVENTS: usize = 16;

/// A received item with its sequence number checked.
struct Received {
    buffer: Buffer,
    /// For a priority item: the data items the sender's queue held behind it.
    overtaken: usize,
    /// For a priority item: data-lane items received before it (all of them, read or not).
    data_before: u64,
}

/// What the transport and the gate share of one remote channel.
pub struct RemoteChannelShared {
    channel: usize,
    consumed: ConsumedSubpartition,
    queue: Arc<ChannelQueue>,
    buffers: Arc<BufferManager>,
    received: SpillQueue<Received>,
    received_priority: SpillQueue<Received>,
    /// Items pushed onto `received` so far. Written only by the transport's thread (the one
    /// calling `on_buffer`), so a priority item can note how many came before it.
    data_received: AtomicU64,
    expected_sequence: AtomicU64,
    error: Mutex<Option<GateError>>,
    failed: AtomicBool,
    released: AtomicBool,
    resume_requested: AtomicBool,
    /// The task processed every record before the channel's EndOfData; not yet sent.
    all_records_processed: AtomicBool,
    /// Task events for the producer, encoded, that the transport has not sent yet.
    task_events: Mutex<std::collections::VecDeque<Vec<u8>>>,
    /// Set after a push to `task_events`: the transport looks at every ready channel (one per
    /// credit announcement), and takes the lock, which task threads share, only when set.
    task_events_queued: AtomicBool,
    /// Partition requests re-sent after PartitionNotFound, and connection attempts repeated
    /// after a refusal.
    retries: AtomicU64,
    metrics: ChannelMetrics,
    /// The newest aligned barrier with a timeout received into the data lane (Flink's
    /// `EventAnnouncement`): where it is, so the gate can move it ahead of the data before it
    /// when its alignment times out.
    announced: Mutex<Option<Announced>>,
    /// `announced`'s checkpoint, or `NO_ANNOUNCEMENT`: a read that looks for an announcement
    /// takes the lock only when there is one.
    announced_checkpoint: AtomicU64,
    /// Events received and not yet read by the gate: they take memory outside the gate's
    /// quota (no credit bounds them), so more than [`UNCREDITED_EVENTS`] fail the channel.
    unread_events: AtomicUsize,
}

/// An aligned barrier with a timeout waiting in a channel's data lane.
#[derive(Clone, Copy, Debug)]
struct Announced {
    /// Its index among the data-lane items the channel received.
    position: u64,
    /// The barrier: its checkpoint, and for the gate's alignment timer its timeout, which
    /// counts from the checkpoint's start whether or not the task has read as far as it.
    barrier: CheckpointBarrier,
}

const NO_ANNOUNCEMENT: u64 = u64::MAX;

/// Task events one remote channel keeps for its transport at most; more are dropped (logged)
/// rather than held without bound while the connection is not there.
const MAX_PENDING_TASK_EVENTS: usize = 1024;

impl fmt::Debug for RemoteChannelShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteChannelShared")
            .field("channel", &self.channel)
            .field("consumed", &self.consumed)
            .field("received", &self.received.len())
            .finish()
    }
}

impl RemoteChannelShared {
    /// The gate-local channel index.
    pub fn channel(&self) -> usize {
        self.channel
    }

    /// The subpartition the channel consumes.
    pub fn consumed(&self) -> ConsumedSubpartition {
        self.consumed
    }

    /// The channel's segments and credit.
    pub fn buffers(&self) -> &Arc<BufferManager> {
        &self.buffers
    }

    /// Events received and not yet read by the gate (see [`UNCREDITED_EVENTS`]).
    pub fn unread_events(&self) -> usize {
        self.unread_events.load(Ordering::Relaxed)
    }

    /// Items received and not yet read by the gate.
    pub fn queued(&self) -> usize {
        self.received.len() + self.received_priority.len()
    }

    /// The sequence number the next buffer must carry.
    pub fn expected_sequence(&self) -> u64 {
        self.expected_sequence.load(Ordering::Acquire)
    }

    /// A buffer (or event) arrived from the sender with its sequence number and the sender's
    /// backlog. A sequence gap fails the channel with [`GateError::Reordering`]; the buffer is
    /// dropped (its segment recycled) on every error path.
    pub fn on_buffer(
        &self,
        buffer: Buffer,
        sequence: u64,
        backlog: usize,
        overtaken: usize,
    ) -> Result<(), GateError> {
        if self.released.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.take_sequence(sequence)?;
        let priority = buffer.data_type().has_priority();
        let is_blocking = buffer.data_type().is_blocking_upstream();
        let data_before = self.data_received.load(Ordering::Relaxed);
        let lane = if priority {
            &self.received_priority
        } else {
            self.data_received.store(data_before + 1, Ordering::Relaxed);
            &self.received
        };
        let item = Received {
            buffer,
            overtaken,
            data_before,
        };
        if is_blocking {
            // The sender stopped behind an aligned barrier until ResumeConsumption. Released
            // before the barrier is readable: a gate already holding this channel in its
            // queue could read the barrier at once, finish the alignment and resume before a
            // later release, and would keep unannounced credit for the segments released
            // after it; the sender's data for that credit would then find no segment.
            self.buffers.release_floating();
        }
        let event = item.buffer.data_type().is_event();
        let announced = item.buffer.data_type().requires_announcement();
        let announced_barrier = match announced.then(|| Event::decode(item.buffer.as_slice())) {
            Some(Ok(Event::CheckpointBarrier(barrier))) => Some(barrier),
            // Not a barrier after all: the gate's read of it reports the error.
            _ => None,
        };
        // Counted before the push: a gate that reads the event at once counts it down after.
        if event {
            self.unread_events.fetch_add(1, Ordering::Relaxed);
        }
        if lane.push(item).is_err() {
            let error = GateError::CreditExceeded(self.channel);
            self.fail(error.clone());
            return Err(error);
        }
        // A release that emptied the lanes before the push landed: empty them again, or the
        // item's segment stays in a channel nobody reads (as `keep_floating` re-checks).
        if self.released.load(Ordering::SeqCst) {
            while self.received.pop().is_some() {}
            while self.received_priority.pop().is_some() {}
            return Ok(());
        }
        if let Some(barrier) = announced_barrier {
            // After the push: a gate that sees the announcement finds the barrier queued.
            // Both under the lock: a gate that clears a slot it found read (under the lock)
            // then cannot leave the checkpoint naming an empty slot.
            let mut announced = self.announced.lock().expect("not poisoned");
            *announced = Some(Announced {
                position: data_before,
                barrier,
            });
            self.announced_checkpoint
                .store(barrier.id, Ordering::Release);
            drop(announced);
            // Before the enqueue below wakes the reader.
            self.queue.announce();
        }
        // Every response, a backlog of 0 too, as Flink's `onBuffer`: a channel keeps wanting
        // floating segments only while its sender has buffers for them. A sender stopped
        // behind an aligned barrier has none it may send until resumed (Flink's blocked
        // subpartition reports a backlog of 0), so a channel with exclusive segments lets its
        // surplus floating ones go back to the other channels while it waits for the rest of
        // the alignment.
        self.buffers
            .on_sender_backlog(if is_blocking { 0 } else { backlog });
        self.queue.enqueue(self.channel as u32, priority);
        Ok(())
    }

    /// An empty data buffer arrived (Flink's `onEmptyBuffer`): a sender without data for the
    /// credit it holds spent it on a buffer that ended empty; the transport has given the
    /// segment it took for it back already. Its sequence number is checked and its backlog
    /// applied like a buffer's; nothing is queued for the gate (it is no data item, see
    /// [`SubpartitionView::send_empty_buffers`](crate::partition::SubpartitionView::send_empty_buffers)).
    pub fn on_empty_buffer(&self, sequence: u64, backlog: usize) -> Result<(), GateError> {
        if self.released.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.take_sequence(sequence)?;
        self.buffers.on_sender_backlog(backlog);
        Ok(())
    }

    /// Takes `sequence` as the next sequence number, or fails the channel with
    /// [`GateError::Reordering`] when another is due.
    fn take_sequence(&self, sequence: u64) -> Result<(), GateError> {
        let expected = self.expected_sequence.load(Ordering::Acquire);
        if sequence != expected {
            let error = GateError::Reordering {
                channel: self.channel,
                expected,
                actual: sequence,
            };
            self.fail(error.clone());
            return Err(error);
        }
        self.expected_sequence
            .store(expected + 1, Ordering::Release);
        Ok(())
    }

    /// Fails the channel: the gate's next read of it returns `error`.
    pub fn fail(&self, error: GateError) {
        let mut slot = self.error.lock().expect("not poisoned");
        if slot.is_none() {
            *slot = Some(error);
        }
        drop(slot);
        self.failed.store(true, Ordering::SeqCst);
        self.queue.enqueue(self.channel as u32, false);
    }

    /// Attaches the transport: it hears when credit, a resume request or a release is due.
    pub fn attach(&self, listener: Arc<dyn CreditListener>) {
        self.buffers.set_listener(listener);
    }

    /// True (once) when the gate asked to resume consumption after an aligned barrier; the
    /// transport then sends ResumeConsumption.
    pub fn take_resume_request(&self) -> bool {
        self.resume_requested.swap(false, Ordering::AcqRel)
    }

    /// Whether the task acknowledged every record (FLIP-147) since the last call: the
    /// transport sends AckAllUserRecordsProcessed.
    pub fn take_acknowledgement(&self) -> bool {
        self.all_records_processed.load(Ordering::Relaxed)
            && self.all_records_processed.swap(false, Ordering::AcqRel)
    }

    /// True once the gate released the channel.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::SeqCst)
    }

    /// The task events waiting for the transport, oldest first (each once); the transport
    /// sends them as TaskEventRequests once the channel's partition request stands.
    pub fn take_task_events(&self) -> std::collections::VecDeque<Vec<u8>> {
        self.take_task_events_within(usize::MAX).0
    }

    /// As [`take_task_events`](Self::take_task_events), but only while fewer than `bytes`
    /// bytes of events were taken (the last may pass it); with whether none is left. The rest
    /// stay queued, flagged, for a later take.
    pub fn take_task_events_within(
        &self,
        bytes: usize,
    ) -> (std::collections::VecDeque<Vec<u8>>, bool) {
        // A push that lands after the swap sets the flag again (and tells the transport).
        if !self.task_events_queued.swap(false, Ordering::Acquire) {
            return (std::collections::VecDeque::new(), true);
        }
        let mut queued = self.task_events.lock().expect("not poisoned");
        let mut taken_bytes = 0;
        let mut split = 0;
        while split < queued.len() && taken_bytes < bytes {
            taken_bytes += queued[split].len();
            split += 1;
        }
        let left = queued.split_off(split);
        let taken = std::mem::replace(&mut *queued, left);
        let all = queued.is_empty();
        if !all {
            // Still queued: the next look takes them (the connection looks again once it has
            // room; a push meanwhile tells it anyway).
            self.task_events_queued.store(true, Ordering::SeqCst);
        }
        (taken, all)
    }

    /// True when task events wait for the transport.
    pub fn has_task_events(&self) -> bool {
        self.task_events_queued.load(Ordering::SeqCst)
    }

    /// How often the transport tried again for this channel: partition requests re-sent after
    /// PartitionNotFound and connections re-opened after a refusal (each after its back-off).
    pub fn request_retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// The transport is about to try again (see [`request_retries`](Self::request_retries)).
    pub fn note_retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }
}

/// A channel whose producer runs in another process (Flink's `RemoteInputChannel`).
pub struct RemoteInputChannel {
    shared: Arc<RemoteChannelShared>,
    requested: bool,
    /// Data-lane items the gate took off `received` so far: returned, moved to `pending`, or
    /// dropped (a barrier moved ahead); not the stashed one. The index of the next one.
    data_taken: u64,
    /// A data item taken off `received` while a priority item came in: returned after it.
    stashed: Option<Received>,
    /// Data-lane items taken off `received` ahead of their turn, to persist them as a
    /// checkpoint's in-flight data at once, each with its index on the data lane (a dropped
    /// barrier leaves a gap); read, in order, before anything after them.
    pending: VecDeque<(u64, Received)>,
    /// Unread data-lane items in the in-flight data of the priority item read last that came
    /// before it (taken ahead already, or queued): to be taken ahead.
    unread_before_priority: usize,
    /// How many of `pending`, from its front, the gate lists for persisting.
    listed_ahead: usize,
}

impl fmt::Debug for RemoteInputChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteInputChannel")
            .field("shared", &self.shared)
            .field("requested", &self.requested)
            .finish()
    }
}

impl RemoteInputChannel {
    /// A channel that may hold up to `max_received` buffers at once (its gate's pool) and
    /// usually holds at most `usual_received` (its exclusive and the gate's floating ones):
    /// its lanes keep room for the usual number and grow beyond it only while needed.
    pub(crate) fn new(
        channel: usize,
        consumed: ConsumedSubpartition,
        queue: Arc<ChannelQueue>,
        buffers: Arc<BufferManager>,
        max_received: usize,
        usual_received: usize,
    ) -> Self {
        // Credit bounds the buffers; events arrive without credit and need room too.
        let usual = usual_received.min(max_received).max(1) + UNCREDITED_EVENTS;
        let most = max_received.max(1) + UNCREDITED_EVENTS;
        Self {
            shared: Arc::new(RemoteChannelShared {
                channel,
                consumed,
                queue,
                buffers,
                received: SpillQueue::new(usual, most),
                received_priority: SpillQueue::new(usual, most),
                data_received: AtomicU64::new(0),
                expected_sequence: AtomicU64::new(0),
                error: Mutex::new(None),
                failed: AtomicBool::new(false),
                released: AtomicBool::new(false),
                resume_requested: AtomicBool::new(false),
                all_records_processed: AtomicBool::new(false),
                task_events: Mutex::new(std::collections::VecDeque::new()),
                task_events_queued: AtomicBool::new(false),
                retries: AtomicU64::new(0),
                metrics: ChannelMetrics::default(),
                announced: Mutex::new(None),
                announced_checkpoint: AtomicU64::new(NO_ANNOUNCEMENT),
                unread_events: AtomicUsize::new(0),
            }),
            requested: false,
            data_taken: 0,
            stashed: None,
            pending: VecDeque::with_capacity(usual),
            unread_before_priority: 0,
            listed_ahead: 0,
        }
    }

    /// What the transport holds of this channel.
    pub fn shared(&self) -> &Arc<RemoteChannelShared> {
        &self.shared
    }

    /// The subpartition the channel consumes.
    pub fn consumed(&self) -> ConsumedSubpartition {
        self.shared.consumed
    }

    pub(crate) fn metrics(&self) -> &ChannelMetrics {
        &self.shared.metrics
    }

    /// Marks the channel requested; the transport sends the PartitionRequest with the initial
    /// credit when it attaches (its listener is told).
    pub(crate) fn request(&mut self) -> Result<(), GateError> {
        self.requested = true;
        Ok(())
    }

    /// Attaches the transport: it hears when credit or a resume request is due.
    pub fn attach(&self, listener: Arc<dyn CreditListener>) {
        self.shared.buffers.set_listener(listener);
    }

    pub(crate) fn next_read(&mut self) -> Result<Option<ChannelRead>, GateError> {
        let shared = &self.shared;
        if shared.failed.load(Ordering::SeqCst) {
            let error = shared.error.lock().expect("not poisoned").clone();
            return Err(error.unwrap_or(GateError::Transport {
                channel: shared.channel,
                reason: "failed".into(),
            }));
        }
        let item = match shared.received_priority.pop() {
            Some(item) => item,
            None => {
                // Items taken ahead of their turn came before everything still queued.
                if let Some((_, data)) = self.pending.pop_front() {
                    self.listed_ahead = self.listed_ahead.saturating_sub(1);
                    return Ok(Some(self.read_of(data.buffer, 0)));
                }
                let Some(data) = self.stashed.take().or_else(|| shared.received.pop()) else {
                    return Ok(None);
                };
                // A priority item may have come in after the look above and before this data
                // item (the transport pushes in wire order): it goes first, or the data item,
                // which may be after it on the wire, would be read before the barrier that it
                // follows.
                let Some(item) = shared.received_priority.pop() else {
                    self.data_taken += 1;
                    return Ok(Some(self.read_of(data.buffer, 0)));
                };
                self.stashed = Some(data);
                item
            }
        };
        // The item's in-flight data is every data-lane item before index `end` the task has
        // not read: the sender counted what it still held behind the item (indices from
        // `data_before` on, after the item on the wire); what it had sent before is queued
        // here, unread, and is overtaken as well (the gate reads this lane first). Everything
        // received before the item was pushed before it, by the transport's one thread, so
        // `data_before` covers it. Items taken ahead of their turn count if they are before
        // `end` (an older barrier moved ahead may have taken some that came after the item);
        // a barrier moved ahead and dropped is never read, and does not count.
        let end = item.data_before.saturating_add(item.overtaken as u64);
        let taken_before_end = self.pending.iter().filter(|(i, _)| *i < end).count();
        let queued_before = item.data_before.saturating_sub(self.data_taken) as usize;
        let still_to_come = end.saturating_sub(self.data_taken.max(item.data_before)) as usize;
        self.unread_before_priority = taken_before_end + queued_before;
        Ok(Some(self.read_of(
            item.buffer,
            self.unread_before_priority + still_to_come,
        )))
    }

    /// True when the next read returns a priority event (a look: it takes nothing). A failed
    /// channel reports its error on the next read, which a priority read leaves to the task.
    pub(crate) fn has_priority_event(&self) -> bool {
        let shared = &self.shared;
        !shared.failed.load(Ordering::SeqCst) && !shared.received_priority.is_empty()
    }

    /// After a priority barrier was read: takes the unread data-lane items that came before
    /// it off the queue, ahead of their turn (they are read next, in order), so the gate can
    /// persist them as the checkpoint's in-flight data now ([`for_each_taken_ahead`]), as
    /// Flink's channel gives its queued buffers to the channel-state writer when the barrier
    /// comes instead of when the task gets to them. Returns how many items (events included)
    /// are taken ahead now.
    ///
    /// [`for_each_taken_ahead`]: Self::for_each_taken_ahead
    pub(crate) fn take_unread_before_priority(&mut self) -> usize {
        let wanted = std::mem::take(&mut self.unread_before_priority);
        self.take_ahead(wanted.saturating_sub(self.pending.len()));
        self.listed_ahead = wanted.min(self.pending.len());
        self.listed_ahead
    }

    /// The aligned barrier with a timeout this channel received and nobody read yet, if any
    /// (Flink's `EventAnnouncement`, which its gate handles as it arrives).
    pub(crate) fn announced_barrier(&self) -> Option<CheckpointBarrier> {
        if self.shared.announced_checkpoint.load(Ordering::Acquire) == NO_ANNOUNCEMENT {
            return None;
        }
        let mut announced = self.shared.announced.lock().expect("not poisoned");
        match *announced {
            Some(a) if a.position >= self.data_taken => Some(a.barrier),
            Some(_) | None => {
                // Read since (in place), or already cleared: the slot goes, so later looks
                // take no lock for it. A newer announcement is stored under this lock, so
                // none is lost here.
                *announced = None;
                self.shared
                    .announced_checkpoint
                    .store(NO_ANNOUNCEMENT, Ordering::Release);
                None
            }
        }
    }

    /// Flink's `convertToPriorityEvent`: the aligned barrier of `checkpoint`, received and not
    /// read yet, goes ahead of the data before it once its alignment timed out. That data is
    /// taken off the queue ahead of its turn (read next, in order; the gate persists it as
    /// in-flight data), and the barrier itself is dropped: the gate turned the checkpoint
    /// unaligned already. False when the channel does not hold that barrier unread.
    pub(crate) fn convert_barrier_to_priority(&mut self, checkpoint: u64) -> bool {
        // The look first: this runs for every buffer read while an unaligned checkpoint
        // waits for the channel's barrier.
        if self.shared.announced_checkpoint.load(Ordering::Acquire) != checkpoint {
            return false;
        }
        let shared = self.shared.clone();
        let position = {
            let mut announced = shared.announced.lock().expect("not poisoned");
            match *announced {
                Some(a) if a.barrier.id == checkpoint && a.position >= self.data_taken => {
                    *announced = None;
                    shared
                        .announced_checkpoint
                        .store(NO_ANNOUNCEMENT, Ordering::Release);
                    a.position
                }
                _ => return false,
            }
        };
        // Everything up to the barrier was pushed before the announcement.
        let before = (position - self.data_taken) as usize;
        if self.take_ahead(before) < before {
            return false;
        }
        // Every item taken ahead came before this barrier.
        self.listed_ahead = self.pending.len();
        let Some(barrier) = self.stashed.take().or_else(|| shared.received.pop()) else {
            return false;
        };
        self.data_taken += 1;
        debug_assert!(barrier.buffer.data_type().requires_announcement());
        shared.unread_events.fetch_sub(1, Ordering::Relaxed);
        // Read in, though not handed to the task: Flink's channel reads it from the head of
        // its queue, and counts it there.
        self.metrics().num_buffers_in.add(1);
        self.metrics().num_bytes_in.add(barrier.buffer.len() as u64);
        drop(barrier);
        true
    }

    /// The data buffers among the items taken ahead of their turn that the last barrier
    /// listed, in order.
    pub(crate) fn for_each_taken_ahead(&self, f: &mut dyn FnMut(&Buffer)) {
        self.pending
            .iter()
            .take(self.listed_ahead)
            .map(|(_, item)| item)
            .filter(|item| item.buffer.data_type().is_buffer())
            .for_each(|item| f(&item.buffer));
    }

    /// Moves up to `count` data-lane items, in order, from the queue to `pending`; returns how
    /// many it moved (fewer only when the queue ran out, which a released channel's does).
    fn take_ahead(&mut self, count: usize) -> usize {
        for moved in 0..count {
            let Some(item) = self.stashed.take().or_else(|| self.shared.received.pop()) else {
                return moved;
            };
            self.pending.push_back((self.data_taken, item));
            self.data_taken += 1;
        }
        count
    }

    fn read_of(&self, buffer: Buffer, overtaken: usize) -> ChannelRead {
        let shared = &self.shared;
        if buffer.data_type().is_event() {
            shared.unread_events.fetch_sub(1, Ordering::Relaxed);
        }
        ChannelRead {
            buffer,
            more_available: !self.pending.is_empty()
                || self.stashed.is_some()
                || !shared.received.is_empty()
                || !shared.received_priority.is_empty(),
            next_is_priority: !shared.received_priority.is_empty(),
            overtaken,
        }
    }

    /// Whether [`send_task_event`](Self::send_task_event) takes one more event now (at most
    /// `MAX_PENDING_TASK_EVENTS` wait for the connection). Only the connection takes them
    /// out meanwhile: room seen stays. A channel released (it ended) or failed has room: it
    /// drops what it is sent, as no connection will take it out.
    pub(crate) fn has_task_event_room(&self) -> bool {
        self.is_gone()
            || self.shared.task_events.lock().expect("not poisoned").len() < MAX_PENDING_TASK_EVENTS
    }

    /// Released or failed: its connection no longer serves it.
    fn is_gone(&self) -> bool {
        self.shared.is_released() || self.shared.failed.load(Ordering::SeqCst)
    }

    /// Queues `event` for the producer (Flink's `RemoteInputChannel.sendTaskEvent`, through the
    /// connection) and tells the transport.
    pub(crate) fn send_task_event(&self, event: &crate::event::Event) {
        if self.is_gone() {
            tracing::debug!(
                channel = self.shared.channel,
                "a task event for a channel that ended or failed is dropped"
            );
            return;
        }
        let mut bytes = Vec::with_capacity(event.encoded_len());
        event.encode(&mut bytes);
        {
            let mut pending = self.shared.task_events.lock().expect("not poisoned");
            if pending.len() >= MAX_PENDING_TASK_EVENTS {
                tracing::warn!(
                    channel = self.shared.channel,
                    "{MAX_PENDING_TASK_EVENTS} task events wait for the connection; one dropped"
                );
                return;
            }
            pending.push_back(bytes);
        }
        self.shared.task_events_queued.store(true, Ordering::SeqCst);
        // Pairs with the fence of the transport's attach (`ClientConnection::add_channel`):
        // either it sees the flag, or this sees its listener.
        fence(Ordering::SeqCst);
        if let Some(slot) = self.shared.buffers.listener.load().as_ref() {
            slot.0.on_channel_ready(self.shared.channel);
        }
    }

    /// See [`InputGate::acknowledge_all_records_processed`](super::InputGate): the transport
    /// sends it to the producer.
    pub(crate) fn acknowledge_all_records_processed(&mut self) {
        self.shared
            .all_records_processed
            .store(true, Ordering::Release);
        if let Some(slot) = self.shared.buffers.listener.load().as_ref() {
            slot.0.on_channel_ready(self.shared.channel);
        }
    }

    pub(crate) fn resume_consumption(&mut self) {
        self.shared.buffers.forget_unannounced_credit();
        self.shared.resume_requested.store(true, Ordering::Release);
        if let Some(slot) = self.shared.buffers.listener.load().as_ref() {
            slot.0.on_channel_ready(self.shared.channel);
        }
    }

    pub(crate) fn release(&mut self) {
        self.stashed = None;
        self.pending.clear();
        self.listed_ahead = 0;
        let shared = &self.shared;
        shared.released.store(true, Ordering::SeqCst);
        while shared.received.pop().is_some() {}
        while shared.received_priority.pop().is_some() {}
        shared.buffers.release();
        // As for task events: either the attach sees the release, or this sees its listener.
        fence(Ordering::SeqCst);
        if let Some(slot) = shared.buffers.listener.load().as_ref() {
            slot.0.on_channel_ready(shared.channel);
        }
    }
}
