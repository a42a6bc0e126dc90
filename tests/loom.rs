//! loom model checks of the segment lease protocol (run with `RUSTFLAGS="--cfg loom"`).
//!
//! Under `--cfg loom` the crate's atomics (segment lease counts and markers, local-pool
//! counters) are loom's, so loom explores their interleavings and the values weak orderings
//! allow. The free lists are crossbeam `ArrayQueue`s on std atomics: loom sees each of their
//! operations as one indivisible step and does not reorder around them.
//!
//! Every model builds its own tiny network memory (4 KiB segments) inside the model closure,
//! so each explored execution starts from fresh loom objects.
#![cfg(loom)]

use fluxgate::buffer::{Buffer, DataType, LocalPoolSpec, NetworkBufferPool};
use fluxgate::NetworkConfig;
use loom::thread;

/// A network memory of `segments` segments of 4 KiB.
fn network(segments: usize) -> NetworkBufferPool {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config
        .set(
            "taskmanager.memory.network.max",
            &(segments * 4096).to_string(),
        )
        .unwrap();
    config.set("fluxgate.memory.arena-size", "64kb").unwrap();
    NetworkBufferPool::new(&config).unwrap()
}

/// What the writer of model (a) appends, in two commits: consumers may see 0, 2 or 5 bytes.
const FIRST: &[u8] = b"ab";
const SECOND: &[u8] = b"cde";

/// Bytes the consumer has built so far must be exactly a committed prefix of what was written.
fn check_prefix(seen: &[u8]) {
    let all = [FIRST, SECOND].concat();
    assert!(
        [0, FIRST.len(), all.len()].contains(&seen.len()),
        "consumer saw {} bytes, not a commit boundary",
        seen.len()
    );
    assert_eq!(seen, &all[..seen.len()], "consumer saw bytes never written");
}

/// (a) One thread writes and commits while another builds buffers from a consumer created
/// before the split: the consumer sees only committed, correct bytes; once it sees the writer
/// finished it sees everything; and the segment goes back to the pool exactly once, whichever
/// side drops last.
#[test]
fn builder_and_consumer_on_two_threads() {
    loom::model(|| {
        let pool = network(2);
        let mut builder = pool
            .request_segment()
            .unwrap()
            .into_builder(DataType::DataBuffer);
        let mut consumer = builder.create_consumer_from_beginning();

        let reader = thread::spawn(move || {
            let mut seen = Vec::new();
            let mut kept: Vec<Buffer> = Vec::new();
            for _ in 0..2 {
                let finished = consumer.is_finished();
                let buffer = consumer.build();
                seen.extend_from_slice(buffer.as_slice());
                check_prefix(&seen);
                kept.push(buffer);
                if finished {
                    // `finish` publishes the final position with the flag in one store.
                    assert_eq!(seen, [FIRST, SECOND].concat(), "finished but bytes missing");
                    assert!(!consumer.is_data_available());
                    break;
                }
            }
            // Drop the leases here, possibly last: then this thread recycles the segment.
            drop(kept);
            drop(consumer);
        });

        assert_eq!(builder.append_and_commit(FIRST), FIRST.len());
        assert_eq!(builder.append_and_commit(SECOND), SECOND.len());
        drop(builder); // finishes and releases the writer's lease

        reader.join().unwrap();
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (b) A buffer and its clone dropped on two threads: the segment is recycled exactly once (a
/// second recycle would overflow the global free list, which holds exactly every segment, and
/// panic; none would leave the count short).
#[test]
fn buffer_clones_dropped_on_two_threads() {
    loom::model(|| {
        let pool = network(2);
        let mut builder = pool
            .request_segment()
            .unwrap()
            .into_builder(DataType::DataBuffer);
        let mut consumer = builder.create_consumer_from_beginning();
        builder.append_and_commit(b"xyz");
        drop(builder);
        let buffer = consumer.build();
        drop(consumer);
        let clone = buffer.clone();
        assert_eq!(pool.available_segments(), pool.total_segments() - 1);

        let other = thread::spawn(move || {
            assert_eq!(clone.as_slice(), b"xyz");
            drop(clone);
        });
        assert_eq!(buffer.as_slice(), b"xyz");
        drop(buffer);
        other.join().unwrap();

        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (b, local) As (b), with the segment from a local pool and three leases (the buffer, a
/// clone, a slice) split over two threads: it goes back to the local pool's free list exactly
/// once and its subpartition count drops to zero.
#[test]
fn local_buffer_leases_dropped_on_two_threads() {
    loom::model(|| {
        let pool = network(2);
        let local = pool
            .create_local_pool(LocalPoolSpec {
                min_segments: 2,
                max_segments: 2,
                subpartitions: 1,
                max_segments_per_channel: 2,
                max_listeners: 1,
            })
            .unwrap();
        let mut builder = local.request_buffer_builder(0).unwrap();
        let mut consumer = builder.create_consumer_from_beginning();
        builder.append_and_commit(b"xyz");
        drop(builder);
        let buffer = consumer.build();
        drop(consumer);
        let clone = buffer.clone();
        let slice = buffer.slice(1, 2);
        assert_eq!(local.segments_of(0), 1);

        let other = thread::spawn(move || {
            assert_eq!(clone.as_slice(), b"xyz");
            drop(clone);
        });
        drop(buffer);
        assert_eq!(slice.as_slice(), b"yz");
        drop(slice);
        other.join().unwrap();

        assert_eq!(local.segments_of(0), 0);
        assert_eq!(local.in_use_segments(), 0);
        assert_eq!(local.available_segments(), 1);
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (c) A local pool: one thread drops a builder (recycling its segment into the pool, or past
/// it to the global pool) while another requests a builder. The global pool is empty at the
/// start, so the request either reuses the recycled segment or finds none; either way no
/// segment is handed out twice (`BufferBuilder::new` asserts the segment had no lease), none
/// is lost, and the per-subpartition count matches the builders alive.
#[test]
fn local_pool_recycle_races_request() {
    loom::model(|| {
        let pool = network(2);
        let local = pool
            .create_local_pool(LocalPoolSpec {
                min_segments: 2,
                max_segments: 4,
                subpartitions: 1,
                max_segments_per_channel: 4,
                max_listeners: 1,
            })
            .unwrap();
        let first = local.request_buffer_builder(0).unwrap();
        let second = local.request_buffer_builder(0).unwrap();
        assert_eq!(pool.available_segments(), 0);
        let first_index = first.segment_index();

        let recycler = thread::spawn(move || drop(first));
        let third = local.request_buffer_builder(0);
        recycler.join().unwrap();

        if let Some(third) = &third {
            // The only segment that can be free is the one just recycled.
            assert_eq!(third.segment_index(), first_index);
            assert_ne!(third.segment_index(), second.segment_index());
        }
        let alive = 1 + usize::from(third.is_some());
        assert_eq!(local.segments_of(0), alive);
        // Every segment is leased, in the local pool's free list, or back in the global pool.
        assert_eq!(
            alive + local.available_segments() + pool.available_segments(),
            pool.total_segments()
        );
        assert_eq!(
            local.requested_segments() + pool.available_segments(),
            pool.total_segments()
        );
        // Nothing is leased by two: a request now gets the free segment if the race left one.
        let fourth = if third.is_none() {
            Some(
                local
                    .request_buffer_builder(0)
                    .expect("the recycled segment"),
            )
        } else {
            None
        };
        drop((second, third, fourth));
        assert_eq!(local.in_use_segments(), 0);
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}
