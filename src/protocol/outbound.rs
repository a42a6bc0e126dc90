//! The bytes a connection has to write, in order, as ranges a driver can hand to one vectored
//! send: control frames (and BufferResponse headers that could not go in a segment's
//! headroom) from one reused byte vector, buffer payloads straight from their segments.

use std::collections::VecDeque;
use std::io::IoSlice;

use crate::buffer::{Buffer, HEADROOM};

/// Written control bytes kept before the vector is compacted.
const COMPACT_AT: usize = 64 * 1024;

/// One frame waiting to be written.
#[derive(Debug)]
enum OutFrame {
    /// `len` bytes of the control vector.
    Control { len: usize },
    /// A BufferResponse: `header_len` bytes of the control vector (0 when the header sits in
    /// the segment's headroom), then the buffer (with its headroom when `in_headroom`).
    Buffer {
        header_len: usize,
        buffer: Buffer,
        in_headroom: usize,
    },
}

impl OutFrame {
    fn len(&self) -> usize {
        match self {
            OutFrame::Control { len } => *len,
            OutFrame::Buffer {
                header_len,
                buffer,
                in_headroom,
            } => header_len + in_headroom + buffer.len(),
        }
    }
}

/// Frames queued for writing, and how far the first one was written.
///
/// Asynchronous writes (io_uring): between [`begin_write`](Self::begin_write) and the next
/// [`on_written`](Self::on_written) the kernel may read the buffers' segments the slices
/// pointed to, so those frames are not dropped before then, not even by
/// [`clear`](Self::clear). The control vector gives no such promise (appending may move it):
/// a driver keeping a write in flight copies control bytes first.
///
/// Zero-copy sends (io_uring `SendZc`): the kernel may read a sent segment until the send's
/// notification, after the write completed. While [`retain_sent`](Self::retain_sent) is in
/// force, frames leaving the queue (written, or dropped by a clear) are held instead of
/// dropped, tagged with the newest zero-copy send that may have read them, until
/// [`release_sent`](Self::release_sent) says every send up to that tag has been notified.
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    frames: VecDeque<OutFrame>,
    /// Control bytes of the queued frames, in frame order; `control_read` of them are written.
    control: Vec<u8>,
    control_read: usize,
    /// Bytes of the first frame already written.
    written_in_first: usize,
    queued_bytes: usize,
    /// A write of the current slices is in flight.
    write_in_flight: bool,
    /// `clear` ran while a write was in flight: its result no longer counts, and `retired`
    /// holds the frames it may still read until it completes.
    cleared_in_flight: bool,
    retired: VecDeque<OutFrame>,
    /// Bytes of the first retired frame written before the write in flight.
    retired_written: usize,
    /// Frames leaving the queue are held under this tag (the newest zero-copy send issued).
    retain_tag: Option<u64>,
    /// Frames left the queue while a zero-copy send that may have read them is unnotified,
    /// in tag order.
    held: VecDeque<(u64, OutFrame)>,
}

impl Outbound {
    /// The control vector to append one frame's bytes to; follow with [`push_control`].
    pub(crate) fn control_bytes(&mut self) -> &mut Vec<u8> {
        &mut self.control
    }

    /// Queues the `len` control bytes just appended as one frame.
    pub(crate) fn push_control(&mut self, len: usize) {
        self.frames.push_back(OutFrame::Control { len });
        self.queued_bytes += len;
    }

    /// Queues a buffer whose header (of `header_len` bytes) was just appended to the control
    /// vector, or sits in its headroom (`header_len == 0`, `headroom_used` header bytes).
    pub(crate) fn push_buffer(&mut self, header_len: usize, buffer: Buffer, headroom_used: usize) {
        debug_assert!(headroom_used <= HEADROOM);
        let frame = OutFrame::Buffer {
            header_len,
            buffer,
            in_headroom: headroom_used,
        };
        self.queued_bytes += frame.len();
        self.frames.push_back(frame);
    }

    /// True when nothing waits to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Bytes waiting to be written.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Fills `out` with up to `max` slices of the bytes to write next, in order.
    pub(crate) fn slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        let mut control_at = self.control_read;
        let mut skip = self.written_in_first;
        for frame in &self.frames {
            if out.len() >= max {
                return;
            }
            match frame {
                OutFrame::Control { len } => {
                    let bytes = &self.control[control_at..control_at + len];
                    control_at += len;
                    push_from(out, bytes, &mut skip);
                }
                OutFrame::Buffer {
                    header_len,
                    buffer,
                    in_headroom,
                } => {
                    let header = &self.control[control_at..control_at + header_len];
                    control_at += header_len;
                    push_from(out, header, &mut skip);
                    if out.len() >= max {
                        return;
                    }
                    let with_room = if *in_headroom > 0 {
                        &buffer.with_headroom()[HEADROOM - in_headroom..]
                    } else {
                        buffer.as_slice()
                    };
                    push_from(out, with_room, &mut skip);
                }
            }
        }
    }

    /// A driver submitted an asynchronous write of the current [`slices`](Self::slices): the
    /// segments stay alive until the next [`on_written`](Self::on_written) (with 0 when the
    /// write failed).
    pub(crate) fn begin_write(&mut self) {
        self.write_in_flight = true;
    }

    /// A write of the current slices is in flight.
    pub(crate) fn write_in_flight(&self) -> bool {
        self.write_in_flight
    }

    /// `n` more bytes were written: frames written completely are dropped (their segments
    /// go back to their pools). Ends an in-flight write.
    pub(crate) fn on_written(&mut self, mut n: usize) {
        if std::mem::take(&mut self.write_in_flight) && std::mem::take(&mut self.cleared_in_flight)
        {
            // The write was of frames `clear` dropped since: they may go now.
            let on_frame_end = ends_on_frame_end(&self.retired, self.retired_written + n);
            while let Some(frame) = self.retired.pop_front() {
                self.discard(frame);
            }
            if !on_frame_end {
                // The wire stops inside a frame: whatever was queued since (an ErrorResponse)
                // would be read as the rest of it. Nothing more goes out; the driver closes.
                self.clear();
            }
            return;
        }
        self.queued_bytes -= n.min(self.queued_bytes);
        while n > 0 {
            let Some(first) = self.frames.front() else {
                return;
            };
            let left = first.len() - self.written_in_first;
            if n < left {
                self.written_in_first += n;
                return;
            }
            n -= left;
            self.written_in_first = 0;
            let frame = self.frames.pop_front().expect("checked");
            match &frame {
                OutFrame::Control { len } => self.control_read += len,
                OutFrame::Buffer { header_len, .. } => self.control_read += header_len,
            }
            self.discard(frame);
        }
        if self.frames.is_empty() {
            // Everything written: reuse the control vector from its start.
            self.control.clear();
            self.control_read = 0;
        } else if self.control_read >= COMPACT_AT {
            // A connection that never drains completely still must not grow without bound.
            self.control.drain(..self.control_read);
            self.control_read = 0;
        }
    }

    /// Drops everything queued (connection closed): segments go back to their pools, those an
    /// in-flight write may still read once it completes.
    pub(crate) fn clear(&mut self) {
        if self.write_in_flight && !self.cleared_in_flight {
            self.cleared_in_flight = true;
            self.retired = std::mem::take(&mut self.frames);
            self.retired_written = self.written_in_first;
        }
        while let Some(frame) = self.frames.pop_front() {
            self.discard(frame);
        }
        self.control.clear();
        self.control_read = 0;
        self.written_in_first = 0;
        self.queued_bytes = 0;
    }

    /// A frame leaves the queue: dropped (its segment goes back to its pool), or held while a
    /// zero-copy send may still read it.
    fn discard(&mut self, frame: OutFrame) {
        match (self.retain_tag, frame) {
            (Some(tag), frame @ OutFrame::Buffer { .. }) => self.held.push_back((tag, frame)),
            (_, frame) => drop(frame),
        }
    }

    /// A zero-copy send tagged `tag` (tags grow with every send) was submitted: frames
    /// leaving the queue from now on are held until [`release_sent`](Self::release_sent)
    /// passes `tag`. The frames it reads that are still queued stay queued meanwhile anyway.
    pub(crate) fn retain_sent(&mut self, tag: u64) {
        debug_assert!(self.retain_tag.is_none_or(|t| t <= tag));
        self.retain_tag = Some(tag);
    }

    /// Every zero-copy send tagged below `done_below` has been notified: frames held for
    /// them go (back to their pools); once no later send is unnotified, nothing more is held.
    pub(crate) fn release_sent(&mut self, done_below: u64) {
        while self.held.front().is_some_and(|(tag, _)| *tag < done_below) {
            self.held.pop_front();
        }
        if self.retain_tag.is_some_and(|tag| tag < done_below) {
            self.retain_tag = None;
        }
    }

    /// Segments held for zero-copy sends not notified yet.
    pub(crate) fn held_segments(&self) -> usize {
        self.held.len()
    }

    /// The connection is gone but zero-copy sends are not notified yet: every frame (queued
    /// or held) whose segment they may read moves to `out`, to be dropped once they are.
    /// Only without a write in flight.
    pub(crate) fn take_held(&mut self, out: &mut Vec<Buffer>) {
        debug_assert!(!self.write_in_flight);
        if self.retain_tag.is_some() {
            self.clear();
        }
        for (_, frame) in self.held.drain(..) {
            if let OutFrame::Buffer { buffer, .. } = frame {
                out.push(buffer);
            }
        }
        self.retain_tag = None;
    }
}

impl Outbound {
    /// Like [`clear`](Self::clear), but a frame already partly written stays, so the stream
    /// stays framed for whatever is queued after it (an ErrorResponse before closing).
    pub(crate) fn clear_keeping_partial(&mut self) {
        if self.write_in_flight || self.written_in_first == 0 {
            self.clear();
            return;
        }
        let first = self.frames.pop_front().expect("a partly written frame");
        let control_len = match &first {
            OutFrame::Control { len } => *len,
            OutFrame::Buffer { header_len, .. } => *header_len,
        };
        let control: Vec<u8> =
            self.control[self.control_read..self.control_read + control_len].to_vec();
        let written = self.written_in_first;
        self.clear();
        self.control = control;
        self.written_in_first = written;
        self.queued_bytes = first.len() - written;
        self.frames.push_back(first);
    }
}

/// True when `written` bytes from the start of `frames` end exactly where a frame ends (or
/// at the very start).
fn ends_on_frame_end(frames: &VecDeque<OutFrame>, mut written: usize) -> bool {
    for frame in frames {
        if written == 0 {
            return true;
        }
        let len = frame.len();
        if written < len {
            return false;
        }
        written -= len;
    }
    true
}

/// Pushes `bytes` minus what `skip` says was already written.
fn push_from<'a>(out: &mut Vec<IoSlice<'a>>, bytes: &'a [u8], skip: &mut usize) {
    if *skip >= bytes.len() {
        *skip -= bytes.len();
        return;
    }
    out.push(IoSlice::new(&bytes[*skip..]));
    *skip = 0;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::{pool_of_4k_segments, DataType, NetworkBufferPool};

    fn pool() -> NetworkBufferPool {
        pool_of_4k_segments(16)
    }

    fn queue_buffer(outbound: &mut Outbound, pool: &NetworkBufferPool, bytes: &[u8]) {
        let mut builder = pool
            .request_segment()
            .unwrap()
            .into_builder(DataType::DataBuffer);
        let mut consumer = builder.create_consumer();
        builder.append(bytes);
        drop(builder);
        let header = outbound.control_bytes();
        header.extend_from_slice(b"HDR");
        outbound.push_buffer(3, consumer.build(), 0);
    }

    /// The connection fails while a write is in flight: the queue is cleared and an error
    /// response (`ERROR`, a 5-byte control frame) queued after it.
    fn fail_during_write_and_queue_error(outbound: &mut Outbound) {
        outbound.begin_write();
        outbound.clear();
        outbound.control_bytes().extend_from_slice(b"ERROR");
        outbound.push_control(5);
    }

    #[test]
    fn a_clear_during_an_async_write_keeps_its_segments_until_it_completes() {
        let pool = pool();
        let total = pool.total_segments();
        let mut outbound = Outbound::default();
        queue_buffer(&mut outbound, &pool, b"payload");
        outbound.begin_write();
        // The connection fails while the write is in flight.
        outbound.clear();
        assert!(outbound.is_empty());
        assert_eq!(pool.available_segments(), total - 1, "still leased");
        // An error response queued meanwhile is not taken for written by the old write.
        let bytes = outbound.control_bytes();
        bytes.extend_from_slice(b"ERROR");
        outbound.push_control(5);
        outbound.on_written(10);
        assert_eq!(pool.available_segments(), total, "released on completion");
        let mut slices = Vec::new();
        outbound.slices(&mut slices, 8);
        assert_eq!(slices.len(), 1);
        assert_eq!(&*slices[0], b"ERROR");
    }

    #[test]
    fn nothing_follows_a_frame_that_a_cleared_async_write_cut_short() {
        let pool = pool();
        let total = pool.total_segments();
        let mut outbound = Outbound::default();
        queue_buffer(&mut outbound, &pool, b"payload");
        fail_during_write_and_queue_error(&mut outbound);
        // Only "HDRp" of the 10-byte frame went out: the error response would continue it.
        outbound.on_written(4);
        assert!(outbound.is_empty(), "nothing more is written");
        assert_eq!(pool.available_segments(), total);
        // Cut where the first frame had been partly written before: the same.
        queue_buffer(&mut outbound, &pool, b"payload");
        outbound.on_written(2);
        fail_during_write_and_queue_error(&mut outbound);
        outbound.on_written(0);
        assert!(
            outbound.is_empty(),
            "the stream already stops inside the frame"
        );
        assert_eq!(pool.available_segments(), total);
    }

    #[test]
    fn zero_copy_sends_hold_written_segments_until_notified() {
        let pool = pool();
        let total = pool.total_segments();
        let mut outbound = Outbound::default();
        queue_buffer(&mut outbound, &pool, b"first");
        queue_buffer(&mut outbound, &pool, b"second");
        // Zero-copy send 0 writes the first frame and part of the second.
        outbound.begin_write();
        outbound.retain_sent(0);
        outbound.on_written(3 + 5 + 4);
        assert_eq!(outbound.held_segments(), 1);
        assert_eq!(pool.available_segments(), total - 2);
        // A plain write finishes the second frame while send 0 is unnotified: held too.
        outbound.begin_write();
        outbound.on_written(5);
        assert!(outbound.is_empty());
        assert_eq!(outbound.held_segments(), 2);
        assert_eq!(pool.available_segments(), total - 2);
        // Notified: both go.
        outbound.release_sent(1);
        assert_eq!(outbound.held_segments(), 0);
        assert_eq!(pool.available_segments(), total);
        // Without retention, written segments go at once again.
        queue_buffer(&mut outbound, &pool, b"third");
        outbound.begin_write();
        outbound.on_written(8);
        assert_eq!(pool.available_segments(), total);
    }

    #[test]
    fn held_segments_wait_for_every_earlier_send_and_survive_a_clear() {
        let pool = pool();
        let total = pool.total_segments();
        let mut outbound = Outbound::default();
        queue_buffer(&mut outbound, &pool, b"a");
        queue_buffer(&mut outbound, &pool, b"b");
        queue_buffer(&mut outbound, &pool, b"c");
        outbound.begin_write();
        outbound.retain_sent(4);
        outbound.on_written(4);
        outbound.begin_write();
        outbound.retain_sent(5);
        outbound.on_written(4);
        // Send 4 notified, 5 not: only the frame tagged 4 goes.
        outbound.release_sent(5);
        assert_eq!(outbound.held_segments(), 1);
        assert_eq!(pool.available_segments(), total - 2);
        // The connection closes: the queued frame is held as well, then handed over.
        outbound.clear();
        assert_eq!(outbound.held_segments(), 2);
        assert_eq!(pool.available_segments(), total - 2);
        let mut out = Vec::new();
        outbound.take_held(&mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(outbound.held_segments(), 0);
        drop(out);
        assert_eq!(pool.available_segments(), total);
    }

    #[test]
    fn an_async_write_completes_like_a_synchronous_one() {
        let pool = pool();
        let total = pool.total_segments();
        let mut outbound = Outbound::default();
        queue_buffer(&mut outbound, &pool, b"payload");
        outbound.begin_write();
        outbound.on_written(5);
        assert_eq!(pool.available_segments(), total - 1);
        let mut slices = Vec::new();
        outbound.slices(&mut slices, 8);
        assert_eq!(&*slices[0], b"yload");
        drop(slices);
        outbound.begin_write();
        outbound.on_written(5);
        assert!(outbound.is_empty());
        assert_eq!(pool.available_segments(), total);
        // Without `begin_write` (the epoll driver) a clear drops at once.
        queue_buffer(&mut outbound, &pool, b"x");
        outbound.clear();
        assert_eq!(pool.available_segments(), total);
    }
}
