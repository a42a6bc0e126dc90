//! Segment leases and pools through the public API: who sees which bytes, where segments go
//! back, and how local pools hand them out, wait for them and give them up.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::Duration;

use fluxgate::buffer::{
    BufferListener, DataType, LocalPoolSpec, NetworkBufferPool, PoolError, PooledSegment, HEADROOM,
    MOST_POOL_CHANNELS,
};
use fluxgate::NetworkConfig;

/// A generous bound for waits that must end because another thread acts; never a sleep.
const LONG: Duration = Duration::from_secs(20);

fn network(segments: usize) -> (NetworkBufferPool, NetworkConfig) {
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
    (NetworkBufferPool::new(&config).unwrap(), config)
}

fn spec(min: usize, max: usize) -> LocalPoolSpec {
    LocalPoolSpec {
        min_segments: min,
        max_segments: max,
        subpartitions: 2,
        max_segments_per_channel: max,
        max_listeners: 4,
        max_overdraft_segments: usize::MAX,
    }
}

#[test]
fn arenas_cover_every_segment_with_headroom() {
    let (pool, _) = network(40);
    let arenas = pool.arenas();
    // 64 KiB arenas hold 15 segments of 4 KiB + 64 B headroom: 40 segments need 3 arenas.
    assert_eq!(arenas.len(), 3);
    let stride = 4096 + HEADROOM;
    for index in 0..40u32 {
        let (arena, offset) = pool.locate(index);
        assert!(offset >= HEADROOM && (offset - HEADROOM) % stride == 0);
        assert!(offset + 4096 <= arenas[arena].len);
    }
    assert_eq!(pool.available_segments(), 40);
}

#[test]
fn consumer_sees_only_committed_bytes_and_reads_on_while_writing() {
    let (pool, _) = network(4);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    let mut consumer = builder.create_consumer();
    assert_eq!(builder.append(b"hello"), 5);
    assert!(
        !consumer.is_data_available(),
        "uncommitted bytes are invisible"
    );
    builder.commit();
    let first = consumer.build();
    assert_eq!(first.as_slice(), b"hello");
    assert_eq!(builder.append_and_commit(b" world"), 6);
    let second = consumer.build();
    assert_eq!(second.as_slice(), b" world");
    assert_eq!(second.offset(), 5);
    assert!(!consumer.is_finished());
    builder.finish();
    assert!(consumer.is_finished());
    assert!(consumer.build().is_empty());
    drop((builder, consumer, first));
    assert_eq!(
        pool.available_segments(),
        3,
        "one buffer still holds the segment"
    );
    drop(second);
    assert_eq!(pool.available_segments(), 4);
}

#[test]
fn append_stops_at_capacity_and_trim_never_cuts_written_bytes() {
    let (pool, _) = network(2);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    assert_eq!(builder.append(&[7u8; 5000]), 4096);
    assert!(builder.is_full());
    assert_eq!(builder.append(b"x"), 0);
    let mut small = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    small.append(&[1u8; 100]);
    small.trim(10);
    assert_eq!(small.capacity(), 100);
    small.trim(1 << 20);
    assert_eq!(small.capacity(), 4096);
    drop((builder, small));
    assert_eq!(pool.available_segments(), 2);
}

#[test]
fn dropping_the_builder_finishes_it_for_consumers() {
    let (pool, _) = network(1);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::EventBuffer);
    let mut consumer = builder.create_consumer_from_beginning();
    builder.append(b"abc");
    drop(builder);
    assert!(consumer.is_finished());
    let buffer = consumer.build();
    assert_eq!(buffer.as_slice(), b"abc");
    assert_eq!(buffer.data_type(), DataType::EventBuffer);
    drop((consumer, buffer));
    assert_eq!(pool.available_segments(), 1);
}

#[test]
fn broadcast_copies_share_one_segment_until_the_last_reader_drops() {
    let (pool, _) = network(2);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    let mut a = builder.create_consumer();
    let mut b = a.copy();
    builder.append_and_commit(b"shared");
    drop(builder);
    assert_eq!(a.build().as_slice(), b"shared");
    drop(a);
    assert_eq!(pool.available_segments(), 1);
    assert_eq!(b.build().as_slice(), b"shared");
    drop(b);
    assert_eq!(pool.available_segments(), 2);
}

#[test]
fn headroom_is_writable_only_by_the_sole_lease_at_offset_zero() {
    let (pool, _) = network(2);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    let mut consumer = builder.create_consumer_from_beginning();
    builder.append_and_commit(b"payload");
    let mut whole = consumer.build();
    assert!(
        whole.headroom_mut().is_none(),
        "builder and consumer still share it"
    );
    drop((builder, consumer));
    let mut tail = whole.slice(3, 4);
    assert!(
        tail.headroom_mut().is_none(),
        "a slice not at offset 0 has no headroom"
    );
    assert!(
        whole.headroom_mut().is_none(),
        "the slice shares the segment"
    );
    drop(tail);
    let header = whole.headroom_mut().expect("sole lease at offset 0");
    header.fill(0xEE);
    let frame = whole.with_headroom();
    assert_eq!(frame.len(), HEADROOM + 7);
    assert!(frame[..HEADROOM].iter().all(|&b| b == 0xEE));
    assert_eq!(&frame[HEADROOM..], b"payload");
    drop(whole);
    assert_eq!(pool.available_segments(), 2);
}

#[test]
fn bytes_view_keeps_the_segment_until_dropped() {
    let (pool, _) = network(1);
    let mut builder = pool
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    let mut consumer = builder.create_consumer_from_beginning();
    builder.append_and_commit(b"zero copy");
    drop(builder);
    let bytes = consumer.build().into_bytes();
    drop(consumer);
    let part = bytes.slice(5..);
    drop(bytes);
    assert_eq!(pool.available_segments(), 0);
    assert_eq!(&part[..], b"copy");
    drop(part);
    assert_eq!(pool.available_segments(), 1);
}

#[test]
fn a_pool_spec_counting_more_channels_than_a_pool_may_is_refused() {
    // The pool sizes a counter per subpartition and a queue slot per listener up front: such
    // counts panicked (or aborted the process) in the allocation.
    let (network, _) = network(4);
    for spec in [
        LocalPoolSpec {
            max_listeners: usize::MAX,
            ..spec(1, 2)
        },
        LocalPoolSpec {
            subpartitions: MOST_POOL_CHANNELS + 1,
            ..spec(1, 2)
        },
    ] {
        assert!(
            matches!(network.create_local_pool(spec), Err(PoolError::Config(_))),
            "{spec:?}"
        );
    }
    let most = LocalPoolSpec {
        max_listeners: MOST_POOL_CHANNELS,
        subpartitions: MOST_POOL_CHANNELS,
        ..spec(1, 2)
    };
    drop(network.create_local_pool(most).unwrap());
    assert_eq!(network.available_segments(), 4);
}

#[test]
fn local_pool_stops_at_its_maximum_and_per_channel_limit() {
    let (network, _) = network(16);
    let pool = network
        .create_local_pool(LocalPoolSpec {
            max_segments_per_channel: 2,
            ..spec(2, 5)
        })
        .unwrap();
    let a: Vec<_> = (0..2)
        .map(|_| pool.request_buffer_builder(0).unwrap())
        .collect();
    assert!(
        pool.request_buffer_builder(0).is_none(),
        "channel 0 at its limit"
    );
    assert!(!pool.is_available(0));
    let b: Vec<_> = (0..2)
        .map(|_| pool.request_buffer_builder(1).unwrap())
        .collect();
    assert_eq!(pool.segments_of(0), 2);
    let c = pool.request_segment().unwrap();
    assert!(pool.request_segment().is_none(), "pool at its maximum of 5");
    assert_eq!(pool.in_use_segments(), 5);
    assert_eq!(network.available_segments(), 11);
    drop(a);
    assert_eq!(pool.segments_of(0), 0);
    assert!(pool.request_buffer_builder(0).is_some());
    drop((b, c));
    drop(pool);
    assert_eq!(network.available_segments(), 16);
}

#[test]
fn recycled_segments_above_the_minimum_go_back_to_the_global_pool() {
    let (network, _) = network(8);
    let pool = network.create_local_pool(spec(1, 4)).unwrap();
    let held: Vec<_> = (0..4).map(|_| pool.request_segment().unwrap()).collect();
    assert_eq!(network.available_segments(), 4);
    drop(held);
    assert_eq!(pool.requested_segments(), 1, "keeps its minimum");
    assert_eq!(pool.available_segments(), 1);
    assert_eq!(network.available_segments(), 7);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_pool_at_its_minimum_rewrites_the_segment_free_longest_not_the_one_just_read() {
    let (network, _) = network(4);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let mut written = Vec::new();
    for _ in 0..4 {
        let segment = pool.request_segment().unwrap();
        written.push(segment.index());
        drop(segment);
        // Kept at the minimum, nothing lost on the way: one held here, three free globally.
        assert_eq!(pool.requested_segments(), 1);
        assert_eq!(pool.available_segments(), 1);
        assert_eq!(network.available_segments(), 3);
    }
    written.sort_unstable();
    written.dedup();
    assert_eq!(written.len(), 4, "each request wrote a different segment");
    drop(pool);
    assert_eq!(network.available_segments(), 4);
}

#[test]
fn a_pool_holding_every_segment_keeps_the_one_it_gets_back() {
    let (network, _) = network(2);
    let pool = network.create_local_pool(spec(2, 2)).unwrap();
    let (a, b) = (
        pool.request_segment().unwrap(),
        pool.request_segment().unwrap(),
    );
    let index = a.index();
    drop(a);
    assert_eq!(pool.available_segments(), 1);
    assert_eq!(pool.request_segment().unwrap().index(), index);
    drop(b);
    drop(pool);
    assert_eq!(network.available_segments(), 2);
}

#[test]
fn admission_fails_when_minimums_exceed_the_network_memory() {
    let (network, _) = network(8);
    let first = network.create_local_pool(spec(6, 8)).unwrap();
    let err = network.create_local_pool(spec(3, 8)).unwrap_err();
    assert!(matches!(
        err,
        PoolError::Insufficient {
            required: 3,
            available: 2,
            total: 8,
            ..
        }
    ));
    drop(first);
    assert!(network.create_local_pool(spec(3, 8)).is_ok());
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn destroyed_pool_refuses_requests_and_late_recycles_reach_the_global_pool() {
    let (network, _) = network(8);
    let pool = network.create_local_pool(spec(2, 4)).unwrap();
    let builder = pool.request_buffer_builder(0).unwrap();
    let free = pool.request_segment().unwrap();
    drop(free);
    pool.destroy();
    assert!(pool.is_destroyed());
    assert!(pool.request_segment().is_none());
    assert_eq!(
        pool.request_buffer_builder_blocking(0, LONG).unwrap_err(),
        PoolError::Destroyed
    );
    assert_eq!(network.available_segments(), 7);
    drop(builder);
    assert_eq!(network.available_segments(), 8);
}

/// A listener that keeps up to `wanted` segments.
struct Collector {
    wanted: usize,
    kept: Mutex<Vec<PooledSegment>>,
    destroyed: AtomicUsize,
}

impl BufferListener for Collector {
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
        let mut kept = self.kept.lock().unwrap();
        if kept.len() >= self.wanted {
            return Err(segment);
        }
        kept.push(segment);
        Ok(())
    }

    fn on_pool_destroyed(&self) {
        self.destroyed.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn listeners_get_recycled_segments_before_the_free_list() {
    let (network, _) = network(4);
    let pool = network.create_local_pool(spec(2, 2)).unwrap();
    let held: Vec<_> = (0..2).map(|_| pool.request_segment().unwrap()).collect();
    let collector = Arc::new(Collector {
        wanted: 1,
        kept: Mutex::new(Vec::new()),
        destroyed: AtomicUsize::new(0),
    });
    let listener: Arc<dyn BufferListener> = collector.clone();
    assert!(pool.request_segment_or_listen(&listener).unwrap().is_none());
    let mut held = held.into_iter();
    drop(held.next());
    assert_eq!(
        collector.kept.lock().unwrap().len(),
        1,
        "listener served first"
    );
    assert_eq!(pool.available_segments(), 0);
    // A listener that rejects leaves the segment to the free list.
    assert!(pool.request_segment_or_listen(&listener).unwrap().is_none());
    drop(held.next());
    assert_eq!(collector.kept.lock().unwrap().len(), 1);
    assert_eq!(pool.available_segments(), 1);
    // Segments a listener keeps belong to the pool and return to it.
    collector.kept.lock().unwrap().clear();
    assert_eq!(pool.available_segments(), 2);
    assert!(pool.request_segment_or_listen(&listener).unwrap().is_some());
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn destroying_a_pool_tells_its_listeners() {
    let (network, _) = network(2);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_segment().unwrap();
    let collector = Arc::new(Collector {
        wanted: 1,
        kept: Mutex::new(Vec::new()),
        destroyed: AtomicUsize::new(0),
    });
    let listener: Arc<dyn BufferListener> = collector.clone();
    assert!(pool.request_segment_or_listen(&listener).unwrap().is_none());
    drop(pool);
    assert_eq!(collector.destroyed.load(Ordering::SeqCst), 1);
    drop(held);
    assert_eq!(network.available_segments(), 2);
}

#[test]
fn blocking_request_times_out_when_nothing_comes_back() {
    let (network, _) = network(2);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_buffer_builder(0).unwrap();
    let err = pool
        .request_buffer_builder_blocking(0, Duration::from_millis(1))
        .unwrap_err();
    assert_eq!(err, PoolError::Timeout(Duration::from_millis(1)));
    drop((held, pool));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn blocking_request_wakes_when_another_thread_recycles() {
    let (network, _) = network(2);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_buffer_builder(0).unwrap();
    let waiting = thread::scope(|s| {
        let waiter = s.spawn(|| pool.request_buffer_builder_blocking(0, LONG));
        // The waiter waits first: the recycle must wake it, not be found by its first look.
        assert!(common::wait_until(LONG, || pool.waiting_requests() == 1));
        drop(held);
        waiter.join().unwrap()
    });
    assert!(waiting.is_ok());
    drop((waiting, pool));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn blocking_request_wakes_when_another_pool_frees_global_segments() {
    let (network, _) = network(3);
    let small = network.create_local_pool(spec(1, 3)).unwrap();
    let other = network.create_local_pool(spec(1, 3)).unwrap();
    let held: Vec<_> = (0..3).map(|_| other.request_segment().unwrap()).collect();
    let waiting = thread::scope(|s| {
        let waiter = s.spawn(|| small.request_buffer_builder_blocking(0, LONG));
        // The waiter waits first: the give-back must wake it, not be found by its first look.
        assert!(common::wait_until(LONG, || small.waiting_requests() == 1));
        drop(held);
        waiter.join().unwrap()
    });
    assert!(waiting.is_ok());
    drop((waiting, small, other));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A waker that counts its wake-ups.
#[derive(Default)]
struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A pending `request_builder` future is woken by the recycle of a segment on another thread
/// and then resolves. (The loom model p2e checks the race of the two; this runs it on real
/// threads.) The wake-up itself is awaited: a lost one fails the wait.
#[test]
fn async_request_resolves_when_a_segment_is_recycled() {
    let (network, _) = network(2);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_buffer_builder(1).unwrap();
    let woken = Arc::new(CountingWaker::default());
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let mut request = Box::pin(pool.request_builder(1));
    assert!(request.as_mut().poll(&mut cx).is_pending());
    thread::spawn(move || drop(held)).join().unwrap();
    assert!(
        common::wait_until(LONG, || woken.0.load(Ordering::SeqCst) > 0),
        "the recycle did not wake the pending request"
    );
    match request.as_mut().poll(&mut cx) {
        Poll::Ready(result) => assert!(result.is_ok()),
        Poll::Pending => panic!("woken, yet the request found no segment"),
    }
    drop(request);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_event_waits_for_an_overdraft_segment_and_gets_the_one_that_comes_back() {
    let (network, _) = network(32);
    let pool = network
        .create_local_pool(LocalPoolSpec {
            max_overdraft_segments: 2,
            ..spec(2, 2)
        })
        .unwrap();
    let pooled: Vec<_> = (0..2).map(|_| pool.request_segment().unwrap()).collect();
    let mut overdraft: Vec<_> = (0..2)
        .map(|_| pool.request_overdraft_segment().unwrap())
        .collect();
    assert!(
        pool.request_overdraft_segment().is_none(),
        "the overdraft is bounded though the network has memory"
    );
    assert_eq!(pool.overdraft_segments(), 2);
    thread::scope(|s| {
        let waiter = s.spawn(|| pool.request_event_segment_blocking(LONG));
        // Whether the waiter already waits or not, the returned overdraft segment is its.
        drop(overdraft.pop());
        let segment = waiter
            .join()
            .unwrap()
            .expect("the returned overdraft segment");
        assert_eq!(
            pool.overdraft_segments(),
            2,
            "it is an overdraft segment again"
        );
        drop(segment);
    });
    assert_eq!(pool.overdraft_segments(), 1);
    drop((pooled, overdraft));
    assert_eq!(pool.overdraft_segments(), 0);
    pool.destroy();
    assert!(matches!(
        pool.request_event_segment_blocking(LONG),
        Err(PoolError::Destroyed)
    ));
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn no_local_pool_may_hold_more_than_the_network_memory() {
    let (network, config) = network(16);
    let mut big = config.clone();
    big.set(
        "taskmanager.network.memory.floating-buffers-per-gate",
        "65536",
    )
    .unwrap();
    let pool = network
        .create_local_pool(LocalPoolSpec::for_gate(2, &big))
        .unwrap();
    assert_eq!(pool.spec().max_segments, network.total_segments());
    assert!(pool.spec().max_overdraft_segments <= network.total_segments());
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Memory mapped for one segment (Flink's unpooled buffer, for an event that finds the network
/// memory used up) carries bytes like a pooled one, as many as it was mapped for.
#[test]
fn an_unpooled_segment_carries_its_bytes() {
    let segment = fluxgate::buffer::PooledSegment::unpooled(40).unwrap();
    assert_eq!(segment.capacity(), 40);
    let mut builder = segment.into_builder(DataType::EventBuffer);
    assert_eq!(builder.append(&[7; 64]), 40, "no byte beyond its size");
    let mut consumer = builder.create_consumer_from_beginning();
    builder.finish();
    drop(builder);
    let buffer = consumer.build();
    assert_eq!(buffer.as_slice(), &[7; 40][..]);
}

/// Keeps what it is offered and hands back a segment of other memory instead.
struct Swapper {
    kept: Mutex<Vec<PooledSegment>>,
}

impl BufferListener for Swapper {
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
        self.kept.lock().unwrap().push(segment);
        Err(PooledSegment::unpooled(8).unwrap())
    }

    fn on_pool_destroyed(&self) {}
}

#[test]
fn a_segment_of_other_memory_a_listener_hands_back_never_enters_the_pool() {
    // Its index would name one of the pool's own segments, which would then have two owners.
    let (network, _) = network(4);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_segment().unwrap();
    let swapper = Arc::new(Swapper {
        kept: Mutex::new(Vec::new()),
    });
    let listener: Arc<dyn BufferListener> = swapper.clone();
    assert!(pool.request_segment_or_listen(&listener).unwrap().is_none());
    drop(held);
    assert_eq!(
        swapper.kept.lock().unwrap().len(),
        1,
        "the listener kept it"
    );
    assert_eq!(
        pool.available_segments(),
        0,
        "nothing came back in its place"
    );
    swapper.kept.lock().unwrap().clear();
    assert_eq!(pool.available_segments(), 1);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A listener that keeps the segment offered and hands back another it held.
struct HandsBackAnother {
    other: Mutex<Option<PooledSegment>>,
    kept: Mutex<Vec<PooledSegment>>,
}

impl BufferListener for HandsBackAnother {
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
        self.kept.lock().unwrap().push(segment);
        match self.other.lock().unwrap().take() {
            Some(other) => Err(other),
            None => Ok(()),
        }
    }

    fn on_pool_destroyed(&self) {}
}

/// A listener may hand back another of the pool's segments than the one offered (it kept
/// that one): the one handed back goes back as what it is, here an overdraft segment. Taken
/// for the one offered, it was counted as one of the pool's, the overdraft stayed counted
/// for good, and the pool's count went wrong by one each way.
#[test]
fn a_listener_handing_back_an_overdraft_segment_leaves_the_counts_right() {
    let (network, _) = network(4);
    let pool = network
        .create_local_pool(LocalPoolSpec {
            max_overdraft_segments: 1,
            ..spec(0, 1)
        })
        .unwrap();
    let offered = pool.request_segment().unwrap();
    let overdraft = pool.request_overdraft_segment().unwrap();
    assert_eq!(pool.overdraft_segments(), 1);
    let listener = Arc::new(HandsBackAnother {
        other: Mutex::new(Some(overdraft)),
        kept: Mutex::new(Vec::new()),
    });
    let as_listener: Arc<dyn BufferListener> = listener.clone();
    assert!(pool
        .request_segment_or_listen(&as_listener)
        .unwrap()
        .is_none());
    drop(offered);
    assert_eq!(
        listener.kept.lock().unwrap().len(),
        1,
        "the listener kept it"
    );
    assert_eq!(pool.overdraft_segments(), 0, "the overdraft came back");
    assert_eq!(pool.in_use_segments(), 1, "the one kept");
    listener.kept.lock().unwrap().clear();
    assert_eq!(pool.in_use_segments(), 0);
    drop(pool);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A listener that panics when offered a segment.
struct PanicsWhenOffered;

impl BufferListener for PanicsWhenOffered {
    fn on_segment_available(&self, _segment: PooledSegment) -> Result<(), PooledSegment> {
        panic!("a buffer listener's panic (expected by the test)");
    }

    fn on_pool_destroyed(&self) {
        panic!("a buffer listener's panic at destruction (expected by the test)");
    }
}

/// A listener that panics costs its own offer only: the thread that gave the segment back
/// (here in a drop, where a panic would abort an unwinding thread) goes on, and the next
/// listener gets the segment; the pool's destruction reaches every listener.
#[test]
fn a_panicking_buffer_listener_costs_only_its_own_offer() {
    let (network, _) = network(4);
    let pool = network.create_local_pool(spec(1, 1)).unwrap();
    let held = pool.request_segment().unwrap();
    let panicking: Arc<dyn BufferListener> = Arc::new(PanicsWhenOffered);
    let collector = Arc::new(Collector {
        wanted: 1,
        kept: Mutex::new(Vec::new()),
        destroyed: AtomicUsize::new(0),
    });
    let collecting: Arc<dyn BufferListener> = collector.clone();
    assert!(pool
        .request_segment_or_listen(&panicking)
        .unwrap()
        .is_none());
    assert!(pool
        .request_segment_or_listen(&collecting)
        .unwrap()
        .is_none());
    drop(held);
    assert_eq!(collector.kept.lock().unwrap().len(), 1, "the next listener");
    collector.kept.lock().unwrap().clear();
    // Both listening again, the pool's end reaches the second despite the first's panic.
    let held = pool.request_segment().unwrap();
    assert!(pool
        .request_segment_or_listen(&panicking)
        .unwrap()
        .is_none());
    assert!(pool
        .request_segment_or_listen(&collecting)
        .unwrap()
        .is_none());
    pool.destroy();
    assert_eq!(collector.destroyed.load(Ordering::SeqCst), 1);
    drop((held, pool));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_unpooled_segment_stays_below_the_finished_mark() {
    assert!(matches!(
        PooledSegment::unpooled(1 << 31),
        Err(PoolError::Allocation { .. })
    ));
}

#[test]
#[should_panic(expected = "write to a finished BufferBuilder")]
fn a_finished_builder_takes_no_more_bytes_by_advance() {
    let (network, _) = network(4);
    let mut builder = network
        .request_segment()
        .unwrap()
        .into_builder(DataType::DataBuffer);
    builder.finish();
    builder.advance(0);
}
