//! Records on the wire: `[length | record bytes]`, written straight into the segments of
//! [`BufferBuilder`]s and continued in the next segment when a record does not fit (Flink's
//! record layout, without its intermediate serialization buffer).
//!
//! The length is an unsigned LEB128 varint of at most [`MAX_LENGTH_PREFIX`] bytes, not Flink's
//! fixed 4-byte int: for the small records a shuffle mostly carries, the prefix is most of the
//! framing every byte of which the kernel copies twice on the way — an 8-byte record moves as
//! 9 bytes instead of 12, and a 1 KiB record as 1026 instead of 1028.
//!
//! Records are bytes at this layer. A user type implements [`Record`] to write itself into the
//! segment directly, without an intermediate `Vec`.

mod deserializer;

pub use deserializer::{RecordDeserializer, SpanningBudget, WholeRecords};

use crate::buffer::BufferBuilder;

/// Most bytes of the length prefix before a record (a `u32` as LEB128).
pub const MAX_LENGTH_PREFIX: usize = 5;

/// Bytes of the length prefix before a record of `len` bytes.
#[inline]
pub const fn prefix_len(len: usize) -> usize {
    1 + (len >= 1 << 7) as usize
        + (len >= 1 << 14) as usize
        + (len >= 1 << 21) as usize
        + (len >= 1 << 28) as usize
}

/// Bytes a record of `len` bytes takes in a segment, prefix included.
#[inline]
pub const fn framed_len(len: usize) -> usize {
    prefix_len(len) + len
}

/// Writes the length prefix of a record of `len` (≤ `u32::MAX`) bytes into `out`; returns the
/// bytes used.
#[inline]
pub fn encode_prefix(len: u32, out: &mut [u8; MAX_LENGTH_PREFIX]) -> usize {
    let mut value = len;
    let mut used = 0;
    // Bounded: a u32 has five 7-bit groups.
    while value >= 0x80 {
        out[used] = (value as u8) | 0x80;
        value >>= 7;
        used += 1;
    }
    out[used] = value as u8;
    used + 1
}

/// What the bytes at the start of a record say about its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefix {
    /// The record has `len` bytes, after a prefix of `size` bytes.
    Complete { len: usize, size: usize },
    /// The prefix goes on past these bytes.
    Incomplete,
    /// No `u32` is written like this (more than five bytes, or bits above 32).
    Malformed,
}

/// Decodes a length prefix from the start of `bytes`.
#[inline]
pub fn decode_prefix(bytes: &[u8]) -> Prefix {
    let mut len: u64 = 0;
    for (i, &byte) in bytes.iter().take(MAX_LENGTH_PREFIX).enumerate() {
        len |= u64::from(byte & 0x7F) << (7 * i);
        if byte < 0x80 {
            return if len > u64::from(u32::MAX) {
                Prefix::Malformed
            } else {
                Prefix::Complete {
                    len: len as usize,
                    size: i + 1,
                }
            };
        }
    }
    if bytes.len() >= MAX_LENGTH_PREFIX {
        Prefix::Malformed
    } else {
        Prefix::Incomplete
    }
}

/// Why a record could not be written or read.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    /// Records spanning buffers, assembled at once on a reader's channels, would hold more
    /// of its memory than its [`SpanningBudget`] (a hostile or runaway peer: each may claim
    /// up to the maximum record size).
    #[error(
        "records spanning buffers would hold {needed} more bytes of this reader's memory, \
         {used} of {limit} held"
    )]
    SpanningMemory {
        /// Bytes the growth asked for.
        needed: usize,
        /// Bytes held already.
        used: usize,
        /// The budget.
        limit: usize,
    },
    /// A record is longer than the configured maximum (writer: caller's fault; reader: a
    /// corrupt or hostile stream).
    #[error("record of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// The record's (claimed) length.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A [`Record`] wrote a different number of bytes than its `encoded_len` said (a bug in
    /// that impl). An excess is refused. A partition's writer reads nothing of it as a
    /// record: it is taken back, or, once part of it was published, the partition ends its
    /// stream ([`SegmentSink::abandon`]: it is released). A sink that can do neither gets it
    /// padded with zeros to its declared length, so the records after it stay framed.
    #[error("record declared {declared} bytes but wrote {written}")]
    LengthMismatch {
        /// What `encoded_len` returned.
        declared: usize,
        /// What `encode` wrote (at least).
        written: usize,
    },
    /// A new buffer was given to the deserializer before the previous one was read to its end.
    #[error("the previous buffer still holds unread bytes")]
    BufferNotConsumed,
    /// A length prefix no `u32` is written as (a corrupt or hostile stream).
    #[error("malformed record length prefix")]
    MalformedLength,
    /// The stream ended in the middle of a record.
    #[error("the stream ended inside a record")]
    Truncated,
    /// No segment could be obtained for the record (the pool was destroyed or timed out).
    #[error("no buffer for the record: {0}")]
    Pool(#[from] crate::buffer::PoolError),
    /// The destination was released while the record was being written (a partition whose
    /// consumer went away); the writer reports it as the partition's release.
    #[error("the destination was released")]
    Released,
}

/// Where serialized bytes go: the current builder of a subpartition, or a new one once the
/// current is full.
pub trait SegmentSink {
    /// A builder with room for at least one byte: the current one, or a fresh one (finishing
    /// and publishing the full one) when the current is full or missing.
    ///
    /// An error ends the record being written as an `encode` failing would: it is taken back
    /// ([`discard_uncommitted`](Self::discard_uncommitted)), or its stream is ended
    /// ([`abandon`](Self::abandon)) once part of it was published, or else it is framed to
    /// its declared length (the rest of its length prefix, then zeros), which asks this
    /// method again; a sink that fails then too leaves its stream misframed, so a sink whose
    /// `writable` can fail should implement `abandon`.
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError>;

    /// The record is complete: publish it to consumers.
    fn commit(&mut self);

    /// The current builder if it has room for `bytes` more (the fast path: a record that fits
    /// is written without asking for a builder per piece).
    fn current_with_room(&mut self, _bytes: usize) -> Option<&mut BufferBuilder> {
        None
    }

    /// Drops the bytes written since the last [`commit`](Self::commit), when they all lie in
    /// the current builder (a record whose `encode` failed before it crossed into another
    /// segment); returns whether it did. A sink that cannot returns false, and the record is
    /// then padded to its declared length instead, so the records after it stay readable.
    fn discard_uncommitted(&mut self) -> bool {
        false
    }

    /// The record being written failed after part of it was published (it crossed into
    /// another segment), so it can no longer be taken back: ends the stream the sink feeds,
    /// so no reader takes what is left as a record (Flink fails the task, which releases its
    /// partitions). Returns whether it did. A sink that cannot has the record padded to its
    /// declared length and committed instead, so the records after it stay framed.
    fn abandon(&mut self) -> bool {
        false
    }
}

/// A sink that is one builder known to have room for the whole record.
struct RoomyBuilder<'a>(&'a mut BufferBuilder);

impl SegmentSink for RoomyBuilder<'_> {
    #[inline]
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        Ok(self.0)
    }

    #[inline]
    fn commit(&mut self) {
        self.0.commit();
    }

    fn discard_uncommitted(&mut self) -> bool {
        self.0.discard_uncommitted();
        true
    }
}

/// A value that can write itself as record bytes.
pub trait Record {
    /// Exactly how many bytes [`encode`](Record::encode) writes.
    fn encoded_len(&self) -> usize;

    /// Writes the record's bytes.
    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError>;

    /// The record's bytes when it already is one contiguous byte string: then a record that
    /// fits the current segment is written with one bounds check and one copy.
    fn as_contiguous(&self) -> Option<&[u8]> {
        None
    }
}

/// The writing side handed to [`Record::encode`]: bytes go straight into segments.
#[derive(Debug)]
pub struct RecordOutput<'a, S> {
    sink: &'a mut S,
    /// The record's declared length (its `encoded_len`, without the length prefix).
    declared: usize,
    /// Bytes still to write, the length prefix's included.
    remaining: usize,
    /// The builder filled up under this record; the next `writable` finishes and publishes
    /// it. Until then the record can still be taken back.
    filled: bool,
    /// A builder holding part of this record was published: it can no longer be taken back.
    crossed: bool,
    /// What the sink's `writable` failed with: every later write of this record fails with it
    /// without asking the sink again, so an `encode` that goes on past an error cannot leave a
    /// gap in the record's bytes.
    sink_error: Option<RecordError>,
}

impl<S: SegmentSink> RecordOutput<'_, S> {
    /// Appends bytes, continuing into new segments as needed.
    #[inline]
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), RecordError> {
        if bytes.len() > self.remaining {
            // Past the prefix (which always fits): the record's own bytes, in all.
            return Err(RecordError::LengthMismatch {
                declared: self.declared,
                written: (self.declared - self.remaining) + bytes.len(),
            });
        }
        if let Some(error) = &self.sink_error {
            return Err(error.clone());
        }
        while !bytes.is_empty() {
            // A full builder is finished (published, uncommitted bytes and all) by this
            // `writable`.
            self.crossed |= self.filled;
            let builder = match self.sink.writable() {
                Ok(builder) => builder,
                Err(error) => {
                    self.sink_error = Some(error.clone());
                    return Err(error);
                }
            };
            let n = builder.append(bytes);
            // Counted as written only once in a segment: after a failed `writable` what is
            // left to write is what the record lacks, and its end is framed from that.
            self.remaining -= n;
            bytes = &bytes[n..];
            self.filled = builder.remaining() == 0;
        }
        Ok(())
    }

    /// Bytes still to write.
    pub fn remaining(&self) -> usize {
        self.remaining
    }
}

/// Writes `record` with its length prefix into `sink`.
#[inline]
pub fn serialize<R, S>(record: &R, sink: &mut S, max_record_bytes: usize) -> Result<(), RecordError>
where
    R: Record + ?Sized,
    S: SegmentSink,
{
    let len = record.encoded_len();
    if len > max_record_bytes || len > u32::MAX as usize {
        return Err(RecordError::TooLarge {
            len,
            max: max_record_bytes,
        });
    }
    if let Some(builder) = sink.current_with_room(framed_len(len)) {
        // Only bytes of the declared length: the room was checked for that (a type whose two
        // lengths disagree goes through `encode`, which refuses the difference).
        if let Some(bytes) = record.as_contiguous().filter(|bytes| bytes.len() == len) {
            builder.append_framed(bytes);
            return Ok(());
        }
        return write_record(record, len, &mut RoomyBuilder(builder));
    }
    write_record(record, len, sink)
}

/// Writes the prefix and the record's bytes through `sink`, keeping the framing intact when
/// the record's `encode` misbehaves.
#[inline]
fn write_record<R, S>(record: &R, len: usize, sink: &mut S) -> Result<(), RecordError>
where
    R: Record + ?Sized,
    S: SegmentSink,
{
    let mut prefix = [0; MAX_LENGTH_PREFIX];
    let prefix_bytes = encode_prefix(len as u32, &mut prefix);
    let mut out = RecordOutput {
        sink,
        declared: len,
        remaining: prefix_bytes + len,
        filled: false,
        crossed: false,
        sink_error: None,
    };
    // `encode` is the caller's code. If it panics (and the caller catches the unwind and
    // writes on), the record is ended as a failed one is, before the panic goes on: taken
    // back, or its stream abandoned (padded, for a sink that cannot) once part of it was
    // published, so the bytes it left are not published with the next record. (Costs
    // nothing unless it panics.) A prefix the sink failed to take is such a record too:
    // part of it may have been published with a full segment.
    let (encoded, panic) = match out.write(&prefix[..prefix_bytes]) {
        Err(error) => (Err(error), None),
        Ok(()) => {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| record.encode(&mut out)))
            {
                Ok(encoded) => (encoded, None),
                Err(panic) => (Ok(()), Some(panic)),
            }
        }
    };
    // The sink's own failure is the record's error, also when `encode` swallowed it.
    let encoded = match out.sink_error.take() {
        Some(error) => Err(error),
        None => encoded,
    };
    let resume = |panic: Option<Box<dyn std::any::Any + Send>>| {
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
    };
    let short = out.remaining;
    // A record that failed to encode is taken back while no part of it was published (as
    // Flink, which serializes into a separate buffer first, sends nothing of it).
    let failed = encoded.is_err() || short > 0 || panic.is_some();
    if failed && !out.crossed && out.sink.discard_uncommitted() {
        resume(panic);
        encoded?;
        return Err(RecordError::LengthMismatch {
            declared: len,
            written: len - short,
        });
    }
    if failed && out.crossed && out.sink.abandon() {
        resume(panic);
        encoded?;
        return Err(RecordError::LengthMismatch {
            declared: len,
            written: len - short,
        });
    }
    if short > 0 {
        // Keep the framing intact for the records after this one: the rest of a prefix the
        // sink failed inside, then zeros for the record's missing bytes. A sink failing again
        // here leaves its stream misframed (one that can fail implements `abandon`).
        const ZEROS: [u8; 256] = [0; 256];
        let prefix_left = out.remaining.saturating_sub(len);
        let mut padded = out.write(&prefix[prefix_bytes - prefix_left..prefix_bytes]);
        while padded.is_ok() && out.remaining > 0 {
            let n = out.remaining.min(ZEROS.len());
            padded = out.write(&ZEROS[..n]);
        }
        if let Err(error) = padded {
            resume(panic);
            return Err(encoded.err().unwrap_or(error));
        }
    }
    sink.commit();
    resume(panic);
    encoded?;
    if short > 0 {
        return Err(RecordError::LengthMismatch {
            declared: len,
            written: len - short,
        });
    }
    Ok(())
}

impl Record for [u8] {
    fn encoded_len(&self) -> usize {
        self.len()
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        Some(self)
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(self)
    }
}

impl<const N: usize> Record for [u8; N] {
    fn encoded_len(&self) -> usize {
        N
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        Some(self)
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(self)
    }
}

impl Record for Vec<u8> {
    fn encoded_len(&self) -> usize {
        self.len()
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        Some(self)
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(self)
    }
}

impl Record for str {
    fn encoded_len(&self) -> usize {
        self.len()
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        Some(self.as_bytes())
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(self.as_bytes())
    }
}

impl Record for u64 {
    fn encoded_len(&self) -> usize {
        8
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(&self.to_be_bytes())
    }
}

impl<R: Record + ?Sized> Record for &R {
    fn encoded_len(&self) -> usize {
        (**self).encoded_len()
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        (**self).as_contiguous()
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        (**self).encode(out)
    }
}
