//! Records into segments and back: `record::serialize` through a [`SegmentSink`] over pooled
//! builders, and [`RecordDeserializer`] over the resulting buffers.
//!
//! `cargo bench --bench record` (add `-- --quick` for a short run). Serialization reports one
//! record per iteration (time = ns/record); deserialization one pass over a prepared stream,
//! with both records/s and bytes/s. The deserializer hands out records as borrowed slices and
//! the benchmark does not read them, so its bytes/s counts record bytes delivered, not read
//! (only records spanning two segments are copied).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fluxgate::buffer::{
    Buffer, BufferBuilder, BufferConsumer, LocalBufferPool, LocalPoolSpec, NetworkBufferPool,
};
use fluxgate::record::{self, RecordDeserializer, RecordError, SegmentSink};
use fluxgate::NetworkConfig;

/// Segments of serialized records the deserialization benchmark reads per pass (16 × 32 KiB).
const PREPARED_SEGMENTS: usize = 16;

/// Record sizes benchmarked: a bare `u64`-sized record and a 1 KiB one.
const SIZES: [usize; 2] = [8, 1024];

/// The current builder and a consumer reading it from the start; a full builder is finished and
/// its bytes built into a [`Buffer`], which is dropped (recycled at once) or kept.
struct BenchSink<'a> {
    pool: &'a LocalBufferPool,
    current: Option<(BufferBuilder, BufferConsumer)>,
    /// `Some`: keep the finished buffers (to prepare deserializer input); `None`: drop them.
    kept: Option<Vec<Buffer>>,
}

impl<'a> BenchSink<'a> {
    fn new(pool: &'a LocalBufferPool, keep: bool) -> Self {
        Self {
            pool,
            current: None,
            kept: keep.then(Vec::new),
        }
    }

    /// Finishes the current builder (if any) and builds its bytes into a buffer.
    fn ship(&mut self) {
        if let Some((mut builder, mut consumer)) = self.current.take() {
            builder.finish();
            let buffer = consumer.build();
            drop((builder, consumer));
            match self.kept.as_mut() {
                Some(kept) => kept.push(buffer),
                None => drop(buffer),
            }
        }
    }

    /// The kept buffers, after shipping the current builder.
    fn into_buffers(mut self) -> Vec<Buffer> {
        self.ship();
        self.kept.take().unwrap_or_default()
    }
}

impl SegmentSink for BenchSink<'_> {
    #[inline]
    fn writable(&mut self) -> Result<&mut BufferBuilder, RecordError> {
        if self.current.as_ref().is_some_and(|(b, _)| b.is_full()) {
            self.ship();
        }
        if self.current.is_none() {
            let builder = self
                .pool
                .request_buffer_builder(0)
                .expect("the benchmark pool never runs dry");
            let consumer = builder.create_consumer_from_beginning();
            self.current = Some((builder, consumer));
        }
        Ok(&mut self.current.as_mut().expect("just set").0)
    }

    #[inline]
    fn commit(&mut self) {
        if let Some((builder, _)) = self.current.as_mut() {
            builder.commit();
        }
    }
}

fn setup() -> (NetworkConfig, NetworkBufferPool, LocalBufferPool) {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.network.max", "16mb")
        .expect("valid size");
    let network = NetworkBufferPool::new(&config).expect("16 MiB of network memory");
    // A partition pool, but large enough to hold the prepared stream plus a spare segment.
    let spec = LocalPoolSpec {
        max_segments: PREPARED_SEGMENTS + 2,
        max_segments_per_channel: PREPARED_SEGMENTS + 2,
        ..LocalPoolSpec::for_partition(1, &config)
    };
    let pool = network.create_local_pool(spec).expect("the pool fits");
    (config, network, pool)
}

/// A record of `size` bytes with varying content.
fn record_of(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 31 + 7) as u8).collect()
}

fn serialize(c: &mut Criterion) {
    let (config, network, pool) = setup();
    let mut group = c.benchmark_group("serialize");
    for size in SIZES {
        let record = record_of(size);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(format!("{size} B record"), |b| {
            let mut sink = BenchSink::new(&pool, false);
            b.iter(|| {
                record::serialize(black_box(&record[..]), &mut sink, config.max_record_bytes)
                    .expect("record fits the maximum")
            });
            drop(sink.into_buffers());
        });
    }
    group.finish();
    assert_eq!(pool.in_use_segments(), 0);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Whole segments of `size`-byte records: the buffers and the number of records in them.
fn prepare(pool: &LocalBufferPool, size: usize, max_record_bytes: usize) -> (Vec<Buffer>, u64) {
    let record = record_of(size);
    let mut sink = BenchSink::new(pool, true);
    let mut records = 0;
    // Stop at the first record that would start a segment beyond the prepared ones, so the
    // stream ends on a record boundary.
    while sink.kept.as_ref().map_or(0, Vec::len) < PREPARED_SEGMENTS - 1
        || sink
            .current
            .as_ref()
            .is_some_and(|(b, _)| b.remaining() >= record::framed_len(size))
    {
        record::serialize(&record[..], &mut sink, max_record_bytes).expect("record fits");
        records += 1;
    }
    let buffers = sink.into_buffers();
    // Check the stream once, outside any timing.
    let mut deserializer = RecordDeserializer::new(max_record_bytes);
    let mut read = 0;
    for buffer in buffers.iter().cloned() {
        deserializer
            .set_next_buffer(buffer)
            .expect("read to the end");
        while let Some(got) = deserializer.next_record().expect("valid stream") {
            assert_eq!(got, &record[..]);
            read += 1;
        }
    }
    deserializer.finish().expect("ends on a record boundary");
    assert_eq!(read, records);
    (buffers, records)
}

fn deserialize(c: &mut Criterion) {
    let (config, network, pool) = setup();
    let mut group = c.benchmark_group("deserialize");
    for size in SIZES {
        let (buffers, records) = prepare(&pool, size, config.max_record_bytes);
        group.throughput(Throughput::ElementsAndBytes {
            elements: records,
            bytes: records * size as u64,
        });
        group.bench_function(
            format!("{size} B records, {PREPARED_SEGMENTS} segments per iteration"),
            |b| {
                let mut deserializer = RecordDeserializer::new(config.max_record_bytes);
                b.iter_batched(
                    // Clones only bump the segments' lease counts.
                    || buffers.clone(),
                    |input| {
                        for buffer in input {
                            deserializer
                                .set_next_buffer(buffer)
                                .expect("read to the end");
                            while let Some(record) =
                                deserializer.next_record().expect("valid stream")
                            {
                                black_box(record);
                            }
                        }
                    },
                    BatchSize::SmallInput,
                )
            },
        );
        drop(buffers);
    }
    group.finish();
    assert_eq!(pool.in_use_segments(), 0);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

criterion_group!(benches, serialize, deserialize);
criterion_main!(benches);
