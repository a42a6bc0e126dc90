//! Hostile peers against a live server, on both drivers (`_epoll`, `_uring`; the io_uring
//! variants skip loudly where the kernel refuses io_uring).
//!
//! A producer environment serves a real partition to a well-behaved consumer environment
//! while raw `std::net::TcpStream` peers connect and send malformed frames, floods and wrong
//! proofs. For each, the server answers with an ErrorResponse or closes that connection
//! (read until EOF, bounded), never panics, gets every segment back, and the exchange on the
//! other connection keeps flowing and verifies every record. Then the authenticated
//! handshake: the right secret works end to end; a wrong or missing one fails the consumer's
//! gate with `GateError::Unauthenticated` within a bounded time.
//!
//! No sleeps as synchronization: every wait is on a condition with a deadline, every loop is
//! bounded.

#[macro_use]
mod common;

use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use fluxgate::config::{SecretError, SECRET_ENV};
use fluxgate::env::EnvError;
use fluxgate::gate::{ConsumedSubpartition, GateError, ReaderError, ReaderItem, RecordReader};
use fluxgate::io::{DriverStats, Transport};
use fluxgate::partition::{BufferTimeout, RecordWriter, ResultPartitionId, RoundRobinSelector};
use fluxgate::protocol::auth::{Nonce, Transcript};
use fluxgate::protocol::frame::{
    decode_header, encode_buffer_response, encode_header, BufferResponseHeader, FrameHeader,
    BUFFER_RESPONSE_HEADER, FRAME_HEADER, VERSION,
};
use fluxgate::protocol::{ErrorKind, Message, MessageId, ReceiverId, Secret};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

/// Bound of every wait (a hang fails the test, it does not pass it).
const LONG: Duration = Duration::from_secs(30);
const SEGMENT: usize = 8 * 1024;
/// The partition the well-behaved consumer reads.
const LIVE: ResultPartitionId = ResultPartitionId {
    partition: 1,
    producer: 7,
};
/// A partition only chaos peers request (one subpartition per case that needs a view).
const CHAOS: ResultPartitionId = ResultPartitionId {
    partition: 2,
    producer: 7,
};
/// A partition nobody registers (requests for it wait, counting as channels).
const MISSING: ResultPartitionId = ResultPartitionId {
    partition: 99,
    producer: 7,
};
/// Limits of the producer under attack.
const MAX_CHANNELS: usize = 16;
const REQUEST_RATE: u32 = 50;
const REQUEST_BURST: u32 = 20;
const SHARED_SECRET: &[u8] = b"chaos peer test: the cluster's shared secret";

// ---------------------------------------------------------------------------------------------
// Environments

/// A file holding `secret`, removed when dropped.
struct SecretFile(PathBuf);

impl SecretFile {
    fn new(name: &str, secret: &[u8]) -> Self {
        let dir = std::env::temp_dir().join(format!("fluxgate-chaos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        // A final newline, as an editor or `echo` leaves it: not part of the secret.
        std::fs::write(&path, [secret, b"\n"].concat()).unwrap();
        Self(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn network(options: &[(&str, &str)]) -> NetworkConfig {
    let mut network = NetworkConfig::default();
    for (key, value) in [
        ("taskmanager.memory.segment-size", "8kb"),
        ("taskmanager.memory.network.max", "16mb"),
        ("fluxgate.memory.arena-size", "4mb"),
    ]
    .iter()
    .chain(options)
    {
        network.set(key, value).unwrap();
    }
    network
}

fn start(node: u128, transport: Transport, options: &[(&str, &str)]) -> ShuffleEnvironment {
    let env = ShuffleEnvironment::start(EnvConfig {
        network: network(options),
        node,
        transport,
        ..EnvConfig::default()
    })
    .unwrap();
    assert_eq!(env.transport(), transport, "the requested driver runs");
    env
}

/// Options that switch authentication on with the secret in `file`.
fn auth_options(file: &SecretFile) -> [(&'static str, &str); 2] {
    [
        ("fluxgate.security.auth", "on"),
        ("fluxgate.security.secret-file", file.path()),
    ]
}

fn channel(partition: ResultPartitionId, peer: SocketAddr) -> ChannelDescriptor {
    ChannelDescriptor {
        consumed: ConsumedSubpartition {
            partition,
            subpartition: 0,
        },
        location: ProducerLocation::Remote(peer),
    }
}

fn record(seq: u64) -> Vec<u8> {
    let len = (seq.wrapping_mul(2654435761) % 700) as usize + if seq % 89 == 0 { 9000 } else { 0 };
    let mut bytes = seq.to_be_bytes().to_vec();
    bytes.resize(8 + len, (seq % 251) as u8);
    bytes
}

// ---------------------------------------------------------------------------------------------
// The well-behaved exchange

/// A live exchange of `records` records from `producer` to `consumer`: the first half is
/// sent and read before [`LiveExchange::resume`], the second half after, so whatever runs in
/// between happens while the exchange is open and mid-stream.
struct LiveExchange {
    resume: mpsc::Sender<()>,
    /// Told once the producer's first half is sent and its in-flight segments are back.
    idle: mpsc::Receiver<()>,
    producer: thread::JoinHandle<()>,
    consumer: thread::JoinHandle<Result<u64, String>>,
    received: Arc<AtomicU64>,
    half: u64,
}

impl LiveExchange {
    fn start(producer: &ShuffleEnvironment, consumer: &ShuffleEnvironment, records: u64) -> Self {
        let partition = producer.create_partition(LIVE, 1).unwrap();
        let gate = consumer
            .create_gate(&[channel(LIVE, producer.local_addr())])
            .unwrap();
        let half = records / 2;
        let (resume, resumed) = mpsc::channel::<()>();
        let (idle_tx, idle) = mpsc::channel::<()>();
        let producer = thread::spawn(move || {
            let mut writer = RecordWriter::new(
                partition,
                RoundRobinSelector::default(),
                BufferTimeout::from_millis(2),
            );
            for seq in 0..records {
                if seq == half {
                    writer.flush_all();
                    // Idle means every sent segment came back: only the open builder holds
                    // one. Before that, a segment still in the I/O thread's hands after the
                    // consumer read its records would come back during the test's count.
                    let pool = writer.partition().pool();
                    if common::wait_until(LONG, || pool.in_use_segments() <= 1) {
                        let _ = idle_tx.send(());
                    }
                    // Bounded: the test resumes or gives up.
                    resumed
                        .recv_timeout(LONG * 4)
                        .expect("the test resumes the exchange");
                }
                writer.emit(&record(seq)[..]).unwrap();
            }
            writer.finish().unwrap();
        });
        let received = Arc::new(AtomicU64::new(0));
        let count = received.clone();
        let consumer = thread::spawn(move || {
            let mut reader = RecordReader::new(gate, 1 << 20);
            let mut next = 0u64;
            // Bounded: every read has a deadline; the records are finite.
            loop {
                match reader.next_timeout(LONG * 4) {
                    Ok(Some(ReaderItem::Record { bytes, .. })) => {
                        if bytes != record(next) {
                            return Err(format!("record {next} differs"));
                        }
                        next += 1;
                        count.store(next, Ordering::Release);
                    }
                    Ok(Some(ReaderItem::Event { .. })) => {}
                    Ok(None) => return Ok(next),
                    Err(error) => return Err(format!("after {next} records: {error}")),
                }
            }
        });
        Self {
            resume,
            idle,
            producer,
            consumer,
            received,
            half,
        }
    }

    /// Waits until the consumer read the first half (its connection is up and idle).
    fn wait_for_first_half(&self) {
        assert!(
            common::wait_until(LONG, || self.received.load(Ordering::Acquire) >= self.half),
            "the live exchange did not deliver its first half"
        );
        assert!(
            self.idle.recv_timeout(LONG).is_ok(),
            "the producer's sent segments did not come back after the first half"
        );
    }

    /// Sends the second half and checks every record arrived, in order, intact.
    fn finish(self, records: u64) {
        self.resume.send(()).unwrap();
        self.producer.join().expect("the producer does not panic");
        let read = self.consumer.join().expect("the consumer does not panic");
        assert_eq!(read, Ok(records), "the live exchange kept flowing");
    }
}

// ---------------------------------------------------------------------------------------------
// A raw peer

fn frame(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    message.encode(&mut out);
    out
}

fn handshake(authenticate: bool, nonce: Nonce) -> Vec<u8> {
    frame(&Message::Handshake {
        version: VERSION,
        node: 666,
        authenticate,
        nonce,
    })
}

fn request(partition: ResultPartitionId, subpartition: u32, receiver: u128) -> Vec<u8> {
    frame(&Message::PartitionRequest {
        partition,
        subpartition,
        receiver: ReceiverId(receiver),
        credit: 1,
    })
}

/// A TCP connection that speaks bytes, not the protocol.
struct RawPeer {
    stream: TcpStream,
}

impl RawPeer {
    fn connect(server: SocketAddr) -> Self {
        let stream = TcpStream::connect(server).unwrap();
        stream.set_read_timeout(Some(LONG)).unwrap();
        stream.set_write_timeout(Some(LONG)).unwrap();
        Self { stream }
    }

    /// Connects and completes the handshake the server asks for: with `secret`, the proof.
    fn handshaken(server: SocketAddr, secret: Option<&Secret>) -> Self {
        let mut peer = Self::connect(server);
        let nonce = [0x42; 32];
        peer.send(&handshake(secret.is_some(), nonce));
        let Some(Message::Handshake {
            node,
            authenticate,
            nonce: server_nonce,
            ..
        }) = peer.read_message()
        else {
            panic!("the server opens with its handshake");
        };
        assert_eq!(
            authenticate,
            secret.is_some(),
            "the server's authentication"
        );
        if let Some(secret) = secret {
            assert!(
                matches!(peer.read_message(), Some(Message::AuthProof { .. })),
                "the server proves itself"
            );
            let proof = Transcript {
                client_nonce: nonce,
                server_nonce,
                client_node: 666,
                server_node: node,
            }
            .client_proof(secret);
            peer.send(&frame(&Message::AuthProof { proof }));
        }
        peer
    }

    fn send(&mut self, bytes: &[u8]) {
        // The server may already have closed (it refuses early): that is its answer.
        let _ = self.stream.write_all(bytes);
    }

    /// The next control message (BufferResponses are read past); `None` at EOF.
    fn read_message(&mut self) -> Option<Message> {
        // Bounded: each pass consumes one frame of a stream the server closes eventually.
        for _ in 0..100_000 {
            let mut header = [0u8; FRAME_HEADER];
            if !self.read_exact_or_eof(&mut header) {
                return None;
            }
            let frame: FrameHeader = decode_header(&header, SEGMENT)
                .unwrap_or_else(|e| panic!("the server sent a bad frame header: {e}"));
            let mut body = vec![0u8; frame.body_len()];
            if !self.read_exact_or_eof(&mut body) {
                return None;
            }
            if frame.id == MessageId::BufferResponse {
                continue;
            }
            return Some(Message::decode(&frame, &body).expect("the server's frames decode"));
        }
        panic!("the server never stopped sending");
    }

    /// False at EOF (or a reset: the server closed); panics if nothing comes within [`LONG`].
    fn read_exact_or_eof(&mut self, buf: &mut [u8]) -> bool {
        match self.stream.read_exact(buf) {
            Ok(()) => true,
            Err(e)
                if matches!(
                    e.kind(),
                    IoErrorKind::UnexpectedEof | IoErrorKind::ConnectionReset
                ) =>
            {
                false
            }
            Err(e) => panic!("the server neither answered nor closed within {LONG:?}: {e}"),
        }
    }

    /// Reads until the server closes the connection (bounded); returns the control messages.
    fn read_until_closed(&mut self) -> Vec<Message> {
        let mut messages = Vec::new();
        while let Some(message) = self.read_message() {
            messages.push(message);
            assert!(messages.len() < 10_000, "the server keeps talking");
        }
        messages
    }
}

/// How the server must end a chaos connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// An ErrorResponse for the connection of this kind, then EOF.
    Error(ErrorKind),
    /// EOF (the peer hung up mid-frame: nobody to answer).
    Closed,
}

/// One hostile conversation.
struct Case {
    name: &'static str,
    /// Speak only after a proper handshake (and proof, when the server asks for one).
    after_handshake: bool,
    bytes: Vec<u8>,
    /// Half-close after sending (EOF from the server's point of view).
    hang_up: bool,
    ending: Ending,
}

fn case(name: &'static str, after_handshake: bool, bytes: Vec<u8>, ending: Ending) -> Case {
    Case {
        name,
        after_handshake,
        bytes,
        hang_up: false,
        ending,
    }
}

/// Every malformed conversation, for a server that does (`auth`) or does not authenticate.
fn cases(auth: bool) -> Vec<Case> {
    let protocol = Ending::Error(ErrorKind::Protocol);
    let limit = Ending::Error(ErrorKind::LimitExceeded);
    let mut bad_magic = handshake(auth, [1; 32]);
    bad_magic[4] ^= 0xFF;
    let mut unknown_id = [0u8; FRAME_HEADER];
    encode_header(&mut unknown_id, FRAME_HEADER, MessageId::CloseRequest);
    unknown_id[9] = 200;
    let mut over_segment = [0u8; BUFFER_RESPONSE_HEADER];
    encode_buffer_response(
        &mut over_segment,
        &BufferResponseHeader {
            receiver: ReceiverId(1),
            sequence_number: 0,
            backlog: 0,
            data_type: fluxgate::buffer::DataType::DataBuffer,
            compressed: false,
            size: SEGMENT as u32 + 1,
            overtaken: 0,
        },
        false,
    );
    let mut huge_control = [0u8; FRAME_HEADER];
    encode_header(&mut huge_control, u32::MAX as usize, MessageId::AddCredit);
    let truncated = request(CHAOS, 0, 1);
    let buffer_to_server = {
        let mut out = [0u8; BUFFER_RESPONSE_HEADER];
        encode_buffer_response(
            &mut out,
            &BufferResponseHeader {
                receiver: ReceiverId(12345),
                sequence_number: 0,
                backlog: 0,
                data_type: fluxgate::buffer::DataType::DataBuffer,
                compressed: false,
                size: 16,
                overtaken: 0,
            },
            false,
        );
        [&out[..], &[0xAB; 16]].concat()
    };
    let add_credit = |receiver: u128, credit: u32| {
        frame(&Message::AddCredit {
            receiver: ReceiverId(receiver),
            credit,
        })
    };
    // Each request cancelled at once: only the rate counts, not the channels.
    let flood: Vec<u8> = (0..200u128)
        .flat_map(|r| {
            let mut bytes = request(MISSING, 0, 1000 + r);
            bytes.extend(frame(&Message::CancelPartitionRequest {
                receiver: ReceiverId(1000 + r),
            }));
            bytes
        })
        .collect();
    let too_many: Vec<u8> = (0..=MAX_CHANNELS as u128)
        .flat_map(|r| request(MISSING, 0, 2000 + r))
        .collect();
    let mut cases = vec![
        case("garbage", false, vec![0xFF; 64], protocol),
        case("bad magic", false, bad_magic, protocol),
        case("unknown message id", true, unknown_id.to_vec(), protocol),
        case(
            "payload over the segment size",
            true,
            over_segment.to_vec(),
            protocol,
        ),
        case(
            "control frame of 4 GiB",
            true,
            huge_control.to_vec(),
            protocol,
        ),
        Case {
            hang_up: true,
            ..case(
                "truncated body, then EOF",
                true,
                truncated[..truncated.len() / 2].to_vec(),
                Ending::Closed,
            )
        },
        case(
            "BufferResponse to the server",
            true,
            buffer_to_server,
            protocol,
        ),
        case(
            "credit past u32",
            true,
            [request(CHAOS, 0, 7), add_credit(7, u32::MAX)].concat(),
            protocol,
        ),
        case(
            "credit beyond what is sane",
            true,
            [request(CHAOS, 1, 7), add_credit(7, 1 << 21)].concat(),
            protocol,
        ),
        case("a flood of partition requests", true, flood, limit),
        case(
            "more channels than one connection may carry",
            true,
            too_many,
            limit,
        ),
        case(
            // The live consumer holds this view: the peer gets a channel error, then closes.
            "a request for the live consumer's subpartition",
            true,
            [request(LIVE, 0, 9), frame(&Message::CloseRequest)].concat(),
            Ending::Closed,
        ),
    ];
    if auth {
        let unauthenticated = Ending::Error(ErrorKind::Unauthenticated);
        let mut wrong_proof = handshake(true, [5; 32]);
        wrong_proof.extend(frame(&Message::AuthProof { proof: [0x11; 32] }));
        wrong_proof.extend(request(CHAOS, 2, 1));
        cases.extend([
            case("a wrong HMAC proof", false, wrong_proof, unauthenticated),
            case(
                "a request without a proof",
                false,
                [handshake(true, [6; 32]), request(CHAOS, 3, 1)].concat(),
                unauthenticated,
            ),
            case(
                "no authentication at all",
                false,
                [handshake(false, [0; 32]), request(CHAOS, 4, 1)].concat(),
                unauthenticated,
            ),
        ]);
    }
    cases
}

/// Plays `case` against `server`; checks how the server ended it.
fn play(server: SocketAddr, secret: Option<&Secret>, case: &Case) {
    let mut peer = if case.after_handshake {
        RawPeer::handshaken(server, secret)
    } else {
        RawPeer::connect(server)
    };
    peer.send(&case.bytes);
    if case.hang_up {
        let _ = peer.stream.shutdown(Shutdown::Write);
    }
    let messages = peer.read_until_closed();
    let last_error = messages.iter().rev().find_map(|m| match m {
        Message::ErrorResponse {
            receiver: None,
            kind,
            ..
        } => Some(*kind),
        _ => None,
    });
    match case.ending {
        Ending::Error(kind) => assert_eq!(
            last_error,
            Some(kind),
            "{}: the server answered {messages:?}",
            case.name
        ),
        Ending::Closed => assert_eq!(last_error, None, "{}: {messages:?}", case.name),
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

fn chaos_peers_leave_a_live_exchange_intact(transport: Transport, auth: bool) {
    let file = SecretFile::new(&format!("chaos-{transport:?}-{auth}"), SHARED_SECRET);
    let auth_options = auth_options(&file);
    let max_channels = MAX_CHANNELS.to_string();
    let rate = REQUEST_RATE.to_string();
    let burst = REQUEST_BURST.to_string();
    let mut producer_options = vec![
        (
            "fluxgate.network.max-channels-per-connection",
            max_channels.as_str(),
        ),
        ("fluxgate.network.partition-request-rate", rate.as_str()),
        ("fluxgate.network.partition-request-burst", burst.as_str()),
    ];
    let mut consumer_options = Vec::new();
    if auth {
        producer_options.extend(auth_options);
        consumer_options.extend(auth_options);
    }
    let producer = start(1, transport, &producer_options);
    let consumer = start(2, transport, &consumer_options);
    let chaos_partition = producer.create_partition(CHAOS, 8).unwrap();
    let records = 6_000;
    let live = LiveExchange::start(&producer, &consumer, records);
    live.wait_for_first_half();
    // The producer is idle between the halves: its free segments must come back to this
    // after every hostile connection.
    let baseline = producer.network().available_segments();
    let secret = Secret::new(SHARED_SECRET).unwrap();
    let secret = auth.then_some(&secret);
    for case in cases(auth) {
        play(producer.local_addr(), secret, &case);
        assert!(
            common::wait_until(LONG, || producer.network().available_segments() == baseline),
            "{}: the producer's segments did not come back ({} free, {baseline} before)",
            case.name,
            producer.network().available_segments()
        );
    }
    live.finish(records);
    drop(chaos_partition);
    assert!(
        common::pools_full(&[&producer, &consumer]),
        "segments leaked"
    );
}

fn chaos_without_authentication(transport: Transport) {
    chaos_peers_leave_a_live_exchange_intact(transport, false);
}
on_both_drivers!(
    chaos_without_authentication,
    chaos_peers_without_authentication_epoll,
    chaos_peers_without_authentication_uring
);

fn chaos_with_authentication(transport: Transport) {
    chaos_peers_leave_a_live_exchange_intact(transport, true);
}
on_both_drivers!(
    chaos_with_authentication,
    chaos_peers_with_authentication_epoll,
    chaos_peers_with_authentication_uring
);

fn wrong_or_missing_secrets_fail_the_gate_with_unauthenticated(transport: Transport) {
    let right = SecretFile::new(&format!("right-{transport:?}"), SHARED_SECRET);
    let wrong = SecretFile::new(&format!("wrong-{transport:?}"), b"another cluster's secret");
    let producer = start(1, transport, &auth_options(&right));
    let mut partition = producer.create_partition(LIVE, 3).unwrap();
    for subpartition in 0..3 {
        partition.emit_record(&record(0)[..], subpartition).unwrap();
    }
    partition.flush_all();
    let wrong_options = auth_options(&wrong);
    let consumers: [(&str, &[(&str, &str)]); 3] = [
        ("wrong secret", &wrong_options),
        (
            "no secret (authentication off)",
            &[("fluxgate.security.auth", "off")],
        ),
        ("right secret", &auth_options(&right)),
    ];
    for (subpartition, (name, options)) in consumers.into_iter().enumerate() {
        let consumer = start(2, transport, options);
        let gate = consumer
            .create_gate(&[ChannelDescriptor {
                consumed: ConsumedSubpartition {
                    partition: LIVE,
                    subpartition,
                },
                location: ProducerLocation::Remote(producer.local_addr()),
            }])
            .unwrap();
        let mut reader = RecordReader::new(gate, 1 << 20);
        let first = reader.next_timeout(LONG);
        if name == "right secret" {
            match first {
                Ok(Some(ReaderItem::Record { bytes, .. })) => assert_eq!(bytes, record(0)),
                other => panic!("{name}: expected the record, got {other:?}"),
            }
        } else {
            assert!(
                matches!(
                    first,
                    Err(ReaderError::Gate(GateError::Unauthenticated {
                        channel: 0,
                        ..
                    }))
                ),
                "{name}: got {first:?}"
            );
        }
        drop(reader);
        assert!(
            common::pools_full(&[&consumer]),
            "{name}: consumer segments leaked"
        );
    }
    // Two subpartitions were never consumed: releasing the partition frees their data.
    drop(partition);
    producer.partition_manager().release(LIVE).unwrap();
    assert!(common::pools_full(&[&producer]), "producer segments leaked");
}
on_both_drivers!(
    wrong_or_missing_secrets_fail_the_gate_with_unauthenticated,
    wrong_or_missing_secrets_fail_the_gate_with_unauthenticated_epoll,
    wrong_or_missing_secrets_fail_the_gate_with_unauthenticated_uring
);

fn connections_beyond_the_limit_are_closed_at_once(transport: Transport) {
    // The live consumer's connection and two raw ones fill the limit.
    let producer = start(1, transport, &[("fluxgate.network.max-connections", "3")]);
    let consumer = start(2, transport, &[]);
    let records = 2_000;
    let live = LiveExchange::start(&producer, &consumer, records);
    live.wait_for_first_half();
    let accepted =
        |peer: &mut RawPeer| matches!(peer.read_message(), Some(Message::Handshake { .. }));
    let mut first = RawPeer::connect(producer.local_addr());
    let mut second = RawPeer::connect(producer.local_addr());
    assert!(accepted(&mut first) && accepted(&mut second));
    let mut refused = RawPeer::connect(producer.local_addr());
    assert!(
        matches!(
            &refused.read_until_closed()[..],
            [Message::ErrorResponse {
                receiver: None,
                kind: ErrorKind::LimitExceeded,
                ..
            }]
        ),
        "closed at once, before a handshake, saying why"
    );
    // A slot frees when a connection closes: a later peer is served again.
    drop(first);
    let mut served = None;
    // Bounded by count and by LONG overall: the server frees the slot as soon as it notices
    // the close.
    let deadline = std::time::Instant::now() + LONG;
    for _ in 0..1000 {
        let mut peer = RawPeer::connect(producer.local_addr());
        if accepted(&mut peer) {
            served = Some(peer);
            break;
        }
        if std::time::Instant::now() > deadline {
            break;
        }
    }
    assert!(served.is_some(), "the freed slot was never reused");
    live.finish(records);
    drop((second, served));
    assert!(common::pools_full(&[&producer, &consumer]));
}
on_both_drivers!(
    connections_beyond_the_limit_are_closed_at_once,
    connections_beyond_the_limit_are_closed_at_once_epoll,
    connections_beyond_the_limit_are_closed_at_once_uring
);

/// A producer at its `max-connections` closes a new connection before its handshake. The
/// consumer's channels on it are not failed for that: they connect again after the request
/// back-off and are served once a slot frees (they failed at once with ConnectionLost).
fn a_consumer_refused_at_the_connection_limit_is_served_once_a_slot_frees(transport: Transport) {
    let producer = start(1, transport, &[("fluxgate.network.max-connections", "1")]);
    let consumer = start(2, transport, &[]);
    let mut holder = RawPeer::connect(producer.local_addr());
    assert!(
        matches!(holder.read_message(), Some(Message::Handshake { .. })),
        "the raw peer holds the one slot"
    );
    let records = 2_000;
    let live = LiveExchange::start(&producer, &consumer, records);
    assert!(
        common::wait_until(LONG, || producer
            .driver_stats()
            .is_some_and(|stats| stats.refused_connections >= 1)),
        "the consumer's connection was never refused"
    );
    drop(holder);
    live.wait_for_first_half();
    live.finish(records);
    assert!(common::pools_full(&[&producer, &consumer]));
}
on_both_drivers!(
    a_consumer_refused_at_the_connection_limit_is_served_once_a_slot_frees,
    a_consumer_refused_at_the_connection_limit_is_served_once_a_slot_frees_epoll,
    a_consumer_refused_at_the_connection_limit_is_served_once_a_slot_frees_uring
);

/// A producer that stays at its `max-connections`: the refused consumer's channel connects
/// again through the request back-off, each refusal a step further, and fails once it is
/// exhausted (it must not try for good).
fn a_consumer_refused_at_the_connection_limit_for_good_fails_once_the_back_off_runs_out(
    transport: Transport,
) {
    let producer = start(1, transport, &[("fluxgate.network.max-connections", "1")]);
    let consumer = start(
        2,
        transport,
        &[
            ("taskmanager.network.request-backoff.initial", "10"),
            ("taskmanager.network.request-backoff.max", "40"),
        ],
    );
    let mut holder = RawPeer::connect(producer.local_addr());
    assert!(
        matches!(holder.read_message(), Some(Message::Handshake { .. })),
        "the raw peer holds the one slot"
    );
    let _partition = producer.create_partition(LIVE, 1).unwrap();
    let gate = consumer
        .create_gate(&[channel(LIVE, producer.local_addr())])
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    let read = reader.next_timeout(LONG);
    assert!(
        matches!(
            &read,
            Err(ReaderError::Gate(GateError::Transport { channel: 0, .. }))
        ),
        "{read:?}"
    );
    let refused = producer
        .driver_stats_within(LONG)
        .unwrap()
        .refused_connections;
    assert!(
        refused >= 2,
        "connected again after a refusal: {refused} refused"
    );
    drop((reader, holder));
    assert!(common::pools_full(&[&producer, &consumer]));
}
on_both_drivers!(
    a_consumer_refused_at_the_connection_limit_for_good_fails_once_the_back_off_runs_out,
    a_consumer_refused_at_the_connection_limit_for_good_fails_once_the_back_off_runs_out_epoll,
    a_consumer_refused_at_the_connection_limit_for_good_fails_once_the_back_off_runs_out_uring
);

/// A protocol error found while the server's write is stuck (its consumer reads nothing, so
/// the socket's buffers are full): the server must still answer with its ErrorResponse once
/// that write is done, after the whole frame the write was in, and only then close. The
/// io_uring driver once closed the connection as soon as the stuck write completed, so the
/// consumer saw EOF without the error.
/// A producer whose writer emits far more than the sockets hold to a raw peer that asked with
/// ample credit and reads nothing: returned once the server's writes filled the socket.
fn stuck_server(
    transport: Transport,
    options: &[(&str, &str)],
) -> (ShuffleEnvironment, thread::JoinHandle<()>, RawPeer) {
    let producer = start(1, transport, options);
    let partition = producer.create_partition(CHAOS, 1).unwrap();
    let writer = thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            RoundRobinSelector::default(),
            BufferTimeout::from_millis(1),
        );
        // Bounded: far more than the sockets hold; the writer blocks until the connection
        // closes, which releases the subpartition and fails the next emit.
        for seq in 0..1_000_000u64 {
            if writer.emit(&[seq as u8; 1000][..]).is_err() {
                return;
            }
        }
    });
    let mut peer = RawPeer::handshaken(producer.local_addr(), None);
    peer.send(&frame(&Message::PartitionRequest {
        partition: CHAOS,
        subpartition: 0,
        receiver: ReceiverId(1),
        credit: 1 << 20,
    }));
    // A zero-copy send waits in the kernel until it is whole (no short write): the socket
    // is full once one waits for its notification.
    assert!(
        common::wait_until(LONG, || producer
            .driver_stats()
            .is_some_and(|s| s.short_writes > 0 || s.zc_sends > s.zc_notifications)),
        "the server's writes fill the socket"
    );
    (producer, writer, peer)
}

/// Once the server closed the connection: the writer ends (its next emit fails) and every
/// segment is back.
fn end_stuck_server(
    producer: &ShuffleEnvironment,
    writer: thread::JoinHandle<()>,
    peer: Option<RawPeer>,
) {
    writer.join().expect("the writer does not panic");
    drop(peer);
    assert!(
        common::wait_until(LONG, || common::pool_full(producer)),
        "producer segments leaked"
    );
}

/// A shutdown while zero-copy sends wait at a peer that stopped reading (its window closed):
/// every segment is back once the environment is gone. (Off loopback, where a dead host
/// leaves the notifications to TCP's own timeouts, the shutdown aborts such sockets after a
/// grace; on loopback the notifications come without that, so this checks the path, not the
/// abort.)
#[test]
fn a_shutdown_with_zero_copy_sends_stuck_at_a_silent_peer_leaks_no_segment() {
    let test = "a_shutdown_with_zero_copy_sends_stuck_at_a_silent_peer_leaks_no_segment";
    if common::skip_without_uring(test) {
        return;
    }
    let always = [("fluxgate.network.zero-copy-send", "always")];
    let (producer, writer, peer) = stuck_server(Transport::Uring, &always);
    let stats = producer.driver_stats_within(LONG).unwrap();
    if !stats.zc_available {
        eprintln!("SKIPPED: {test}: the kernel has no zero-copy send (logged)");
        return;
    }
    // The writer waits for room once the sends stopped: the socket is full, and what it
    // holds waits for a peer that reads nothing.
    let partition = producer.partition_manager().partition(CHAOS).unwrap();
    assert!(
        common::wait_until(LONG, || partition.is_back_pressured()),
        "the writer never waited"
    );
    let stats = producer.driver_stats_within(LONG).unwrap();
    assert!(
        stats.zc_sends > stats.zc_notifications,
        "no zero-copy send waits for its notification: {stats:?}"
    );
    drop(partition);
    let network = producer.network().clone();
    drop(producer);
    writer.join().expect("the writer does not panic");
    assert_eq!(
        network.available_segments(),
        network.total_segments(),
        "segments of unnotified sends leaked"
    );
    drop(peer);
}

/// A frame with a bad magic.
fn bad_magic() -> Vec<u8> {
    let mut bytes = frame(&Message::AddCredit {
        receiver: ReceiverId(1),
        credit: 1,
    });
    bytes[4] ^= 0xFF;
    bytes
}

fn an_error_found_while_a_write_is_stuck_is_answered_after_it(transport: Transport) {
    let (producer, writer, mut peer) = stuck_server(transport, &[]);
    let stat = |pick: fn(&DriverStats) -> u64| producer.driver_stats().map_or(0, |s| pick(&s));
    // A frame with a bad magic: the server finds it while its write is stuck.
    peer.send(&bad_magic());
    // Read only once the server has found the error with its socket still full: closed
    // then, it lost the response (the epoll driver did, whenever it got there first).
    assert!(
        common::wait_until(LONG, || stat(|s| s.protocol_errors) > 0),
        "the server found the bad frame"
    );
    let messages = peer.read_until_closed();
    assert!(
        matches!(
            messages.last(),
            Some(Message::ErrorResponse {
                receiver: None,
                kind: ErrorKind::Protocol,
                ..
            })
        ),
        "the server answered {messages:?}"
    );
    end_stuck_server(&producer, writer, Some(peer));
}
on_both_drivers!(
    an_error_found_while_a_write_is_stuck_is_answered_after_it,
    an_error_found_while_a_write_is_stuck_is_answered_after_it_epoll,
    an_error_found_while_a_write_is_stuck_is_answered_after_it_uring
);

/// A peer that sends a bad frame while it reads nothing: the error response the server
/// queued can never go out, so the server closes the connection anyway after a while
/// (`ERROR_RESPONSE_LINGER`, 5 s), freeing its slot, instead of keeping it for good (TCP's
/// user timeout, which would end it too, is off here). On epoll a guard: that driver had the
/// linger already.
fn a_peer_that_never_reads_its_error_response_is_closed_anyway(transport: Transport) {
    let (producer, writer, mut peer) =
        stuck_server(transport, &[("fluxgate.network.tcp.user-timeout-ms", "0")]);
    let stat = |pick: fn(&DriverStats) -> u64| producer.driver_stats().map_or(0, |s| pick(&s));
    peer.send(&bad_magic());
    assert!(
        common::wait_until(LONG, || stat(|s| s.protocol_errors) > 0),
        "the server found the bad frame"
    );
    assert!(
        common::wait_until(LONG, || stat(|s| s.open_connections) == 0),
        "the connection stays open while its peer reads nothing"
    );
    end_stuck_server(&producer, writer, Some(peer));
}
on_both_drivers!(
    a_peer_that_never_reads_its_error_response_is_closed_anyway,
    a_peer_that_never_reads_its_error_response_is_closed_anyway_epoll,
    a_peer_that_never_reads_its_error_response_is_closed_anyway_uring
);

#[test]
fn authentication_on_without_a_secret_refuses_to_start() {
    let missing = std::env::temp_dir().join("fluxgate-chaos-no-such-secret-file");
    let started = ShuffleEnvironment::start(EnvConfig {
        network: network(&[
            ("fluxgate.security.auth", "on"),
            ("fluxgate.security.secret-file", missing.to_str().unwrap()),
        ]),
        ..EnvConfig::default()
    });
    assert!(
        matches!(
            started,
            Err(EnvError::Secret(SecretError::Unreadable { .. }))
        ),
        "{started:?}"
    );
    if std::env::var_os(SECRET_ENV).is_none() {
        // Non-loopback with `auto`: authentication is on, and nothing says the secret.
        let started = ShuffleEnvironment::start(EnvConfig {
            network: network(&[]),
            bind: SocketAddr::from(([0, 0, 0, 0], 0)),
            ..EnvConfig::default()
        });
        match started {
            Err(EnvError::Secret(SecretError::Missing(reason))) => {
                assert!(reason.contains("auto"), "{reason}")
            }
            other => panic!("expected a missing-secret error, got {other:?}"),
        }
    } else {
        eprintln!("{SECRET_ENV} is set: the missing-secret case is not checked");
    }
}

/// Every SIGPIPE this test process receives (the tests' own raw peers write through `send`
/// with `MSG_NOSIGNAL`, as `std` does, so only the engine's writes can raise one).
fn sigpipes_seen() -> &'static Arc<std::sync::atomic::AtomicBool> {
    static SEEN: std::sync::OnceLock<Arc<std::sync::atomic::AtomicBool>> =
        std::sync::OnceLock::new();
    SEEN.get_or_init(|| {
        let seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register(libc::SIGPIPE, Arc::clone(&seen)).expect("a SIGPIPE handler");
        seen
    })
}

/// Whether every io_uring I/O thread of this process holds SIGPIPE blocked (and there is one),
/// from `/proc/self/task/*/status`.
fn io_uring_threads_block_sigpipe() -> bool {
    let mut found = false;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("fluxgate-io-uri") {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        let blocked = status
            .lines()
            .find_map(|line| line.strip_prefix("SigBlk:"))
            .map(|mask| u64::from_str_radix(mask.trim(), 16).unwrap())
            .expect("a SigBlk line");
        if blocked & (1 << (libc::SIGPIPE - 1)) == 0 {
            return false;
        }
        found = true;
    }
    found
}

/// A consumer that resets its connection while the server's write is stuck on it (closing a
/// socket with unread data sends a reset): the server's next write finds a broken pipe. That
/// must be an error on the connection, never a SIGPIPE, whose default action kills a host
/// process that has not ignored it (Rust's runtime ignores it; a JVM or C host need not).
/// For the outcome this is a guard on both drivers: they meet the reset as ECONNRESET first
/// and do not write again. The io_uring variant's check of the thread's signal mask fails
/// without the fix; the epoll driver's `MSG_NOSIGNAL` has no such check.
fn a_reset_under_a_stuck_write_raises_no_sigpipe(transport: Transport) {
    let seen = sigpipes_seen();
    let (producer, writer, peer) = stuck_server(transport, &[]);
    if transport == Transport::Uring {
        // `Writev` and `WriteFixed` cannot say `MSG_NOSIGNAL`: the ring's thread must hold the
        // signal blocked instead. Waited for, not read once: a test running beside this one
        // may have just spawned an I/O thread that has its name but has not yet blocked it.
        assert!(
            common::wait_until(LONG, io_uring_threads_block_sigpipe),
            "an io_uring I/O thread takes SIGPIPE"
        );
    }
    // Unread data in the peer's receive buffer: its close sends a reset, not a FIN.
    drop(peer);
    let stat = |pick: fn(&DriverStats) -> u64| producer.driver_stats().map_or(0, |s| pick(&s));
    assert!(
        common::wait_until(LONG, || stat(|s| s.open_connections) == 0),
        "the server closes the reset connection"
    );
    end_stuck_server(&producer, writer, None);
    assert!(
        !seen.load(Ordering::SeqCst),
        "a write into the reset connection raised SIGPIPE"
    );
}
on_both_drivers!(
    a_reset_under_a_stuck_write_raises_no_sigpipe,
    a_reset_under_a_stuck_write_raises_no_sigpipe_epoll,
    a_reset_under_a_stuck_write_raises_no_sigpipe_uring
);
