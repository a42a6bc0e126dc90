//! Reading frames from a byte stream in pieces: the frame header, then a control body into a
//! bounded reused vector (the caller handles BufferResponse payloads itself).

use super::frame::{decode_header_within, FrameHeader, FRAME_HEADER};
use super::ProtocolError;

/// Where the reader is within the current frame.
#[derive(Debug)]
pub(crate) enum Stage {
    /// Gathering the frame header.
    Header,
    /// Gathering a control body of `frame.body_len()` bytes.
    Body(FrameHeader),
}

/// Header and control-body reading shared by both sides of a connection.
#[derive(Debug)]
pub(crate) struct FrameReader {
    header: [u8; FRAME_HEADER],
    have: usize,
    pub(crate) body: Vec<u8>,
    pub(crate) stage: Stage,
    max_payload: usize,
    max_frame: usize,
}

/// What a completed read step produced.
#[derive(Debug)]
pub(crate) enum Step {
    /// More bytes are needed.
    Incomplete,
    /// A frame header arrived (the caller decides how to read the body).
    Header(FrameHeader),
    /// A control frame's body is complete in `body`.
    Body(FrameHeader),
}

impl FrameReader {
    /// Payloads up to `max_payload` bytes, frames up to `max_frame` bytes (header included).
    pub(crate) fn new(max_payload: usize, max_frame: usize) -> Self {
        Self {
            max_frame,
            header: [0; FRAME_HEADER],
            have: 0,
            body: Vec::new(),
            stage: Stage::Header,
            max_payload,
        }
    }

    /// Where the next bytes go.
    pub(crate) fn destination(&mut self) -> &mut [u8] {
        match self.stage {
            Stage::Header => &mut self.header[self.have..],
            Stage::Body(_) => &mut self.body[self.have..],
        }
    }

    /// `n` bytes arrived in [`destination`](Self::destination).
    pub(crate) fn advance(&mut self, n: usize) -> Result<Step, ProtocolError> {
        self.have += n;
        match self.stage {
            Stage::Header => {
                if self.have < FRAME_HEADER {
                    return Ok(Step::Incomplete);
                }
                self.have = 0;
                // Every limit is checked here, before `read_body` reserves the body's bytes.
                let frame = decode_header_within(&self.header, self.max_payload, self.max_frame)?;
                Ok(Step::Header(frame))
            }
            Stage::Body(frame) => {
                if self.have < frame.body_len() {
                    return Ok(Step::Incomplete);
                }
                self.have = 0;
                self.stage = Stage::Header;
                Ok(Step::Body(frame))
            }
        }
    }

    /// Reads the body of `frame` into the body vector next (bounded by the header check).
    pub(crate) fn read_body(&mut self, frame: FrameHeader) -> Option<Step> {
        self.body.clear();
        self.body.resize(frame.body_len(), 0);
        if frame.body_len() == 0 {
            return Some(Step::Body(frame));
        }
        self.stage = Stage::Body(frame);
        None
    }

    /// Back to reading a frame header (after the caller read a body its own way).
    pub(crate) fn expect_header(&mut self) {
        self.have = 0;
        self.stage = Stage::Header;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame::{encode_header, DecodeError, MessageId};

    #[test]
    fn a_frame_over_the_configured_limit_is_refused_before_its_body_is_reserved() {
        let segment = 4096;
        let max_frame = segment + FRAME_HEADER;
        let mut reader = FrameReader::new(segment, max_frame);
        // A task event one byte longer than the configured frame limit (its own limit is
        // larger: the configured one decides).
        let mut header = [0u8; FRAME_HEADER];
        encode_header(&mut header, max_frame + 1, MessageId::TaskEventRequest);
        reader.destination().copy_from_slice(&header);
        let result = reader.advance(FRAME_HEADER);
        assert!(
            matches!(
                result,
                Err(ProtocolError::Decode(DecodeError::BadLength { limit, .. }))
                    if limit == max_frame as u64
            ),
            "{result:?}"
        );
        assert_eq!(reader.body.capacity(), 0, "nothing reserved for the body");
        // At the limit it is read.
        let mut reader = FrameReader::new(segment, max_frame);
        encode_header(&mut header, max_frame, MessageId::TaskEventRequest);
        reader.destination().copy_from_slice(&header);
        assert!(matches!(reader.advance(FRAME_HEADER), Ok(Step::Header(_))));
    }
}
