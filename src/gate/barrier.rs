//! Checkpoint barriers at the gate (Flink's `CheckpointedInputGate` with its barrier
//! handlers): aligned, unaligned, and cancellation, and the end of recovered channel state.

use std::fmt;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::Instant;

use super::{BufferOrEvent, GateError, GateItem, InputGate, RETRY_CHECK};
use crate::buffer::Buffer;
use crate::event::{Alignment, CheckpointBarrier, Event};
use crate::partition::ResultPartition;

/// How a task's wait for its back-pressured output, or outputs, ended
/// ([`CheckpointedInputGate::wait_for_output`], [`CheckpointedInputGate::wait_for_outputs`]).
#[derive(Debug)]
pub enum OutputWait {
    /// The output (every output, for `wait_for_outputs`) takes the next record without
    /// waiting for memory: read input again.
    Available,
    /// An event the task handles now, while its output is still back-pressured: a checkpoint
    /// barrier that came as a priority event (unaligned, or turned unaligned at its
    /// alignment's timeout), to trigger the checkpoint with and send on as a priority event,
    /// or a cancellation marker; or the event next in line after one the gate handed out
    /// before (an end of partition after the barrier its end completed). Never data. The
    /// task waits again afterwards.
    Event(BufferOrEvent),
}

/// The first of `outputs` that does not take records now (`None`: they all do).
fn first_back_pressured<O: AsMut<ResultPartition>>(
    outputs: &mut [O],
) -> Option<&mut ResultPartition> {
    outputs
        .iter_mut()
        .map(AsMut::as_mut)
        .find(|output| !output.is_available())
}

/// Unparks the thread blocked in [`CheckpointedInputGate::wait_for_output`].
struct UnparkThread(Thread);

impl Wake for UnparkThread {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// How barriers are aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlignmentMode {
    /// A channel that delivered barrier n is blocked until every channel did; then all resume
    /// and the barrier is handed to the task once.
    Aligned,
    /// Unaligned checkpoints enabled (Flink's alternating handler, which its tasks use then):
    /// a checkpoint whose barriers are aligned ones (a savepoint's, or `ForcedAligned` ones of
    /// point-wise inputs) aligns as in [`Aligned`](AlignmentMode::Aligned); its first
    /// unaligned barrier triggers it at once, or turns its alignment unaligned (the channels
    /// blocked so far stay blocked until it completes); from then on data received before
    /// each channel's barrier goes to the channel-state sink, by reference, and a channel
    /// whose barrier is an aligned one blocks at it until the checkpoint completes (its data
    /// before the barrier was persisted as it was read). A checkpoint whose barriers are
    /// aligned with a timeout ([`Alignment::AlignedWithTimeout`], Flink's
    /// `execution.checkpointing.aligned-checkpoint-timeout`) aligns until that long after it
    /// started (the barrier's timestamp), then turns unaligned the same way: its barrier comes
    /// out as an unaligned one, the channels blocked so far stay blocked until it completes,
    /// and the others' data is persisted up to their barriers.
    Unaligned,
}

/// Receives the in-flight input data of unaligned checkpoints (Flink's `ChannelStateWriter`,
/// input side). For one channel and checkpoint, the calls come in stream order: a partial
/// record first, then the buffers after it; restoring feeds them to a record reader in that
/// order.
pub trait ChannelStateSink: Send + Sync {
    /// A buffer of `channel` that precedes its barrier of checkpoint `checkpoint_id`; the
    /// buffer shares the segment (no copy).
    fn add_input_data(&self, checkpoint_id: u64, channel: usize, buffer: Buffer);
    /// The bytes of `channel` the task's reader had not consumed when checkpoint
    /// `checkpoint_id` started (Flink's `getUnconsumedBuffer`): a record begun and not
    /// finished (its length prefix and the part received), and, for a barrier taken in the
    /// middle of a buffer, the rest of that buffer. The rest follows in the channel's
    /// in-flight buffers.
    fn add_partial_record(&self, checkpoint_id: u64, channel: usize, bytes: &[u8]);
    /// Every channel's in-flight data of the unaligned checkpoint `checkpoint_id` was handed
    /// over (a checkpoint that stayed aligned has none, and is not reported).
    fn input_complete(&self, checkpoint_id: u64);
    /// Checkpoint `checkpoint_id` was aborted (a newer one subsumed it, or a cancellation
    /// marker came): what was handed over for it can go.
    fn abort(&self, checkpoint_id: u64);
}

/// What an unaligned checkpoint still persists of one channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Persist {
    /// Nothing (barrier seen and its overtaken data persisted, or no checkpoint running).
    Done,
    /// Every data buffer until the channel's barrier arrives.
    UntilBarrier,
    /// This many more data buffers (the ones its barrier overtook).
    Next(usize),
    /// The next `skip` data-lane items were taken ahead of their turn and persisted when the
    /// barrier came; the `then` after them are in flight still.
    Skip { skip: usize, then: usize },
}

impl Persist {
    /// What is left to persist of `then` items after `skip` already persisted.
    fn after(skip: usize, then: usize) -> Self {
        match (skip, then) {
            (_, 0) => Persist::Done,
            (0, n) => Persist::Next(n),
            (skip, then) => Persist::Skip { skip, then },
        }
    }
}

/// A gate whose barriers are aligned (or not) before the task sees them.
pub struct CheckpointedInputGate<G> {
    gate: G,
    mode: AlignmentMode,
    sink: Option<Arc<dyn ChannelStateSink>>,
    /// The checkpoint being aligned or persisted.
    current: Option<u64>,
    /// Highest checkpoint completed or aborted: its late barriers are ignored.
    last_done: Option<u64>,
    barrier_seen: Vec<bool>,
    /// Barriers each channel delivered, of any kind and checkpoint (late ones and those
    /// moved ahead of their data included).
    barriers_received: Vec<u64>,
    /// Channels blocked behind an aligned barrier.
    blocked: Vec<usize>,
    persist: Vec<Persist>,
    /// The running checkpoint is unaligned: it persists in-flight data.
    unaligned: bool,
    /// The barrier of the aligned checkpoint in progress (and a channel it came on): when the
    /// alignment completes because a channel ended rather than on a barrier, this is the
    /// barrier the task sees, so it still forwards it downstream.
    held_barrier: Option<(usize, CheckpointBarrier)>,
    /// An item read from the gate that goes to the task after a barrier surfaced ahead of it.
    deferred: Option<BufferOrEvent>,
    /// When the alignment in progress turns unaligned: set by the first barrier of a
    /// checkpoint aligned with a timeout, in unaligned mode, read or only announced.
    alignment_deadline: Option<Instant>,
    /// The oldest aligned barrier with a timeout that a channel received and the task has not
    /// read yet, of a checkpoint not done (Flink's `EventAnnouncement`): its timeout runs from
    /// the checkpoint's start whether or not the task reads as far as the barrier, and at the
    /// timeout it moves ahead of the data before it.
    announced: Option<(usize, CheckpointBarrier)>,
    /// `announced` went stale (its checkpoint ended unread): the next scan looks at every
    /// channel, not only those that announced since, for what the last scan passed over.
    rescan_announcements: bool,
    /// Channels whose upstream finished sending recovered channel state (EndOfChannelState
    /// blocks each until every channel got there: Flink's `UpstreamRecoveryTracker`).
    recovered: Vec<bool>,
    /// Channels that took data ahead of its turn for the running checkpoint (behind a
    /// priority barrier, or a barrier moved ahead at the alignment's timeout), still to be
    /// persisted: after the barrier that came out to the task, on the next read, so a record
    /// reader's half-read records reach the sink first; before the checkpoint completes.
    taken_ahead: Vec<usize>,
    /// Wakes a pending `next_async` at the alignment's timeout or a retry.
    timer: super::WakeTimer,
}

impl<G> Drop for CheckpointedInputGate<G> {
    /// A task that goes away (cancelled, failed, finished) mid-checkpoint: the sink lets go
    /// of the in-flight data it was handed (buffers sharing the gate's segments), as after an
    /// abort. Blocked channels are not resumed: nothing reads them any more.
    fn drop(&mut self) {
        if let (Some(id), true, Some(sink)) = (self.current, self.unaligned, &self.sink) {
            sink.abort(id);
        }
    }
}

impl<G> fmt::Debug for CheckpointedInputGate<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointedInputGate")
            .field("mode", &self.mode)
            .field("current", &self.current)
            .field("last_done", &self.last_done)
            .field("blocked", &self.blocked)
            .finish()
    }
}

impl<G: InputGate> CheckpointedInputGate<G> {
    /// Wraps `gate`; `sink` receives unaligned checkpoints' in-flight data.
    pub fn new(gate: G, mode: AlignmentMode, sink: Option<Arc<dyn ChannelStateSink>>) -> Self {
        let channels = gate.channel_count();
        Self {
            gate,
            mode,
            sink,
            current: None,
            last_done: None,
            barrier_seen: vec![false; channels],
            barriers_received: vec![0; channels],
            blocked: Vec::new(),
            persist: vec![Persist::Done; channels],
            unaligned: false,
            held_barrier: None,
            deferred: None,
            alignment_deadline: None,
            announced: None,
            rescan_announcements: false,
            recovered: vec![false; channels],
            taken_ahead: Vec::with_capacity(channels),
            timer: super::WakeTimer::default(),
        }
    }

    /// The wrapped gate.
    pub fn gate(&self) -> &G {
        &self.gate
    }

    /// The wrapped gate, mutably.
    pub fn gate_mut(&mut self) -> &mut G {
        &mut self.gate
    }

    /// The checkpoint being aligned or persisted.
    pub fn pending_checkpoint(&self) -> Option<u64> {
        self.current
    }

    /// Channels blocked behind an aligned barrier now.
    pub fn blocked_channels(&self) -> &[usize] {
        &self.blocked
    }

    /// How many checkpoint barriers `channel` delivered so far, of any kind and checkpoint,
    /// whether they reached the task or not (late ones, a checkpoint's second on a channel,
    /// those moved ahead of their data): once the channel ended, as many as its producer
    /// wrote to it. 0 for a channel the gate does not have.
    pub fn barriers_received(&self, channel: usize) -> u64 {
        self.barriers_received.get(channel).copied().unwrap_or(0)
    }

    /// When the alignment in progress stops waiting and turns unaligned (a checkpoint aligned
    /// with a timeout, in unaligned mode). A task that reads with
    /// [`poll_next`](Self::poll_next) from an event loop polls again by then, or calls
    /// [`handle_timeout`](Self::handle_timeout); the blocking reads wake for it themselves.
    pub fn alignment_deadline(&self) -> Option<Instant> {
        self.alignment_deadline
    }

    /// The next item the task should see, without blocking.
    pub fn poll_next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if let Some(item) = self.deferred.take() {
            return Ok(Some(item));
        }
        self.read_handled(G::poll_next)
    }

    /// What is due first, then `read`'s items through the barrier handler until one is for
    /// the task (or `read` has none now).
    fn read_handled(
        &mut self,
        mut read: impl FnMut(&mut G) -> Result<Option<BufferOrEvent>, GateError>,
    ) -> Result<Option<BufferOrEvent>, GateError> {
        self.persist_taken_ahead()?;
        self.note_announced_barriers();
        // What an announcement took ahead just now, before a read takes any of it.
        self.persist_taken_ahead()?;
        if let Some(item) = self.time_out_alignment_if_due() {
            return Ok(Some(item));
        }
        // Bounded by what the gate can deliver now; swallowed barriers loop.
        loop {
            let Some(item) = read(&mut self.gate)? else {
                return Ok(None);
            };
            if let Some(item) = self.handle(item)? {
                return Ok(Some(item));
            }
            // A swallowed barrier's data taken ahead: before the next read takes any of it.
            self.persist_taken_ahead()?;
            // A swallowed barrier may have started an alignment already past its timeout
            // (usual under back pressure): the switch comes first, not after the gate's items.
            if let Some(item) = self.time_out_alignment_if_due() {
                return Ok(Some(item));
            }
        }
    }

    /// The next item only if it is an event the task handles although its output is
    /// back-pressured (Flink's `processPriorityEvents`): a barrier that came as a priority
    /// event (an unaligned one, which triggers or turns the checkpoint unaligned here as in
    /// [`poll_next`](Self::poll_next)), a barrier whose alignment just timed out, a
    /// cancellation marker, or an event the gate holds back as next in line (see
    /// [`OutputWait::Event`]). No data is read: `Ok(None)` when there is no such event.
    ///
    /// A task that processes a record at a time reads so while its output is unavailable, at
    /// record boundaries; the checkpoint's snapshot then counts the records of the current
    /// buffer it has not processed as in-flight input (a [`RecordReader`](super::RecordReader)
    /// hands those to the channel-state sink itself).
    pub fn poll_priority(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if let Some(item) = self.deferred.take() {
            if matches!(item.item, GateItem::Event { .. }) {
                return Ok(Some(item));
            }
            self.deferred = Some(item);
            return Ok(None);
        }
        self.read_handled(G::poll_priority_event)
    }

    /// Blocks while `output` is back-pressured ([`ResultPartition::is_available`] false),
    /// handling what a task must handle meanwhile (Flink's task suspends its input then, and
    /// its mailbox still runs priority events and timers): returns
    /// [`OutputWait::Available`] once the output takes records again, or
    /// [`OutputWait::Event`] with a priority barrier or cancellation marker to handle first
    /// ([`poll_priority`](Self::poll_priority)); then the task asks again. Meanwhile it turns
    /// this gate's alignment unaligned at its timeout, retries due partition requests, and
    /// turns `output`'s pending aligned barrier unaligned at its own timeout.
    /// [`GateError::TimedOut`] at `deadline`.
    ///
    /// Without it, a task blocked in a record's write under back pressure reads its next
    /// barrier only after a consumer downstream frees a buffer, which can take as long as
    /// the checkpoint is meant to skip.
    pub fn wait_for_output(
        &mut self,
        output: &mut ResultPartition,
        deadline: Option<Instant>,
    ) -> Result<OutputWait, GateError> {
        if output.is_available() {
            return Ok(OutputWait::Available);
        }
        let waker = Waker::from(Arc::new(UnparkThread(thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut available = pin!(output.until_available());
        loop {
            if let Poll::Ready(waited) = self.poll_wait_for_output(available.as_mut(), &mut cx) {
                return waited;
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Err(GateError::TimedOut);
            }
            // The waker unparks for the output, a priority event, and the output's barrier
            // timer; the gate's own deadlines are waited for here.
            let wake = [deadline, InputGate::poll_timeout(self)]
                .into_iter()
                .flatten()
                .min()
                .map_or(RETRY_CHECK, |due| due.saturating_duration_since(now));
            thread::park_timeout(wake.min(RETRY_CHECK));
        }
    }

    /// [`wait_for_output`](Self::wait_for_output) for a task with several outputs, as
    /// Flink's task waits for its `RecordWriterDelegate`, which is available when all of its
    /// writers are: [`OutputWait::Available`] comes only from a look at which every output
    /// takes records. Waiting for the outputs one after another would not do: an event the
    /// task handles while it waits for one (a barrier it writes to all) can fill another that
    /// had room, and the next record would then block in its write. Takes anything that
    /// gives its partition (a [`ResultPartition`], a `&mut` one, a
    /// [`RecordWriter`](crate::partition::RecordWriter)). [`GateError::TimedOut`] at
    /// `deadline`, as the single wait gives it. Each pass waits for the one output it found
    /// back-pressured, so it is that output's pending aligned barrier whose timeout this
    /// wait turns unaligned; the others' turn at their own waits and writes.
    pub fn wait_for_outputs<O: AsMut<ResultPartition>>(
        &mut self,
        outputs: &mut [O],
        deadline: Option<Instant>,
    ) -> Result<OutputWait, GateError> {
        // Each pass blocks until the output it found back-pressured takes records, an event
        // comes, or the deadline passes: a wait, not a spin.
        loop {
            let Some(output) = first_back_pressured(outputs) else {
                return Ok(OutputWait::Available);
            };
            match self.wait_for_output(output, deadline)? {
                OutputWait::Available => {}
                event => return Ok(event),
            }
        }
    }

    /// [`wait_for_outputs`](Self::wait_for_outputs) without blocking the thread (any
    /// executor).
    pub async fn wait_for_outputs_async<O: AsMut<ResultPartition>>(
        &mut self,
        outputs: &mut [O],
    ) -> Result<OutputWait, GateError> {
        loop {
            let Some(output) = first_back_pressured(outputs) else {
                return Ok(OutputWait::Available);
            };
            match self.wait_for_output_async(output).await? {
                OutputWait::Available => {}
                event => return Ok(event),
            }
        }
    }

    /// [`wait_for_output`](Self::wait_for_output) without blocking the thread (any executor).
    pub async fn wait_for_output_async(
        &mut self,
        output: &mut ResultPartition,
    ) -> Result<OutputWait, GateError> {
        if output.is_available() {
            return Ok(OutputWait::Available);
        }
        let mut available = pin!(output.until_available());
        std::future::poll_fn(|cx| {
            let waited = self.poll_wait_for_output(available.as_mut(), cx);
            if waited.is_pending() {
                if let Some(due) = InputGate::poll_timeout(self) {
                    self.timer.wake_at(due, cx.waker());
                }
            }
            waited
        })
        .await
    }

    /// One look of a wait for the output: what is due, the output, then priority events,
    /// with `cx`'s waker registered at both before they are found wanting.
    fn poll_wait_for_output(
        &mut self,
        available: Pin<&mut impl Future<Output = ()>>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<OutputWait, GateError>> {
        let now = Instant::now();
        if InputGate::poll_timeout(self).is_some_and(|due| now >= due) {
            if let Err(error) = self.handle_timeout(now) {
                return Poll::Ready(Err(error));
            }
        }
        if available.poll(cx).is_ready() {
            return Poll::Ready(Ok(OutputWait::Available));
        }
        // Two rounds at most: what was queued, or a close, before the first registration is
        // read by the second round's look; what comes after it wakes the waker.
        for _ in 0..2 {
            match self.poll_priority() {
                Err(error) => return Poll::Ready(Err(error)),
                Ok(Some(item)) => return Poll::Ready(Ok(OutputWait::Event(item))),
                Ok(None) => {}
            }
            // A channel queued for a priority event after the registration wakes the waker
            // (data queued wakes it too, at most once per channel while the task reads
            // none), and so does a close. Nothing queued and not closed: nothing slipped in.
            if !self.gate.register_waker(cx.waker()) {
                break;
            }
        }
        Poll::Pending
    }

    /// The next item the task should see, without blocking the thread (any executor): the
    /// wrapped gate's data wakes it, and a timer the alignment's timeout (and a partition
    /// request's retry), as the blocking reads wake for them.
    pub async fn next_async(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        let timer = self.timer.clone();
        super::read_async(self, timer).await
    }

    /// The next item the task should see, blocking; `Ok(None)` at the end.
    // A blocking, fallible read (Flink's `getNext`), not an iterator: items borrow the reader.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        self.next_until(None)
    }

    /// [`next`](Self::next) giving up at `deadline` with [`GateError::TimedOut`].
    pub fn next_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<BufferOrEvent>, GateError> {
        if let Some(item) = self.deferred.take() {
            return Ok(Some(item));
        }
        loop {
            self.persist_taken_ahead()?;
            self.note_announced_barriers();
            self.persist_taken_ahead()?;
            if let Some(item) = self.time_out_alignment_if_due() {
                return Ok(Some(item));
            }
            let wake = match self.alignment_deadline {
                Some(alignment) => Some(deadline.map_or(alignment, |d| d.min(alignment))),
                None => deadline,
            };
            let item = match self.gate.next_until(wake) {
                // The alignment's deadline (perhaps the caller's too): turned at the loop's
                // top, or here when the caller's ends the read.
                Err(GateError::TimedOut) => match self.time_out_alignment(Instant::now()) {
                    Some(item) => return Ok(Some(item)),
                    None if wake != deadline => continue,
                    None => return Err(GateError::TimedOut),
                },
                read => read?,
            };
            let Some(item) = item else {
                return Ok(None);
            };
            if let Some(item) = self.handle(item)? {
                return Ok(Some(item));
            }
        }
    }

    /// Retries due partition requests of the wrapped gate, and turns an alignment whose
    /// timeout passed unaligned (its barrier is the next item read).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), GateError> {
        self.note_announced_barriers();
        if self.deferred.is_none() {
            self.deferred = self.time_out_alignment(now);
        }
        self.gate.handle_timeout(now)
    }

    /// Starts the alignment's timer at the barriers channels received before the task read
    /// them (Flink's `processBarrierAnnouncement`): a task reading a backlog of data queued
    /// before a barrier would otherwise start it only once it read as far as the barrier,
    /// past its deadline already, and the alignment could last far longer than its timeout.
    /// An announcement of a newer checkpoint than the one aligning waits for that one to end.
    /// One load per read while nothing is announced, none while an alignment runs against its
    /// deadline (announcements wait in the gate); unaligned mode only.
    fn note_announced_barriers(&mut self) {
        if self.mode != AlignmentMode::Unaligned {
            return;
        }
        let last_done = self.last_done;
        let done = |barrier: &CheckpointBarrier| last_done.is_some_and(|d| barrier.id <= d);
        let stale = self.announced.is_some_and(|(_, barrier)| done(&barrier));
        if stale {
            // Its checkpoint ended (completed, aborted, cancelled) without reading it; with no
            // checkpoint running, the deadline was its own.
            self.announced = None;
            self.rescan_announcements = true;
            if self.current.is_none() {
                self.alignment_deadline = None;
            }
        }
        if self.unaligned {
            self.convert_announced_barriers();
            return;
        }
        if self.alignment_deadline.is_some() {
            return;
        }
        let mut oldest = self.announced;
        // After a stale one, all again (once a scan runs): announcements of newer
        // checkpoints the last scan passed over for it are not reported twice.
        let rescan = std::mem::take(&mut self.rescan_announcements);
        self.gate
            .for_each_new_announcement(rescan, &mut |channel, barrier| {
                if !done(&barrier)
                    && barrier.alignment_timeout_ms().is_some()
                    && oldest.is_none_or(|(_, o)| barrier.id < o.id)
                {
                    oldest = Some((channel, barrier));
                }
            });
        self.announced = oldest;
        let Some((_, barrier)) = oldest else {
            return;
        };
        if self.current.is_some_and(|current| current != barrier.id) {
            return;
        }
        self.alignment_deadline = barrier.alignment_deadline(Instant::now());
    }

    /// The running checkpoint is unaligned: a barrier of it that a channel received behind
    /// data since the last look goes ahead of that data now (Flink's
    /// `processBarrierAnnouncement` while unaligned), not only once the task reads a buffer of
    /// that channel, which a back-pressured task, reading priority events only, does not do
    /// until its output frees a buffer. The checkpoint can then complete meanwhile. What was
    /// taken ahead is persisted by the caller's next `persist_taken_ahead`. Announcements of
    /// other checkpoints are looked at again once this one ends (the flag is taken here).
    fn convert_announced_barriers(&mut self) {
        let Some(current) = self.current else {
            return;
        };
        let mut ours = false;
        let mut others = false;
        self.gate
            .for_each_new_announcement(false, &mut |_, barrier| {
                if barrier.id == current {
                    ours = true;
                } else {
                    others = true;
                }
            });
        if others {
            self.rescan_announcements = true;
        }
        if ours {
            self.convert_received_barriers(current);
        }
    }

    /// [`time_out_alignment`](Self::time_out_alignment) now, reading the clock only while an
    /// alignment runs against a timeout (the reads of every other item do not).
    fn time_out_alignment_if_due(&mut self) -> Option<BufferOrEvent> {
        self.alignment_deadline?;
        self.time_out_alignment(Instant::now())
    }

    /// Turns the alignment in progress unaligned once its deadline passed (Flink's
    /// `alignedCheckpointTimeout`): returns its barrier, as an unaligned one, for the task to
    /// trigger the checkpoint with and send on.
    fn time_out_alignment(&mut self, now: Instant) -> Option<BufferOrEvent> {
        if self
            .alignment_deadline
            .is_none_or(|deadline| now < deadline)
        {
            return None;
        }
        self.alignment_deadline = None;
        let (channel, barrier) = match self.held_barrier {
            Some(held) => held,
            None => {
                // Only announced: the checkpoint starts now, turned unaligned at once, and
                // the announced barriers go ahead of their data below.
                let announced = self.announced?;
                if self.current.is_none() {
                    self.start(announced.1.id);
                }
                announced
            }
        };
        if self.unaligned || self.current != Some(barrier.id) {
            return None;
        }
        self.turn_unaligned();
        let converted = self.convert_received_barriers(barrier.id);
        tracing::debug!(
            checkpoint = barrier.id,
            blocked = self.blocked.len(),
            converted,
            "alignment timed out; the checkpoint turns unaligned"
        );
        Some(BufferOrEvent {
            channel,
            item: GateItem::Event {
                event: Event::CheckpointBarrier(barrier.as_unaligned()),
                priority: true,
            },
            more_available: true,
            overtaken: 0,
        })
    }

    /// The running checkpoint persists in-flight data from now on: what each channel sends
    /// until its barrier. A channel whose aligned barrier came already has none; it stays
    /// blocked until the checkpoint completes, as in Flink's handler, which keeps its channel
    /// state when it turns unaligned.
    fn turn_unaligned(&mut self) {
        self.unaligned = true;
        self.held_barrier = None;
        self.alignment_deadline = None;
        for c in 0..self.persist.len() {
            self.persist[c] = if self.barrier_seen[c] || self.gate.is_channel_finished(c) {
                Persist::Done
            } else {
                Persist::UntilBarrier
            };
        }
    }

    /// The running checkpoint turned unaligned: every channel still to deliver its barrier
    /// that holds it received, behind data the task has not read, moves it ahead of that
    /// data (Flink's `convertToPriorityEvent` after `alignedCheckpointTimeout`). The data goes
    /// to the sink now rather than as the task reads it, and the channel stays blocked (its
    /// sender stopped behind the barrier) until the checkpoint completes. Returns how many
    /// channels did.
    fn convert_received_barriers(&mut self, id: u64) -> usize {
        let mut converted = 0;
        for c in 0..self.persist.len() {
            if self.persist[c] != Persist::UntilBarrier {
                continue;
            }
            if self.gate.convert_barrier_to_priority(c, id) {
                self.on_barrier_moved_ahead(c);
                converted += 1;
            }
        }
        converted
    }

    /// `channel`'s aligned barrier of the running unaligned checkpoint went ahead of the items
    /// before it (taken ahead, persisted on the next read).
    fn on_barrier_moved_ahead(&mut self, channel: usize) {
        self.barriers_received[channel] += 1;
        self.barrier_seen[channel] = true;
        if !self.blocked.contains(&channel) {
            self.blocked.push(channel);
        }
        self.persist[channel] = Persist::Done;
        // Listed with nothing ahead too: the next read then completes the checkpoint if this
        // was the last barrier it waited for (its senders, stopped behind their aligned
        // barriers, send nothing that would).
        self.list_taken_ahead(channel);
    }

    /// `channel` has data taken ahead for the running checkpoint, persisted on the next read.
    fn list_taken_ahead(&mut self, channel: usize) {
        if !self.taken_ahead.contains(&channel) {
            self.taken_ahead.push(channel);
        }
    }

    /// Hands the sink what channels took ahead of its turn for the running checkpoint, then
    /// completes the checkpoint if that was all it waited for.
    fn persist_taken_ahead(&mut self) -> Result<(), GateError> {
        if self.taken_ahead.is_empty() {
            return Ok(());
        }
        if let (Some(id), Some(sink)) = (self.current, self.sink.as_ref()) {
            for &channel in &self.taken_ahead {
                self.gate.for_each_taken_ahead(channel, &mut |buffer| {
                    sink.add_input_data(id, channel, buffer.clone())
                });
            }
        }
        self.taken_ahead.clear();
        self.check_complete().map(drop)
    }

    fn handle(&mut self, item: BufferOrEvent) -> Result<Option<BufferOrEvent>, GateError> {
        let channel = item.channel;
        if let GateItem::Event {
            priority: false, ..
        } = &item.item
        {
            // A barrier's overtaken items are everything its channel's data lane held, events
            // included; only the buffers among them are channel state.
            self.persist_if_in_flight(channel, None)?;
        }
        match &item.item {
            GateItem::Buffer(buffer) => {
                self.persist_if_in_flight(channel, Some(buffer))?;
                // A barrier that arrived after its alignment timed out goes ahead of the data
                // before it too, once the channel has it.
                if self.persist[channel] == Persist::UntilBarrier {
                    if let Some(id) = self.current {
                        if self.gate.convert_barrier_to_priority(channel, id) {
                            self.on_barrier_moved_ahead(channel);
                        }
                    }
                }
                Ok(Some(item))
            }
            GateItem::Event {
                event: Event::CheckpointBarrier(barrier),
                ..
            } => {
                self.barriers_received[channel] += 1;
                let id = barrier.id;
                let aborted = self.current.filter(|&current| id > current);
                // An aligned barrier read in order blocked its channel behind it.
                let blocks = barrier.alignment != Alignment::Unaligned;
                if !blocks && self.mode == AlignmentMode::Aligned {
                    return Err(GateError::UnalignedBarrier {
                        channel,
                        checkpoint: id,
                    });
                }
                // The unaligned path: an unaligned barrier, or an aligned one of the running
                // unaligned checkpoint. Any other aligned barrier aligns.
                let unaligned = self.mode == AlignmentMode::Unaligned
                    && (!blocks || (self.unaligned && self.current == Some(id)));
                if unaligned {
                    let surface = self.on_unaligned_barrier(id, channel, item.overtaken, blocks)?;
                    Ok(self.with_abort_notice(aborted, channel, surface.then_some(item)))
                } else {
                    let barrier = *barrier;
                    let surface = self.on_aligned_barrier(id, channel)?;
                    // Held while this checkpoint aligns, for a completion by a channel's end.
                    // Only a barrier of the aligning checkpoint sets it: a late one of an
                    // aborted checkpoint leaves it alone (a completion or an abort clears it).
                    if !surface && self.current == Some(id) {
                        self.held_barrier = Some((channel, barrier));
                        if self.mode == AlignmentMode::Unaligned
                            && self.alignment_deadline.is_none()
                        {
                            self.alignment_deadline = barrier.alignment_deadline(Instant::now());
                        }
                    }
                    Ok(self.with_abort_notice(aborted, channel, surface.then_some(item)))
                }
            }
            GateItem::Event {
                event: Event::CancelCheckpointMarker(id),
                ..
            } => {
                let id = *id;
                // As Flink: a marker for a checkpoint already done, aborted or older than the
                // one running is not news.
                if self.last_done.is_some_and(|done| id <= done)
                    || self.current.is_some_and(|current| id < current)
                {
                    return Ok(None);
                }
                if self.current.is_some() {
                    self.abort()?;
                }
                self.last_done = Some(self.last_done.map_or(id, |done| done.max(id)));
                Ok(Some(item))
            }
            GateItem::Event {
                event: Event::EndOfPartition,
                ..
            } => {
                self.persist[channel] = Persist::Done;
                // The last channel not recovered may end instead.
                if self.recovered.contains(&true) {
                    self.resume_if_all_recovered()?;
                }
                let held = self.held_barrier;
                if self.current.is_some() && self.check_complete()? {
                    // The alignment completed because this channel ended: the task must still
                    // see the checkpoint's barrier (it forwards it downstream, whose own
                    // alignment waits for it), then this end.
                    if let Some((barrier_channel, barrier)) = held {
                        self.deferred = Some(item);
                        return Ok(Some(BufferOrEvent {
                            channel: barrier_channel,
                            item: GateItem::Event {
                                event: Event::CheckpointBarrier(barrier),
                                priority: false,
                            },
                            more_available: true,
                            overtaken: 0,
                        }));
                    }
                }
                Ok(Some(item))
            }
            GateItem::Event {
                event: Event::EndOfChannelState,
                ..
            } => {
                self.on_end_of_channel_state(channel)?;
                Ok(Some(item))
            }
            GateItem::Event {
                event: Event::EndOfData(_),
                ..
            } => {
                // Read in turn, it comes after every record of its channel, which the task
                // has taken by now (it reads the gate again only once it processed its last
                // buffer's records): acknowledged at once, as Flink's checkpointed gate does.
                self.gate.acknowledge_all_records_processed(channel)?;
                Ok(Some(item))
            }
            GateItem::Event { .. } => Ok(Some(item)),
        }
    }

    /// A channel's upstream sent all its recovered channel state, and the channel blocked
    /// behind the event. Once every open channel got there, all resume, as Flink's
    /// `UpstreamRecoveryTracker` resumes them (new records may then mix with no recovered
    /// ones still to come).
    fn on_end_of_channel_state(&mut self, channel: usize) -> Result<(), GateError> {
        self.recovered[channel] = true;
        self.resume_if_all_recovered()
    }

    /// Resumes the recovered channels once every channel is recovered or ended.
    fn resume_if_all_recovered(&mut self) -> Result<(), GateError> {
        let all = (0..self.recovered.len())
            .all(|c| self.recovered[c] || self.gate.is_channel_finished(c));
        if !all {
            return Ok(());
        }
        let mut result = Ok(());
        for c in 0..self.recovered.len() {
            if std::mem::take(&mut self.recovered[c]) && !self.gate.is_channel_finished(c) {
                let resumed = self.gate.resume_consumption(c);
                if result.is_ok() {
                    result = resumed;
                }
            }
        }
        result
    }

    /// Returns whether the barrier is handed to the task.
    fn on_aligned_barrier(&mut self, id: u64, channel: usize) -> Result<bool, GateError> {
        if self.last_done.is_some_and(|done| id <= done)
            || self.current.is_some_and(|current| id < current)
        {
            // A barrier of a checkpoint already completed or aborted: let the channel go on.
            self.gate.resume_consumption(channel)?;
            return Ok(false);
        }
        if self.current.is_some_and(|current| id > current) {
            // A newer checkpoint subsumes the one being aligned.
            self.abort()?;
        }
        if self.current.is_none() {
            self.start(id);
        }
        if !self.barrier_seen[channel] {
            self.barrier_seen[channel] = true;
            self.blocked.push(channel);
        }
        self.check_complete()
    }

    /// In unaligned mode, an unaligned barrier, or (`blocks`) an aligned one of the running
    /// unaligned checkpoint, which blocked its channel. Returns whether the barrier is handed
    /// to the task: the one that triggers the checkpoint, or turns its alignment unaligned.
    fn on_unaligned_barrier(
        &mut self,
        id: u64,
        channel: usize,
        overtaken: usize,
        blocks: bool,
    ) -> Result<bool, GateError> {
        if self.last_done.is_some_and(|done| id <= done)
            || self.current.is_some_and(|current| id < current)
        {
            if blocks {
                self.gate.resume_consumption(channel)?;
            }
            return Ok(false);
        }
        if self.current.is_some_and(|current| id > current) {
            self.abort()?;
        }
        let first = !self.unaligned;
        if first {
            if self.current.is_none() {
                self.start(id);
            }
            self.turn_unaligned();
            // An alignment with a timeout turned by this barrier: the aligned barriers other
            // channels hold go ahead of their data too (Flink's `prioritizeAllAnnouncements`).
            self.convert_received_barriers(id);
        }
        // Not "barrier not seen yet": a peer that sends an aligned barrier after the channel's
        // unaligned one blocks the channel too, and it must resume with the others.
        if blocks && !self.blocked.contains(&channel) {
            self.blocked.push(channel);
        }
        if std::mem::replace(&mut self.barrier_seen[channel], true) {
            // The channel's second barrier of this checkpoint (a sender that sent both kinds,
            // or one twice): its in-flight data was counted, and listed, with the first.
            self.check_complete()?;
            return Ok(first);
        }
        // An aligned barrier came in order: what its channel sent before it was read, and
        // persisted as read. An unaligned one overtook `overtaken` items still to be read:
        // those the channel received already are taken ahead of their turn and persisted
        // now; the rest, still on their way, as they are read.
        self.persist[channel] = if overtaken > 0 && !blocks {
            let ahead = self.gate.take_unread_before_priority(channel);
            if ahead > 0 {
                self.list_taken_ahead(channel);
            }
            Persist::after(ahead, overtaken.saturating_sub(ahead))
        } else {
            Persist::Done
        };
        self.check_complete()?;
        Ok(first)
    }

    /// What the task sees when a barrier aborted checkpoint `aborted`: first a
    /// CancelCheckpointMarker for it (Flink's handler tells the task, which declines the
    /// checkpoint and sends the marker downstream), then `item`, if any, on the next read.
    fn with_abort_notice(
        &mut self,
        aborted: Option<u64>,
        channel: usize,
        item: Option<BufferOrEvent>,
    ) -> Option<BufferOrEvent> {
        let Some(aborted) = aborted else {
            return item;
        };
        debug_assert!(
            self.deferred.is_none(),
            "a barrier arrives with nothing deferred"
        );
        self.deferred = item;
        Some(BufferOrEvent {
            channel,
            item: GateItem::Event {
                event: Event::CancelCheckpointMarker(aborted),
                priority: false,
            },
            more_available: true,
            overtaken: 0,
        })
    }

    /// A data-lane item of `channel` was read: a `buffer` is persisted while the channel's
    /// in-flight data of the running checkpoint lasts; an event (`None`) only counts.
    fn persist_if_in_flight(
        &mut self,
        channel: usize,
        buffer: Option<&Buffer>,
    ) -> Result<(), GateError> {
        let Some(id) = self.current else {
            return Ok(());
        };
        match self.persist[channel] {
            Persist::Done => return Ok(()),
            Persist::Skip { skip, then } => {
                // Persisted when it was taken ahead.
                self.persist[channel] = Persist::after(skip - 1, then);
                return Ok(());
            }
            Persist::UntilBarrier => {}
            Persist::Next(n) => {
                self.persist[channel] = if n > 1 {
                    Persist::Next(n - 1)
                } else {
                    Persist::Done
                };
            }
        }
        // Counted without a sink too: the checkpoint completes once the data is read.
        if let (Some(buffer), Some(sink)) = (buffer, self.sink.as_ref()) {
            sink.add_input_data(id, channel, buffer.clone());
        }
        if self.persist[channel] == Persist::Done {
            // Completing resumes the channels aligned barriers blocked, which can fail.
            self.check_complete()?;
        }
        Ok(())
    }

    fn start(&mut self, id: u64) {
        self.current = Some(id);
        self.unaligned = false;
        self.alignment_deadline = None;
        self.barrier_seen.iter_mut().for_each(|seen| *seen = false);
    }

    /// Completes the current checkpoint when every open channel delivered its barrier (and,
    /// unaligned, its in-flight data). Returns whether it completed now.
    fn check_complete(&mut self) -> Result<bool, GateError> {
        let Some(id) = self.current else {
            return Ok(false);
        };
        let all_seen = (0..self.barrier_seen.len())
            .all(|c| self.barrier_seen[c] || self.gate.is_channel_finished(c));
        if !all_seen {
            return Ok(false);
        }
        if self.unaligned {
            if !self.taken_ahead.is_empty() || self.persist.iter().any(|p| *p != Persist::Done) {
                return Ok(false);
            }
            if let Some(sink) = &self.sink {
                sink.input_complete(id);
            }
        }
        self.finish_checkpoint(id)?;
        Ok(true)
    }

    fn abort(&mut self) -> Result<(), GateError> {
        if let Some(id) = self.current {
            if self.unaligned {
                if let Some(sink) = &self.sink {
                    sink.abort(id);
                }
            }
            self.finish_checkpoint(id)?;
        }
        Ok(())
    }

    fn finish_checkpoint(&mut self, id: u64) -> Result<(), GateError> {
        // An aborted checkpoint's data taken ahead is read as any, and persisted for none.
        self.taken_ahead.clear();
        self.current = None;
        self.unaligned = false;
        self.held_barrier = None;
        self.alignment_deadline = None;
        self.last_done = Some(self.last_done.map_or(id, |done| done.max(id)));
        self.persist.iter_mut().for_each(|p| *p = Persist::Done);
        self.resume_blocked()
    }

    /// Resumes every blocked channel, even after one fails: the first failure is the result.
    fn resume_blocked(&mut self) -> Result<(), GateError> {
        let mut result = Ok(());
        for channel in std::mem::take(&mut self.blocked) {
            if !self.gate.is_channel_finished(channel) {
                let resumed = self.gate.resume_consumption(channel);
                if result.is_ok() {
                    result = resumed;
                }
            }
        }
        result
    }
}

/// A checkpointed gate reads like any gate (so a `RecordReader` can sit on top of barrier
/// alignment): barriers come out only when the task should see them.
impl<G: InputGate> InputGate for CheckpointedInputGate<G> {
    fn poll_next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        CheckpointedInputGate::poll_next(self)
    }

    fn next_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<BufferOrEvent>, GateError> {
        CheckpointedInputGate::next_until(self, deadline)
    }

    fn resume_consumption(&mut self, channel: usize) -> Result<(), GateError> {
        self.gate.resume_consumption(channel)
    }

    fn channel_count(&self) -> usize {
        self.gate.channel_count()
    }

    fn is_finished(&self) -> bool {
        self.gate.is_finished()
    }

    fn is_channel_finished(&self, channel: usize) -> bool {
        self.gate.is_channel_finished(channel)
    }

    fn handle_timeout(&mut self, now: Instant) -> Result<(), GateError> {
        CheckpointedInputGate::handle_timeout(self, now)
    }

    fn poll_timeout(&self) -> Option<Instant> {
        [self.gate.poll_timeout(), self.alignment_deadline]
            .into_iter()
            .flatten()
            .min()
    }

    fn register_waker(&self, waker: &std::task::Waker) -> bool {
        self.deferred.is_some() || self.gate.register_waker(waker)
    }

    fn poll_priority_event(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        self.poll_priority()
    }

    fn end_of_data_status(&self) -> super::EndOfDataStatus {
        self.gate.end_of_data_status()
    }

    fn acknowledge_all_records_processed(&mut self, channel: usize) -> Result<(), GateError> {
        self.gate.acknowledge_all_records_processed(channel)
    }

    fn has_priority_event(&self) -> bool {
        self.deferred
            .as_ref()
            .is_some_and(|item| matches!(item.item, GateItem::Event { .. }))
            || self.gate.has_priority_event()
    }

    fn idle_time(&self) -> &crate::metrics::WaitTime {
        self.gate.idle_time()
    }

    fn channel_state_sink(&self) -> Option<&Arc<dyn ChannelStateSink>> {
        if self.mode == AlignmentMode::Unaligned {
            self.sink.as_ref()
        } else {
            None
        }
    }
}
