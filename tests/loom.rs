//! loom model checks of the lock-free protocols (run with `RUSTFLAGS="--cfg loom"`, as
//! `.ci/run` does): the segment lease protocol, the global and local pools' free lists and
//! wake-ups (a blocked thread's and a pending future's, an output waiting at a subpartition's
//! limit), a remote channel's floating-buffer
//! registration, the channels-with-data / ready-reader queue with its enqueued flags, the I/O
//! thread's parked flag, a subpartition's backlog count and read order against a priority event
//! queued mid-read and its barrier turned unaligned by a timeout against its reader, a priority
//! event's notification against the reader's park after it, and a remote channel's read order
//! against a priority item arriving mid-read and its floating credit against a blocking barrier
//! read at once.
//!
//! Under `--cfg loom` the crate's atomics (segment lease counts and markers, pool counters,
//! queue flags, the parked flag) are loom's, so loom explores their interleavings and the
//! values weak orderings allow. The bounded queues (free lists, lanes, command and listener
//! queues) are the `sync` shim's stand-in for crossbeam's `ArrayQueue`, a lock-protected
//! `VecDeque` with the same bounded FIFO contract: each operation is one linearizable loom
//! step (see `src/sync.rs` for why not crossbeam's algorithm on loom atomics).
//!
//! Every model builds its own tiny network memory (4 KiB segments) inside the model closure,
//! so each explored execution starts from fresh loom objects.
#![cfg(loom)]

use fluxgate::buffer::{Buffer, DataType, LocalPoolSpec, NetworkBufferPool};
use fluxgate::partition::{AvailabilityListener, ResultPartition, ResultPartitionId};
use fluxgate::NetworkConfig;
use loom::thread;

/// A configuration of `segments` segments of 4 KiB.
fn config(segments: usize) -> NetworkConfig {
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
    config
}

/// A network memory of `segments` segments of 4 KiB.
fn network(segments: usize) -> NetworkBufferPool {
    NetworkBufferPool::new(&config(segments)).unwrap()
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

/// A local pool of `min`..=`max` segments for one subpartition that may hold them all, one
/// listener, and `overdraft` segments beyond it.
fn one_channel_pool(
    pool: &NetworkBufferPool,
    min: usize,
    max: usize,
    overdraft: usize,
) -> LocalBufferPool {
    pool.create_local_pool(LocalPoolSpec {
        min_segments: min,
        max_segments: max,
        subpartitions: 1,
        max_segments_per_channel: max,
        max_listeners: 1,
        max_overdraft_segments: overdraft,
    })
    .unwrap()
}

/// (b, local) As (b), with the segment from a local pool and three leases (the buffer, a
/// clone, a slice) split over two threads: it goes back to the local pool's free list exactly
/// once and its subpartition count drops to zero.
#[test]
fn local_buffer_leases_dropped_on_two_threads() {
    loom::model(|| {
        let pool = network(2);
        let local = one_channel_pool(&pool, 2, 2, usize::MAX);
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
        let local = one_channel_pool(&pool, 2, 4, usize::MAX);
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

// ---------------------------------------------------------------------------------------------
// Models of the queues, flags and wake-ups (issue 8). They drive the crate's own types, made
// reachable under `--cfg loom` only (`fluxgate::gate::queue`, `fluxgate::io::waker`,
// `fluxgate::sync`). The free lists and command queues are the `sync` shim's loom-aware
// `ArrayQueue` stand-in (see `src/sync.rs` for why), the wakers are loom-aware, and a blocked
// thread sleeps on loom's `Condvar`, which never times out: a lost wake-up is a deadlock loom
// reports, not a delay a timeout would hide. Each model is bounded by `preemption_bound` so
// the file runs in seconds.
// ---------------------------------------------------------------------------------------------

use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::Duration;

use fluxgate::buffer::{BufferListener, LocalBufferPool, PooledSegment};
use fluxgate::gate::lane::SpillQueue;
use fluxgate::gate::queue::{hold_wakes, ChannelQueue, ChannelQueueHandle};
use fluxgate::gate::BufferManager;
use fluxgate::io::waker::IoWaker;
use fluxgate::sync::ArrayQueue;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Condvar, Mutex};

/// Runs `f` under loom with at most `LOOM_MAX_PREEMPTIONS` (default 3) preemptions per
/// execution: enough for every interleaving of the two or three racing steps each model is
/// about, and it keeps each model to seconds on a shared 2-core machine.
fn bounded_model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// A `Waker` that counts its wake-ups in a loom atomic (so loom sees them in its model).
#[derive(Default)]
struct CountingWaker(AtomicUsize);

impl CountingWaker {
    fn woken(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Never timing out under loom: how long a model's blocking wait may take in the real code.
const FOREVER: Duration = Duration::from_secs(3600);

/// (q1) The ready-reader queue (`ChannelQueueHandle`, as the protocol's server and client use
/// it) and a registered waker: the owner pops, finds nothing, registers its waker and is told
/// "nothing queued" (it goes Pending) while a data notifier and a priority notifier enqueue
/// slots concurrently. It is always woken afterwards, and nothing enqueued is lost.
#[test]
fn ready_queue_register_waker_races_enqueue() {
    bounded_model(|| {
        let ready = ChannelQueueHandle::new(2);
        let data = ready.clone();
        let priority = ready.clone();
        let t1 = loom::thread::spawn(move || data.enqueue(0));
        let t2 = loom::thread::spawn(move || priority.enqueue_priority(1));

        let counter = Arc::new(CountingWaker::default());
        let waker = Waker::from(counter.clone());
        let mut popped = Vec::new();
        // One poll of the owner: drain, then register and look once more.
        let pending = loop {
            while let Some(slot) = ready.pop() {
                popped.push(slot);
            }
            if !ready.register_waker(&waker) {
                break true;
            }
            if popped.len() == 2 {
                break false;
            }
        };
        t1.join().unwrap();
        t2.join().unwrap();

        if pending && popped.len() < 2 {
            assert!(
                counter.woken() > 0,
                "went Pending with a slot queued: lost wake-up"
            );
        }
        while let Some(slot) = ready.pop() {
            popped.push(slot);
        }
        popped.sort_unstable();
        assert_eq!(popped, [0, 1], "a slot was lost or queued twice");
        assert!(ready.is_empty());
    });
}

/// (q2) A gate's blocking reader (`ChannelQueue::wait`, what `next()` sleeps in) against a
/// notifier on another thread: the reader looks, finds nothing and waits; the notifier's
/// enqueue always wakes it (loom's condvar never times out, so a missed notify deadlocks).
#[test]
fn gate_blocking_wait_races_enqueue() {
    bounded_model(|| {
        let queue = ChannelQueue::new(1);
        let notifier = queue.clone();
        let producer = loom::thread::spawn(move || notifier.enqueue(0, false));
        let channel = loop {
            if let Some((channel, _)) = queue.pop() {
                break channel;
            }
            queue.wait(FOREVER);
        };
        producer.join().unwrap();
        assert_eq!(channel, 0);
        assert!(!queue.has_channels());
    });
}

/// (q2b) The same race with the notifier holding its wake-up, as an I/O thread does over its
/// reads (`hold_wakes`): the enqueue's wake-up comes only when the hold ends, and the two
/// channels it brings wake the reader once. The reader must still never sleep through it
/// (a missed one deadlocks), whether it looks before the push, between the push and the
/// hold's end, or after.
#[test]
fn gate_blocking_wait_races_a_held_enqueue() {
    bounded_model(|| {
        let queue = ChannelQueue::new(2);
        let notifier = queue.clone();
        let producer = loom::thread::spawn(move || {
            let hold = hold_wakes();
            notifier.enqueue(0, false);
            notifier.enqueue(1, false);
            drop(hold);
        });
        let mut channels = Vec::new();
        // Bounded: two channels, each popped once.
        while channels.len() < 2 {
            match queue.pop() {
                Some((channel, _)) => channels.push(channel),
                None => queue.wait(FOREVER),
            }
        }
        producer.join().unwrap();
        assert_eq!(channels, [0, 1]);
        assert!(!queue.has_channels());
    });
}

/// One channel's data as a source publishes it: a count of items published (release) that
/// the gate's single reader compares with what it has read (acquire load). The weakest source
/// the queue must work with: "is there more?" is a plain load, as an empty `ArrayQueue::pop`
/// is.
struct Source {
    published: AtomicUsize,
}

impl Source {
    fn publish(&self) {
        self.published.fetch_add(1, Ordering::Release);
    }

    fn available(&self, read: usize) -> usize {
        self.published.load(Ordering::Acquire) - read
    }
}

/// (q3) The channels-with-data queue with its per-lane "enqueued" flag: two sources publish
/// an item for the same channel each and notify it on the data lane, while the gate's reader
/// pops, reads one item and requeues the channel at the tail when more is available (the
/// gate's FIFO requeue). Checked:
/// * no double enqueue: each lane has room for exactly one entry (one channel), so a second
///   entry of the channel in a lane panics in `enqueue` ("a lane holds each channel at most
///   once");
/// * no lost channel: once the sources are done, every published item is read by popping the
///   queue alone; a channel with data left that is in no lane would leave items unread.
#[test]
fn channel_queue_notify_races_pop_and_requeue() {
    bounded_model(|| {
        let queue = ChannelQueue::new(1);
        let source = Arc::new(Source {
            published: AtomicUsize::new(0),
        });
        let spawn_source = |priority: bool| {
            let queue = queue.clone();
            let source = source.clone();
            loom::thread::spawn(move || {
                source.publish();
                queue.enqueue(0, priority);
            })
        };
        let sources = [spawn_source(false), spawn_source(false)];

        let mut read = 0;
        // What `SingleInputGate::poll_next` and `on_read` do with one channel.
        let mut read_one = |queue: &Arc<ChannelQueue>| -> bool {
            let Some((channel, _priority)) = queue.pop() else {
                return false;
            };
            assert_eq!(channel, 0);
            if source.available(read) > 0 {
                read += 1;
                if source.available(read) > 0 {
                    queue.enqueue(channel, false);
                }
            }
            true
        };
        // The reader races the sources for a few pops...
        for _ in 0..2 {
            read_one(&queue);
        }
        for source in sources {
            source.join().unwrap();
        }
        // ...then, with the sources done, the queue alone must lead it to every item.
        while read_one(&queue) {}
        assert_eq!(
            read, 2,
            "a channel with data was not queued: lost notification"
        );
        assert!(!queue.has_channels());
    });
}

/// The eventfd an I/O thread sleeps on, as loom sees it: `signal` adds to the counter and
/// wakes the sleeper; `sleep` waits until the counter is non-zero and resets it (an eventfd
/// read); `poll` is the drivers' zero-timeout wait after a busy re-check, which consumes a
/// pending signal without waiting (a ready mio waker event / the armed eventfd read's
/// completion reaped). No timeout: a sleep nobody signals is a deadlock loom reports.
#[derive(Default)]
struct EventFd {
    count: Mutex<u64>,
    cond: Condvar,
    /// Signals sent over the whole execution (each one is a syscall in the drivers).
    signals: AtomicUsize,
}

impl EventFd {
    fn signal(&self) {
        self.signals.fetch_add(1, Ordering::SeqCst);
        *self.count.lock().unwrap() += 1;
        self.cond.notify_all();
    }

    fn sleep(&self) {
        let mut count = self.count.lock().unwrap();
        while *count == 0 {
            count = self.cond.wait(count).unwrap();
        }
        *count = 0;
    }

    fn poll(&self) {
        *self.count.lock().unwrap() = 0;
    }
}

type Signal = Box<dyn Fn() + Send + Sync>;

/// An I/O thread's `IoWaker` whose signal writes to a model `EventFd`.
fn io_waker() -> (Arc<IoWaker<Signal>>, Arc<EventFd>) {
    let eventfd = Arc::new(EventFd::default());
    let signal = eventfd.clone();
    let waker = Arc::new(IoWaker::new(Box::new(move || signal.signal()) as Signal));
    (waker, eventfd)
}

/// (io) The I/O thread's park protocol against a task thread's `submit` and a producer
/// notifying the ready-reader queue of one of its connections. The I/O thread runs the
/// drivers' loop shape: drain its command queue and ready queue; if not everything has
/// arrived, `prepare_park` (announce "parked", then re-check: command queue non-empty, ready
/// queue non-empty after registering its waker, as `Connection::set_waker` does), sleep on the
/// eventfd unless the re-check found work (then a zero-timeout poll, which consumes a pending
/// signal as the drivers' `poll` / `enter` with `Duration::ZERO` do), `unpark`. The other two
/// threads hand over work with the crate's own `IoWaker::submit` and through the ready
/// queue's `AtomicWaker` into the `IoWaker`'s `std::task::Waker`. The I/O thread always gets
/// both (a lost wake-up sleeps forever: loom reports a deadlock), and it is signalled at most
/// once per park.
///
/// A signal meant for one park that lands after the thread went on (its re-check was busy)
/// is consumed by a later poll or sleep: at worst one spurious turn of the loop, never a lost
/// wake-up, because every park stores `parked = true` again before its re-check, and whoever
/// clears that store signals after it.
///
/// Passes at `LOOM_MAX_PREEMPTIONS=5` too. It used not to while `wake_if_parked` cleared the
/// flag with `swap(false)`: loom 0.7 keeps an RMW's store unordered with stores it did not
/// see, even when the RMW read an earlier store of the same thread (no RMW atomicity in its
/// modification order). Trace: I/O parks (`true`), its re-check finds the ready slot, it
/// unparks (`false`); the producer's `load` had read that park's `true`, its `swap` now reads
/// the unpark's `false` and writes `false`; the I/O thread parks again (`true`), finds the
/// command queue empty; the submitter pushes (after that look, through the queue's lock) and
/// its `load` returns the producer's `false`, which loom leaves unordered with the newer
/// `true`, although a real swap that read the unpark's value sits right after it, before the
/// second `true`. Nobody signals and the I/O thread sleeps forever. A compare-exchange that
/// fails writes nothing, so the phantom store is gone.
#[test]
fn io_thread_park_races_submit_and_ready_wake() {
    bounded_model(|| {
        let (waker, eventfd) = io_waker();
        let commands = Arc::new(ArrayQueue::<u32>::new(2));
        let ready = ChannelQueueHandle::new(1);

        let io = {
            let waker = waker.clone();
            let commands = commands.clone();
            let ready = ready.clone();
            let eventfd = eventfd.clone();
            loom::thread::spawn(move || {
                let std_waker = Waker::from(waker.clone());
                let (mut got_command, mut got_ready) = (false, false);
                let mut parks = 0;
                loop {
                    while let Some(command) = commands.pop() {
                        assert_eq!(command, 7);
                        got_command = true;
                    }
                    while let Some(slot) = ready.pop() {
                        assert_eq!(slot, 0);
                        got_ready = true;
                    }
                    if got_command && got_ready {
                        break;
                    }
                    let busy = waker.prepare_park(|| {
                        let mut busy = !commands.is_empty();
                        busy |= ready.register_waker(&std_waker);
                        busy
                    });
                    parks += 1;
                    if busy {
                        eventfd.poll();
                    } else {
                        eventfd.sleep();
                    }
                    waker.unpark();
                }
                parks
            })
        };
        let submitter = {
            let waker = waker.clone();
            let commands = commands.clone();
            loom::thread::spawn(move || waker.submit(&commands, 7).expect("room"))
        };
        ready.enqueue(0);

        submitter.join().unwrap();
        let parks = io.join().unwrap();
        let signals = eventfd.signals.load(Ordering::SeqCst);
        assert!(
            signals <= parks,
            "{signals} signals for {parks} parks: a running thread was signalled"
        );
    });
}

/// (io, busy path) With the I/O thread running (never parked), handing it work makes no
/// signal at all: the "parked" flag keeps the syscall off the busy path.
#[test]
fn io_waker_does_not_signal_a_running_thread() {
    bounded_model(|| {
        let (waker, eventfd) = io_waker();
        let commands = Arc::new(ArrayQueue::<u32>::new(2));
        let submitter = {
            let waker = waker.clone();
            let commands = commands.clone();
            loom::thread::spawn(move || waker.submit(&commands, 1).expect("room"))
        };
        Waker::from(waker.clone()).wake_by_ref();
        waker.submit(&commands, 2).expect("room");
        submitter.join().unwrap();
        assert_eq!(eventfd.signals.load(Ordering::SeqCst), 0);
        assert_eq!(commands.len(), 2);
    });
}

/// (io, stop) An I/O thread whose loop ends (an OS error stopped it) against a task thread's
/// `submit`, as `DriverHandle::submit` makes it: the command is refused exactly once, by the
/// stopping thread's last drain or by the submitter taking it back, and never stays in the
/// queue, where nobody would take it (a channel waiting there to connect would wait for good).
#[test]
fn io_thread_stop_races_submit() {
    bounded_model(|| {
        let (waker, _eventfd) = io_waker();
        let commands = Arc::new(ArrayQueue::<u32>::new(2));
        let refused = Arc::new(AtomicUsize::new(0));
        let io = {
            let waker = waker.clone();
            let commands = commands.clone();
            let refused = refused.clone();
            loom::thread::spawn(move || {
                waker.stop(&commands, |_| {
                    refused.fetch_add(1, Ordering::SeqCst);
                })
            })
        };
        let refuse = |_| {
            refused.fetch_add(1, Ordering::SeqCst);
        };
        match waker.submit(&commands, 7) {
            Ok(()) => {
                waker.take_back_if_stopped(&commands, refuse);
            }
            Err(command) => refuse(command),
        }
        io.join().unwrap();
        assert_eq!(refused.load(Ordering::SeqCst), 1, "refused once");
        assert!(commands.is_empty(), "the command stayed queued");
    });
}

/// (p1) The global free list across threads: three threads (two spawned and this one) each
/// take a segment from a two-segment pool while others give theirs back. No segment has two
/// owners at once (a per-segment owner count, and the lease's own "no lease yet" assertion in
/// `into_builder`), none is lost (the pool is full at the end), and one of the three always
/// gets one of the two segments.
#[test]
fn global_pool_request_and_recycle_on_three_threads() {
    bounded_model(|| {
        let pool = network(2);
        let owners: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let take_and_give_back = {
            let pool = pool.clone();
            let owners = owners.clone();
            move || -> bool {
                let Some(segment) = pool.request_segment() else {
                    return false;
                };
                let index = segment.index() as usize;
                let before = owners[index].fetch_add(1, Ordering::SeqCst);
                assert_eq!(before, 0, "segment {index} has two owners");
                let builder = segment.into_builder(DataType::DataBuffer);
                owners[index].fetch_sub(1, Ordering::SeqCst);
                drop(builder);
                true
            }
        };
        let threads: Vec<_> = (0..2)
            .map(|_| loom::thread::spawn(take_and_give_back.clone()))
            .collect();
        let mine = take_and_give_back();
        let got = threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|&got| got)
            .count()
            + usize::from(mine);
        assert!(got >= 2, "only {got} of 3 requests got one of 2 segments");
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p2) A local pool waiting for the global pool to refill: its blocking request found the
/// local free list empty and the global pool empty (registering the pool as "starved"),
/// while another thread gives a global segment back. The waiter always gets the segment
/// (`give_back` → `wake_starved` → `on_global_available` → `wake_waiters`; a lost wake-up is a
/// deadlock under loom), and every segment is back in the global pool at the end.
#[test]
fn local_pool_waiter_races_global_give_back() {
    waiter_races_give_back(false);
}

/// (p2b) The same race when the segment comes back on an I/O thread, so it goes to the global
/// pool's warm list rather than its main one: the starved waiter must still be woken and get
/// it (its second look after registering takes from either list), and every segment is back
/// at the end.
#[test]
fn local_pool_waiter_races_io_thread_give_back() {
    waiter_races_give_back(true);
}

/// The race of (p2) and (p2b); `on_io_thread`: the giving thread is marked as an I/O thread.
fn waiter_races_give_back(on_io_thread: bool) {
    bounded_model(move || {
        let pool = network(2);
        let local = one_channel_pool(&pool, 1, 2, usize::MAX);
        let held = local.request_buffer_builder(0).unwrap();
        let elsewhere = pool.request_segment().unwrap();
        assert_eq!(pool.available_segments(), 0);

        let giver = loom::thread::spawn(move || {
            if on_io_thread {
                fluxgate::buffer::mark_io_thread();
            }
            drop(elsewhere);
        });
        let second = local
            .request_buffer_builder_blocking(0, FOREVER)
            .expect("the segment given back");
        giver.join().unwrap();

        assert_ne!(second.segment_index(), held.segment_index());
        assert_eq!(local.segments_of(0), 2);
        drop((held, second));
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p2d) Two threads wait on one pool while its segments come back one by one: each is woken
/// and gets one. (A waiter that looked without the lock could clear the other's wake-up and
/// both sleep; under loom, where waits never time out, a deadlock.)
#[test]
fn two_waiters_on_one_pool_are_both_woken() {
    bounded_model(|| {
        let pool = network(2);
        let local = std::sync::Arc::new(
            pool.create_local_pool(LocalPoolSpec {
                min_segments: 2,
                max_segments: 2,
                subpartitions: 0,
                max_segments_per_channel: usize::MAX,
                max_listeners: 1,
                max_overdraft_segments: 0,
            })
            .unwrap(),
        );
        let first = local.request_segment().unwrap();
        let second = local.request_segment().unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let local = local.clone();
                // Each keeps its segment: only the main thread's returns can wake them.
                loom::thread::spawn(move || local.request_segment_blocking(FOREVER).expect("woken"))
            })
            .collect();
        drop(first);
        drop(second);
        let got: Vec<_> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        drop((got, local));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p2e) The async form of (p2): a writer's `request_builder` future finds its pool at its
/// maximum and goes Pending while another thread gives a segment back, either by dropping one
/// of the pool's own builders (`from_the_pool`) or by returning a global segment the starved
/// pool may then grow by. Either the first poll got the segment, or the give-back woke the
/// future's waker and the next poll gets it. Loom sees the waker's registration, the
/// `notified` flag and the fences of `AsyncWait::poll` against `wake_waiters`; a wake-up lost
/// between the future's two looks leaves `woken` at zero.
fn async_waiter_races_give_back(from_the_pool: bool) {
    bounded_model(move || {
        let pool = network(2);
        let local = one_channel_pool(&pool, 1, if from_the_pool { 1 } else { 2 }, usize::MAX);
        let held = local.request_buffer_builder(0).unwrap();
        let held_index = held.segment_index();
        let elsewhere = pool.request_segment().unwrap();
        assert_eq!(pool.available_segments(), 0);
        let (given, kept): (Box<dyn Any + Send>, Box<dyn Any + Send>) = if from_the_pool {
            (Box::new(held), Box::new(elsewhere))
        } else {
            (Box::new(elsewhere), Box::new(held))
        };

        let giver = loom::thread::spawn(move || drop(given));
        let counting = Arc::new(CountingWaker::default());
        let waker = Waker::from(counting.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let got = {
            let mut request = std::pin::pin!(local.request_builder(0));
            let first = request.as_mut().poll(&mut cx);
            giver.join().unwrap();
            match first {
                std::task::Poll::Ready(got) => got.expect("a builder"),
                std::task::Poll::Pending => {
                    assert!(
                        counting.woken() > 0,
                        "the give-back did not wake the future"
                    );
                    match request.as_mut().poll(&mut cx) {
                        std::task::Poll::Ready(got) => got.expect("a builder"),
                        std::task::Poll::Pending => panic!("woken, yet nothing at hand"),
                    }
                }
            }
        };
        if from_the_pool {
            assert_eq!(got.segment_index(), held_index);
        } else {
            assert_ne!(got.segment_index(), held_index);
        }
        drop((got, kept));
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

#[test]
fn an_async_request_pending_on_a_full_pool_is_woken_by_its_recycle() {
    async_waiter_races_give_back(true);
}

#[test]
fn an_async_request_pending_on_a_starved_pool_is_woken_by_a_global_give_back() {
    async_waiter_races_give_back(false);
}

/// (p2a) Flink's output availability: a writer's `until_available_to_any` future finds its
/// one subpartition at `max-buffers-per-channel` (two builders held, a segment still free in
/// the pool) and goes Pending while another thread drops one of them, taking the
/// subpartition under its limit. Either the first poll saw the count below the limit, or
/// the recycle woke the future and the next poll resolves: the limit's count (relaxed) is
/// published by the fences of the recycle's wake-up against those of the future's looks.
#[test]
fn an_output_waiting_at_its_subpartition_limit_is_woken_by_a_recycle() {
    bounded_model(|| {
        let pool = network(3);
        let local = pool
            .create_local_pool(LocalPoolSpec {
                min_segments: 1,
                max_segments: 3,
                subpartitions: 1,
                max_segments_per_channel: 2,
                max_listeners: 1,
                max_overdraft_segments: 0,
            })
            .unwrap();
        let first = local.request_buffer_builder(0).unwrap();
        let second = local.request_buffer_builder(0).unwrap();
        assert!(!local.is_available_to_any(), "at its limit");
        assert!(local.is_available(1) || pool.available_segments() > 0);

        let giver = loom::thread::spawn(move || drop(first));
        let counting = Arc::new(CountingWaker::default());
        let waker = Waker::from(counting.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        {
            let mut available = std::pin::pin!(local.until_available_to_any());
            let first_look = available.as_mut().poll(&mut cx);
            giver.join().unwrap();
            if first_look.is_pending() {
                assert!(counting.woken() > 0, "the recycle did not wake the future");
                assert!(
                    available.as_mut().poll(&mut cx).is_ready(),
                    "woken, yet still unavailable"
                );
            }
        }
        assert!(local.is_available_to_any());
        drop((second, local));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A pool at its maximum of one segment (held, the builder), allowed one overdraft segment,
/// and the network's other segment held elsewhere: neither the pool nor its overdraft has
/// one until something is given back.
fn a_full_pool_and_none_elsewhere() -> (
    NetworkBufferPool,
    LocalBufferPool,
    fluxgate::buffer::BufferBuilder,
    PooledSegment,
) {
    let pool = network(2);
    let local = one_channel_pool(&pool, 1, 1, 1);
    let held = local.request_buffer_builder(0).unwrap();
    let elsewhere = pool.request_segment().unwrap();
    assert_eq!(pool.available_segments(), 0);
    (pool, local, held, elsewhere)
}

/// (p2c) An event waits for a segment while its pool is at its maximum and the global pool is
/// empty, so neither the pool nor its overdraft has one; another thread gives a global segment
/// back. The event gets it as an overdraft segment: the failed overdraft take registered the
/// pool as starved, so the give-back wakes it (before, only a recycle in this pool or the
/// wait's 50 ms re-check did; under loom, where waits never time out, a deadlock).
#[test]
fn an_event_waiting_for_an_overdraft_segment_is_woken_by_a_global_give_back() {
    bounded_model(|| {
        let (pool, local, held, elsewhere) = a_full_pool_and_none_elsewhere();

        let giver = loom::thread::spawn(move || drop(elsewhere));
        let event = local
            .request_event_segment_blocking(FOREVER)
            .expect("the segment given back");
        giver.join().unwrap();

        assert_eq!(local.overdraft_segments(), 1);
        drop((held, event));
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p2d) An event waits for an overdraft segment as in p2c while another request for one
/// (a remote channel's, which does not wait) finds the global pool empty. The global
/// give-back woke the waiter while the other request had counted the overdraft up for a
/// segment it did not get: the waiter looked, found the overdraft used up and slept; the
/// count went down again with no wake-up (only the wait's 50 ms re-check; under loom, a
/// deadlock). Now a request counts the overdraft only once it holds the segment.
#[test]
fn a_failed_overdraft_request_hides_no_segment_from_a_waiting_event() {
    bounded_model(|| {
        let (pool, local, held, elsewhere) = a_full_pool_and_none_elsewhere();
        let local = Arc::new(local);

        let waiter = {
            let local = local.clone();
            loom::thread::spawn(move || {
                local
                    .request_event_segment_blocking(FOREVER)
                    .expect("a segment")
            })
        };
        let giver = loom::thread::spawn(move || drop(elsewhere));
        let other = local.request_overdraft_segment();
        // Dropped, it goes back and wakes the waiter.
        drop(other);
        let event = waiter.join().unwrap();
        giver.join().unwrap();
        drop((held, event));
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A buffer listener (a remote channel waiting for a floating buffer) that keeps what it gets.
#[derive(Default)]
struct KeepingListener {
    segments: Mutex<Vec<PooledSegment>>,
}

impl BufferListener for KeepingListener {
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
        self.segments.lock().unwrap().push(segment);
        Ok(())
    }

    fn on_pool_destroyed(&self) {}
}

/// A gate's pool of `network`: `min` to `max` segments, no per-subpartition accounting, room
/// for `listeners` buffer listeners.
fn gate_pool(
    network: &NetworkBufferPool,
    min: usize,
    max: usize,
    listeners: usize,
) -> LocalBufferPool {
    network
        .create_local_pool(LocalPoolSpec {
            min_segments: min,
            max_segments: max,
            subpartitions: 0,
            max_segments_per_channel: usize::MAX,
            max_listeners: listeners,
            max_overdraft_segments: usize::MAX,
        })
        .unwrap()
}

/// (p3) A gate pool's availability/listener path: with every segment of the pool leased, a
/// channel asks for a segment or to be told (`request_segment_or_listen`) while another thread
/// recycles a segment of the pool. The recycled segment reaches the channel, now or through its
/// listener; it never sits in the pool's free list with the listener still waiting (a lost
/// notification), and is never handed out twice.
#[test]
fn local_pool_listener_races_recycle() {
    bounded_model(|| listener_races_recycle(2));
}

/// (p3b) The same race when the recycled segment leaves the pool: above its minimum, a pool
/// gives a recycled segment no listener wanted back to the global pool. A listener that
/// registered meanwhile, its second look finding the pool at its maximum, must still get a
/// segment (the pool grows again for it), or it waits with the pool below its maximum and a
/// segment free in the global pool.
#[test]
fn local_pool_listener_races_recycle_above_the_minimum() {
    bounded_model(|| listener_races_recycle(1));
}

/// The body of p3 and p3b: a pool of 2 segments at most, `min_segments` of them promised.
fn listener_races_recycle(min_segments: usize) {
    let pool = network(2);
    let local = gate_pool(&pool, min_segments, 2, 1);
    let first = local.request_segment().unwrap();
    let second = local.request_segment().unwrap();
    let first_index = first.index();

    let recycler = loom::thread::spawn(move || drop(first));
    let keeper = Arc::new(KeepingListener::default());
    let listener: Arc<dyn BufferListener> = keeper.clone();
    let now = local.request_segment_or_listen(&listener).unwrap();
    recycler.join().unwrap();

    let told: Vec<PooledSegment> = std::mem::take(&mut *keeper.segments.lock().unwrap());
    match &now {
        Some(segment) => {
            assert_eq!(segment.index(), first_index);
            assert!(told.is_empty(), "handed out twice");
        }
        None => {
            assert_eq!(
                told.len(),
                1,
                "the listener waits while the pool holds {} of its 2 segments, {} free",
                local.requested_segments(),
                local.available_segments()
            );
            assert_eq!(told[0].index(), first_index);
        }
    }
    assert_eq!(local.available_segments(), 0);
    drop((now, told, second));
    drop(local);
    assert_eq!(pool.available_segments(), pool.total_segments());
}

/// (p4) A remote channel without exclusive buffers asks its gate's pool for a floating
/// segment from two threads at once: the transport on a sender's backlog, and a task whose
/// recycled segment the channel was just told of (still short, it asks again). The channel is
/// registered at the pool at most once, and exactly while it says it waits. Two registrations
/// once filled the gate's listener slots (one per remote channel): another channel's request
/// was then refused, that channel stopped asking, and the floating-only cluster stalled with a
/// segment free in the pool and its sender waiting for credit.
#[test]
fn remote_channel_backlog_races_floating_handover() {
    bounded_model(|| {
        let pool = network(2);
        // Two listener slots, as for a gate with a second remote channel: room for a duplicate.
        let local = Arc::new(gate_pool(&pool, 2, 2, 2));
        let channel =
            BufferManager::new(0, local.clone(), 0, 2, std::time::Duration::ZERO).unwrap();
        // A backlog of 3: both segments of the pool, and a registration for a third.
        channel.on_sender_backlog(3);
        assert_eq!(channel.available(), 2);
        assert_eq!(local.listener_count(), 1);
        // A buffer arrived into one of them; the task reads it and recycles it, while the
        // sender's next response repeats the backlog. (The SeqCst pairing of a backlog that
        // rises while another thread holds the flag is not modelled: loom treats SeqCst as
        // AcqRel.)
        let received = channel.take_segment().unwrap();
        let task = thread::spawn(move || drop(received));
        channel.on_sender_backlog(3);
        task.join().unwrap();

        assert_eq!(
            channel.available(),
            2,
            "the recycled segment is floating credit again"
        );
        assert!(
            local.listener_count() <= 1,
            "the channel is registered {} times",
            local.listener_count()
        );
        assert_eq!(
            local.listener_count(),
            usize::from(channel.is_waiting_for_floating()),
            "registered at the pool exactly while the channel says it waits"
        );
        // The pool's destruction drops the registration; the channel's release its segments.
        drop(local);
        channel.release();
        drop(channel);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p5) A registered remote channel is released (its gate read its end) while another thread
/// recycles the segment it waits for, which the pool hands to it: the segment never stays in
/// the released channel, where nothing would take it out again before the gate closes.
#[test]
fn remote_channel_release_races_floating_handover() {
    bounded_model(|| {
        let pool = network(1);
        let local = Arc::new(gate_pool(&pool, 1, 1, 1));
        let held = local.request_segment().unwrap();
        let channel =
            BufferManager::new(0, local.clone(), 0, 1, std::time::Duration::ZERO).unwrap();
        channel.on_sender_backlog(1);
        assert_eq!(
            local.listener_count(),
            1,
            "nothing free: the channel registered"
        );

        let recycler = thread::spawn(move || drop(held));
        channel.release();
        recycler.join().unwrap();

        assert_eq!(
            channel.available(),
            0,
            "a segment stayed in the released channel"
        );
        drop(local);
        drop(channel);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A subpartition reader that is never told anything (the models poll it).
struct Unheard;

impl AvailabilityListener for Unheard {
    fn notify_data_available(&self) {}
    fn notify_priority_event(&self) {}
}

/// (p) The producer finishes a data buffer (here by finishing the partition) while the reader
/// takes it: the reader may see the buffer finished before the producer has counted it in the
/// backlog, yet the backlog it reports with every item stays between 0 and the one buffer
/// there is. (It once wrapped below zero there: a sender announced a backlog of 2^32 - 1.)
#[test]
fn subpartition_backlog_races_the_finish_of_a_buffer() {
    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(4);
        partition.emit_record(&b"record"[..], 0).unwrap();

        let producer = thread::spawn(move || {
            partition.finish().unwrap();
            partition
        });
        let mut items = Vec::new();
        for _ in 0..2 {
            if let Some(item) = view.poll_next() {
                items.push((item.buffer.data_type(), item.backlog));
            }
        }
        let partition = producer.join().unwrap();
        for &(data_type, backlog) in &items {
            assert!(
                backlog <= 1,
                "{data_type:?} came with a backlog of {backlog}"
            );
        }
        drop((items, view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p9) The producer turns an aligned barrier with a timeout unaligned while the reader reaches
/// it: whichever claims it first decides, so exactly one barrier comes out, either aligned
/// between the records or unaligned ahead of "after"; never both, never none, and nothing
/// after the barrier comes before it.
#[test]
fn a_barrier_timing_out_races_its_reader() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(8);
        let barrier = CheckpointBarrier {
            id: 1,
            // Now: the timeout lies ahead, so only the explicit call below fires it.
            timestamp: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64,
            kind: CheckpointKind::Checkpoint,
            alignment: Alignment::AlignedWithTimeout {
                timeout_ms: 3_600_000,
            },
        };
        partition.emit_record(&b"before"[..], 0).unwrap();
        partition
            .broadcast_event(&Event::CheckpointBarrier(barrier), false)
            .unwrap();
        partition.emit_record(&b"after"[..], 0).unwrap();
        partition.flush(0);

        let timer = thread::spawn(move || {
            let turned = partition.aligned_barrier_timeout(1);
            (partition, turned)
        });
        let mut seen = Vec::new();
        // Bounded: the reader waits only while the producer queues the unaligned copy.
        for _ in 0..20 {
            match view.poll_next() {
                Some(item) => {
                    let data_type = item.buffer.data_type();
                    if data_type == DataType::TimeoutableAlignedCheckpointBarrier {
                        view.resume_consumption();
                    }
                    let after = data_type == DataType::DataBuffer
                        && item.buffer.as_slice().ends_with(b"after");
                    seen.push(data_type);
                    if after {
                        break;
                    }
                }
                None => thread::yield_now(),
            }
        }
        let (partition, turned) = timer.join().unwrap();
        let barriers: Vec<_> = seen.iter().filter(|t| t.is_event()).collect();
        let expected = if turned == 1 {
            DataType::PrioritizedEventBuffer
        } else {
            DataType::TimeoutableAlignedCheckpointBarrier
        };
        assert_eq!(barriers, [&expected], "turned {turned}, read {seen:?}");
        assert_eq!(seen.last(), Some(&DataType::DataBuffer), "read {seen:?}");
        drop((view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p9b) Two checkpoints' barriers time out while the reader reads through them: the first
/// one's original may still hold the drop slot when the second turns, and the second
/// barrier is queued after the first turned. Each checkpoint's barrier comes out exactly
/// once, 5 before 6, and the records stay in order around them.
#[test]
fn two_barriers_timing_out_race_their_reader() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(8);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let barrier = move |id| CheckpointBarrier {
            id,
            timestamp: now_ms,
            kind: CheckpointKind::Checkpoint,
            alignment: Alignment::AlignedWithTimeout {
                timeout_ms: 3_600_000,
            },
        };
        partition.emit_record(&b"r1"[..], 0).unwrap();
        partition
            .broadcast_event(&Event::CheckpointBarrier(barrier(5)), false)
            .unwrap();

        let writer = thread::spawn(move || {
            partition.aligned_barrier_timeout(5);
            partition.emit_record(&b"r2"[..], 0).unwrap();
            partition
                .broadcast_event(&Event::CheckpointBarrier(barrier(6)), false)
                .unwrap();
            partition.emit_record(&b"r3"[..], 0).unwrap();
            partition.flush(0);
            partition.aligned_barrier_timeout(6);
            partition
        });
        let mut seen: Vec<String> = Vec::new();
        // Bounded: every item comes within the writer's few steps.
        for _ in 0..40 {
            match view.poll_next() {
                Some(item) => {
                    let data_type = item.buffer.data_type();
                    if data_type.is_event() {
                        let Ok(Event::CheckpointBarrier(b)) = Event::decode(item.buffer.as_slice())
                        else {
                            panic!("only barriers are sent");
                        };
                        if data_type.is_blocking_upstream() {
                            view.resume_consumption();
                        }
                        let kind = if data_type.has_priority() { 'u' } else { 'a' };
                        seen.push(format!("b{}{kind}", b.id));
                    } else {
                        let bytes = item.buffer.as_slice();
                        for record in [&b"r1"[..], b"r2", b"r3"] {
                            if bytes.windows(2).any(|w| w == record) {
                                seen.push(String::from_utf8_lossy(record).into_owned());
                            }
                        }
                    }
                    if seen.last().map(String::as_str) == Some("r3") {
                        break;
                    }
                }
                None => thread::yield_now(),
            }
        }
        let partition = writer.join().unwrap();
        // Each checkpoint's barrier once; 6 ahead of 5 only when 6 went unaligned (a newer
        // checkpoint's priority barrier overtakes an older aligned one, which its consumer
        // then drops as subsumed, as in Flink).
        let mut barriers: Vec<&str> = seen
            .iter()
            .map(String::as_str)
            .filter(|s| s.starts_with('b'))
            .collect();
        if barriers.first().is_some_and(|b| b.starts_with("b6")) {
            assert_eq!(barriers[0], "b6u", "read {seen:?}");
        }
        barriers.sort_unstable();
        assert!(
            barriers.len() == 2 && barriers[0].starts_with("b5") && barriers[1].starts_with("b6"),
            "read {seen:?}"
        );
        let records: Vec<&str> = seen
            .iter()
            .map(String::as_str)
            .filter(|s| s.starts_with('r'))
            .collect();
        assert_eq!(records, ["r1", "r2", "r3"], "read {seen:?}");
        let at = |name: &str| seen.iter().position(|s| s.starts_with(name)).unwrap();
        assert!(at("b5") < at("r2") && at("b6") < at("r3"), "read {seen:?}");
        drop((view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A network of `segments` segments and a partition of one subpartition on it, with the
/// subpartition's view (polled by the models, never told anything).
fn one_subpartition_with_view(
    segments: usize,
) -> (
    NetworkBufferPool,
    ResultPartition,
    fluxgate::partition::SubpartitionView,
) {
    subpartition_with_view(config(segments))
}

/// [`one_subpartition_with_view`] with `config`.
fn subpartition_with_view(
    config: NetworkConfig,
) -> (
    NetworkBufferPool,
    ResultPartition,
    fluxgate::partition::SubpartitionView,
) {
    let pool = NetworkBufferPool::new(&config).unwrap();
    let id = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let partition = ResultPartition::new(id, 1, &pool, &config).unwrap();
    let view = partition
        .handle()
        .create_view(0, Arc::new(Unheard))
        .unwrap();
    (pool, partition, view)
}

/// (p6) The reader takes a finished buffer while the producer finishes the next one (a flush
/// made its start readable): an item whose next is a data buffer never comes with a backlog
/// of 0. The backlog once read the count before the next buffer's state, saw the finish but
/// not the count taken just before it, and a sender announced nothing to a consumer without
/// exclusive buffers that was then never asked for credit (the floating-only cluster stalled).
#[test]
fn a_next_data_buffer_is_always_in_the_backlog() {
    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(4);
        // The second record spans: it finishes the first buffer and starts a second, whose
        // start the flush makes readable.
        partition.emit_record(&[1u8; 3000][..], 0).unwrap();
        partition.emit_record(&[2u8; 3000][..], 0).unwrap();
        partition.flush(0);

        let producer = thread::spawn(move || {
            partition.finish().unwrap();
            partition
        });
        let first = view.poll_next().expect("the finished first buffer");
        let partition = producer.join().unwrap();
        if first.next_data_type.is_buffer() {
            assert!(
                first.backlog >= 1,
                "next is {:?} but the backlog is {}",
                first.next_data_type,
                first.backlog
            );
        }
        drop((first, view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A network of `config`'s memory and a set-up, requested gate of one remote channel (for
/// partition 0, subpartition 0), with the channel's transport side.
fn one_remote_channel_gate(
    config: NetworkConfig,
) -> (
    NetworkBufferPool,
    fluxgate::gate::SingleInputGate,
    Arc<fluxgate::gate::RemoteChannelShared>,
) {
    use fluxgate::gate::{ChannelLocation, ChannelSpec, ConsumedSubpartition, SingleInputGate};
    use fluxgate::partition::PartitionManager;

    let pool = NetworkBufferPool::new(&config).unwrap();
    let spec = ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: ResultPartitionId {
                partition: 0,
                producer: 0,
            },
            subpartition: 0,
        },
        location: ChannelLocation::Remote,
    };
    let mut gate = SingleInputGate::new(
        vec![spec],
        Arc::new(PartitionManager::new()),
        &pool,
        &config,
    );
    gate.setup().unwrap();
    gate.request_partitions(std::time::Instant::now()).unwrap();
    let shared = gate.remote_channel(0).unwrap().shared().clone();
    (pool, gate, shared)
}

/// (g) The transport hands the channel a buffer while the gate closes (releasing the
/// channel): the buffer's segment goes back to the network either way, not into a lane of the
/// released channel, where it stayed until the last handle of the channel went. (The push
/// could land after the release emptied the lanes.)
#[test]
fn a_buffer_arriving_while_its_channel_is_released_goes_back() {
    bounded_model(|| {
        let (pool, mut gate, shared) = one_remote_channel_gate(config(4));
        let transport = {
            let shared = shared.clone();
            thread::spawn(move || {
                if let Some(segment) = shared.buffers().take_segment() {
                    let buffer = fill(segment, b"data", DataType::DataBuffer);
                    let _ = shared.on_buffer(buffer, 0, 0, 0);
                }
            })
        };
        gate.close();
        transport.join().unwrap();
        drop(gate);
        assert_eq!(
            pool.available_segments(),
            pool.total_segments(),
            "a segment stayed in the released channel"
        );
        drop(shared);
    });
}

/// `bytes` written into `segment` as a finished buffer of `kind`, as the transport receives one.
fn fill(segment: PooledSegment, bytes: &[u8], kind: DataType) -> Buffer {
    let mut builder = segment.into_builder(kind);
    builder.append_and_commit(bytes);
    let mut consumer = builder.create_consumer_from_beginning();
    consumer.build()
}

/// (g) The transport pushes priority barriers and then data that follows the last of them on
/// the wire while the gate reads the channel. A read that took the channel off the gate's
/// queue after its item was already read (a barrier read first leaves such an entry) may
/// look at the empty priority lane just before the second barrier comes, yet it never hands
/// out the data after that barrier before the barrier itself. Before the fix it did: that
/// data, processed ahead of its barrier, was in no checkpoint's state.
#[test]
fn a_remote_read_racing_a_priority_arrival_never_returns_the_later_data_first() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    use fluxgate::gate::{GateItem, InputGate, SingleInputGate};

    bounded_model(|| {
        let (pool, mut gate, shared) = one_remote_channel_gate(config(6));
        let barrier = |id: u64| {
            let mut bytes = Vec::new();
            Event::CheckpointBarrier(CheckpointBarrier {
                id,
                timestamp: 0,
                kind: CheckpointKind::Checkpoint,
                alignment: Alignment::Unaligned,
            })
            .encode(&mut bytes);
            fill(
                shared.buffers().event_segment(64).unwrap(),
                &bytes,
                DataType::PrioritizedEventBuffer,
            )
        };
        let (first, second) = (barrier(1), barrier(2));
        let data = |bytes: &[u8]| {
            fill(
                shared.buffers().take_segment().unwrap(),
                bytes,
                DataType::DataBuffer,
            )
        };
        let (d0, d1) = (data(b"d0"), data(b"d1"));
        shared.on_buffer(d0, 0, 0, 0).unwrap();

        let transport = {
            let shared = shared.clone();
            thread::spawn(move || {
                shared.on_buffer(first, 1, 0, 0).unwrap();
                shared.on_buffer(second, 2, 0, 0).unwrap();
                shared.on_buffer(d1, 3, 0, 0).unwrap();
            })
        };
        // What the gate hands out, in order: barrier ids, and 0 for data.
        let mut read = Vec::new();
        let mut take_one = |gate: &mut SingleInputGate| -> bool {
            let Some(item) = gate.poll_next().unwrap() else {
                return false;
            };
            read.push(match item.item {
                GateItem::Event {
                    event: Event::CheckpointBarrier(b),
                    ..
                } => b.id,
                _ => 0,
            });
            true
        };
        // Three reads race the pushes; the rest is read after them (bounded: four items).
        for _ in 0..3 {
            take_one(&mut gate);
        }
        transport.join().unwrap();
        for _ in 0..4 {
            take_one(&mut gate);
        }
        assert_eq!(read.len(), 4, "{read:?}");
        // d1 is last on the wire, and the barriers keep their order: d1 must be read last.
        assert_eq!(
            read.last(),
            Some(&0),
            "d1 follows barrier 2 on the wire and comes after it: {read:?}"
        );
        gate.close();
        drop(gate);
        drop(shared);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (h) A channel without exclusive segments (all its credit floating) receives an aligned
/// barrier while the gate, which already had the channel queued, reads on: the gate may read
/// the barrier at once, finish the one-channel alignment and resume. Credit not yet announced
/// never outlives the floating segments it stood for: the channel releases them before the
/// barrier is readable. (Released after, a resume in between kept the credit, and the
/// sender's data for it found no segment.)
#[test]
fn a_blocking_barrier_read_at_once_keeps_no_credit_for_released_segments() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    use fluxgate::gate::{AlignmentMode, CheckpointedInputGate};

    bounded_model(|| {
        let mut config = config(6);
        config.buffers_per_channel = 0;
        config.floating_buffers_per_gate = 2;
        let (pool, gate, shared) = one_remote_channel_gate(config);
        // The sender announced a backlog: one floating segment, its credit announced.
        let buffers = shared.buffers().clone();
        buffers.on_sender_backlog(1);
        assert_eq!(buffers.take_unannounced_credit(), 1);
        // d0 arrives into it, saying one more buffer is coming: another floating segment,
        // its credit not yet announced.
        let d0 = fill(buffers.take_segment().unwrap(), b"d0", DataType::DataBuffer);
        shared.on_buffer(d0, 0, 1, 0).unwrap();
        assert_eq!(buffers.unannounced_credit(), 1);
        let mut bytes = Vec::new();
        Event::CheckpointBarrier(CheckpointBarrier {
            id: 1,
            timestamp: 0,
            kind: CheckpointKind::Checkpoint,
            alignment: Alignment::Aligned,
        })
        .encode(&mut bytes);
        let barrier = fill(
            buffers.event_segment(64).unwrap(),
            &bytes,
            DataType::AlignedCheckpointBarrier,
        );

        let transport = {
            let shared = shared.clone();
            thread::spawn(move || shared.on_buffer(barrier, 1, 0, 0).unwrap())
        };
        let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
        // d0, then (if it came in time) the barrier, which completes the alignment at once.
        for _ in 0..2 {
            drop(checkpointed.poll_next().unwrap());
        }
        transport.join().unwrap();
        // The barrier, if it came too late above: the resume follows the release then.
        for _ in 0..2 {
            drop(checkpointed.poll_next().unwrap());
        }
        assert_eq!(
            checkpointed.pending_checkpoint(),
            None,
            "aligned and resumed"
        );
        assert!(
            buffers.unannounced_credit() as usize <= buffers.available(),
            "credit {} not announced for {} segments held",
            buffers.unannounced_credit(),
            buffers.available()
        );
        drop(checkpointed);
        drop(shared);
        drop(buffers);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (i) The producer queues an unaligned barrier and then writes and flushes a record after it
/// while the reader takes from the subpartition: whatever the reader looked at first, it
/// never hands out the record written after the barrier before the barrier. (It could: a
/// reader that found the priority lane empty, then the data lane holding the new record,
/// returned the record first, and a consumer processed it ahead of its checkpoint.)
#[test]
fn a_subpartition_never_hands_out_data_written_after_a_barrier_before_it() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};

    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(6);
        let producer = thread::spawn(move || {
            let barrier = Event::CheckpointBarrier(CheckpointBarrier {
                id: 1,
                timestamp: 0,
                kind: CheckpointKind::Checkpoint,
                alignment: Alignment::Unaligned,
            });
            partition.broadcast_event(&barrier, true).unwrap();
            partition.emit_record(&[7u8; 8][..], 0).unwrap();
            partition.flush(0);
            partition
        });
        // What the reader hands out, in order: true for the barrier.
        let mut read = Vec::new();
        if let Some(item) = view.poll_next() {
            read.push(item.buffer.data_type().has_priority());
        }
        let partition = producer.join().unwrap();
        // Bounded: two items.
        for _ in 0..2 {
            if let Some(item) = view.poll_next() {
                read.push(item.buffer.data_type().has_priority());
            }
        }
        assert_eq!(read, [true, false], "the barrier, then the record after it");
        drop((view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// A partition of one subpartition whose data lane has room for two buffers (one buffer per
/// channel), with two broadcast buffers queued in it: the first finished, the second open
/// (the second record spans into it). The lane has no room for a third buffer.
fn subpartition_with_a_full_lane() -> (
    NetworkBufferPool,
    ResultPartition,
    fluxgate::partition::SubpartitionView,
) {
    let mut config = config(8);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    config
        .set("taskmanager.network.memory.buffers-per-channel", "1")
        .unwrap();
    // No overdraft: the lane then has room for two buffers.
    config
        .set(
            "taskmanager.network.memory.max-overdraft-buffers-per-gate",
            "0",
        )
        .unwrap();
    let (pool, mut partition, view) = subpartition_with_view(config);
    partition.broadcast_record(&[1u8; 4000][..]).unwrap();
    partition.broadcast_record(&[2u8; 4000][..]).unwrap();
    (pool, partition, view)
}

/// (p7) The writer finds the subpartition's data lane without room for a buffer (its reader has
/// not taken the two there) and waits, while the reader takes. The writer is always woken
/// (the reader's take clears `room_wanted` and wakes the pool's waiters; a lost wake-up is a
/// deadlock under loom), and every segment is back at the end.
#[test]
fn a_writer_waiting_for_room_in_a_lane_is_woken_by_the_reader_s_take() {
    bounded_model(|| {
        let (pool, mut partition, mut view) = subpartition_with_a_full_lane();
        let producer = thread::spawn(move || {
            partition.emit_record(&[3u8; 8][..], 0).unwrap();
            partition.flush(0);
            partition
        });
        let first = view.poll_next().expect("the finished broadcast buffer");
        let partition = producer.join().unwrap();
        assert!(first.buffer.data_type().is_buffer());
        drop((first, view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p8) The writer waits for room in the lane while the reader goes away (its view dropped,
/// which releases the subpartition from the reader's thread). Whichever way the release's
/// mark and drain interleave with the writer's looks, the writer is woken (by the drain, or
/// by the segments it returned), its record is refused as `Released`, and every segment is
/// back at the end.
#[test]
fn a_writer_waiting_for_room_sees_a_release_that_drained_the_lane() {
    bounded_model(|| {
        let (pool, mut partition, view) = subpartition_with_a_full_lane();
        let producer = thread::spawn(move || {
            let emitted = partition.emit_record(&[3u8; 8][..], 0);
            (partition, emitted)
        });
        drop(view);
        let (partition, emitted) = producer.join().unwrap();
        assert!(
            matches!(emitted, Err(fluxgate::partition::PartitionError::Released)),
            "{emitted:?}"
        );
        drop(partition);
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (lane) The transport pushes into a received lane whose ring holds two items while the
/// gate's reader pops: whatever the interleaving loom explores, the reader gets every item
/// once, in order, across the spill and the move back into the ring. (The window between the
/// reader's lock-free look and its look at the spill has a deterministic unit test in
/// `gate::lane`: loom's exploration did not reach it.)
#[test]
fn a_received_lane_keeps_its_order_across_a_spill() {
    bounded_model(|| {
        let lane = Arc::new(SpillQueue::new(2, 8));
        let pusher = {
            let lane = lane.clone();
            thread::spawn(move || {
                for item in 0..4u32 {
                    lane.push(item).unwrap();
                }
            })
        };
        let mut got = Vec::new();
        for _ in 0..3 {
            if let Some(item) = lane.pop() {
                got.push(item);
            }
        }
        pusher.join().unwrap();
        while let Some(item) = lane.pop() {
            got.push(item);
        }
        assert_eq!(got, [0, 1, 2, 3]);
        assert!(lane.is_empty());
    });
}

/// A subpartition reader that counts what it is told (in a loom atomic).
#[derive(Default)]
struct Told(AtomicUsize);

impl AvailabilityListener for Told {
    fn notify_data_available(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn notify_priority_event(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A partition of one subpartition over 4 segments, its view, and what the view was told.
fn one_subpartition_told() -> (
    NetworkBufferPool,
    ResultPartition,
    fluxgate::partition::SubpartitionView,
    Arc<Told>,
) {
    let pool = network(4);
    let id = ResultPartitionId {
        partition: 1,
        producer: 1,
    };
    let partition = ResultPartition::new(id, 1, &pool, &config(4)).unwrap();
    let told = Arc::new(Told::default());
    let view = partition.handle().create_view(0, told.clone()).unwrap();
    (pool, partition, view, told)
}

/// (p10) The reader takes the flushed start of a buffer while the producer fills it, starts the
/// next one with the rest of its record and flushes that: the second flush is neither lost
/// nor unheard. Every byte written ends up read, and bytes readable after the reader parked
/// come with a notification. The reader's look once cleared the flush flag after the producer
/// had set it for the next buffer: that buffer's flushed bytes stayed unreadable, and its
/// reader parked untold, until some later flush.
#[test]
fn a_flush_of_the_next_buffer_survives_the_read_of_the_one_before() {
    bounded_model(|| {
        let (pool, mut partition, mut view, told) = one_subpartition_told();
        partition.emit_record(&[1u8; 3000][..], 0).unwrap();
        partition.flush(0);

        let producer = thread::spawn(move || {
            // Fills the first buffer, finishing it, and starts the second.
            partition.emit_record(&[2u8; 3000][..], 0).unwrap();
            partition.flush(0);
            partition
        });
        let mut read = 0;
        let mut trace = Vec::new();
        let mut told_before_park = 0;
        for _ in 0..4 {
            told_before_park = told.0.load(Ordering::SeqCst);
            match view.poll_next() {
                Some(item) => {
                    read += item.buffer.len();
                    trace.push(format!(
                        "{} {:?} next {:?}",
                        item.buffer.len(),
                        item.buffer.data_type(),
                        item.next_data_type
                    ));
                }
                None => break,
            }
        }
        let partition = producer.join().unwrap();
        let told_after = told.0.load(Ordering::SeqCst);
        let mut rest = 0;
        trace.push(view.debug_summary());
        while let Some(item) = view.poll_next() {
            rest += item.buffer.len();
            trace.push(format!("after {}", item.buffer.len()));
        }
        let mut prefix = [0u8; fluxgate::record::MAX_LENGTH_PREFIX];
        let written = 2 * (3000 + fluxgate::record::encode_prefix(3000, &mut prefix));
        assert_eq!(
            read + rest,
            written,
            "flushed bytes stayed unreadable {trace:?}"
        );
        assert!(
            rest == 0 || told_after > told_before_park,
            "{rest} bytes became readable after the reader parked, and it was not told"
        );
        drop((view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p11) A network sender without credit is there for a priority event (the reader reported
/// one available, with a finished data buffer at its head) when the producer releases the
/// subpartition, whose drain takes the event. The read that follows returns the event or
/// nothing, never the data buffer: sent without credit, the consumer would find no segment
/// for it and fail every channel of the connection.
#[test]
fn a_release_taking_the_priority_event_leaves_no_data_for_a_reader_without_credit() {
    bounded_model(|| {
        let (pool, mut partition, mut view) = one_subpartition_with_view(4);
        // 4094 bytes with their 2-byte prefix fill a segment: a finished data buffer.
        partition.emit_record(&[1u8; 4094][..], 0).unwrap();
        let barrier =
            fluxgate::event::Event::CheckpointBarrier(fluxgate::event::CheckpointBarrier {
                id: 1,
                timestamp: 0,
                kind: fluxgate::event::CheckpointKind::Checkpoint,
                alignment: fluxgate::event::Alignment::Unaligned,
            });
        partition.broadcast_event(&barrier, true).unwrap();
        let (available, _) = view.availability_and_backlog(false);
        assert!(available, "the priority event needs no credit");

        let producer = thread::spawn(move || {
            partition.release();
            partition
        });
        let read = view.poll_next();
        let partition = producer.join().unwrap();
        if let Some(item) = &read {
            assert!(
                !item.buffer.data_type().is_buffer(),
                "a data buffer came out for a reader without credit"
            );
        }
        drop((read, view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}

/// (p12) A priority event's notification does not undo the reader's park: a reader that took
/// the event (and parked, nothing after it) before the producer's notification ran, and that
/// answers the notification with a look that finds nothing and does not park again (as a
/// network sender without credit does: nothing it may send), is still told of the item
/// queued next. The notification cleared the reader's waiting flag after its fence, so that
/// item came without a word (for a sender, until credit came).
#[test]
fn a_priority_event_s_notification_keeps_the_reader_s_later_park() {
    use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
    bounded_model(|| {
        let (pool, mut partition, mut view, told) = one_subpartition_told();
        let barrier = |id, alignment| {
            Event::CheckpointBarrier(CheckpointBarrier {
                id,
                timestamp: 0,
                kind: CheckpointKind::Checkpoint,
                alignment,
            })
        };
        let producer = thread::spawn(move || {
            partition
                .broadcast_event(&barrier(1, Alignment::Unaligned), true)
                .unwrap();
            partition
                .broadcast_event(&barrier(2, Alignment::Aligned), false)
                .unwrap();
            partition
        });
        let told_now = || told.0.load(Ordering::SeqCst);
        // Reads until nothing is left; `told_before` is the count before the read after which,
        // by `poll_next`'s contract, the reader is told of what comes.
        let read_all = |view: &mut fluxgate::partition::SubpartitionView| {
            let mut told_before = None;
            for _ in 0..3 {
                let before = told_now();
                match view.poll_next() {
                    Some(item) => {
                        let parked = item.next_data_type == DataType::None;
                        told_before = parked.then_some(before);
                    }
                    None => return Some(before),
                }
            }
            told_before
        };
        let mut told_before = read_all(&mut view);
        if let Some(before) = told_before {
            // Woken (within a bounded wait): one look that finds nothing does not park again.
            for _ in 0..3 {
                if told_now() > before {
                    break;
                }
                thread::yield_now();
            }
            if told_now() > before {
                let reacted = told_now();
                let (available, _) = view.availability_and_backlog(false);
                told_before = if available {
                    read_all(&mut view)
                } else {
                    Some(reacted)
                };
            }
        }
        let partition = producer.join().unwrap();
        let later = view.poll_next();
        if let (Some(item), Some(told_then)) = (&later, told_before) {
            assert!(
                told_now() > told_then,
                "{:?} became readable after the reader last looked, and it was not told",
                item.buffer.data_type()
            );
        }
        drop((later, view, partition));
        assert_eq!(pool.available_segments(), pool.total_segments());
    });
}
