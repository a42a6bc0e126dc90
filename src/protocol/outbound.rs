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
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    frames: VecDeque<OutFrame>,
    /// Control bytes of the queued frames, in frame order; `control_read` of them are written.
    control: Vec<u8>,
    control_read: usize,
    /// Bytes of the first frame already written.
    written_in_first: usize,
    queued_bytes: usize,
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

    /// `n` more bytes were written: frames written completely are dropped (their segments
    /// go back to their pools).
    pub(crate) fn on_written(&mut self, mut n: usize) {
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
            match self.frames.pop_front().expect("checked") {
                OutFrame::Control { len } => self.control_read += len,
                OutFrame::Buffer { header_len, .. } => self.control_read += header_len,
            }
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

    /// Drops everything queued (connection closed): segments go back to their pools.
    pub(crate) fn clear(&mut self) {
        self.frames.clear();
        self.control.clear();
        self.control_read = 0;
        self.written_in_first = 0;
        self.queued_bytes = 0;
    }
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
