//! `RecordReader`: records, events and the end, read from any gate.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{CheckpointedInputGate, GateError, GateItem, InputGate, OutputWait};
use crate::event::Event;
use crate::partition::ResultPartition;
use crate::record::{RecordDeserializer, RecordError, SpanningBudget, WholeRecords};

/// What the reader yields.
#[derive(Debug)]
pub enum ReaderItem<'a> {
    /// One record, borrowed from its buffer (or from the reader's scratch vector when it
    /// spanned buffers); valid until the next call.
    Record {
        /// The channel it came from.
        channel: usize,
        /// The record's bytes.
        bytes: &'a [u8],
    },
    /// An event (EndOfPartition included, once per channel).
    Event {
        /// The channel it came from.
        channel: usize,
        /// The event.
        event: Event,
    },
}

/// A batch of records read from one buffer ([`RecordReader::records_in_buffer`]).
#[derive(Debug)]
pub struct BufferRecords<'a> {
    channel: usize,
    records: WholeRecords<'a>,
}

impl BufferRecords<'_> {
    /// The channel the records came from.
    pub fn channel(&self) -> usize {
        self.channel
    }
}

impl<'a> Iterator for BufferRecords<'a> {
    type Item = &'a [u8];

    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        self.records.next()
    }
}

/// How a read may wait.
#[derive(Clone, Copy, Debug)]
enum Wait {
    Poll,
    Forever,
    For(Duration),
}

/// Why the reader stopped.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReaderError {
    /// The gate failed.
    #[error(transparent)]
    Gate(#[from] GateError),
    /// A channel's records did not decode.
    #[error("channel {channel}: {source}")]
    Record {
        /// The channel.
        channel: usize,
        /// What was wrong.
        source: RecordError,
    },
}

/// Reads records from a gate: one deserializer per channel, so records spanning buffers of a
/// channel are joined while other channels' buffers interleave.
pub struct RecordReader<G> {
    gate: G,
    deserializers: Vec<RecordDeserializer>,
    /// The channel whose buffer is being read.
    current: Option<usize>,
    /// A channel whose EndOfPartition came with a record begun and never ended: the read
    /// failed with `Truncated`, and the next one hands out the end (each channel's end comes
    /// out once, also after an error).
    end_after_error: Option<usize>,
}

impl<G> fmt::Debug for RecordReader<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordReader")
            .field("current", &self.current)
            .finish()
    }
}

impl<G: InputGate> RecordReader<G> {
    /// A reader over `gate` refusing records over `max_record_bytes`, whose channels may hold
    /// [`SpanningBudget::default_limit`] of memory for records spanning buffers.
    pub fn new(gate: G, max_record_bytes: usize) -> Self {
        let budget = SpanningBudget::new(SpanningBudget::default_limit(max_record_bytes));
        Self::with_spanning_budget(gate, max_record_bytes, budget)
    }

    /// [`new`](Self::new) with the memory its channels may hold for records spanning buffers
    /// given (or shared with other readers): past it a read fails with
    /// [`RecordError::SpanningMemory`].
    pub fn with_spanning_budget(
        gate: G,
        max_record_bytes: usize,
        budget: Arc<SpanningBudget>,
    ) -> Self {
        let deserializers = (0..gate.channel_count())
            .map(|_| RecordDeserializer::new(max_record_bytes).with_budget(budget.clone()))
            .collect();
        Self {
            gate,
            deserializers,
            current: None,
            end_after_error: None,
        }
    }

    /// The next record or event, blocking; `Ok(None)` once every channel ended.
    // A blocking, fallible read (Flink's `getNext`), not an iterator: items borrow the reader.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        self.read(Wait::Forever)
    }

    /// [`next`](Self::next) giving up after `timeout` with [`GateError::TimedOut`].
    pub fn next_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        self.read(Wait::For(timeout))
    }

    /// The next record or event if one is readable now.
    pub fn poll_next(&mut self) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        self.read(Wait::Poll)
    }

    /// The records after the last one read that lie whole in the same buffer, as one batch:
    /// a loop over it costs far less per record than a call of [`next`](Self::next) each
    /// (nothing is looked up per record, and the read position stays in a register). The
    /// batch ends at the buffer's end, or before a record that spans on into the next
    /// buffer or whose length is refused; read on with `next`, which takes what the batch
    /// left (that record, the channel's next buffer or event). `None` when no buffer is
    /// being read: before the first record, and after an event between buffers (a priority
    /// event handed out mid-buffer by [`wait_for_output`](Self::wait_for_output) leaves the
    /// buffer's rest to a batch).
    ///
    /// ```ignore
    /// while let Some(item) = reader.next()? {
    ///     handle(item);
    ///     if let Some(batch) = reader.records_in_buffer() {
    ///         batch.for_each(handle_record);
    ///     }
    /// }
    /// ```
    #[inline]
    pub fn records_in_buffer(&mut self) -> Option<BufferRecords<'_>> {
        let channel = self.current?;
        let records = self.deserializers.get_mut(channel)?.whole_records();
        Some(BufferRecords { channel, records })
    }

    /// The gate read from.
    pub fn gate(&self) -> &G {
        &self.gate
    }

    /// The gate read from, mutably (resume consumption, close).
    pub fn gate_mut(&mut self) -> &mut G {
        &mut self.gate
    }

    /// A checkpoint barrier came out of the gate: for an unaligned checkpoint, the records
    /// each channel's deserializer holds half-read are in flight too (their rest comes in the
    /// buffers the gate persists from now on), so they go to the gate's channel-state sink
    /// first, as Flink's `prepareSnapshot` writes each deserializer's unconsumed bytes. An
    /// aligned barrier comes out with every channel at a barrier or ended, where no record is
    /// half-read (a record never spans an event), so there is nothing then.
    #[cold]
    fn persist_unconsumed(&mut self, checkpoint_id: u64) {
        let Some(sink) = self.gate.channel_state_sink() else {
            return;
        };
        let mut bytes = Vec::new();
        for (channel, deserializer) in self.deserializers.iter().enumerate() {
            bytes.clear();
            if deserializer.unconsumed_bytes(&mut bytes) {
                sink.add_partial_record(checkpoint_id, channel, &bytes);
            }
        }
    }

    /// Reads the next item; blocking as `wait` says.
    #[inline]
    fn read(&mut self, wait: Wait) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        // The common case inline: the next record lies whole in the current buffer.
        if let Some(channel) = self.current {
            if let Some(deserializer) = self.deserializers.get_mut(channel) {
                if deserializer.advance_within_buffer() {
                    return Ok(Some(ReaderItem::Record {
                        channel,
                        bytes: self.deserializers[channel].current_record(),
                    }));
                }
            }
        }
        self.read_general(wait)
    }

    /// [`read`](Self::read) for every case: buffer ends, spanning records, events, waiting.
    #[inline(never)]
    fn read_general(&mut self, wait: Wait) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        // One deadline for the whole call, fixed when it first has to wait: buffers that
        // bring no whole record do not restart the timeout.
        let mut deadline = None;
        if let Some(channel) = self.end_after_error.take() {
            return Ok(Some(ReaderItem::Event {
                channel,
                event: Event::EndOfPartition,
            }));
        }
        loop {
            if let Some(channel) = self.current {
                let found = RecordDeserializer::advance_among(&mut self.deserializers, channel)
                    .map_err(|source| ReaderError::Record { channel, source })?;
                if found {
                    return Ok(Some(ReaderItem::Record {
                        channel,
                        bytes: self.deserializers[channel].current_record(),
                    }));
                }
                self.current = None;
            }
            // Only a read that would block reads the clock (not one per record or buffer).
            let next = match (self.gate.poll_next()?, wait) {
                (Some(item), _) => Some(item),
                (None, Wait::Poll) => None,
                (None, Wait::Forever) => self.gate.next_until(None)?,
                (None, Wait::For(timeout)) => {
                    // A timeout beyond what the clock can count waits without a deadline.
                    let deadline =
                        *deadline.get_or_insert_with(|| Instant::now().checked_add(timeout));
                    self.gate.next_until(deadline)?
                }
            };
            let Some(item) = next else {
                return Ok(None);
            };
            let channel = item.channel;
            match item.item {
                GateItem::Buffer(buffer) => {
                    self.deserializers[channel]
                        .set_next_buffer(buffer)
                        .map_err(|source| ReaderError::Record { channel, source })?;
                    self.current = Some(channel);
                }
                GateItem::Event { event, .. } => {
                    return self.on_event(channel, event).map(Some);
                }
            }
        }
    }

    /// An event of `channel` comes out: a barrier first persists what the deserializers
    /// hold unconsumed, an end checks its channel's stream ended on a record boundary.
    fn on_event(&mut self, channel: usize, event: Event) -> Result<ReaderItem<'_>, ReaderError> {
        if let Event::CheckpointBarrier(barrier) = &event {
            self.persist_unconsumed(barrier.id);
        }
        if event == Event::EndOfPartition {
            // A record begun and never ended means a truncated stream.
            if let Err(source) = self.deserializers[channel].finish() {
                self.end_after_error = Some(channel);
                return Err(ReaderError::Record { channel, source });
            }
        }
        Ok(ReaderItem::Event { channel, event })
    }
}

impl<G: InputGate> RecordReader<CheckpointedInputGate<G>> {
    /// [`CheckpointedInputGate::wait_for_output`] between two records: `Ok(None)` once
    /// `output` takes records again, or a priority event to handle first (an unaligned
    /// barrier, a cancellation marker), while the output is still back-pressured. A barrier
    /// coming out here, in the middle of a buffer, first hands the channel-state sink the
    /// rest of that buffer (and any record half-read) as in-flight data, as Flink's
    /// `getUnconsumedBuffer` does: the records after it still come out of this reader
    /// afterwards, and belong to the data after the checkpoint's snapshot.
    /// [`GateError::TimedOut`] at `deadline`.
    pub fn wait_for_output(
        &mut self,
        output: &mut ResultPartition,
        deadline: Option<Instant>,
    ) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        let waited = self.gate.wait_for_output(output, deadline)?;
        self.on_output_wait(waited)
    }

    /// [`wait_for_output`](Self::wait_for_output) for several outputs: `Ok(None)` only from a
    /// look at which every output takes records
    /// ([`CheckpointedInputGate::wait_for_outputs`]).
    pub fn wait_for_outputs<O: AsMut<ResultPartition>>(
        &mut self,
        outputs: &mut [O],
        deadline: Option<Instant>,
    ) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        let waited = self.gate.wait_for_outputs(outputs, deadline)?;
        self.on_output_wait(waited)
    }

    fn on_output_wait(
        &mut self,
        waited: OutputWait,
    ) -> Result<Option<ReaderItem<'_>>, ReaderError> {
        match waited {
            OutputWait::Available => Ok(None),
            OutputWait::Event(item) => {
                let GateItem::Event { event, .. } = item.item else {
                    unreachable!("the wait hands out events only");
                };
                self.on_event(item.channel, event).map(Some)
            }
        }
    }
}
