//! The protocol without sockets: a producer-side and a consumer-side connection joined by an
//! in-memory wire that delivers bytes in random pieces, over many seeds (printed on failure).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fluxgate::buffer::Buffer;
use fluxgate::buffer::{DataType, NetworkBufferPool};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    AlignmentMode, ChannelLocation, ChannelSpec, ChannelStateSink, CheckpointedInputGate,
    ConsumedSubpartition, GateError, GateItem, InputGate, SingleInputGate,
};
use fluxgate::partition::{
    PartitionError, PartitionManager, ResultPartition, ResultPartitionId, TaskEventListener,
};
use fluxgate::protocol::auth::{Nonce, Transcript};
use fluxgate::protocol::frame::{
    encode_buffer_response, encode_header, BufferResponseHeader, BUFFER_RESPONSE_HEADER,
    FRAME_HEADER,
};
use fluxgate::protocol::{
    ClientConfig, ClientConnection, DecodeError, ErrorKind, Message, MessageId, ProtocolError,
    ReceiverId, RequestRate, Secret, ServerConfig, ServerConnection,
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
    /// The producer side's partitions, as its server finds them.
    manager: Arc<PartitionManager>,
    producers: Vec<ResultPartition>,
    gate: SingleInputGate,
    pair: Pair,
}

fn setup(channels: usize, seed: u64, max_piece: usize) -> Setup {
    setup_with(channels, seed, max_piece, None, None)
}

fn secret(text: &str) -> Option<Arc<Secret>> {
    Some(Arc::new(Secret::new(text.as_bytes()).unwrap()))
}

/// Fixed nonces: the pair is deterministic per seed.
const CLIENT_NONCE: Nonce = [0xC1; 32];
const SERVER_NONCE: Nonce = [0x5E; 32];

/// A pair whose client and server authenticate with these secrets (`None`: not at all).
fn setup_with(
    channels: usize,
    seed: u64,
    max_piece: usize,
    client_secret: Option<Arc<Secret>>,
    server_secret: Option<Arc<Secret>>,
) -> Setup {
    setup_reading(
        channels,
        seed,
        max_piece,
        client_secret,
        server_secret,
        SEGMENT,
    )
}

/// As [`setup_with`], the client reading payloads of up to `client_segment` bytes (the
/// segment size its `ClientConfig` says; the gate's pool has `SEGMENT`-byte segments).
fn setup_reading(
    channels: usize,
    seed: u64,
    max_piece: usize,
    client_secret: Option<Arc<Secret>>,
    server_secret: Option<Arc<Secret>>,
    client_segment: usize,
) -> Setup {
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
    let mut client = ClientConnection::with_config(
        ClientConfig {
            secret: client_secret,
            ..ClientConfig::new(2, 64, client_segment)
        },
        CLIENT_NONCE,
    );
    for i in 0..channels {
        let channel = gate.remote_channel(i).unwrap();
        client
            .register(channel.shared().clone(), |listener| {
                channel.attach(listener)
            })
            .unwrap();
    }
    let server = ServerConnection::with_nonce(
        ServerConfig {
            node: 1,
            segment_size: SEGMENT,
            secret: server_secret,
            ..ServerConfig::default()
        },
        manager.clone(),
        SERVER_NONCE,
    );
    let rng = TestRng::from_seed(
        proptest::test_runner::RngAlgorithm::ChaCha,
        &seed.to_le_bytes().repeat(4),
    );
    Setup {
        consumer_network,
        producer_network,
        manager,
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
fn exchange(
    seed: u64,
    channels: usize,
    records: u64,
    max_piece: usize,
    authenticated: bool,
) -> Result<(), String> {
    let shared = authenticated
        .then(|| secret("the cluster's shared secret"))
        .flatten();
    let mut s = setup_with(channels, seed, max_piece, shared.clone(), shared);
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

/// Moves bytes until nothing moves (bounded).
fn settle(pair: &mut Pair) {
    for _ in 0..10_000 {
        if !pair.step().unwrap() {
            return;
        }
    }
    panic!("the pair kept moving bytes");
}

/// What an unaligned checkpoint persisted, as record sequence numbers per checkpoint.
#[derive(Default)]
struct PersistedRecords {
    records: Mutex<Vec<(u64, u64)>>,
    complete: Mutex<Vec<u64>>,
}

impl ChannelStateSink for PersistedRecords {
    fn add_input_data(&self, checkpoint_id: u64, _channel: usize, buffer: Buffer) {
        let mut reader = RecordDeserializer::new(1 << 20);
        reader.set_next_buffer(buffer).unwrap();
        while let Some(record) = reader.next_record().unwrap() {
            let seq = u64::from_be_bytes(record[..8].try_into().unwrap());
            self.records.lock().unwrap().push((checkpoint_id, seq));
        }
    }

    fn add_partial_record(&self, _checkpoint_id: u64, _channel: usize, _bytes: &[u8]) {
        panic!("the test reads no records through a RecordReader");
    }

    fn input_complete(&self, checkpoint_id: u64) {
        self.complete.lock().unwrap().push(checkpoint_id);
    }

    fn abort(&self, checkpoint_id: u64) {
        panic!("checkpoint {checkpoint_id} aborted");
    }
}

/// Exactly-once across the wire: data the sender had already sent, still queued unread in
/// the consumer's channel when an unaligned barrier overtakes it there, is channel state of
/// that checkpoint, and so is the data the sender still held behind the barrier. The sender
/// counts only what it held, so the consumer counts the rest; data after the barrier is not
/// persisted.
#[test]
fn an_unaligned_barrier_persists_the_data_it_overtakes_in_the_consumer() {
    let Setup {
        consumer_network,
        producer_network,
        mut producers,
        gate,
        mut pair,
        ..
    } = setup_with(1, 7, 1 << 20, None, None);
    // Three flushed records: two buffers sent with the two exclusive credits and queued
    // unread, and a third the sender holds for want of credit.
    for seq in 0..3 {
        producers[0].emit_record(&record(seq, 100)[..], 0).unwrap();
        producers[0].flush(0);
        settle(&mut pair);
    }
    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
        id: 9,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Unaligned,
    });
    producers[0].broadcast_event(&barrier, true).unwrap();
    producers[0].emit_record(&record(3, 100)[..], 0).unwrap();
    producers[0].flush(0);
    settle(&mut pair);

    let sink = Arc::new(PersistedRecords::default());
    let mut gate = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    let mut read = Vec::new();
    // Bounded: each pass reads what arrived, then lets credit and data move.
    for _ in 0..100 {
        while let Some(item) = gate.poll_next().unwrap() {
            read.push(match item.item {
                GateItem::Buffer(_) => "data",
                GateItem::Event { priority: true, .. } => "barrier",
                GateItem::Event { .. } => "event",
            });
        }
        if read.len() == 5 {
            break;
        }
        settle(&mut pair);
    }
    assert_eq!(read, ["barrier", "data", "data", "data", "data"]);
    // Records 0 and 1 overtaken here, record 2 at the sender; record 3 came after.
    assert_eq!(*sink.records.lock().unwrap(), [(9, 0), (9, 1), (9, 2)]);
    assert_eq!(*sink.complete.lock().unwrap(), [9]);

    pair.client.close();
    settle(&mut pair);
    drop(pair);
    drop(gate);
    drop(producers);
    assert_eq!(
        producer_network.available_segments(),
        producer_network.total_segments()
    );
    assert_eq!(
        consumer_network.available_segments(),
        consumer_network.total_segments()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_record_arrives_once_in_order_with_credit_respected(
        seed in any::<u64>(),
        channels in 1usize..4,
        max_piece in prop_oneof![Just(1usize), 2usize..64, 64usize..20_000],
        authenticated in any::<bool>(),
    ) {
        let records = if max_piece == 1 { 30 } else { 120 };
        if let Err(message) = exchange(seed, channels, records, max_piece, authenticated) {
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
    forge_into(setup(1, 7, 1), frames)
}

/// Feeds the producer's handshake and forged `frames` to the client of `s`, whose one
/// channel is registered (as receiver `1 << 64`).
fn forge_into(
    mut s: Setup,
    frames: impl FnOnce(ReceiverId, &mut Vec<u8>),
) -> (Setup, Result<(), ProtocolError>) {
    let receiver = ReceiverId(1 << 64);
    let mut bytes = Vec::new();
    Message::Handshake {
        version: fluxgate::protocol::frame::VERSION,
        node: 1,
        authenticate: false,
        nonce: [0; 32],
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

/// Producer 0 writes `record` and flushes it; its server sends the buffer onto the wire
/// towards the consumer, which has not read it yet.
fn buffer_in_flight(s: &mut Setup, record: &[u8]) {
    s.producers[0].emit_record(record, 0).unwrap();
    s.producers[0].flush_all();
    s.pair.server.transmit(s.pair.now);
    assert!(drain_into(&mut s.pair.to_client, &mut s.pair.server));
}

fn all_back(s: Setup) {
    drop(s.pair);
    // The registered partitions' handles keep what their subpartitions still queue.
    drop(s.manager);
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

/// Task events a producer heard.
#[derive(Default)]
struct HeardTaskEvents(Mutex<Vec<Event>>);

impl TaskEventListener for HeardTaskEvents {
    fn on_task_event(&self, event: &Event) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// A task event sent just before the gate closed (within one turn of the I/O thread) still
/// reaches the producer, ahead of the cancel, as Flink writes a task event at once. The
/// connection saw the channel released first and sent only the cancel.
#[test]
fn a_task_event_sent_just_before_the_gate_closed_reaches_the_producer() {
    let mut s = setup(1, 11, 64);
    let heard = Arc::new(HeardTaskEvents::default());
    s.manager
        .subscribe_task_events(s.producers[0].handle().id(), heard.clone());
    settle(&mut s.pair);
    s.gate
        .send_task_event(&Event::Task(b"last word".to_vec()))
        .unwrap();
    s.gate.close();
    settle(&mut s.pair);
    assert_eq!(
        *heard.0.lock().unwrap(),
        [Event::Task(b"last word".to_vec())]
    );
    all_back(s);
}

/// A burst of task events from the consumer's own task (64 events of almost a segment on
/// each of 8 channels, 2 MiB) is no sign of a producer that does not read: the connection
/// reads on, the events reach every producer in order, the last ones ahead of the channels'
/// cancels when the gate closes right after. Moved into the outbound queue all at once, they
/// made the next read fail the connection with `ControlBacklog`.
#[test]
fn a_burst_of_task_events_keeps_the_connection_and_every_event() {
    burst_of_task_events(8, 64, false);
}

/// The same when the gate closes while data is in flight to it: the read finds the channel
/// released, and its events still held go out before its cancel, as the queue drains (all
/// of them at once from the read failed the connection).
#[test]
fn a_burst_of_task_events_then_a_close_under_data_keeps_every_event() {
    burst_of_task_events(1, 400, true);
}

/// Sends `events` events of almost a segment on each of `channels` channels before a data
/// buffer of the first channel reaches the consumer; the gate closes after that read, or
/// before it (`close_under_data`).
fn burst_of_task_events(channels: usize, events: usize, close_under_data: bool) {
    let mut s = setup(channels, 13, 1 << 16);
    let heard: Vec<_> = (0..channels)
        .map(|i| {
            let heard = Arc::new(HeardTaskEvents::default());
            s.manager
                .subscribe_task_events(s.producers[i].handle().id(), heard.clone());
            heard
        })
        .collect();
    settle(&mut s.pair);
    let event = |i: usize| Event::Task(vec![i as u8; SEGMENT - 64]);
    for i in 0..events {
        s.gate.send_task_event(&event(i)).unwrap();
    }
    // The consumer's connection queues what it sends before the producer's next frame
    // arrives; nothing of it has been written yet.
    s.pair.client.transmit(s.pair.now);
    buffer_in_flight(&mut s, b"data");
    if close_under_data {
        s.gate.close();
    }
    deliver(
        &mut s.pair.to_client,
        usize::MAX,
        &mut s.pair.client,
        s.pair.now,
    )
    .expect("the consumer's own task events are no control backlog");
    s.gate.close();
    settle(&mut s.pair);
    let expected: Vec<_> = (0..events).map(event).collect();
    for (i, heard) in heard.iter().enumerate() {
        assert!(
            *heard.0.lock().unwrap() == expected,
            "producer {i} heard {} events, not the {events} sent in order",
            heard.0.lock().unwrap().len()
        );
    }
    assert_eq!(s.pair.client.channel_count(), 0, "every channel left");
    all_back(s);
}

/// The same, when data for the channel arrives before the connection's next transmit: the
/// read finds the channel released and sends the cancel, and the task event still goes out
/// ahead of it (it was dropped with the channel).
#[test]
fn a_task_event_sent_just_before_the_gate_closed_reaches_the_producer_under_data() {
    let mut s = setup(1, 12, 64);
    let heard = Arc::new(HeardTaskEvents::default());
    s.manager
        .subscribe_task_events(s.producers[0].handle().id(), heard.clone());
    settle(&mut s.pair);
    // A buffer in flight towards the consumer.
    buffer_in_flight(&mut s, b"in flight");
    s.gate
        .send_task_event(&Event::Task(b"last word".to_vec()))
        .unwrap();
    s.gate.close();
    // The consumer's connection reads before it transmits.
    deliver(
        &mut s.pair.to_client,
        usize::MAX,
        &mut s.pair.client,
        s.pair.now,
    )
    .unwrap();
    settle(&mut s.pair);
    assert_eq!(
        *heard.0.lock().unwrap(),
        [Event::Task(b"last word".to_vec())]
    );
    all_back(s);
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
fn an_empty_buffer_spends_its_credit_and_queues_nothing() {
    // Two exclusive buffers of credit: three empty buffers and a record fit, because each empty
    // one gives its segment back at once (and with it the credit), as Flink's decoder recycles
    // it; none reaches the gate, and their sequence numbers count.
    let (mut s, result) = forge(|receiver, out| {
        for seq in 0..3 {
            data_frame(out, receiver, seq, &[]);
        }
        data_frame(out, receiver, 3, b"after");
    });
    assert_eq!(result, Ok(()));
    let item = s.gate.poll_next().unwrap().expect("the record after them");
    match item.item {
        GateItem::Buffer(buffer) => assert_eq!(buffer.as_slice(), b"after"),
        other => panic!("expected the record, got {other:?}"),
    }
    assert!(
        s.gate.poll_next().unwrap().is_none(),
        "an empty buffer was queued"
    );
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

/// A client configured for larger payloads than its gate's segments (a `ClientConfig` that
/// does not match the pool's memory) refuses a payload its segment cannot hold with a typed
/// error; it panicked slicing the segment past its end.
#[test]
fn a_payload_longer_than_the_channel_s_segment_is_refused() {
    let (s, result) = forge_into(
        setup_reading(1, 7, 1, None, None, 2 * SEGMENT),
        |receiver, out| data_frame(out, receiver, 0, &[7; SEGMENT + 1]),
    );
    assert!(
        matches!(
            result,
            Err(ProtocolError::Decode(DecodeError::BadLength { limit, .. })) if limit == SEGMENT as u64
        ),
        "{result:?}"
    );
    all_back(s);
}

/// A data frame flagged compressed is refused: nothing here decompresses (Flink compresses
/// only blocking partitions), and its bytes were read as records, garbage handed to the task.
#[test]
fn a_compressed_buffer_is_refused_as_no_codec_reads_it() {
    let (s, result) = forge(|receiver, out| {
        Message::BufferResponse(BufferResponseHeader {
            receiver,
            sequence_number: 0,
            backlog: 0,
            data_type: DataType::DataBuffer,
            compressed: true,
            size: 6,
            overtaken: 0,
        })
        .encode(out);
        out.extend_from_slice(b"\x05zstd?");
    });
    assert!(
        matches!(
            result,
            Err(ProtocolError::Decode(DecodeError::InvalidField {
                value: 1,
                ..
            }))
        ),
        "{result:?}"
    );
    all_back(s);
}

/// After PartitionNotFound no request of the channel stands until it asks again: a data
/// frame or backlog for the answered request (forged, or from a broken producer) reaches the
/// channel no more than one for a channel gone. It was taken: it used a credited segment and
/// moved the expected sequence number, and the re-request then failed the channel.
#[test]
fn frames_for_a_request_answered_not_found_do_not_reach_the_channel() {
    let (mut s, result) = forge(|receiver, out| {
        Message::ErrorResponse {
            receiver: Some(receiver),
            kind: ErrorKind::PartitionNotFound,
            message: "not yet".into(),
        }
        .encode(out);
        Message::BacklogAnnouncement {
            receiver,
            backlog: 5,
        }
        .encode(out);
        data_frame(out, receiver, 0, b"forged");
    });
    assert_eq!(result, Ok(()));
    let shared = s.gate.remote_channel(0).unwrap().shared().clone();
    assert_eq!(shared.expected_sequence(), 0, "no frame was taken");
    assert_eq!(
        shared.buffers().unannounced_credit(),
        0,
        "no floating segment was taken for the stale backlog"
    );
    assert!(s.gate.poll_next().unwrap().is_none(), "nothing to read");
    assert_eq!(
        s.pair.client.channel_count(),
        1,
        "the channel waits to ask again"
    );
    drop(shared);
    all_back(s);
}

/// PartitionNotFound after the producer sent the channel data contradicts it: the channel
/// fails with that answer at once, and asks no more (a re-request would announce its
/// exclusive credit again while a segment of it holds the unread buffer).
#[test]
fn partition_not_found_after_data_fails_the_channel_without_asking_again() {
    let (mut s, result) = forge(|receiver, out| {
        data_frame(out, receiver, 0, b"\x05hello");
        Message::ErrorResponse {
            receiver: Some(receiver),
            kind: ErrorKind::PartitionNotFound,
            message: "gone".into(),
        }
        .encode(out);
    });
    assert_eq!(result, Ok(()));
    assert_eq!(
        s.pair.client.channel_count(),
        0,
        "the channel left the connection instead of waiting to ask again"
    );
    let shared = s.gate.remote_channel(0).unwrap().shared().clone();
    assert_eq!(shared.request_retries(), 0, "no request went out again");
    // The buffer that came first is read, then the failure.
    let mut failure = None;
    for _ in 0..4 {
        match s.gate.poll_next() {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    assert!(
        matches!(
            failure,
            Some(GateError::Partition {
                source: PartitionError::PartitionNotFound(_),
                ..
            })
        ),
        "{failure:?}"
    );
    drop(shared);
    all_back(s);
}

/// Frames whose fields contradict each other are refused, as no sender of this protocol
/// writes them: a priority flag that disagrees with the data type, a compressed event, a
/// non-priority item that says it overtook data, an error without a receiver that names one.
#[test]
fn frames_whose_fields_contradict_each_other_are_refused() {
    let buffer = |data_type: DataType, compressed: bool, overtaken: u32, priority: bool| {
        let mut bytes = [0u8; BUFFER_RESPONSE_HEADER];
        let header = BufferResponseHeader {
            receiver: ReceiverId(7),
            sequence_number: 0,
            backlog: 0,
            data_type,
            compressed,
            size: 0,
            overtaken,
        };
        encode_buffer_response(&mut bytes, &header, priority);
        bytes.to_vec()
    };
    let decoded = |bytes: &[u8]| {
        let header: &[u8; FRAME_HEADER] = bytes[..FRAME_HEADER].try_into().unwrap();
        let parsed = fluxgate::protocol::frame::decode_header(header, SEGMENT).unwrap();
        Message::decode(&parsed, &bytes[FRAME_HEADER..])
    };
    let refused = |bytes: &[u8]| matches!(decoded(bytes), Err(DecodeError::InvalidField { .. }));
    // As senders write them: accepted.
    assert!(decoded(&buffer(DataType::DataBuffer, true, 0, false)).is_ok());
    assert!(decoded(&buffer(DataType::PrioritizedEventBuffer, false, 3, true)).is_ok());
    // Contradictions: refused.
    assert!(refused(&buffer(DataType::DataBuffer, false, 0, true)));
    assert!(refused(&buffer(
        DataType::PrioritizedEventBuffer,
        false,
        0,
        false
    )));
    assert!(refused(&buffer(DataType::EventBuffer, true, 0, false)));
    assert!(refused(&buffer(DataType::DataBuffer, false, 3, false)));
    let mut error = Vec::new();
    Message::ErrorResponse {
        receiver: None,
        kind: ErrorKind::Protocol,
        message: "bad".into(),
    }
    .encode(&mut error);
    assert!(decoded(&error).is_ok());
    // The receiver id field, after the frame header and the has-receiver byte.
    error[FRAME_HEADER + 16] = 1;
    assert!(refused(&error));
}

/// Runs a pair until both sides stopped (an error each, or nothing moves): returns each
/// side's error. A client that failed still hands the server what it queued (its reason).
fn run_until_refused(s: &mut Setup) -> (Option<ProtocolError>, Option<ProtocolError>) {
    let (mut client_error, mut server_error) = (None, None);
    // Bounded: a handshake takes a few steps; the limit catches a stall.
    for _ in 0..1000 {
        let p = &mut s.pair;
        if client_error.is_none() {
            p.client.poll_transmit(p.now);
        }
        if server_error.is_none() {
            p.server.poll_transmit(p.now);
        }
        let mut moved = drain_into(&mut p.to_server, &mut p.client);
        moved |= drain_into(&mut p.to_client, &mut p.server);
        if server_error.is_none() {
            match deliver(&mut p.to_server, usize::MAX, &mut p.server, p.now) {
                Ok(m) => moved |= m,
                Err(error) => server_error = Some(error),
            }
        }
        if client_error.is_none() {
            match deliver(&mut p.to_client, usize::MAX, &mut p.client, p.now) {
                Ok(m) => moved |= m,
                Err(error) => client_error = Some(error),
            }
        }
        if !moved {
            break;
        }
    }
    (client_error, server_error)
}

#[test]
fn a_wrong_or_missing_secret_fails_every_channel_with_unauthenticated() {
    let cases = [
        (
            "wrong secret",
            secret("the consumer's secret"),
            secret("the producer's secret"),
        ),
        (
            "consumer without a secret",
            None,
            secret("the producer's secret"),
        ),
        (
            "producer without a secret",
            secret("the consumer's secret"),
            None,
        ),
    ];
    for (case, client_secret, server_secret) in cases {
        let mut s = setup_with(2, 1, 64, client_secret, server_secret.clone());
        for producer in s.producers.iter_mut() {
            producer.emit_record(&record(0, 10)[..], 0).unwrap();
            producer.finish().unwrap();
        }
        let (client_error, server_error) = run_until_refused(&mut s);
        assert!(
            client_error
                .as_ref()
                .is_some_and(ProtocolError::is_authentication_failure),
            "{case}: consumer {client_error:?}"
        );
        // Every channel reports it on the gate's next read.
        for _ in 0..2 {
            assert!(
                matches!(s.gate.poll_next(), Err(GateError::Unauthenticated { .. })),
                "{case}"
            );
        }
        assert_eq!(
            s.pair.server.reader_count(),
            0,
            "{case}: served unauthenticated"
        );
        if server_secret.is_some() {
            // The producer refused too, and knows why (it logs it).
            assert!(
                server_error
                    .as_ref()
                    .is_some_and(ProtocolError::is_authentication_failure),
                "{case}: producer {server_error:?}"
            );
            assert!(s.pair.server.is_closing(), "{case}");
        }
        all_back(s);
    }
}

/// Feeds `bytes` to `server` at `now`; returns its result and what it wrote.
fn feed_server(
    server: &mut ServerConnection,
    bytes: &[u8],
    now: Instant,
) -> (Result<(), ProtocolError>, Vec<Message>) {
    let mut wire: VecDeque<u8> = bytes.iter().copied().collect();
    let result = deliver(&mut wire, usize::MAX, server, now).map(|_| ());
    let mut out = VecDeque::new();
    drain_into(&mut out, server);
    let out: Vec<u8> = out.into_iter().collect();
    let mut messages = Vec::new();
    let mut at = 0;
    // Bounded by the bytes: each frame is at least a header long.
    while at + FRAME_HEADER <= out.len() {
        let header: &[u8; FRAME_HEADER] = out[at..at + FRAME_HEADER].try_into().unwrap();
        let frame = fluxgate::protocol::frame::decode_header(header, SEGMENT).unwrap();
        let end = at + frame.length as usize;
        messages.push(Message::decode(&frame, &out[at + FRAME_HEADER..end]).unwrap());
        at = end;
    }
    (result, messages)
}

fn handshake(authenticate: bool, nonce: Nonce) -> Vec<u8> {
    let mut out = Vec::new();
    Message::Handshake {
        version: fluxgate::protocol::frame::VERSION,
        node: 9,
        authenticate,
        nonce,
    }
    .encode(&mut out);
    out
}

fn request(receiver: u128) -> Vec<u8> {
    request_with_credit(receiver, 2)
}

fn refused_with(messages: &[Message], expected: ErrorKind) -> bool {
    matches!(
        messages.last(),
        Some(Message::ErrorResponse { receiver: None, kind, .. }) if *kind == expected
    )
}

/// A frame header alone: `length` bytes in all, of message `id`.
fn header_only(id: u8, length: u32) -> Vec<u8> {
    let mut bytes = vec![0; FRAME_HEADER];
    fluxgate::protocol::frame::encode_header(&mut bytes, length as usize, MessageId::CloseRequest);
    bytes[9] = id;
    bytes
}

#[test]
fn frames_a_side_may_not_get_yet_are_refused_by_their_header_before_their_body_is_read() {
    // A task event's body may be a segment long: a peer that never completes the handshake
    // must not make the other side reserve it, so the header alone is refused. The headers
    // below come with no body at all: a side that waited for it would return Ok.
    const TASK_EVENT: u8 = 5;
    const BUFFER_RESPONSE: u8 = 2;
    let long = (SEGMENT + 40) as u32;
    let now = Instant::now();
    let mut s = setup(1, 1, 64);
    let (result, _) = feed_server(&mut s.pair.server, &header_only(TASK_EVENT, long), now);
    assert!(
        matches!(result, Err(ProtocolError::Handshake(_))),
        "a task event before the handshake: {result:?}"
    );
    all_back(s);

    let mut s = setup_with(1, 1, 64, None, secret("the producer's secret"));
    let bytes = [handshake(true, [3; 32]), header_only(TASK_EVENT, long)].concat();
    let (result, _) = feed_server(&mut s.pair.server, &bytes, now);
    assert!(
        matches!(result, Err(ProtocolError::Unauthenticated(_))),
        "a task event before the proof: {result:?}"
    );
    all_back(s);

    let mut s = setup(1, 1, 64);
    let bytes = [
        handshake(false, [3; 32]),
        header_only(BUFFER_RESPONSE, long),
    ]
    .concat();
    let (result, _) = feed_server(&mut s.pair.server, &bytes, now);
    assert!(
        matches!(
            result,
            Err(ProtocolError::UnexpectedMessage(MessageId::BufferResponse))
        ),
        "data sent to a producer: {result:?}"
    );
    all_back(s);

    let mut s = setup(1, 1, 64);
    let mut wire: VecDeque<u8> = header_only(TASK_EVENT, long).into();
    let result = deliver(&mut wire, usize::MAX, &mut s.pair.client, now);
    assert!(
        matches!(
            result,
            Err(ProtocolError::UnexpectedMessage(
                MessageId::TaskEventRequest
            ))
        ),
        "a task event sent to a consumer: {result:?}"
    );
    all_back(s);
}

#[test]
fn a_request_without_a_proof_gets_an_error_response_and_the_connection_closes() {
    for authenticate in [false, true] {
        let mut s = setup_with(1, 1, 64, None, secret("the producer's secret"));
        let server = &mut s.pair.server;
        let bytes = [handshake(authenticate, [3; 32]), request(5)].concat();
        let (result, written) = feed_server(server, &bytes, Instant::now());
        assert!(
            matches!(result, Err(ProtocolError::Unauthenticated(_))),
            "{result:?}"
        );
        assert!(
            refused_with(&written, ErrorKind::Unauthenticated),
            "{written:?}"
        );
        assert!(server.is_closing());
        assert_eq!(server.reader_count(), 0);
        all_back(s);
    }
}

/// A man in the middle passes an environment's consumer handshake to that environment's own
/// server, to carry the server's proof back to the consumer: the server refuses it before
/// proving anything (the per-direction tags do not stop this: both roles share a secret and
/// a node id).
#[test]
fn a_consumer_handshake_passed_back_to_its_own_environment_gets_no_proof() {
    let shared = secret("the cluster's shared secret");
    let mut s = setup_with(1, 1, 64, None, shared.clone());
    let server = &mut s.pair.server;
    let own_nonce = shared.as_ref().unwrap().fresh_nonce().unwrap();
    let (result, written) = feed_server(server, &handshake(true, own_nonce), Instant::now());
    assert!(
        matches!(result, Err(ProtocolError::Unauthenticated(_))),
        "{result:?}"
    );
    assert!(
        !written
            .iter()
            .any(|m| matches!(m, Message::AuthProof { .. })),
        "the server proved itself: {written:?}"
    );
    assert!(!server.is_authenticated());
    all_back(s);
    // Another environment's consumer, with the same secret, gets the proof.
    let mut s = setup_with(1, 1, 64, None, shared.clone());
    let server = &mut s.pair.server;
    let elsewhere = Secret::new(b"the cluster's shared secret").unwrap();
    let (result, written) = feed_server(
        server,
        &handshake(true, elsewhere.fresh_nonce().unwrap()),
        Instant::now(),
    );
    assert_eq!(result, Ok(()));
    assert!(written
        .iter()
        .any(|m| matches!(m, Message::AuthProof { .. })));
    all_back(s);
}

/// A connection that fails before the producer wrote anything (here: one request past its
/// channel limit, read with the handshake): the producer's handshake still goes first, so
/// the consumer takes the ErrorResponse for the failure it is, not for a refusal before any
/// handshake (a connection limit's, whose channels it would place again instead of failing).
#[test]
fn an_error_before_any_write_still_follows_the_producer_s_handshake() {
    let mut server = ServerConnection::new(
        ServerConfig {
            node: 1,
            segment_size: SEGMENT,
            max_channels: 1,
            ..ServerConfig::default()
        },
        Arc::new(PartitionManager::new()),
    );
    let bytes = [handshake(false, [0; 32]), request(5), request(6)].concat();
    let (result, written) = feed_server(&mut server, &bytes, Instant::now());
    assert!(result.is_err(), "{result:?}");
    assert!(
        matches!(
            written.as_slice(),
            [
                Message::Handshake { .. },
                Message::ErrorResponse {
                    receiver: None,
                    kind: ErrorKind::LimitExceeded,
                    ..
                }
            ]
        ),
        "{written:?}"
    );
}

#[test]
fn a_proof_for_another_connection_is_refused() {
    let shared = secret("the cluster's shared secret");
    let mut s = setup_with(1, 1, 64, None, shared.clone());
    let server = &mut s.pair.server;
    // A proof recorded on a connection where the producer had another nonce.
    let replayed = Transcript {
        client_nonce: [3; 32],
        server_nonce: [4; 32],
        client_node: 9,
        server_node: 1,
    }
    .client_proof(shared.as_ref().unwrap());
    let mut bytes = handshake(true, [3; 32]);
    Message::AuthProof { proof: replayed }.encode(&mut bytes);
    bytes.extend(request(5));
    let (result, written) = feed_server(server, &bytes, Instant::now());
    assert!(matches!(result, Err(ProtocolError::Unauthenticated(_))));
    assert!(
        refused_with(&written, ErrorKind::Unauthenticated),
        "{written:?}"
    );
    assert_eq!(server.reader_count(), 0);
    all_back(s);
    // The right proof for this connection is let in.
    let mut s = setup_with(1, 1, 64, None, shared.clone());
    let server = &mut s.pair.server;
    let proof = Transcript {
        client_nonce: [3; 32],
        server_nonce: SERVER_NONCE,
        client_node: 9,
        server_node: 1,
    }
    .client_proof(shared.as_ref().unwrap());
    let mut bytes = handshake(true, [3; 32]);
    Message::AuthProof { proof }.encode(&mut bytes);
    bytes.extend(request(5));
    let (result, _) = feed_server(server, &bytes, Instant::now());
    assert_eq!(result, Ok(()));
    assert!(server.is_authenticated());
    assert_eq!(server.reader_count(), 1);
    all_back(s);
}

#[test]
fn a_partition_request_flood_closes_the_connection_and_a_paced_one_does_not() {
    let server_for = |rate| {
        let manager = Arc::new(PartitionManager::new());
        ServerConnection::new(
            ServerConfig {
                node: 1,
                segment_size: SEGMENT,
                request_rate: rate,
                ..ServerConfig::default()
            },
            manager,
        )
    };
    let rate = RequestRate {
        per_second: 10,
        burst: 4,
    };
    let start = Instant::now();
    // Paced: the burst at once, then one every 100 ms (the refill), for 20 requests.
    let mut server = server_for(rate);
    let (result, _) = feed_server(&mut server, &handshake(false, [0; 32]), start);
    assert_eq!(result, Ok(()));
    for i in 0..20u32 {
        let now = start + Duration::from_millis(100) * i.saturating_sub(3);
        let mut bytes = request(u128::from(i) + 100);
        // Cancel at once: the channel count stays low, only the rate counts.
        Message::CancelPartitionRequest {
            receiver: ReceiverId(u128::from(i) + 100),
        }
        .encode(&mut bytes);
        let (result, _) = feed_server(&mut server, &bytes, now);
        assert_eq!(result, Ok(()), "paced request {i}");
    }
    // A flood: the burst passes, the next request closes the connection.
    let mut server = server_for(rate);
    let mut bytes = handshake(false, [0; 32]);
    for i in 0..5 {
        bytes.extend(request(100 + i));
    }
    let (result, written) = feed_server(&mut server, &bytes, start);
    assert_eq!(
        result,
        Err(ProtocolError::RequestRateExceeded {
            per_second: 10,
            burst: 4
        })
    );
    assert!(
        refused_with(&written, ErrorKind::LimitExceeded),
        "{written:?}"
    );
    assert!(server.is_closing());
    assert_eq!(server.reader_count(), 0, "views released");
}

/// The handshake deadline (`fluxgate.network.handshake-timeout`, 10 s by default).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn a_consumer_that_stays_silent_or_never_proves_is_closed_at_the_handshake_deadline() {
    let start = Instant::now();
    // (the producer's secret, what the consumer sends, the refusal it gets at the deadline)
    let cases = [
        (None, Vec::new(), ErrorKind::Protocol),
        (
            secret("the producer's secret"),
            Vec::new(),
            ErrorKind::Protocol,
        ),
        (
            secret("the producer's secret"),
            handshake(true, [3; 32]),
            ErrorKind::Unauthenticated,
        ),
    ];
    for (server_secret, sent, refusal) in cases {
        let mut s = setup_with(1, 1, 64, None, server_secret);
        let server = &mut s.pair.server;
        let (result, _) = feed_server(server, &sent, start);
        assert_eq!(result, Ok(()));
        server.poll_transmit(start);
        assert_eq!(server.poll_timeout(), Some(start + HANDSHAKE_TIMEOUT));
        server.poll_transmit(start + HANDSHAKE_TIMEOUT - Duration::from_millis(1));
        assert!(!server.is_closing(), "open until the deadline");
        server.poll_transmit(start + HANDSHAKE_TIMEOUT);
        assert!(server.is_closing(), "{refusal:?}");
        let (_, written) = feed_server(server, &[], start + HANDSHAKE_TIMEOUT);
        assert!(refused_with(&written, refusal), "{written:?}");
        all_back(s);
    }
    // A consumer that completed its handshake has no deadline.
    let mut s = setup_with(1, 1, 64, None, None);
    let server = &mut s.pair.server;
    let (result, _) = feed_server(server, &handshake(false, [0; 32]), start);
    assert_eq!(result, Ok(()));
    server.poll_transmit(start + HANDSHAKE_TIMEOUT * 100);
    assert!(!server.is_closing());
    assert_eq!(server.poll_timeout(), None);
    all_back(s);
}

#[test]
fn a_producer_that_stays_silent_fails_the_channels_at_the_handshake_deadline() {
    let start = Instant::now();
    let mut s = setup_with(2, 1, 64, None, None);
    let client = &mut s.pair.client;
    client.poll_transmit(start);
    assert_eq!(client.poll_timeout(), Some(start + HANDSHAKE_TIMEOUT));
    client.poll_transmit(start + HANDSHAKE_TIMEOUT - Duration::from_millis(1));
    assert!(!client.is_closed(), "open until the deadline");
    assert!(matches!(s.gate.poll_next(), Ok(None)));
    s.pair.client.poll_transmit(start + HANDSHAKE_TIMEOUT);
    assert!(s.pair.client.is_closed());
    // Every channel reports it on the gate's next read.
    for _ in 0..2 {
        let error = s.gate.poll_next().unwrap_err();
        assert!(
            error.to_string().contains("no handshake from the producer"),
            "{error}"
        );
    }
    all_back(s);
}

/// A partition request for partition 0, subpartition 0 bringing `credit` (the consumer's
/// exclusive buffers).
fn request_with_credit(receiver: u128, credit: u32) -> Vec<u8> {
    encoded_message(&Message::PartitionRequest {
        partition: ResultPartitionId {
            partition: 0,
            producer: 1,
        },
        subpartition: 0,
        receiver: ReceiverId(receiver),
        credit,
    })
}

/// Lets `server` move what it can into its outbound queue, then decodes what it wrote.
fn transmit_and_collect(server: &mut ServerConnection, now: Instant) -> Vec<Message> {
    server.poll_transmit(now);
    feed_server(server, &[], now).1
}

/// Flink's `needAnnounceBacklog`: a sender stopped at zero credit announces its backlog only
/// to a consumer without exclusive buffers (initial credit 0), which has no other way to learn
/// that it must find floating buffers. A consumer with exclusive buffers learns the backlog
/// from every BufferResponse and gets its credit back as it reads.
#[test]
fn a_sender_out_of_credit_announces_its_backlog_only_to_a_consumer_without_exclusive_buffers() {
    let responses = |messages: &[Message]| {
        messages
            .iter()
            .filter(|m| matches!(m, Message::BufferResponse(_)))
            .count()
    };
    let announced = |messages: &[Message]| -> Vec<u32> {
        messages
            .iter()
            .filter_map(|m| match m {
                Message::BacklogAnnouncement { receiver, backlog } => {
                    assert_eq!(*receiver, ReceiverId(7));
                    Some(*backlog)
                }
                _ => None,
            })
            .collect()
    };
    for initial_credit in [0u32, 2] {
        let mut s = setup_with(1, 1, 64, None, None);
        // Four 1000-byte records fill a 4 KiB segment; the ninth finishes the second buffer.
        let mut emitted = 0;
        let mut emit = |s: &mut Setup, n: u64| {
            for _ in 0..n {
                s.producers[0]
                    .emit_record(&record(emitted, 1000)[..], 0)
                    .unwrap();
                emitted += 1;
            }
        };
        emit(&mut s, 9);
        let now = Instant::now();
        let bytes = [
            handshake(false, [3; 32]),
            request_with_credit(7, initial_credit),
        ]
        .concat();
        let (result, _) = feed_server(&mut s.pair.server, &bytes, now);
        assert_eq!(result, Ok(()));
        let written = transmit_and_collect(&mut s.pair.server, now);
        assert_eq!(responses(&written), initial_credit as usize, "{written:?}");
        if initial_credit == 0 {
            assert_eq!(announced(&written), [2], "{written:?}");
        } else {
            assert_eq!(announced(&written), [], "{written:?}");
        }
        // The credit ran out with the queue drained (credit 2) or untouched (credit 0); two
        // more finished buffers now wake the reader, which still has no credit.
        emit(&mut s, 8);
        let written = transmit_and_collect(&mut s.pair.server, now);
        assert_eq!(responses(&written), 0, "{written:?}");
        assert_eq!(announced(&written), [], "{written:?}");
        // Credit moves the stalled sender on in both cases.
        let add = encoded_message(&Message::AddCredit {
            receiver: ReceiverId(7),
            credit: 2,
        });
        let (result, _) = feed_server(&mut s.pair.server, &add, now);
        assert_eq!(result, Ok(()));
        let written = transmit_and_collect(&mut s.pair.server, now);
        assert_eq!(responses(&written), 2, "{written:?}");
        all_back(s);
    }
}

fn encoded_message(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    message.encode(&mut out);
    out
}

/// Flink's reader `resumeConsumption`: a consumer without exclusive buffers gave its floating
/// ones back when the reader blocked on an aligned barrier, so ResumeConsumption takes back
/// the credit the sender still had and the sender announces its backlog instead of sending.
/// A resume of a reader that never blocked leaves its credit alone.
#[test]
fn a_resume_after_an_aligned_barrier_takes_back_the_credit_of_a_consumer_without_exclusive_ones() {
    let announced = |messages: &[Message]| -> Vec<u32> {
        messages
            .iter()
            .filter_map(|m| match m {
                Message::BacklogAnnouncement { backlog, .. } => Some(*backlog),
                _ => None,
            })
            .collect()
    };
    let responses = |messages: &[Message]| -> Vec<DataType> {
        messages
            .iter()
            .filter_map(|m| match m {
                Message::BufferResponse(header) => Some(header.data_type),
                _ => None,
            })
            .collect()
    };
    let mut s = setup_with(1, 1, 64, None, None);
    let now = Instant::now();
    let receiver = ReceiverId(7);
    // One flushed record, the barrier, then nine 1000-byte records: two full buffers and a
    // tail behind the barrier.
    s.producers[0].emit_record(&record(0, 10)[..], 0).unwrap();
    s.producers[0].flush(0);
    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
        id: 1,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Aligned,
    });
    s.producers[0].broadcast_event(&barrier, false).unwrap();
    for i in 0..9 {
        s.producers[0].emit_record(&record(i, 1000)[..], 0).unwrap();
    }
    let server = &mut s.pair.server;
    let bytes = [handshake(false, [3; 32]), request_with_credit(7, 0)].concat();
    assert_eq!(feed_server(server, &bytes, now).0, Ok(()));
    assert_eq!(announced(&transmit_and_collect(server, now)), [3]);
    // Three credits: the record's buffer goes, then the barrier (no credit), and the reader
    // blocks holding two.
    let add = encoded_message(&Message::AddCredit {
        receiver,
        credit: 3,
    });
    assert_eq!(feed_server(server, &add, now).0, Ok(()));
    let written = transmit_and_collect(server, now);
    assert_eq!(
        responses(&written),
        [DataType::DataBuffer, DataType::AlignedCheckpointBarrier]
    );
    assert_eq!(server.credit_of(receiver), Some(2));
    // The resume takes the two back: the backlog is announced, nothing is sent.
    let resume = encoded_message(&Message::ResumeConsumption { receiver });
    assert_eq!(feed_server(server, &resume, now).0, Ok(()));
    let written = transmit_and_collect(server, now);
    assert_eq!(server.credit_of(receiver), Some(0));
    assert_eq!(responses(&written), []);
    assert_eq!(announced(&written), [2]);
    // Four credits send the two full buffers and the tail (flushed before the barrier) and
    // keep one; a resume without a barrier before it leaves that one.
    let add = encoded_message(&Message::AddCredit {
        receiver,
        credit: 4,
    });
    assert_eq!(feed_server(server, &add, now).0, Ok(()));
    assert_eq!(
        responses(&transmit_and_collect(server, now)),
        [DataType::DataBuffer; 3]
    );
    assert_eq!(server.credit_of(receiver), Some(1));
    assert_eq!(feed_server(server, &resume, now).0, Ok(()));
    assert_eq!(transmit_and_collect(server, now), []);
    assert_eq!(server.credit_of(receiver), Some(1));
    all_back(s);
}

/// A sender at zero credit for a consumer without exclusive buffers, woken when nothing was
/// readable (a flush of nothing), must still hear of the next finished buffer: the consumer
/// asks for floating buffers only for a backlog it is told of.
#[test]
fn a_reader_woken_for_nothing_at_zero_credit_still_announces_the_next_buffer() {
    let mut s = setup_with(1, 1, 64, None, None);
    let now = Instant::now();
    let bytes = [handshake(false, [3; 32]), request_with_credit(7, 0)].concat();
    assert_eq!(feed_server(&mut s.pair.server, &bytes, now).0, Ok(()));
    assert_eq!(transmit_and_collect(&mut s.pair.server, now), []);
    // A flush with nothing written wakes the reader for nothing.
    s.producers[0].flush(0);
    assert_eq!(transmit_and_collect(&mut s.pair.server, now), []);
    // Five 1000-byte records finish a buffer.
    for i in 0..5 {
        s.producers[0].emit_record(&record(i, 1000)[..], 0).unwrap();
    }
    let written = transmit_and_collect(&mut s.pair.server, now);
    assert!(
        matches!(
            written[..],
            [Message::BacklogAnnouncement {
                receiver: ReceiverId(7),
                backlog: 1
            }]
        ),
        "{written:?}"
    );
    all_back(s);
}

/// A listener that hears nothing (the test looks at the view itself).
struct Deaf;

impl fluxgate::partition::AvailabilityListener for Deaf {
    fn notify_data_available(&self) {}
    fn notify_priority_event(&self) {}
}

/// A producer's server (node 1) with default settings, and the partition manager it serves.
fn producer_server() -> (ServerConnection, Arc<PartitionManager>) {
    let manager = Arc::new(PartitionManager::new());
    let server = ServerConnection::new(
        ServerConfig {
            node: 1,
            segment_size: SEGMENT,
            ..ServerConfig::default()
        },
        manager.clone(),
    );
    (server, manager)
}

/// A producer's server with a request of receiver 5 waiting for partition 0 (not registered),
/// behind which the consumer sent `words` as task events; and what the server answered.
fn a_request_waiting_with_task_events(
    words: &[&[u8]],
) -> (
    ServerConnection,
    Arc<PartitionManager>,
    Instant,
    Vec<Message>,
) {
    let (mut server, manager) = producer_server();
    let start = Instant::now();
    let mut bytes = handshake(false, [0; 32]);
    bytes.extend(request(5));
    bytes.extend(task_event_requests(words));
    let (result, answered) = feed_server(&mut server, &bytes, start);
    assert_eq!(result, Ok(()));
    (server, manager, start, answered)
}

/// The partition `a_request_waiting_with_task_events` asks for.
const WAITED_FOR: ResultPartitionId = ResultPartitionId {
    partition: 0,
    producer: 1,
};

/// TaskEventRequests of receiver 5 for [`WAITED_FOR`], one per word.
fn task_event_requests(words: &[&[u8]]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for word in words {
        let mut event = Vec::new();
        Event::Task(word.to_vec()).encode(&mut event);
        bytes.extend(encoded_message(&Message::TaskEventRequest {
            partition: WAITED_FOR,
            receiver: ReceiverId(5),
            event,
        }));
    }
    bytes
}

fn tasks(words: &[&[u8]]) -> Vec<Event> {
    words
        .iter()
        .map(|word| Event::Task(word.to_vec()))
        .collect()
}

/// Task events a consumer sends while its request waits for the partition reach the producer,
/// in order, once the partition is set up (its producer listens from then on). They went
/// nowhere: no producer listened yet.
#[test]
fn task_events_sent_while_the_request_waits_reach_the_producer_once_it_is_found() {
    let (mut server, manager, start, _) =
        a_request_waiting_with_task_events(&[b"first", b"second"]);
    // The producer sets its partition up: it listens, then registers.
    let heard = Arc::new(HeardTaskEvents::default());
    manager.subscribe_task_events(WAITED_FOR, heard.clone());
    let network = NetworkBufferPool::new(&config()).unwrap();
    let partition = ResultPartition::new(WAITED_FOR, 1, &network, &config()).unwrap();
    manager.register(partition.handle()).unwrap();
    server.poll_transmit(start + Duration::from_millis(60));
    assert_eq!(server.reader_count(), 1, "the request was served");
    assert_eq!(*heard.0.lock().unwrap(), tasks(&[b"first", b"second"]));
    drop((server, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Held task events go to a producer that listens by now, in order, ahead of the next event
/// or the consumer's cancel, without waiting for the partition.
#[test]
fn held_task_events_go_first_once_their_producer_listens() {
    for cancel in [false, true] {
        let (mut server, manager, start, _) = a_request_waiting_with_task_events(&[b"first"]);
        let heard = Arc::new(HeardTaskEvents::default());
        manager.subscribe_task_events(WAITED_FOR, heard.clone());
        let next = if cancel {
            encoded_message(&Message::CancelPartitionRequest {
                receiver: ReceiverId(5),
            })
        } else {
            task_event_requests(&[b"second"])
        };
        let (result, _) = feed_server(&mut server, &next, start);
        assert_eq!(result, Ok(()));
        let expected: &[&[u8]] = if cancel {
            &[b"first"]
        } else {
            &[b"first", b"second"]
        };
        assert_eq!(
            *heard.0.lock().unwrap(),
            tasks(expected),
            "cancel: {cancel}"
        );
    }
}

/// The task events a connection holds for waiting requests are bounded: past 1 MiB the
/// request is refused (LimitExceeded for its receiver) rather than memory growing with what
/// a consumer sends.
#[test]
fn task_events_held_past_the_bound_refuse_their_request() {
    let big = [7u8; 3000];
    let words: Vec<&[u8]> = std::iter::repeat_n(&big[..], 400).collect();
    let (mut server, manager, start, messages) = a_request_waiting_with_task_events(&words);
    assert!(
        messages.iter().any(|m| matches!(
            m,
            Message::ErrorResponse {
                receiver: Some(ReceiverId(5)),
                kind: ErrorKind::LimitExceeded,
                ..
            }
        )),
        "{messages:?}"
    );
    let network = NetworkBufferPool::new(&config()).unwrap();
    let partition = ResultPartition::new(WAITED_FOR, 1, &network, &config()).unwrap();
    manager.register(partition.handle()).unwrap();
    server.poll_transmit(start + Duration::from_millis(60));
    assert_eq!(
        server.reader_count(),
        0,
        "the refused request was withdrawn"
    );
    drop((server, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// An ErrorResponse for one receiver ends its request as a cancellation does, also while the
/// request still waits for its partition: once the partition registers, no reader is made
/// for it. One was, holding the subpartition's one view and a channel slot until the
/// connection closed.
#[test]
fn an_error_for_a_receiver_waiting_for_its_partition_withdraws_the_request() {
    let (mut server, manager) = producer_server();
    let start = Instant::now();
    let mut bytes = handshake(false, [0; 32]);
    bytes.extend(request(5));
    bytes.extend(encoded_message(&Message::ErrorResponse {
        receiver: Some(ReceiverId(5)),
        kind: ErrorKind::Protocol,
        message: "the consumer gave up on it".into(),
    }));
    let (result, _) = feed_server(&mut server, &bytes, start);
    assert_eq!(result, Ok(()));
    let network = NetworkBufferPool::new(&config()).unwrap();
    let id = ResultPartitionId {
        partition: 0,
        producer: 1,
    };
    let partition = ResultPartition::new(id, 1, &network, &config()).unwrap();
    manager.register(partition.handle()).unwrap();
    // Past several retries of a request still waiting (every 50 ms), within its deadline.
    for ms in [60, 200, 1000] {
        server.poll_transmit(start + Duration::from_millis(ms));
    }
    assert_eq!(
        server.reader_count(),
        0,
        "a reader for the withdrawn request"
    );
    assert!(
        partition.handle().create_view(0, Arc::new(Deaf)).is_ok(),
        "the subpartition's view is free"
    );
    drop((server, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}
