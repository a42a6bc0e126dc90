//! Network memory: the global [`NetworkBufferPool`] of fixed segments cut from a few
//! pre-faulted arenas, per-partition / per-gate [`LocalBufferPool`]s with Flink's quotas, and
//! the leases through which segments are written ([`BufferBuilder`]), read while still being
//! written ([`BufferConsumer`]) and passed around ([`Buffer`]).
//!
//! Every segment has exactly one owner at a time: a free list, a [`PooledSegment`], or the set
//! of leases ([`BufferBuilder`], [`BufferConsumer`], [`Buffer`]) sharing it through the
//! segment's reference count. When the last lease drops, the segment goes back to the pool it
//! came from, whichever thread drops it.

mod local;
mod network;
mod segment;

pub(crate) use local::PoolWaiters;
pub use local::{BufferListener, LocalBufferPool, LocalPoolSpec, RequestBuilder};
#[cfg(not(loom))]
pub(crate) use network::mark_io_thread;
#[cfg(loom)]
pub use network::mark_io_thread;
#[cfg(test)]
pub(crate) use network::pool_of_4k_segments;
pub use network::{NetworkBufferPool, MOST_POOL_CHANNELS};
pub(crate) use segment::prefetch_for_read;
pub use segment::{
    ArenaRegion, Buffer, BufferBuilder, BufferConsumer, FramedRun, PooledSegment, Recycler,
    Segment, SegmentMemory, HEADROOM,
};

/// Pieces other modules of the crate build their own recyclers from.
pub(crate) mod segment_internals {
    pub(crate) use super::segment::{FreeList, SegmentMemory};
}

/// What a buffer carries; the ordinal is what goes on the wire (Flink 1.18's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// Placeholder for "nothing follows" in a poll result.
    None = 0,
    /// Serialized records.
    DataBuffer = 1,
    /// An in-band event that keeps its place in the stream.
    EventBuffer = 2,
    /// An event that overtakes queued data (unaligned checkpoint barrier).
    PrioritizedEventBuffer = 3,
    /// An aligned barrier: the channel blocks until `resume_consumption`.
    AlignedCheckpointBarrier = 4,
    /// An aligned barrier that turns unaligned after a timeout: it blocks its channel like an
    /// aligned one when it arrives in time; past the timeout the producer sends its unaligned
    /// copy ahead instead, and a consumer still aligning turns the checkpoint unaligned.
    TimeoutableAlignedCheckpointBarrier = 5,
    /// End of recovered channel state; blocks the channel like an aligned barrier.
    RecoveryCompletion = 6,
}

impl DataType {
    /// Decodes the wire ordinal; `None` for an ordinal no version of ours sends.
    pub fn from_ordinal(ordinal: u8) -> Option<Self> {
        Some(match ordinal {
            0 => Self::None,
            1 => Self::DataBuffer,
            2 => Self::EventBuffer,
            3 => Self::PrioritizedEventBuffer,
            4 => Self::AlignedCheckpointBarrier,
            5 => Self::TimeoutableAlignedCheckpointBarrier,
            6 => Self::RecoveryCompletion,
            _ => return None,
        })
    }

    /// True for buffers of serialized records.
    pub fn is_buffer(self) -> bool {
        self == Self::DataBuffer
    }

    /// True for every kind of event.
    pub fn is_event(self) -> bool {
        !matches!(self, Self::None | Self::DataBuffer)
    }

    /// True when the item jumps ahead of queued data.
    pub fn has_priority(self) -> bool {
        self == Self::PrioritizedEventBuffer
    }

    /// True when consuming the item blocks the channel until `resume_consumption`.
    pub fn is_blocking_upstream(self) -> bool {
        matches!(
            self,
            Self::AlignedCheckpointBarrier
                | Self::TimeoutableAlignedCheckpointBarrier
                | Self::RecoveryCompletion
        )
    }

    /// True when the consumer must be told ahead of time that the item is queued.
    pub fn requires_announcement(self) -> bool {
        self == Self::TimeoutableAlignedCheckpointBarrier
    }
}

/// Why a pool could not hand out a segment.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError {
    /// The configuration asks for memory the machine or the limits cannot give (caller's fault).
    #[error("invalid network memory configuration: {0}")]
    Config(String),
    /// Mapping the arenas failed (the machine's fault: memory, limits).
    #[error("allocating {bytes} bytes of network memory failed: {reason}")]
    Allocation {
        /// Bytes asked for.
        bytes: usize,
        /// The OS error.
        reason: String,
    },
    /// The minimum of all local pools would exceed the global pool (Flink's message).
    #[error(
        "Insufficient number of network buffers: required {required}, but only {available} \
         available. The total number of network buffers is currently set to {total} of \
         {segment_size} bytes each."
    )]
    Insufficient {
        /// Segments the new pool needs as its guaranteed minimum.
        required: usize,
        /// Segments not yet promised to another pool.
        available: usize,
        /// Segments in the whole network memory.
        total: usize,
        /// Payload bytes per segment.
        segment_size: usize,
    },
    /// A blocking request waited its whole timeout.
    #[error("timed out after {0:?} waiting for a network buffer")]
    Timeout(std::time::Duration),
    /// The pool was destroyed (its partition or gate was released).
    #[error("the buffer pool was destroyed")]
    Destroyed,
    /// The listener queue is full: more listeners than the pool was sized for.
    #[error("the buffer pool has no room for another listener")]
    TooManyListeners,
    /// A request was called off by its owner: the gate it was for was closed, or the
    /// subpartitions a partition's writer waited to write to were released.
    #[error("the buffer request was cancelled")]
    Cancelled,
}
