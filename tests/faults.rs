//! Faults with real processes and sockets, on both drivers (`_epoll`, `_uring`; the io_uring
//! variants skip loudly where the kernel refuses io_uring):
//!
//! * a producer process killed mid-stream (SIGKILL): its consumer's next read returns
//!   `GateError::ConnectionLost` naming the producer's address, while an exchange with another
//!   producer on the same consumer goes on to its end;
//! * a consumer process killed mid-stream: the producer's view is released, its writer learns
//!   it (`PartitionError::Released`) instead of blocking, and every segment comes back;
//! * a stalled peer that requests a partition with plenty of credit and never reads: the
//!   producer is backpressured within its pool, other consumers go on, and when the staller
//!   goes away everything is released.
//!
//! The producer process is `fluxgate bench --producer-process` (what `fluxgate bench` starts);
//! the consumer process is this test binary run again on the ignored
//! `consumer_process_for_fault_tests`. Every wait is bounded; no sleep synchronizes.

#[macro_use]
mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::gate::{ConsumedSubpartition, GateError, ReaderError, ReaderItem, RecordReader};
use fluxgate::io::Transport;
use fluxgate::partition::{
    BufferTimeout, ForwardSelector, PartitionError, RecordWriter, ResultPartitionId,
};
use fluxgate::protocol::frame::VERSION;
use fluxgate::protocol::{Message, ReceiverId};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

const LONG: Duration = Duration::from_secs(30);

fn transport_name(transport: Transport) -> &'static str {
    match transport {
        Transport::Uring => "uring",
        Transport::Epoll => "epoll",
        Transport::Auto => "auto",
    }
}

/// An environment with the default 32 KiB segments (what the bench producer process uses).
fn env(node: u128, transport: Transport) -> ShuffleEnvironment {
    let mut network = NetworkConfig::default();
    network
        .set("taskmanager.memory.network.max", "32mb")
        .unwrap();
    ShuffleEnvironment::start(EnvConfig {
        network,
        node,
        transport,
        ..EnvConfig::default()
    })
    .unwrap()
}

/// Emits 8-byte records into `partition` (flushed every millisecond) until an emit fails;
/// returns how many went out and the error. Bounded: the test makes emits fail within LONG.
fn emit_until_error(
    partition: fluxgate::partition::ResultPartition,
) -> thread::JoinHandle<Result<(u64, PartitionError), String>> {
    thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            ForwardSelector,
            BufferTimeout::Every(Duration::from_millis(1)),
        );
        let started = Instant::now();
        let mut seq = 0u64;
        while started.elapsed() < 2 * LONG {
            match writer.emit(&seq.to_le_bytes()[..]) {
                Ok(()) => seq += 1,
                Err(error) => return Ok((seq, error)),
            }
        }
        Err(format!("still emitting after {:?}", 2 * LONG))
    })
}

fn gate_of(
    env: &ShuffleEnvironment,
    partition: ResultPartitionId,
    peer: SocketAddr,
) -> fluxgate::gate::SingleInputGate {
    env.create_gate(&[ChannelDescriptor {
        consumed: ConsumedSubpartition {
            partition,
            subpartition: 0,
        },
        location: ProducerLocation::Remote(peer),
    }])
    .unwrap()
}

/// A child started from `command` with its stdin and stdout piped.
fn spawn(mut command: Command) -> common::ChildProcess {
    let child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the child starts");
    common::ChildProcess::new(child, LONG)
}

/// Emits `count` numbered records into a fresh partition of `env`, for a healthy exchange
/// that must go on while another peer fails.
fn healthy_producer(
    env: &ShuffleEnvironment,
    id: ResultPartitionId,
    count: u64,
) -> thread::JoinHandle<()> {
    let partition = env.create_partition(id, 1).unwrap();
    thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            ForwardSelector,
            BufferTimeout::Every(Duration::from_millis(1)),
        );
        for seq in 0..count {
            writer.emit(&seq.to_le_bytes()[..]).unwrap();
        }
        writer.finish().unwrap();
    })
}

/// Reads the healthy exchange to its end: every record, in order, once.
fn read_healthy(gate: fluxgate::gate::SingleInputGate, count: u64) {
    let mut reader = RecordReader::new(gate, 1 << 20);
    let mut next = 0u64;
    // Bounded: `count` records and a few events, each within LONG.
    loop {
        match reader
            .next_timeout(LONG)
            .expect("the healthy exchange goes on")
        {
            Some(ReaderItem::Record { bytes, .. }) => {
                let seq = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
                assert_eq!(seq, next, "in order, none lost or repeated");
                next += 1;
            }
            Some(ReaderItem::Event { .. }) => {}
            None => break,
        }
    }
    assert_eq!(next, count);
}

fn killing_the_producer_process_fails_its_consumer_naming_the_peer(transport: Transport) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_fluxgate"));
    command.args([
        "bench",
        "--producer-process",
        "throughput",
        "--duration",
        "120",
        "--rate",
        "0",
        "--no-baseline",
        "--transport",
        transport_name(transport),
    ]);
    let mut producer = spawn(command);
    let ready = producer.line();
    let addr: SocketAddr = ready
        .trim()
        .strip_prefix("ready ")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("`ready ADDR`, got {ready:?}"));

    let consumer_env = env(2, transport);
    let healthy_env = env(3, transport);
    let healthy_id = ResultPartitionId {
        partition: 50,
        producer: 3,
    };
    const HEALTHY: u64 = 200_000;
    let healthy_gate = gate_of(&consumer_env, healthy_id, healthy_env.local_addr());
    let doomed_gate = gate_of(
        &consumer_env,
        ResultPartitionId {
            partition: 0,
            producer: 0,
        },
        addr,
    );
    producer.say("go");
    let mut doomed = RecordReader::new(doomed_gate, 1 << 20);
    let mut received = 0u64;
    // Bounded: until 10 000 records arrived, each read within LONG.
    while received < 10_000 {
        match doomed.next_timeout(LONG) {
            Ok(Some(ReaderItem::Record { .. })) => received += 1,
            Ok(Some(ReaderItem::Event { .. })) => {}
            other => panic!("the producer streams, got {other:?}"),
        }
    }
    let healthy = healthy_producer(&healthy_env, healthy_id, HEALTHY);
    producer.kill();
    let started = Instant::now();
    let error = loop {
        // Records already received are read first; bounded by what the pool could hold.
        match doomed.next_timeout(LONG) {
            Ok(Some(_)) => assert!(started.elapsed() < LONG, "no error after {LONG:?}"),
            Ok(None) => panic!("a killed producer cannot end its partition"),
            Err(error) => break error,
        }
    };
    match error {
        ReaderError::Gate(GateError::ConnectionLost { peer, .. }) => assert_eq!(peer, addr),
        other => panic!("expected ConnectionLost naming {addr}, got {other:?}"),
    }
    read_healthy(healthy_gate, HEALTHY);
    healthy.join().expect("the healthy producer finished");
    drop(doomed);
    assert!(common::pool_full(&consumer_env));
    assert!(common::pool_full(&healthy_env));
}
on_both_drivers!(
    killing_the_producer_process_fails_its_consumer_naming_the_peer,
    killing_the_producer_process_fails_its_consumer_naming_the_peer_epoll,
    killing_the_producer_process_fails_its_consumer_naming_the_peer_uring
);

const FAULT_PEER: &str = "FLUXGATE_FAULT_TEST_PEER";
const FAULT_TRANSPORT: &str = "FLUXGATE_FAULT_TEST_TRANSPORT";
const DOOMED: ResultPartitionId = ResultPartitionId {
    partition: 60,
    producer: 4,
};

/// The consumer process of `killing_the_consumer_process_releases_the_producer`: reads from
/// the producer named in its environment, says `reading` after the first record, and reads
/// until killed (bounded: it gives up after LONG). Does nothing when run by hand.
#[test]
#[ignore = "a child process of the fault tests"]
fn consumer_process_for_fault_tests() {
    let (Ok(peer), Ok(transport)) = (std::env::var(FAULT_PEER), std::env::var(FAULT_TRANSPORT))
    else {
        return;
    };
    let peer: SocketAddr = peer.parse().unwrap();
    let transport: Transport = transport.parse().unwrap();
    let consumer_env = env(5, transport);
    let mut reader = RecordReader::new(gate_of(&consumer_env, DOOMED, peer), 1 << 20);
    let mut said = false;
    let started = Instant::now();
    while started.elapsed() < LONG {
        match reader.next_timeout(LONG) {
            Ok(Some(ReaderItem::Record { .. })) if !said => {
                println!("reading");
                std::io::stdout().flush().unwrap();
                said = true;
            }
            Ok(Some(_)) => {}
            _ => return,
        }
    }
}

fn killing_the_consumer_process_releases_the_producer(transport: Transport) {
    let producer_env = env(4, transport);
    let partition = producer_env.create_partition(DOOMED, 1).unwrap();
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "consumer_process_for_fault_tests",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .env(FAULT_PEER, producer_env.local_addr().to_string())
        .env(FAULT_TRANSPORT, transport_name(transport));
    let mut consumer = spawn(command);
    let writer = emit_until_error(partition);
    // Bounded: the child prints a few lines of test-harness text before `reading`.
    let mut reading = false;
    for _ in 0..50 {
        if consumer.line().trim() == "reading" {
            reading = true;
            break;
        }
    }
    assert!(reading, "the consumer process started reading");
    consumer.kill();
    let (emitted, error) = writer
        .join()
        .expect("the writer thread")
        .expect("emit failed");
    assert!(emitted > 0);
    assert!(
        matches!(error, PartitionError::Released),
        "the writer learns its consumer is gone: {error:?}"
    );
    assert!(
        common::pool_full(&producer_env),
        "every segment the view held came back"
    );
}
on_both_drivers!(
    killing_the_consumer_process_releases_the_producer,
    killing_the_consumer_process_releases_the_producer_epoll,
    killing_the_consumer_process_releases_the_producer_uring
);

fn frame(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    message.encode(&mut out);
    out
}

fn a_stalled_peer_backpressures_only_its_producer(transport: Transport) {
    let producer_env = env(6, transport);
    let stalled_id = ResultPartitionId {
        partition: 70,
        producer: 6,
    };
    let partition = producer_env.create_partition(stalled_id, 1).unwrap();
    let handle = partition.handle();
    let pool_max = partition.pool().spec().max_segments;
    // A peer that asks for the partition with a large credit and never reads a byte.
    let mut staller = std::net::TcpStream::connect(producer_env.local_addr()).unwrap();
    let mut hello = frame(&Message::Handshake {
        version: VERSION,
        node: 77,
        authenticate: false,
        nonce: [0; 32],
    });
    hello.extend(frame(&Message::PartitionRequest {
        partition: stalled_id,
        subpartition: 0,
        receiver: ReceiverId(1),
        credit: 1 << 16,
    }));
    staller.write_all(&hello).unwrap();
    let writer = thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            ForwardSelector,
            BufferTimeout::Every(Duration::from_millis(1)),
        );
        let record = [7u8; 1024];
        let started = Instant::now();
        let mut most_leased = 0;
        // Bounded: the staller goes away within LONG, then emits fail.
        while started.elapsed() < 2 * LONG {
            most_leased = most_leased.max(writer.partition().pool().in_use_segments());
            if let Err(error) = writer.emit(&record[..]) {
                return Ok((
                    most_leased,
                    error,
                    writer.partition().pool().blocked_nanos(),
                ));
            }
        }
        Err("still emitting".to_string())
    });
    // The producer fills the socket and its pool, then waits: back pressure, not growth.
    assert!(
        common::wait_until(LONG, || producer_env.network().available_segments()
            + pool_max
            <= producer_env.network().total_segments()),
        "the producer's pool never filled"
    );
    // Meanwhile another consumer of the same server is served to its end.
    let consumer_env = env(7, transport);
    let healthy_id = ResultPartitionId {
        partition: 71,
        producer: 6,
    };
    let healthy_gate = gate_of(&consumer_env, healthy_id, producer_env.local_addr());
    let healthy = healthy_producer(&producer_env, healthy_id, 50_000);
    read_healthy(healthy_gate, 50_000);
    healthy.join().unwrap();
    // The staller leaves without reading (its kernel resets the connection): its view goes,
    // the writer is told.
    drop(staller);
    let (most_leased, error, blocked) = writer.join().unwrap().expect("emit failed");
    assert!(
        most_leased <= pool_max,
        "within its pool: {most_leased} of {pool_max}"
    );
    assert!(blocked > 0, "the writer waited for buffers (back pressure)");
    assert!(matches!(error, PartitionError::Released), "{error:?}");
    drop(handle);
    assert!(common::pool_full(&producer_env));
    assert!(common::pool_full(&consumer_env));
}
on_both_drivers!(
    a_stalled_peer_backpressures_only_its_producer,
    a_stalled_peer_backpressures_only_its_producer_epoll,
    a_stalled_peer_backpressures_only_its_producer_uring
);

/// A producer that speaks just enough of the protocol by hand: accepts one consumer, reads
/// its handshake and partition request, answers with its own handshake, then writes what the
/// test gives it and closes.
fn fake_producer(
    script: impl FnOnce(ReceiverId) -> Vec<u8> + Send + 'static,
) -> (SocketAddr, thread::JoinHandle<()>) {
    use fluxgate::protocol::frame::{decode_header, FRAME_HEADER};
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        socket.set_read_timeout(Some(LONG)).unwrap();
        let mut next_message = || {
            let mut header = [0u8; FRAME_HEADER];
            socket.read_exact(&mut header).unwrap();
            let frame = decode_header(&header, 1 << 20).unwrap();
            let mut body = vec![0u8; frame.body_len()];
            socket.read_exact(&mut body).unwrap();
            Message::decode(&frame, &body).unwrap()
        };
        assert!(matches!(next_message(), Message::Handshake { .. }));
        let Message::PartitionRequest { receiver, .. } = next_message() else {
            panic!("a partition request follows the handshake");
        };
        let mut out = frame(&Message::Handshake {
            version: VERSION,
            node: 99,
            authenticate: false,
            nonce: [0; 32],
        });
        out.extend(script(receiver));
        let mut socket = socket;
        socket.write_all(&out).unwrap();
        // Dropping the socket closes it: EOF for the consumer.
    });
    (addr, server)
}

/// A BufferResponse of `payload` records bytes for `receiver` with `sequence`.
fn buffer_response(receiver: ReceiverId, sequence: u64, payload: &[u8]) -> Vec<u8> {
    use fluxgate::buffer::DataType;
    use fluxgate::protocol::frame::{
        encode_buffer_response, BufferResponseHeader, BUFFER_RESPONSE_HEADER,
    };
    let mut header = [0u8; BUFFER_RESPONSE_HEADER];
    encode_buffer_response(
        &mut header,
        &BufferResponseHeader {
            receiver,
            sequence_number: sequence,
            backlog: 0,
            data_type: DataType::DataBuffer,
            compressed: false,
            size: payload.len() as u32,
            overtaken: 0,
        },
        false,
    );
    let mut out = header.to_vec();
    out.extend_from_slice(payload);
    out
}

/// Reads until the gate's error (records before it are fine), bounded by LONG.
fn first_error(gate: fluxgate::gate::SingleInputGate) -> ReaderError {
    let mut reader = RecordReader::new(gate, 1 << 20);
    let started = Instant::now();
    loop {
        match reader.next_timeout(LONG) {
            Ok(Some(_)) => assert!(started.elapsed() < LONG, "no error within {LONG:?}"),
            Ok(None) => panic!("the gate ended without an error"),
            Err(error) => return error,
        }
    }
}

fn an_eof_in_the_middle_of_a_frame_fails_the_channel_naming_the_peer(transport: Transport) {
    let (addr, server) = fake_producer(|receiver| {
        let whole = buffer_response(receiver, 0, &common::framed_record(b"whole"));
        let mut cut = buffer_response(receiver, 1, &common::framed_record(&[5u8; 1000]));
        cut.truncate(cut.len() / 2);
        [whole, cut].concat()
    });
    let consumer_env = env(8, transport);
    let gate = gate_of(&consumer_env, DOOMED, addr);
    match first_error(gate) {
        ReaderError::Gate(GateError::ConnectionLost { peer, .. }) => assert_eq!(peer, addr),
        other => panic!("expected ConnectionLost naming {addr}, got {other:?}"),
    }
    server.join().unwrap();
    assert!(
        common::pool_full(&consumer_env),
        "the half-filled segment came back"
    );
}
on_both_drivers!(
    an_eof_in_the_middle_of_a_frame_fails_the_channel_naming_the_peer,
    an_eof_in_the_middle_of_a_frame_fails_the_channel_naming_the_peer_epoll,
    an_eof_in_the_middle_of_a_frame_fails_the_channel_naming_the_peer_uring
);

fn a_frame_out_of_sequence_fails_the_channel_with_reordering(transport: Transport) {
    let (addr, server) = fake_producer(|receiver| {
        // Sequence 0, then 2: buffer 1 went missing.
        let first = buffer_response(receiver, 0, &common::framed_record(b"zero"));
        let skipped = buffer_response(receiver, 2, &common::framed_record(b"two"));
        [first, skipped].concat()
    });
    let consumer_env = env(9, transport);
    let gate = gate_of(&consumer_env, DOOMED, addr);
    match first_error(gate) {
        ReaderError::Gate(GateError::Reordering {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (1, 2)),
        other => panic!("expected Reordering, got {other:?}"),
    }
    server.join().unwrap();
    assert!(common::pool_full(&consumer_env));
}
on_both_drivers!(
    a_frame_out_of_sequence_fails_the_channel_with_reordering,
    a_frame_out_of_sequence_fails_the_channel_with_reordering_epoll,
    a_frame_out_of_sequence_fails_the_channel_with_reordering_uring
);

fn a_consumer_cancelling_midway_releases_only_its_view(transport: Transport) {
    let producer_env = env(10, transport);
    let consumer_env = env(11, transport);
    let cancelled_id = ResultPartitionId {
        partition: 80,
        producer: 10,
    };
    let kept_id = ResultPartitionId {
        partition: 81,
        producer: 10,
    };
    let cancelled = producer_env.create_partition(cancelled_id, 1).unwrap();
    // Both gates share one connection to the producer: cancelling one must not disturb the
    // other.
    let kept_gate = gate_of(&consumer_env, kept_id, producer_env.local_addr());
    let cancelled_gate = gate_of(&consumer_env, cancelled_id, producer_env.local_addr());
    let writer = emit_until_error(cancelled);
    let mut reader = RecordReader::new(cancelled_gate, 1 << 20);
    let mut received = 0u64;
    // Bounded: each read within LONG.
    while received < 5_000 {
        match reader.next_timeout(LONG) {
            Ok(Some(ReaderItem::Record { .. })) => received += 1,
            Ok(Some(ReaderItem::Event { .. })) => {}
            other => panic!("the producer streams, got {other:?}"),
        }
    }
    // The task gives up on its input midway: the gate closes, the request is cancelled.
    drop(reader);
    let (_, error) = writer.join().unwrap().expect("emit failed");
    assert!(matches!(error, PartitionError::Released), "{error:?}");
    // The other channel on the same connection is served to its end.
    let kept = healthy_producer(&producer_env, kept_id, 20_000);
    read_healthy(kept_gate, 20_000);
    kept.join().unwrap();
    assert!(common::pool_full(&producer_env));
    assert!(common::pool_full(&consumer_env));
}
on_both_drivers!(
    a_consumer_cancelling_midway_releases_only_its_view,
    a_consumer_cancelling_midway_releases_only_its_view_epoll,
    a_consumer_cancelling_midway_releases_only_its_view_uring
);
