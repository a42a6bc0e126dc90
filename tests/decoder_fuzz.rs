//! Decoder fuzzing on stable Rust: proptest-driven inputs through both decoding entry points.
//!
//! * The connections: bytes fed in random-sized pieces (`read_buffer` / `on_read`) to a fresh
//!   [`ServerConnection`] (with a registered partition holding data, so requests, credit and
//!   resume reach real views) and to a fresh [`ClientConnection`] with one registered remote
//!   channel (its gate read or left full, so credit runs out sometimes).
//! * [`Message::decode`] / [`decode_header`] / [`decode_buffer_response`] over arbitrary
//!   headers and bodies.
//!
//! Inputs: (a) arbitrary bytes (raw, after a valid handshake, after a valid-looking frame
//! header); (b) valid frame streams in both directions, and the corpus, with random mutations
//! (bit flips, byte writes, truncation, length / size / id field rewrites, inserted and deleted
//! bytes).
//!
//! (c) Authenticated streams (a handshake with a nonce and a valid proof, then a valid stream)
//! with random mutations, fed to a server and a client that require the shared secret.
//!
//! Properties: nothing panics; every error is a [`ProtocolError`] (and the driver stops
//! feeding after it); a server that failed is closing with exactly one connection-level
//! ErrorResponse queued; a client that failed failed its channel; an unmutated valid stream is
//! accepted whole; every segment is back in its pool once everything is dropped (checked on
//! both networks after every input); decoded messages re-encode within the limits; a side that
//! authenticated read the valid handshake and proof intact, and a server that did not served
//! nothing.
//!
//! Budget: `FLUXGATE_FUZZ_CASES` cases per fuzz test (default 2000, so `cargo test` stays
//! fast); `-- --nocapture` prints each test's cases, executions (one input through one fresh
//! connection, or one `Message::decode` case), time and outcome counts. A long run, in release
//! but with overflow checks and debug assertions (in their own target directory, so the usual
//! release build is not rebuilt):
//!
//! ```sh
//! CARGO_TARGET_DIR=target/fuzz-checked CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
//!   CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true FLUXGATE_FUZZ_CASES=4000000 \
//!   cargo test --release --test decoder_fuzz -- --nocapture --test-threads=1
//! ```
//!
//! The corpus in `tests/corpus/decoder/` is replayed first by both connection fuzz tests (and
//! on its own by `corpus_replays_with_the_expected_outcomes`): each file through both
//! connections in three piece patterns, with the outcome [`corpus_entries`] expects. It also
//! seeds the mutations. `cargo test --test decoder_fuzz -- --ignored
//! regenerate_corpus` rebuilds it.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fluxgate::buffer::{DataType, NetworkBufferPool};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event, StopMode};
use fluxgate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, GateError, GateItem, InputGate,
    SingleInputGate,
};
use fluxgate::partition::{PartitionManager, ResultPartition, ResultPartitionId};
use fluxgate::protocol::auth::{Nonce, Proof, Transcript, PROOF_LEN};
use fluxgate::protocol::frame::{
    decode_buffer_response, decode_header, encode_header, BufferResponseHeader, FrameHeader,
    BUFFER_RESPONSE_BODY, BUFFER_RESPONSE_HEADER, FRAME_HEADER, HANDSHAKE_BODY, MAGIC,
    MAX_CONTROL_FRAME, MAX_ERROR_MESSAGE, MAX_OVERTAKEN, TASK_EVENT_REQUEST_HEADER, VERSION,
};
use fluxgate::protocol::{
    ClientConfig, ClientConnection, DecodeError, ErrorKind, Message, MessageId, ProtocolError,
    ReceiverId, Secret, ServerConfig, ServerConnection,
};
use fluxgate::NetworkConfig;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};

/// Payload bytes per segment on both sides (the largest BufferResponse payload).
const SEGMENT: usize = 4096;
/// The partition the server has registered (subpartition 0, with data queued).
const PARTITION: ResultPartitionId = ResultPartitionId {
    partition: 0,
    producer: 1,
};
/// The receiver id of the client's one channel (slot 0, generation 1).
const RECEIVER: ReceiverId = ReceiverId(1 << 64);
/// Cases per fuzz test when `FLUXGATE_FUZZ_CASES` is not set.
const DEFAULT_CASES: u32 = 2000;
/// Channels the server lets one connection request (valid streams request at most 10).
const MAX_CHANNELS: usize = 12;
/// The node ids and nonces of the authenticated connections (fixed: deterministic proofs).
const SERVER_NODE: u128 = 1;
const CLIENT_NODE: u128 = 2;
const PEER_NODE: u128 = 9;
const SERVER_NONCE: Nonce = [0x5E; 32];
const CLIENT_NONCE: Nonce = [0xC1; 32];

/// The cluster secret of the authenticated connections.
fn secret() -> Arc<Secret> {
    Arc::new(Secret::new(b"decoder fuzz shared secret").unwrap())
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/decoder")
}

fn budget() -> u32 {
    match std::env::var("FLUXGATE_FUZZ_CASES") {
        Ok(value) => value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("FLUXGATE_FUZZ_CASES={value:?} is not a case count")),
        Err(_) => DEFAULT_CASES,
    }
}

fn config() -> NetworkConfig {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config.set("taskmanager.memory.network.max", "4mb").unwrap();
    config.set("fluxgate.memory.arena-size", "1mb").unwrap();
    config
}

/// The producer's and the consumer's network memory, shared by every input of one test (the
/// pools map and pre-fault their memory: too slow to create per input).
struct Networks {
    config: NetworkConfig,
    producer: NetworkBufferPool,
    consumer: NetworkBufferPool,
    /// One base instant per test (`Instant::now` per input costs a syscall on some machines).
    start: Instant,
}

impl Networks {
    fn new() -> Self {
        let config = config();
        Self {
            producer: NetworkBufferPool::new(&config).unwrap(),
            consumer: NetworkBufferPool::new(&config).unwrap(),
            config,
            start: Instant::now(),
        }
    }

    /// Memory is bounded: with everything of an input dropped, every segment is back.
    fn assert_all_back(&self, what: &str) {
        assert_eq!(
            self.producer.available_segments(),
            self.producer.total_segments(),
            "{what}: producer segments not returned"
        );
        assert_eq!(
            self.consumer.available_segments(),
            self.consumer.total_segments(),
            "{what}: consumer segments not returned"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Driving one connection

/// Feeds `input` in pieces of the sizes in `pieces` (cycled) through `read_buffer`/`on_read`
/// (as many reads per piece as the destinations need), calling `after_piece` after every
/// piece. Stops at the first error: a connection that failed is fed nothing more.
fn feed<C>(
    conn: &mut C,
    input: &[u8],
    pieces: &[usize],
    read_buffer: impl Fn(&mut C) -> &mut [u8],
    mut on_read: impl FnMut(&mut C, usize) -> Result<(), ProtocolError>,
    mut after_piece: impl FnMut(&mut C),
) -> Result<(), ProtocolError> {
    assert!(!pieces.is_empty());
    let mut at = 0;
    let mut next_piece = 0;
    while at < input.len() {
        let mut left = pieces[next_piece % pieces.len()]
            .max(1)
            .min(input.len() - at);
        next_piece += 1;
        while left > 0 {
            let destination = read_buffer(conn);
            // Until it fails, a connection always wants more bytes somewhere.
            assert!(!destination.is_empty(), "empty read buffer at byte {at}");
            let n = destination.len().min(left);
            destination[..n].copy_from_slice(&input[at..at + n]);
            at += n;
            left -= n;
            on_read(conn, n)?;
        }
        after_piece(conn);
    }
    Ok(())
}

/// Takes everything the server queued for writing (up to 64 slices a round, as a driver's
/// vectored send would); returns the bytes when `keep`.
fn server_writes(server: &mut ServerConnection, keep: bool) -> Vec<u8> {
    let mut kept = Vec::new();
    // Bounded: every round writes at least one byte of a finite queue.
    while server.wants_write() {
        let mut slices = Vec::new();
        server.write_slices(&mut slices, 64);
        let n: usize = slices.iter().map(|s| s.len()).sum();
        if keep {
            slices.iter().for_each(|s| kept.extend_from_slice(s));
        }
        drop(slices);
        assert!(n > 0, "wants to write but offers no bytes");
        server.on_written(n);
    }
    kept
}

/// A fresh server with [`PARTITION`] registered: two flushed records, an aligned barrier
/// (blocks the view until ResumeConsumption) and one more record queued in subpartition 0.
/// With `auth`, it requires the consumer to prove it knows [`secret`].
fn fresh_server(nets: &Networks, auth: bool) -> (ServerConnection, ResultPartition) {
    let manager = Arc::new(PartitionManager::new());
    let mut partition = ResultPartition::new(PARTITION, 1, &nets.producer, &nets.config).unwrap();
    manager.register(partition.handle()).unwrap();
    partition.emit_record(&[7u8; 100][..], 0).unwrap();
    partition.emit_record(&[8u8; 100][..], 0).unwrap();
    partition.flush(0);
    partition
        .broadcast_event(&barrier(3, Alignment::Aligned), false)
        .unwrap();
    partition.emit_record(&[9u8; 10][..], 0).unwrap();
    partition.flush(0);
    let server = ServerConnection::with_nonce(
        ServerConfig {
            node: SERVER_NODE,
            segment_size: SEGMENT,
            max_channels: MAX_CHANNELS,
            // Long enough that the 13 waiting requests of `too_many_channels` (650 bytes) are
            // all still waiting when fed byte by byte.
            partition_request_timeout: Duration::from_secs(40),
            secret: auth.then(secret),
            ..ServerConfig::default()
        },
        manager,
        SERVER_NONCE,
    );
    (server, partition)
}

/// Feeds `input` to a fresh server. On an error, checks the server is closing with exactly
/// one connection-level ErrorResponse queued. Every segment is back afterwards.
fn run_server(nets: &Networks, input: &[u8], pieces: &[usize]) -> Result<(), ProtocolError> {
    run_server_with(nets, input, pieces, false).0
}

/// [`run_server`] on a server that requires authentication when `auth`; also says whether
/// the consumer authenticated.
fn run_server_with(
    nets: &Networks,
    input: &[u8],
    pieces: &[usize],
    auth: bool,
) -> (Result<(), ProtocolError>, bool) {
    let (mut server, partition) = fresh_server(nets, auth);
    // The server's own handshake.
    server_writes(&mut server, false);
    let now = Cell::new(nets.start);
    let result = feed(
        &mut server,
        input,
        pieces,
        |s| s.read_buffer(),
        |s, n| s.on_read(n, now.get()),
        |s| {
            // A driver between reads: time passes (fast: a request for a partition that never
            // comes retries every 50 ms and fails after 40 s, 800 pieces), the server sends
            // what it can.
            now.set(now.get() + Duration::from_millis(50));
            s.poll_transmit(now.get());
            server_writes(s, false);
        },
    );
    if let Err(error) = &result {
        assert!(server.is_closing(), "{error:?}: not closing");
        let bytes = server_writes(&mut server, true);
        let frames = split_frames(&bytes);
        assert_eq!(frames.len(), 1, "{error:?}: wrote {frames:?}");
        // The error's kind on the wire, written out here rather than asked of the code under
        // test: refused proofs say Unauthenticated, exceeded limits LimitExceeded, anything
        // else (the peer's own error too) Protocol.
        let kind = match error {
            ProtocolError::Unauthenticated(_) => ErrorKind::Unauthenticated,
            ProtocolError::TooManyChannels { .. } | ProtocolError::RequestRateExceeded { .. } => {
                ErrorKind::LimitExceeded
            }
            _ => ErrorKind::Protocol,
        };
        assert!(
            matches!(
                &frames[0],
                Ok(Message::ErrorResponse {
                    receiver: None,
                    kind: k,
                    ..
                }) if *k == kind
            ),
            "{error:?}: wrote {frames:?}"
        );
    }
    let authenticated = server.is_authenticated();
    if auth && !authenticated {
        assert_eq!(server.reader_count(), 0, "served before authentication");
    }
    drop(server);
    drop(partition);
    nets.assert_all_back("server");
    (result, authenticated)
}

/// A gate with one remote channel consuming subpartition 0 of `partition`.
fn remote_gate(nets: &Networks, partition: ResultPartitionId) -> SingleInputGate {
    let spec = ChannelSpec {
        consumed: ConsumedSubpartition {
            partition,
            subpartition: 0,
        },
        location: ChannelLocation::Remote,
    };
    let mut gate = SingleInputGate::new(
        vec![spec],
        Arc::new(PartitionManager::new()),
        &nets.consumer,
        &nets.config,
    );
    gate.setup().unwrap();
    gate.request_partitions(nets.start).unwrap();
    gate
}

/// Registers the gate's channel on the client.
fn register(client: &mut ClientConnection, gate: &SingleInputGate) -> ReceiverId {
    let channel = gate.remote_channel(0).unwrap();
    client
        .register(channel.shared().clone(), |listener| {
            channel.attach(listener)
        })
        .unwrap()
}

/// A fresh gate with one remote channel and a client with that channel registered; with
/// `auth`, the client authenticates with [`secret`].
fn fresh_client(nets: &Networks, auth: bool) -> (ClientConnection, SingleInputGate) {
    let gate = remote_gate(nets, PARTITION);
    let mut client = ClientConnection::with_config(
        ClientConfig {
            secret: auth.then(secret),
            ..ClientConfig::new(CLIENT_NODE, 4, SEGMENT)
        },
        CLIENT_NONCE,
    );
    assert_eq!(register(&mut client, &gate), RECEIVER);
    (client, gate)
}

/// Feeds `bytes` to the client in one piece, as one read would bring them.
fn client_reads(client: &mut ClientConnection, bytes: &[u8]) -> Result<(), ProtocolError> {
    feed(
        client,
        bytes,
        &[usize::MAX],
        |c| c.read_buffer(),
        |c, n| c.on_read(n),
        |_| {},
    )
}

/// Writes what the client queued; returns the bytes.
fn client_writes(client: &mut ClientConnection) -> Vec<u8> {
    let mut written = Vec::new();
    // Bounded: every round writes at least one byte of a finite queue.
    while client.wants_write() {
        let mut slices = Vec::new();
        client.write_slices(&mut slices, 64);
        let n: usize = slices.iter().map(|s| s.len()).sum();
        slices.iter().for_each(|s| written.extend_from_slice(s));
        drop(slices);
        assert!(n > 0, "wants to write but offers no bytes");
        client.on_written(n);
    }
    written
}

/// Reads what the gate has (dropping buffers: their segments are credit again), resuming
/// after aligned barriers, past events that do not decode. Returns whether the channel
/// reported a failure.
fn drain_gate(gate: &mut SingleInputGate) -> bool {
    // Bounded: a gate holds at most its pool's segments plus overdraft events.
    for _ in 0..10_000 {
        match gate.poll_next() {
            Ok(Some(item)) => {
                if let GateItem::Event {
                    event: Event::CheckpointBarrier(b),
                    ..
                } = &item.item
                {
                    if b.alignment != Alignment::Unaligned {
                        let _ = gate.resume_consumption(item.channel);
                    }
                }
            }
            Ok(None) => return false,
            // A payload that is not an event: that item is lost, the channel goes on.
            Err(GateError::Event { .. }) => {}
            Err(_) => return true,
        }
    }
    panic!("the gate never ran dry");
}

/// Feeds `input` to a fresh client; `read_gate` says whether the gate is read after every
/// `on_read` (or left to fill up). On an error, checks the channel failed. Every segment is
/// back afterwards.
fn run_client(
    nets: &Networks,
    input: &[u8],
    pieces: &[usize],
    read_gate: bool,
) -> Result<(), ProtocolError> {
    run_client_with(nets, input, pieces, read_gate, false).0
}

/// [`run_client`] on a client that authenticates when `auth`; also says whether the producer
/// authenticated.
fn run_client_with(
    nets: &Networks,
    input: &[u8],
    pieces: &[usize],
    read_gate: bool,
    auth: bool,
) -> (Result<(), ProtocolError>, bool) {
    let (mut client, mut gate) = fresh_client(nets, auth);
    // Handshake and partition request.
    client_writes(&mut client);
    let mut now = nets.start;
    let mut channel_failed = false;
    let result = {
        let gate = &mut gate;
        let channel_failed = &mut channel_failed;
        feed(
            &mut client,
            input,
            pieces,
            |c| c.read_buffer(),
            |c, n| {
                c.on_read(n)?;
                if read_gate {
                    *channel_failed |= drain_gate(gate);
                }
                Ok(())
            },
            |c| {
                now += Duration::from_millis(1);
                c.poll_transmit(now);
                client_writes(c);
            },
        )
    };
    if let Err(error) = &result {
        // "An error closes the connection: every channel on it fails" (unless it failed or
        // finished before).
        let finished = gate.is_channel_finished(0);
        channel_failed |= drain_gate(&mut gate);
        assert!(
            finished || channel_failed,
            "{error:?}: the channel did not fail"
        );
    }
    let authenticated = client.is_authenticated();
    drop(client);
    drop(gate);
    nets.assert_all_back("client");
    (result, authenticated)
}

// ---------------------------------------------------------------------------------------------
// Frames

fn frame(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    message.encode(&mut out);
    out
}

fn handshake() -> Vec<u8> {
    frame(&Message::Handshake {
        version: VERSION,
        node: PEER_NODE,
        authenticate: false,
        nonce: [0; 32],
    })
}

/// A handshake that authenticates with `nonce`.
fn authenticating_handshake(nonce: Nonce) -> Vec<u8> {
    frame(&Message::Handshake {
        version: VERSION,
        node: PEER_NODE,
        authenticate: true,
        nonce,
    })
}

/// What a consumer (node [`PEER_NODE`]) that knows [`secret`] sends a fresh authenticating
/// server first: its handshake and its proof.
fn consumer_authentication() -> Vec<u8> {
    let transcript = transcript(PEER_NODE, SERVER_NODE);
    peer_authentication(CLIENT_NONCE, transcript.client_proof(&secret()))
}

/// What a producer (node [`PEER_NODE`]) that knows [`secret`] sends a fresh authenticating
/// client first: its handshake and its proof.
fn producer_authentication() -> Vec<u8> {
    let transcript = transcript(CLIENT_NODE, PEER_NODE);
    peer_authentication(SERVER_NONCE, transcript.server_proof(&secret()))
}

/// The handshake of the fixed nonces between `client_node` and `server_node`.
fn transcript(client_node: u128, server_node: u128) -> Transcript {
    Transcript {
        client_nonce: CLIENT_NONCE,
        server_nonce: SERVER_NONCE,
        client_node,
        server_node,
    }
}

/// A peer's first bytes: its authenticating handshake with `nonce`, then `proof`.
fn peer_authentication(nonce: Nonce, proof: Proof) -> Vec<u8> {
    cat(&[
        &authenticating_handshake(nonce),
        &frame(&Message::AuthProof { proof }),
    ])
}

fn barrier(id: u64, alignment: Alignment) -> Event {
    Event::CheckpointBarrier(CheckpointBarrier {
        id,
        timestamp: 1,
        kind: CheckpointKind::Checkpoint,
        alignment,
    })
}

/// A BufferResponse frame with its payload.
fn buffer_frame(
    receiver: ReceiverId,
    sequence_number: u64,
    data_type: DataType,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = frame(&Message::BufferResponse(BufferResponseHeader {
        receiver,
        sequence_number,
        backlog: 0,
        data_type,
        compressed: false,
        size: payload.len() as u32,
        overtaken: 0,
    }));
    out.extend_from_slice(payload);
    out
}

fn event_frame(
    receiver: ReceiverId,
    sequence_number: u64,
    event: &Event,
    priority: bool,
) -> Vec<u8> {
    let mut payload = Vec::new();
    event.encode(&mut payload);
    buffer_frame(
        receiver,
        sequence_number,
        event.data_type(priority),
        &payload,
    )
}

fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Decodes a byte stream into its frames (as a peer would), stopping at the first bad one.
fn split_frames(mut bytes: &[u8]) -> Vec<Result<Message, String>> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < FRAME_HEADER {
            frames.push(Err(format!("{} trailing bytes", bytes.len())));
            break;
        }
        let header: &[u8; FRAME_HEADER] = bytes[..FRAME_HEADER].try_into().unwrap();
        let frame = match decode_header(header, SEGMENT) {
            Ok(frame) => frame,
            Err(e) => {
                frames.push(Err(e.to_string()));
                break;
            }
        };
        let len = frame.length as usize;
        if frame.id == MessageId::BufferResponse {
            if bytes.len() < BUFFER_RESPONSE_HEADER {
                frames.push(Err("truncated buffer header".into()));
                break;
            }
            let body = &bytes[FRAME_HEADER..BUFFER_RESPONSE_HEADER];
            frames.push(Message::decode(&frame, body).map_err(|e| e.to_string()));
        } else {
            if bytes.len() < len {
                frames.push(Err("truncated frame".into()));
                break;
            }
            frames.push(
                Message::decode(&frame, &bytes[FRAME_HEADER..len]).map_err(|e| e.to_string()),
            );
        }
        bytes = &bytes[len.min(bytes.len())..];
    }
    frames
}

/// Where a stream's frames are and their interesting fields: `(offset, width)` of the frame
/// length, the message id, and per message its size / length / type / flag fields. Walks the
/// length fields while they make sense (works on mutated and corpus bytes too).
fn fields_of(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at + FRAME_HEADER <= bytes.len() {
        let length = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        fields.push((at, 4));
        fields.push((at + 9, 1));
        match bytes[at + 9] {
            // BufferResponse: payload size, data type, flags, sequence number's low byte.
            2 => fields.extend([(at + 40, 4), (at + 38, 1), (at + 39, 1), (at + 33, 1)]),
            // TaskEventRequest: event length.
            5 => fields.push((at + 42, 4)),
            // ErrorResponse: has-receiver, kind, message length.
            9 => fields.extend([(at + 10, 1), (at + 27, 1), (at + 28, 2)]),
            // AddCredit and BacklogAnnouncement: the count.
            3 | 8 => fields.push((at + 26, 4)),
            // Handshake: version, flags.
            0 => fields.extend([(at + 10, 1), (at + 27, 1)]),
            _ => {}
        }
        let length = if bytes[at + 9] == 2 {
            // A BufferResponse's length covers its payload.
            length.max(BUFFER_RESPONSE_HEADER)
        } else {
            length
        };
        if length < FRAME_HEADER {
            break;
        }
        at += length;
    }
    fields
}

// ---------------------------------------------------------------------------------------------
// The corpus

/// What a connection must make of a corpus file: "ok", or the error's variant (decode errors
/// as `Decode::Variant`).
fn label(result: &Result<(), ProtocolError>) -> String {
    fn variant(value: &dyn Debug) -> String {
        let text = format!("{value:?}");
        text.split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or_default()
            .to_owned()
    }
    match result {
        Ok(()) => "ok".to_owned(),
        Err(ProtocolError::Decode(e)) => format!("Decode::{}", variant(e)),
        Err(e) => variant(e),
    }
}

/// One corpus file: its bytes and what the server and the client must make of them (the
/// client with its gate read after every read, and with its gate never read).
struct CorpusEntry {
    name: &'static str,
    bytes: Vec<u8>,
    server: &'static str,
    client: &'static str,
    client_unread: &'static str,
}

fn entry(
    name: &'static str,
    bytes: Vec<u8>,
    server: &'static str,
    client: &'static str,
) -> CorpusEntry {
    CorpusEntry {
        name,
        bytes,
        server,
        client,
        client_unread: client,
    }
}

impl CorpusEntry {
    /// A different outcome for a client whose gate is never read (no credit comes back).
    fn unread(mut self, outcome: &'static str) -> Self {
        self.client_unread = outcome;
        self
    }
}

fn header_only(length: u32, id: u8) -> Vec<u8> {
    let mut out = vec![0; FRAME_HEADER];
    encode_header(&mut out, length as usize, MessageId::CloseRequest);
    out[9] = id;
    out
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The corpus: valid frames of every message type, edge cases, and the outcome expected of
/// each on both sides (the server reads client frames, the client reads server frames).
fn corpus_entries() -> Vec<CorpusEntry> {
    let h = handshake();
    let request = |receiver: u128, credit: u32| {
        frame(&Message::PartitionRequest {
            partition: PARTITION,
            subpartition: 0,
            receiver: ReceiverId(receiver),
            credit,
        })
    };
    let add_credit = |receiver: u128, credit: u32| {
        frame(&Message::AddCredit {
            receiver: ReceiverId(receiver),
            credit,
        })
    };
    let error = |receiver: Option<ReceiverId>, kind: ErrorKind, message: &str| {
        frame(&Message::ErrorResponse {
            receiver,
            kind,
            message: message.to_owned(),
        })
    };
    let data = |seq: u64, len: usize| {
        buffer_frame(
            RECEIVER,
            seq,
            DataType::DataBuffer,
            &payload(len, seq as u8),
        )
    };
    let task_event = |event: Vec<u8>| {
        frame(&Message::TaskEventRequest {
            partition: PARTITION,
            receiver: ReceiverId(5),
            event,
        })
    };
    let mut encoded_task = Vec::new();
    Event::Task(vec![1, 2, 3]).encode(&mut encoded_task);
    // The longest task event the frame limit admits: 52 + segment bytes after the header.
    // An encoded task event of a segment (an `Event::Task` encodes 5 bytes of its own), and
    // one byte more. The header once allowed 16 more (a 52-byte fixed body, not 36).
    let mut longest_task = Vec::new();
    Event::Task(vec![0xAB; SEGMENT - 5]).encode(&mut longest_task);
    let mut too_long_task = Vec::new();
    Event::Task(vec![0xAB; SEGMENT - 4]).encode(&mut too_long_task);
    let mut once_longest_task = Vec::new();
    Event::Task(vec![0xAB; SEGMENT + 16 - 5]).encode(&mut once_longest_task);
    let mut bad_flags = data(0, 4);
    bad_flags[39] = 0b100;
    let mut type_none = data(0, 4);
    type_none[38] = 0;
    let mut type_unknown = data(0, 4);
    type_unknown[38] = 7;
    // The frame claims one byte more than the size field (and the byte is there, so the server,
    // which reads whole bodies, gets to decode it too).
    let mut size_mismatch = data(0, 4);
    size_mismatch[3] += 1;
    size_mismatch.push(0);
    let mut bad_magic = h.clone();
    bad_magic[4] ^= 0x01;
    let mut bad_version = h.clone();
    bad_version[8] = 1;
    let mut bad_kind = error(Some(ReceiverId(5)), ErrorKind::Other, "x");
    bad_kind[27] = 6;
    let mut has_receiver_two = error(Some(ReceiverId(5)), ErrorKind::Other, "x");
    has_receiver_two[10] = 2;
    let mut invalid_utf8 = error(Some(ReceiverId(5)), ErrorKind::Other, "abcd");
    invalid_utf8[30..34].copy_from_slice(&[0xFF, 0xFE, 0xC3, 0x28]);
    let mut add_credit_trailing = add_credit(1 << 64, 1);
    add_credit_trailing.push(0);
    add_credit_trailing[3] += 1;
    let mut handshake_short = h.clone();
    handshake_short.pop();
    handshake_short[3] -= 1;
    let handshake_v3 = frame(&Message::Handshake {
        version: 3,
        node: 9,
        authenticate: false,
        nonce: [0; 32],
    });
    let mut handshake_bad_flags = h.clone();
    handshake_bad_flags[27] = 0b10;
    let proof = frame(&Message::AuthProof {
        proof: [0xA5; PROOF_LEN],
    });
    let mut proof_short = proof.clone();
    proof_short.pop();
    proof_short[3] -= 1;
    // Requests for a partition not registered (yet): each waits, and counts as a channel.
    let too_many_requests: Vec<u8> = (0..=MAX_CHANNELS as u128)
        .flat_map(|r| {
            frame(&Message::PartitionRequest {
                partition: ResultPartitionId {
                    partition: 77,
                    producer: 1,
                },
                subpartition: 0,
                receiver: ReceiverId(100 + r),
                credit: 1,
            })
        })
        .collect();
    let mut error_frame_limit = error(Some(ReceiverId(5)), ErrorKind::Other, "");
    // The longest control frame: a message that fills it to MAX_CONTROL_FRAME, past the 512
    // bytes an encoder sends (refused for its message length, not the frame's).
    let fill = MAX_CONTROL_FRAME - error_frame_limit.len();
    error_frame_limit.extend(std::iter::repeat_n(b'e', fill));
    error_frame_limit[28..30].copy_from_slice(&(fill as u16).to_be_bytes());
    error_frame_limit[0..4].copy_from_slice(&(MAX_CONTROL_FRAME as u32).to_be_bytes());
    let mut error_frame_over = error_frame_limit.clone();
    error_frame_over.push(b'e');
    error_frame_over[28..30].copy_from_slice(&((fill + 1) as u16).to_be_bytes());
    error_frame_over[0..4].copy_from_slice(&(MAX_CONTROL_FRAME as u32 + 1).to_be_bytes());
    let over_segment = {
        let mut out = data(0, SEGMENT);
        out.push(0);
        out[0..4].copy_from_slice(&((BUFFER_RESPONSE_HEADER + SEGMENT + 1) as u32).to_be_bytes());
        out[40..44].copy_from_slice(&(SEGMENT as u32 + 1).to_be_bytes());
        out
    };

    vec![
        // Framing edge cases, the same on both sides.
        entry("empty", Vec::new(), "ok", "ok"),
        entry("handshake", h.clone(), "ok", "ok"),
        entry("truncated_header", h[..5].to_vec(), "ok", "ok"),
        entry("truncated_body", h[..h.len() - 1].to_vec(), "ok", "ok"),
        entry(
            "handshake_then_truncated_header",
            cat(&[&h, &h[..9]]),
            "ok",
            "ok",
        ),
        entry(
            "bad_magic",
            bad_magic,
            "Decode::BadMagic",
            "Decode::BadMagic",
        ),
        entry(
            "bad_version",
            bad_version,
            "Decode::UnsupportedVersion",
            "Decode::UnsupportedVersion",
        ),
        entry(
            "unknown_message_12",
            cat(&[&h, &header_only(10, 12)]),
            "Decode::UnknownMessage",
            "Decode::UnknownMessage",
        ),
        entry(
            "unknown_message_255",
            cat(&[&h, &header_only(10, 255)]),
            "Decode::UnknownMessage",
            "Decode::UnknownMessage",
        ),
        entry(
            "length_zero",
            cat(&[&h, &header_only(0, 7)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "length_below_header",
            cat(&[&h, &header_only(9, 7)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "length_u32_max",
            cat(&[&h, &header_only(u32::MAX, 3)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "control_length_over_limit",
            cat(&[&h, &header_only(MAX_CONTROL_FRAME as u32 + 1, 3)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "handshake_short_body",
            handshake_short,
            "Decode::BodyLength",
            "Decode::BodyLength",
        ),
        entry(
            "handshake_version_3",
            handshake_v3,
            "Handshake",
            "Handshake",
        ),
        entry(
            "handshake_bad_flags",
            handshake_bad_flags,
            "Decode::InvalidField",
            "Decode::InvalidField",
        ),
        // Authentication: these connections have no secret. A server without one lets an
        // authenticating consumer in (the consumer refuses it); a consumer without one refuses
        // a producer that authenticates.
        entry(
            "handshake_authenticating",
            authenticating_handshake([7; 32]),
            "ok",
            "Unauthenticated",
        ),
        entry(
            "auth_proof_unexpected",
            cat(&[&h, &proof]),
            "UnexpectedMessage",
            "UnexpectedMessage",
        ),
        entry(
            "auth_proof_short_body",
            cat(&[&h, &proof_short]),
            "Decode::BodyLength",
            "Decode::BodyLength",
        ),
        entry(
            "too_many_channels",
            cat(&[&h, &too_many_requests]),
            "TooManyChannels",
            "UnexpectedMessage",
        ),
        entry(
            "add_credit_empty_body",
            cat(&[&h, &header_only(10, 3)]),
            "Decode::BodyLength",
            "UnexpectedMessage",
        ),
        entry(
            "add_credit_trailing_byte",
            cat(&[&h, &add_credit_trailing]),
            "Decode::BodyLength",
            "UnexpectedMessage",
        ),
        entry(
            "close_request_empty_body",
            cat(&[&h, &frame(&Message::CloseRequest)]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "control_before_handshake",
            add_credit(1 << 64, 1),
            "Handshake",
            "UnexpectedMessage",
        ),
        // Client → server frames.
        entry(
            "partition_request",
            cat(&[&h, &request(5, 2)]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "partition_request_unknown_partition",
            cat(&[
                &h,
                &frame(&Message::PartitionRequest {
                    partition: ResultPartitionId {
                        partition: 77,
                        producer: 1,
                    },
                    subpartition: 0,
                    receiver: ReceiverId(5),
                    credit: 2,
                }),
            ]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "partition_request_then_add_credit",
            cat(&[&h, &request(5, 0), &add_credit(5, 3)]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "add_credit_zero",
            cat(&[&h, &add_credit(5, 0)]),
            "Decode::InvalidField",
            "UnexpectedMessage",
        ),
        entry(
            "add_credit_overflow",
            cat(&[&h, &request(5, 2), &add_credit(5, u32::MAX)]),
            "CreditOverflow",
            "UnexpectedMessage",
        ),
        entry(
            "partition_request_credit_overflow",
            cat(&[&h, &request(5, (1 << 20) + 1)]),
            "CreditOverflow",
            "UnexpectedMessage",
        ),
        entry(
            "duplicate_receiver",
            cat(&[&h, &request(5, 2), &request(5, 2)]),
            "DuplicateReceiver",
            "UnexpectedMessage",
        ),
        entry(
            "resume_consumption",
            cat(&[
                &h,
                &request(5, 2),
                &frame(&Message::ResumeConsumption {
                    receiver: ReceiverId(5),
                }),
            ]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "ack_all_user_records_processed",
            cat(&[
                &h,
                &request(5, 2),
                &frame(&Message::AckAllUserRecordsProcessed {
                    receiver: ReceiverId(5),
                }),
            ]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "cancel_partition_request",
            cat(&[
                &h,
                &request(5, 2),
                &frame(&Message::CancelPartitionRequest {
                    receiver: ReceiverId(5),
                }),
            ]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "close_request",
            cat(&[&h, &request(5, 2), &frame(&Message::CloseRequest)]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "task_event",
            cat(&[&h, &task_event(encoded_task.clone())]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "task_event_invalid",
            cat(&[&h, &task_event(vec![0xEE, 1, 2])]),
            "Decode::InvalidField",
            "UnexpectedMessage",
        ),
        entry(
            "task_event_empty",
            cat(&[&h, &task_event(Vec::new())]),
            "Decode::InvalidField",
            "UnexpectedMessage",
        ),
        entry(
            "task_event_longest",
            cat(&[&h, &task_event(longest_task)]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "task_event_too_long",
            cat(&[&h, &task_event(too_long_task)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "task_event_16_past_a_segment",
            cat(&[&h, &task_event(once_longest_task)]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "error_response_for_channel",
            cat(&[
                &h,
                &request(5, 2),
                &error(Some(ReceiverId(5)), ErrorKind::Other, "gone"),
            ]),
            "ok",
            "UnexpectedMessage",
        ),
        entry(
            "error_response_invalid_utf8",
            cat(&[&h, &invalid_utf8]),
            "ok",
            "ok",
        ),
        entry(
            "error_response_bad_kind",
            cat(&[&h, &bad_kind]),
            "Decode::InvalidField",
            "Decode::InvalidField",
        ),
        entry(
            "error_response_has_receiver_2",
            cat(&[&h, &has_receiver_two]),
            "Decode::InvalidField",
            "Decode::InvalidField",
        ),
        entry(
            "error_response_longest_message",
            cat(&[
                &h,
                &error(None, ErrorKind::Other, &"m".repeat(MAX_ERROR_MESSAGE)),
            ]),
            "Remote",
            "Remote",
        ),
        entry(
            "error_response_frame_limit",
            cat(&[&h, &error_frame_limit]),
            "Decode::InvalidField",
            "Decode::InvalidField",
        ),
        entry(
            "error_response_frame_over_limit",
            cat(&[&h, &error_frame_over]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        // Server → client frames.
        entry(
            "data_buffer",
            cat(&[&h, &data(0, 100)]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "data_buffer_empty",
            cat(&[&h, &data(0, 0)]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "data_buffer_max",
            cat(&[&h, &data(0, SEGMENT)]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "data_buffer_over_max",
            cat(&[&h, &over_segment]),
            "Decode::BadLength",
            "Decode::BadLength",
        ),
        entry(
            "data_buffers_many",
            cat(&[
                &h,
                &data(0, 10),
                &data(1, SEGMENT),
                &data(2, 0),
                &data(3, 1),
            ]),
            "UnexpectedMessage",
            "ok",
        )
        .unread("CreditExceeded"),
        entry(
            "data_before_handshake",
            data(0, 8),
            "UnexpectedMessage",
            "Handshake",
        ),
        entry(
            "data_wrong_sequence",
            cat(&[&h, &data(0, 8), &data(5, 8), &data(6, 8)]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "data_unknown_receiver",
            cat(&[
                &h,
                &buffer_frame(ReceiverId(3), 0, DataType::DataBuffer, &payload(SEGMENT, 1)),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "data_type_none",
            cat(&[&h, &type_none]),
            "UnexpectedMessage",
            "Decode::InvalidField",
        ),
        entry(
            "data_type_unknown",
            cat(&[&h, &type_unknown]),
            "UnexpectedMessage",
            "Decode::InvalidField",
        ),
        entry(
            "data_bad_flags",
            cat(&[&h, &bad_flags]),
            "UnexpectedMessage",
            "Decode::InvalidField",
        ),
        entry(
            "data_size_mismatch",
            cat(&[&h, &size_mismatch]),
            "UnexpectedMessage",
            "Decode::BodyLength",
        ),
        entry(
            "event_end_of_partition",
            cat(&[
                &h,
                &data(0, 5),
                &event_frame(RECEIVER, 1, &Event::EndOfPartition, false),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "event_priority_barrier",
            cat(&[
                &h,
                &data(0, 5),
                &event_frame(RECEIVER, 1, &barrier(1, Alignment::Unaligned), true),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "event_aligned_barrier",
            cat(&[
                &h,
                &event_frame(RECEIVER, 0, &barrier(1, Alignment::Aligned), false),
                &data(1, 5),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "event_garbage_payload",
            cat(&[
                &h,
                &buffer_frame(RECEIVER, 0, DataType::EventBuffer, &[0xEE; 7]),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "event_empty_payload",
            cat(&[&h, &buffer_frame(RECEIVER, 0, DataType::EventBuffer, &[])]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "backlog_announcement",
            cat(&[
                &h,
                &frame(&Message::BacklogAnnouncement {
                    receiver: RECEIVER,
                    backlog: 5,
                }),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "backlog_zero",
            cat(&[
                &h,
                &frame(&Message::BacklogAnnouncement {
                    receiver: RECEIVER,
                    backlog: 0,
                }),
            ]),
            "UnexpectedMessage",
            "Decode::InvalidField",
        ),
        entry(
            "error_response_channel",
            cat(&[
                &h,
                &error(
                    Some(RECEIVER),
                    ErrorKind::PartitionNotFound,
                    "no such partition",
                ),
                &data(0, 5),
            ]),
            "UnexpectedMessage",
            "ok",
        ),
        entry(
            "error_response_connection",
            cat(&[&h, &error(None, ErrorKind::ProducerFailed, "bye")]),
            "Remote",
            "Remote",
        ),
    ]
}

/// Corpus files on disk, by name (every `*.bin` file).
fn corpus_files() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir())
        .expect("tests/corpus/decoder exists (regenerate_corpus builds it)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// Replays every corpus file through a fresh server and a fresh client, whole, byte by byte
/// and in odd pieces: none panics, and each ends as [`corpus_entries`] says.
fn replay_corpus(nets: &Networks) {
    let expected = corpus_entries();
    let files = corpus_files();
    let on_disk: BTreeSet<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    let known: BTreeSet<&str> = expected.iter().map(|e| e.name).collect();
    assert_eq!(
        on_disk, known,
        "the corpus and corpus_entries() differ: run \
         `cargo test --test decoder_fuzz -- --ignored regenerate_corpus` or add the new file's \
         expectations"
    );
    let mut mismatches = Vec::new();
    for (name, bytes) in &files {
        let entry = expected.iter().find(|e| e.name == name).unwrap();
        for pieces in [&[usize::MAX][..], &[1], &[3, 7, 1000]] {
            let server = label(&run_server(nets, bytes, pieces));
            if server != entry.server {
                mismatches.push(format!(
                    "{name} (pieces {pieces:?}): server {server}, expected {}",
                    entry.server
                ));
            }
            for (read_gate, expected) in [(true, entry.client), (false, entry.client_unread)] {
                let client = label(&run_client(nets, bytes, pieces, read_gate));
                if client != expected {
                    mismatches.push(format!(
                        "{name} (pieces {pieces:?}, gate read {read_gate}): client {client}, expected {expected}"
                    ));
                }
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "corpus outcomes differ:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn corpus_replays_with_the_expected_outcomes() {
    let nets = Networks::new();
    replay_corpus(&nets);
}

#[test]
#[ignore = "writes tests/corpus/decoder: run to rebuild the corpus"]
fn regenerate_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let entries = corpus_entries();
    for (name, _) in corpus_files() {
        if !entries.iter().any(|e| e.name == name) {
            std::fs::remove_file(dir.join(format!("{name}.bin"))).unwrap();
        }
    }
    for entry in &entries {
        std::fs::write(dir.join(format!("{}.bin", entry.name)), &entry.bytes).unwrap();
    }
    println!("wrote {} corpus files to {}", entries.len(), dir.display());
}

// ---------------------------------------------------------------------------------------------
// Strategies

/// Piece sizes a driver's reads return: byte by byte, small, large, everything at once.
fn pieces() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(
        prop_oneof![
            2 => 1usize..=3,
            3 => 1usize..=64,
            2 => 1usize..=SEGMENT + 100,
            1 => Just(usize::MAX),
        ],
        1..6,
    )
}

/// A replacement for a length, size, id or flag field: an interesting absolute value or a
/// nudge of the current one.
#[derive(Clone, Debug)]
enum Value {
    Absolute(u32),
    Delta(i32),
}

fn value() -> impl Strategy<Value = Value> {
    let s = SEGMENT as u32;
    let b = BUFFER_RESPONSE_HEADER as u32;
    prop_oneof![
        3 => (-3i32..=3).prop_map(Value::Delta),
        3 => prop::sample::select(vec![
            0, 1, 2, 7, 8, 9, 10, 11, 36, 37, 38, b - 1, b, b + 1, 255, 256,
            MAX_CONTROL_FRAME as u32 - 1, MAX_CONTROL_FRAME as u32, MAX_CONTROL_FRAME as u32 + 1,
            s - 1, s, s + 1, b + s - 1, b + s, b + s + 1, 62 + s, 63 + s,
            u16::MAX as u32, 1 << 16, 1 << 20, (1 << 20) + 1, 1 << 31, u32::MAX - 1, u32::MAX,
        ]).prop_map(Value::Absolute),
        1 => any::<u32>().prop_map(Value::Absolute),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(Index, u8),
    SetByte(Index, u8),
    Truncate(Index),
    SetField(Index, Value),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    /// Repeats a range (a frame sent twice, a header repeated).
    Duplicate(Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
        2 => any::<Index>().prop_map(Mutation::Truncate),
        4 => (any::<Index>(), value()).prop_map(|(i, v)| Mutation::SetField(i, v)),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..12)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        2 => (any::<Index>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    match mutation {
        Mutation::FlipBit(at, bit) if len > 0 => bytes[at.index(len)] ^= 1 << bit,
        Mutation::SetByte(at, value) if len > 0 => bytes[at.index(len)] = *value,
        Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
        Mutation::SetField(which, value) => {
            let fields = fields_of(bytes);
            if fields.is_empty() {
                return;
            }
            let (at, width) = fields[which.index(fields.len())];
            if at + width > len {
                return;
            }
            let field = &mut bytes[at..at + width];
            let current = field.iter().fold(0u32, |acc, b| (acc << 8) | u32::from(*b));
            let new = match value {
                Value::Absolute(v) => *v,
                Value::Delta(d) => current.wrapping_add_signed(*d),
            };
            let be = new.to_be_bytes();
            field.copy_from_slice(&be[4 - width..]);
        }
        Mutation::Insert(at, inserted) => {
            let at = at.index(len + 1);
            bytes.splice(at..at, inserted.iter().copied());
        }
        Mutation::Delete(at, n) if len > 0 => {
            let at = at.index(len);
            bytes.drain(at..(at + n).min(len));
        }
        Mutation::Duplicate(at, n) if len > 0 => {
            let at = at.index(len);
            let range = bytes[at..(at + n).min(len)].to_vec();
            bytes.splice(at..at, range);
        }
        _ => {}
    }
}

/// Events a valid stream carries in the middle of a channel (not EndOfPartition).
fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        any::<u64>().prop_map(Event::CancelCheckpointMarker),
        (
            any::<u64>(),
            prop_oneof![
                Just(Alignment::Aligned),
                Just(Alignment::Unaligned),
                Just(Alignment::ForcedAligned),
                any::<u64>().prop_map(|timeout_ms| Alignment::AlignedWithTimeout { timeout_ms }),
            ]
        )
            .prop_map(|(id, alignment)| barrier(id, alignment)),
        prop_oneof![Just(StopMode::Drain), Just(StopMode::NoDrain)].prop_map(Event::EndOfData),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Event::Task),
    ]
}

fn error_kind() -> impl Strategy<Value = ErrorKind> {
    prop_oneof![
        Just(ErrorKind::PartitionNotFound),
        Just(ErrorKind::ProducerFailed),
        Just(ErrorKind::Protocol),
        Just(ErrorKind::Other),
    ]
}

fn payload_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(0usize),
        4 => 1usize..200,
        1 => SEGMENT - 4..=SEGMENT,
    ]
}

/// One item of a valid server → client stream.
#[derive(Clone, Debug)]
enum ToClient {
    Data(usize),
    Event(Event, bool),
    Backlog(u32),
    /// Data for a receiver the client does not know (discarded).
    Stray(usize),
    /// An error for the channel (it fails; later frames for it are discarded).
    ChannelError(ErrorKind),
    /// An error for another receiver (ignored).
    OtherError(ErrorKind),
}

fn to_client() -> impl Strategy<Value = ToClient> {
    prop_oneof![
        8 => payload_len().prop_map(ToClient::Data),
        3 => (event(), any::<bool>()).prop_map(|(e, p)| {
            // Only an unaligned barrier may travel with priority.
            let priority = p && matches!(&e, Event::CheckpointBarrier(b) if b.alignment == Alignment::Unaligned);
            ToClient::Event(e, priority)
        }),
        2 => (1u32..20).prop_map(ToClient::Backlog),
        1 => payload_len().prop_map(ToClient::Stray),
        1 => error_kind().prop_map(ToClient::ChannelError),
        1 => error_kind().prop_map(ToClient::OtherError),
    ]
}

/// A valid stream to the client: a handshake, then items for its channel with consecutive
/// sequence numbers, sometimes ending with EndOfPartition.
fn client_stream() -> impl Strategy<Value = Vec<u8>> {
    (prop::collection::vec(to_client(), 0..10), any::<bool>()).prop_map(|(items, end)| {
        let mut out = handshake();
        let mut seq = 0u64;
        for item in items {
            match item {
                ToClient::Data(len) => {
                    out.extend(buffer_frame(
                        RECEIVER,
                        seq,
                        DataType::DataBuffer,
                        &payload(len, seq as u8),
                    ));
                    seq += 1;
                }
                ToClient::Event(event, priority) => {
                    out.extend(event_frame(RECEIVER, seq, &event, priority));
                    seq += 1;
                }
                ToClient::Backlog(backlog) => out.extend(frame(&Message::BacklogAnnouncement {
                    receiver: RECEIVER,
                    backlog,
                })),
                ToClient::Stray(len) => out.extend(buffer_frame(
                    ReceiverId(RECEIVER.0 + 1),
                    0,
                    DataType::DataBuffer,
                    &payload(len, 3),
                )),
                ToClient::ChannelError(kind) => out.extend(frame(&Message::ErrorResponse {
                    receiver: Some(RECEIVER),
                    kind,
                    message: "channel failed".into(),
                })),
                ToClient::OtherError(kind) => out.extend(frame(&Message::ErrorResponse {
                    receiver: Some(ReceiverId(77)),
                    kind,
                    message: "someone else's".into(),
                })),
            }
        }
        if end {
            out.extend(event_frame(RECEIVER, seq, &Event::EndOfPartition, false));
        }
        out
    })
}

/// One item of a valid client → server stream; `Index`es pick a receiver requested earlier.
#[derive(Clone, Debug)]
enum ToServer {
    Request {
        known: bool,
        subpartition: u32,
        credit: u32,
    },
    AddCredit(Index, u32),
    Resume(Index),
    AckAllRecords(Index),
    TaskEvent(Event),
    Cancel(Index),
    ChannelError(Index, ErrorKind, String),
    Close,
}

fn to_server() -> impl Strategy<Value = ToServer> {
    prop_oneof![
        4 => (prop::bool::weighted(0.8), prop_oneof![3 => Just(0u32), 1 => any::<u32>()], 0u32..4)
            .prop_map(|(known, subpartition, credit)| ToServer::Request { known, subpartition, credit }),
        4 => (any::<Index>(), 1u32..=8).prop_map(|(i, c)| ToServer::AddCredit(i, c)),
        2 => any::<Index>().prop_map(ToServer::Resume),
        1 => any::<Index>().prop_map(ToServer::AckAllRecords),
        1 => event().prop_map(ToServer::TaskEvent),
        1 => any::<Index>().prop_map(ToServer::Cancel),
        1 => (any::<Index>(), error_kind(), "[a-z ]{0,20}").prop_map(|(i, k, m)| ToServer::ChannelError(i, k, m)),
        1 => Just(ToServer::Close),
    ]
}

/// A valid stream to the server: a handshake, then requests with fresh receivers and
/// messages for them (small credits: never an overflow).
fn server_stream() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(to_server(), 0..10).prop_map(|items| {
        let mut out = handshake();
        let mut receivers: Vec<ReceiverId> = Vec::new();
        let pick = |receivers: &Vec<ReceiverId>, i: &Index| {
            if receivers.is_empty() {
                ReceiverId(999)
            } else {
                receivers[i.index(receivers.len())]
            }
        };
        for item in items {
            let message = match item {
                ToServer::Request {
                    known,
                    subpartition,
                    credit,
                } => {
                    let receiver = ReceiverId(100 + receivers.len() as u128);
                    receivers.push(receiver);
                    Message::PartitionRequest {
                        partition: if known {
                            PARTITION
                        } else {
                            ResultPartitionId {
                                partition: 5,
                                producer: 5,
                            }
                        },
                        subpartition,
                        receiver,
                        credit,
                    }
                }
                ToServer::AddCredit(i, credit) => Message::AddCredit {
                    receiver: pick(&receivers, &i),
                    credit,
                },
                ToServer::Resume(i) => Message::ResumeConsumption {
                    receiver: pick(&receivers, &i),
                },
                ToServer::AckAllRecords(i) => Message::AckAllUserRecordsProcessed {
                    receiver: pick(&receivers, &i),
                },
                ToServer::TaskEvent(event) => {
                    let mut bytes = Vec::new();
                    event.encode(&mut bytes);
                    Message::TaskEventRequest {
                        partition: PARTITION,
                        receiver: ReceiverId(1),
                        event: bytes,
                    }
                }
                ToServer::Cancel(i) => Message::CancelPartitionRequest {
                    receiver: pick(&receivers, &i),
                },
                ToServer::ChannelError(i, kind, message) => Message::ErrorResponse {
                    receiver: Some(pick(&receivers, &i)),
                    kind,
                    message,
                },
                ToServer::Close => Message::CloseRequest,
            };
            out.extend(frame(&message));
        }
        out
    })
}

/// Which side a base stream is valid for (corpus files: neither, they carry their own
/// expectations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValidFor {
    Client,
    Server,
    Corpus,
}

/// Every message, within the limits an encoder respects (roundtrips exactly).
fn message() -> impl Strategy<Value = Message> {
    let receiver = any::<u128>().prop_map(ReceiverId);
    let partition =
        (any::<u64>(), any::<u64>()).prop_map(|(partition, producer)| ResultPartitionId {
            partition,
            producer,
        });
    let data_type = (1u8..=6).prop_map(|t| DataType::from_ordinal(t).unwrap());
    prop_oneof![
        (any::<u8>(), any::<u128>(), any::<bool>(), any::<Nonce>()).prop_map(
            |(version, node, authenticate, nonce)| Message::Handshake {
                version,
                node,
                authenticate,
                nonce,
            }
        ),
        any::<[u8; PROOF_LEN]>().prop_map(|proof| Message::AuthProof { proof }),
        (
            partition.clone(),
            any::<u32>(),
            receiver.clone(),
            any::<u32>()
        )
            .prop_map(|(partition, subpartition, receiver, credit)| {
                Message::PartitionRequest {
                    partition,
                    subpartition,
                    receiver,
                    credit,
                }
            }),
        (
            receiver.clone(),
            any::<u64>(),
            any::<u32>(),
            data_type,
            any::<bool>(),
            0..=SEGMENT as u32,
            0..=MAX_OVERTAKEN
        )
            .prop_map(
                |(receiver, sequence_number, backlog, data_type, compressed, size, overtaken)| {
                    // As a sender writes them: only data is compressed, only a priority
                    // item overtakes.
                    Message::BufferResponse(BufferResponseHeader {
                        receiver,
                        sequence_number,
                        backlog,
                        data_type,
                        compressed: compressed && data_type.is_buffer(),
                        size,
                        overtaken: if data_type.has_priority() {
                            overtaken
                        } else {
                            0
                        },
                    })
                }
            ),
        (receiver.clone(), 1..=u32::MAX)
            .prop_map(|(receiver, credit)| Message::AddCredit { receiver, credit }),
        receiver
            .clone()
            .prop_map(|receiver| Message::ResumeConsumption { receiver }),
        receiver
            .clone()
            .prop_map(|receiver| Message::AckAllUserRecordsProcessed { receiver }),
        (
            partition,
            receiver.clone(),
            prop::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(partition, receiver, event)| {
                Message::TaskEventRequest {
                    partition,
                    receiver,
                    event,
                }
            }),
        receiver
            .clone()
            .prop_map(|receiver| Message::CancelPartitionRequest { receiver }),
        Just(Message::CloseRequest),
        (receiver.clone(), 1..=u32::MAX)
            .prop_map(|(receiver, backlog)| Message::BacklogAnnouncement { receiver, backlog }),
        (prop::option::of(receiver), error_kind(), "\\PC{0,40}").prop_map(
            |(receiver, kind, message)| {
                Message::ErrorResponse {
                    receiver,
                    kind,
                    message,
                }
            }
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// The fuzz tests

/// Outcome counts of one fuzz test (printed with `--nocapture`: shows what the inputs reach).
#[derive(Default)]
struct Stats(Mutex<BTreeMap<String, u64>>);

impl Stats {
    fn add(&self, key: impl Into<String>, n: u64) {
        *self.0.lock().unwrap().entry(key.into()).or_default() += n;
    }

    fn outcome(&self, side: &str, result: &Result<(), ProtocolError>) {
        self.add(format!("{side} {}", label(result)), 1);
    }
}

/// Runs `cases` cases of `strategy` through `test`, reports cases, executions, time and the
/// outcome counts.
fn fuzz<S: Strategy>(
    name: &'static str,
    strategy: S,
    executions_per_case: u64,
    test: impl Fn(S::Value, &Stats) -> Result<(), TestCaseError>,
) where
    S::Value: Debug,
{
    let cases = budget();
    let mut runner = TestRunner::new(Config {
        cases,
        source_file: Some(file!()),
        test_name: Some(name),
        // Failing cases go to tests/decoder_fuzz.proptest-regressions and are replayed first.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        // A failing input shrinks for at most a minute, not the default's hours.
        max_shrink_time: 60_000,
        ..Config::default()
    });
    let started = Instant::now();
    let ran = AtomicU64::new(0);
    let stats = Stats::default();
    let result = runner.run(&strategy, |value| {
        ran.fetch_add(1, Ordering::Relaxed);
        test(value, &stats)
    });
    let ran = ran.into_inner();
    let mut report = format!(
        "decoder_fuzz {name}: {ran} cases, {} executions, {:.1} s",
        ran * executions_per_case,
        started.elapsed().as_secs_f64()
    );
    for (key, count) in stats.0.into_inner().unwrap() {
        report.push_str(&format!("\n    {count:>10}  {key}"));
    }
    eprintln!("{report}");
    if let Err(error) = result {
        panic!("{name}: {error}");
    }
}

/// (a) Arbitrary bytes: raw, after a valid handshake, and after a handshake and a frame
/// header with our magic and version but any id and length.
#[test]
fn arbitrary_bytes_never_panic_or_leak() {
    let nets = Networks::new();
    replay_corpus(&nets);
    let raw = prop::collection::vec(any::<u8>(), 0..200);
    let after_handshake =
        prop::collection::vec(any::<u8>(), 0..600).prop_map(|b| cat(&[&handshake(), &b]));
    let after_header = (0u8..13, value(), prop::collection::vec(any::<u8>(), 0..300)).prop_map(
        |(id, length, body)| {
            let natural = (FRAME_HEADER + body.len()) as u32;
            let length = match length {
                Value::Absolute(v) => v,
                Value::Delta(d) => natural.wrapping_add_signed(d),
            };
            cat(&[&handshake(), &header_only(length, id), &body])
        },
    );
    let input = prop_oneof![2 => raw, 2 => after_handshake, 3 => after_header];
    fuzz(
        "arbitrary_bytes",
        (input, pieces(), any::<bool>()),
        2,
        |(input, pieces, read_gate), stats| {
            stats.add("bytes fed", 2 * input.len() as u64);
            stats.outcome("server", &run_server(&nets, &input, &pieces));
            stats.outcome("client", &run_client(&nets, &input, &pieces, read_gate));
            Ok(())
        },
    );
}

/// (b) Valid streams in both directions and the corpus files, with 0–4 mutations, fed to a
/// server and a client. An unmutated stream is accepted whole by the side it is for.
#[test]
fn mutated_frame_streams_never_panic_or_leak() {
    let nets = Networks::new();
    replay_corpus(&nets);
    let corpus: Vec<Vec<u8>> = corpus_files().into_iter().map(|(_, b)| b).collect();
    let base = prop_oneof![
        3 => client_stream().prop_map(|b| (ValidFor::Client, b)),
        3 => server_stream().prop_map(|b| (ValidFor::Server, b)),
        1 => prop::sample::select(corpus).prop_map(|b| (ValidFor::Corpus, b)),
    ];
    fuzz(
        "mutated_frame_streams",
        (
            base,
            prop::collection::vec(mutation(), 0..5),
            pieces(),
            any::<bool>(),
        ),
        2,
        |((valid_for, base), mutations, pieces, read_gate), stats| {
            let mut input = base.clone();
            for m in &mutations {
                mutate(&mut input, m);
            }
            stats.add("bytes fed", 2 * input.len() as u64);
            let server = run_server(&nets, &input, &pieces);
            let client = run_client(&nets, &input, &pieces, read_gate);
            stats.outcome("server", &server);
            stats.outcome("client", &client);
            if mutations.is_empty() {
                match valid_for {
                    ValidFor::Server => {
                        prop_assert_eq!(server, Ok(()), "a valid stream to the server")
                    }
                    // Data needs credit: a valid stream is accepted whole when the gate is read.
                    ValidFor::Client if read_gate => {
                        prop_assert_eq!(client, Ok(()), "a valid stream to the client")
                    }
                    _ => {}
                }
            }
            Ok(())
        },
    );
}

/// (c) Authenticated connections: valid streams that authenticate with the shared secret, in
/// both directions, with 0–4 mutations, fed to a server and a client that require it. An
/// unmutated stream authenticates and is accepted whole; a side that authenticated read the
/// valid handshake and proof intact (a mutated proof, nonce, node or flag never passes); a
/// server that did not authenticate served nothing ([`run_server_with`] checks that).
#[test]
fn authenticated_streams_never_pass_a_wrong_proof() {
    let nets = Networks::new();
    let plain_handshake = FRAME_HEADER + HANDSHAKE_BODY;
    let consumer_auth = consumer_authentication();
    let producer_auth = producer_authentication();
    let to_server = {
        let auth = consumer_auth.clone();
        server_stream().prop_map(move |b| (ValidFor::Server, cat(&[&auth, &b[plain_handshake..]])))
    };
    let to_client = {
        let auth = producer_auth.clone();
        client_stream().prop_map(move |b| (ValidFor::Client, cat(&[&auth, &b[plain_handshake..]])))
    };
    let contains =
        |haystack: &[u8], needle: &[u8]| haystack.windows(needle.len()).any(|w| w == needle);
    fuzz(
        "authenticated_streams",
        (
            prop_oneof![to_server, to_client],
            prop::collection::vec(mutation(), 0..5),
            pieces(),
            any::<bool>(),
        ),
        2,
        |((valid_for, base), mutations, pieces, read_gate), stats| {
            let mut input = base.clone();
            for m in &mutations {
                mutate(&mut input, m);
            }
            let (server, server_authenticated) = run_server_with(&nets, &input, &pieces, true);
            let (client, client_authenticated) =
                run_client_with(&nets, &input, &pieces, read_gate, true);
            stats.outcome("server", &server);
            stats.outcome("client", &client);
            stats.add(format!("server authenticated {server_authenticated}"), 1);
            stats.add(format!("client authenticated {client_authenticated}"), 1);
            if server_authenticated {
                prop_assert!(
                    contains(&input, &consumer_auth),
                    "server let a changed proof in"
                );
            }
            if client_authenticated {
                prop_assert!(
                    contains(&input, &producer_auth),
                    "client let a changed proof in"
                );
            }
            if mutations.is_empty() {
                match valid_for {
                    ValidFor::Server => {
                        prop_assert_eq!(server, Ok(()), "a valid stream to the server");
                        prop_assert!(server_authenticated);
                    }
                    ValidFor::Client => {
                        prop_assert!(client_authenticated);
                        if read_gate {
                            prop_assert_eq!(client, Ok(()), "a valid stream to the client");
                        }
                    }
                    ValidFor::Corpus => {}
                }
            }
            Ok(())
        },
    );
}

/// A frame header for `Message::decode`: parsed from bytes by `decode_header` (the path the
/// connections take), or any [`FrameHeader`] value whose length covers the header.
#[derive(Clone, Debug)]
enum HeaderSource {
    Bytes([u8; FRAME_HEADER], usize),
    Natural(u8, Value, usize),
    Direct(u32, u8),
}

fn message_id(id: u8) -> MessageId {
    const IDS: [MessageId; 12] = [
        MessageId::Handshake,
        MessageId::PartitionRequest,
        MessageId::BufferResponse,
        MessageId::AddCredit,
        MessageId::ResumeConsumption,
        MessageId::TaskEventRequest,
        MessageId::CancelPartitionRequest,
        MessageId::CloseRequest,
        MessageId::BacklogAnnouncement,
        MessageId::ErrorResponse,
        MessageId::AuthProof,
        MessageId::AckAllUserRecordsProcessed,
    ];
    IDS[usize::from(id) % IDS.len()]
}

/// Message::decode, decode_header and decode_buffer_response over arbitrary headers and
/// bodies (random, or a valid message's body mutated); what decodes re-encodes within the
/// limits, and encode ∘ decode is idempotent.
#[test]
fn message_decode_never_panics() {
    let max_payload = prop_oneof![3 => Just(SEGMENT), 1 => 0usize..70_000];
    let header = prop_oneof![
        1 => (any::<[u8; FRAME_HEADER]>(), max_payload.clone()).prop_map(|(mut b, max)| {
            // Mostly our magic and version, so the id and length get checked.
            b[4..8].copy_from_slice(&MAGIC.to_be_bytes());
            b[8] = VERSION;
            HeaderSource::Bytes(b, max)
        }),
        3 => (0u8..11, value(), max_payload.clone()).prop_map(|(id, v, max)| HeaderSource::Natural(id, v, max)),
        1 => (FRAME_HEADER as u32..=u32::MAX, 0u8..11).prop_map(|(length, id)| HeaderSource::Direct(length, id)),
    ];
    let body = prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..1100),
        2 => (message(), prop::collection::vec(mutation(), 0..3)).prop_map(|(m, mutations)| {
            let mut bytes = frame(&m);
            for mutation in &mutations {
                mutate(&mut bytes, mutation);
            }
            bytes.split_off(FRAME_HEADER.min(bytes.len()))
        }),
    ];
    // A valid frame mutated, its header and body read as a connection would.
    let framed = (
        message(),
        prop::collection::vec(mutation(), 0..4),
        max_payload.clone(),
    )
        .prop_map(|(m, mutations, max)| {
            let mut bytes = frame(&m);
            for mutation in &mutations {
                mutate(&mut bytes, mutation);
            }
            bytes.resize(bytes.len().max(FRAME_HEADER), 0);
            let body = bytes.split_off(FRAME_HEADER);
            (HeaderSource::Bytes(bytes.try_into().unwrap(), max), body)
        });
    let input = prop_oneof![2 => (header, body), 3 => framed];
    fuzz(
        "message_decode",
        (input, message()),
        1,
        |((source, body), valid), stats| {
            // A valid message roundtrips exactly.
            let bytes = frame(&valid);
            let header: &[u8; FRAME_HEADER] = bytes[..FRAME_HEADER].try_into().unwrap();
            let parsed = decode_header(header, SEGMENT)
                .map_err(|e| TestCaseError::fail(format!("{valid:?}: {e}")))?;
            prop_assert_eq!(
                Message::decode(&parsed, &bytes[FRAME_HEADER..]),
                Ok(valid.clone())
            );

            let parsed = match source {
                HeaderSource::Bytes(bytes, max) => {
                    decode_header(&bytes, max).ok().map(|f| (f, max))
                }
                HeaderSource::Natural(id, length, max) => {
                    let natural = (FRAME_HEADER + body.len()) as u32;
                    let length = match length {
                        Value::Absolute(v) => v,
                        Value::Delta(d) => natural.wrapping_add_signed(d),
                    };
                    let mut bytes = [0u8; FRAME_HEADER];
                    encode_header(&mut bytes, length as usize, message_id(id));
                    decode_header(&bytes, max).ok().map(|f| (f, max))
                }
                HeaderSource::Direct(length, id) => Some((
                    FrameHeader {
                        length,
                        id: message_id(id),
                    },
                    SEGMENT,
                )),
            };
            let Some((header, max)) = parsed else {
                stats.add("header rejected", 1);
                return Ok(());
            };
            if header.id == MessageId::BufferResponse && body.len() >= BUFFER_RESPONSE_BODY {
                let fixed: &[u8; BUFFER_RESPONSE_BODY] =
                    body[..BUFFER_RESPONSE_BODY].try_into().unwrap();
                let _ = decode_buffer_response(&header, fixed);
            }
            let decoded = match Message::decode(&header, &body) {
                Ok(decoded) => decoded,
                Err(e) => {
                    stats.add(format!("{:?} {}", header.id, label(&Err(e.into()))), 1);
                    return Ok(());
                }
            };
            stats.add(format!("{:?} ok", header.id), 1);
            // What decodes re-encodes as a frame the same limits accept, and decodes to a fixed
            // point (an error message may be made valid UTF-8 and cut to the encoder's limit).
            let again = frame(&decoded);
            let header: &[u8; FRAME_HEADER] = again[..FRAME_HEADER].try_into().unwrap();
            let reframe = decode_header(header, max)
                .map_err(|e| TestCaseError::fail(format!("re-encoded {decoded:?}: {e}")))?;
            let redecoded = Message::decode(&reframe, &again[FRAME_HEADER..])
                .map_err(|e| TestCaseError::fail(format!("re-encoded {decoded:?}: {e}")))?;
            prop_assert_eq!(frame(&redecoded), again);
            if !matches!(&decoded, Message::ErrorResponse { message, .. } if message.len() > MAX_ERROR_MESSAGE)
            {
                prop_assert_eq!(redecoded, decoded);
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Bugs found on the way (each test states the expected behaviour and fails today)

/// `FrameHeader` and `Message::decode` are public, but a header whose length is below the
/// frame header (which `decode_header` never returns, but any caller can build) makes a
/// BufferResponse whose size disagrees with it panic in `FrameHeader::body_len` ("attempt to
/// subtract with overflow") while building the `BodyLength` error. Only with overflow checks
/// (debug builds, `cargo test`); a release build reports a wrapped `actual` length instead.
#[test]
fn message_decode_reports_a_frame_length_below_the_header_as_an_error() {
    let mut body = [0u8; BUFFER_RESPONSE_BODY];
    body[28] = DataType::DataBuffer as u8;
    body[33] = 5; // payload size 5: the frame should be 53 bytes long
    for length in 0..FRAME_HEADER as u32 {
        let header = FrameHeader {
            length,
            id: MessageId::BufferResponse,
        };
        let decoded = std::panic::catch_unwind(|| Message::decode(&header, &body));
        assert!(
            matches!(decoded, Ok(Err(DecodeError::BodyLength { .. }))),
            "length {length}: {decoded:?}"
        );
    }
}

/// Two gates (two tasks) share one connection. One gate closes (its task finished or was
/// cancelled) while its producer still has a data buffer in flight, which it sent with credit
/// the channel had announced. The buffer arrives before the client's next `poll_transmit`
/// (which would drop the released channel and cancel it): `begin_payload` finds the channel
/// still registered, asks its released `BufferManager` for a segment, gets none and fails the
/// whole connection with `CreditExceeded` (an event in flight: no event memory, the gate's
/// pool is gone), which fails the other gate's healthy channel too. Flink's client handler
/// discards a buffer for a released channel and cancels it; the client should check
/// `is_released()` before reserving a segment and take the discard path.
#[test]
fn a_buffer_in_flight_for_a_closed_gate_is_discarded() {
    let nets = Networks::new();
    for event in [false, true] {
        let mut closing = remote_gate(&nets, PARTITION);
        let other_partition = ResultPartitionId {
            partition: 1,
            producer: 1,
        };
        let mut healthy = remote_gate(&nets, other_partition);
        let mut client = ClientConnection::new(2, 4, SEGMENT);
        let closing_receiver = register(&mut client, &closing);
        register(&mut client, &healthy);
        client_writes(&mut client);
        closing.close();
        let in_flight = if event {
            event_frame(closing_receiver, 0, &Event::EndOfPartition, false)
        } else {
            buffer_frame(
                closing_receiver,
                0,
                DataType::DataBuffer,
                b"sent with credit",
            )
        };
        let input = cat(&[&handshake(), &in_flight]);
        let result = client_reads(&mut client, &input);
        assert_eq!(result, Ok(()), "event {event}");
        assert!(matches!(healthy.poll_next(), Ok(None)), "event {event}");
        drop((client, closing, healthy));
        nets.assert_all_back("closed gate");
    }
}

/// An event arrives while the consumer's whole network memory is in use: there is no segment
/// to read it into. That is no reason to fail anything (a barrier arriving under full
/// back-pressure is the ordinary case of an unaligned checkpoint): the event is read into
/// memory mapped for it alone, as Flink reads events into unpooled buffers, and reaches its
/// channel like any other; the other channel on the connection goes on. (It failed its
/// channel before, and the whole connection before that.)
#[test]
fn an_event_without_network_memory_arrives_in_memory_of_its_own() {
    let nets = Networks::new();
    let mut starved = remote_gate(&nets, PARTITION);
    let other_partition = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let mut healthy = remote_gate(&nets, other_partition);
    let mut client = ClientConnection::new(2, 4, SEGMENT);
    let starved_receiver = register(&mut client, &starved);
    let healthy_receiver = register(&mut client, &healthy);
    client_writes(&mut client);
    // A floating segment used once stays with the gate's pool (it holds its minimum).
    let pool = starved.pool().expect("set up").clone();
    drop(pool.request_segment().expect("the pool grows"));
    let free_in_gate = pool.available_segments();
    assert!(free_in_gate > 0, "the gate holds a free segment");
    let hoard: Vec<_> = std::iter::from_fn(|| nets.consumer.request_segment()).collect();
    assert_eq!(nets.consumer.available_segments(), 0);
    // Not the gate's free segment either: its channels waiting for floating ones need it.
    let drain = Event::EndOfData(fluxgate::event::StopMode::Drain);
    let first = cat(&[
        &handshake(),
        &event_frame(starved_receiver, 0, &drain, false),
    ]);
    assert_eq!(client_reads(&mut client, &first), Ok(()));
    let read = starved
        .poll_next()
        .expect("the event was read")
        .expect("an item");
    assert!(
        matches!(read.item, GateItem::Event { ref event, .. } if *event == drain),
        "{:?}",
        read.item
    );
    assert_eq!(pool.available_segments(), free_in_gate);
    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
        id: 7,
        timestamp: 70,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Unaligned,
    });
    let input = cat(&[
        &event_frame(starved_receiver, 1, &barrier, true),
        &event_frame(starved_receiver, 2, &Event::EndOfPartition, false),
        &buffer_frame(healthy_receiver, 0, DataType::DataBuffer, b"credited"),
    ]);
    let result = client_reads(&mut client, &input);
    assert_eq!(result, Ok(()), "the connection goes on");
    let mut events = Vec::new();
    while let Some(read) = starved.poll_next().expect("the channel is healthy") {
        match read.item {
            GateItem::Event { event, .. } => events.push(event),
            other => panic!("only events were sent, read {other:?}"),
        }
    }
    assert_eq!(events, [barrier, Event::EndOfPartition]);
    let item = healthy
        .poll_next()
        .expect("the other channel is healthy")
        .expect("its buffer arrived, read into its own credited segment");
    assert!(matches!(item.item, GateItem::Buffer(ref b) if b.as_slice() == b"credited"));
    drop((item, read, hoard, pool, client, starved, healthy));
    nets.assert_all_back("events without network memory");
}

/// A gate closed before its channel reached the connection (the driver registers channels
/// later, on its own thread): the request goes out, and so does its cancellation, so the
/// producer does not keep a subpartition for a consumer that is gone. (Without exclusive
/// buffers nothing else would ever cancel it: no payload comes to find it released.)
#[test]
fn a_channel_released_before_it_was_registered_is_cancelled() {
    let nets = Networks::new();
    let mut gate = remote_gate(&nets, PARTITION);
    gate.close();
    let mut client = ClientConnection::new(2, 4, SEGMENT);
    let receiver = register(&mut client, &gate);
    let result = client_reads(&mut client, &handshake());
    assert_eq!(result, Ok(()));
    client.poll_transmit(nets.start);
    let sent = split_frames(&client_writes(&mut client));
    let at = |message: Message| sent.iter().position(|m| m.as_ref() == Ok(&message));
    let cancel = at(Message::CancelPartitionRequest { receiver });
    assert!(cancel.is_some(), "sent {sent:?}");
    assert_eq!(client.channel_count(), 0, "the channel left");
    // Its last channel gone, the connection closes, after the cancellation.
    assert!(
        at(Message::CloseRequest) > cancel,
        "the connection closes after the cancellation: {sent:?}"
    );
    assert!(client.is_closed());
    drop((client, gate));
    nets.assert_all_back("released before registration");
}

/// A producer that streams empty BufferResponses for receivers the consumer does not know,
/// and never reads: each is answered with a cancellation, and the consumer's queue of them
/// would grow without bound. Past `MAX_QUEUED_CONTROL` (and the room the consumer keeps for
/// its own task events) the connection fails with a typed error instead, and the queue is
/// dropped.
#[test]
fn a_flood_of_frames_answered_with_cancellations_fails_at_the_control_limit() {
    let nets = Networks::new();
    let (mut client, gate) = fresh_client(&nets, false);
    client_writes(&mut client);
    let unknown = buffer_frame(ReceiverId(999), 0, DataType::DataBuffer, &[]);
    let cancel = frame(&Message::CancelPartitionRequest {
        receiver: ReceiverId(999),
    });
    let frames = 2 * fluxgate::protocol::MAX_QUEUED_CONTROL / cancel.len();
    let mut input = handshake();
    for _ in 0..frames {
        input.extend_from_slice(&unknown);
    }
    let result = client_reads(&mut client, &input);
    assert!(
        matches!(result, Err(ProtocolError::ControlBacklog { bytes }) if bytes > fluxgate::protocol::MAX_QUEUED_CONTROL),
        "{result:?}"
    );
    assert!(client.is_closed());
    let queued = client_writes(&mut client).len();
    assert!(
        queued <= fluxgate::protocol::MAX_QUEUED_CONTROL,
        "the backlog was dropped ({queued} bytes left)"
    );
    drop((client, gate));
    nets.assert_all_back("control flood");
}

/// A payload half read when its channel's gate closes: the channel leaves (its slot is free)
/// and a new channel takes the slot before the rest arrives. The rest is discarded; it never
/// reaches the new channel, whose first buffer it would have been.
#[test]
fn a_payload_for_a_channel_that_left_never_reaches_the_one_in_its_slot() {
    let nets = Networks::new();
    let mut closing = remote_gate(&nets, PARTITION);
    let mut client = ClientConnection::new(2, 4, SEGMENT);
    let closing_receiver = register(&mut client, &closing);
    // A second channel keeps the connection open when the first leaves.
    let staying = remote_gate(
        &nets,
        ResultPartitionId {
            partition: 2,
            producer: 1,
        },
    );
    register(&mut client, &staying);
    client_writes(&mut client);
    let in_flight = buffer_frame(closing_receiver, 0, DataType::DataBuffer, &[7u8; 600]);
    let input = cat(&[&handshake(), &in_flight]);
    let (first, rest) = input.split_at(input.len() - 300);
    assert_eq!(client_reads(&mut client, first), Ok(()));
    // The gate closes mid-payload; the client's next turn lets the channel go.
    closing.close();
    client.poll_transmit(nets.start);
    client_writes(&mut client);
    let other = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let mut fresh = remote_gate(&nets, other);
    let fresh_receiver = register(&mut client, &fresh);
    assert_ne!(fresh_receiver, closing_receiver);
    assert_eq!(
        fresh_receiver.0 as u64, closing_receiver.0 as u64,
        "the new channel has the slot of the one that left"
    );
    assert_eq!(client_reads(&mut client, rest), Ok(()));
    assert!(
        matches!(fresh.poll_next(), Ok(None)),
        "the new channel got nothing"
    );
    drop((client, closing, staying, fresh));
    nets.assert_all_back("channel that left mid-payload");
}

/// The server writes a BufferResponse partly (a short vectored send), then reads a bad frame.
/// `fail` clears the outbound queue, the partly written frame included, and queues the
/// ErrorResponse: its bytes continue the torn frame on the wire, so the peer never reads the
/// ErrorResponse (it reads them as the rest of the BufferResponse header and fails on
/// garbage, or waits for a payload that never comes). "Send what is queued (an
/// ErrorResponse), then close" needs the partly written frame finished first.
#[test]
fn an_error_response_follows_a_partly_written_frame_intact() {
    let nets = Networks::new();
    let (mut server, partition) = fresh_server(&nets, false);
    let mut wire = server_writes(&mut server, true);
    let request = frame(&Message::PartitionRequest {
        partition: PARTITION,
        subpartition: 0,
        receiver: ReceiverId(5),
        credit: 2,
    });
    let input = cat(&[&handshake(), &request]);
    let now = nets.start;
    feed(
        &mut server,
        &input,
        &[usize::MAX],
        |s| s.read_buffer(),
        |s, n| s.on_read(n, now),
        |_| {},
    )
    .unwrap();
    server.poll_transmit(now);
    // A short send: the first 20 bytes of the BufferResponse.
    let mut slices = Vec::new();
    server.write_slices(&mut slices, 64);
    let first: Vec<u8> = slices
        .iter()
        .flat_map(|s| s.iter().copied())
        .take(20)
        .collect();
    drop(slices);
    assert_eq!(first.len(), 20);
    wire.extend_from_slice(&first);
    server.on_written(20);
    // Then the peer sends garbage.
    let result = feed(
        &mut server,
        &[0xFF; FRAME_HEADER],
        &[usize::MAX],
        |s| s.read_buffer(),
        |s, n| s.on_read(n, now),
        |_| {},
    );
    assert!(matches!(
        result,
        Err(ProtocolError::Decode(DecodeError::BadMagic(_)))
    ));
    wire.extend(server_writes(&mut server, true));
    let frames = split_frames(&wire);
    assert!(
        frames.iter().any(|f| matches!(
            f,
            Ok(Message::ErrorResponse {
                receiver: None,
                kind: ErrorKind::Protocol,
                ..
            })
        )),
        "the peer reads {frames:?}"
    );
    drop((server, partition));
    nets.assert_all_back("torn frame");
}

/// A driver that gives up on a read still in flight (its cancellation never completed) takes
/// the payload's destination segment out before the connection is lost: the channel fails as
/// for any lost connection, but the segment the kernel may still write stays out of the pool
/// until the driver lets go of it, never handed to another buffer under that write.
#[test]
fn a_payload_destination_taken_out_stays_out_of_the_pool_when_the_connection_is_lost() {
    let nets = Networks::new();
    let mut gate = remote_gate(&nets, PARTITION);
    let mut client = ClientConnection::new(2, 4, SEGMENT);
    let receiver = register(&mut client, &gate);
    client_writes(&mut client);
    let frame = buffer_frame(receiver, 0, DataType::DataBuffer, &payload(1000, 3));
    let partial = cat(&[&handshake(), &frame[..frame.len() - 500]]);
    assert_eq!(client_reads(&mut client, &partial), Ok(()));
    let destination = client
        .take_payload_destination()
        .expect("a payload is being read");
    let in_use = nets.consumer.total_segments() - nets.consumer.available_segments();
    client.on_connection_lost("shutdown gave up on the read");
    assert!(
        matches!(
            gate.poll_next(),
            Err(GateError::Transport { channel: 0, .. })
        ),
        "the channel fails"
    );
    gate.close();
    drop(gate);
    assert_eq!(
        nets.consumer.total_segments() - nets.consumer.available_segments(),
        1,
        "only the destination is out of the pool ({in_use} were before the loss)"
    );
    drop(destination);
    drop(client);
    nets.assert_all_back("destination given back by its holder");
}

/// Events need no credit, so a producer could send them faster than the consumer's task
/// reads them, each into memory of its own once the overdraft is used up. One more than
/// `UNCREDITED_EVENTS` unread fails only that channel (its payload discarded unread); the
/// connection and its other channels go on, and no memory is taken for the flood.
#[test]
fn a_flood_of_events_fails_its_channel_before_taking_memory_for_it() {
    let nets = Networks::new();
    let mut flooded = remote_gate(&nets, PARTITION);
    let other_partition = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let mut healthy = remote_gate(&nets, other_partition);
    let mut client = ClientConnection::new(2, 4, SEGMENT);
    let flooded_receiver = register(&mut client, &flooded);
    let healthy_receiver = register(&mut client, &healthy);
    client_writes(&mut client);
    let mut input = handshake();
    let limit = fluxgate::gate::UNCREDITED_EVENTS as u64;
    for sequence in 0..=limit {
        let marker = Event::CancelCheckpointMarker(sequence);
        input.extend(event_frame(flooded_receiver, sequence, &marker, false));
    }
    input.extend(buffer_frame(
        healthy_receiver,
        0,
        DataType::DataBuffer,
        b"credited",
    ));
    assert_eq!(
        client_reads(&mut client, &input),
        Ok(()),
        "the connection goes on"
    );
    let shared = flooded.remote_channel(0).expect("remote").shared().clone();
    assert_eq!(shared.unread_events(), fluxgate::gate::UNCREDITED_EVENTS);
    let mut read = 0;
    let failure = loop {
        match flooded.poll_next() {
            Ok(Some(_)) => read += 1,
            Ok(None) => panic!("the flooded channel did not fail"),
            Err(error) => break error,
        }
    };
    assert!(
        matches!(failure, GateError::CreditExceeded(0)),
        "{failure:?} after {read} events"
    );
    let item = healthy
        .poll_next()
        .expect("the other channel is healthy")
        .expect("its buffer arrived");
    assert!(matches!(item.item, GateItem::Buffer(ref b) if b.as_slice() == b"credited"));
    drop((item, client, flooded, healthy, shared));
    nets.assert_all_back("a flood of events");
}

/// A priority event claiming to overtake more than a sender's queue can hold is a decode
/// error (a typed error and a closed connection), not an instruction to persist every later
/// buffer of its channel as in-flight data.
/// A BufferResponse frame too short for its own fixed header is refused by its frame header,
/// at once: the client read the rest of its 38-byte header from whatever followed on the
/// wire, so with nothing following (a producer with nothing to send) the connection stayed
/// open with no error.
#[test]
fn a_buffer_response_shorter_than_its_header_is_refused_at_once() {
    let nets = Networks::new();
    for length in [FRAME_HEADER, FRAME_HEADER + 1, BUFFER_RESPONSE_HEADER - 1] {
        let input = cat(&[
            &handshake(),
            &header_only(length as u32, MessageId::BufferResponse as u8),
        ]);
        let result = run_client(&nets, &input, &[input.len()], true);
        assert!(
            matches!(
                result,
                Err(ProtocolError::Decode(DecodeError::BodyLength { .. }))
            ),
            "length {length}: {result:?}"
        );
    }
    nets.assert_all_back("short BufferResponse");
}

/// A peer's error text reaches our logs and errors with its control characters escaped: a
/// newline in it would forge a log line of its own, an escape sequence drive a terminal.
#[test]
fn a_peer_s_error_text_comes_with_its_control_characters_escaped() {
    let bytes = frame(&Message::ErrorResponse {
        receiver: None,
        kind: ErrorKind::Other,
        message: "x\nFORGED \u{1b}[31mred é".into(),
    });
    let header = decode_header(bytes[..FRAME_HEADER].try_into().unwrap(), SEGMENT).unwrap();
    match Message::decode(&header, &bytes[FRAME_HEADER..]) {
        Ok(Message::ErrorResponse { message, .. }) => {
            assert_eq!(message, "x\\nFORGED \\u{1b}[31mred é")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_buffer_response_overtaking_more_than_a_queue_holds_is_refused() {
    for (overtaken, accepted) in [(MAX_OVERTAKEN, true), (MAX_OVERTAKEN + 1, false)] {
        let header = BufferResponseHeader {
            receiver: RECEIVER,
            sequence_number: 0,
            backlog: 0,
            data_type: DataType::PrioritizedEventBuffer,
            compressed: false,
            size: 0,
            overtaken,
        };
        let bytes = frame(&Message::BufferResponse(header));
        let frame_header =
            decode_header(bytes[..FRAME_HEADER].try_into().unwrap(), SEGMENT).unwrap();
        let body: &[u8; BUFFER_RESPONSE_BODY] = bytes[FRAME_HEADER..BUFFER_RESPONSE_HEADER]
            .try_into()
            .unwrap();
        let decoded = decode_buffer_response(&frame_header, body);
        assert_eq!(
            decoded.is_ok(),
            accepted,
            "overtaken {overtaken}: {decoded:?}"
        );
    }
}

/// A task event may be as long as a segment, no longer: the frame header's limit was 16
/// bytes above it (the body's fixed fields counted as 52 bytes, not 36).
#[test]
fn a_task_event_longer_than_a_segment_is_refused_by_its_header() {
    for (len, accepted) in [(SEGMENT, true), (SEGMENT + 1, false), (SEGMENT + 16, false)] {
        let bytes = frame(&Message::TaskEventRequest {
            partition: ResultPartitionId {
                partition: 1,
                producer: 2,
            },
            receiver: RECEIVER,
            event: vec![0; len],
        });
        assert_eq!(bytes.len(), TASK_EVENT_REQUEST_HEADER + len);
        let header = decode_header(bytes[..FRAME_HEADER].try_into().unwrap(), SEGMENT);
        assert_eq!(header.is_ok(), accepted, "{len} bytes: {header:?}");
    }
}

/// An error message longer than the encoder ever writes (it cuts at `MAX_ERROR_MESSAGE`
/// bytes) is refused, not shown.
#[test]
fn an_error_message_longer_than_any_encoder_writes_is_refused() {
    for (len, accepted) in [(MAX_ERROR_MESSAGE, true), (MAX_ERROR_MESSAGE + 1, false)] {
        let text = "e".repeat(len);
        let mut body = vec![0u8];
        body.extend_from_slice(&0u128.to_be_bytes());
        body.push(ErrorKind::Other as u8);
        body.extend_from_slice(&(len as u16).to_be_bytes());
        body.extend_from_slice(text.as_bytes());
        let mut bytes = vec![0u8; FRAME_HEADER];
        encode_header(
            &mut bytes,
            FRAME_HEADER + body.len(),
            MessageId::ErrorResponse,
        );
        bytes.extend_from_slice(&body);
        let header = decode_header(bytes[..FRAME_HEADER].try_into().unwrap(), SEGMENT).unwrap();
        let decoded = Message::decode(&header, &bytes[FRAME_HEADER..]);
        assert_eq!(decoded.is_ok(), accepted, "{len} bytes: {decoded:?}");
    }
}
