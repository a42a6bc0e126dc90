//! In-band events and their bytes.
//!
//! Layout (ours, big-endian): one tag byte, then the event's fields.
//!
//! | tag | event | body |
//! | --- | --- | --- |
//! | 0 | `EndOfPartition` | — |
//! | 1 | `CheckpointBarrier` | id u64, timestamp i64, kind u8, alignment u8, [timeout ms u64 if alignment = 2] |
//! | 2 | `CancelCheckpointMarker` | id u64 |
//! | 3 | `EndOfData` | stop mode u8 (0 drain, 1 no-drain) |
//! | 4 | `EndOfChannelState` | — |
//! | 5 | `Task` | length u32, then that many opaque bytes |

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::buffer::{BufferBuilder, DataType};

/// Why bytes did not decode to an event: always the sender's fault.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventError {
    /// No bytes at all.
    #[error("empty event buffer")]
    Empty,
    /// A tag no version of ours writes.
    #[error("unknown event tag {0}")]
    UnknownTag(u8),
    /// The body is shorter than its fields.
    #[error("truncated {0} event")]
    Truncated(&'static str),
    /// Bytes after the event's last field.
    #[error("{0} trailing bytes after the event")]
    Trailing(usize),
    /// A field holds a value out of its range.
    #[error("invalid {field}: {value}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The event does not fit into one buffer.
    #[error("event of {0} bytes does not fit into a buffer")]
    TooLarge(usize),
    /// The event came in a buffer of a type it is never sent as (an aligned barrier as a
    /// priority event, or in an event buffer that does not block its channel; an unaligned one
    /// in a blocking buffer): the channel's blocking would not match what the barrier says.
    #[error("event {event} in a buffer of type {data_type:?}")]
    WrongBufferType {
        /// The event's tag.
        event: &'static str,
        /// The buffer's type.
        data_type: crate::buffer::DataType,
    },
}

impl CheckpointBarrier {
    /// Refuses what Flink's checkpoint options never make: an unaligned savepoint (savepoints
    /// are always aligned).
    pub fn validate(&self) -> Result<(), EventError> {
        if self.kind == CheckpointKind::Savepoint && self.alignment == Alignment::Unaligned {
            return Err(EventError::InvalidField {
                field: "alignment of a savepoint barrier",
                value: 1,
            });
        }
        Ok(())
    }

    /// For a barrier aligned with a timeout, when that timeout passes: `timeout_ms` after the
    /// checkpoint started, as Flink measures it (the barrier's timestamp against this
    /// machine's wall clock), on the monotonic clock from `now`. A timestamp ahead of the
    /// clock (skew between machines) counts as now. `None` for the other alignments, and as
    /// Flink's `isTimeoutable` says: for a savepoint, a timeout of 0 and Flink's "no timeout"
    /// (`Long.MAX_VALUE`).
    pub fn alignment_deadline(&self, now: Instant) -> Option<Instant> {
        let timeout_ms = self.alignment_timeout_ms()?;
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
            });
        let elapsed = u64::try_from(now_ms.saturating_sub(self.timestamp)).unwrap_or(0);
        Some(now + Duration::from_millis(timeout_ms.saturating_sub(elapsed)))
    }

    /// The alignment timeout this barrier carries, if its alignment can time out (see
    /// [`alignment_deadline`](Self::alignment_deadline)); reads no clock.
    pub fn alignment_timeout_ms(&self) -> Option<u64> {
        let Alignment::AlignedWithTimeout { timeout_ms } = self.alignment else {
            return None;
        };
        let times_out = self.kind != CheckpointKind::Savepoint
            && timeout_ms != 0
            && timeout_ms < i64::MAX as u64;
        times_out.then_some(timeout_ms)
    }

    /// The same barrier, unaligned: what an alignment that timed out turns it into.
    pub fn as_unaligned(&self) -> CheckpointBarrier {
        CheckpointBarrier {
            alignment: Alignment::Unaligned,
            ..*self
        }
    }
}

/// Checkpoint or savepoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CheckpointKind {
    /// A regular checkpoint.
    Checkpoint,
    /// A savepoint (always aligned in Flink).
    Savepoint,
}

/// How a barrier is aligned at the consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Alignment {
    /// Blocks each channel until the barrier arrived on all (exactly once, aligned).
    Aligned,
    /// Overtakes in-flight data, which is persisted with the checkpoint.
    Unaligned,
    /// Flink's aligned barrier with an alignment timeout
    /// (`execution.checkpointing.aligned-checkpoint-timeout`), carried on the wire as
    /// `TimeoutableAlignedCheckpointBarrier`. A consumer with unaligned checkpoints on
    /// ([`AlignmentMode::Unaligned`](crate::gate::AlignmentMode::Unaligned)) aligns it until
    /// `timeout_ms` after the checkpoint started (the barrier's timestamp), then turns the
    /// checkpoint unaligned. The producer, at the same deadline, sends the barrier's unaligned
    /// copy ahead of the data queued before it where its reader has not taken it
    /// ([`ResultPartition::aligned_barrier_timeout`](crate::partition::ResultPartition::aligned_barrier_timeout)).
    /// Flink also moves it ahead of what the receiving channel holds (after announcing it);
    /// here that data is read and persisted up to the barrier. As in Flink, where the timeout
    /// is an option of unaligned checkpoints, only consumers with unaligned checkpoints on
    /// may be sent such barriers: the producer may send them unaligned.
    AlignedWithTimeout {
        /// Alignment time after which Flink turns the barrier unaligned, in milliseconds.
        timeout_ms: u64,
    },
    /// Unaligned requested but forced aligned (e.g. point-wise connections).
    ForcedAligned,
}

/// A checkpoint barrier (Flink's `CheckpointBarrier` with its `CheckpointOptions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckpointBarrier {
    /// Checkpoint id.
    pub id: u64,
    /// When the checkpoint was triggered (ms since the epoch, as given by the coordinator).
    pub timestamp: i64,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// How it aligns.
    pub alignment: Alignment,
}

/// What the producer does at end of data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StopMode {
    /// Drain: process everything, fire timers.
    Drain,
    /// Stop without draining.
    NoDrain,
}

/// An event travelling in-band with the records.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The subpartition ends; nothing follows.
    EndOfPartition,
    /// A checkpoint barrier.
    CheckpointBarrier(CheckpointBarrier),
    /// The checkpoint with this id was aborted.
    CancelCheckpointMarker(u64),
    /// No more records will come (FLIP-147); events may still follow.
    EndOfData(StopMode),
    /// Recovered channel state was fully sent.
    EndOfChannelState,
    /// A user task event (opaque bytes).
    Task(Vec<u8>),
}

const TAG_END_OF_PARTITION: u8 = 0;
const TAG_CHECKPOINT_BARRIER: u8 = 1;
const TAG_CANCEL_CHECKPOINT: u8 = 2;
const TAG_END_OF_DATA: u8 = 3;
const TAG_END_OF_CHANNEL_STATE: u8 = 4;
const TAG_TASK: u8 = 5;

impl Event {
    /// The buffer data type this event travels as (Flink's `getDataType(event, hasPriority)`).
    pub fn data_type(&self, priority: bool) -> DataType {
        if priority {
            return DataType::PrioritizedEventBuffer;
        }
        match self {
            Event::CheckpointBarrier(barrier) => match barrier.alignment {
                Alignment::Aligned | Alignment::ForcedAligned => DataType::AlignedCheckpointBarrier,
                Alignment::AlignedWithTimeout { .. } => {
                    DataType::TimeoutableAlignedCheckpointBarrier
                }
                Alignment::Unaligned => DataType::EventBuffer,
            },
            Event::EndOfChannelState => DataType::RecoveryCompletion,
            _ => DataType::EventBuffer,
        }
    }

    /// Whether the event may overtake queued data as a priority event: an unaligned barrier,
    /// a cancel marker (Flink sends it with priority when checkpoints are unaligned), a task's
    /// own event. Not an aligned barrier, which must block its channel behind the data before
    /// it, nor an event that ends the channel's data or its recovered state: overtaking, it
    /// would end the channel with its data still queued (dropped, or left out of an unaligned
    /// checkpoint), or resume channels while recovered data is still to come.
    pub fn may_overtake_data(&self) -> bool {
        match self {
            Event::CheckpointBarrier(barrier) => barrier.alignment == Alignment::Unaligned,
            Event::CancelCheckpointMarker(_) | Event::Task(_) => true,
            Event::EndOfPartition | Event::EndOfData(_) | Event::EndOfChannelState => false,
        }
    }

    /// Checks that the event came as the writer sends it, in a buffer of `data_type`: a barrier
    /// that blocks its channel must say it is aligned, and one that overtook data that it is
    /// unaligned, or a consumer's alignment would wait for a channel that never blocked, or
    /// never resume one that did; only an event that may overtake data comes as a priority
    /// one ([`may_overtake_data`](Self::may_overtake_data)).
    pub fn check_buffer_type(&self, data_type: crate::buffer::DataType) -> Result<(), EventError> {
        let priority = data_type.has_priority();
        if self.data_type(priority) != data_type || (priority && !self.may_overtake_data()) {
            return Err(EventError::WrongBufferType {
                event: self.name(),
                data_type,
            });
        }
        Ok(())
    }

    /// The event's name, for errors.
    fn name(&self) -> &'static str {
        match self {
            Event::EndOfPartition => "EndOfPartition",
            Event::CheckpointBarrier(_) => "CheckpointBarrier",
            Event::CancelCheckpointMarker(_) => "CancelCheckpointMarker",
            Event::EndOfData(_) => "EndOfData",
            Event::EndOfChannelState => "EndOfChannelState",
            Event::Task(_) => "Task",
        }
    }

    /// Bytes [`encode`](Self::encode) writes.
    pub fn encoded_len(&self) -> usize {
        1 + match self {
            Event::EndOfPartition | Event::EndOfChannelState => 0,
            Event::CheckpointBarrier(b) => {
                18 + usize::from(matches!(b.alignment, Alignment::AlignedWithTimeout { .. })) * 8
            }
            Event::CancelCheckpointMarker(_) => 8,
            Event::EndOfData(_) => 1,
            Event::Task(bytes) => 4 + bytes.len(),
        }
    }

    /// Appends the event's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_with(&mut |bytes| out.extend_from_slice(bytes));
    }

    /// Writes the event as the whole content of a fresh builder and finishes it.
    pub fn write_to(&self, builder: &mut BufferBuilder) -> Result<(), EventError> {
        let len = self.encoded_len();
        if len > builder.remaining() {
            return Err(EventError::TooLarge(len));
        }
        self.encode_with(&mut |bytes| {
            builder.append(bytes);
        });
        builder.finish();
        Ok(())
    }

    /// The one place the layout is written: field by field into `put`.
    fn encode_with(&self, put: &mut impl FnMut(&[u8])) {
        match self {
            Event::EndOfPartition => put(&[TAG_END_OF_PARTITION]),
            Event::CheckpointBarrier(b) => {
                put(&[TAG_CHECKPOINT_BARRIER]);
                put(&b.id.to_be_bytes());
                put(&b.timestamp.to_be_bytes());
                put(&[match b.kind {
                    CheckpointKind::Checkpoint => 0,
                    CheckpointKind::Savepoint => 1,
                }]);
                match b.alignment {
                    Alignment::Aligned => put(&[0]),
                    Alignment::Unaligned => put(&[1]),
                    Alignment::AlignedWithTimeout { timeout_ms } => {
                        put(&[2]);
                        put(&timeout_ms.to_be_bytes());
                    }
                    Alignment::ForcedAligned => put(&[3]),
                }
            }
            Event::CancelCheckpointMarker(id) => {
                put(&[TAG_CANCEL_CHECKPOINT]);
                put(&id.to_be_bytes());
            }
            Event::EndOfData(mode) => put(&[
                TAG_END_OF_DATA,
                match mode {
                    StopMode::Drain => 0,
                    StopMode::NoDrain => 1,
                },
            ]),
            Event::EndOfChannelState => put(&[TAG_END_OF_CHANNEL_STATE]),
            Event::Task(bytes) => {
                put(&[TAG_TASK]);
                put(&(bytes.len() as u32).to_be_bytes());
                put(bytes);
            }
        }
    }

    /// Decodes an event; any malformed input is an [`EventError`].
    pub fn decode(bytes: &[u8]) -> Result<Event, EventError> {
        let (&tag, body) = bytes.split_first().ok_or(EventError::Empty)?;
        let mut reader = Reader { body, name: "" };
        let event = match tag {
            TAG_END_OF_PARTITION => Event::EndOfPartition,
            TAG_CHECKPOINT_BARRIER => {
                reader.name = "checkpoint barrier";
                let id = reader.u64()?;
                let timestamp = reader.u64()? as i64;
                let kind = match reader.u8()? {
                    0 => CheckpointKind::Checkpoint,
                    1 => CheckpointKind::Savepoint,
                    other => {
                        return Err(EventError::InvalidField {
                            field: "checkpoint kind",
                            value: other.into(),
                        })
                    }
                };
                let alignment = match reader.u8()? {
                    0 => Alignment::Aligned,
                    1 => Alignment::Unaligned,
                    2 => Alignment::AlignedWithTimeout {
                        timeout_ms: reader.u64()?,
                    },
                    3 => Alignment::ForcedAligned,
                    other => {
                        return Err(EventError::InvalidField {
                            field: "barrier alignment",
                            value: other.into(),
                        })
                    }
                };
                let barrier = CheckpointBarrier {
                    id,
                    timestamp,
                    kind,
                    alignment,
                };
                barrier.validate()?;
                Event::CheckpointBarrier(barrier)
            }
            TAG_CANCEL_CHECKPOINT => {
                reader.name = "cancel checkpoint marker";
                Event::CancelCheckpointMarker(reader.u64()?)
            }
            TAG_END_OF_DATA => {
                reader.name = "end of data";
                Event::EndOfData(match reader.u8()? {
                    0 => StopMode::Drain,
                    1 => StopMode::NoDrain,
                    other => {
                        return Err(EventError::InvalidField {
                            field: "stop mode",
                            value: other.into(),
                        })
                    }
                })
            }
            TAG_END_OF_CHANNEL_STATE => Event::EndOfChannelState,
            TAG_TASK => {
                reader.name = "task";
                let len = reader.u32()? as usize;
                Event::Task(reader.take(len)?.to_vec())
            }
            other => return Err(EventError::UnknownTag(other)),
        };
        if !reader.body.is_empty() {
            return Err(EventError::Trailing(reader.body.len()));
        }
        Ok(event)
    }
}

struct Reader<'a> {
    body: &'a [u8],
    name: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EventError> {
        if self.body.len() < n {
            return Err(EventError::Truncated(self.name));
        }
        let (head, tail) = self.body.split_at(n);
        self.body = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, EventError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, EventError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, EventError> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}
