//! Property: any interleaving of requests, recycles (on the requesting thread or another one)
//! and local-pool creation/destruction from several threads loses no segment and never hands
//! one segment to two owners.

use std::collections::HashSet;
use std::sync::{mpsc, Mutex};
use std::thread;

use fluxgate::buffer::{
    Buffer, BufferBuilder, LocalBufferPool, LocalPoolSpec, NetworkBufferPool, PooledSegment,
};
use fluxgate::NetworkConfig;
use proptest::prelude::*;

const SEGMENTS: usize = 24;

#[derive(Clone, Debug)]
enum Op {
    /// Request a builder for a subpartition from the thread's pool.
    Builder(usize),
    /// Request an unaccounted segment from the thread's pool.
    Segment,
    /// Request straight from the global pool.
    Global,
    /// Turn the oldest held builder into a buffer plus a clone of it.
    Share,
    /// Drop the oldest / newest thing held.
    DropOldest,
    DropNewest,
    /// Hand the oldest thing held to the next thread, which drops it there.
    SendAway,
    /// Destroy the thread's pool (things held stay valid) and create a fresh one.
    ReplacePool,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3).prop_map(Op::Builder),
        2 => Just(Op::Segment),
        1 => Just(Op::Global),
        2 => Just(Op::Share),
        3 => Just(Op::DropOldest),
        2 => Just(Op::DropNewest),
        2 => Just(Op::SendAway),
        1 => Just(Op::ReplacePool),
    ]
}

enum Held {
    Builder(BufferBuilder),
    Segment(PooledSegment),
    Shared(Buffer, Buffer),
}

impl Held {
    fn index(&self) -> u32 {
        match self {
            Held::Builder(b) => b.segment_index(),
            Held::Segment(s) => s.index(),
            Held::Shared(a, b) => {
                assert_eq!(
                    a.segment_index(),
                    b.segment_index(),
                    "a clone shares the segment"
                );
                a.segment_index()
            }
        }
    }
}

/// Segments currently owned by some test thread: a second owner of one is a bug.
struct Owners(Mutex<HashSet<u32>>);

impl Owners {
    fn claim(&self, held: Held) -> Held {
        assert!(
            self.0.lock().unwrap().insert(held.index()),
            "segment {} handed to two owners",
            held.index()
        );
        held
    }

    fn release(&self, held: Held) {
        assert!(self.0.lock().unwrap().remove(&held.index()));
        drop(held);
    }
}

fn pool_for(network: &NetworkBufferPool) -> LocalBufferPool {
    let spec = LocalPoolSpec {
        min_segments: 2,
        max_segments: 6,
        subpartitions: 3,
        max_segments_per_channel: 3,
        max_listeners: 1,
        max_overdraft_segments: usize::MAX,
    };
    network.create_local_pool(spec).expect("minimums fit")
}

fn run_thread(
    network: &NetworkBufferPool,
    owners: &Owners,
    ops: &[Op],
    outbox: mpsc::Sender<Held>,
    inbox: mpsc::Receiver<Held>,
) {
    let mut pool = pool_for(network);
    let mut held: Vec<Held> = Vec::new();
    for op in ops {
        // Things sent by the neighbour thread are recycled here, across threads.
        while let Ok(foreign) = inbox.try_recv() {
            owners.release(foreign);
        }
        match op {
            Op::Builder(channel) => {
                if let Some(b) = pool.request_buffer_builder(*channel) {
                    held.push(owners.claim(Held::Builder(b)));
                }
            }
            Op::Segment => {
                if let Some(s) = pool.request_segment() {
                    held.push(owners.claim(Held::Segment(s)));
                }
            }
            Op::Global => {
                if let Some(s) = network.request_segment() {
                    held.push(owners.claim(Held::Segment(s)));
                }
            }
            Op::Share => {
                if let Some(pos) = held.iter().position(|h| matches!(h, Held::Builder(_))) {
                    let Held::Builder(mut builder) = held.remove(pos) else {
                        unreachable!()
                    };
                    let mut consumer = builder.create_consumer_from_beginning();
                    builder.append_and_commit(&[1, 2, 3]);
                    drop(builder);
                    let buffer = consumer.build();
                    let copy = buffer.clone();
                    held.push(Held::Shared(buffer, copy));
                }
            }
            Op::DropOldest => {
                if !held.is_empty() {
                    owners.release(held.remove(0));
                }
            }
            Op::DropNewest => {
                if let Some(h) = held.pop() {
                    owners.release(h);
                }
            }
            Op::SendAway => {
                if !held.is_empty() {
                    let h = held.remove(0);
                    if let Err(mpsc::SendError(h)) = outbox.send(h) {
                        owners.release(h);
                    }
                }
            }
            Op::ReplacePool => {
                pool.destroy();
                pool = pool_for(network);
            }
        }
    }
    for h in held {
        owners.release(h);
    }
    drop(outbox);
    // Drain until the neighbour hung up, so nothing it sent is left unreleased.
    while let Ok(foreign) = inbox.recv() {
        owners.release(foreign);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn no_segment_is_lost_or_doubly_owned(
        a in prop::collection::vec(op(), 0..120),
        b in prop::collection::vec(op(), 0..120),
        c in prop::collection::vec(op(), 0..120),
    ) {
        let mut config = NetworkConfig::default();
        config.set("taskmanager.memory.segment-size", "4kb").unwrap();
        config.set("taskmanager.memory.network.max", &(SEGMENTS * 4096).to_string()).unwrap();
        config.set("fluxgate.memory.arena-size", "32kb").unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let owners = Owners(Mutex::new(HashSet::new()));
        // A ring of threads: each sends to the next.
        let (tx_ab, rx_ab) = mpsc::channel();
        let (tx_bc, rx_bc) = mpsc::channel();
        let (tx_ca, rx_ca) = mpsc::channel();
        thread::scope(|s| {
            let (network, owners) = (&network, &owners);
            s.spawn(move || run_thread(network, owners, &a, tx_ab, rx_ca));
            s.spawn(move || run_thread(network, owners, &b, tx_bc, rx_ab));
            s.spawn(move || run_thread(network, owners, &c, tx_ca, rx_bc));
        });
        prop_assert!(owners.0.lock().unwrap().is_empty());
        prop_assert_eq!(network.available_segments(), SEGMENTS);
    }
}
