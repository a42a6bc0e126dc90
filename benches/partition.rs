//! Producer-only throughput: records written through a `ResultPartition` into one
//! pipelined subpartition whose view a second thread drains (dropping the buffers recycles
//! their segments to the partition's pool). Reported per record.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fluxgate::buffer::NetworkBufferPool;
use fluxgate::partition::{
    AvailabilityListener, PartitionManager, ResultPartition, ResultPartitionId,
};
use fluxgate::NetworkConfig;

/// The drainer polls; it needs no wake-ups (it yields between empty polls).
struct Quiet;

impl AvailabilityListener for Quiet {
    fn notify_data_available(&self) {}
}

fn producer(c: &mut Criterion) {
    let mut group = c.benchmark_group("producer");
    for size in [8usize, 1024] {
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("{size} B records"), |b| {
            b.iter_custom(|iterations| run(size, iterations));
        });
    }
    group.finish();
}

/// Emits `iterations` records with a drainer thread; returns the producer's elapsed time.
fn run(size: usize, iterations: u64) -> Duration {
    let config = NetworkConfig::default();
    let network = NetworkBufferPool::new(&config).expect("network memory");
    let manager = PartitionManager::new();
    let id = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let mut partition = ResultPartition::new(id, 1, &network, &config).expect("partition");
    manager
        .register(partition.handle())
        .expect("registered once");
    let mut view = manager.create_view(id, 0, Arc::new(Quiet)).expect("view");
    let record = vec![0x5Au8; size];
    let done = Arc::new(AtomicBool::new(false));
    let drained = done.clone();
    let drainer = thread::spawn(move || {
        // Bounded by the producer: it sets `done` after its last record and flush.
        loop {
            match view.poll_next() {
                Some(item) => drop(black_box(item)),
                None if drained.load(Ordering::Acquire) => {
                    if view.poll_next().is_none() {
                        break;
                    }
                }
                None => thread::yield_now(),
            }
        }
    });
    let started = Instant::now();
    for _ in 0..iterations {
        partition
            .emit_record(&record[..], 0)
            .expect("partition alive");
    }
    partition.flush(0);
    let elapsed = started.elapsed();
    done.store(true, Ordering::Release);
    drainer.join().expect("drainer");
    elapsed
}

criterion_group!(benches, producer);
criterion_main!(benches);
