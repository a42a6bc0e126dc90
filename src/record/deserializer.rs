//! Reading records back out of a channel's buffers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{decode_prefix, encode_prefix, Prefix, RecordError, MAX_LENGTH_PREFIX};
use crate::buffer::{prefetch_for_read, Buffer};

/// Scratch capacity a deserializer keeps between spanning records.
const SCRATCH_KEPT: usize = 64 * 1024;

/// Buffers in a row with no record spanning into them after which a larger scratch is given
/// back: large records each spanning buffers (their last piece ending a buffer, as a flush
/// after every record leaves it) start buffers clean one at a time, and must not free and
/// regrow the scratch per record.
const CLEAN_BUFFERS_BEFORE_SHRINK: u32 = 64;

/// The heap that records spanning buffers may hold beyond each deserializer's first 64 KiB,
/// shared by the deserializers of one reader (its channels): a peer sending huge records on
/// many channels at once cannot make a consumer hold `max-record-bytes` per channel outside
/// the network memory (Flink spills records over 5 MiB to disk instead). Only the reader's
/// thread charges it; atomics keep the reader `Send`.
#[derive(Debug)]
pub struct SpanningBudget {
    limit: usize,
    used: AtomicUsize,
}

impl SpanningBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The budget's size.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A reader's budget unless told otherwise: four records of the maximum size, and at
    /// least 256 MiB.
    pub fn default_limit(max_record_bytes: usize) -> usize {
        max_record_bytes.saturating_mul(4).max(256 << 20)
    }

    /// Charges `bytes` if they fit (at once: readers on other threads may share it).
    fn try_charge(&self, bytes: usize) -> Result<(), RecordError> {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .map(drop)
            .map_err(|used| RecordError::SpanningMemory {
                needed: bytes,
                used,
                limit: self.limit,
            })
    }

    fn charge(&self, bytes: usize) {
        self.used.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Never below zero, whatever a caller did: a wrapped count would refuse for good.
    fn release(&self, bytes: usize) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                Some(used.saturating_sub(bytes))
            });
    }
}

/// Turns a channel's data buffers back into records (Flink's
/// `SpillingAdaptiveSpanningRecordDeserializer`, without the spilling).
///
/// A record that lies inside one buffer is returned as a slice of that buffer, without a copy.
/// Only a record that spans buffers is assembled, into a scratch vector reused for the next
/// one; it grows (by doubling) only as the record's bytes arrive, so a corrupt length cannot
/// make it allocate more than twice what was received (and never more than
/// `max_record_bytes`), and it shrinks back to 64 KiB when a smaller spanning record follows a
/// large one, after 64 buffers in a row with no record spanning into them, and on
/// `clear`/`finish`: a channel that once carried a huge record does not keep its memory for
/// good.
#[derive(Debug)]
pub struct RecordDeserializer {
    buffer: Option<Buffer>,
    position: usize,
    /// Length-prefix bytes gathered so far when the prefix itself spans buffers.
    prefix: [u8; MAX_LENGTH_PREFIX],
    prefix_len: usize,
    /// Length of the record being assembled in `scratch`, if any.
    spanning: Option<usize>,
    scratch: Vec<u8>,
    /// Where the scratch beyond `SCRATCH_KEPT` is charged, if anywhere.
    budget: Option<Arc<SpanningBudget>>,
    /// What the scratch is charged to the budget now.
    charged: usize,
    /// Buffers in a row that began with no record spanning into them.
    clean_buffers: u32,
    /// Where the record found by the last successful `advance` lies.
    current: Option<Location>,
    max_record_bytes: usize,
    /// The stream's framing was refused (a malformed or too long length): every later read
    /// fails with this, holding no buffer. The bytes after a refused length cannot be told
    /// apart from a record's, so nothing after it is read.
    failed: Option<RecordError>,
}

/// Where a complete record lies.
#[derive(Clone, Copy, Debug)]
enum Location {
    /// `start..start + len` of the current buffer.
    Buffer { start: usize, len: usize },
    /// The whole scratch vector (a record that spanned buffers).
    Scratch,
}

/// Where the record at `at` of `bytes` lies, `(start, len)`, when its length prefix and its
/// bytes are whole in `bytes` and it is within `max_record_bytes`; `None` for everything
/// else (a buffer's end, a record spanning on, a prefix to refuse or to gather), which the
/// general read handles.
#[inline(always)]
fn whole_record_at(bytes: &[u8], at: usize, max_record_bytes: usize) -> Option<(usize, usize)> {
    let first = *bytes.get(at)?;
    // One prefix byte for every record under 128 bytes: no decoding loop for them.
    let (start, len) = if first < 0x80 {
        (at + 1, usize::from(first))
    } else {
        longer_prefix_at(bytes, at)?
    };
    // The prefix ends inside `bytes`, so `start` is at most its length.
    (len <= max_record_bytes && bytes.len() - start >= len).then_some((start, len))
}

/// [`whole_record_at`] for a prefix of two bytes or more: where the record starts and its
/// length, if the prefix is whole in `bytes` and well formed.
#[inline(never)]
fn longer_prefix_at(bytes: &[u8], at: usize) -> Option<(usize, usize)> {
    match decode_prefix(bytes.get(at..)?) {
        Prefix::Complete { len, size } => Some((at + size, len)),
        Prefix::Incomplete | Prefix::Malformed => None,
    }
}

/// The records lying whole in a deserializer's current buffer
/// ([`RecordDeserializer::whole_records`]).
#[derive(Debug)]
pub struct WholeRecords<'a> {
    bytes: &'a [u8],
    /// The read position, kept here while the loop runs and stored back after each record.
    at: usize,
    position: &'a mut usize,
    max_record_bytes: usize,
}

impl<'a> Iterator for WholeRecords<'a> {
    type Item = &'a [u8];

    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        let (start, len) = whole_record_at(self.bytes, self.at, self.max_record_bytes)?;
        prefetch_for_read(self.bytes.as_ptr(), start, self.bytes.len(), len);
        self.at = start + len;
        *self.position = self.at;
        self.bytes.get(start..self.at)
    }
}

impl RecordDeserializer {
    /// A deserializer refusing records longer than `max_record_bytes`.
    pub fn new(max_record_bytes: usize) -> Self {
        Self {
            buffer: None,
            position: 0,
            prefix: [0; MAX_LENGTH_PREFIX],
            prefix_len: 0,
            spanning: None,
            scratch: Vec::new(),
            budget: None,
            charged: 0,
            clean_buffers: 0,
            failed: None,
            current: None,
            max_record_bytes,
        }
    }

    /// Charges the scratch this deserializer holds beyond 64 KiB to `budget`, shared with the
    /// other channels' deserializers of a reader: a growth past it fails the read with
    /// [`RecordError::SpanningMemory`].
    pub fn with_budget(mut self, budget: Arc<SpanningBudget>) -> Self {
        if let Some(previous) = self.budget.take() {
            previous.release(self.charged);
        }
        self.charged = 0;
        self.budget = Some(budget);
        self.recharge();
        self
    }

    /// [`advance`](Self::advance) of `deserializers[channel]`, one of a reader's channels
    /// sharing a budget: refused memory, the channel first takes back what the others keep
    /// from records already read ([`give_back_idle_scratch`](Self::give_back_idle_scratch)),
    /// so only records assembled at once count.
    pub fn advance_among(deserializers: &mut [Self], channel: usize) -> Result<bool, RecordError> {
        match deserializers[channel].advance() {
            Err(RecordError::SpanningMemory { .. }) => {
                deserializers
                    .iter_mut()
                    .for_each(Self::give_back_idle_scratch);
                deserializers[channel].advance()
            }
            found => found,
        }
    }

    /// Gives back the scratch beyond 64 KiB kept from a record already read, when no record
    /// is being assembled (what a reader does for its other channels when one is refused
    /// memory: a finished record's scratch stays until the channel's next spanning record
    /// or 64 clean buffers otherwise).
    pub fn give_back_idle_scratch(&mut self) {
        if self.spanning.is_none()
            && self.prefix_len == 0
            && self.scratch.capacity() > SCRATCH_KEPT
            && !matches!(self.current, Some(Location::Scratch))
        {
            self.scratch.clear();
            self.scratch.shrink_to(SCRATCH_KEPT);
            self.recharge();
        }
    }

    /// What the scratch beyond 64 KiB counts against the budget.
    fn chargeable(capacity: usize) -> usize {
        capacity.saturating_sub(SCRATCH_KEPT)
    }

    /// Brings the budget's charge in line with the scratch's capacity after it changed.
    fn recharge(&mut self) {
        Self::recharge_for(&self.budget, self.scratch.capacity(), &mut self.charged);
    }

    /// [`recharge`](Self::recharge) by fields (while a buffer is borrowed).
    fn recharge_for(budget: &Option<Arc<SpanningBudget>>, capacity: usize, charged: &mut usize) {
        let Some(budget) = budget else {
            return;
        };
        let now = Self::chargeable(capacity);
        if now > *charged {
            // Allocators may round a reservation up: what was checked before it is charged,
            // the rounding too, past the limit if need be.
            budget.charge(now - *charged);
        } else {
            budget.release(*charged - now);
        }
        *charged = now;
    }

    /// Hands over the channel's next data buffer. The previous one must have been read to its
    /// end ([`next_record`](Self::next_record) returned `Ok(None)`).
    pub fn set_next_buffer(&mut self, buffer: Buffer) -> Result<(), RecordError> {
        if let Some(error) = &self.failed {
            // Dropped here: its segment goes back to its pool at once.
            drop(buffer);
            return Err(error.clone());
        }
        if self.buffer.is_some() {
            return Err(RecordError::BufferNotConsumed);
        }
        // Once per buffer, not per record. Nothing spans into a clean buffer, so the scratch
        // holds no record still to be read then.
        if self.spanning.is_some() || self.prefix_len != 0 {
            self.clean_buffers = 0;
        } else {
            self.clean_buffers = self.clean_buffers.saturating_add(1);
            if self.clean_buffers >= CLEAN_BUFFERS_BEFORE_SHRINK {
                self.give_back_idle_scratch();
            }
        }
        self.buffer = Some(buffer);
        self.position = 0;
        Ok(())
    }

    /// Heap bytes held for assembling records that span buffers: what the largest recent one
    /// needed, kept for the next until 64 buffers in a row need none (or the next such record
    /// starts, or the reader is cleared); see the type's documentation.
    pub fn held_bytes(&self) -> usize {
        self.scratch.capacity()
    }

    /// The next complete record, or `Ok(None)` when the current buffer is used up (it is then
    /// released) and the next one is needed.
    pub fn next_record(&mut self) -> Result<Option<&[u8]>, RecordError> {
        Ok(if self.advance()? {
            Some(self.current_record())
        } else {
            None
        })
    }

    /// Moves to the next record when it lies whole in the current buffer — the common case,
    /// small enough to inline into a reader's loop — and returns true; false means "call
    /// [`advance`](Self::advance)": no buffer, its end, a record spanning buffers, or a length
    /// to refuse. Then read the record with [`current_record`](Self::current_record).
    #[inline]
    pub fn advance_within_buffer(&mut self) -> bool {
        if self.spanning.is_some() || self.prefix_len != 0 {
            return false;
        }
        let Some(buffer) = self.buffer.as_ref() else {
            return false;
        };
        let Some((start, len)) =
            whole_record_at(buffer.as_slice(), self.position, self.max_record_bytes)
        else {
            return false;
        };
        let bytes = buffer.as_slice();
        prefetch_for_read(bytes.as_ptr(), start, bytes.len(), len);
        self.position = start + len;
        self.current = Some(Location::Buffer { start, len });
        true
    }

    /// The records after the read position that lie whole in the current buffer, each a
    /// slice of it, read in one loop with the position kept in a register: for a reader
    /// that takes many small records at a time, the per-record cost of
    /// [`advance_within_buffer`](Self::advance_within_buffer) (a load of the position the
    /// last call stored) goes. The iterator stops where `advance_within_buffer` would
    /// return false; the position moves past each record handed out, so whatever the caller
    /// does with the iterator, [`advance`](Self::advance) goes on after the last one. It
    /// ends the record [`current_record`](Self::current_record) returned (empty after it).
    #[inline]
    pub fn whole_records(&mut self) -> WholeRecords<'_> {
        self.current = None;
        let bytes = match &self.buffer {
            Some(buffer) if self.spanning.is_none() && self.prefix_len == 0 => buffer.as_slice(),
            _ => &[],
        };
        WholeRecords {
            bytes,
            at: self.position,
            position: &mut self.position,
            max_record_bytes: self.max_record_bytes,
        }
    }

    /// Moves to the next complete record (then read it with
    /// [`current_record`](Self::current_record)); `Ok(false)` when the current buffer is used
    /// up (it is then released) and the next one is needed. The split from `next_record` lets
    /// a caller loop over channels without holding a borrow across iterations.
    pub fn advance(&mut self) -> Result<bool, RecordError> {
        self.current = None;
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let advanced = self.advance_framed();
        if let Err(error @ (RecordError::MalformedLength | RecordError::TooLarge { .. })) =
            &advanced
        {
            // The buffer and any partial record go now, not when the reader is dropped: a
            // pooled segment held by a stream that will never be read is credit (or a
            // producer's segment) gone for good.
            let error = error.clone();
            self.clear();
            self.failed = Some(error);
        }
        advanced
    }

    /// [`advance`](Self::advance) over a stream whose framing holds so far.
    fn advance_framed(&mut self) -> Result<bool, RecordError> {
        loop {
            let Some(buffer) = self.buffer.as_ref() else {
                return Ok(false);
            };
            let rest = &buffer.as_slice()[self.position..];
            if rest.is_empty() {
                self.buffer = None;
                return Ok(false);
            }
            if let Some(len) = self.spanning {
                let take = (len - self.scratch.len()).min(rest.len());
                let needed = self.scratch.len() + take;
                if needed > self.scratch.capacity() {
                    // Doubling, as `extend` would, but never past the record's length.
                    let grown = (self.scratch.capacity() * 2).clamp(needed, len);
                    if let Some(budget) = &self.budget {
                        // Refused before it is allocated; the record stays begun, and a
                        // later call may find room another channel gave back.
                        let more = Self::chargeable(grown).saturating_sub(self.charged);
                        budget.try_charge(more)?;
                        self.charged += more;
                    }
                    self.scratch.reserve_exact(grown - self.scratch.len());
                    Self::recharge_for(&self.budget, self.scratch.capacity(), &mut self.charged);
                }
                self.scratch.extend_from_slice(&rest[..take]);
                self.position += take;
                if self.scratch.len() == len {
                    self.spanning = None;
                    self.current = Some(Location::Scratch);
                    return Ok(true);
                }
                continue;
            }
            if self.prefix_len == 0 {
                match decode_prefix(rest) {
                    Prefix::Complete { len, size } => {
                        // The common case: the prefix is whole in this buffer.
                        let len = self.checked_len(len)?;
                        if rest.len() - size >= len {
                            let start = self.position + size;
                            self.position = start + len;
                            self.current = Some(Location::Buffer { start, len });
                            return Ok(true);
                        }
                        self.position += size;
                        self.begin_spanning(len);
                        continue;
                    }
                    Prefix::Malformed => return Err(RecordError::MalformedLength),
                    Prefix::Incomplete => {}
                }
            }
            // The prefix itself spans buffers: gather it until its last byte.
            let take = (MAX_LENGTH_PREFIX - self.prefix_len).min(rest.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&rest[..take]);
            match decode_prefix(&self.prefix[..self.prefix_len + take]) {
                Prefix::Incomplete => {
                    self.prefix_len += take;
                    self.position += take;
                }
                Prefix::Malformed => return Err(RecordError::MalformedLength),
                Prefix::Complete { len, size } => {
                    // Checked before the prefix is consumed: a refused length stays the error
                    // of every later call, instead of its record's bytes being read as the
                    // next prefixes.
                    let len = self.checked_len(len)?;
                    // Only the bytes up to the prefix's end belong to it.
                    self.position += size - self.prefix_len;
                    self.prefix_len = 0;
                    self.begin_spanning(len);
                    if len == 0 {
                        self.spanning = None;
                        self.current = Some(Location::Scratch);
                        return Ok(true);
                    }
                }
            }
        }
    }

    /// The record found by the last successful [`advance`](Self::advance); empty if none.
    #[inline]
    pub fn current_record(&self) -> &[u8] {
        match self.current {
            Some(Location::Buffer { start, len }) => match self.buffer.as_ref() {
                Some(buffer) => &buffer.as_slice()[start..start + len],
                None => &[],
            },
            Some(Location::Scratch) => &self.scratch,
            None => &[],
        }
    }

    /// True when bytes of the stream have not come out as records: a record begun and not
    /// ended, or the unread rest of the current buffer (checked when the channel ends, after
    /// the reader has read until `Ok(None)`: then only a truncated stream leaves any).
    pub fn has_partial_record(&self) -> bool {
        self.spanning.is_some()
            || self.prefix_len > 0
            || self
                .buffer
                .as_ref()
                .is_some_and(|b| b.len() > self.position)
    }

    /// Appends to `out` the bytes of the record begun and not finished, as they came on the
    /// wire (its length prefix, then what arrived of it), and the unread rest of the current
    /// buffer; false when there are none. What an unaligned checkpoint persists of the
    /// channel's reader (Flink's `getUnconsumedBuffer`): fed to a fresh deserializer before the
    /// channel's later buffers, they give the same records.
    pub fn unconsumed_bytes(&self, out: &mut Vec<u8>) -> bool {
        let start = out.len();
        if let Some(len) = self.spanning {
            let mut prefix = [0; MAX_LENGTH_PREFIX];
            let prefix_bytes = encode_prefix(len as u32, &mut prefix);
            out.extend_from_slice(&prefix[..prefix_bytes]);
            out.extend_from_slice(&self.scratch);
        } else {
            out.extend_from_slice(&self.prefix[..self.prefix_len]);
        }
        if let Some(buffer) = &self.buffer {
            out.extend_from_slice(&buffer.as_slice()[self.position..]);
        }
        out.len() > start
    }

    /// Ends the stream: fails with the error that refused its framing, if one did, or with
    /// [`RecordError::Truncated`] if bytes of it have not come out as records
    /// ([`Self::has_partial_record`]): a record begun and never finished, or a buffer not
    /// read to its end, whose records are dropped with it.
    pub fn finish(&mut self) -> Result<(), RecordError> {
        if let Some(error) = self.failed.take() {
            self.clear();
            return Err(error);
        }
        let partial = self.has_partial_record();
        self.clear();
        if partial {
            return Err(RecordError::Truncated);
        }
        Ok(())
    }

    /// Drops the current buffer and any partial record (channel released); a refused stream's
    /// error too, so the deserializer can read a new stream.
    pub fn clear(&mut self) {
        self.failed = None;
        self.current = None;
        self.buffer = None;
        self.position = 0;
        self.prefix_len = 0;
        self.spanning = None;
        self.scratch.clear();
        self.scratch.shrink_to(SCRATCH_KEPT);
        self.recharge();
    }

    fn checked_len(&self, len: usize) -> Result<usize, RecordError> {
        if len > self.max_record_bytes {
            return Err(RecordError::TooLarge {
                len,
                max: self.max_record_bytes,
            });
        }
        Ok(len)
    }

    fn begin_spanning(&mut self, len: usize) {
        self.scratch.clear();
        // A channel that once carried a huge record does not keep its memory for good.
        let keep = len.max(SCRATCH_KEPT);
        if self.scratch.capacity() > keep {
            self.scratch.shrink_to(keep);
            self.recharge();
        }
        self.spanning = Some(len);
    }
}

impl Drop for RecordDeserializer {
    fn drop(&mut self) {
        if let Some(budget) = &self.budget {
            budget.release(self.charged);
        }
    }
}
