//! Frames: the fixed header, every message's body, encoding and validated decoding.
//!
//! Layout (version 2, all integers big-endian):
//!
//! ```text
//! frame header (10 bytes)
//!   0  u32  frame length, this header included
//!   4  u32  magic 0xF1C6_A7E5
//!   8  u8   protocol version (2)
//!   9  u8   message id
//! then the message body:
//!   0 Handshake            u8 version, u128 node id, u8 flags (bit 0: authenticate),
//!                          32-byte nonce (zero when not authenticating; not read then)
//!   1 PartitionRequest     u64 partition, u64 producer, u32 subpartition, u128 receiver,
//!                          u32 initial credit
//!   2 BufferResponse       u128 receiver, u64 sequence number, u32 backlog, u8 data type,
//!                          u8 flags (bit 0 compressed: reserved, a consumer refuses it as
//!                          no codec is configured; bit 1 priority), u32 payload size,
//!                          u32 overtaken (a priority event: data items it overtook), then the
//!                          payload (38-byte body header: 48 bytes with the frame header, so it
//!                          fits a segment's 64-byte headroom)
//!   3 AddCredit            u128 receiver, u32 credit (> 0)
//!   4 ResumeConsumption    u128 receiver
//!   5 TaskEventRequest     u64 partition, u64 producer, u128 receiver, u32 length, event bytes
//!   6 CancelPartitionRequest u128 receiver
//!   7 CloseRequest         (empty)
//!   8 BacklogAnnouncement  u128 receiver, u32 backlog (> 0)
//!   9 ErrorResponse        u8 has receiver, u128 receiver, u8 error kind, u16 length (at most
//!                          512), UTF-8 text (a byte that is not is read as U+FFFD)
//!  10 AuthProof            32-byte HMAC-SHA256 proof (see [`super::auth`])
//!  11 AckAllUserRecordsProcessed u128 receiver
//! ```
//!
//! Version history: 1 had a 17-byte Handshake (version, node) and no AuthProof; 2 adds the
//! handshake's flags and nonce, AuthProof, and the error kinds Unauthenticated and
//! LimitExceeded; within 2, AckAllUserRecordsProcessed came later (a peer that does not know
//! it refuses it as an unknown message and closes the connection).
//!
//! Every length is checked against its message's limit (and the configured largest frame)
//! when the header arrives, before a byte of the body is read or memory is reserved for it.

use super::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
use crate::buffer::DataType;
use crate::partition::ResultPartitionId;

/// Bytes of the frame header.
pub const FRAME_HEADER: usize = 10;
/// The magic number every frame starts with (after its length).
pub const MAGIC: u32 = 0xF1C6_A7E5;
/// The protocol version this build speaks.
pub const VERSION: u8 = 2;
/// Bytes of a BufferResponse before its payload (frame header included).
pub const BUFFER_RESPONSE_HEADER: usize = FRAME_HEADER + BUFFER_RESPONSE_BODY;
/// Bytes of a BufferResponse's fixed body header.
pub const BUFFER_RESPONSE_BODY: usize = 38;
/// Bytes of a TaskEventRequest before its event (frame header included).
pub const TASK_EVENT_REQUEST_HEADER: usize = FRAME_HEADER + TASK_EVENT_REQUEST_BODY;
/// Bytes of a TaskEventRequest's fixed body: partition, producer, receiver, event length.
const TASK_EVENT_REQUEST_BODY: usize = 8 + 8 + 16 + 4;
/// Longest control frame (everything but a BufferResponse's payload and a task event).
pub const MAX_CONTROL_FRAME: usize = 1024;
/// Longest error message carried.
pub const MAX_ERROR_MESSAGE: usize = 512;
/// Bytes of a Handshake's body.
pub const HANDSHAKE_BODY: usize = 1 + 16 + 1 + NONCE_LEN;
/// Handshake flag: the sender authenticates (has the cluster secret and requires the peer
/// to prove it has it too).
const FLAG_AUTHENTICATE: u8 = 1;

/// Identifies a remote input channel on a connection (Flink's `InputChannelID`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReceiverId(pub u128);

/// Message ids on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageId {
    /// Connection handshake.
    Handshake = 0,
    /// Consumer asks for a subpartition.
    PartitionRequest = 1,
    /// A buffer or event for a channel.
    BufferResponse = 2,
    /// More credit for a channel.
    AddCredit = 3,
    /// Unblock a channel after an aligned barrier.
    ResumeConsumption = 4,
    /// A task event for the producer.
    TaskEventRequest = 5,
    /// Stop sending to a channel.
    CancelPartitionRequest = 6,
    /// Close the connection.
    CloseRequest = 7,
    /// The producer has a backlog (sent when it has no credit to send data with).
    BacklogAnnouncement = 8,
    /// An error, for one channel or the whole connection.
    ErrorResponse = 9,
    /// Proof of knowing the cluster secret (authenticated handshake).
    AuthProof = 10,
    /// The consumer processed every record before the channel's EndOfData (FLIP-147).
    AckAllUserRecordsProcessed = 11,
}

impl MessageId {
    /// True for what a consumer may send; a producer sends data and backlog announcements
    /// only (handshakes, proofs and errors go both ways).
    pub fn sent_by_consumer(self) -> bool {
        !matches!(self, Self::BufferResponse | Self::BacklogAnnouncement)
    }

    /// True for what a producer may send.
    pub fn sent_by_producer(self) -> bool {
        matches!(
            self,
            Self::Handshake
                | Self::BufferResponse
                | Self::BacklogAnnouncement
                | Self::ErrorResponse
                | Self::AuthProof
        )
    }

    fn from_u8(id: u8) -> Option<Self> {
        Some(match id {
            0 => Self::Handshake,
            1 => Self::PartitionRequest,
            2 => Self::BufferResponse,
            3 => Self::AddCredit,
            4 => Self::ResumeConsumption,
            5 => Self::TaskEventRequest,
            6 => Self::CancelPartitionRequest,
            7 => Self::CloseRequest,
            8 => Self::BacklogAnnouncement,
            9 => Self::ErrorResponse,
            10 => Self::AuthProof,
            11 => Self::AckAllUserRecordsProcessed,
            _ => return None,
        })
    }
}

/// What kind of error an ErrorResponse reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorKind {
    /// The requested partition is not (or no longer) registered.
    PartitionNotFound = 0,
    /// The producer failed or released the partition.
    ProducerFailed = 1,
    /// The peer broke the protocol.
    Protocol = 2,
    /// Anything else.
    Other = 3,
    /// The peer did not prove it knows the cluster secret (or refused our proof).
    Unauthenticated = 4,
    /// The peer went past a limit (channels per connection, partition-request rate).
    LimitExceeded = 5,
}

impl ErrorKind {
    fn from_u8(kind: u8) -> Option<Self> {
        Some(match kind {
            0 => Self::PartitionNotFound,
            1 => Self::ProducerFailed,
            2 => Self::Protocol,
            3 => Self::Other,
            4 => Self::Unauthenticated,
            5 => Self::LimitExceeded,
            _ => return None,
        })
    }
}

/// The fixed part of a BufferResponse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferResponseHeader {
    /// The channel it is for.
    pub receiver: ReceiverId,
    /// Position in the subpartition's output.
    pub sequence_number: u64,
    /// Data buffers the sender still has queued.
    pub backlog: u32,
    /// What the payload is.
    pub data_type: DataType,
    /// The payload is compressed.
    pub compressed: bool,
    /// Payload bytes that follow.
    pub size: u32,
    /// For a priority event: data items of the subpartition it overtook.
    pub overtaken: u32,
}

/// A decoded control message (everything but a BufferResponse's payload).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First frame on a connection, both ways.
    Handshake {
        /// The sender's protocol version.
        version: u8,
        /// The sender's node identity.
        node: u128,
        /// The sender authenticates: it holds the cluster secret and requires a proof.
        authenticate: bool,
        /// The sender's fresh nonce (zero when not authenticating).
        nonce: Nonce,
    },
    /// Consumer → producer: start sending a subpartition to `receiver`.
    PartitionRequest {
        /// The partition.
        partition: ResultPartitionId,
        /// Its subpartition.
        subpartition: u32,
        /// The consumer's channel.
        receiver: ReceiverId,
        /// Credit the channel grants from the start (its exclusive buffers).
        credit: u32,
    },
    /// Producer → consumer: a buffer or event (payload follows).
    BufferResponse(BufferResponseHeader),
    /// Consumer → producer: more credit.
    AddCredit {
        /// The channel.
        receiver: ReceiverId,
        /// Credit added (> 0).
        credit: u32,
    },
    /// Consumer → producer: unblock after an aligned barrier.
    ResumeConsumption {
        /// The channel.
        receiver: ReceiverId,
    },
    /// Consumer → producer: a task event.
    TaskEventRequest {
        /// The producer's partition.
        partition: ResultPartitionId,
        /// The channel sending it.
        receiver: ReceiverId,
        /// The encoded event.
        event: Vec<u8>,
    },
    /// Consumer → producer: stop sending to this channel.
    CancelPartitionRequest {
        /// The channel.
        receiver: ReceiverId,
    },
    /// Consumer → producer: the connection closes.
    CloseRequest,
    /// Producer → consumer: backlog without credit to send it.
    BacklogAnnouncement {
        /// The channel.
        receiver: ReceiverId,
        /// Buffers queued (> 0).
        backlog: u32,
    },
    /// Consumer → producer: every record before the channel's EndOfData was processed
    /// (FLIP-147's `AckAllUserRecordsProcessed`).
    AckAllUserRecordsProcessed {
        /// The channel.
        receiver: ReceiverId,
    },
    /// Either way, once per connection and side: proof of knowing the cluster secret.
    AuthProof {
        /// HMAC-SHA256 over the connection's nonces and nodes.
        proof: Proof,
    },
    /// Either way: an error for one channel, or (no receiver) for the connection.
    ErrorResponse {
        /// The channel, if the error is not fatal for the connection.
        receiver: Option<ReceiverId>,
        /// What kind of error.
        kind: ErrorKind,
        /// Human-readable cause.
        message: String,
    },
}

/// Why bytes are not a valid frame. Always the peer's fault: the connection closes.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame does not start with our magic number.
    #[error("bad magic number {0:#010x}")]
    BadMagic(u32),
    /// A protocol version we do not speak.
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u8),
    /// An unknown message id.
    #[error("unknown message id {0}")]
    UnknownMessage(u8),
    /// A frame length below the header or above the limit for its message.
    #[error("frame length {length} out of range for message {id} (limit {limit})")]
    BadLength {
        /// Message id.
        id: u8,
        /// Claimed length.
        length: u64,
        /// Largest allowed.
        limit: u64,
    },
    /// A field holds a value out of its range.
    #[error("invalid {field}: {value}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The body is shorter or longer than its fields.
    #[error("body of message {id} has {actual} bytes, its fields need {expected}")]
    BodyLength {
        /// Message id.
        id: u8,
        /// Bytes the fields need.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Total frame length, header included.
    pub length: u32,
    /// The message.
    pub id: MessageId,
}

impl FrameHeader {
    /// Body bytes after the header.
    pub fn body_len(&self) -> usize {
        // `decode_header` never yields a shorter frame; a hand-built header must not panic.
        (self.length as usize).saturating_sub(FRAME_HEADER)
    }
}

/// Parses and validates a frame header; `max_payload` bounds a BufferResponse's payload and
/// a task event (the segment size).
pub fn decode_header(
    bytes: &[u8; FRAME_HEADER],
    max_payload: usize,
) -> Result<FrameHeader, DecodeError> {
    decode_header_within(bytes, max_payload, usize::MAX)
}

/// Like [`decode_header`], and no frame may be longer than `max_frame` bytes (header
/// included; `fluxgate.network.max-frame-size`).
pub fn decode_header_within(
    bytes: &[u8; FRAME_HEADER],
    max_payload: usize,
    max_frame: usize,
) -> Result<FrameHeader, DecodeError> {
    let length = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let magic = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    if bytes[8] != VERSION {
        return Err(DecodeError::UnsupportedVersion(bytes[8]));
    }
    let id = MessageId::from_u8(bytes[9]).ok_or(DecodeError::UnknownMessage(bytes[9]))?;
    let limit = match id {
        MessageId::BufferResponse => BUFFER_RESPONSE_HEADER + max_payload,
        MessageId::TaskEventRequest => TASK_EVENT_REQUEST_HEADER + max_payload,
        _ => MAX_CONTROL_FRAME,
    }
    .min(max_frame);
    if (length as usize) < FRAME_HEADER || length as usize > limit {
        return Err(DecodeError::BadLength {
            id: id as u8,
            length: length.into(),
            limit: limit as u64,
        });
    }
    // A BufferResponse is read in two steps, its fixed header first: one too short for it
    // is refused here, or the reader would take the rest of that header from what follows
    // (and wait for it, a known bad frame unanswered, while nothing follows).
    if id == MessageId::BufferResponse && (length as usize) < BUFFER_RESPONSE_HEADER {
        return Err(DecodeError::BodyLength {
            id: id as u8,
            expected: BUFFER_RESPONSE_BODY,
            actual: length as usize - FRAME_HEADER,
        });
    }
    Ok(FrameHeader { length, id })
}

/// A peer's error text with its control characters escaped (a newline as `\n`): logged or
/// shown, it cannot forge lines or drive a terminal. At most ten bytes for one, over a text
/// the frame bounds.
fn printable(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes a frame header.
pub fn encode_header(out: &mut [u8], length: usize, id: MessageId) {
    out[0..4].copy_from_slice(&(length as u32).to_be_bytes());
    out[4..8].copy_from_slice(&MAGIC.to_be_bytes());
    out[8] = VERSION;
    out[9] = id as u8;
}

/// Writes a BufferResponse's frame header and fixed header (`BUFFER_RESPONSE_HEADER`, 48
/// bytes) into `out`.
pub fn encode_buffer_response(
    out: &mut [u8; BUFFER_RESPONSE_HEADER],
    header: &BufferResponseHeader,
    priority: bool,
) {
    encode_header(
        &mut out[..],
        BUFFER_RESPONSE_HEADER + header.size as usize,
        MessageId::BufferResponse,
    );
    let body = &mut out[FRAME_HEADER..];
    body[0..16].copy_from_slice(&header.receiver.0.to_be_bytes());
    body[16..24].copy_from_slice(&header.sequence_number.to_be_bytes());
    body[24..28].copy_from_slice(&header.backlog.to_be_bytes());
    body[28] = header.data_type as u8;
    body[29] = u8::from(header.compressed) | (u8::from(priority) << 1);
    body[30..34].copy_from_slice(&header.size.to_be_bytes());
    body[34..38].copy_from_slice(&header.overtaken.to_be_bytes());
}

/// Most data items a priority event can overtake, with room to spare: all a sender's
/// subpartition queue holds (twice `max-buffers-per-channel`, plus
/// `max-overdraft-buffers-per-gate`, plus its event reserve, each option at most 65536) and
/// the item its reader is reading. More is a corrupt or hostile frame: the consumer would
/// persist every later buffer of the channel as in-flight data.
pub const MAX_OVERTAKEN: u32 = 4 * (1 << 16);

/// Parses a BufferResponse's fixed header (the bytes after the frame header) and checks it
/// against the frame length (and `overtaken` against [`MAX_OVERTAKEN`]).
pub fn decode_buffer_response(
    frame: &FrameHeader,
    body: &[u8; BUFFER_RESPONSE_BODY],
) -> Result<BufferResponseHeader, DecodeError> {
    let mut r = Reader::new(body, MessageId::BufferResponse);
    let receiver = ReceiverId(r.u128());
    let sequence_number = r.u64();
    let backlog = r.u32();
    let data_type_byte = r.u8();
    let data_type = DataType::from_ordinal(data_type_byte)
        .filter(|t| *t != DataType::None)
        .ok_or(DecodeError::InvalidField {
            field: "data type",
            value: data_type_byte.into(),
        })?;
    let flags = r.u8();
    if flags & !0b11 != 0 {
        return Err(DecodeError::InvalidField {
            field: "buffer flags",
            value: flags.into(),
        });
    }
    // The priority flag repeats what the data type says; a compressed item is data (events
    // are never compressed); only a priority item overtakes. A frame that says otherwise was
    // not written by a sender of this protocol.
    let priority = flags & 0b10 != 0;
    if priority != data_type.has_priority() || (flags & 1 != 0 && !data_type.is_buffer()) {
        return Err(DecodeError::InvalidField {
            field: "buffer flags",
            value: flags.into(),
        });
    }
    let size = r.u32();
    let overtaken = r.u32();
    if overtaken > MAX_OVERTAKEN || (overtaken != 0 && !priority) {
        return Err(DecodeError::InvalidField {
            field: "overtaken",
            value: overtaken.into(),
        });
    }
    // In u64: on a 32-bit target the sum in usize could wrap to a short frame's length.
    if u64::from(frame.length) != BUFFER_RESPONSE_HEADER as u64 + u64::from(size) {
        return Err(DecodeError::BodyLength {
            id: MessageId::BufferResponse as u8,
            expected: (BUFFER_RESPONSE_HEADER - FRAME_HEADER).saturating_add(size as usize),
            actual: frame.body_len(),
        });
    }
    Ok(BufferResponseHeader {
        receiver,
        sequence_number,
        backlog,
        data_type,
        compressed: flags & 1 != 0,
        size,
        overtaken,
    })
}

impl Message {
    /// Appends the whole frame (header and body) to `out`. A BufferResponse writes only its
    /// header ([`BUFFER_RESPONSE_HEADER`] bytes); its payload follows separately.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; FRAME_HEADER]);
        let id = match self {
            Message::Handshake {
                version,
                node,
                authenticate,
                nonce,
            } => {
                out.push(*version);
                out.extend_from_slice(&node.to_be_bytes());
                out.push(if *authenticate { FLAG_AUTHENTICATE } else { 0 });
                out.extend_from_slice(nonce);
                MessageId::Handshake
            }
            Message::AuthProof { proof } => {
                out.extend_from_slice(proof);
                MessageId::AuthProof
            }
            Message::PartitionRequest {
                partition,
                subpartition,
                receiver,
                credit,
            } => {
                put_partition(out, partition);
                out.extend_from_slice(&subpartition.to_be_bytes());
                out.extend_from_slice(&receiver.0.to_be_bytes());
                out.extend_from_slice(&credit.to_be_bytes());
                MessageId::PartitionRequest
            }
            Message::BufferResponse(header) => {
                let mut bytes = [0u8; BUFFER_RESPONSE_HEADER];
                encode_buffer_response(&mut bytes, header, header.data_type.has_priority());
                out.truncate(start);
                out.extend_from_slice(&bytes);
                return;
            }
            Message::AddCredit { receiver, credit } => {
                out.extend_from_slice(&receiver.0.to_be_bytes());
                out.extend_from_slice(&credit.to_be_bytes());
                MessageId::AddCredit
            }
            Message::ResumeConsumption { receiver } => {
                out.extend_from_slice(&receiver.0.to_be_bytes());
                MessageId::ResumeConsumption
            }
            Message::AckAllUserRecordsProcessed { receiver } => {
                out.extend_from_slice(&receiver.0.to_be_bytes());
                MessageId::AckAllUserRecordsProcessed
            }
            Message::TaskEventRequest {
                partition,
                receiver,
                event,
            } => {
                put_partition(out, partition);
                out.extend_from_slice(&receiver.0.to_be_bytes());
                out.extend_from_slice(&(event.len() as u32).to_be_bytes());
                out.extend_from_slice(event);
                MessageId::TaskEventRequest
            }
            Message::CancelPartitionRequest { receiver } => {
                out.extend_from_slice(&receiver.0.to_be_bytes());
                MessageId::CancelPartitionRequest
            }
            Message::CloseRequest => MessageId::CloseRequest,
            Message::BacklogAnnouncement { receiver, backlog } => {
                out.extend_from_slice(&receiver.0.to_be_bytes());
                out.extend_from_slice(&backlog.to_be_bytes());
                MessageId::BacklogAnnouncement
            }
            Message::ErrorResponse {
                receiver,
                kind,
                message,
            } => {
                out.push(u8::from(receiver.is_some()));
                out.extend_from_slice(&receiver.map_or(0, |r| r.0).to_be_bytes());
                out.push(*kind as u8);
                let text = truncate_utf8(message, MAX_ERROR_MESSAGE);
                out.extend_from_slice(&(text.len() as u16).to_be_bytes());
                out.extend_from_slice(text.as_bytes());
                MessageId::ErrorResponse
            }
        };
        let length = out.len() - start;
        encode_header(&mut out[start..start + FRAME_HEADER], length, id);
    }

    /// Decodes a message's body. A control message's body must be exactly as long as its
    /// header says, so the limits checked on the header's length hold for what decodes; a
    /// BufferResponse's is its fixed part only (the payload follows on its own).
    pub fn decode(frame: &FrameHeader, body: &[u8]) -> Result<Message, DecodeError> {
        let framed = frame.body_len();
        if frame.id != MessageId::BufferResponse && body.len() != framed {
            return Err(DecodeError::BodyLength {
                id: frame.id as u8,
                expected: framed,
                actual: body.len(),
            });
        }
        let mut r = Reader::new(body, frame.id);
        let message = match frame.id {
            MessageId::Handshake => {
                r.need(HANDSHAKE_BODY)?;
                let version = r.u8();
                let node = r.u128();
                let flags = r.u8();
                if flags & !FLAG_AUTHENTICATE != 0 {
                    return Err(DecodeError::InvalidField {
                        field: "handshake flags",
                        value: flags.into(),
                    });
                }
                Message::Handshake {
                    version,
                    node,
                    authenticate: flags & FLAG_AUTHENTICATE != 0,
                    nonce: r.array(),
                }
            }
            MessageId::AuthProof => {
                r.need(PROOF_LEN)?;
                Message::AuthProof { proof: r.array() }
            }
            MessageId::PartitionRequest => {
                r.need(40)?;
                Message::PartitionRequest {
                    partition: r.partition(),
                    subpartition: r.u32(),
                    receiver: ReceiverId(r.u128()),
                    credit: r.u32(),
                }
            }
            MessageId::BufferResponse => {
                r.need(BUFFER_RESPONSE_BODY)?;
                let fixed: &[u8; BUFFER_RESPONSE_BODY] =
                    body[..BUFFER_RESPONSE_BODY].try_into().expect("checked");
                return decode_buffer_response(frame, fixed).map(Message::BufferResponse);
            }
            MessageId::AddCredit => {
                r.need(20)?;
                let receiver = ReceiverId(r.u128());
                let credit = r.u32();
                if credit == 0 {
                    return Err(DecodeError::InvalidField {
                        field: "credit",
                        value: 0,
                    });
                }
                Message::AddCredit { receiver, credit }
            }
            MessageId::ResumeConsumption => {
                r.need(16)?;
                Message::ResumeConsumption {
                    receiver: ReceiverId(r.u128()),
                }
            }
            MessageId::AckAllUserRecordsProcessed => {
                r.need(16)?;
                Message::AckAllUserRecordsProcessed {
                    receiver: ReceiverId(r.u128()),
                }
            }
            MessageId::TaskEventRequest => {
                r.need(TASK_EVENT_REQUEST_BODY)?;
                let partition = r.partition();
                let receiver = ReceiverId(r.u128());
                let len = r.u32() as usize;
                r.need(len)?;
                Message::TaskEventRequest {
                    partition,
                    receiver,
                    event: r.take(len).to_vec(),
                }
            }
            MessageId::CancelPartitionRequest => {
                r.need(16)?;
                Message::CancelPartitionRequest {
                    receiver: ReceiverId(r.u128()),
                }
            }
            MessageId::CloseRequest => Message::CloseRequest,
            MessageId::BacklogAnnouncement => {
                r.need(20)?;
                let receiver = ReceiverId(r.u128());
                let backlog = r.u32();
                if backlog == 0 {
                    return Err(DecodeError::InvalidField {
                        field: "backlog",
                        value: 0,
                    });
                }
                Message::BacklogAnnouncement { receiver, backlog }
            }
            MessageId::ErrorResponse => {
                r.need(20)?;
                let has_receiver = r.u8();
                let receiver = r.u128();
                let kind_byte = r.u8();
                let len = r.u16() as usize;
                // Without a receiver its id field is zero, as the encoder writes it.
                if has_receiver > 1 || (has_receiver == 0 && receiver != 0) {
                    return Err(DecodeError::InvalidField {
                        field: "has receiver",
                        value: has_receiver.into(),
                    });
                }
                let kind = ErrorKind::from_u8(kind_byte).ok_or(DecodeError::InvalidField {
                    field: "error kind",
                    value: kind_byte.into(),
                })?;
                // The encoder cuts its text there; a longer one is no message of ours.
                if len > MAX_ERROR_MESSAGE {
                    return Err(DecodeError::InvalidField {
                        field: "error message length",
                        value: len as u64,
                    });
                }
                r.need(len)?;
                let message = printable(&String::from_utf8_lossy(r.take(len)));
                Message::ErrorResponse {
                    receiver: (has_receiver == 1).then_some(ReceiverId(receiver)),
                    kind,
                    message,
                }
            }
        };
        if !r.rest().is_empty() {
            return Err(DecodeError::BodyLength {
                id: frame.id as u8,
                expected: body.len() - r.rest().len(),
                actual: body.len(),
            });
        }
        Ok(message)
    }
}

fn put_partition(out: &mut Vec<u8>, partition: &ResultPartitionId) {
    out.extend_from_slice(&partition.partition.to_be_bytes());
    out.extend_from_slice(&partition.producer.to_be_bytes());
}

fn truncate_utf8(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Reads fields from a body whose length was checked with `need` first.
struct Reader<'a> {
    body: &'a [u8],
    id: MessageId,
    total: usize,
}

impl<'a> Reader<'a> {
    fn new(body: &'a [u8], id: MessageId) -> Self {
        Self {
            body,
            id,
            total: body.len(),
        }
    }

    fn need(&self, n: usize) -> Result<(), DecodeError> {
        if self.body.len() < n {
            return Err(DecodeError::BodyLength {
                id: self.id as u8,
                expected: (self.total - self.body.len()).saturating_add(n),
                actual: self.total,
            });
        }
        Ok(())
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.body.split_at(n);
        self.body = tail;
        head
    }

    fn rest(&self) -> &'a [u8] {
        self.body
    }

    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().expect("2 bytes"))
    }

    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().expect("4 bytes"))
    }

    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take(8).try_into().expect("8 bytes"))
    }

    fn u128(&mut self) -> u128 {
        u128::from_be_bytes(self.take(16).try_into().expect("16 bytes"))
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        self.take(N).try_into().expect("N bytes")
    }

    fn partition(&mut self) -> ResultPartitionId {
        ResultPartitionId {
            partition: self.u64(),
            producer: self.u64(),
        }
    }
}
