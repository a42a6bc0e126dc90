//! The producing half of the exchange (Flink's `ResultPartition`, `PipelinedSubpartition`,
//! `RecordWriter`). IO-free: a local input channel or the network sender drains the
//! [`SubpartitionView`]s.
//!
//! ```text
//! RecordWriter.emit(record) ─ selector ─▶ ResultPartition.emit_record(record, i)
//!   serialize into subpartition i's BufferBuilder (a segment of the partition's pool)
//!   full → finish, backlog += 1, notify the reader if it waits
//!   flush (buffer timeout) → the committed part of the unfinished buffer becomes readable
//!   event → finish builders, queue the event (priority events overtake queued data)
//! SubpartitionView.poll_next() → BufferAndBacklog { buffer, backlog, next type, seq, overtaken }
//! ```

mod manager;
mod result_partition;
mod subpartition;
mod writer;

pub use manager::{PartitionManager, TaskEventListener};
pub use result_partition::{PartitionHandle, ResultPartition};
pub use subpartition::SubpartitionView;
pub use writer::{
    BroadcastSelector, BufferTimeout, ChannelSelector, ForwardSelector, KeyHashSelector,
    RecordWriter, RoundRobinSelector, Selection,
};

use crate::buffer::{Buffer, DataType, PoolError};
use crate::event::{Event, EventError};
use crate::record::RecordError;

/// Identifies a produced partition (Flink: intermediate result partition + producer attempt).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResultPartitionId {
    /// The intermediate result partition.
    pub partition: u64,
    /// The producing execution attempt.
    pub producer: u64,
}

/// How a partition is consumed; pipelined and bounded by its pool for now, an enum so a
/// blocking (batch) type can follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PartitionType {
    /// Streamed while produced, bounded by the partition's buffer pool (Flink's
    /// `PIPELINED_BOUNDED`).
    Pipelined,
}

/// What a view returns per item.
#[derive(Debug)]
pub struct BufferAndBacklog {
    /// The buffer or event.
    pub buffer: Buffer,
    /// Finished data buffers still queued behind it.
    pub backlog: usize,
    /// The type of the next readable item (`DataType::None` if nothing is readable now), so
    /// a sender knows an event follows even without credit.
    pub next_data_type: DataType,
    /// Position of this item in the subpartition's output order, from 0.
    pub sequence_number: u64,
    /// For a priority event: how many items of the data lane it overtook. They are the next
    /// that many data-lane items this view returns; a checkpoint persists them by reference.
    pub overtaken: usize,
}

/// Told by a subpartition when its reader has something to read.
pub trait AvailabilityListener: Send + Sync {
    /// The view went from nothing-to-read to something-to-read (or was flushed).
    fn notify_data_available(&self);
    /// A priority event was queued; it is readable ahead of the data.
    fn notify_priority_event(&self) {
        self.notify_data_available();
    }
}

/// Why a producer-side operation failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartitionError {
    /// No partition with this id is registered (yet).
    #[error("partition {0:?} not found")]
    PartitionNotFound(ResultPartitionId),
    /// The subpartition index is out of range.
    #[error("subpartition {index} out of range (partition has {count})")]
    NoSuchSubpartition {
        /// Asked for.
        index: usize,
        /// Subpartitions of the partition.
        count: usize,
    },
    /// A partition was asked for with no subpartition (Flink refuses it too): it could never
    /// finish, and would read as released and finished at once.
    #[error("a partition needs at least one subpartition")]
    NoSubpartitions,
    /// The subpartition already has its one reader.
    #[error("subpartition {0} already has a reader")]
    ViewExists(usize),
    /// The partition or subpartition was released (consumer gone or cancelled).
    #[error("the partition was released")]
    Released,
    /// Written to after `finish`.
    #[error("the partition is finished")]
    Finished,
    /// A partition with this id is already registered.
    #[error("partition {0:?} already registered")]
    DuplicatePartition(ResultPartitionId),
    /// No buffer could be had.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A record could not be written.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// An event could not be written.
    #[error(transparent)]
    Event(#[from] EventError),
    /// An aligned checkpoint barrier was to be broadcast as a priority event: it would not
    /// block its channels, and records after it would reach the consumer before the alignment
    /// ends. Only unaligned barriers overtake data (Flink derives the priority from the
    /// barrier's options).
    #[error("an aligned checkpoint barrier cannot be a priority event")]
    PriorityAlignedBarrier,
    /// An event that ends the channel's data or its recovered state (EndOfPartition,
    /// EndOfData, EndOfChannelState) was to be broadcast as a priority event: overtaking, it
    /// would end the channels with data still queued before it.
    #[error("{0:?} cannot be a priority event: it must follow the data before it")]
    PriorityEndEvent(Event),
    /// The output flusher thread (`execution.buffer-timeout` above zero) could not be
    /// started: the system refused a thread.
    #[error("starting the output flusher thread failed: {0}")]
    Flusher(String),
}
