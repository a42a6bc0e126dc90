//! Segment leases through the pools: request a segment, drop it (which recycles it), on one
//! thread and across two threads.
//!
//! `cargo bench --bench pool` (add `-- --quick` for a short run).

use std::hint::black_box;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use fluxgate::buffer::{
    Buffer, BufferBuilder, DataType, LocalBufferPool, LocalPoolSpec, NetworkBufferPool,
};
use fluxgate::NetworkConfig;

/// Items in flight between the two threads (below the partition pool's maximum of 10, so the
/// producer mostly waits on the hand-over rather than on the pool).
const QUEUE_CAPACITY: usize = 8;

/// Bound on every wait in the two-thread benchmarks; reaching it means a lost segment or a
/// stuck peer, never a slow machine.
const STUCK: Duration = Duration::from_secs(30);

/// Default configuration with 16 MiB of network memory (512 segments of 32 KiB).
fn config() -> NetworkConfig {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.network.max", "16mb")
        .expect("valid size");
    config
}

fn pools(config: &NetworkConfig) -> (NetworkBufferPool, LocalBufferPool) {
    let network = NetworkBufferPool::new(config).expect("16 MiB of network memory");
    let local = network
        .create_local_pool(LocalPoolSpec::for_partition(1, config))
        .expect("a partition pool fits");
    (network, local)
}

/// A builder for subpartition 0: at once if the pool has one, else waiting (bounded) for the
/// other thread to recycle one.
fn builder(pool: &LocalBufferPool) -> BufferBuilder {
    match pool.request_buffer_builder(0) {
        Some(builder) => builder,
        None => pool
            .request_buffer_builder_blocking(0, STUCK)
            .expect("a segment comes back within the bound"),
    }
}

/// The builder's (empty) content as a finished buffer; builder and consumer are dropped here,
/// so the buffer is the segment's only lease.
fn into_buffer(mut builder: BufferBuilder) -> Buffer {
    let mut consumer = builder.create_consumer_from_beginning();
    builder.finish();
    consumer.build()
}

fn one_thread(c: &mut Criterion) {
    let config = config();
    let (network, local) = pools(&config);
    let mut group = c.benchmark_group("segment request+recycle, one thread");
    group.throughput(Throughput::Elements(1));
    group.bench_function("LocalBufferPool::request_buffer_builder + drop", |b| {
        b.iter(|| {
            let builder = local.request_buffer_builder(0).expect("pool has room");
            drop(black_box(builder));
        })
    });
    group.bench_function("NetworkBufferPool::request_segment + drop", |b| {
        b.iter(|| {
            let segment = network.request_segment().expect("network has segments");
            drop(black_box(segment));
        })
    });
    group.bench_function(
        "NetworkBufferPool::request_segment + into_builder + drop",
        |b| {
            b.iter(|| {
                let segment = network.request_segment().expect("network has segments");
                drop(black_box(segment.into_builder(DataType::DataBuffer)));
            })
        },
    );
    group.finish();
    assert_eq!(local.in_use_segments(), 0);
    drop(local);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// `iters` items made on this thread by `make`, handed over through a bounded lock-free queue
/// and dropped on a second thread. Returns the time from the first `make` until the second
/// thread has dropped the last item.
fn round_trips_array_queue<T: Send + 'static>(iters: u64, mut make: impl FnMut() -> T) -> Duration {
    let queue = Arc::new(ArrayQueue::<T>::new(QUEUE_CAPACITY));
    let (ready_tx, ready_rx) = mpsc::sync_channel::<()>(0);
    let receiver = {
        let queue = Arc::clone(&queue);
        thread::spawn(move || {
            ready_tx.send(()).expect("bench thread waits");
            let deadline = Instant::now() + STUCK;
            let mut received = 0;
            while received < iters {
                match queue.pop() {
                    Some(item) => {
                        drop(black_box(item));
                        received += 1;
                    }
                    None => {
                        assert!(Instant::now() < deadline, "producer stuck");
                        thread::yield_now();
                    }
                }
            }
        })
    };
    ready_rx.recv().expect("receiver started");
    let start = Instant::now();
    let deadline = start + STUCK;
    for _ in 0..iters {
        let mut item = make();
        while let Err(back) = queue.push(item) {
            assert!(Instant::now() < deadline, "receiver stuck");
            item = back;
            thread::yield_now();
        }
    }
    receiver.join().expect("receiver thread");
    start.elapsed()
}

/// As [`round_trips_array_queue`], but the builders themselves go through a blocking
/// `sync_channel`; dropping a builder on the second thread finishes it and recycles its segment.
fn round_trips_sync_channel(pool: &LocalBufferPool, iters: u64) -> Duration {
    let (tx, rx) = mpsc::sync_channel::<BufferBuilder>(QUEUE_CAPACITY);
    let (ready_tx, ready_rx) = mpsc::sync_channel::<()>(0);
    let receiver = thread::spawn(move || {
        ready_tx.send(()).expect("bench thread waits");
        let mut received = 0;
        while received < iters {
            let builder = rx.recv_timeout(STUCK).expect("producer stuck");
            drop(black_box(builder));
            received += 1;
        }
    });
    ready_rx.recv().expect("receiver started");
    let start = Instant::now();
    for _ in 0..iters {
        tx.send(builder(pool)).expect("receiver alive");
    }
    receiver.join().expect("receiver thread");
    start.elapsed()
}

fn two_threads(c: &mut Criterion) {
    let config = config();
    let (network, local) = pools(&config);
    let mut group = c.benchmark_group("two threads");
    group.throughput(Throughput::Elements(1));
    group.bench_function(
        "builder -> Buffer via ArrayQueue(8), dropped on the other thread",
        |b| b.iter_custom(|iters| round_trips_array_queue(iters, || into_buffer(builder(&local)))),
    );
    // The hand-over alone, without segments: the difference to the line above is the pool's.
    group.bench_function("baseline: u64 via ArrayQueue(8), no segment", |b| {
        b.iter_custom(|iters| round_trips_array_queue(iters, || black_box(7u64)))
    });
    group.bench_function(
        "BufferBuilder via sync_channel(8), dropped on the other thread",
        |b| b.iter_custom(|iters| round_trips_sync_channel(&local, iters)),
    );
    group.finish();
    assert_eq!(local.in_use_segments(), 0);
    drop(local);
    assert_eq!(network.available_segments(), network.total_segments());
}

criterion_group!(benches, one_thread, two_threads);
criterion_main!(benches);
