//! The protocol without sockets: a producer-side and a consumer-side connection joined by an
//! in-memory wire that delivers bytes in random pieces, over many seeds (printed on failure).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::buffer::{DataType, NetworkBufferPool};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, GateError, GateItem, InputGate,
    SingleInputGate,
};
use fluxgate::partition::{PartitionManager, ResultPartition, ResultPartitionId};
use fluxgate::protocol::frame::{
    encode_buffer_response, encode_header, BufferResponseHeader, BUFFER_RESPONSE_HEADER,
    FRAME_HEADER,
};
use fluxgate::protocol::{
    ClientConnection, DecodeError, Message, MessageId, ProtocolError, ReceiverId, ServerConfig,
    ServerConnection,
};
use fluxgate::record::RecordDeserializer;
use fluxgate::NetworkConfig;
use proptest::prelude::*;
use proptest::test_runner::TestRng;

const SEGMENT: usize = 4096;

fn config() -> NetworkConfig {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config.set("taskmanager.memory.network.max", "4mb").unwrap();
    config.set("fluxgate.memory.arena-size", "1mb").unwrap();
    config
}

/// Both sides of one connection and the bytes in flight between them.
struct Pair {
    client: ClientConnection,
    server: ServerConnection,
    to_server: VecDeque<u8>,
    to_client: VecDeque<u8>,
    now: Instant,
    rng: TestRng,
    /// Largest piece delivered per step (1 = byte by byte).
    max_piece: usize,
}

/// What went wrong on the wire, if anything.
#[derive(Debug, PartialEq)]
enum WireError {
    Client(ProtocolError),
    Server(ProtocolError),
}

/// One end of the connection as the wire sees it.
trait Side {
    fn transmit(&mut self, now: Instant);
    fn write_slices_into(&self, out: &mut Vec<u8>);
    fn written(&mut self, n: usize);
    fn read_buffer(&mut self) -> &mut [u8];
    fn read(&mut self, n: usize, now: Instant) -> Result<(), ProtocolError>;
}

impl Side for ClientConnection {
    fn transmit(&mut self, now: Instant) {
        self.poll_transmit(now);
    }
    fn write_slices_into(&self, out: &mut Vec<u8>) {
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        self.write_slices(&mut slices, 64);
        slices.iter().for_each(|s| out.extend_from_slice(s));
    }
    fn written(&mut self, n: usize) {
        self.on_written(n);
    }
    fn read_buffer(&mut self) -> &mut [u8] {
        ClientConnection::read_buffer(self)
    }
    fn read(&mut self, n: usize, _now: Instant) -> Result<(), ProtocolError> {
        self.on_read(n)
    }
}

impl Side for ServerConnection {
    fn transmit(&mut self, now: Instant) {
        self.poll_transmit(now);
    }
    fn write_slices_into(&self, out: &mut Vec<u8>) {
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        self.write_slices(&mut slices, 64);
        slices.iter().for_each(|s| out.extend_from_slice(s));
    }
    fn written(&mut self, n: usize) {
        self.on_written(n);
    }
    fn read_buffer(&mut self) -> &mut [u8] {
        ServerConnection::read_buffer(self)
    }
    fn read(&mut self, n: usize, now: Instant) -> Result<(), ProtocolError> {
        self.on_read(n, now)
    }
}

/// Copies everything `side` wants to write onto the wire.
fn drain_into(wire: &mut VecDeque<u8>, side: &mut impl Side) -> bool {
    let mut bytes = Vec::new();
    side.write_slices_into(&mut bytes);
    side.written(bytes.len());
    wire.extend(bytes.iter());
    !bytes.is_empty()
}

/// Hands up to `piece` bytes from the wire to `side`, in as many reads as its destinations
/// need.
fn deliver(
    wire: &mut VecDeque<u8>,
    mut piece: usize,
    side: &mut impl Side,
    now: Instant,
) -> Result<bool, ProtocolError> {
    let mut moved = false;
    // Bounded by `piece`: every round moves at least one byte or stops.
    while piece > 0 && !wire.is_empty() {
        let destination = side.read_buffer();
        let n = destination.len().min(piece).min(wire.len());
        if n == 0 {
            break;
        }
        for (d, b) in destination[..n].iter_mut().zip(wire.drain(..n)) {
            *d = b;
        }
        piece -= n;
        moved = true;
        side.read(n, now)?;
    }
    Ok(moved)
}

impl Pair {
    /// Moves bytes both ways once; returns whether anything moved.
    fn step(&mut self) -> Result<bool, WireError> {
        self.client.transmit(self.now);
        self.server.transmit(self.now);
        let mut moved = drain_into(&mut self.to_server, &mut self.client);
        moved |= drain_into(&mut self.to_client, &mut self.server);
        let piece = self.rng.random_range(1..=self.max_piece);
        moved |= deliver(&mut self.to_server, piece, &mut self.server, self.now)
            .map_err(WireError::Server)?;
        let piece = self.rng.random_range(1..=self.max_piece);
        moved |= deliver(&mut self.to_client, piece, &mut self.client, self.now)
            .map_err(WireError::Client)?;
        self.now += Duration::from_micros(100);
        Ok(moved)
    }
}

struct Setup {
    consumer_network: NetworkBufferPool,
    producer_network: NetworkBufferPool,
    producers: Vec<ResultPartition>,
    gate: SingleInputGate,
    pair: Pair,
}

fn setup(channels: usize, seed: u64, max_piece: usize) -> Setup {
    let config = config();
    let producer_network = NetworkBufferPool::new(&config).unwrap();
    let consumer_network = NetworkBufferPool::new(&config).unwrap();
    let manager = Arc::new(PartitionManager::new());
    let producers: Vec<_> = (0..channels)
        .map(|i| {
            let id = ResultPartitionId {
                partition: i as u64,
                producer: 1,
            };
            let p = ResultPartition::new(id, 1, &producer_network, &config).unwrap();
            manager.register(p.handle()).unwrap();
            p
        })
        .collect();
    let specs = (0..channels)
        .map(|i| ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: ResultPartitionId {
                    partition: i as u64,
                    producer: 1,
                },
                subpartition: 0,
            },
            location: ChannelLocation::Remote,
        })
        .collect();
    let mut gate = SingleInputGate::new(
        specs,
        Arc::new(PartitionManager::new()),
        &consumer_network,
        &config,
    );
    gate.setup().unwrap();
    gate.request_partitions(Instant::now()).unwrap();
    let mut client = ClientConnection::new(2, 64, SEGMENT);
    for i in 0..channels {
        let channel = gate.remote_channel(i).unwrap();
        client
            .register(channel.shared().clone(), |listener| {
                channel.attach(listener)
            })
            .unwrap();
    }
    let server = ServerConnection::new(
        ServerConfig {
            node: 1,
            segment_size: SEGMENT,
            ..ServerConfig::default()
        },
        manager,
    );
    let rng = TestRng::from_seed(
        proptest::test_runner::RngAlgorithm::ChaCha,
        &seed.to_le_bytes().repeat(4),
    );
    Setup {
        consumer_network,
        producer_network,
        producers,
        gate,
        pair: Pair {
            client,
            server,
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            now: Instant::now(),
            rng,
            max_piece,
        },
    }
}

/// What the consumer saw per channel.
#[derive(Default, Debug)]
struct Seen {
    records: Vec<Vec<u64>>,
    barriers: Vec<Vec<(u64, bool)>>,
    ends: Vec<usize>,
}

fn read_gate(
    gate: &mut SingleInputGate,
    readers: &mut [RecordDeserializer],
    seen: &mut Seen,
) -> Result<bool, GateError> {
    let mut any = false;
    while let Some(item) = gate.poll_next()? {
        any = true;
        match item.item {
            GateItem::Buffer(buffer) => {
                let reader = &mut readers[item.channel];
                reader.set_next_buffer(buffer).unwrap();
                while let Some(record) = reader.next_record().unwrap() {
                    seen.records[item.channel]
                        .push(u64::from_be_bytes(record[..8].try_into().unwrap()));
                }
            }
            GateItem::Event {
                event: Event::EndOfPartition,
                ..
            } => seen.ends[item.channel] += 1,
            GateItem::Event {
                event: Event::CheckpointBarrier(b),
                priority,
            } => seen.barriers[item.channel].push((b.id, priority)),
            GateItem::Event { event, .. } => panic!("unexpected {event:?}"),
        }
    }
    Ok(any)
}

fn record(seq: u64, len: usize) -> Vec<u8> {
    let mut bytes = seq.to_be_bytes().to_vec();
    bytes.resize(8 + len, (seq % 251) as u8);
    bytes
}

/// Runs a whole exchange for one seed; returns an error text on a violated property.
fn exchange(seed: u64, channels: usize, records: u64, max_piece: usize) -> Result<(), String> {
    let mut s = setup(channels, seed, max_piece);
    let mut readers: Vec<_> = (0..channels)
        .map(|_| RecordDeserializer::new(1 << 20))
        .collect();
    let mut seen = Seen {
        records: vec![Vec::new(); channels],
        barriers: vec![Vec::new(); channels],
        ends: vec![0; channels],
    };
    let mut sent = vec![0u64; channels];
    let mut finished = false;
    // Bounded: every step either moves bytes, reads or emits; the limit catches a stall.
    for step in 0..2_000_000u64 {
        // Producers write in bursts while their pools allow (never blocking the test).
        for (i, producer) in s.producers.iter_mut().enumerate() {
            let burst = s.pair.rng.random_range(0..4);
            for _ in 0..burst {
                // A record spans up to three segments: emit only when they are free, so the
                // single-threaded test never blocks on back pressure.
                let pool = producer.pool();
                let room =
                    pool.spec().max_segments - pool.in_use_segments().min(pool.spec().max_segments);
                let channel_room = pool
                    .spec()
                    .max_segments_per_channel
                    .saturating_sub(pool.segments_of(0));
                if sent[i] >= records || room < 4 || channel_room < 4 {
                    break;
                }
                let len = s.pair.rng.random_range(0..SEGMENT * 2);
                producer
                    .emit_record(&record(sent[i], len)[..], 0)
                    .map_err(|e| e.to_string())?;
                sent[i] += 1;
                if sent[i] % 7 == 0 {
                    producer.flush(0);
                }
                if sent[i] % 50 == 0 {
                    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
                        id: sent[i],
                        timestamp: 0,
                        kind: CheckpointKind::Checkpoint,
                        alignment: Alignment::Unaligned,
                    });
                    producer
                        .broadcast_event(&barrier, true)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        if !finished && sent.iter().all(|&n| n >= records) {
            for producer in s.producers.iter_mut() {
                producer.finish().map_err(|e| e.to_string())?;
            }
            finished = true;
        }
        let moved = s
            .pair
            .step()
            .map_err(|e| format!("seed {seed}: wire error {e:?}"))?;
        let read = read_gate(&mut s.gate, &mut readers, &mut seen)
            .map_err(|e| format!("seed {seed}: gate {e}"))?;
        if finished && s.gate.is_finished() {
            break;
        }
        if step == 2_000_000 - 1 || (!moved && !read && finished && step > 1_000_000) {
            return Err(format!(
                "seed {seed}: stalled; sent {sent:?}, ends {:?}",
                seen.ends
            ));
        }
    }
    for c in 0..channels {
        let expected: Vec<u64> = (0..records).collect();
        if seen.records[c] != expected {
            return Err(format!(
                "seed {seed}: channel {c} records differ (got {})",
                seen.records[c].len()
            ));
        }
        if seen.ends[c] != 1 {
            return Err(format!(
                "seed {seed}: channel {c} saw {} EndOfPartition",
                seen.ends[c]
            ));
        }
        if seen.barriers[c].iter().any(|&(_, priority)| !priority) {
            return Err(format!("seed {seed}: a priority barrier lost its priority"));
        }
        if seen.barriers[c].len() as u64 != records / 50 {
            return Err(format!(
                "seed {seed}: channel {c} saw {} barriers",
                seen.barriers[c].len()
            ));
        }
    }
    // Close: the consumer says goodbye, everything goes back.
    s.pair.client.close();
    for _ in 0..1000 {
        if !s.pair.step().map_err(|e| format!("seed {seed}: {e:?}"))? {
            break;
        }
    }
    drop(s.pair);
    drop(s.gate);
    drop(s.producers);
    if s.producer_network.available_segments() != s.producer_network.total_segments() {
        return Err(format!("seed {seed}: producer segments leaked"));
    }
    if s.consumer_network.available_segments() != s.consumer_network.total_segments() {
        return Err(format!("seed {seed}: consumer segments leaked"));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_record_arrives_once_in_order_with_credit_respected(
        seed in any::<u64>(),
        channels in 1usize..4,
        max_piece in prop_oneof![Just(1usize), 2usize..64, 64usize..20_000],
    ) {
        let records = if max_piece == 1 { 30 } else { 120 };
        if let Err(message) = exchange(seed, channels, records, max_piece) {
            prop_assert!(false, "{}", message);
        }
    }
}

#[test]
fn tampered_bytes_give_a_typed_error_and_release_every_segment() {
    for seed in 0..40u64 {
        let mut s = setup(2, seed, 512);
        for producer in s.producers.iter_mut() {
            for i in 0..20 {
                producer.emit_record(&record(i, 300)[..], 0).unwrap();
            }
            producer.finish().unwrap();
        }
        let mut flipped = false;
        let mut outcome = Ok(());
        for _ in 0..10_000 {
            s.pair.client.poll_transmit(s.pair.now);
            s.pair.server.poll_transmit(s.pair.now);
            drain_into(&mut s.pair.to_client, &mut s.pair.server);
            if !flipped && s.pair.to_client.len() > 200 {
                let at = s.pair.rng.random_range(0..s.pair.to_client.len());
                s.pair.to_client[at] ^= 0xFF;
                flipped = true;
            }
            match s.pair.step() {
                Ok(_) => {}
                Err(error) => {
                    outcome = Err(error);
                    break;
                }
            }
            let _ = s.gate.poll_next();
            if s.gate.is_finished() {
                break;
            }
        }
        // A flipped byte either broke framing (a typed wire error), hit a payload (records
        // differ, still well-framed), or a field the gate rejects; never a panic or a leak.
        if let Err(WireError::Client(error)) = &outcome {
            assert!(!error.to_string().is_empty());
        }
        drop(s.pair);
        drop(s.gate);
        drop(s.producers);
        assert_eq!(
            s.consumer_network.available_segments(),
            s.consumer_network.total_segments(),
            "seed {seed}"
        );
        assert_eq!(
            s.producer_network.available_segments(),
            s.producer_network.total_segments(),
            "seed {seed}"
        );
    }
}

/// Feeds forged bytes to a fresh client with one registered channel.
fn forge(frames: impl FnOnce(ReceiverId, &mut Vec<u8>)) -> (Setup, Result<(), ProtocolError>) {
    let mut s = setup(1, 7, 1);
    let receiver = ReceiverId(1 << 64);
    let mut bytes = Vec::new();
    Message::Handshake {
        version: 1,
        node: 1,
    }
    .encode(&mut bytes);
    frames(receiver, &mut bytes);
    let mut wire: VecDeque<u8> = bytes.into_iter().collect();
    let result = deliver(&mut wire, usize::MAX, &mut s.pair.client, s.pair.now).map(|_| ());
    (s, result)
}

fn data_frame(out: &mut Vec<u8>, receiver: ReceiverId, sequence_number: u64, payload: &[u8]) {
    Message::BufferResponse(BufferResponseHeader {
        receiver,
        sequence_number,
        backlog: 0,
        data_type: DataType::DataBuffer,
        compressed: false,
        size: payload.len() as u32,
        overtaken: 0,
    })
    .encode(out);
    out.extend_from_slice(payload);
}

fn all_back(s: Setup) {
    drop(s.pair);
    drop(s.gate);
    drop(s.producers);
    assert_eq!(
        s.consumer_network.available_segments(),
        s.consumer_network.total_segments()
    );
    assert_eq!(
        s.producer_network.available_segments(),
        s.producer_network.total_segments()
    );
}

#[test]
fn a_data_buffer_beyond_the_granted_credit_is_a_protocol_error() {
    // The channel granted two exclusive buffers and no floating ones: a third data buffer
    // has nowhere to go.
    let (mut s, result) = forge(|receiver, out| {
        for seq in 0..3 {
            data_frame(out, receiver, seq, &[1; 8]);
        }
    });
    assert_eq!(
        result,
        Err(ProtocolError::CreditExceeded(ReceiverId(1 << 64)))
    );
    assert!(matches!(
        s.gate.poll_next(),
        Err(GateError::Transport { channel: 0, .. })
    ));
    all_back(s);
}

#[test]
fn a_wrong_sequence_number_fails_the_channel_with_a_reordering_error() {
    let (mut s, result) = forge(|receiver, out| {
        data_frame(out, receiver, 0, b"first");
        data_frame(out, receiver, 5, b"skipped ahead");
    });
    assert_eq!(result, Ok(()), "a channel error, not a connection error");
    assert_eq!(
        s.gate.poll_next().unwrap_err(),
        GateError::Reordering {
            channel: 0,
            expected: 1,
            actual: 5
        }
    );
    all_back(s);
}

#[test]
fn oversized_lengths_and_unknown_ids_are_decode_errors() {
    let (s, result) = forge(|_, out| {
        let mut header = [0u8; FRAME_HEADER];
        encode_header(&mut header, 1 << 30, MessageId::AddCredit);
        out.extend_from_slice(&header);
    });
    assert!(matches!(
        result,
        Err(ProtocolError::Decode(DecodeError::BadLength { .. }))
    ));
    all_back(s);
    let (s, result) = forge(|_, out| {
        let mut header = [0u8; FRAME_HEADER];
        encode_header(&mut header, FRAME_HEADER, MessageId::AddCredit);
        header[9] = 200;
        out.extend_from_slice(&header);
    });
    assert_eq!(
        result,
        Err(ProtocolError::Decode(DecodeError::UnknownMessage(200)))
    );
    all_back(s);
    let (s, result) = forge(|receiver, out| {
        // A payload larger than a segment.
        let mut header = [0u8; BUFFER_RESPONSE_HEADER];
        let forged = BufferResponseHeader {
            receiver,
            sequence_number: 0,
            backlog: 0,
            data_type: DataType::DataBuffer,
            compressed: false,
            size: SEGMENT as u32 + 1,
            overtaken: 0,
        };
        encode_buffer_response(&mut header, &forged, false);
        out.extend_from_slice(&header);
    });
    assert!(matches!(
        result,
        Err(ProtocolError::Decode(DecodeError::BadLength { .. }))
    ));
    all_back(s);
}
