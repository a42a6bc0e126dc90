//! `RecordWriter`: picks a subpartition per record and applies the buffer timeout.

use std::fmt;
use std::time::Duration;

use super::result_partition::ResultPartition;
use super::PartitionError;
use crate::event::Event;
use crate::flusher::OutputFlusher;
use crate::record::Record;

/// Where a record goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// To one subpartition.
    Channel(usize),
    /// To every subpartition (written once, shared).
    Broadcast,
}

/// Picks the subpartition of each record (Flink's `ChannelSelector` / stream partitioners).
pub trait ChannelSelector<R: ?Sized> {
    /// Where `record` goes among `channels` subpartitions.
    fn select(&mut self, record: &R, channels: usize) -> Selection;
}

/// Round-robin over the subpartitions (Flink's rebalance partitioner).
#[derive(Clone, Debug, Default)]
pub struct RoundRobinSelector {
    next: usize,
}

impl RoundRobinSelector {
    /// Starts at `first` (Flink starts at a random channel so producers spread out).
    pub fn starting_at(first: usize) -> Self {
        Self { next: first }
    }
}

impl<R: ?Sized> ChannelSelector<R> for RoundRobinSelector {
    #[inline]
    fn select(&mut self, _record: &R, channels: usize) -> Selection {
        // A compare instead of `%`: an integer division per record is measurable.
        let channel = if self.next >= channels { 0 } else { self.next };
        self.next = channel + 1;
        Selection::Channel(channel)
    }
}

/// Every record to every subpartition.
#[derive(Clone, Copy, Debug, Default)]
pub struct BroadcastSelector;

impl<R: ?Sized> ChannelSelector<R> for BroadcastSelector {
    fn select(&mut self, _record: &R, _channels: usize) -> Selection {
        Selection::Broadcast
    }
}

/// Every record to subpartition 0 (a one-to-one forward connection).
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardSelector;

impl<R: ?Sized> ChannelSelector<R> for ForwardSelector {
    fn select(&mut self, _record: &R, _channels: usize) -> Selection {
        Selection::Channel(0)
    }
}

/// By key, as Flink's `KeyGroupStreamPartitioner`: key hash → key group (of
/// `max_parallelism`) → channel, so a key always goes to the same channel and rescaling moves
/// whole key groups.
pub struct KeyHashSelector<F> {
    key_hash: F,
    max_parallelism: usize,
}

impl<F> fmt::Debug for KeyHashSelector<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyHashSelector")
            .field("max_parallelism", &self.max_parallelism)
            .finish()
    }
}

impl<F> KeyHashSelector<F> {
    /// `key_hash` hashes a record's key; `max_parallelism` is the number of key groups
    /// (Flink's default is 128).
    pub fn new(key_hash: F, max_parallelism: usize) -> Self {
        Self {
            key_hash,
            max_parallelism: max_parallelism.max(1),
        }
    }

    /// The key group of a key hash (a murmur finalizer spreads poor hashes first).
    pub fn key_group(&self, hash: u64) -> usize {
        let mut h = hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        (h % self.max_parallelism as u64) as usize
    }
}

impl<R: ?Sized, F: FnMut(&R) -> u64> ChannelSelector<R> for KeyHashSelector<F> {
    #[inline]
    fn select(&mut self, record: &R, channels: usize) -> Selection {
        let hash = (self.key_hash)(record);
        let group = self.key_group(hash);
        // Flink's `keyGroup * parallelism / maxParallelism`: in 64 bits (sizes of real jobs),
        // in 128 only for sizes whose product overflows them.
        let channel = match (group as u64).checked_mul(channels as u64) {
            Some(product) => product / self.max_parallelism as u64,
            None => (group as u128 * channels as u128 / self.max_parallelism as u128) as u64,
        };
        Selection::Channel(channel as usize)
    }
}

/// Takes the next record of `records` with the selector's choice for it: the selector is
/// asked once per record, as the record is taken.
#[inline]
fn selecting<'a, 'r, R, I, S>(
    records: &'a mut I,
    selector: &'a mut S,
    channels: usize,
) -> impl FnMut() -> Option<(&'r R, Selection)> + 'a
where
    R: ?Sized + 'r,
    I: Iterator<Item = &'r R>,
    S: ChannelSelector<R>,
{
    move || {
        records
            .next()
            .map(|record| (record, selector.select(record, channels)))
    }
}

/// The records after one that went to `target` through the general path, appended to their
/// subpartitions' open buffers in runs ([`RecordWriter::emit_all`]): in all subpartitions'
/// at once (more than one and up to `RUN_SUBPARTITIONS` of them), so records spread round
/// robin or by key batch too, or else in `target`'s alone, while the records go there.
/// Returns the first record the runs did not take (a broadcast, or one for the general
/// path: no open buffer, a full one, a spanning record), with its selection. `pending` is
/// the record after the one emitted; `next` selects each one after. The runs end (and
/// publish) before it returns.
#[inline]
fn extend_run<'r, R: Record + ?Sized + 'r>(
    partition: &mut ResultPartition,
    target: usize,
    mut pending: Option<(&'r R, Selection)>,
    next: &mut impl FnMut() -> Option<(&'r R, Selection)>,
) -> Option<(&'r R, Selection)> {
    // Runs only for a record they can take: contiguous bytes (not a record type serialized
    // in pieces, which takes the general path each time) to a subpartition with an open
    // buffer. Else opening and publishing them per record would cost more than it saves.
    let Some((record, Selection::Channel(first))) = pending else {
        return pending;
    };
    if record.as_contiguous().is_none() || !partition.has_open_buffer(first) {
        return pending;
    }
    // One subpartition: its run alone, whose position the compiler keeps in a register
    // (in the array of runs it goes through memory per record, about 1 ns more at 8 B).
    if partition.subpartition_count() > 1 {
        if let Some(mut runs) = partition.unicast_runs() {
            while let Some((record, Selection::Channel(t))) = pending {
                if !runs.try_emit(t, record) {
                    break;
                }
                pending = next();
            }
            return pending;
        }
    }
    if !matches!(pending, Some((_, Selection::Channel(t))) if t == target) {
        return pending;
    }
    let Some(mut run) = partition.unicast_run(target) else {
        return pending;
    };
    while let Some((record, Selection::Channel(t))) = pending {
        if t != target || !run.try_emit(record) {
            break;
        }
        pending = next();
    }
    pending
}

/// When partly filled buffers become readable (Flink's `execution.buffer-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferTimeout {
    /// `-1`: only full buffers and events are readable.
    Never,
    /// `0`: flush after every record (lowest latency).
    Always,
    /// `N ms`: a flusher makes data readable at most this long after it was written.
    Every(Duration),
}

impl BufferTimeout {
    /// From Flink's millisecond value: -1, 0 or a positive interval; Flink refuses a value
    /// below -1, which [`try_from_millis`](Self::try_from_millis) does too (this reads it as
    /// -1).
    pub fn from_millis(millis: i64) -> Self {
        match millis {
            i64::MIN..=-1 => BufferTimeout::Never,
            0 => BufferTimeout::Always,
            n => BufferTimeout::Every(Duration::from_millis(n as u64)),
        }
    }

    /// [`from_millis`](Self::from_millis), refusing a value below -1 as Flink's
    /// `setBufferTimeout` does.
    pub fn try_from_millis(millis: i64) -> Result<Self, String> {
        if millis < -1 {
            return Err(
                "must be -1 (only full buffers), 0 (every record) or a positive number \
                 of milliseconds"
                    .into(),
            );
        }
        Ok(Self::from_millis(millis))
    }
}

/// Writes records into a [`ResultPartition`] through a [`ChannelSelector`], applying the
/// buffer timeout (Flink's `RecordWriter`).
pub struct RecordWriter<S> {
    partition: ResultPartition,
    selector: S,
    flush_always: bool,
    _flusher: Option<OutputFlusher>,
}

impl<S> fmt::Debug for RecordWriter<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordWriter")
            .field("partition", &self.partition)
            .field("flush_always", &self.flush_always)
            .finish()
    }
}

impl<S> RecordWriter<S> {
    /// A writer over `partition`; with `BufferTimeout::Every` it starts an output flusher
    /// thread that stops when the writer drops.
    ///
    /// # Panics
    ///
    /// When the flusher thread cannot be started, as `std::thread::spawn` does;
    /// [`try_new`](Self::try_new) returns that error instead.
    pub fn new(partition: ResultPartition, selector: S, timeout: BufferTimeout) -> Self {
        Self::try_new(partition, selector, timeout).expect("starting the output flusher")
    }

    /// As [`new`](Self::new), failing with [`PartitionError::Flusher`] when the system
    /// refuses the flusher thread. The partition is then dropped unfinished, which releases
    /// it (its readers see the release): as a task fails when its writer cannot be set up.
    pub fn try_new(
        partition: ResultPartition,
        selector: S,
        timeout: BufferTimeout,
    ) -> Result<Self, PartitionError> {
        let flusher = match timeout {
            BufferTimeout::Every(interval) => Some(
                OutputFlusher::start(partition.handle(), interval)
                    .map_err(|error| PartitionError::Flusher(error.to_string()))?,
            ),
            _ => None,
        };
        Ok(Self {
            partition,
            selector,
            flush_always: timeout == BufferTimeout::Always,
            _flusher: flusher,
        })
    }

    /// Emits `record` to the subpartition(s) the selector picks.
    #[inline]
    pub fn emit<R: Record + ?Sized>(&mut self, record: &R) -> Result<(), PartitionError>
    where
        S: ChannelSelector<R>,
    {
        let channels = self.partition.subpartition_count();
        match self.selector.select(record, channels) {
            Selection::Channel(target) => {
                self.partition.emit_record(record, target)?;
                if self.flush_always {
                    self.partition.flush(target);
                }
            }
            Selection::Broadcast => {
                self.partition.broadcast_record(record)?;
                if self.flush_always {
                    self.partition.flush_all();
                }
            }
        }
        Ok(())
    }

    /// Emits every record of `records` in order, as many calls of [`emit`](Self::emit)
    /// would (the selector is asked once per record, in order, and an error stops the batch
    /// at the record it reports), at a fraction of their cost for small records: records are
    /// appended to their subpartitions' open buffers in runs, which keep each buffer's
    /// position out of the builder (in a register, with one subpartition) and publish it
    /// once. With up to 16 subpartitions every subpartition has a run at once, so records
    /// spread round robin or by key batch too; with more, only records that follow one
    /// another to the same subpartition do.
    ///
    /// The records of a run become readable when the runs end (the batch ends, or a record
    /// takes the general path: a buffer fills, a record spans, a broadcast; with more than 16
    /// subpartitions also when the selector picks another one), so a timed flush during a batch
    /// sends what was published before it, and the rest goes with the next flush. An
    /// iterator or selector that blocks (waiting for input, say) holds the records of every
    /// open run back meanwhile, in every subpartition, past `execution.buffer-timeout`
    /// (a job whose records come back around a loop could wait on itself): give `emit_all` records at
    /// hand. With [`BufferTimeout::Always`] each record is emitted and flushed on its own.
    pub fn emit_all<'r, R, I>(&mut self, records: I) -> Result<(), PartitionError>
    where
        R: Record + ?Sized + 'r,
        I: IntoIterator<Item = &'r R>,
        S: ChannelSelector<R>,
    {
        let mut records = records.into_iter();
        if self.flush_always {
            return records.try_for_each(|record| self.emit(record));
        }
        let channels = self.partition.subpartition_count();
        let mut next = selecting(&mut records, &mut self.selector, channels);
        // Bounded by the iterator: every pass takes at least one record from it.
        let mut pending = next();
        while let Some((record, selection)) = pending {
            pending = match selection {
                Selection::Channel(target) => {
                    // The record through the general path (which opens a buffer when
                    // needed), then those after it into their subpartitions' open buffers.
                    self.partition.emit_record(record, target)?;
                    extend_run(&mut self.partition, target, next(), &mut next)
                }
                Selection::Broadcast => {
                    self.partition.broadcast_record(record)?;
                    next()
                }
            };
        }
        Ok(())
    }

    /// [`emit_all`](Self::emit_all) waiting for buffers without blocking the thread: each
    /// record that needs the general path goes through [`emit_async`](Self::emit_async)'s
    /// waits (so, as there, a record spanning past its overdraft still waits blocking). Dropped
    /// before it completes (a cancelled task), it has emitted the records before the one it
    /// waited for, as one `emit_async` per record would have; that one was taken from the
    /// iterator and selected, but none of its bytes written.
    pub async fn emit_all_async<'r, R, I>(&mut self, records: I) -> Result<(), PartitionError>
    where
        R: Record + ?Sized + 'r,
        I: IntoIterator<Item = &'r R>,
        S: ChannelSelector<R>,
    {
        let mut records = records.into_iter();
        if self.flush_always {
            for record in records {
                self.emit_async(record).await?;
            }
            return Ok(());
        }
        let channels = self.partition.subpartition_count();
        let mut next = selecting(&mut records, &mut self.selector, channels);
        // Bounded by the iterator: every pass takes at least one record from it.
        let mut pending = next();
        while let Some((record, selection)) = pending {
            pending = match selection {
                Selection::Channel(target) => {
                    self.partition.emit_record_async(record, target).await?;
                    extend_run(&mut self.partition, target, next(), &mut next)
                }
                Selection::Broadcast => {
                    self.partition.broadcast_record_async(record).await?;
                    next()
                }
            };
        }
        Ok(())
    }

    /// Emits without blocking the thread while waiting for buffers, unicast or broadcast.
    /// The selector is asked once per record, as by [`emit`](Self::emit).
    pub async fn emit_async<R: Record + ?Sized>(&mut self, record: &R) -> Result<(), PartitionError>
    where
        S: ChannelSelector<R>,
    {
        let channels = self.partition.subpartition_count();
        match self.selector.select(record, channels) {
            Selection::Channel(target) => {
                self.partition.emit_record_async(record, target).await?;
                if self.flush_always {
                    self.partition.flush(target);
                }
            }
            Selection::Broadcast => {
                self.partition.broadcast_record_async(record).await?;
                if self.flush_always {
                    self.partition.flush_all();
                }
            }
        }
        Ok(())
    }

    /// Queues an event in every subpartition (priority: ahead of queued data).
    pub fn broadcast_event(&mut self, event: &Event, priority: bool) -> Result<(), PartitionError> {
        self.partition.broadcast_event(event, priority)
    }

    /// Makes everything written so far readable.
    pub fn flush_all(&mut self) {
        self.partition.flush_all();
    }

    /// Ends the partition (EndOfPartition everywhere).
    pub fn finish(&mut self) -> Result<(), PartitionError> {
        self.partition.finish()
    }

    /// The channel selector.
    pub fn selector(&self) -> &S {
        &self.selector
    }

    /// The channel selector, mutably.
    pub fn selector_mut(&mut self) -> &mut S {
        &mut self.selector
    }

    /// The partition written to.
    pub fn partition(&self) -> &ResultPartition {
        &self.partition
    }

    /// The partition written to, mutably.
    pub fn partition_mut(&mut self) -> &mut ResultPartition {
        &mut self.partition
    }
}

/// The partition written to, for the waits that take any output
/// ([`CheckpointedInputGate::wait_for_outputs`](crate::gate::CheckpointedInputGate::wait_for_outputs)).
impl<S> AsMut<ResultPartition> for RecordWriter<S> {
    fn as_mut(&mut self) -> &mut ResultPartition {
        &mut self.partition
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::BufferTimeout;

    #[test]
    fn a_buffer_timeout_below_minus_one_is_refused_as_flink_refuses_it() {
        assert!(BufferTimeout::try_from_millis(-5).is_err());
        assert!(matches!(
            BufferTimeout::try_from_millis(-1),
            Ok(BufferTimeout::Never)
        ));
        assert!(matches!(
            BufferTimeout::try_from_millis(0),
            Ok(BufferTimeout::Always)
        ));
        assert!(matches!(
            BufferTimeout::try_from_millis(7),
            Ok(BufferTimeout::Every(d)) if d == Duration::from_millis(7)
        ));
    }
}
