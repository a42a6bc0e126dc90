//! The producer's side of a partition: builders per subpartition, events, flush, finish.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use super::subpartition::{
    AllDataProcessed, Conversion, PipelinedSubpartition, Queued, SubpartitionView, EVENT_RESERVE,
};
use super::{AvailabilityListener, PartitionError, PartitionType, ResultPartitionId};
use crate::buffer::{
    BufferBuilder, DataType, FramedRun, LocalBufferPool, LocalPoolSpec, NetworkBufferPool,
    PoolError, PoolWaiters,
};
use crate::config::NetworkConfig;
use crate::event::{CheckpointBarrier, Event, StopMode};
use crate::metrics::{Counter, OutputMetrics, OutputMetricsSnapshot};
use crate::record::{self, Record, RecordError, SegmentSink};
use crate::wake_timer::WakeTimer;

/// Builder requests for segments not counted against one subpartition (events, broadcast).
const UNACCOUNTED: usize = usize::MAX;

/// The part of a partition both sides reach: its subpartitions and metrics. Cheap to clone;
/// the partition manager, the output flusher and readers hold it.
#[derive(Clone)]
pub struct PartitionHandle {
    shared: Arc<PartitionShared>,
}

struct PartitionShared {
    id: ResultPartitionId,
    kind: PartitionType,
    subpartitions: Box<[Arc<PipelinedSubpartition>]>,
    metrics: OutputMetrics,
    /// The waiters of the partition's pool: its writer, when it waits.
    writer_waits: PoolWaiters,
    /// Why the producer failed, if it said (the first cause given).
    failure: Arc<OnceLock<String>>,
    /// The consumers that processed every record (FLIP-147).
    all_data_processed: Arc<AllDataProcessed>,
}

impl fmt::Debug for PartitionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionHandle")
            .field("id", &self.shared.id)
            .field("subpartitions", &self.shared.subpartitions.len())
            .finish()
    }
}

impl PartitionHandle {
    /// The partition's id.
    pub fn id(&self) -> ResultPartitionId {
        self.shared.id
    }

    /// The partition's type.
    pub fn partition_type(&self) -> PartitionType {
        self.shared.kind
    }

    /// Number of subpartitions.
    pub fn subpartition_count(&self) -> usize {
        self.shared.subpartitions.len()
    }

    /// Creates the one reader of a subpartition.
    pub fn create_view(
        &self,
        subpartition: usize,
        listener: Arc<dyn AvailabilityListener>,
    ) -> Result<SubpartitionView, PartitionError> {
        let count = self.shared.subpartitions.len();
        self.shared
            .subpartitions
            .get(subpartition)
            .ok_or(PartitionError::NoSuchSubpartition {
                index: subpartition,
                count,
            })?
            .create_view(listener)
    }

    /// Makes the committed bytes of every subpartition readable (the output flusher's call).
    pub fn flush_all(&self) {
        for subpartition in self.shared.subpartitions.iter() {
            subpartition.flush();
        }
    }

    /// Releases every subpartition and what is queued in it.
    pub fn release(&self) {
        for subpartition in self.shared.subpartitions.iter() {
            subpartition.release();
        }
    }

    /// The producer failed: releases the partition, and its readers are told `cause` (Flink's
    /// `release(Throwable)`, whose consumers get a `ProducerFailedException` carrying it):
    /// [`GateError::ProducerFailed`](crate::gate::GateError::ProducerFailed), locally and
    /// across the wire (there cut to 512 bytes). The first cause given stays.
    pub fn fail(&self, cause: impl Into<String>) {
        self.note_failure(cause.into());
        self.release();
    }

    /// Keeps the first cause given. Before the release: a reader that sees the release finds
    /// the cause.
    fn note_failure(&self, cause: String) {
        let _ = self.shared.failure.set(cause);
    }

    /// Why the producer failed, if it said ([`fail`](Self::fail)).
    pub fn failure_cause(&self) -> Option<&str> {
        self.shared.failure.get().map(String::as_str)
    }

    /// True once every subpartition was released.
    pub fn is_released(&self) -> bool {
        self.shared.subpartitions.iter().all(|s| s.is_released())
    }

    /// True once the producer finished (EndOfPartition queued everywhere).
    pub fn is_finished(&self) -> bool {
        self.shared.subpartitions.iter().all(|s| s.is_finished())
    }

    /// `numRecordsOut`, `numBytesOut`, `numBuffersOut`.
    pub fn metrics(&self) -> &OutputMetrics {
        &self.shared.metrics
    }

    /// True while the partition's writer waits for a segment or for room in a subpartition's
    /// queue (Flink's `isBackPressured` gauge): a sample of back pressure now, where
    /// [`back_pressured_time`](Self::back_pressured_time) sums it.
    pub fn is_back_pressured(&self) -> bool {
        self.shared.writer_waits.any_waiting()
    }

    /// Flink's `accumulatedBackPressuredTimeMs` as a duration: the time the writer waited, the
    /// wait under way included, so another thread (a metrics reporter) sees a writer stuck
    /// behind a stalled consumer while it is stuck.
    pub fn back_pressured_time(&self) -> Duration {
        self.shared.writer_waits.blocked_time()
    }

    /// True once the consumer of every subpartition said it processed every record (after
    /// the EndOfData of [`ResultPartition::notify_end_of_data`]; Flink's
    /// `getAllDataProcessedFuture` done).
    pub fn is_all_data_processed(&self) -> bool {
        self.shared.all_data_processed.is_done()
    }
}

/// A result partition as its producer holds it (Flink's `BufferWritingResultPartition` with
/// pipelined subpartitions). Single-threaded: the task that writes owns it. Readers reach the
/// data through [`PartitionHandle::create_view`].
pub struct ResultPartition {
    handle: PartitionHandle,
    pool: LocalBufferPool,
    /// The builder each subpartition is filling (unicast records).
    unicast: Box<[Option<BufferBuilder>]>,
    /// The builder shared by all subpartitions (broadcast records).
    broadcast: Option<BufferBuilder>,
    max_record_bytes: usize,
    /// Bytes of a segment: how many buffers a record runs into.
    segment_size: usize,
    request_timeout: Duration,
    /// `max-overdraft-buffers-per-gate`: segments beyond the pool that finish a started record.
    max_overdraft_for_records: usize,
    finished: bool,
    /// EndOfData went out (FLIP-147's `notifyEndOfData`, once).
    end_of_data_sent: bool,
    /// The newest aligned barrier with a timeout, until it was turned unaligned.
    barrier_timer: Option<BarrierTimer>,
    /// Wakes an async emit waiting under back pressure when `barrier_timer` comes due.
    barrier_wake: WakeTimer,
}

/// Records appended to one subpartition's open buffer in a loop
/// ([`ResultPartition::unicast_run`]): what [`ResultPartition::emit_record`]'s common case
/// does per record, with the buffer's position and the records-out count kept here until the
/// run is dropped (then the records are published and counted).
pub(crate) struct UnicastRun<'a> {
    run: FramedRun<'a>,
    records: u64,
    max_record_bytes: usize,
    num_records_out: &'a Counter,
}

impl UnicastRun<'_> {
    /// Appends `record` if it is contiguous, within the size limit and fits before the
    /// buffer's end; false, writing nothing, for anything `emit_record`'s general path must
    /// handle.
    #[inline(always)]
    pub(crate) fn try_emit<R: Record + ?Sized>(&mut self, record: &R) -> bool {
        let Some(bytes) = fast_path_bytes(record, self.max_record_bytes) else {
            return false;
        };
        if !self.run.try_append(bytes) {
            return false;
        }
        self.records += 1;
        true
    }
}

impl Drop for UnicastRun<'_> {
    fn drop(&mut self) {
        // Published before counted, as `emit_record` does: a metrics reader never counts
        // records a consumer cannot read yet.
        self.run.publish();
        if self.records > 0 {
            self.num_records_out.add(self.records);
        }
    }
}

/// A record's bytes if the fast paths (`emit_record`'s common case, the runs of
/// [`UnicastRun`] and [`UnicastRuns`]) may append them as they are: contiguous, of the length
/// the record declares (other bytes go to the general path, to be refused), and within
/// `max_record_bytes`.
#[inline(always)]
fn fast_path_bytes<R: Record + ?Sized>(record: &R, max_record_bytes: usize) -> Option<&[u8]> {
    record
        .as_contiguous()
        .filter(|bytes| bytes.len() == record.encoded_len() && bytes.len() <= max_record_bytes)
}

/// Most subpartitions whose open buffers [`UnicastRuns`] keeps runs in at once: a task's
/// output to more consumers than this batches only records that follow one another to the
/// same one ([`UnicastRun`]). 16 runs are a few hundred bytes on the stack.
pub(crate) const RUN_SUBPARTITIONS: usize = 16;

/// A run in every subpartition's open buffer at once ([`ResultPartition::unicast_runs`]):
/// records going round robin or by key over a few subpartitions are appended to their
/// targets' buffers as [`UnicastRun`] appends one target's, each run's position kept out of
/// its builder until the runs are dropped (then every run is published, and the records
/// counted). A run also opens in builders no record of the batch reaches: publishing it
/// publishes nothing, because between records every open builder has committed all it
/// holds (a record's bytes are committed or discarded before its emit returns;
/// `BufferBuilder::framed_run` asserts it in debug builds).
pub(crate) struct UnicastRuns<'a> {
    runs: [Option<FramedRun<'a>>; RUN_SUBPARTITIONS],
    records: u64,
    max_record_bytes: usize,
    num_records_out: &'a Counter,
}

impl UnicastRuns<'_> {
    /// Appends `record` to `target`'s run if that subpartition has an open buffer and the
    /// record is contiguous, within the size limit and fits before the buffer's end; false,
    /// writing nothing, for anything `emit_record`'s general path must handle.
    #[inline(always)]
    pub(crate) fn try_emit<R: Record + ?Sized>(&mut self, target: usize, record: &R) -> bool {
        let Some(Some(run)) = self.runs.get_mut(target) else {
            return false;
        };
        let Some(bytes) = fast_path_bytes(record, self.max_record_bytes) else {
            return false;
        };
        if !run.try_append(bytes) {
            return false;
        }
        self.records += 1;
        true
    }
}

impl Drop for UnicastRuns<'_> {
    fn drop(&mut self) {
        // Published before counted, as `emit_record` does.
        for run in self.runs.iter_mut().flatten() {
            run.publish();
        }
        if self.records > 0 {
            self.num_records_out.add(self.records);
        }
    }
}

/// An aligned barrier with a timeout this partition queued, and when it turns unaligned in
/// the subpartitions whose readers have not taken it by then (Flink's producer-side
/// `alignedBarrierTimeout`).
#[derive(Clone, Copy, Debug)]
struct BarrierTimer {
    barrier: CheckpointBarrier,
    deadline: Instant,
}

/// An async emit's wait under back pressure, during which the partition's aligned barrier
/// may come due: the sync emit's wait fires it at its deadline (`until_available_timed`),
/// and a future, which has no clock, is woken for it, so a writer held up by a slow consumer
/// still lets its barrier overtake the queued data in time (Flink's timer runs on the task's
/// mailbox while the writer waits for availability).
struct BarrierTimed<'a> {
    timer: &'a mut Option<BarrierTimer>,
    wake: &'a WakeTimer,
    pool: &'a LocalBufferPool,
    subpartitions: &'a [Arc<PipelinedSubpartition>],
}

impl BarrierTimed<'_> {
    /// `wait`'s output, firing the barrier timer each time it comes due meanwhile.
    async fn wait<F: Future>(&mut self, wait: F) -> F::Output {
        let mut wait = std::pin::pin!(wait);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = wait.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            if self.timer.is_some() {
                // Fired after the wait registered, so whatever the copy takes or frees is
                // seen by the wait's next look.
                fire_barrier_timer(self.timer, self.pool, self.subpartitions, Instant::now());
                if let Some(pending) = self.timer {
                    self.wake.wake_at(pending.deadline, cx.waker());
                }
            }
            Poll::Pending
        })
        .await
    }
}

/// How soon a barrier timer that could not finish (no memory for the unaligned copy, a full
/// priority lane) tries again.
const BARRIER_TIMER_RETRY: Duration = Duration::from_millis(10);

impl fmt::Debug for ResultPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResultPartition")
            .field("id", &self.handle.id())
            .field("pool", &self.pool)
            .field("finished", &self.finished)
            .finish()
    }
}

impl ResultPartition {
    /// A pipelined partition with `subpartitions` subpartitions and its own buffer pool sized
    /// as Flink sizes it (see [`LocalPoolSpec::for_partition`]).
    pub fn new(
        id: ResultPartitionId,
        subpartitions: usize,
        network: &NetworkBufferPool,
        config: &NetworkConfig,
    ) -> Result<Self, PartitionError> {
        if subpartitions == 0 {
            return Err(PartitionError::NoSubpartitions);
        }
        // The fields are public, and only the network pool's constructor checked them: a
        // `max-buffers-per-channel` of 0 made the first emit wait for good, a zero request
        // timeout every wait a busy loop.
        config
            .validate()
            .map_err(|error| PoolError::Config(error.to_string()))?;
        let pool =
            network.create_local_pool(LocalPoolSpec::for_partition(subpartitions, config))?;
        // As created: bounded by the network memory.
        let spec = pool.spec();
        // Room for the subpartition's own buffers (the pool holds them to
        // `max-buffers-per-channel`), as many broadcast buffers besides, the overdraft a
        // started record may take, and a reserve for events; a writer that finds no room
        // waits for the reader. Never more than the items there can be: each holds a distinct
        // segment, of the pool or of the overdraft.
        let buffer_room = config
            .max_buffers_per_channel
            .saturating_mul(2)
            .saturating_add(config.max_overdraft_buffers_per_gate);
        let lane = buffer_room
            .saturating_add(EVENT_RESERVE)
            .min(spec.max_segments + spec.max_overdraft_segments);
        let room_waiters = pool.waiters();
        let failure = Arc::new(OnceLock::new());
        let all_data_processed = Arc::new(AllDataProcessed::new(subpartitions));
        let shared = Arc::new(PartitionShared {
            id,
            kind: PartitionType::Pipelined,
            subpartitions: (0..subpartitions)
                .map(|i| {
                    Arc::new(PipelinedSubpartition::new(
                        i,
                        buffer_room,
                        lane,
                        room_waiters.clone(),
                        network.clone(),
                        failure.clone(),
                        all_data_processed.clone(),
                    ))
                })
                .collect(),
            metrics: OutputMetrics::default(),
            writer_waits: room_waiters,
            failure,
            all_data_processed,
        });
        Ok(Self {
            handle: PartitionHandle { shared },
            pool,
            unicast: (0..subpartitions).map(|_| None).collect(),
            broadcast: None,
            max_record_bytes: config.max_record_bytes,
            segment_size: network.segment_size(),
            request_timeout: config.buffer_request_timeout,
            max_overdraft_for_records: config.max_overdraft_buffers_per_gate,
            finished: false,
            end_of_data_sent: false,
            barrier_timer: None,
            barrier_wake: WakeTimer::default(),
        })
    }

    /// The shared handle (for the partition manager, flusher and readers).
    pub fn handle(&self) -> PartitionHandle {
        self.handle.clone()
    }

    /// Number of subpartitions.
    pub fn subpartition_count(&self) -> usize {
        self.unicast.len()
    }

    /// The partition's buffer pool (`outPoolUsage` is its usage).
    pub fn pool(&self) -> &LocalBufferPool {
        &self.pool
    }

    /// Flink's `RecordWriter.isAvailable`: the task's next record starts without waiting for
    /// memory, whichever subpartition it goes to (a segment is at hand and no subpartition
    /// holds `max-buffers-per-channel` segments). A task looks before it reads input to
    /// process; while this is false it reads priority events only
    /// ([`CheckpointedInputGate::wait_for_output`](crate::gate::CheckpointedInputGate::wait_for_output)),
    /// so an unaligned barrier is taken at once under back pressure, not once a consumer
    /// downstream freed a buffer. A record spanning buffers may still wait for the ones after
    /// its first. True for a finished or released partition (the write then fails at once).
    pub fn is_available(&self) -> bool {
        self.finished || self.pool.is_available_to_any()
    }

    /// Resolves once [`is_available`](Self::is_available) holds, without blocking the thread
    /// (any executor). Meanwhile it turns a pending aligned barrier unaligned at its timeout,
    /// as the writer's own waits do. The wait counts as back-pressured time.
    pub async fn until_available(&mut self) {
        if self.is_available() {
            return;
        }
        let mut timed = self.barrier_timed();
        let available = timed.pool.until_available_to_any();
        // A destroyed pool: the write reports the release.
        let _ = timed.wait(available).await;
    }

    /// The partition's metrics now, with Flink's names: the counters of the shared
    /// [`PartitionHandle::metrics`] plus `outPoolUsage` and the back-pressured time, which come
    /// from the pool this partition owns (so the snapshot is taken here, not on the handle).
    pub fn metrics_snapshot(&self) -> OutputMetricsSnapshot {
        let metrics = self.handle.metrics();
        OutputMetricsSnapshot {
            num_records_out: metrics.num_records_out.get(),
            num_bytes_out: metrics.num_bytes_out.get(),
            num_buffers_out: metrics.num_buffers_out.get(),
            out_pool_usage: self.pool.usage(),
            back_pressured_time_ms: self.pool.blocked_nanos() / 1_000_000,
            output_queue_length: self
                .handle
                .shared
                .subpartitions
                .iter()
                .map(|s| s.queued_items() as u64)
                .sum(),
        }
    }

    /// Serializes `record` into subpartition `target`. Blocks while no buffer is free (the
    /// back pressure) before the record starts; a record already started goes on in
    /// overdraft segments (`max-overdraft-buffers-per-gate`) and blocks only once they are
    /// used up. Fails when the partition was released.
    // Always inlined: the common case below is a handful of instructions, and left to the
    // inliner a caller with several writer types (several monomorphic emit loops) got a call
    // per record instead, measured 15 % more CPU per 8-byte record.
    #[inline(always)]
    pub fn emit_record<R: Record + ?Sized>(
        &mut self,
        record: &R,
        target: usize,
    ) -> Result<(), PartitionError> {
        // The common case, kept small enough to inline into the caller's loop: a contiguous
        // record that fits the target's open builder is one framed copy and a publish. Every
        // other case (no builder, a full one, a spanning record, broadcast, errors) takes the
        // general path, which checks the same conditions again. Bytes of another length than
        // declared go there too, to be refused (for `[u8]` the two lengths are one value, and
        // the comparison folds away).
        if let Some(bytes) = fast_path_bytes(record, self.max_record_bytes) {
            if let Some(Some(builder)) = self.unicast.get_mut(target) {
                // A unicast builder exists only while the partition is unfinished and not
                // broadcasting (finish and broadcast close them all), so neither is looked at.
                debug_assert!(!self.finished && self.broadcast.is_none());
                // Strictly less: a record that fills the buffer to its end takes the general
                // path, which finishes the full buffer at once (as Flink does), so this path
                // needs no check after the append.
                if record::framed_len(bytes.len()) < builder.remaining()
                    && !self.pool.is_destroyed()
                {
                    builder.append_framed(bytes);
                    self.handle.shared.metrics.num_records_out.add(1);
                    return Ok(());
                }
            }
        }
        self.emit_record_general(record, target, true)
    }

    /// A run of records appended to `target`'s open buffer one after another without a call
    /// of [`emit_record`](Self::emit_record) each ([`RecordWriter::emit_all`]); `None` when
    /// `target` has no open buffer or the pool is gone, which `emit_record` then reports.
    /// The destroyed pool is looked at when the run begins, not per record: only this
    /// partition's own `&mut` paths destroy it, none of which a run can overlap.
    ///
    /// [`RecordWriter::emit_all`]: super::RecordWriter::emit_all
    #[inline]
    pub(crate) fn unicast_run(&mut self, target: usize) -> Option<UnicastRun<'_>> {
        if self.pool.is_destroyed() {
            return None;
        }
        let run = self.unicast.get_mut(target)?.as_mut()?.framed_run()?;
        Some(UnicastRun {
            run,
            records: 0,
            max_record_bytes: self.max_record_bytes,
            num_records_out: &self.handle.shared.metrics.num_records_out,
        })
    }

    /// Whether `target` has an open buffer its next record could be appended to.
    #[inline]
    pub(crate) fn has_open_buffer(&self, target: usize) -> bool {
        self.unicast.get(target).is_some_and(Option::is_some)
    }

    /// A run in each subpartition's open buffer at once ([`UnicastRuns`]); `None` with more
    /// than [`RUN_SUBPARTITIONS`] subpartitions or once the pool is gone (as
    /// [`unicast_run`](Self::unicast_run)). A subpartition without an open buffer has no run:
    /// its next record takes the general path, which opens one.
    #[inline]
    pub(crate) fn unicast_runs(&mut self) -> Option<UnicastRuns<'_>> {
        if self.pool.is_destroyed() || self.unicast.len() > RUN_SUBPARTITIONS {
            return None;
        }
        let mut runs = [const { None }; RUN_SUBPARTITIONS];
        for (run, builder) in runs.iter_mut().zip(self.unicast.iter_mut()) {
            *run = builder.as_mut().and_then(BufferBuilder::framed_run);
        }
        Some(UnicastRuns {
            runs,
            records: 0,
            max_record_bytes: self.max_record_bytes,
            num_records_out: &self.handle.shared.metrics.num_records_out,
        })
    }

    /// [`emit_record`](Self::emit_record) for every case: requests builders, spans segments,
    /// reports errors. `fire_timer`: fire a due barrier timer first (the async emit fired it
    /// already, before its wait).
    #[inline(never)]
    fn emit_record_general<R: Record + ?Sized>(
        &mut self,
        record: &R,
        target: usize,
        fire_timer: bool,
    ) -> Result<(), PartitionError> {
        self.check_writable()?;
        // Before anything changes, as the async emit checks it: a record for no subpartition
        // finishes no open broadcast buffer and fires no timer.
        if target >= self.unicast.len() {
            return Err(PartitionError::NoSuchSubpartition {
                index: target,
                count: self.unicast.len(),
            });
        }
        // Before any wait, too: refused whatever the back pressure.
        self.check_record_size(record)?;
        if self.broadcast.is_some() {
            self.finish_broadcast_builder(Sent::Yes);
        }
        if fire_timer && self.barrier_timer.is_some() {
            self.fire_barrier_timer();
        }
        let open = self.unicast.get(target).and_then(Option::as_ref);
        if self.crosses(record, open) && self.pool.spec().max_segments_per_channel <= 1 {
            // The open buffer is all the subpartition may hold, and its reader cannot give it
            // back before it is finished: finish it now, and the record starts in a fresh
            // buffer, for which it waits as any request does.
            self.finish_unicast_builder(target, Sent::Yes);
        }
        self.wait_before_record(record, Target::Unicast(target))?;
        let max_record_bytes = self.max_record_bytes;
        let written = record::serialize(
            record,
            &mut self.sink(Target::Unicast(target))?,
            max_record_bytes,
        );
        self.release_after_abandoned(&written);
        if self.unicast[target].as_ref().is_some_and(|b| b.is_full()) {
            self.finish_unicast_builder(target, Sent::Yes);
        }
        written.map_err(released_or)?;
        self.handle.shared.metrics.num_records_out.add(1);
        Ok(())
    }

    /// Like [`emit_record`](Self::emit_record), but waits for the first buffer, or for the
    /// segment a record running past the open buffer needs, without blocking the thread. (A
    /// record spanning more segments than are free takes overdraft segments, and past
    /// `max-overdraft-buffers-per-gate` of them waits in the middle, blocking.)
    pub async fn emit_record_async<R: Record + ?Sized>(
        &mut self,
        record: &R,
        target: usize,
    ) -> Result<(), PartitionError> {
        self.check_writable()?;
        let open = self
            .unicast
            .get(target)
            .ok_or(PartitionError::NoSuchSubpartition {
                index: target,
                count: self.unicast.len(),
            })?
            .as_ref();
        self.check_record_size(record)?;
        if self.crosses(record, open) && self.pool.spec().max_segments_per_channel <= 1 {
            // As `emit_record` does: the open buffer is all the subpartition may hold, so the
            // record starts in a fresh one, waited for below.
            self.finish_unicast_builder(target, Sent::Yes);
        }
        let needs_builder = self.unicast[target].as_ref().is_none_or(|b| b.is_full());
        if needs_builder {
            self.finish_unicast_builder(target, Sent::Yes);
            let mut timed = self.barrier_timed();
            let subpartition = &timed.subpartitions[target];
            if !subpartition.has_room(Queued::Buffer) {
                let room = timed
                    .pool
                    .until_ready(|| subpartition.has_room_or_listen(Queued::Buffer));
                timed.wait(room).await.map_err(released_if_destroyed)?;
            }
            // Ends at the subpartition's release too, as the blocking request does.
            let builder = timed
                .pool
                .request_builder_unless(target, || subpartition.is_released());
            let builder = timed.wait(builder).await.map_err(released_if_destroyed)?;
            self.install_unicast(target, builder)?;
        }
        self.until_segment_for_crossing(record, Target::Unicast(target))
            .await?;
        self.emit_record_general(record, target, false)
    }

    /// Writes `record` once into a segment shared by every subpartition.
    pub fn broadcast_record<R: Record + ?Sized>(
        &mut self,
        record: &R,
    ) -> Result<(), PartitionError> {
        self.check_writable()?;
        self.check_record_size(record)?;
        self.finish_unicast_builders(Sent::Yes);
        self.wait_before_record(record, Target::Broadcast)?;
        self.broadcast_record_general(record)
    }

    /// Like [`broadcast_record`](Self::broadcast_record), but waits for room in every
    /// subpartition's queue, for the buffer and for the segment a record running past the
    /// open buffer needs without blocking the thread, as
    /// [`emit_record_async`](Self::emit_record_async) does.
    pub async fn broadcast_record_async<R: Record + ?Sized>(
        &mut self,
        record: &R,
    ) -> Result<(), PartitionError> {
        self.check_writable()?;
        self.check_record_size(record)?;
        self.finish_unicast_builders(Sent::Yes);
        if self.broadcast.as_ref().is_none_or(|b| b.is_full()) {
            self.finish_broadcast_builder(Sent::Yes);
            let mut timed = self.barrier_timed();
            let subpartitions = timed.subpartitions;
            if !subpartitions.iter().all(|s| s.has_room(Queued::Buffer)) {
                let room = timed.pool.until_ready(|| {
                    subpartitions
                        .iter()
                        .all(|s| s.has_room_or_listen(Queued::Buffer))
                });
                timed.wait(room).await.map_err(released_if_destroyed)?;
            }
            // Ends once every subpartition was released, as the blocking request does.
            let builder = timed.pool.request_builder_unless(UNACCOUNTED, || {
                subpartitions.iter().all(|s| s.is_released())
            });
            let builder = timed.wait(builder).await.map_err(released_if_destroyed)?;
            let consumer = builder.create_consumer_from_beginning();
            queue_in_open_subpartitions(&self.handle.shared, |subpartition| {
                subpartition.add_data(consumer.copy())
            })?;
            self.broadcast = Some(builder);
        }
        self.until_segment_for_crossing(record, Target::Broadcast)
            .await?;
        self.broadcast_record_general(record)
    }

    /// Refuses a record longer than `fluxgate.record.max-size` before an emit waits for
    /// anything (the write would refuse it after the wait: under back pressure, an emit
    /// waiting for as long as the consumer stalls, for a record that never goes out).
    fn check_record_size<R: Record + ?Sized>(&self, record: &R) -> Result<(), PartitionError> {
        let len = record.encoded_len();
        if len > self.max_record_bytes || len > u32::MAX as usize {
            return Err(RecordError::TooLarge {
                len,
                max: self.max_record_bytes,
            }
            .into());
        }
        Ok(())
    }

    /// The async emits' wait that the sync ones block in before a record's first byte: for
    /// room in `target`'s queues and the segment a record running past its open buffer needs
    /// (a write that found either missing would block the thread). A barrier timer due
    /// before or during the wait fires here (it may take the segment waited for: then this
    /// waits again), and the write after it fires none, so it finds the segment still at
    /// hand. Bounded by the back pressure, as the wait is.
    async fn until_segment_for_crossing<R: Record + ?Sized>(
        &mut self,
        record: &R,
        target: Target,
    ) -> Result<(), PartitionError> {
        let channel = target.channel();
        loop {
            // As the sync path: no clock read per record without a timer.
            if self.barrier_timer.is_some() {
                self.fire_barrier_timer();
            }
            let Some((room, crosses)) = self.needs_before_record(record, target) else {
                return Ok(());
            };
            let mut timed = self.barrier_timed();
            let readers = target.readers(timed.subpartitions);
            // Room in the queues first: the write would block the thread for it.
            if !readers.iter().all(|s| s.has_room(room)) {
                let room = timed
                    .pool
                    .until_ready(|| readers.iter().all(|s| s.has_room_or_listen(room)));
                timed.wait(room).await.map_err(released_if_destroyed)?;
                continue;
            }
            if !crosses || timed.pool.segment_at_hand(channel) {
                return Ok(());
            }
            // Ends at a release too, as the blocking wait does; the write would then fail as
            // Released, so it is not tried (nor the wait looked at again, which a release
            // leaves ready for good).
            let pool = timed.pool;
            let released = || readers.iter().all(|s| s.is_released());
            let at_hand = pool.until_ready(|| released() || pool.segment_at_hand(channel));
            timed.wait(at_hand).await.map_err(released_if_destroyed)?;
            if released() {
                return Err(PartitionError::Released);
            }
        }
    }

    /// What an async emit's waits need to fire the barrier timer while they wait.
    fn barrier_timed(&mut self) -> BarrierTimed<'_> {
        BarrierTimed {
            timer: &mut self.barrier_timer,
            wake: &self.barrier_wake,
            pool: &self.pool,
            subpartitions: &self.handle.shared.subpartitions,
        }
    }

    /// The write of [`broadcast_record`](Self::broadcast_record) once its waits are over.
    fn broadcast_record_general<R: Record + ?Sized>(
        &mut self,
        record: &R,
    ) -> Result<(), PartitionError> {
        let max_record_bytes = self.max_record_bytes;
        let written =
            record::serialize(record, &mut self.sink(Target::Broadcast)?, max_record_bytes);
        self.release_after_abandoned(&written);
        if self.broadcast.as_ref().is_some_and(|b| b.is_full()) {
            self.finish_broadcast_builder(Sent::Yes);
        }
        written.map_err(released_or)?;
        self.handle.shared.metrics.num_records_out.add(1);
        Ok(())
    }

    /// True when `record` starts in the open builder `open` and runs past its end. (A record
    /// without an open builder waits for its first segment like any request; one whose open
    /// builder is empty has its first segment at hand already.)
    fn crosses<R: Record + ?Sized>(&self, record: &R, open: Option<&BufferBuilder>) -> bool {
        open.is_some_and(|builder| {
            let len = record.encoded_len();
            !builder.is_full()
                && builder.written() > 0
                && len <= self.max_record_bytes
                && record::framed_len(len) > builder.remaining()
        })
    }

    /// The builder a record for `target` starts in, if one is open.
    fn open_builder(&self, target: Target) -> Option<&BufferBuilder> {
        match target {
            Target::Unicast(index) => self.unicast[index].as_ref(),
            Target::Broadcast => self.broadcast.as_ref(),
        }
    }

    /// How many buffers `record` adds to its target's queues beyond the open builder `open`:
    /// at most one more than the overdraft a record may take (past that, it waits for
    /// segments inside itself anyway).
    fn buffers_for<R: Record + ?Sized>(&self, record: &R, open: Option<&BufferBuilder>) -> usize {
        let framed = record::framed_len(record.encoded_len().min(self.max_record_bytes));
        let in_open = open
            .filter(|builder| !builder.is_full())
            .map_or(0, BufferBuilder::remaining);
        framed
            .saturating_sub(in_open)
            .div_ceil(self.segment_size)
            .min(self.max_overdraft_for_records.saturating_add(1))
    }

    /// What `record` needs at hand before its first byte, written for `target`: room for its
    /// buffers in the target's queues, and whether it runs past the started open buffer (a
    /// segment then); `None` when it fits the open buffer.
    fn needs_before_record<R: Record + ?Sized>(
        &self,
        record: &R,
        target: Target,
    ) -> Option<(Queued, bool)> {
        let open = self.open_builder(target);
        let buffers = self.buffers_for(record, open);
        (buffers > 0).then(|| (Queued::Buffers(buffers), self.crosses(record, open)))
    }

    /// Before a record's first byte: waits until the buffers it runs into can be had without
    /// a wait inside it (as far as the queue's size allows: see `Queued::Buffers`), room for
    /// them in the target's queues (every queue, for a broadcast; a queue fills before the
    /// pool when broadcast buffers pile up behind a stalled reader) and, for a record running
    /// past the open buffer, a segment at hand, as a Flink task waits for its output to be
    /// available before it processes a record. So the record stops before its first byte
    /// under back pressure, not inside itself, and needs overdraft only for segments beyond
    /// that one. (Room stays: only this writer queues buffers.)
    fn wait_before_record<R: Record + ?Sized>(
        &mut self,
        record: &R,
        target: Target,
    ) -> Result<(), PartitionError> {
        let Some((room, crosses)) = self.needs_before_record(record, target) else {
            return Ok(());
        };
        let (pool, subpartitions) = (&self.pool, &self.handle.shared.subpartitions[..]);
        let readers = target.readers(subpartitions);
        if !readers.iter().all(|s| s.has_room(room)) {
            until_available_timed(
                &mut self.barrier_timer,
                pool,
                subpartitions,
                self.request_timeout,
                |wait| pool.wait_until(wait, || readers.iter().all(|s| s.has_room_or_listen(room))),
            )?;
        }
        if !crosses {
            return Ok(());
        }
        // Released meanwhile: the wait ends at the release's wake-up and the write then fails
        // as Released, whether or not a consumer gives the segments back.
        let channel = target.channel();
        until_available_timed(
            &mut self.barrier_timer,
            pool,
            subpartitions,
            self.request_timeout,
            |wait| {
                pool.wait_until(wait, || {
                    readers.iter().all(|s| s.is_released()) || pool.segment_at_hand(channel)
                })
            },
        )
    }

    /// Queues `event` in every subpartition after what was written so far; a priority event
    /// overtakes queued data instead.
    pub fn broadcast_event(&mut self, event: &Event, priority: bool) -> Result<(), PartitionError> {
        self.check_writable()?;
        if let Event::CheckpointBarrier(barrier) = event {
            barrier.validate()?;
        }
        if priority && !event.may_overtake_data() {
            return Err(match event {
                Event::CheckpointBarrier(_) => PartitionError::PriorityAlignedBarrier,
                other => PartitionError::PriorityEndEvent(other.clone()),
            });
        }
        // An aligned barrier that may time out: the subpartitions track it, and a timer turns
        // it unaligned where it is still queued by then.
        let timer = match (priority, event) {
            (false, Event::CheckpointBarrier(barrier)) => barrier
                .alignment_deadline(Instant::now())
                .map(|deadline| BarrierTimer {
                    barrier: *barrier,
                    deadline,
                }),
            _ => None,
        };
        let timeoutable = timer.map(|timer| timer.barrier.id);
        // A newer checkpoint subsumes the one the pending timer is for (its consumers abort
        // it), and the older barrier turned unaligned later would come after this newer one;
        // a cancelled one is not turned either (its consumers drop it, and a priority cancel
        // marker counted the barrier among the data it overtook).
        let ends_timer = |pending: u64| match event {
            Event::CheckpointBarrier(barrier) => pending < barrier.id,
            Event::CancelCheckpointMarker(cancelled) => pending <= *cancelled,
            _ => false,
        };
        if self
            .barrier_timer
            .is_some_and(|pending| ends_timer(pending.barrier.id))
        {
            self.barrier_timer = None;
        }
        self.finish_unicast_builders(Sent::Yes);
        self.finish_broadcast_builder(Sent::Yes);
        let mut builder = self.event_builder(priority)?;
        builder.set_data_type(event.data_type(priority));
        event.write_to(&mut builder)?;
        let consumer = builder.create_consumer_from_beginning();
        drop(builder);
        let queued = if priority {
            Queued::PriorityEvent
        } else {
            Queued::Event
        };
        // Every subpartition with room first, then those without, each as soon as its reader
        // makes room: a reader that stopped taking delays only its own copy, not the others'.
        // The list is made only when some lane is full.
        let mut full = Vec::new();
        let mut any_queued = false;
        let mut queue = |subpartition: &Arc<PipelinedSubpartition>| {
            skip_released(
                subpartition.add_event(consumer.copy(), priority, timeoutable),
                &mut any_queued,
            )
        };
        for subpartition in self.handle.shared.subpartitions.iter() {
            if subpartition.has_room(queued) {
                queue(subpartition)?;
            } else {
                full.push(subpartition.clone());
            }
        }
        // Bounded: each round queues in at least one more subpartition.
        while !full.is_empty() {
            until_available_timed(
                &mut self.barrier_timer,
                &self.pool,
                &self.handle.shared.subpartitions,
                self.request_timeout,
                |wait| {
                    self.pool
                        .wait_until(wait, || full.iter().any(|s| s.has_room_or_listen(queued)))
                },
            )?;
            let mut index = 0;
            while index < full.len() {
                if full[index].has_room(queued) {
                    queue(&full.swap_remove(index))?;
                } else {
                    index += 1;
                }
            }
        }
        if !any_queued {
            return Err(PartitionError::Released);
        }
        if timer.is_some() {
            self.barrier_timer = timer;
            // Its deadline may have passed while it waited for room above.
            self.fire_barrier_timer();
        }
        Ok(())
    }

    /// Flink's `alignedBarrierTimeout` on the producer's side: checkpoint `checkpoint_id`'s
    /// aligned barrier with a timeout (the newest this partition queued), in every
    /// subpartition whose reader has not taken it yet, turns unaligned now: its unaligned
    /// copy, a priority event, overtakes the data queued before it (which the consumer
    /// persists as in-flight data), and the aligned one is dropped. The partition does this
    /// itself past the barrier's deadline ([`aligned_barrier_deadline`](Self::aligned_barrier_deadline))
    /// whenever it starts a buffer or waits for back pressure. A task whose output is sparse
    /// (its open buffer may not fill for long), or that writes only through
    /// [`emit_record_async`](Self::emit_record_async), calls this at that deadline from its
    /// own timer, as Flink's task registers one. Returns how many subpartitions it turned (0
    /// for another checkpoint's id).
    pub fn aligned_barrier_timeout(&mut self, checkpoint_id: u64) -> usize {
        match self.barrier_timer {
            Some(timer) if timer.barrier.id == checkpoint_id => {
                self.barrier_timer = Some(BarrierTimer {
                    deadline: Instant::now(),
                    ..timer
                });
                self.fire_barrier_timer()
            }
            _ => 0,
        }
    }

    /// [`fire_barrier_timer`] for this partition's timer, now.
    fn fire_barrier_timer(&mut self) -> usize {
        fire_barrier_timer(
            &mut self.barrier_timer,
            &self.pool,
            &self.handle.shared.subpartitions,
            Instant::now(),
        )
    }

    /// When the newest aligned barrier with a timeout turns unaligned where its readers have
    /// not taken it; `None` when there is none waiting.
    pub fn aligned_barrier_deadline(&self) -> Option<Instant> {
        self.barrier_timer.map(|timer| timer.deadline)
    }

    /// Makes the committed bytes of subpartition `target` readable now.
    pub fn flush(&mut self, target: usize) {
        if let Some(subpartition) = self.handle.shared.subpartitions.get(target) {
            subpartition.flush();
        }
    }

    /// Makes the committed bytes of every subpartition readable now.
    pub fn flush_all(&mut self) {
        self.handle.flush_all();
    }

    /// FLIP-147's `notifyEndOfData`: no record follows. Queues `EndOfData(mode)` in every
    /// subpartition once (later calls do nothing); events, a final checkpoint's barriers
    /// among them, may still follow. The consumers acknowledge once they processed every
    /// record before it ([`SubpartitionView::acknowledge_all_data_processed`], which a gate's
    /// `acknowledge_all_records_processed` reaches, over the wire too); the producer waits
    /// for that ([`wait_all_data_processed`](Self::wait_all_data_processed)) before it
    /// finishes, so a final checkpoint covers every record.
    pub fn notify_end_of_data(&mut self, mode: StopMode) -> Result<(), PartitionError> {
        if self.end_of_data_sent {
            return Ok(());
        }
        // Marked first: a broadcast failing part-way has queued it in some subpartitions
        // already, and a second call must not queue it there again.
        self.end_of_data_sent = true;
        self.broadcast_event(&Event::EndOfData(mode), false)
    }

    /// See [`PartitionHandle::is_all_data_processed`].
    pub fn is_all_data_processed(&self) -> bool {
        self.handle.is_all_data_processed()
    }

    /// A subpartition was released (its consumer went away, or the partition) before its
    /// consumer acknowledged: the acknowledgement never comes.
    fn released_unacknowledged(&self) -> bool {
        let subpartitions = &self.handle.shared.subpartitions;
        subpartitions.iter().any(|s| s.released_unacknowledged())
    }

    /// Blocks until every consumer acknowledged that it processed every record (`Ok(true)`),
    /// or `deadline` passes (`Ok(false)`); fails with `Released` once a subpartition is
    /// released unacknowledged (a consumer that went away never acknowledges).
    pub fn wait_all_data_processed(
        &self,
        deadline: Option<Instant>,
    ) -> Result<bool, PartitionError> {
        let processed = &self.handle.shared.all_data_processed;
        // Bounded by the deadline; a release wakes the wait.
        loop {
            if processed.is_done() {
                return Ok(true);
            }
            if self.released_unacknowledged() {
                return Err(PartitionError::Released);
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Ok(false);
            }
            let wait = deadline.map_or(Duration::from_secs(1), |d| d - now);
            processed.wait_unless(wait, || {
                processed.is_done() || self.released_unacknowledged()
            });
        }
    }

    /// [`wait_all_data_processed`](Self::wait_all_data_processed) without blocking the
    /// thread (any executor) and without a deadline. One such future at a time per partition
    /// (the producer's task): a second one's registration takes the first one's wake-up.
    pub async fn until_all_data_processed(&self) -> Result<(), PartitionError> {
        let processed = &self.handle.shared.all_data_processed;
        std::future::poll_fn(|cx| {
            for round in 0..2 {
                if processed.is_done() {
                    return Poll::Ready(Ok(()));
                }
                if self.released_unacknowledged() {
                    return Poll::Ready(Err(PartitionError::Released));
                }
                if round == 0 {
                    // Registered before the second look: an acknowledgement or a release
                    // after it wakes this waker.
                    processed.register(cx.waker());
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Ends the partition: finishes the builders and queues EndOfPartition everywhere.
    pub fn finish(&mut self) -> Result<(), PartitionError> {
        self.broadcast_event(&Event::EndOfPartition, false)?;
        for subpartition in self.handle.shared.subpartitions.iter() {
            subpartition.mark_finished();
        }
        self.finished = true;
        Ok(())
    }

    /// A record failed after part of it was published: its sink released the subpartitions
    /// ([`SegmentSink::abandon`]), and the partition is released with them, so every later
    /// write fails (as the failed task's partitions are in Flink).
    fn release_after_abandoned(&mut self, written: &Result<(), RecordError>) {
        if written.is_err() && self.handle.is_released() {
            self.release();
        }
    }

    /// The producer failed: [`release`](Self::release), its readers told `cause` (see
    /// [`PartitionHandle::fail`]).
    pub fn fail(&mut self, cause: impl Into<String>) {
        self.handle.note_failure(cause.into());
        self.release();
    }

    /// Drops everything queued and finishes every builder; segments go back to the pool.
    /// Readers see the partition as released.
    pub fn release(&mut self) {
        // Released first, so readers stop taking; the builders are then finished as any
        // (counted in the backlog before they show as finished): a read that began before the
        // release and takes one out counts it down from there, not from zero.
        self.handle.release();
        // Never sent: not counted in numBuffersOut / numBytesOut (Flink closes them uncounted).
        self.finish_unicast_builders(Sent::No);
        self.finish_broadcast_builder(Sent::No);
        self.pool.destroy();
    }

    /// Per record, so only what is cheap: a subpartition released by its reader is noticed
    /// when its next buffer is queued.
    #[inline]
    fn check_writable(&self) -> Result<(), PartitionError> {
        if self.finished {
            return Err(PartitionError::Finished);
        }
        if self.pool.is_destroyed() {
            return Err(PartitionError::Released);
        }
        Ok(())
    }

    fn sink(&mut self, target: Target) -> Result<PartitionSink<'_>, PartitionError> {
        let slot = match target {
            Target::Unicast(index) => {
                self.unicast
                    .get_mut(index)
                    .ok_or(PartitionError::NoSuchSubpartition {
                        index,
                        count: self.handle.shared.subpartitions.len(),
                    })?
            }
            Target::Broadcast => &mut self.broadcast,
        };
        Ok(PartitionSink {
            slot,
            target,
            pool: &self.pool,
            shared: &self.handle.shared,
            request_timeout: self.request_timeout,
            max_overdraft_for_records: self.max_overdraft_for_records,
            barrier_timer: &mut self.barrier_timer,
        })
    }

    fn install_unicast(
        &mut self,
        target: usize,
        builder: BufferBuilder,
    ) -> Result<(), PartitionError> {
        // A unicast builder exists only while no broadcast builder is open (`emit_record`'s
        // fast path relies on it): a later broadcast record must not land in a buffer queued
        // ahead of this one.
        self.finish_broadcast_builder(Sent::Yes);
        let consumer = builder.create_consumer_from_beginning();
        self.handle.shared.subpartitions[target].add_data(consumer)?;
        self.unicast[target] = Some(builder);
        Ok(())
    }

    /// A segment for an event. An event does not wait for the partition's pool while it can
    /// overdraw (Flink serializes events into unpooled memory): a checkpoint barrier or
    /// EndOfPartition is what lets blocked or back-pressured consumers go on, and the segments
    /// it would wait for may be held by exactly those consumers — an aligned barrier behind a
    /// subpartition its consumer blocked for the previous barrier is a deadlock. It takes a
    /// free segment of the pool, else an overdraft segment of the network. The overdraft is
    /// bounded (the pool's `max_overdraft_segments`), so that events queued for a reader
    /// that stopped reading cannot take the whole network memory nor overflow a lane; past
    /// it, or with the whole network memory in use, the event waits like a record, for a
    /// segment of either kind.
    fn event_builder(&self, priority: bool) -> Result<BufferBuilder, PartitionError> {
        let data_type = if priority {
            DataType::PrioritizedEventBuffer
        } else {
            DataType::EventBuffer
        };
        let segment = until_available(|| {
            self.pool
                .request_event_segment_blocking(self.request_timeout)
        })?;
        Ok(segment.into_builder(data_type))
    }

    fn finish_unicast_builder(&mut self, target: usize, sent: Sent) {
        if let Some(builder) = self.unicast.get_mut(target).and_then(Option::take) {
            finish_builder(builder, Target::Unicast(target), &self.handle.shared, sent);
        }
    }

    fn finish_unicast_builders(&mut self, sent: Sent) {
        for target in 0..self.unicast.len() {
            self.finish_unicast_builder(target, sent);
        }
    }

    fn finish_broadcast_builder(&mut self, sent: Sent) {
        if let Some(builder) = self.broadcast.take() {
            finish_builder(builder, Target::Broadcast, &self.handle.shared, sent);
        }
    }
}

/// Itself, so a slice of partitions (or of `&mut` ones) is a task's outputs for
/// [`CheckpointedInputGate::wait_for_outputs`](crate::gate::CheckpointedInputGate::wait_for_outputs).
impl AsMut<ResultPartition> for ResultPartition {
    fn as_mut(&mut self) -> &mut ResultPartition {
        self
    }
}

impl Drop for ResultPartition {
    fn drop(&mut self) {
        if self.finished {
            // Queued data stays readable, EndOfPartition behind it.
            self.finish_unicast_builders(Sent::Yes);
            self.finish_broadcast_builder(Sent::Yes);
        } else {
            // A producer gone without finishing failed (an early return, a panic): nothing
            // would ever end its readers' streams, so they would wait for good. Released, as
            // Flink's failing task releases its partitions: readers see the release
            // (`ProducerFailed` across the wire) and fail over.
            self.release();
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Target {
    Unicast(usize),
    Broadcast,
}

impl Target {
    /// The subpartitions a buffer for this target is queued in.
    fn readers(
        self,
        subpartitions: &[Arc<PipelinedSubpartition>],
    ) -> &[Arc<PipelinedSubpartition>] {
        match self {
            Target::Unicast(index) => &subpartitions[index..=index],
            Target::Broadcast => subpartitions,
        }
    }

    /// The pool's channel its segments count against.
    fn channel(self) -> usize {
        match self {
            Target::Unicast(index) => index,
            Target::Broadcast => UNACCOUNTED,
        }
    }
}

/// Finishes a builder and tells the subpartition(s) reading it.
/// Whether a buffer finished counts as sent (numBuffersOut, numBytesOut): not when the
/// partition is released, which drops it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sent {
    Yes,
    No,
}

fn finish_builder(
    mut builder: BufferBuilder,
    target: Target,
    shared: &PartitionShared,
    sent: Sent,
) {
    let readers = match target {
        Target::Unicast(index) => &shared.subpartitions[index..=index],
        Target::Broadcast => &shared.subpartitions[..],
    };
    // Counted before the finish publishes the buffer, or a reader could take it out and count
    // it down first (the backlog wrapped below zero: a sender once announced 2^32 - 1).
    readers.iter().for_each(|s| s.count_finishing_buffer());
    if builder.written() == 0 {
        readers.iter().for_each(|s| s.count_empty_buffer());
    }
    let bytes = builder.finish();
    drop(builder);
    // A broadcast buffer counts once per subpartition, as Flink counts it: these are what the
    // partition sends, and each consumer receives its own copy. An empty one (a record whose
    // encoding failed was taken back out of it) is never sent: readers skip it.
    if bytes > 0 && sent == Sent::Yes {
        let copies = readers.len() as u64;
        shared.metrics.num_buffers_out.add(copies);
        shared.metrics.num_bytes_out.add(bytes as u64 * copies);
    }
    readers.iter().for_each(|s| s.on_data_finished());
}

/// Queues one item of a broadcast in every subpartition not released. One whose consumer
/// released it is skipped, as Flink's `add` skips it: failing there would leave the others
/// with part of a spanning record, a buffer the backlog never counted, or without the event.
/// Fails only when every subpartition was released.
fn queue_in_open_subpartitions(
    shared: &PartitionShared,
    mut queue: impl FnMut(&Arc<PipelinedSubpartition>) -> Result<(), PartitionError>,
) -> Result<(), PartitionError> {
    let mut queued = false;
    for subpartition in shared.subpartitions.iter() {
        skip_released(queue(subpartition), &mut queued)?;
    }
    if queued {
        Ok(())
    } else {
        Err(PartitionError::Released)
    }
}

/// The outcome of queueing one item of a broadcast in one subpartition: a released one is
/// skipped, any other error is the broadcast's; `queued` notes that one took it.
fn skip_released(
    outcome: Result<(), PartitionError>,
    queued: &mut bool,
) -> Result<(), PartitionError> {
    match outcome {
        Ok(()) => *queued = true,
        Err(PartitionError::Released) => {}
        Err(other) => return Err(other),
    }
    Ok(())
}

/// A serializer error as the writer reports it: the sink's [`RecordError::Released`] means
/// the partition was released (by its consumer going away, or `release`) while the record was
/// being written, which callers handle as [`PartitionError::Released`].
fn released_or(error: RecordError) -> PartitionError {
    match error {
        RecordError::Released => PartitionError::Released,
        other => other.into(),
    }
}

/// [`until_available`] for the writer's waits: each wait also ends at a pending barrier
/// timer's deadline, which then fires (so a back-pressured writer still turns its barrier
/// unaligned on time).
fn until_available_timed<T>(
    timer: &mut Option<BarrierTimer>,
    pool: &LocalBufferPool,
    subpartitions: &[Arc<PipelinedSubpartition>],
    recheck: Duration,
    mut request: impl FnMut(Duration) -> Result<T, PoolError>,
) -> Result<T, PartitionError> {
    until_available(|| {
        let wait = timer.map_or(recheck, |timer| {
            timer
                .deadline
                .saturating_duration_since(Instant::now())
                .min(recheck)
        });
        let result = request(wait);
        if matches!(result, Err(PoolError::Timeout(_))) {
            fire_barrier_timer(timer, pool, subpartitions, Instant::now());
        }
        result
    })
}

/// Turns the timer's barrier unaligned in every subpartition still holding it, once its
/// deadline passed. What could not be done now (no memory for the unaligned copy, a full
/// priority lane) is tried again shortly. Returns how many subpartitions it turned.
fn fire_barrier_timer(
    timer: &mut Option<BarrierTimer>,
    pool: &LocalBufferPool,
    subpartitions: &[Arc<PipelinedSubpartition>],
    now: Instant,
) -> usize {
    let Some(pending) = timer.as_mut() else {
        return 0;
    };
    if now < pending.deadline {
        return 0;
    }
    pending.deadline = now + BARRIER_TIMER_RETRY;
    let pending_id = pending.barrier.id;
    let event = Event::CheckpointBarrier(pending.barrier.as_unaligned());
    // Not waiting for memory here: the writer may be waiting for it already. With the pool and
    // its overdraft used up, the copy goes into memory of its own, as Flink serializes the
    // unaligned barrier into unpooled memory: a back-pressured partition, whose memory is
    // all queued, is where the timeout matters most.
    let Some(segment) = pool
        .request_segment()
        .or_else(|| pool.request_overdraft_segment())
        .or_else(|| crate::buffer::PooledSegment::unpooled(event.encoded_len()).ok())
    else {
        return 0;
    };
    let mut builder = segment.into_builder(DataType::PrioritizedEventBuffer);
    if event.write_to(&mut builder).is_err() {
        // A segment too small for a barrier: it stays aligned.
        *timer = None;
        return 0;
    }
    let consumer = builder.create_consumer_from_beginning();
    drop(builder);
    let mut turned = 0;
    let mut retry = false;
    for subpartition in subpartitions {
        match subpartition.convert_timeoutable_barrier(pending_id, || consumer.copy()) {
            Conversion::Converted => turned += 1,
            Conversion::NotQueued => {}
            Conversion::NoRoom => retry = true,
        }
    }
    if !retry {
        *timer = None;
    }
    if turned > 0 {
        tracing::debug!(
            checkpoint = pending_id,
            subpartitions = turned,
            "aligned barrier timed out in its queues; sent unaligned ahead"
        );
    }
    turned
}

/// Repeats a blocking `request` through its timeouts (each a recheck, not a failure) until it
/// yields; the pool's destruction is the partition's release.
fn until_available<T>(
    mut request: impl FnMut() -> Result<T, PoolError>,
) -> Result<T, PartitionError> {
    // Bounded by the back pressure: the pool's destruction ends it.
    loop {
        match request() {
            Ok(found) => return Ok(found),
            Err(PoolError::Timeout(_)) => continue,
            Err(other) => return Err(released_if_destroyed(other)),
        }
    }
}

/// The pool's destruction is the partition's release (as the blocking paths report it).
fn released_if_destroyed(error: PoolError) -> PartitionError {
    match error {
        // Cancelled: a wait that ended because its subpartitions were released.
        PoolError::Destroyed | PoolError::Cancelled => PartitionError::Released,
        other => other.into(),
    }
}

/// Serialization target: one subpartition's builder or the broadcast builder.
struct PartitionSink<'a> {
    slot: &'a mut Option<BufferBuilder>,
    target: Target,
    pool: &'a LocalBufferPool,
    shared: &'a PartitionShared,
    request_timeout: Duration,
    max_overdraft_for_records: usize,
    barrier_timer: &'a mut Option<BarrierTimer>,
}

impl SegmentSink for PartitionSink<'_> {
    /// Releases every subpartition before any of the failed record's rest is published, and
    /// destroys the pool, so every later write fails (also after a panic the caller caught);
    /// the writer then finishes the release ([`ResultPartition::release_after_abandoned`]).
    /// Unless the record failed because its own reader went (its subpartition released, a
    /// broadcast's all): that stream has ended already, and the others go on, as in Flink.
    /// The record's open buffer is dropped uncounted either way: nothing of it is sent.
    fn abandon(&mut self) -> bool {
        let ended = match self.target {
            Target::Unicast(index) => self.shared.subpartitions[index].is_released(),
            Target::Broadcast => self.shared.subpartitions.iter().all(|s| s.is_released()),
        };
        if !ended {
            for subpartition in self.shared.subpartitions.iter() {
                subpartition.release();
            }
            self.pool.destroy();
        }
        if let Some(builder) = self.slot.take() {
            finish_builder(builder, self.target, self.shared, Sent::No);
        }
        true
    }

    #[inline]
    fn current_with_room(&mut self, bytes: usize) -> Option<&mut BufferBuilder> {
        self.slot.as_mut().filter(|b| b.remaining() >= bytes)
    }

    #[inline]
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        // A full builder holding bytes not yet committed holds the start of the record being
        // written: the next segment continues it, and may be an overdraft one.
        let mut continuing = false;
        if self.slot.as_ref().is_some_and(|b| b.is_full()) {
            let full = self.slot.take().expect("checked");
            continuing = full.has_uncommitted();
            finish_builder(full, self.target, self.shared, Sent::Yes);
        }
        if self.slot.is_none() {
            let channel = match self.target {
                Target::Unicast(index) => index,
                Target::Broadcast => UNACCOUNTED,
            };
            let readers = match self.target {
                Target::Unicast(index) => &self.shared.subpartitions[index..=index],
                Target::Broadcast => &self.shared.subpartitions[..],
            };
            // Room in the lanes, then a segment, each as long as it takes. A lane fills only
            // while its reader takes nothing and the writer queues broadcast buffers or events
            // past `max-buffers-per-channel`: back pressure like the pool's, booked as the
            // writer's back-pressured time too. Both fail only as Released or with the pool's
            // own error. A barrier timer due while the writer waits fires meanwhile: that is
            // when its barrier sits behind data the most.
            let (pool, subpartitions) = (self.pool, &self.shared.subpartitions[..]);
            let builder = if readers.iter().all(|s| s.has_room(Queued::Buffer)) {
                Ok(())
            } else {
                until_available_timed(
                    self.barrier_timer,
                    pool,
                    subpartitions,
                    self.request_timeout,
                    |wait| {
                        pool.wait_until(wait, || {
                            readers.iter().all(|s| s.has_room_or_listen(Queued::Buffer))
                        })
                    },
                )
            }
            .and_then(|()| {
                let max_overdraft = self.max_overdraft_for_records;
                // Released while the writer waits (the environment's shutdown, a cancelled
                // consumer): the wait ends at the release's wake-up, as Released, rather than
                // when a segment comes back, which a consumer still holding the pool's
                // segments may never do.
                let released = || readers.iter().all(|s| s.is_released());
                until_available_timed(
                    self.barrier_timer,
                    pool,
                    subpartitions,
                    self.request_timeout,
                    |wait| {
                        if continuing {
                            pool.request_continuation_builder_blocking_unless(
                                channel,
                                max_overdraft,
                                wait,
                                &released,
                            )
                        } else {
                            pool.request_buffer_builder_blocking_unless(channel, wait, &released)
                        }
                    },
                )
            })
            .map_err(|error| match error {
                PartitionError::Pool(pool) => RecordError::Pool(pool),
                _ => RecordError::Released,
            })?;
            let consumer = builder.create_consumer_from_beginning();
            let queued = match self.target {
                Target::Unicast(index) => self.shared.subpartitions[index].add_data(consumer),
                Target::Broadcast => queue_in_open_subpartitions(self.shared, |subpartition| {
                    subpartition.add_data(consumer.copy())
                }),
            };
            // A subpartition refuses data only once released (a broadcast: all of them).
            queued.map_err(|_| RecordError::Released)?;
            *self.slot = Some(builder);
        }
        Ok(self.slot.as_mut().expect("set above"))
    }

    #[inline]
    fn commit(&mut self) {
        if let Some(builder) = self.slot.as_mut() {
            builder.commit();
        }
    }

    fn discard_uncommitted(&mut self) -> bool {
        if let Some(builder) = self.slot.as_mut() {
            builder.discard_uncommitted();
        }
        true
    }
}
