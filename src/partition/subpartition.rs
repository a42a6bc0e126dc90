//! One pipelined subpartition: the queue between the producer's builders and one reader.
//!
//! Flink guards its `PrioritizedDeque` with a lock. Here the queue is two bounded lock-free
//! lanes (data and priority) with one producer (the partition's writer, plus the output
//! flusher for `flush`) and one reader (the [`SubpartitionView`]). The reader keeps the head
//! consumer it is reading; only the last consumer in the data lane may be unfinished.
//!
//! Wake-ups: the reader sets `reader_waiting` when it finds nothing, then looks once more; the
//! producer makes data readable, then checks the flag. With a SeqCst fence on both sides
//! (Dekker's pattern) either the reader sees the data or the producer sees the flag, so no
//! wake-up is lost, and only the side that clears the flag notifies: exactly one notification
//! per nothing-to-read → something-to-read transition, and a priority event's besides (which
//! leaves the flag as it is, so at most one more may follow it).
//!
//! The lanes are bounded by `max-buffers-per-channel`, not by the partition's pool: the pool
//! bounds a subpartition's own buffers by that option already, and sized by the pool (about
//! two segments per subpartition) the lanes of all subpartitions together grew with the
//! square of their count. Buffers may fill the data lane to twice the option, the rest being
//! room for broadcast buffers, which the option does not count; events may use
//! [`EVENT_RESERVE`] slots more, so that a barrier or EndOfPartition still gets in behind
//! buffers its reader has not taken. A writer that finds no room waits for the reader as it
//! waits for memory: it sets `room_wanted`, looks again, and sleeps on the pool; the reader's
//! next take clears the flag and wakes it (the same fence pairing as above).

use std::fmt;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwapOption;

use super::{AvailabilityListener, BufferAndBacklog, PartitionError};
use crate::buffer::{BufferConsumer, DataType, NetworkBufferPool, PoolWaiters};
use crate::sync::{
    fence, ArrayQueue, AtomicBool, AtomicU64, AtomicUsize, AtomicWaker, Condvar, Mutex, Ordering,
};

/// Lane slots only events may take: room for them behind a data lane full of buffers.
pub(crate) const EVENT_RESERVE: usize = 8;

/// [`PipelinedSubpartition::timeoutable`]: the writer is turning the barrier unaligned; the
/// reader waits (its priority copy is being queued).
const CONVERTING: u64 = 1 << 63;

/// What became of an aligned barrier with a timeout when the writer tried to turn it unaligned
/// ([`PipelinedSubpartition::convert_timeoutable_barrier`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Conversion {
    /// Its unaligned copy overtakes the data queued before it; the aligned one is dropped.
    Converted,
    /// None is queued: the reader took it already, or there was none.
    NotQueued,
    /// The priority lane is full: try again later.
    NoRoom,
}

/// What the writer is about to queue, for [`PipelinedSubpartition::has_room`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Queued {
    /// A data buffer (unicast or broadcast): the data lane, short of its event reserve.
    Buffer,
    /// This many data buffers at once (a record's that runs into more than one), at most one
    /// fewer than the lane takes: the writer's own open buffer may sit in it until the reader
    /// looks, and nothing may need the reader to look (a lane clamped to a tiny pool). A
    /// partition's lanes take at least two buffers (twice `max-buffers-per-channel`, and at
    /// least the pool's two segments plus overdraft).
    Buffers(usize),
    /// An event in line with the data: the data lane, reserve included.
    Event,
    /// A priority event: the priority lane.
    PriorityEvent,
}

/// A priority item and how many data-lane items that the reader sends (not the ones it
/// drops unsent) had been enqueued before it.
struct PriorityItem {
    consumer: BufferConsumer,
    sent_before: u64,
}

/// The shared state of one subpartition (producer side and reader side meet here).
pub(crate) struct PipelinedSubpartition {
    index: usize,
    /// Why the producer failed, once it said so (its partition's, shared by every
    /// subpartition): what its readers are told instead of a bare release.
    failure: Arc<OnceLock<String>>,
    data: ArrayQueue<BufferConsumer>,
    /// Data-lane items buffers may fill it to (the rest is the event reserve).
    buffer_room: usize,
    priority: ArrayQueue<PriorityItem>,
    /// Items pushed to the data lane so far (written by the producer only).
    data_enqueued: AtomicU64,
    /// Of those, the ones the reader drops without sending: buffers finished empty (a record
    /// whose encoding failed was taken back out) and aligned barriers whose unaligned copy
    /// went ahead. A priority item overtakes only the others (written by the producer only).
    unsent_enqueued: AtomicU64,
    /// `unsent_enqueued` when the aligned barrier with a timeout in `timeoutable` was queued:
    /// its unaligned copy overtakes the items before it less these.
    timeoutable_unsent: AtomicU64,
    /// Finished data buffers not yet fully taken by the reader (and, for a moment, the one
    /// being finished: see [`PipelinedSubpartition::count_finishing_buffer`]).
    backlog: AtomicUsize,
    /// Events in the data lane not yet taken.
    queued_events: AtomicUsize,
    flush_requested: AtomicBool,
    finished: AtomicBool,
    released: AtomicBool,
    reader_waiting: AtomicBool,
    /// What the reader had read of its unfinished head when it last parked: the segment's
    /// index plus one, and the read position, packed (0: no unfinished head;
    /// `PARKED_ANYWHERE`: not known). A flush with nothing committed past it has nothing to
    /// make readable and leaves the reader parked.
    parked_at: AtomicU64,
    /// The network memory the data segments come from: a flush looks at the head's
    /// committed position there.
    network: NetworkBufferPool,
    view_taken: AtomicBool,
    listener: ArcSwapOption<ListenerSlot>,
    /// Set by the writer when it found the lane it queues to full, before it looks again and
    /// sleeps; cleared by the reader's next take, which wakes it through the pool.
    room_wanted: AtomicBool,
    room_waiters: PoolWaiters,
    /// The data-lane position (plus one) of the newest aligned barrier with a timeout while
    /// its reader has not taken it, 0 when none (with the `CONVERTING` flag while the writer
    /// turns it). The reader claims the barrier with a compare-and-swap to 0 as it takes it
    /// (a look at it claims nothing), the writer with one to `CONVERTING` when the timeout
    /// passes: exactly one of them wins,
    /// so the barrier goes out either aligned, in place, or unaligned, ahead, never both.
    timeoutable: AtomicU64,
    /// The checkpoint of the barrier `timeoutable` names (the writer's alone).
    timeoutable_checkpoint: AtomicU64,
    /// The data-lane position (plus one) of a barrier turned unaligned whose aligned original
    /// the reader has yet to drop, 0 when none. Apart from `timeoutable`, so that a newer
    /// barrier can be turned too; set by the writer before it clears `timeoutable`, cleared
    /// by the reader as it drops the original.
    converted: AtomicU64,
    /// The partition's count of consumers that processed every record.
    all_data_processed: Arc<AllDataProcessed>,
    /// This subpartition's consumer said so (counted there once).
    data_processed: AtomicBool,
}

/// The consumers' word that they processed every record of a partition (FLIP-147's
/// `AckAllUserRecordsProcessed`), counted once per subpartition and waited for by the
/// producer before it finishes (so a final checkpoint covers every record).
#[derive(Debug)]
pub(crate) struct AllDataProcessed {
    acknowledged: AtomicUsize,
    subpartitions: usize,
    lock: Mutex<()>,
    cond: Condvar,
    waker: AtomicWaker,
}

impl AllDataProcessed {
    pub(crate) fn new(subpartitions: usize) -> Self {
        Self {
            acknowledged: AtomicUsize::new(0),
            subpartitions,
            lock: Mutex::new(()),
            cond: Condvar::new(),
            waker: AtomicWaker::new(),
        }
    }

    /// Every subpartition's consumer acknowledged.
    pub(crate) fn is_done(&self) -> bool {
        self.acknowledged.load(Ordering::SeqCst) >= self.subpartitions
    }

    fn acknowledge(&self) {
        if self.acknowledged.fetch_add(1, Ordering::SeqCst) + 1 >= self.subpartitions {
            self.wake();
        }
    }

    /// Wakes the producer's wait (done, or released: it looks).
    pub(crate) fn wake(&self) {
        drop(self.lock.lock().expect("not poisoned"));
        self.cond.notify_all();
        self.waker.wake();
    }

    /// Blocks up to `timeout` unless `done` holds, checked under the lock a wake-up takes.
    pub(crate) fn wait_unless(&self, timeout: std::time::Duration, done: impl Fn() -> bool) {
        let guard = self.lock.lock().expect("not poisoned");
        if !done() {
            drop(
                self.cond
                    .wait_timeout(guard, timeout)
                    .expect("not poisoned"),
            );
        }
    }

    /// Registers an async wait's waker (looked at again by the caller after this).
    pub(crate) fn register(&self, waker: &std::task::Waker) {
        self.waker.register(waker);
    }
}

struct ListenerSlot(Arc<dyn AvailabilityListener>);

impl fmt::Debug for PipelinedSubpartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PipelinedSubpartition")
            .field("index", &self.index)
            .field("backlog", &self.backlog.load(Ordering::Relaxed))
            .field("finished", &self.finished.load(Ordering::Relaxed))
            .field("released", &self.released.load(Ordering::Relaxed))
            .finish()
    }
}

impl PipelinedSubpartition {
    /// A subpartition whose data lane takes buffers up to `buffer_room` items and events up to
    /// `capacity`, and whose priority lane takes `capacity` events; a writer that finds no
    /// room waits on the pool `room_waiters` wakes.
    pub(crate) fn new(
        index: usize,
        buffer_room: usize,
        capacity: usize,
        room_waiters: PoolWaiters,
        network: NetworkBufferPool,
        failure: Arc<OnceLock<String>>,
        all_data_processed: Arc<AllDataProcessed>,
    ) -> Self {
        let capacity = capacity.max(1);
        Self {
            index,
            failure,
            data: ArrayQueue::new(capacity),
            buffer_room: buffer_room.clamp(1, capacity),
            priority: ArrayQueue::new(capacity),
            data_enqueued: AtomicU64::new(0),
            unsent_enqueued: AtomicU64::new(0),
            timeoutable_unsent: AtomicU64::new(0),
            backlog: AtomicUsize::new(0),
            queued_events: AtomicUsize::new(0),
            flush_requested: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            released: AtomicBool::new(false),
            reader_waiting: AtomicBool::new(false),
            parked_at: AtomicU64::new(0),
            network,
            view_taken: AtomicBool::new(false),
            listener: ArcSwapOption::empty(),
            room_wanted: AtomicBool::new(false),
            room_waiters,
            timeoutable: AtomicU64::new(0),
            timeoutable_checkpoint: AtomicU64::new(0),
            converted: AtomicU64::new(0),
            all_data_processed,
            data_processed: AtomicBool::new(false),
        }
    }

    // ---- producer side ----

    /// Queues the consumer of a data builder the producer just started writing.
    pub(crate) fn add_data(&self, consumer: BufferConsumer) -> Result<(), PartitionError> {
        self.push_data(consumer)
    }

    /// The producer is about to finish the data builder at the tail: one more complete
    /// buffer. Counted before the buffer shows as finished, so a reader that takes it out (and
    /// counts it down) at once finds it counted; until the finish the count is one ahead.
    pub(crate) fn count_finishing_buffer(&self) {
        self.backlog.fetch_add(1, Ordering::Release);
    }

    /// The producer finished the data builder at the tail empty: its reader drops it unsent.
    pub(crate) fn count_empty_buffer(&self) {
        self.unsent_enqueued.fetch_add(1, Ordering::Relaxed);
    }

    /// The producer finished the data builder at the tail (counted just before).
    pub(crate) fn on_data_finished(&self) {
        self.notify_if_waiting();
    }

    /// Queues an event. A priority event goes to the priority lane and overtakes queued data.
    /// `timeoutable` names the checkpoint of an aligned barrier that may time out (turn
    /// unaligned, see [`convert_timeoutable_barrier`](Self::convert_timeoutable_barrier)).
    pub(crate) fn add_event(
        &self,
        consumer: BufferConsumer,
        priority: bool,
        timeoutable: Option<u64>,
    ) -> Result<(), PartitionError> {
        if priority {
            let item = PriorityItem {
                consumer,
                sent_before: self.data_enqueued.load(Ordering::Relaxed)
                    - self.unsent_enqueued.load(Ordering::Relaxed),
            };
            if self.priority.push(item).is_err() {
                unreachable!("the writer queues only after it saw room, and only it queues");
            }
            if self.released.load(Ordering::SeqCst) {
                self.drain();
                return Err(PartitionError::Released);
            }
            self.notify_priority();
            return Ok(());
        }
        self.queued_events.fetch_add(1, Ordering::Release);
        if let Some(checkpoint) = timeoutable {
            // Before the push: the reader that pops the barrier finds its position here. A
            // newer barrier replaces an older one, which can then no longer turn unaligned.
            let position = self.data_enqueued.load(Ordering::Relaxed);
            self.timeoutable_checkpoint
                .store(checkpoint, Ordering::Relaxed);
            self.timeoutable_unsent.store(
                self.unsent_enqueued.load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
            self.timeoutable.store(position + 1, Ordering::Release);
        }
        self.push_data(consumer)?;
        self.notify_if_waiting();
        Ok(())
    }

    /// Flink's `alignedBarrierTimeout` for this subpartition: if checkpoint `checkpoint`'s
    /// aligned barrier with a timeout is still queued, `unaligned` (its unaligned copy, a
    /// priority event) overtakes the data queued before it and the aligned one will be
    /// dropped. Only the partition's writer calls this.
    pub(crate) fn convert_timeoutable_barrier(
        &self,
        checkpoint: u64,
        unaligned: impl FnOnce() -> BufferConsumer,
    ) -> Conversion {
        let state = self.timeoutable.load(Ordering::Acquire);
        // Released, nothing is queued: an original left undropped holds the drop slot for
        // good, which must not keep the timer retrying.
        if state == 0
            || state & CONVERTING != 0
            || self.timeoutable_checkpoint.load(Ordering::Relaxed) != checkpoint
            || self.is_released()
        {
            return Conversion::NotQueued;
        }
        // Room first (once claimed, its copy must get in), and the drop slot free (an older
        // barrier turned unaligned whose original the reader has not reached holds it).
        if !self.has_room(Queued::PriorityEvent) || self.converted.load(Ordering::Acquire) != 0 {
            return Conversion::NoRoom;
        }
        if self
            .timeoutable
            .compare_exchange(
                state,
                state | CONVERTING,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            // The reader took it, in place.
            return Conversion::NotQueued;
        }
        let position = state - 1;
        let item = PriorityItem {
            consumer: unaligned(),
            // Overtakes exactly the items before the aligned barrier (the ones sent).
            sent_before: position - self.timeoutable_unsent.load(Ordering::Relaxed),
        };
        // The original is dropped unsent: later priority items do not overtake it.
        self.unsent_enqueued.fetch_add(1, Ordering::Relaxed);
        if self.priority.push(item).is_err() {
            unreachable!("the writer queues only after it saw room, and only it queues");
        }
        // In this order, each a release the reader's acquire pairs with: a reader that finds
        // `timeoutable` no longer naming the barrier finds it in `converted`, and its copy
        // queued.
        self.converted.store(state, Ordering::Release);
        self.timeoutable.store(0, Ordering::Release);
        if self.released.load(Ordering::SeqCst) {
            self.drain();
            return Conversion::NotQueued;
        }
        self.notify_priority();
        Conversion::Converted
    }

    /// Makes the committed bytes of the unfinished tail buffer readable, and tells a parked
    /// reader only if there are any it has not read (Flink's `flush` looks at the last
    /// buffer's data too): an idle subpartition's reader is not woken every buffer timeout.
    pub(crate) fn flush(&self) {
        // A swap where a store would do: loom (0.7) lets a plain store land inside another
        // thread's read-modify-write of the same atomic (tokio-rs/loom#254), so with a store
        // here its models of the reader's swap report outcomes no machine produces.
        self.flush_requested.swap(true, Ordering::Release);
        // Pairs with the fence in `SubpartitionView::park`: either this sees the reader's
        // `reader_waiting` (and with it the `parked_at` stored before), or the reader's look
        // after it sees `flush_requested`.
        fence(Ordering::SeqCst);
        if !self.reader_waiting.load(Ordering::Acquire) || self.nothing_new_since_park() {
            return;
        }
        self.notify_waiting_reader();
    }

    /// Whether the parked reader has read everything a flush could make readable: its
    /// unfinished head holds no committed byte past its read position, or it has no head and
    /// nothing is queued. (The head is the tail then: only the last item may be unfinished,
    /// and the finish of a buffer notifies by itself.)
    fn nothing_new_since_park(&self) -> bool {
        match self.parked_at.load(Ordering::Relaxed) {
            0 => self.data.is_empty(),
            PARKED_ANYWHERE => false,
            parked => {
                let index = (parked >> 32) as u32 - 1;
                let read = parked as u32;
                self.network
                    .written_bytes(index)
                    .is_some_and(|written| written <= read)
            }
        }
    }

    /// Marks the end; the producer has queued EndOfPartition before.
    pub(crate) fn mark_finished(&self) {
        self.finished.store(true, Ordering::Release);
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Buffers and events in the lanes, not taken by the reader yet (Flink's
    /// `getNumberOfQueuedBuffers`, for `outputQueueLength`): a racy estimate, for metrics.
    /// The lanes themselves, not the backlog: a release empties them without counting down.
    pub(crate) fn queued_items(&self) -> usize {
        self.data.len() + self.priority.len()
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::SeqCst)
    }

    /// Released before its consumer acknowledged every record: that acknowledgement will
    /// not come.
    pub(crate) fn released_unacknowledged(&self) -> bool {
        self.is_released() && !self.data_processed.load(Ordering::SeqCst)
    }

    /// Drops everything queued (its segments go back to the pool) and refuses more.
    pub(crate) fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.drain();
        // A writer waiting for room, or for a segment the drain (or the reader's dropped head)
        // gives back, looks again: its next queueing fails as Released.
        self.room_waiters.wake();
        // A parked reader would never look again: wake it, so it sees the release (a server
        // answers its consumer with ProducerFailed and drops the view with the segment it
        // holds; a local channel fails its next read with Released).
        if let Some(slot) = self.listener.swap(None) {
            self.tell(|| slot.0.notify_data_available());
        }
        // A producer waiting for its consumers' acknowledgement stops waiting.
        self.all_data_processed.wake();
    }

    fn push_data(&self, consumer: BufferConsumer) -> Result<(), PartitionError> {
        if self.data.push(consumer).is_err() {
            unreachable!("the writer queues only after it saw room, and only it queues");
        }
        self.data_enqueued.fetch_add(1, Ordering::Relaxed);
        // A release that drained before the push landed: drain again, nothing may stay.
        if self.released.load(Ordering::SeqCst) {
            self.drain();
            return Err(PartitionError::Released);
        }
        Ok(())
    }

    fn drain(&self) {
        while self.data.pop().is_some() {}
        while self.priority.pop().is_some() {}
        self.room_made();
    }

    /// True when an item of kind `queued` can be queued now. Only the partition's writer
    /// queues, so room it saw stays until it queues. A released subpartition has room once
    /// its release has drained it (the push then fails as `Released`), not as soon as it is
    /// marked released: a lane still full would refuse the push.
    pub(crate) fn has_room(&self, queued: Queued) -> bool {
        match queued {
            Queued::Buffer => self.data.len() < self.buffer_room,
            Queued::Buffers(count) => {
                let count = count.clamp(1, self.buffer_room.saturating_sub(1).max(1));
                self.data.len() + count <= self.buffer_room
            }
            Queued::Event => !self.data.is_full(),
            Queued::PriorityEvent => !self.priority.is_full(),
        }
    }

    /// [`has_room`](Self::has_room), asking the reader's next take (or a release) to wake
    /// the pool's waiters when there is none.
    pub(crate) fn has_room_or_listen(&self, queued: Queued) -> bool {
        if self.has_room(queued) {
            return true;
        }
        self.room_wanted.store(true, Ordering::Relaxed);
        // Pairs with the fence in `room_made`: either the reader sees the flag, or this look
        // sees the item it took.
        fence(Ordering::SeqCst);
        self.has_room(queued)
    }

    /// An item left a lane: wakes a writer waiting for room.
    fn room_made(&self) {
        // Pairs with the fence in `has_room_or_listen`.
        fence(Ordering::SeqCst);
        if self.room_wanted.load(Ordering::Relaxed)
            && self.room_wanted.swap(false, Ordering::AcqRel)
        {
            self.room_waiters.wake();
        }
    }

    fn notify_if_waiting(&self) {
        // Pairs with the fence in `SubpartitionView::park`.
        fence(Ordering::SeqCst);
        self.notify_waiting_reader();
    }

    /// [`notify_if_waiting`](Self::notify_if_waiting) once the caller ran its fence.
    fn notify_waiting_reader(&self) {
        if self.reader_waiting.load(Ordering::Relaxed)
            && self.reader_waiting.swap(false, Ordering::AcqRel)
        {
            if let Some(slot) = self.listener.load().as_ref() {
                if !self.tell(|| slot.0.notify_data_available()) {
                    // Untold, it still waits: the next item or flush tells it again.
                    self.reader_waiting.store(true, Ordering::Release);
                }
            }
        }
    }

    /// Runs the reader's listener, the consumer's code, on whichever thread made something
    /// readable (the writer's, the output flusher's, an I/O thread): a panic in it is logged
    /// and costs that notification only, not the thread, nor (for the writer's `Drop`
    /// releasing the partition during an unwind) the process. Returns whether it ran through.
    /// (A release tells once, with nothing after it: a listener that panics then does not
    /// hear of the release.)
    fn tell(&self, notify: impl FnOnce()) -> bool {
        let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(notify)).is_ok();
        if !told {
            tracing::error!(
                subpartition = self.index,
                "a reader's availability listener panicked"
            );
        }
        told
    }

    /// Tells the reader of a priority event, whether it waits or not (Flink notifies every
    /// priority event: a reader without credit is not waiting, yet may send the event). The
    /// reader's waiting flag is left as it is: the reader may have taken this event already
    /// and parked again after it, and clearing the flag then would undo that park, leaving
    /// the next item untold to a reader that answers this call with a look and no park (a
    /// sender without credit). A flag left set costs at most one extra notification.
    fn notify_priority(&self) {
        fence(Ordering::SeqCst);
        if let Some(slot) = self.listener.load().as_ref() {
            self.tell(|| slot.0.notify_priority_event());
        }
    }

    // ---- reader side ----

    /// Creates the one reader of this subpartition.
    pub(crate) fn create_view(
        self: &Arc<Self>,
        listener: Arc<dyn AvailabilityListener>,
    ) -> Result<SubpartitionView, PartitionError> {
        if self.is_released() {
            return Err(PartitionError::Released);
        }
        if self.view_taken.swap(true, Ordering::AcqRel) {
            return Err(PartitionError::ViewExists(self.index));
        }
        self.listener.store(Some(Arc::new(ListenerSlot(listener))));
        let view = SubpartitionView {
            subpartition: self.clone(),
            head: None,
            data_taken: 0,
            unsent_taken: 0,
            sequence_number: 0,
            blocked: false,
            sends_empty_buffers: false,
        };
        // A new reader starts out waiting: the producer's next readable item notifies it.
        self.reader_waiting.store(true, Ordering::SeqCst);
        Ok(view)
    }
}

/// The reader of one subpartition (Flink's `PipelinedSubpartitionView`): a local input channel
/// or the network sender drains it. Dropping it releases the subpartition (pipelined
/// partitions are consumed once).
pub struct SubpartitionView {
    subpartition: Arc<PipelinedSubpartition>,
    /// The data-lane item being read; only it may be unfinished.
    head: Option<BufferConsumer>,
    /// Data-lane items fully taken.
    data_taken: u64,
    /// Of those, the ones dropped unsent (see `PipelinedSubpartition::unsent_enqueued`).
    unsent_taken: u64,
    sequence_number: u64,
    blocked: bool,
    /// A data buffer that ends with nothing left to read is handed out empty instead of
    /// dropped (see [`send_empty_buffers`](Self::send_empty_buffers)).
    sends_empty_buffers: bool,
}

impl fmt::Debug for SubpartitionView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubpartitionView")
            .field("subpartition", &self.subpartition.index)
            .field("sequence_number", &self.sequence_number)
            .field("blocked", &self.blocked)
            .finish()
    }
}

impl SubpartitionView {
    /// The next buffer or event with the backlog behind it, or `None` when nothing is readable
    /// now. Whenever this returns `None`, or an item whose `next_data_type` is `None`, the
    /// listener is told when something becomes readable.
    pub fn poll_next(&mut self) -> Option<BufferAndBacklog> {
        // Bounded: a retry happens only when data arrived between the look and the park.
        for _ in 0..2 {
            if let Some(item) = self.take() {
                return Some(item);
            }
            if !self.park() {
                return None;
            }
        }
        None
    }

    /// Whether something is readable now, and the backlog (Flink's
    /// `getAvailabilityAndBacklog`): with no credit only an event counts as readable.
    pub fn availability_and_backlog(&mut self, has_credit: bool) -> (bool, usize) {
        let next = self.peek_type();
        let available = if has_credit {
            next != DataType::None
        } else {
            next.is_event()
        };
        (available, self.backlog())
    }

    /// Registers for a notification when something becomes readable, after a look that found
    /// nothing (e.g. [`availability_and_backlog`](Self::availability_and_backlog)): a reader
    /// that was notified and found nothing new must wait again, or the next data would come
    /// without a notification. Returns true when something became readable meanwhile (no
    /// notification will come for it: read it now).
    pub fn wait_for_data(&mut self) -> bool {
        self.park()
    }

    /// Unblocks the view after a blocking-upstream item (aligned barrier) was consumed.
    /// Returns whether something is readable now.
    pub fn resume_consumption(&mut self) -> bool {
        self.blocked = false;
        // Parks when nothing is readable: the look may have moved the head (popped the next
        // item), and the next flush must judge by that head (see `park`).
        self.peek_type() != DataType::None || self.park()
    }

    /// Data buffers readable but not yet taken (what a sender announces as backlog): the
    /// finished ones, plus the unfinished tail when it is next in line and a flush made bytes
    /// in it readable.
    ///
    /// Flink's `getBuffersInBacklogUnsafe` counts the tail while a flush is requested. A
    /// consumer without exclusive buffers asks for floating ones only for the backlog it hears
    /// of, so a sender left holding a flushed tail and no credit would otherwise wait for
    /// credit that never comes. A tail behind finished buffers is not counted: the backlog
    /// reported with the last of them counts it, and an overstated backlog would have the
    /// consumer lend a floating buffer that no data comes for, which other channels may need.
    pub fn backlog(&self) -> usize {
        if self.blocked {
            return 0;
        }
        let sub = &self.subpartition;
        // The count is read after the head's state, never before: the producer counts a
        // buffer before it finishes it, so a count read after seeing the head finished
        // includes it. Read before, it could predate the count while the finish was seen,
        // and a sender told "next is data" reported a backlog of 0; a consumer without
        // exclusive buffers then asked for nothing and the sender waited for credit.
        match &self.head {
            // Only the last item may be unfinished, so nothing finished waits behind this
            // head; the count can only be the one taken just before this very head
            // finishes. Either way the head is at most one buffer.
            Some(head) if !head.is_finished() => {
                let finished = sub.backlog.load(Ordering::Acquire);
                let flushed_tail =
                    sub.flush_requested.load(Ordering::Acquire) && head.is_data_available();
                finished.max(usize::from(flushed_tail))
            }
            _ => sub.backlog.load(Ordering::Acquire),
        }
    }

    /// True when the next item [`poll_next`](Self::poll_next) returns is a priority event (a
    /// look only: it claims nothing). A blocked or released view reads nothing.
    pub fn has_priority_event(&self) -> bool {
        !self.blocked && !self.subpartition.is_released() && !self.subpartition.priority.is_empty()
    }

    /// The consumer processed every record of this subpartition, up to its EndOfData
    /// (FLIP-147's `acknowledgeAllDataProcessed`): counted once towards the partition's
    /// [`is_all_data_processed`](super::PartitionHandle::is_all_data_processed).
    pub fn acknowledge_all_data_processed(&self) {
        let sub = &self.subpartition;
        if !sub.data_processed.swap(true, Ordering::SeqCst) {
            sub.all_data_processed.acknowledge();
        }
    }

    /// True after an aligned barrier was taken and before `resume_consumption`.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// True once the subpartition was released (by either side).
    pub fn is_released(&self) -> bool {
        self.subpartition.is_released()
    }

    /// A one-line summary of the queue state, for diagnosing stalls.
    pub fn debug_summary(&self) -> String {
        let sub = &self.subpartition;
        format!(
            "seq {} data lane {} priority lane {} backlog {} events {} waiting {} flush {} head {} blocked {}",
            self.sequence_number,
            sub.data.len(),
            sub.priority.len(),
            sub.backlog.load(Ordering::Relaxed),
            sub.queued_events.load(Ordering::Relaxed),
            sub.reader_waiting.load(Ordering::Relaxed),
            sub.flush_requested.load(Ordering::Relaxed),
            self.head.as_ref().map_or("none".to_string(), |h| format!(
                "finished {} unread {}",
                h.is_finished(),
                h.unread_bytes()
            )),
            self.blocked,
        )
    }

    /// The reader sends to a consumer without exclusive buffers: from now on a data buffer
    /// that ends with nothing left to read (finished empty, or read to its end by flushes
    /// before its finish) is handed out as an empty buffer, with its sequence number and the
    /// backlog, instead of being dropped, as Flink's `pollBuffer` does for such a receiver.
    /// The backlog counted it, so the consumer may have lent a floating buffer as credit for
    /// it: the empty buffer spends that credit, and the consumer gives the floating buffer
    /// back to its gate, where another channel may be waiting for it. Dropped, it stayed the
    /// channel's credit until the producer's next buffer, however long that took.
    ///
    /// Such a buffer carries no data item: in what a priority event overtakes it counts as
    /// what it is, a buffer dropped unsent when finished empty, and a sent one when its bytes
    /// went out before.
    pub fn send_empty_buffers(&mut self) {
        self.sends_empty_buffers = true;
    }

    /// Why the producer failed, if it released its partition saying so
    /// ([`ResultPartition::fail`](super::ResultPartition::fail)).
    pub fn failure_cause(&self) -> Option<&str> {
        self.subpartition.failure.get().map(String::as_str)
    }

    /// The subpartition's index within its partition.
    pub fn subpartition_index(&self) -> usize {
        self.subpartition.index
    }

    /// Releases the subpartition and everything queued in it.
    pub fn release(self) {
        drop(self);
    }

    fn take(&mut self) -> Option<BufferAndBacklog> {
        if self.subpartition.is_released() {
            // The buffer being read goes back to its pool now, not when the view is dropped:
            // a writer may wait for it.
            self.head = None;
            return None;
        }
        if self.blocked {
            return None;
        }
        // The data lane's next item first, then the priority lane: a data item the producer
        // queued after a priority event is seen only with that event's push, so the event
        // comes out first. Looked at the other way round, a reader that found the priority
        // lane empty could then take data written after the event ahead of it.
        let next_data = self.peek_data_type();
        if let Some(PriorityItem {
            mut consumer,
            sent_before,
        }) = self.subpartition.priority.pop()
        {
            self.subpartition.room_made();
            // The producer finished every builder before queueing the event, so a head already
            // read to its end is done: it is not among the overtaken.
            let mut done_behind = 0;
            if let Some(head) = self
                .head
                .as_ref()
                .filter(|h| h.is_finished() && !h.is_data_available())
            {
                if self.sends_empty_buffers {
                    // It goes out after the event, empty: no data item the event overtakes.
                    // (Finished empty, it was never counted among the sent ones.)
                    done_behind = u64::from(head.written_bytes() > 0);
                } else {
                    if head.written_bytes() == 0 {
                        self.unsent_taken += 1;
                    }
                    self.take_head_out();
                }
            }
            let buffer = consumer.build();
            let overtaken = sent_before
                .saturating_sub(self.data_taken + done_behind - self.unsent_taken)
                as usize;
            return Some(self.emit(buffer, overtaken));
        }
        if next_data == DataType::None {
            return None;
        }
        if self.subpartition.is_released() {
            // Released since the first look: its drain may have taken the priority event
            // this read was for, and a sender without credit, there for the event, must not
            // get the data buffer instead. (`released` is set before the drain.)
            self.head = None;
            return None;
        }
        let head = self.head.as_mut().expect("a readable head");
        if !head.is_finished() {
            // The flushed part of the unfinished tail. A swap, not a store: it reads the
            // latest flag, so a flush that lands while this runs either is read here (and the
            // build below sees the bytes that flush published) or stays set for the next
            // look. A store could sit in the store buffer past that flush, clear it, and leave
            // its bytes unread, the reader parked and nobody told.
            let flushed = self
                .subpartition
                .flush_requested
                .swap(false, Ordering::AcqRel);
            let buffer = head.build();
            // The producer may have finished this head since the look above, started the
            // next buffer and flushed that: the flag just cleared was then the next buffer's
            // (its finish came before that flush, so the acquire above makes it visible
            // here). Set again, it makes that buffer's flushed bytes readable; at worst a
            // flush meant for this head lets the next one's first bytes out early.
            if flushed && head.is_finished() {
                self.subpartition
                    .flush_requested
                    .store(true, Ordering::Release);
            }
            return Some(self.emit(buffer, 0));
        }
        if head.data_type() == DataType::TimeoutableAlignedCheckpointBarrier {
            match self.timeoutable_head(true) {
                Claim::Keep => {}
                // Turned unaligned since the look: its copy is queued as a priority event,
                // which the next take finds (bounded: the original goes, and the writer turns
                // one barrier at a time).
                Claim::Drop => {
                    self.unsent_taken += 1;
                    self.take_head_out();
                    return self.take();
                }
                Claim::Wait => return None,
            }
        }
        let head = self.head.as_mut().expect("a readable head");
        let buffer = head.build();
        if buffer.is_empty() && head.written_bytes() == 0 {
            // Finished empty, handed out only to a consumer without exclusive buffers.
            self.unsent_taken += 1;
        }
        self.take_head_out();
        Some(self.emit(buffer, 0))
    }

    /// The head was read to its end: account for it and move on.
    fn take_head_out(&mut self) {
        let head = self.head.take().expect("a head to take out");
        let sub = &self.subpartition;
        self.data_taken += 1;
        if head.data_type().is_buffer() {
            sub.backlog.fetch_sub(1, Ordering::AcqRel);
        } else {
            sub.queued_events.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn emit(&mut self, buffer: crate::buffer::Buffer, overtaken: usize) -> BufferAndBacklog {
        if buffer.data_type().is_blocking_upstream() {
            self.blocked = true;
        }
        let sequence_number = self.sequence_number;
        self.sequence_number += 1;
        let mut next_data_type = self.peek_type();
        if next_data_type == DataType::None && self.park() {
            // Data arrived while parking, and this side took the wake-up: report it.
            next_data_type = self.peek_type();
        }
        BufferAndBacklog {
            buffer,
            backlog: self.backlog(),
            next_data_type,
            sequence_number,
            overtaken,
        }
    }

    /// The type of the next readable item, `DataType::None` if nothing is readable.
    fn peek_type(&mut self) -> DataType {
        if self.subpartition.is_released() {
            self.head = None;
            return DataType::None;
        }
        if self.blocked {
            return DataType::None;
        }
        if !self.subpartition.priority.is_empty() {
            return DataType::PrioritizedEventBuffer;
        }
        self.peek_data_type()
    }

    /// The type of the next readable data-lane item; pulls it into `head`, discarding finished
    /// empty data buffers on the way.
    fn peek_data_type(&mut self) -> DataType {
        loop {
            if self.head.is_none() {
                match self.subpartition.data.pop() {
                    Some(consumer) => {
                        self.subpartition.room_made();
                        self.head = Some(consumer);
                    }
                    None => return DataType::None,
                }
            }
            let head = self.head.as_ref().expect("set above");
            if head.is_finished() {
                if head.data_type().is_buffer()
                    && !head.is_data_available()
                    && !self.sends_empty_buffers
                {
                    // Finished empty, never sent; or read to its end by flushes before it was
                    // finished, sent already.
                    if head.written_bytes() == 0 {
                        self.unsent_taken += 1;
                    }
                    self.take_head_out();
                    continue;
                }
                let data_type = head.data_type();
                if data_type == DataType::TimeoutableAlignedCheckpointBarrier {
                    // A look only: the barrier stays convertible until it is taken (`take`
                    // claims it), as Flink's barrier times out until its reader polls it.
                    match self.timeoutable_head(false) {
                        Claim::Keep => {}
                        Claim::Drop => {
                            self.unsent_taken += 1;
                            self.take_head_out();
                            continue;
                        }
                        Claim::Wait => return DataType::None,
                    }
                }
                return data_type;
            }
            let flushed = self.subpartition.flush_requested.load(Ordering::Acquire);
            return if flushed && head.is_data_available() {
                head.data_type()
            } else {
                DataType::None
            };
        }
    }

    /// The head is an aligned barrier with a timeout: sent in place unless the writer turned
    /// it unaligned (see [`PipelinedSubpartition::timeoutable`]). `claim`: it is being taken,
    /// and the writer can no longer turn it; else a look, which leaves it to the writer.
    fn timeoutable_head(&self, claim: bool) -> Claim {
        let sub = &self.subpartition;
        let here = self.data_taken + 1;
        // Bounded: `timeoutable` changes at most twice (claimed or turning, then cleared) for
        // one barrier.
        for _ in 0..4 {
            let state = sub.timeoutable.load(Ordering::Acquire);
            if state & !CONVERTING == here {
                if state & CONVERTING != 0 {
                    // Its copy is being queued; the writer's priority notification follows.
                    return Claim::Wait;
                }
                if !claim {
                    return Claim::Keep;
                }
                if sub
                    .timeoutable
                    .compare_exchange(state, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Claim::Keep;
                }
                continue;
            }
            // Not (or no longer) the convertible one: turned unaligned, or not timing out.
            if sub.converted.load(Ordering::Acquire) == here {
                sub.converted.store(0, Ordering::Release);
                return Claim::Drop;
            }
            return Claim::Keep;
        }
        Claim::Wait
    }

    /// Registers as waiting, then looks once more. Returns true when something became
    /// readable and this side cleared the flag itself (so no notification will come).
    fn park(&mut self) -> bool {
        if self.blocked {
            // Nothing is readable until the reader resumes, and `resume_consumption` looks
            // again itself: no finished buffer or flush wakes a blocked reader, as Flink's
            // subpartition notifies none (a release still does).
            self.subpartition
                .reader_waiting
                .store(false, Ordering::Relaxed);
            return false;
        }
        let mut parked_at = self.parked_position();
        // Bounded: a second round only when the look moved the head, with `PARKED_ANYWHERE`.
        for _ in 0..2 {
            // Before `reader_waiting`, whose release store publishes it to a flush.
            self.subpartition
                .parked_at
                .store(parked_at, Ordering::Relaxed);
            self.subpartition
                .reader_waiting
                .store(true, Ordering::Release);
            // Pairs with the fences in `notify_if_waiting` and `flush`.
            fence(Ordering::SeqCst);
            if self.peek_type() != DataType::None {
                return self
                    .subpartition
                    .reader_waiting
                    .swap(false, Ordering::AcqRel);
            }
            if parked_at == PARKED_ANYWHERE || self.parked_position() == parked_at {
                return false;
            }
            // The look moved the head (took a finished one out, popped the next item,
            // unflushed): a flush would judge by a head the reader no longer holds and could
            // stay silent about the new one's bytes. Until the next park, every flush tells
            // the reader; a flush that came before this is seen by the look after the fence.
            parked_at = PARKED_ANYWHERE;
        }
        false
    }

    /// What a flush compares with while this reader is parked (see
    /// `PipelinedSubpartition::parked_at`).
    fn parked_position(&self) -> u64 {
        match &self.head {
            Some(head) if !head.is_finished() => {
                (u64::from(head.segment_index()) + 1) << 32 | u64::from(head.read_position())
            }
            _ => 0,
        }
    }
}

/// `parked_at` of a reader whose head moved under its last look while parking: every flush
/// tells it.
const PARKED_ANYWHERE: u64 = u64::MAX;

/// What the reader does with an aligned barrier with a timeout at its head.
enum Claim {
    /// Send it, in place.
    Keep,
    /// Drop it: its unaligned copy went ahead.
    Drop,
    /// Nothing readable yet: its unaligned copy is being queued.
    Wait,
}

impl Drop for SubpartitionView {
    fn drop(&mut self) {
        self.head = None;
        self.subpartition.release();
    }
}
