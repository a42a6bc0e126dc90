//! The wire protocol's state machines without sockets: a BufferResponse header's encoding and
//! decoding, and a `ServerConnection` → `ClientConnection` pair moving full 32 KiB data
//! buffers.
//!
//! `cargo bench --bench protocol` (add `-- --quick` for a short run).
//!
//! * `buffer_response_header`: one op = encoding the 48-byte header (`encode_buffer_response`),
//!   decoding it (`decode_header` + `decode_buffer_response`), or both; time = ns per op.
//! * `pair`: one iteration = one 32 KiB data buffer through the whole path, reported as bytes/s
//!   (criterion scales the amount moved to the measurement time instead of a fixed 1 GB): the
//!   server's `poll_transmit` takes it from the subpartition view and queues `[header | payload]`
//!   straight from the segment; the "wire" copies the server's write slices into the client's
//!   read buffers in full-size pieces (10-byte frame header, 38-byte BufferResponse header, the
//!   32 KiB payload straight into the segment the channel reserved); the gate is read and the
//!   buffer dropped (its segment is credit again); the client's `poll_transmit` announces the
//!   credit and the AddCredit frames cross the wire back. No kernel, no syscalls, one thread.
//!   Producing the buffers (`emit_record`: serializing a 32 764-byte record into a pooled
//!   segment, itself a 32 KiB copy) happens between the timed rounds and is not counted; the
//!   rounds are timed one by one (two clock reads per round of up to three buffers). Caches
//!   are warm: the producer has just written the payload. `pair/32 KiB memcpy alone` is the
//!   wire's copy by itself, for scale.

use std::hint::black_box;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fluxgate::buffer::{DataType, NetworkBufferPool};
use fluxgate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, GateItem, InputGate, SingleInputGate,
};
use fluxgate::partition::{PartitionManager, ResultPartition, ResultPartitionId};
use fluxgate::protocol::frame::{
    decode_buffer_response, decode_header, encode_buffer_response, BufferResponseHeader,
    BUFFER_RESPONSE_BODY, BUFFER_RESPONSE_HEADER, FRAME_HEADER,
};
use fluxgate::protocol::{ClientConnection, ReceiverId, ServerConfig, ServerConnection};
use fluxgate::NetworkConfig;

/// Payload bytes per segment (the default `taskmanager.memory.segment-size`).
const SEGMENT: usize = 32 * 1024;

const PARTITION: ResultPartitionId = ResultPartitionId {
    partition: 0,
    producer: 1,
};

fn header() -> BufferResponseHeader {
    BufferResponseHeader {
        receiver: ReceiverId(1 << 64 | 3),
        sequence_number: 123_456,
        backlog: 7,
        data_type: DataType::DataBuffer,
        compressed: false,
        size: SEGMENT as u32,
        overtaken: 0,
    }
}

fn decode(bytes: &[u8; BUFFER_RESPONSE_HEADER]) -> BufferResponseHeader {
    let frame_header: &[u8; FRAME_HEADER] = bytes[..FRAME_HEADER].try_into().expect("10 bytes");
    let body: &[u8; BUFFER_RESPONSE_BODY] = bytes[FRAME_HEADER..].try_into().expect("38 bytes");
    let frame = decode_header(frame_header, SEGMENT).expect("a valid frame header");
    decode_buffer_response(&frame, body).expect("a valid BufferResponse header")
}

fn buffer_response_header(c: &mut Criterion) {
    let mut group = c.benchmark_group("buffer_response_header");
    group.throughput(Throughput::Elements(1));
    let header = header();
    let mut encoded = [0u8; BUFFER_RESPONSE_HEADER];
    encode_buffer_response(&mut encoded, &header, false);
    assert_eq!(decode(&encoded), header);

    group.bench_function("encode", |b| {
        let mut out = [0u8; BUFFER_RESPONSE_HEADER];
        b.iter(|| {
            encode_buffer_response(black_box(&mut out), black_box(&header), false);
        })
    });
    group.bench_function("decode", |b| b.iter(|| decode(black_box(&encoded))));
    group.bench_function("encode + decode", |b| {
        let mut out = [0u8; BUFFER_RESPONSE_HEADER];
        b.iter(|| {
            encode_buffer_response(black_box(&mut out), black_box(&header), false);
            decode(black_box(&out))
        })
    });
    group.finish();
}

/// A producer's partition and server connection, a consumer's gate and client connection.
struct Pair {
    producer_network: NetworkBufferPool,
    consumer_network: NetworkBufferPool,
    partition: ResultPartition,
    server: ServerConnection,
    client: ClientConnection,
    gate: SingleInputGate,
    record: Vec<u8>,
    now: Instant,
    buffers_read: u64,
    bytes_read: u64,
}

impl Pair {
    fn new() -> Self {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.memory.network.max", "16mb")
            .expect("valid size");
        assert_eq!(config.segment_size, SEGMENT);
        let producer_network = NetworkBufferPool::new(&config).expect("16 MiB of network memory");
        let consumer_network = NetworkBufferPool::new(&config).expect("16 MiB of network memory");
        let manager = Arc::new(PartitionManager::new());
        let partition = ResultPartition::new(PARTITION, 1, &producer_network, &config)
            .expect("a partition pool fits");
        manager
            .register(partition.handle())
            .expect("registered once");
        let spec = ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: PARTITION,
                subpartition: 0,
            },
            location: ChannelLocation::Remote,
        };
        let mut gate = SingleInputGate::new(
            vec![spec],
            Arc::new(PartitionManager::new()),
            &consumer_network,
            &config,
        );
        gate.setup().expect("a gate pool fits");
        gate.request_partitions(Instant::now())
            .expect("a remote channel");
        let mut client = ClientConnection::new(2, 1, SEGMENT);
        let channel = gate.remote_channel(0).expect("channel 0 is remote");
        client
            .register(channel.shared().clone(), |listener| {
                channel.attach(listener)
            })
            .expect("room for one channel");
        let server = ServerConnection::new(
            ServerConfig {
                node: 1,
                segment_size: SEGMENT,
                ..ServerConfig::default()
            },
            manager,
        );
        Self {
            producer_network,
            consumer_network,
            partition,
            server,
            client,
            gate,
            // With its length prefix, a record that fills a segment exactly.
            record: vec![0xA5; SEGMENT - fluxgate::record::prefix_len(SEGMENT)],
            now: Instant::now(),
            buffers_read: 0,
            bytes_read: 0,
        }
    }

    /// Emits records while the partition's pool has room for them (never blocking), then
    /// flushes. Not timed.
    fn produce(&mut self) {
        let spec = self.partition.pool().spec();
        // Keep two segments spare: the one the next record finishes into and a new one.
        let room = |pool: &fluxgate::buffer::LocalBufferPool| {
            spec.max_segments.saturating_sub(pool.in_use_segments()) > 2
                && spec
                    .max_segments_per_channel
                    .saturating_sub(pool.segments_of(0))
                    > 2
        };
        let mut emitted = false;
        while room(self.partition.pool()) {
            self.partition
                .emit_record(&self.record[..], 0)
                .expect("the partition accepts records");
            emitted = true;
        }
        if emitted {
            self.partition.flush(0);
        }
    }

    /// One round of both state machines (timed): the server sends what its credit allows, the
    /// bytes cross to the client, the gate is read, the client's credit crosses back.
    fn round(&mut self) {
        self.server.poll_transmit(self.now);
        let mut slices = Vec::with_capacity(64);
        self.server.write_slices(&mut slices, 64);
        let written = wire(
            &slices,
            &mut self.client,
            |client| client.read_buffer(),
            |client, n| client.on_read(n).expect("a valid stream"),
        );
        drop(slices);
        self.server.on_written(written);
        while let Some(item) = self.gate.poll_next().expect("a healthy channel") {
            if let GateItem::Buffer(buffer) = item.item {
                self.buffers_read += 1;
                self.bytes_read += buffer.len() as u64;
                // Dropping the buffer recycles its segment: credit for the next one.
            }
        }
        self.client.poll_transmit(self.now);
        let now = self.now;
        let mut slices = Vec::with_capacity(64);
        self.client.write_slices(&mut slices, 64);
        let written = wire(
            &slices,
            &mut self.server,
            |server| server.read_buffer(),
            |server, n| server.on_read(n, now).expect("a valid stream"),
        );
        drop(slices);
        self.client.on_written(written);
    }

    /// Moves `buffers` more data buffers through; returns the time spent in [`round`]s.
    fn transfer(&mut self, buffers: u64) -> Duration {
        let target = self.buffers_read + buffers;
        let mut timed = Duration::ZERO;
        let mut idle_rounds = 0;
        while self.buffers_read < target {
            self.produce();
            let before = self.buffers_read;
            let start = Instant::now();
            self.round();
            timed += start.elapsed();
            idle_rounds = if self.buffers_read == before {
                idle_rounds + 1
            } else {
                0
            };
            assert!(idle_rounds < 1000, "the pair stalled");
        }
        timed
    }
}

/// The "wire": copies the sender's write slices into the receiver's read buffers in the
/// largest pieces each destination takes (one `on_read` per piece). This memcpy stands in for
/// the kernel's send and receive copies and is part of the measured cost. Returns the bytes
/// moved (for the sender's `on_written`).
fn wire<R>(
    slices: &[IoSlice<'_>],
    receiver: &mut R,
    read_buffer: impl Fn(&mut R) -> &mut [u8],
    on_read: impl Fn(&mut R, usize),
) -> usize {
    let mut moved = 0;
    for slice in slices {
        let mut rest: &[u8] = slice;
        while !rest.is_empty() {
            let destination = read_buffer(receiver);
            let n = destination.len().min(rest.len());
            destination[..n].copy_from_slice(&rest[..n]);
            on_read(receiver, n);
            rest = &rest[n..];
            moved += n;
        }
    }
    moved
}

fn pair(c: &mut Criterion) {
    let mut pair = Pair::new();
    // Handshakes and the partition request, then a check that every buffer is a full segment.
    pair.transfer(100);
    assert_eq!(pair.bytes_read, pair.buffers_read * SEGMENT as u64);

    let mut group = c.benchmark_group("pair");
    group.throughput(Throughput::Bytes(SEGMENT as u64));
    group.bench_function("32 KiB data buffers", |b| {
        b.iter_custom(|iters| pair.transfer(iters))
    });
    // The floor: the wire's copy alone, 32 KiB between two cache-warm buffers.
    group.bench_function("32 KiB memcpy alone", |b| {
        let from = vec![0xA5u8; SEGMENT];
        let mut to = vec![0u8; SEGMENT];
        b.iter(|| to.copy_from_slice(black_box(&from)));
        black_box(&to);
    });
    group.finish();

    assert_eq!(pair.bytes_read, pair.buffers_read * SEGMENT as u64);
    let Pair {
        producer_network,
        consumer_network,
        partition,
        server,
        client,
        gate,
        ..
    } = pair;
    drop((client, gate, server, partition));
    assert_eq!(
        producer_network.available_segments(),
        producer_network.total_segments()
    );
    assert_eq!(
        consumer_network.available_segments(),
        consumer_network.total_segments()
    );
}

criterion_group!(benches, buffer_response_header, pair);
criterion_main!(benches);
