//! Input gates over local channels: the scenarios the InputGate seed walks through, one test
//! each, plus barriers, union gates and the async read.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::buffer::{NetworkBufferPool, PoolError};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    AlignmentMode, Backoff, BufferOrEvent, ChannelLocation, ChannelSpec, CheckpointedInputGate,
    ConsumedSubpartition, GateError, GateItem, InputGate, OutputWait, ReaderItem, RecordReader,
    SingleInputGate, UnionInputGate,
};
use fluxgate::partition::{
    PartitionError, PartitionManager, ResultPartition, ResultPartitionId, TaskEventListener,
};
use fluxgate::NetworkConfig;

const LONG: Duration = Duration::from_secs(20);

struct Fixture {
    network: NetworkBufferPool,
    config: NetworkConfig,
    manager: Arc<PartitionManager>,
}

fn fixture() -> Fixture {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config.set("taskmanager.memory.network.max", "2mb").unwrap();
    config.set("fluxgate.memory.arena-size", "1mb").unwrap();
    Fixture {
        network: NetworkBufferPool::new(&config).unwrap(),
        config,
        manager: Arc::new(PartitionManager::new()),
    }
}

fn pid(n: u64) -> ResultPartitionId {
    ResultPartitionId {
        partition: n,
        producer: 0,
    }
}

impl Fixture {
    /// A registered producer partition with `subpartitions` subpartitions.
    fn producer(&self, n: u64, subpartitions: usize) -> ResultPartition {
        let partition =
            ResultPartition::new(pid(n), subpartitions, &self.network, &self.config).unwrap();
        self.manager.register(partition.handle()).unwrap();
        partition
    }

    /// A set-up gate with one local channel per `(partition, subpartition)`.
    fn gate(&self, consumed: &[(u64, usize)], location: ChannelLocation) -> SingleInputGate {
        let specs = consumed
            .iter()
            .map(|&(n, subpartition)| ChannelSpec {
                consumed: ConsumedSubpartition {
                    partition: pid(n),
                    subpartition,
                },
                location: location.clone(),
            })
            .collect();
        let mut gate =
            SingleInputGate::new(specs, self.manager.clone(), &self.network, &self.config);
        gate.setup().unwrap();
        gate
    }

    /// A set-up gate with one local channel on `(partition, 0)`, retrying its request on
    /// `backoff`.
    fn gate_with_backoff(&self, partition: u64, backoff: Backoff) -> SingleInputGate {
        let specs = vec![ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: pid(partition),
                subpartition: 0,
            },
            location: ChannelLocation::Local,
        }];
        let mut gate =
            SingleInputGate::new(specs, self.manager.clone(), &self.network, &self.config)
                .with_backoff(backoff);
        gate.setup().unwrap();
        gate
    }

    fn all_segments_back(&self) -> bool {
        self.network.available_segments() == self.network.total_segments()
    }
}

fn data(item: &GateItem) -> Vec<u8> {
    match item {
        GateItem::Buffer(buffer) => buffer.as_slice().to_vec(),
        other => panic!("expected data, got {other:?}"),
    }
}

fn event(item: &GateItem) -> &Event {
    match item {
        GateItem::Event { event, .. } => event,
        other => panic!("expected an event, got {other:?}"),
    }
}

#[test]
fn partitions_are_requested_once_and_data_flows_by_reference() {
    let f = fixture();
    let mut producer = f.producer(1, 1);
    let mut gate = f.gate(&[(1, 0)], ChannelLocation::Local);
    let now = Instant::now();
    gate.request_partitions(now).unwrap();
    gate.request_partitions(now).unwrap();
    send(&mut producer, b"hello");
    let item = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(item.channel, 0);
    let GateItem::Buffer(buffer) = &item.item else {
        panic!()
    };
    assert_eq!(buffer.as_slice(), common::framed_record(b"hello"));
    let metrics = gate.channel(0).unwrap().metrics().unwrap();
    assert_eq!(metrics.num_buffers_in.get(), 1);
    assert_eq!(metrics.num_bytes_in.get(), 6, "a 1-byte length and 5 bytes");
    drop(item);
    producer.finish().unwrap();
    assert_eq!(
        event(&gate.next_timeout(LONG).unwrap().unwrap().item),
        &Event::EndOfPartition
    );
    assert!(gate.is_finished());
    assert!(gate.next_timeout(LONG).unwrap().is_none());
    gate.close();
    assert_eq!(gate.poll_next().unwrap_err(), GateError::Closed);
    assert_eq!(gate.request_partitions(now).unwrap_err(), GateError::Closed);
    drop(producer);
    assert!(f.all_segments_back());
}

#[test]
fn a_missing_partition_is_retried_with_doubling_backoff_then_found() {
    let f = fixture();
    // `with_backoff` applies to channels made after it: before setup.
    let mut gate = f.gate_with_backoff(
        5,
        Backoff::new(Duration::from_millis(100), Duration::from_millis(400)),
    );
    let t0 = Instant::now();
    gate.request_partitions(t0).unwrap();
    assert_eq!(
        gate.local_channel(0).unwrap().backoff(),
        Duration::from_millis(100)
    );
    assert_eq!(gate.poll_timeout(), Some(t0 + Duration::from_millis(100)));
    // Not due yet: nothing happens.
    gate.handle_timeout(t0 + Duration::from_millis(50)).unwrap();
    assert_eq!(
        gate.local_channel(0).unwrap().backoff(),
        Duration::from_millis(100)
    );
    let t1 = t0 + Duration::from_millis(100);
    gate.handle_timeout(t1).unwrap();
    assert_eq!(
        gate.local_channel(0).unwrap().backoff(),
        Duration::from_millis(200)
    );
    assert_eq!(gate.poll_timeout(), Some(t1 + Duration::from_millis(200)));
    // The producer registers before the next retry: the retry succeeds.
    let mut producer = f.producer(5, 1);
    gate.handle_timeout(t1 + Duration::from_millis(200))
        .unwrap();
    assert_eq!(gate.poll_timeout(), None);
    send(&mut producer, b"late");
    assert_eq!(
        data(&gate.next_timeout(LONG).unwrap().unwrap().item),
        common::framed_record(b"late")
    );
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn an_exhausted_backoff_fails_with_partition_not_found() {
    let f = fixture();
    let mut gate = f.gate_with_backoff(
        9,
        Backoff::new(Duration::from_millis(100), Duration::from_millis(200)),
    );
    let mut now = Instant::now();
    gate.request_partitions(now).unwrap();
    let mut result = Ok(());
    for _ in 0..5 {
        now += Duration::from_secs(1);
        result = gate.handle_timeout(now);
        if result.is_err() {
            break;
        }
    }
    assert_eq!(
        result.unwrap_err(),
        GateError::Partition {
            channel: 0,
            source: PartitionError::PartitionNotFound(pid(9))
        }
    );
    drop(gate);
    assert!(f.all_segments_back());
}

/// A gate closed by its closer (task cancellation) while a local channel waits to retry its
/// request retries no more: the read says `Closed`, not that the partition was not found
/// (a failed request, not a cancellation), and a partition registered meanwhile is not
/// requested by a consumer that left.
#[test]
fn a_closed_gate_retries_no_partition_request() {
    let f = fixture();
    let mut gate = f.gate_with_backoff(
        9,
        Backoff::new(Duration::from_millis(100), Duration::from_millis(100)),
    );
    let now = Instant::now();
    gate.request_partitions(now).unwrap();
    gate.closer().close();
    let producer = f.producer(9, 1);
    for retry in 1..=3 {
        let due = now + Duration::from_secs(retry);
        assert_eq!(gate.handle_timeout(due), Err(GateError::Closed));
        // What a blocking read woken by the close does first: it releases the channels.
        assert!(gate.is_closed());
    }
    assert_eq!(gate.poll_next().unwrap_err(), GateError::Closed);
    let view = f.manager.create_view(pid(9), 0, Arc::new(Deaf));
    assert!(
        view.is_ok(),
        "the closed consumer took the subpartition's one view: {view:?}"
    );
    drop((view, gate, producer));
    assert!(f.all_segments_back());
}

/// A union closed from another thread, or through a member's closer, while a member's local
/// channel waits to retry its request: the retry a woken blocking read handles first says
/// `Closed` and closes every member (their channels released on the reader), and the union
/// stays closed.
#[test]
fn a_closed_union_retries_nothing_and_closes_its_members() {
    let f = fixture();
    for close_member in [false, true] {
        let mut waiting = f.gate_with_backoff(
            9,
            Backoff::new(Duration::from_millis(100), Duration::from_millis(100)),
        );
        let now = Instant::now();
        waiting.request_partitions(now).unwrap();
        let other = f.gate(&[(10, 0)], ChannelLocation::Local);
        let mut union = UnionInputGate::new(vec![other, waiting]);
        if close_member {
            union.gates()[1].closer().close();
        } else {
            union.closer().close();
        }
        let due = now + Duration::from_secs(1);
        assert_eq!(union.handle_timeout(due), Err(GateError::Closed));
        assert!(union.gates().iter().all(SingleInputGate::is_closed));
        assert!(matches!(union.next_timeout(LONG), Err(GateError::Closed)));
        drop(union);
    }
    assert!(f.all_segments_back());
}

/// Task events from a local channel that ended are dropped, as a remote channel's are, and a
/// closed gate sends none (Flink's channels refuse to send once released).
#[test]
fn task_events_reach_no_producer_after_the_channel_ended_or_the_gate_closed() {
    let f = fixture();
    let mut producer = f.producer(2, 1);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    f.manager.subscribe_task_events(pid(2), events.clone());
    let mut gate = f.gate(&[(2, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    gate.send_task_event(&Event::Task(b"before".to_vec()))
        .unwrap();
    producer.finish().unwrap();
    let end = gate.next_timeout(LONG).unwrap().expect("the channel's end");
    assert!(matches!(
        end.item,
        GateItem::Event {
            event: Event::EndOfPartition,
            ..
        }
    ));
    gate.send_task_event(&Event::Task(b"after the end".to_vec()))
        .unwrap();
    gate.close();
    assert_eq!(
        gate.send_task_event(&Event::Task(b"after the close".to_vec())),
        Err(GateError::Closed)
    );
    assert_eq!(*events.0.lock().unwrap(), [Event::Task(b"before".to_vec())]);
    drop((end, gate, producer));
    assert!(f.all_segments_back());
}

/// An unknown channel located as local whose request fails for good (here: no such
/// subpartition) fails the gate's reads as a channel failing its first request does; it
/// stayed unknown before, so the update's caller alone heard of it and reads waited for good.
#[test]
fn an_update_whose_request_fails_fails_the_reads() {
    let f = fixture();
    let _producer = f.producer(2, 1);
    let mut gate = f.gate(&[(2, 5)], ChannelLocation::Unknown);
    let now = Instant::now();
    gate.request_partitions(now).unwrap();
    let updated = gate.update_channel(0, ChannelLocation::Local, now);
    assert!(
        matches!(
            updated,
            Err(GateError::Partition {
                channel: 0,
                source: PartitionError::NoSuchSubpartition { .. }
            })
        ),
        "{updated:?}"
    );
    let read = gate.poll_next().map(|item| item.is_some());
    assert!(
        matches!(
            read,
            Err(GateError::Partition {
                channel: 0,
                source: PartitionError::NoSuchSubpartition { .. }
            })
        ),
        "{read:?}"
    );
    drop(gate);
    assert!(f.all_segments_back());
}

/// Flink's inPoolUsage counts segments holding data: the exclusive segments reserved for a
/// channel not located yet hold none (an unknown channel holds no buffers in Flink).
#[test]
fn in_pool_usage_leaves_out_the_segments_reserved_for_unknown_channels() {
    let f = fixture();
    let gate = f.gate(&[(2, 0), (3, 0)], ChannelLocation::Unknown);
    let pool = gate
        .pool()
        .expect("unknown channels reserve remote segments");
    assert_eq!(
        pool.in_use_segments(),
        2 * f.config.buffers_per_channel,
        "both channels' exclusive segments are reserved"
    );
    assert_eq!(gate.metrics_snapshot().in_pool_usage, 0.0);
    drop(gate);
    assert!(f.all_segments_back());
}

/// A gate checks the configuration it is given at setup (its fields are public): an absurd
/// `buffers-per-channel` is refused as a configuration error, not tried against the pool.
#[test]
fn a_gate_refuses_a_configuration_that_cannot_work() {
    let f = fixture();
    let mut config = f.config.clone();
    config.buffers_per_channel = 100_000;
    config.buffer_request_timeout = Duration::from_millis(1);
    let specs = vec![ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: pid(2),
            subpartition: 0,
        },
        location: ChannelLocation::Remote,
    }];
    let mut gate = SingleInputGate::new(specs, f.manager.clone(), &f.network, &config);
    let setup = gate.setup();
    assert!(
        matches!(setup, Err(GateError::Pool(PoolError::Config(_)))),
        "{setup:?}"
    );
    drop(gate);
    assert!(f.all_segments_back());
}

struct Events(Mutex<Vec<Event>>);

/// A reader that listens to nothing.
struct Deaf;

impl fluxgate::partition::AvailabilityListener for Deaf {
    fn notify_data_available(&self) {}
}

impl TaskEventListener for Events {
    fn on_task_event(&self, event: &Event) {
        self.0.lock().unwrap().push(event.clone());
    }
}

#[test]
fn unknown_channels_become_local_get_requested_and_receive_pending_task_events() {
    let f = fixture();
    let mut producer = f.producer(2, 1);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    f.manager.subscribe_task_events(pid(2), events.clone());
    let mut gate = f.gate(&[(2, 0)], ChannelLocation::Unknown);
    let now = Instant::now();
    gate.request_partitions(now).unwrap();
    gate.send_task_event(&Event::Task(b"sync".to_vec()))
        .unwrap();
    assert!(
        events.0.lock().unwrap().is_empty(),
        "held while the location is unknown"
    );
    send(&mut producer, b"x");
    assert!(
        gate.poll_next().unwrap().is_none(),
        "an unknown channel reads nothing"
    );
    gate.update_channel(0, ChannelLocation::Local, now).unwrap();
    assert_eq!(
        *events.0.lock().unwrap(),
        vec![Event::Task(b"sync".to_vec())]
    );
    assert_eq!(
        data(&gate.next_timeout(LONG).unwrap().unwrap().item),
        common::framed_record(b"x")
    );
    gate.send_task_event(&Event::Task(b"again".to_vec()))
        .unwrap();
    assert_eq!(events.0.lock().unwrap().len(), 2);
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn a_task_event_longer_than_a_segment_is_refused_before_it_goes_out() {
    // A producer refuses a TaskEventRequest frame longer than a segment as malformed and
    // closes the connection: sent, such an event failed every channel on it.
    let f = fixture();
    let producer = f.producer(2, 1);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    f.manager.subscribe_task_events(pid(2), events.clone());
    let mut gate = f.gate(&[(2, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let empty = Event::Task(Vec::new()).encoded_len();
    let fits = Event::Task(vec![7; 4096 - empty]);
    let too_long = Event::Task(vec![7; 4096 - empty + 1]);
    assert!(matches!(
        gate.send_task_event(&too_long),
        Err(GateError::TaskEventTooLarge {
            len: 4097,
            max: 4096
        })
    ));
    gate.send_task_event(&fits).unwrap();
    assert_eq!(*events.0.lock().unwrap(), vec![fits]);
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn closing_from_another_thread_wakes_a_blocked_reader() {
    let f = fixture();
    let _producer = f.producer(3, 1);
    let mut gate = f.gate(&[(3, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let closer = gate.closer();
    let idle = gate.metrics().idle.clone();
    let result = thread::scope(|s| {
        let reader = s.spawn(move || gate.next_timeout(LONG));
        // The reader blocks first (its idle time grows): the close must wake it.
        assert!(common::wait_until(LONG, || idle.total() > Duration::ZERO));
        closer.close();
        reader.join().unwrap()
    });
    assert_eq!(result.unwrap_err(), GateError::Closed);
    assert!(f.all_segments_back());
}

#[test]
fn the_gate_finishes_after_end_of_partition_from_every_channel() {
    let f = fixture();
    let mut producer = f.producer(4, 3);
    let mut gate = f.gate(&[(4, 0), (4, 1), (4, 2)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    producer.finish().unwrap();
    let mut ended = Vec::new();
    while let Some(item) = gate.next_timeout(LONG).unwrap() {
        assert_eq!(event(&item.item), &Event::EndOfPartition);
        assert!(!ended.contains(&item.channel));
        ended.push(item.channel);
        assert_eq!(gate.is_finished(), ended.len() == 3);
    }
    ended.sort();
    assert_eq!(ended, vec![0, 1, 2]);
    drop((gate, producer));
    assert!(f.all_segments_back());
}

/// The checkpointed gate's next item, within LONG.
/// Emits `record` to subpartition 0 of `producer` and makes it readable at once.
fn send(producer: &mut ResultPartition, record: &[u8]) {
    producer.emit_record(record, 0).unwrap();
    producer.flush(0);
}

fn next_item<G: InputGate>(gate: &mut CheckpointedInputGate<G>) -> BufferOrEvent {
    gate.next_until(Some(Instant::now() + LONG))
        .expect("no error")
        .expect("an item before the end")
}

fn barrier(id: u64, alignment: Alignment) -> Event {
    Event::CheckpointBarrier(CheckpointBarrier {
        id,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment,
    })
}

#[test]
fn an_aligned_barrier_blocks_its_channel_until_resumed() {
    let f = fixture();
    let mut producer = f.producer(6, 1);
    let mut gate = f.gate(&[(6, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    producer
        .broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    send(&mut producer, b"after");
    assert_eq!(
        event(&gate.next_timeout(LONG).unwrap().unwrap().item),
        &barrier(1, Alignment::Aligned)
    );
    assert!(
        gate.poll_next().unwrap().is_none(),
        "blocked behind the barrier"
    );
    gate.resume_consumption(0).unwrap();
    assert_eq!(
        data(&gate.next_timeout(LONG).unwrap().unwrap().item),
        common::framed_record(b"after")
    );
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn priority_events_are_read_before_queued_data_of_every_channel() {
    let f = fixture();
    let mut a = f.producer(7, 1);
    let mut b = f.producer(8, 1);
    let mut gate = f.gate(&[(7, 0), (8, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    for i in 0..3u8 {
        a.emit_record(&[i][..], 0).unwrap();
        a.flush(0);
    }
    send(&mut b, b"b");
    b.broadcast_event(&barrier(2, Alignment::Unaligned), true)
        .unwrap();
    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(first.channel, 1);
    assert_eq!(event(&first.item), &barrier(2, Alignment::Unaligned));
    assert_eq!(first.overtaken, 1);
    drop((first, gate, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn a_busy_channel_does_not_starve_the_others() {
    let f = fixture();
    let mut busy = f.producer(10, 1);
    let mut quiet = f.producer(11, 1);
    let mut gate = f.gate(&[(10, 0), (11, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let record = [1u8; 4092]; // one full segment per record
    for _ in 0..8 {
        busy.emit_record(&record[..], 0).unwrap();
    }
    busy.flush(0);
    send(&mut quiet, b"q");
    let order: Vec<usize> = (0..4)
        .map(|_| gate.next_timeout(LONG).unwrap().unwrap().channel)
        .collect();
    assert!(
        order[..3].contains(&1),
        "the quiet channel waited behind {order:?}"
    );
    drop((gate, busy, quiet));
    assert!(f.all_segments_back());
}

#[test]
fn a_union_gate_remaps_channels_and_takes_gates_in_turn() {
    let f = fixture();
    let mut a = f.producer(12, 2);
    let mut b = f.producer(13, 1);
    let mut g0 = f.gate(&[(12, 0), (12, 1)], ChannelLocation::Local);
    let mut g1 = f.gate(&[(13, 0)], ChannelLocation::Local);
    g0.request_partitions(Instant::now()).unwrap();
    g1.request_partitions(Instant::now()).unwrap();
    let mut union = UnionInputGate::new(vec![g0, g1]);
    assert_eq!(union.channel_count(), 3);
    assert_eq!(union.locate(2), Some((1, 0)));
    a.emit_record(&b"a1"[..], 1).unwrap();
    a.flush(1);
    send(&mut b, b"b0");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let item = union.next_timeout(LONG).unwrap().unwrap();
        seen.push((item.channel, data(&item.item)));
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (1, common::framed_record(b"a1")),
            (2, common::framed_record(b"b0"))
        ]
    );
    a.finish().unwrap();
    b.finish().unwrap();
    let mut ends = 0;
    while let Some(item) = union.next_timeout(LONG).unwrap() {
        assert_eq!(event(&item.item), &Event::EndOfPartition);
        ends += 1;
    }
    assert_eq!(ends, 3);
    assert!(union.is_finished());
    drop((union, a, b));
    assert!(f.all_segments_back());
}

/// A union is cancelled from another thread through its own closer or a member's: a reader
/// blocked on it wakes with `Closed`, and every segment goes back.
#[test]
fn a_union_gate_is_closed_from_another_thread_by_its_closer_or_a_member_s() {
    for by_member in [false, true] {
        let f = fixture();
        let ids = (30 + u64::from(by_member) * 2, 31 + u64::from(by_member) * 2);
        let a = f.producer(ids.0, 1);
        let b = f.producer(ids.1, 1);
        let mut g0 = f.gate(&[(ids.0, 0)], ChannelLocation::Local);
        let mut g1 = f.gate(&[(ids.1, 0)], ChannelLocation::Local);
        g0.request_partitions(Instant::now()).unwrap();
        g1.request_partitions(Instant::now()).unwrap();
        let mut union = UnionInputGate::new(vec![g0, g1]);
        // Nothing to read: the looks that the requests queued find nothing, so the union's
        // queue is empty and only the close can wake the reader.
        assert!(union.poll_next().unwrap().is_none());
        let closer = if by_member {
            union.gates()[1].closer()
        } else {
            union.closer()
        };
        let idle = union.metrics().idle.clone();
        let read = thread::scope(|s| {
            let reader = s.spawn(|| union.next_timeout(LONG));
            // The reader blocks first (its idle time grows): the close must wake it.
            assert!(common::wait_until(LONG, || idle.total() > Duration::ZERO));
            closer.close();
            reader.join().unwrap()
        });
        let by = if by_member { "a member" } else { "the union" };
        assert!(
            matches!(read, Err(GateError::Closed)),
            "closed by {by}: {read:?}"
        );
        // It stays closed, and the read released every member's channels.
        for _ in 0..3 {
            assert!(
                matches!(union.poll_next(), Err(GateError::Closed)),
                "still closed ({by})"
            );
        }
        assert!(
            union.gates().iter().all(|g| g.is_closed()),
            "closed by {by}"
        );
        drop((union, a, b));
        assert!(f.all_segments_back());
    }
}

/// A request that fails is not forgotten: asking again fails again instead of reporting a
/// gate requested whose later channels were never asked for.
#[test]
fn a_failed_partition_request_is_reported_again_on_the_next_call() {
    let f = fixture();
    let taken = f.producer(34, 1);
    let free = f.producer(35, 1);
    // Another gate holds the only view of partition 34's subpartition.
    let mut first = f.gate(&[(34, 0)], ChannelLocation::Local);
    first.request_partitions(Instant::now()).unwrap();
    let mut gate = f.gate(&[(35, 0), (34, 0)], ChannelLocation::Local);
    assert!(gate.request_partitions(Instant::now()).is_err());
    assert!(
        gate.request_partitions(Instant::now()).is_err(),
        "the second call still has a channel it could not request"
    );
    drop((gate, first, taken, free));
    assert!(f.all_segments_back());
}

use common::RecordingSink as Sink;

/// `N` producers, partitions `first..first + N` of one subpartition each, and an unaligned
/// checkpointed gate of one local channel per producer, requested, with its sink.
fn unaligned_gate<const N: usize>(
    f: &Fixture,
    first: u64,
) -> (
    [ResultPartition; N],
    CheckpointedInputGate<SingleInputGate>,
    Arc<Sink>,
) {
    let producers = std::array::from_fn(|i| f.producer(first + i as u64, 1));
    let consumed: Vec<(u64, usize)> = (0..N as u64).map(|i| (first + i, 0)).collect();
    let mut gate = f.gate(&consumed, ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let sink = Arc::new(Sink::default());
    let checkpointed =
        CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    (producers, checkpointed, sink)
}

#[test]
fn aligned_checkpoints_hand_the_barrier_over_once_all_channels_delivered_it() {
    let f = fixture();
    let mut a = f.producer(14, 1);
    let mut b = f.producer(15, 1);
    let mut gate = f.gate(&[(14, 0), (15, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    a.broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    send(&mut a, b"a-after");
    send(&mut b, b"b-before");
    // Channel 0 is blocked after its barrier: only b's data comes through.
    let item = next_item(&mut checkpointed);
    assert_eq!(
        (item.channel, data(&item.item)),
        (1, common::framed_record(b"b-before"))
    );
    assert!(checkpointed.poll_next().unwrap().is_none());
    assert_eq!(checkpointed.blocked_channels(), &[0]);
    b.broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    drop(item);
    let item = next_item(&mut checkpointed);
    assert_eq!(event(&item.item), &barrier(1, Alignment::Aligned));
    assert_eq!(checkpointed.pending_checkpoint(), None);
    drop(item);
    let item = next_item(&mut checkpointed);
    assert_eq!(
        (item.channel, data(&item.item)),
        (0, common::framed_record(b"a-after"))
    );
    drop((item, checkpointed, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn an_unaligned_barrier_at_a_gate_that_aligns_only_is_an_error() {
    // Its sender did not stop behind it: taken as aligned, the records after it would reach
    // the task before the checkpoint. (A producer turns an aligned barrier with a timeout
    // unaligned by itself, whatever its consumers' mode.)
    let f = fixture();
    let mut a = f.producer(60, 1);
    let mut gate = f.gate(&[(60, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    a.broadcast_event(&barrier(3, Alignment::Unaligned), true)
        .unwrap();
    assert_eq!(
        checkpointed.poll_next().unwrap_err(),
        GateError::UnalignedBarrier {
            channel: 0,
            checkpoint: 3
        }
    );
    drop((checkpointed, a));
    assert!(f.all_segments_back());
}

#[test]
fn a_cancel_marker_aborts_alignment_and_unblocks_channels() {
    let f = fixture();
    let mut a = f.producer(16, 1);
    let mut b = f.producer(17, 1);
    let mut gate = f.gate(&[(16, 0), (17, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    a.broadcast_event(&barrier(3, Alignment::Aligned), false)
        .unwrap();
    send(&mut a, b"a");
    assert!(checkpointed.poll_next().unwrap().is_none());
    assert_eq!(checkpointed.pending_checkpoint(), Some(3));
    b.broadcast_event(&Event::CancelCheckpointMarker(3), false)
        .unwrap();
    assert_eq!(
        event(&next_item(&mut checkpointed).item),
        &Event::CancelCheckpointMarker(3)
    );
    assert_eq!(checkpointed.pending_checkpoint(), None);
    let item = next_item(&mut checkpointed);
    assert_eq!(
        (item.channel, data(&item.item)),
        (0, common::framed_record(b"a"))
    );
    // The late barrier of the aborted checkpoint is swallowed and its channel resumed.
    b.broadcast_event(&barrier(3, Alignment::Aligned), false)
        .unwrap();
    send(&mut b, b"b");
    drop(item);
    let item = next_item(&mut checkpointed);
    assert_eq!(
        (item.channel, data(&item.item)),
        (1, common::framed_record(b"b"))
    );
    drop((item, checkpointed, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn unaligned_checkpoints_trigger_at_the_first_barrier_and_persist_in_flight_data() {
    let f = fixture();
    let mut a = f.producer(18, 1);
    let mut b = f.producer(19, 1);
    let mut gate = f.gate(&[(18, 0), (19, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let sink = Arc::new(Sink::default());
    let mut checkpointed =
        CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    a.emit_record(&b"a-in-flight"[..], 0).unwrap();
    a.broadcast_event(&barrier(4, Alignment::Unaligned), true)
        .unwrap();
    send(&mut a, b"a-after");
    send(&mut b, b"b-in-flight");
    let first = next_item(&mut checkpointed);
    assert_eq!(
        event(&first.item),
        &barrier(4, Alignment::Unaligned),
        "triggered at once"
    );
    let mut delivered = Vec::new();
    while let Some(item) = checkpointed.poll_next().unwrap() {
        delivered.push(data(&item.item));
    }
    assert_eq!(
        delivered.len(),
        3,
        "in-flight data is still delivered to the task"
    );
    assert!(
        sink.complete.lock().unwrap().is_empty(),
        "channel 1 has not sent its barrier"
    );
    b.broadcast_event(&barrier(4, Alignment::Unaligned), true)
        .unwrap();
    assert!(
        checkpointed.poll_next().unwrap().is_none(),
        "later barriers are not handed over"
    );
    let mut persisted = sink.data.lock().unwrap().clone();
    persisted.sort();
    assert_eq!(
        persisted,
        vec![
            (4, 0, common::framed_record(b"a-in-flight")),
            (4, 1, common::framed_record(b"b-in-flight"))
        ]
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![4]);
    drop((first, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// The items an unaligned barrier overtakes are all of its channel's data lane, events
/// included: only the buffers among them are persisted, and the data after them is not.
#[test]
fn an_unaligned_barrier_counts_overtaken_events_without_persisting_them() {
    let f = fixture();
    let mut a = f.producer(23, 1);
    let mut gate = f.gate(&[(23, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let sink = Arc::new(Sink::default());
    let mut checkpointed =
        CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    a.emit_record(&b"d0"[..], 0).unwrap();
    // A data-lane event between the two buffers (the cancellation of an older checkpoint; the
    // task does not see it, as it is older than the running checkpoint).
    a.broadcast_event(&Event::CancelCheckpointMarker(1), false)
        .unwrap();
    a.emit_record(&b"d1"[..], 0).unwrap();
    a.broadcast_event(&barrier(4, Alignment::Unaligned), true)
        .unwrap();
    send(&mut a, b"after");
    let first = next_item(&mut checkpointed);
    assert_eq!(event(&first.item), &barrier(4, Alignment::Unaligned));
    assert_eq!(first.overtaken, 3, "d0, the marker, d1");
    let mut delivered = 0;
    while checkpointed.poll_next().unwrap().is_some() {
        delivered += 1;
    }
    assert_eq!(delivered, 3, "d0, d1, after");
    let persisted: Vec<_> = sink.data.lock().unwrap().clone();
    assert_eq!(
        persisted,
        vec![
            (4, 0, common::framed_record(b"d0")),
            (4, 0, common::framed_record(b"d1"))
        ]
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![4]);
    drop((first, checkpointed, a));
    assert!(f.all_segments_back());
}

/// Without a sink an unaligned checkpoint still completes once its overtaken data is read
/// (before, its count never went down and only a later checkpoint ended it).
#[test]
fn an_unaligned_checkpoint_without_a_sink_completes_once_its_overtaken_data_is_read() {
    let f = fixture();
    let mut a = f.producer(36, 1);
    let mut gate = f.gate(&[(36, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, None);
    a.emit_record(&b"in-flight"[..], 0).unwrap();
    a.broadcast_event(&barrier(5, Alignment::Unaligned), true)
        .unwrap();
    let first = next_item(&mut checkpointed);
    assert_eq!(event(&first.item), &barrier(5, Alignment::Unaligned));
    assert_eq!(checkpointed.pending_checkpoint(), Some(5));
    let second = next_item(&mut checkpointed);
    assert_eq!(data(&second.item), common::framed_record(b"in-flight"));
    assert_eq!(checkpointed.pending_checkpoint(), None);
    drop((first, second, checkpointed, a));
    assert!(f.all_segments_back());
}

#[test]
fn the_record_reader_yields_records_and_events_from_every_channel() {
    let f = fixture();
    let mut a = f.producer(20, 1);
    let mut b = f.producer(21, 1);
    let mut gate = f.gate(&[(20, 0), (21, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let big = vec![7u8; 10_000]; // spans three 4 KiB segments
    a.emit_record(&big[..], 0).unwrap();
    a.emit_record(&b"small"[..], 0).unwrap();
    b.emit_record(&b"other"[..], 0).unwrap();
    a.finish().unwrap();
    b.finish().unwrap();
    let mut reader = RecordReader::new(gate, f.config.max_record_bytes);
    let mut records = Vec::new();
    let mut ends = 0;
    while let Some(item) = reader.next_timeout(LONG).unwrap() {
        match item {
            ReaderItem::Record { channel, bytes } => records.push((channel, bytes.to_vec())),
            ReaderItem::Event { event, .. } => {
                assert_eq!(event, Event::EndOfPartition);
                ends += 1;
            }
        }
    }
    assert_eq!(ends, 2);
    records.sort();
    assert_eq!(
        records,
        vec![
            (0, big.clone()),
            (0, b"small".to_vec()),
            (1, b"other".to_vec())
        ]
    );
    drop((reader, a, b));
    assert!(f.all_segments_back());
}

/// A reader's channels share the memory records spanning buffers may hold; a channel
/// refused memory gets what another channel kept from a record it finished (that record's
/// scratch stayed until its channel's next spanning record), so only records assembled at
/// once count: the read failed, and failed again at every later call.
#[test]
fn a_record_reader_gives_a_finished_record_s_memory_to_the_next() {
    let f = fixture();
    let mut gate = f.gate(&[(22, 0), (23, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let budget = fluxgate::record::SpanningBudget::new(600 << 10);
    let mut reader =
        RecordReader::with_spanning_budget(gate, f.config.max_record_bytes, budget.clone());
    let record = |byte: u8| vec![byte; 400 << 10];
    // Written and flushed, the partition left open: its channel keeps what it read.
    let write = |n: u64, byte: u8| {
        let mut producer = f.producer(n, 1);
        thread::spawn(move || {
            producer.emit_record(&record(byte)[..], 0).unwrap();
            producer.flush(0);
            producer
        })
    };
    let mut read_record_of = |channel: usize| loop {
        match reader.next_timeout(LONG).unwrap() {
            Some(ReaderItem::Record { channel: c, bytes }) => {
                assert_eq!((c, bytes.len()), (channel, 400 << 10));
                return;
            }
            Some(ReaderItem::Event { .. }) => {}
            None => panic!("ended before channel {channel}'s record"),
        }
    };
    let first = write(22, 1);
    read_record_of(0);
    let first = first.join().unwrap();
    assert!(budget.used() > 300 << 10, "{} charged", budget.used());
    let second = write(23, 2);
    read_record_of(1);
    let (mut first, mut second) = (first, second.join().unwrap());
    first.finish().unwrap();
    second.finish().unwrap();
    while reader.next_timeout(LONG).unwrap().is_some() {}
    drop((reader, first, second));
    assert_eq!(budget.used(), 0);
    assert!(f.all_segments_back());
}

struct ThreadWaker(thread::Thread, AtomicUsize);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.unpark();
    }
}

#[test]
fn the_async_read_resolves_when_a_producer_thread_flushes() {
    let f = fixture();
    let mut producer = f.producer(22, 1);
    let mut gate = f.gate(&[(22, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let mut read = Box::pin(gate.next_async());
    assert!(read.as_mut().poll(&mut cx).is_pending());
    thread::scope(|s| {
        // The producer stays alive until the read resolved: dropped unfinished, it would
        // release its partition.
        let _producer_thread = s.spawn(move || {
            send(&mut producer, b"async");
            producer
        });
        // Bounded by LONG in all: each park ends at a wake-up or at the give-up time.
        let give_up = Instant::now() + LONG;
        loop {
            if let Poll::Ready(result) = read.as_mut().poll(&mut cx) {
                let item = result.unwrap().unwrap();
                assert_eq!(data(&item.item), common::framed_record(b"async"));
                return;
            }
            let Some(left) = give_up.checked_duration_since(Instant::now()) else {
                panic!("the async read never resolved");
            };
            thread::park_timeout(left);
        }
    });
    assert!(waker_state.1.load(Ordering::SeqCst) >= 1);
    drop(read);
    drop(gate);
    assert!(f.all_segments_back());
}

/// An async read of a local channel whose partition is registered only later: the gate
/// retries the partition request when its back-off is due, as a blocking read does, and a
/// timer wakes the pending read for it (nothing else would: the producer's registration does
/// not know the gate). Before, the read stayed pending for good.
#[test]
fn an_async_read_retries_a_local_partition_registered_later() {
    let f = fixture();
    let mut gate = f.gate(&[(60, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let mut read = Box::pin(gate.next_async());
    assert!(
        read.as_mut().poll(&mut cx).is_pending(),
        "not registered yet"
    );
    let mut producer = f.producer(60, 1);
    send(&mut producer, b"late");
    // Bounded by the first retry's back-off (100 ms): each wake-up is polled.
    let started = Instant::now();
    while started.elapsed() < LONG {
        if let Poll::Ready(result) = read.as_mut().poll(&mut cx) {
            let item = result.unwrap().unwrap();
            assert_eq!(data(&item.item), common::framed_record(b"late"));
            assert!(
                waker_state.1.load(Ordering::SeqCst) >= 1,
                "woken, not polled blindly"
            );
            drop((item, read));
            drop((gate, producer));
            assert!(f.all_segments_back());
            return;
        }
        thread::park_timeout(LONG);
    }
    panic!("the async read never retried the partition request");
}

impl Fixture {
    /// A set-up gate of local channels reading subpartition 0 of `partitions`, requested, whose
    /// missing partitions are retried after `first_retry`.
    fn requested_gate(&self, partitions: &[u64], first_retry: Duration) -> SingleInputGate {
        let specs = partitions
            .iter()
            .map(|&n| ChannelSpec {
                consumed: ConsumedSubpartition {
                    partition: pid(n),
                    subpartition: 0,
                },
                location: ChannelLocation::Local,
            })
            .collect();
        let mut gate =
            SingleInputGate::new(specs, self.manager.clone(), &self.network, &self.config)
                .with_backoff(Backoff::new(first_retry, Duration::from_secs(1)));
        gate.setup().unwrap();
        gate.request_partitions(Instant::now()).unwrap();
        gate
    }
}

/// Once `gate`'s retry is due, registers partition `late` with one record, and writes a record
/// to `busy` (channel 0) before every read: channel 1, the late partition's, must be read
/// within 20 reads. Drops everything and checks every segment came back.
fn assert_the_late_partition_is_read(
    f: &Fixture,
    mut gate: impl InputGate,
    mut busy: ResultPartition,
    late: u64,
) {
    let due = gate.poll_timeout().expect("the missing partition's retry");
    assert!(common::wait_until(LONG, || Instant::now() >= due));
    let mut late = f.producer(late, 1);
    send(&mut late, b"late");
    let mut reads = Vec::new();
    for _ in 0..20 {
        send(&mut busy, b"busy");
        let item = gate.next_timeout(LONG).unwrap().unwrap();
        reads.push(item.channel);
        if item.channel == 1 {
            break;
        }
    }
    assert_eq!(
        reads.last(),
        Some(&1),
        "the late partition was never read: {reads:?}"
    );
    drop((gate, busy, late));
    assert!(f.all_segments_back());
}

/// A gate whose other channel always has data still retries a channel's partition request
/// when it comes due. The blocking read retried only after a wait, which a gate with data
/// never reaches (nor did `poll_next`, nor a read that failed): the late partition's
/// producer filled its pool and blocked while its consumer read the other input for ever.
#[test]
fn a_busy_gate_still_retries_a_partition_registered_later() {
    let f = fixture();
    let busy = f.producer(72, 1);
    let gate = f.requested_gate(&[72, 73], Duration::from_millis(10));
    assert_the_late_partition_is_read(&f, gate, busy, 73);
}

/// The same through a union, whose member waiting for its partition has nothing queued: the
/// union read it only once its other member went idle.
#[test]
fn a_busy_union_still_retries_a_member_s_partition_registered_later() {
    let f = fixture();
    let mut busy = f.producer(74, 1);
    let member = |n| f.requested_gate(&[n], Duration::from_millis(200));
    let mut union = UnionInputGate::new(vec![member(74), member(75)]);
    // Each member is looked at once before its retry is due: the waiting one, with nothing
    // queued, is then read no more until something queues it.
    send(&mut busy, b"first");
    let first = union
        .poll_next()
        .unwrap()
        .expect("the busy member's record");
    assert_eq!(first.channel, 0);
    drop(first);
    assert!(union.poll_next().unwrap().is_none());
    assert_the_late_partition_is_read(&f, union, busy, 75);
}

/// A channel whose producer released its partition fails every later read, not only the
/// first (Flink's channel keeps its cause): the second read used to wait for good.
#[test]
fn a_released_local_partition_fails_every_later_read() {
    let f = fixture();
    let mut producer = f.producer(61, 1);
    let mut gate = f.gate(&[(61, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    producer.release();
    for read in 0..2 {
        match gate.next_timeout(LONG) {
            Err(GateError::Partition { channel: 0, .. }) => {}
            other => panic!("read {read}: {other:?}"),
        }
    }
    drop((gate, producer));
    assert!(f.all_segments_back());
}

/// A local channel read to its end is not requested again: a re-triggered request does
/// nothing (Flink checks `isReleased`), where it used to find the partition gone and, after
/// its back-off, fail a gate whose channel had finished cleanly.
#[test]
fn a_finished_local_channel_is_not_requested_again() {
    let f = fixture();
    let mut producer = f.producer(62, 1);
    let mut gate = f.gate(&[(62, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    producer.finish().unwrap();
    let end = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(event(&end.item), &Event::EndOfPartition);
    assert!(gate.is_finished());
    drop(producer);
    gate.retrigger_partition_request(0, Instant::now()).unwrap();
    assert_eq!(gate.poll_timeout(), None, "no retry scheduled");
    assert!(matches!(gate.poll_next(), Ok(None)));
    drop((end, gate));
    assert!(f.all_segments_back());
}

/// A local partition that never registers fails the read once the back-off runs out, and
/// every read after it too: the second used to wait for good.
#[test]
fn a_local_partition_that_never_registers_fails_every_read_after_the_back_off() {
    let mut f = fixture();
    f.config
        .set_all([
            ("taskmanager.network.request-backoff.initial", "1"),
            ("taskmanager.network.request-backoff.max", "2"),
        ])
        .unwrap();
    let mut gate = f.gate(&[(63, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    for read in 0..2 {
        match gate.next_timeout(LONG) {
            Err(GateError::Partition { channel: 0, .. }) => {}
            other => panic!("read {read}: {other:?}"),
        }
    }
    drop(gate);
    assert!(f.all_segments_back());
}

#[test]
fn a_record_reader_reads_through_barrier_alignment() {
    let f = fixture();
    let mut a = f.producer(30, 1);
    let mut b = f.producer(31, 1);
    let mut gate = f.gate(&[(30, 0), (31, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    let mut reader = RecordReader::new(checkpointed, 1 << 20);
    a.emit_record(&b"a0"[..], 0).unwrap();
    a.broadcast_event(&barrier(5, Alignment::Aligned), false)
        .unwrap();
    a.emit_record(&b"a1"[..], 0).unwrap();
    b.emit_record(&b"b0"[..], 0).unwrap();
    b.broadcast_event(&barrier(5, Alignment::Aligned), false)
        .unwrap();
    a.finish().unwrap();
    b.finish().unwrap();
    let mut seen = Vec::new();
    while let Some(item) = reader.next_timeout(LONG).unwrap() {
        match item {
            ReaderItem::Record { bytes, .. } => {
                seen.push(String::from_utf8(bytes.to_vec()).unwrap())
            }
            ReaderItem::Event {
                event: Event::CheckpointBarrier(b),
                ..
            } => seen.push(format!("barrier {}", b.id)),
            ReaderItem::Event { .. } => {}
        }
    }
    // One barrier, after every record before it on both channels and before "a1".
    let barrier_at = seen
        .iter()
        .position(|s| s == "barrier 5")
        .expect("the aligned barrier");
    assert_eq!(seen.iter().filter(|s| s.starts_with("barrier")).count(), 1);
    assert!(seen[..barrier_at].contains(&"a0".to_string()));
    assert!(seen[..barrier_at].contains(&"b0".to_string()));
    assert_eq!(seen[barrier_at + 1..], ["a1".to_string()]);
    drop((reader, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn an_alignment_completed_by_a_channel_ending_still_hands_the_barrier_over() {
    // The cluster deadlock it prevents: a pass-through task whose alignment completed because
    // its last open channel ended (EndOfPartition, no barrier) never saw the barrier, so it
    // never forwarded it, and every downstream alignment waited for it forever.
    let f = fixture();
    let mut a = f.producer(18, 1);
    let mut b = f.producer(19, 1);
    let mut gate = f.gate(&[(18, 0), (19, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    a.broadcast_event(&barrier(4, Alignment::Aligned), false)
        .unwrap();
    send(&mut a, b"after");
    assert!(
        checkpointed.poll_next().unwrap().is_none(),
        "channel 0 is blocked"
    );
    assert_eq!(checkpointed.pending_checkpoint(), Some(4));
    b.finish().unwrap();
    let first = next_item(&mut checkpointed);
    assert_eq!(
        event(&first.item),
        &barrier(4, Alignment::Aligned),
        "the barrier comes first"
    );
    assert_eq!(checkpointed.pending_checkpoint(), None);
    let second = next_item(&mut checkpointed);
    assert_eq!(
        (second.channel, event(&second.item)),
        (1, &Event::EndOfPartition)
    );
    // Channel 0 was resumed: its data after the barrier follows.
    let third = next_item(&mut checkpointed);
    assert_eq!(
        (third.channel, data(&third.item)),
        (0, common::framed_record(b"after"))
    );
    drop((first, second, third, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// A late barrier of a checkpoint already aborted does not make the gate forget the barrier
/// of the checkpoint aligning now: when a channel's end completes that alignment, the task
/// still sees it.
#[test]
fn a_late_barrier_does_not_drop_the_barrier_held_for_the_running_alignment() {
    let f = fixture();
    let mut a = f.producer(27, 1);
    let mut b = f.producer(28, 1);
    let mut c = f.producer(29, 1);
    let mut gate = f.gate(&[(27, 0), (28, 0), (29, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    b.broadcast_event(&Event::CancelCheckpointMarker(5), false)
        .unwrap();
    // Read before 6 starts: a marker older than the running checkpoint is not news (Flink
    // drops it), so it would not come out after.
    let cancel = next_item(&mut checkpointed);
    assert_eq!(event(&cancel.item), &Event::CancelCheckpointMarker(5));
    a.broadcast_event(&barrier(6, Alignment::Aligned), false)
        .unwrap();
    b.broadcast_event(&barrier(6, Alignment::Aligned), false)
        .unwrap();
    assert!(checkpointed.poll_next().unwrap().is_none(), "6 aligns");
    assert_eq!(checkpointed.pending_checkpoint(), Some(6));
    // Channel 2's barrier of the aborted checkpoint 5 comes late, then the channel ends.
    c.broadcast_event(&barrier(5, Alignment::Aligned), false)
        .unwrap();
    c.finish().unwrap();
    let first = next_item(&mut checkpointed);
    assert_eq!(
        event(&first.item),
        &barrier(6, Alignment::Aligned),
        "checkpoint 6 completes with channel 2's end and its barrier comes first"
    );
    assert_eq!(checkpointed.pending_checkpoint(), None);
    let second = next_item(&mut checkpointed);
    assert_eq!(
        (second.channel, event(&second.item)),
        (2, &Event::EndOfPartition)
    );
    drop((cancel, first, second, checkpointed, a, b, c));
    assert!(f.all_segments_back());
}

/// In unaligned mode a channel may bring an aligned barrier of the same checkpoint (Flink's
/// forced-aligned barriers, of point-wise inputs). Unaligned barrier first: the checkpoint
/// triggers at once, and the aligned barrier's channel blocks until it completes. Aligned
/// barrier first: the checkpoint aligns, and turns unaligned (triggering, and resuming the
/// blocked channel) at the unaligned barrier. Either way the task sees the checkpoint's
/// barrier once.
#[test]
fn an_unaligned_checkpoint_takes_an_aligned_barrier_on_one_channel_in_either_order() {
    for aligned_first in [false, true] {
        let f = fixture();
        let ([mut a, mut b], mut checkpointed, sink) = unaligned_gate(&f, 40);
        let mut send_unaligned = || {
            a.broadcast_event(&barrier(7, Alignment::Unaligned), true)
                .unwrap()
        };
        let send_aligned = |b: &mut ResultPartition| {
            b.broadcast_event(&barrier(7, Alignment::ForcedAligned), false)
                .unwrap();
            // Data after the aligned barrier: readable only once its channel resumes.
            send(b, b"after");
        };
        if aligned_first {
            send_aligned(&mut b);
            assert!(
                checkpointed.poll_next().unwrap().is_none(),
                "an aligned barrier aligns: nothing comes out yet"
            );
            assert_eq!(checkpointed.pending_checkpoint(), Some(7));
        }
        send_unaligned();
        let first = next_item(&mut checkpointed);
        assert_eq!(
            event(&first.item),
            &barrier(7, Alignment::Unaligned),
            "the unaligned barrier triggers the checkpoint"
        );
        if !aligned_first {
            assert_eq!(checkpointed.pending_checkpoint(), Some(7));
            send_aligned(&mut b);
        }
        let after = next_item(&mut checkpointed);
        assert_eq!(
            (after.channel, data(&after.item)),
            (1, common::framed_record(b"after")),
            "aligned first: {aligned_first}; the checkpoint completed and the channel resumed"
        );
        assert_eq!(checkpointed.pending_checkpoint(), None);
        assert_eq!(*sink.complete.lock().unwrap(), vec![7]);
        assert!(
            checkpointed.poll_next().unwrap().is_none(),
            "no second barrier"
        );
        drop((first, after, checkpointed, a, b));
        assert!(f.all_segments_back());
    }
}

/// An alignment that turns unaligned keeps the channels it blocked blocked until the
/// checkpoint completes, as Flink's handler does: resumed at the switch, such a channel could
/// bring the next checkpoint's barrier and abort this one.
#[test]
fn an_alignment_turning_unaligned_keeps_its_blocked_channels_until_the_checkpoint_completes() {
    let f = fixture();
    let ([mut a, mut b, mut c], mut checkpointed, sink) = unaligned_gate(&f, 48);
    a.broadcast_event(&barrier(5, Alignment::ForcedAligned), false)
        .unwrap();
    send(&mut a, b"a-after");
    assert!(checkpointed.poll_next().unwrap().is_none(), "5 aligns");
    b.broadcast_event(&barrier(5, Alignment::Unaligned), true)
        .unwrap();
    let triggered = next_item(&mut checkpointed);
    assert_eq!(event(&triggered.item), &barrier(5, Alignment::Unaligned));
    assert!(
        checkpointed.poll_next().unwrap().is_none(),
        "channel 0 stays blocked while channel 2's barrier is missing"
    );
    c.broadcast_event(&barrier(5, Alignment::Unaligned), true)
        .unwrap();
    let after = next_item(&mut checkpointed);
    assert_eq!(
        (after.channel, data(&after.item)),
        (0, common::framed_record(b"a-after"))
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![5]);
    assert!(sink.aborted.lock().unwrap().is_empty());
    drop((triggered, after, checkpointed, a, b, c));
    assert!(f.all_segments_back());
}

/// With unaligned checkpoints on, a checkpoint whose barriers are all aligned ones (a
/// savepoint, say) still aligns: its barrier comes out once every channel delivered it, and
/// no channel state is persisted for it.
#[test]
fn an_all_aligned_checkpoint_aligns_in_unaligned_mode() {
    let f = fixture();
    let ([mut a, mut b], mut checkpointed, sink) = unaligned_gate(&f, 46);
    a.broadcast_event(&barrier(8, Alignment::Aligned), false)
        .unwrap();
    send(&mut a, b"a-after");
    send(&mut b, b"b-before");
    let before = next_item(&mut checkpointed);
    assert_eq!(
        (before.channel, data(&before.item)),
        (1, common::framed_record(b"b-before")),
        "channel 0 is blocked at its barrier; channel 1's data before its barrier comes"
    );
    assert!(checkpointed.poll_next().unwrap().is_none());
    b.broadcast_event(&barrier(8, Alignment::Aligned), false)
        .unwrap();
    let aligned = next_item(&mut checkpointed);
    assert_eq!(event(&aligned.item), &barrier(8, Alignment::Aligned));
    let after = next_item(&mut checkpointed);
    assert_eq!(data(&after.item), common::framed_record(b"a-after"));
    assert!(sink.data.lock().unwrap().is_empty(), "nothing persisted");
    assert!(sink.complete.lock().unwrap().is_empty());
    drop((before, aligned, after, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// The id of `item`, which must be a checkpoint barrier turned unaligned.
fn unaligned_barrier_id(item: &GateItem) -> u64 {
    match event(item) {
        Event::CheckpointBarrier(barrier) if barrier.alignment == Alignment::Unaligned => {
            barrier.id
        }
        other => panic!("an unaligned barrier, got {other:?}"),
    }
}

/// Flink's aligned checkpoint timeout: a checkpoint whose barriers are aligned with a timeout
/// aligns until that long after it started, then turns unaligned. Its barrier comes out as an
/// unaligned one (the task triggers the checkpoint with it and sends it on), the channel
/// blocked so far stays blocked until the checkpoint completes, and the others' data up to
/// their barriers is persisted while the task reads on. Before, it stayed aligned for good.
#[test]
fn an_alignment_past_its_timeout_turns_unaligned() {
    let f = fixture();
    let ([mut a, mut b, mut c], mut checkpointed, sink) = unaligned_gate(&f, 60);
    // A 200 ms timeout: the gate takes `a`'s barrier in place at once (so `a`'s own timer
    // finds nothing to turn), then waits for the others past the timeout.
    let late = common::timeoutable_barrier(9, 200, 0);
    a.broadcast_event(&late, false).unwrap();
    let triggered = next_item(&mut checkpointed);
    assert_eq!(unaligned_barrier_id(&triggered.item), 9);
    assert_eq!(checkpointed.blocked_channels(), &[0]);
    send(&mut a, b"a-after");
    send(&mut b, b"b-before");
    let before = next_item(&mut checkpointed);
    assert_eq!(
        (before.channel, data(&before.item)),
        (1, common::framed_record(b"b-before"))
    );
    assert_eq!(
        *sink.data.lock().unwrap(),
        vec![(9, 1, common::framed_record(b"b-before"))],
        "channel 1's data before its barrier is channel state"
    );
    assert!(
        checkpointed.poll_next().unwrap().is_none(),
        "channel 0 stays blocked while barriers are missing"
    );
    b.broadcast_event(&late, false).unwrap();
    c.broadcast_event(&late, false).unwrap();
    let after = next_item(&mut checkpointed);
    assert_eq!(
        (after.channel, data(&after.item)),
        (0, common::framed_record(b"a-after"))
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![9]);
    assert_eq!(checkpointed.pending_checkpoint(), None);
    drop((triggered, before, after, checkpointed, a, b, c));
    assert!(f.all_segments_back());
}

/// A checkpoint aligned with a timeout that completes its alignment within the timeout stays
/// aligned: its barrier comes out as sent, and nothing is persisted.
#[test]
fn an_alignment_within_its_timeout_stays_aligned() {
    let f = fixture();
    let ([mut a, mut b], mut checkpointed, sink) = unaligned_gate(&f, 64);
    let barrier = common::timeoutable_barrier(3, 3_600_000, 0);
    a.broadcast_event(&barrier, false).unwrap();
    send(&mut b, b"b-before");
    let before = next_item(&mut checkpointed);
    assert_eq!(before.channel, 1);
    assert!(
        checkpointed.alignment_deadline().is_some(),
        "the alignment runs against its timeout"
    );
    b.broadcast_event(&barrier, false).unwrap();
    let aligned = next_item(&mut checkpointed);
    assert_eq!(event(&aligned.item), &barrier);
    assert_eq!(checkpointed.alignment_deadline(), None);
    assert!(sink.data.lock().unwrap().is_empty(), "nothing persisted");
    assert!(sink.complete.lock().unwrap().is_empty());
    drop((before, aligned, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// A blocking read waiting on channels that send nothing wakes when the alignment's timeout
/// passes, and returns the barrier turned unaligned (it waited until its own deadline before).
#[test]
fn a_blocking_read_wakes_for_the_alignment_timeout() {
    let f = fixture();
    let ([mut a, b], mut checkpointed, _sink) = unaligned_gate(&f, 66);
    a.broadcast_event(&common::timeoutable_barrier(4, 50, 0), false)
        .unwrap();
    // The caller's own deadline ends such a read too (and turns the alignment then): the
    // read must come back before it, at the alignment's.
    let deadline = Instant::now() + LONG;
    let triggered = checkpointed
        .next_until(Some(deadline))
        .expect("no error")
        .expect("an item");
    assert!(
        Instant::now() < deadline,
        "woken only by the caller's deadline"
    );
    assert_eq!(unaligned_barrier_id(&triggered.item), 4);
    drop((triggered, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// An async read of a checkpointed gate waiting on channels that send nothing is woken at
/// the alignment's timeout (a timer: nothing else would wake the future) and returns the
/// barrier turned unaligned.
#[test]
fn an_async_read_wakes_for_the_alignment_timeout() {
    let f = fixture();
    let ([mut a, b], mut checkpointed, _sink) = unaligned_gate(&f, 72);
    a.broadcast_event(&common::timeoutable_barrier(5, 1_000, 0), false)
        .unwrap();
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let mut read = Box::pin(checkpointed.next_async());
    // A second: the first poll comes well within it even on a loaded machine.
    assert!(
        read.as_mut().poll(&mut cx).is_pending(),
        "aligning, within the timeout"
    );
    // Bounded by LONG in all: each park ends at a wake-up or at the give-up time.
    let give_up = Instant::now() + LONG;
    while let Some(left) = give_up.checked_duration_since(Instant::now()) {
        thread::park_timeout(left);
        if waker_state.1.load(Ordering::SeqCst) == 0 {
            continue; // a spurious unpark
        }
        let Poll::Ready(result) = read.as_mut().poll(&mut cx) else {
            continue;
        };
        let triggered = result.unwrap().unwrap();
        assert_eq!(unaligned_barrier_id(&triggered.item), 5);
        drop((triggered, read));
        drop((checkpointed, a, b));
        assert!(f.all_segments_back());
        return;
    }
    panic!("the async read was never woken for the alignment's timeout");
}

/// An async read polled last by another task (its waker changed: the future moved between
/// tasks) is woken at the alignment's timeout through that task's waker, not the first's.
#[test]
fn an_async_read_moved_to_another_task_is_woken_there_at_the_alignment_timeout() {
    let f = fixture();
    let ([mut a, b], mut checkpointed, _sink) = unaligned_gate(&f, 76);
    a.broadcast_event(&common::timeoutable_barrier(6, 1_000, 0), false)
        .unwrap();
    let first = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let second = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let mut read = Box::pin(checkpointed.next_async());
    let first_waker = Waker::from(first.clone());
    assert!(read
        .as_mut()
        .poll(&mut Context::from_waker(&first_waker))
        .is_pending());
    let second_waker = Waker::from(second.clone());
    let mut cx = Context::from_waker(&second_waker);
    assert!(read.as_mut().poll(&mut cx).is_pending());
    // Bounded by LONG in all: each park ends at a wake-up or at the give-up time.
    let give_up = Instant::now() + LONG;
    while let Some(left) = give_up.checked_duration_since(Instant::now()) {
        thread::park_timeout(left);
        if second.1.load(Ordering::SeqCst) == 0 {
            continue; // not (yet) the task that polled last
        }
        if let Poll::Ready(result) = read.as_mut().poll(&mut cx) {
            let triggered = result.unwrap().unwrap();
            assert_eq!(unaligned_barrier_id(&triggered.item), 6);
            drop((triggered, read));
            drop((checkpointed, a, b));
            assert!(f.all_segments_back());
            return;
        }
    }
    panic!("the task that polled last was never woken for the alignment's timeout");
}

/// An async read of a union is woken by data any member's producer flushes from another
/// thread.
#[test]
fn an_async_union_read_resolves_when_a_member_s_producer_flushes() {
    let f = fixture();
    let mut b = f.producer(75, 1);
    let mut g0 = f.gate(&[(74, 0)], ChannelLocation::Local);
    let mut g1 = f.gate(&[(75, 0)], ChannelLocation::Local);
    let a = f.producer(74, 1);
    g0.request_partitions(Instant::now()).unwrap();
    g1.request_partitions(Instant::now()).unwrap();
    let mut union = UnionInputGate::new(vec![g0, g1]);
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let mut read = Box::pin(union.next_async());
    assert!(read.as_mut().poll(&mut cx).is_pending());
    thread::scope(|s| {
        // The producer stays alive until the read resolved: dropped unfinished, it would
        // release its partition.
        let _producer_thread = s.spawn(move || {
            send(&mut b, b"union-async");
            b
        });
        // Bounded by LONG in all: each park ends at a wake-up or at the give-up time.
        let give_up = Instant::now() + LONG;
        loop {
            if let Poll::Ready(result) = read.as_mut().poll(&mut cx) {
                let item = result.unwrap().unwrap();
                assert_eq!(
                    (item.channel, data(&item.item)),
                    (1, common::framed_record(b"union-async"))
                );
                return;
            }
            let Some(left) = give_up.checked_duration_since(Instant::now()) else {
                panic!("the async union read never resolved");
            };
            thread::park_timeout(left);
        }
    });
    assert!(
        waker_state.1.load(Ordering::SeqCst) >= 1,
        "woken, not polled blindly"
    );
    drop(read);
    drop((union, a));
    assert!(f.all_segments_back());
}

/// A task that reads without blocking, from its own loop, hears of the alignment timeout
/// through `handle_timeout` at the deadline the gate names.
#[test]
fn handle_timeout_turns_a_timed_out_alignment_for_a_polling_task() {
    let f = fixture();
    let ([mut a, b], mut checkpointed, _sink) = unaligned_gate(&f, 68);
    a.broadcast_event(&common::timeoutable_barrier(2, 3_600_000, 0), false)
        .unwrap();
    assert!(checkpointed
        .next_until(Some(Instant::now() + Duration::from_millis(1)))
        .is_err_and(|e| e == GateError::TimedOut));
    let deadline = checkpointed
        .alignment_deadline()
        .expect("the alignment runs against its timeout");
    checkpointed.handle_timeout(deadline).unwrap();
    let triggered = checkpointed.poll_next().unwrap().expect("the barrier");
    assert_eq!(unaligned_barrier_id(&triggered.item), 2);
    drop((triggered, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// EndOfChannelState (an upstream finished sending recovered channel state) blocks its
/// channel until every channel got there, or ended; then all resume, as Flink's
/// `UpstreamRecoveryTracker` resumes them. (Nothing resumed them before: the gate stalled.)
#[test]
fn channels_blocked_by_end_of_channel_state_resume_once_all_recovered() {
    let f = fixture();
    let ([mut a, mut b, mut c], mut checkpointed, _sink) = unaligned_gate(&f, 70);
    for (producer, name) in [(&mut a, &b"a-new"[..]), (&mut b, &b"b-new"[..])] {
        producer
            .broadcast_event(&Event::EndOfChannelState, false)
            .unwrap();
        producer.emit_record(name, 0).unwrap();
        producer.flush(0);
    }
    let mut events = Vec::new();
    for _ in 0..2 {
        let item = next_item(&mut checkpointed);
        events.push((item.channel, event(&item.item).clone()));
    }
    events.sort_by_key(|(channel, _)| *channel);
    assert_eq!(
        events,
        [(0, Event::EndOfChannelState), (1, Event::EndOfChannelState)]
    );
    assert!(
        checkpointed.poll_next().unwrap().is_none(),
        "blocked while channel 2 is still recovering"
    );
    // The last one ends instead of recovering: the others resume.
    c.finish().unwrap();
    let mut data_seen = Vec::new();
    while data_seen.len() < 2 {
        let item = next_item(&mut checkpointed);
        if let GateItem::Buffer(buffer) = &item.item {
            data_seen.push(buffer.as_slice().to_vec());
        }
    }
    data_seen.sort();
    assert_eq!(
        data_seen,
        [
            common::framed_record(b"a-new"),
            common::framed_record(b"b-new")
        ]
    );
    drop((checkpointed, a, b, c));
    assert!(f.all_segments_back());
}

/// A newer barrier aborts the checkpoint running: the task hears of it as a
/// CancelCheckpointMarker first (Flink's handler tells the task, which declines it and sends
/// the marker on), and the channel-state sink is told to drop what it holds of it.
#[test]
fn a_checkpoint_a_newer_barrier_aborts_is_announced_to_the_task_and_the_sink() {
    let f = fixture();
    let ([mut a, mut b], mut checkpointed, sink) = unaligned_gate(&f, 42);
    a.broadcast_event(&barrier(6, Alignment::Unaligned), true)
        .unwrap();
    let six = next_item(&mut checkpointed);
    assert_eq!(event(&six.item), &barrier(6, Alignment::Unaligned));
    b.broadcast_event(&barrier(7, Alignment::Unaligned), true)
        .unwrap();
    let notice = next_item(&mut checkpointed);
    assert_eq!(
        (notice.channel, event(&notice.item)),
        (1, &Event::CancelCheckpointMarker(6))
    );
    let seven = next_item(&mut checkpointed);
    assert_eq!(event(&seven.item), &barrier(7, Alignment::Unaligned));
    assert_eq!(*sink.aborted.lock().unwrap(), vec![6]);
    assert_eq!(checkpointed.pending_checkpoint(), Some(7));
    drop((six, notice, seven, checkpointed, a, b));
    assert!(f.all_segments_back());
}

/// A task that goes away in the middle of an unaligned checkpoint: its sink hears the
/// checkpoint aborted, so it lets go of the in-flight buffers it holds (their segments are
/// the gate's).
#[test]
fn a_gate_dropped_mid_unaligned_checkpoint_aborts_it_at_the_sink() {
    let f = fixture();
    let ([mut a, b], mut checkpointed, sink) = unaligned_gate(&f, 62);
    a.broadcast_event(&barrier(5, Alignment::Unaligned), true)
        .unwrap();
    let five = next_item(&mut checkpointed);
    assert_eq!(event(&five.item), &barrier(5, Alignment::Unaligned));
    assert_eq!(checkpointed.pending_checkpoint(), Some(5));
    drop(checkpointed);
    assert_eq!(*sink.aborted.lock().unwrap(), vec![5]);
    drop((five, a, b));
    assert!(f.all_segments_back());
}

/// A record the task's reader holds half-read when an unaligned checkpoint starts is channel
/// state too (Flink persists each deserializer's unconsumed bytes): the channel's state, read
/// back in order, gives the record whole. Before, its first part was in neither the persisted
/// buffers nor the task's processed input.
#[test]
fn an_unaligned_checkpoint_persists_the_record_a_reader_holds_half_read() {
    let f = fixture();
    let ([mut a, mut b], checkpointed, sink) = unaligned_gate(&f, 44);
    let mut reader = RecordReader::new(checkpointed, 1 << 20);
    // Spans two 4 KiB segments; only the first is finished (readable) before the barrier.
    let record: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    a.emit_record(&record[..], 0).unwrap();
    assert!(
        reader.poll_next().unwrap().is_none(),
        "half a record is no record"
    );
    b.broadcast_event(&barrier(9, Alignment::Unaligned), true)
        .unwrap();
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Event { event, .. }) => {
            assert_eq!(event, barrier(9, Alignment::Unaligned))
        }
        other => panic!("expected the barrier, got {other:?}"),
    }
    // The rest of the record, then channel 0's barrier.
    a.flush(0);
    a.broadcast_event(&barrier(9, Alignment::Unaligned), true)
        .unwrap();
    let mut read = None;
    for _ in 0..4 {
        match reader.next_timeout(LONG).unwrap() {
            Some(ReaderItem::Record { bytes, .. }) => read = Some(bytes.to_vec()),
            Some(ReaderItem::Event { .. }) => {}
            None => break,
        }
        if read.is_some() {
            break;
        }
    }
    assert_eq!(
        read.as_deref(),
        Some(&record[..]),
        "the task reads it whole"
    );
    // Restoring channel 0's state gives the same record.
    let state = sink.channel_state(9, 0);
    assert_eq!(state, common::framed_record(&record));
    drop((reader, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn a_zero_initial_backoff_allows_no_retry_instead_of_retrying_at_once_forever() {
    let mut zero = Backoff::new(Duration::ZERO, Duration::from_millis(10));
    assert!(!zero.increase());
    let mut doubling = Backoff::new(Duration::from_millis(2), Duration::from_millis(8));
    let delays: Vec<_> = std::iter::from_fn(|| doubling.increase().then(|| doubling.current()))
        .take(10)
        .collect();
    assert_eq!(
        delays,
        [2, 4, 8].map(Duration::from_millis),
        "doubling up to the maximum, then no more"
    );
}

#[test]
fn closing_a_gate_ends_its_wait_for_exclusive_segments() {
    // A gate's setup waits for the exclusive segments of a channel that is or may become
    // remote while other pools hold the whole network memory (up to
    // `exclusive-buffers-request-timeout-ms`, 30 s here). A cancelled task closes its gate
    // from another thread: that ends the wait at once.
    let f = fixture();
    let gate = unset_gate(&f, ChannelLocation::Unknown);
    let closer = gate.closer();
    assert_close_ends_the_wait_for_exclusive_segments(&f, gate, closer, SingleInputGate::setup);
}

/// A gate of one channel on partition 2, not set up yet.
fn unset_gate(f: &Fixture, location: ChannelLocation) -> SingleInputGate {
    let specs = vec![ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: pid(2),
            subpartition: 0,
        },
        location,
    }];
    SingleInputGate::new(specs, f.manager.clone(), &f.network, &f.config)
}

/// A channel whose producer is located only later keeps the exclusive segments its gate's
/// setup took for it: the other channels' floating requests cannot fill the gate's pool to its
/// maximum first. It could not wait for them when it turns remote (only its own task's reads,
/// the caller's, free segments), and failed the task with `Insufficient`.
#[test]
fn a_channel_located_later_keeps_its_exclusive_segments_from_the_floating_ones() {
    let f = fixture();
    let specs = [(2, ChannelLocation::Remote), (3, ChannelLocation::Unknown)]
        .into_iter()
        .map(|(n, location)| ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: pid(n),
                subpartition: 0,
            },
            location,
        })
        .collect();
    let mut gate = SingleInputGate::new(specs, f.manager.clone(), &f.network, &f.config);
    gate.setup().unwrap();
    let pool = gate.pool().unwrap().clone();
    // A backlog as long as the gate's floating quota and more: the remote channel takes
    // every floating segment the pool allows.
    let buffers = gate.remote_channel(0).unwrap().shared().buffers().clone();
    buffers.on_sender_backlog(100);
    assert_eq!(pool.requested_segments(), pool.spec().max_segments);
    gate.update_channel(1, ChannelLocation::Remote, Instant::now())
        .expect("the located channel has its exclusive segments");
    assert_eq!(
        gate.remote_channel(1)
            .unwrap()
            .shared()
            .buffers()
            .available(),
        f.config.buffers_per_channel
    );
    drop((buffers, pool));
    gate.close();
    drop(gate);
    assert!(f.all_segments_back());
}

/// A gate closed before its setup fails its setup as closed (the first remote channel's wait
/// for exclusive segments sees the close), and nothing of the network stays taken: a closed
/// gate releases nothing more. (Coverage: a review asked whether that path leaked.)
#[test]
fn a_gate_closed_before_its_setup_takes_no_segments() {
    let f = fixture();
    let specs = vec![ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: pid(2),
            subpartition: 0,
        },
        location: ChannelLocation::Remote,
    }];
    let mut gate = SingleInputGate::new(specs, f.manager.clone(), &f.network, &f.config);
    gate.close();
    assert!(matches!(gate.setup(), Err(GateError::Closed)));
    drop(gate);
    assert!(f.all_segments_back());
}

/// Runs `set_up` (a gate's setup, which takes its floating segment and the exclusive segments
/// of a channel that is or may become remote) on a thread while other pools hold every
/// segment but two, closes through `closer` once the setup took those and so waits for the
/// channel's second, and checks that
/// the wait ended as closed, with every segment back in the end.
fn assert_close_ends_the_wait_for_exclusive_segments<G: Send + 'static>(
    f: &Fixture,
    mut gate: G,
    closer: fluxgate::gate::GateCloser,
    set_up: fn(&mut G) -> Result<(), GateError>,
) {
    assert!(
        f.config.buffers_per_channel >= 2,
        "the wait is for the second"
    );
    let (hog, mut held) = common::hog_every_segment(&f.network);
    let setup = thread::spawn(move || {
        let result = set_up(&mut gate);
        (gate, result)
    });
    // Two segments back: the setup takes them (the gate's floating segment and the
    // channel's first exclusive one) and waits for the next, holding one of the channel's.
    drop((held.pop(), held.pop()));
    assert!(
        common::wait_until(LONG, || f.network.available_segments() == 0),
        "the setup never took the segments given back"
    );
    closer.close();
    let (gate, result) = setup.join().unwrap();
    assert!(
        matches!(result, Err(GateError::Closed)),
        "the wait ended with {result:?}, not as closed"
    );
    drop((gate, held, hog));
    assert!(f.all_segments_back());
}

#[test]
fn a_union_of_a_gate_closed_before_it_reports_the_close() {
    // The member was closed before the union existed, so its close could not queue it at the
    // union: the union still reads it once, and its read reports the close instead of the
    // union waiting for good.
    let f = fixture();
    let producer = f.producer(1, 1);
    let member = f.gate(&[(1, 0)], ChannelLocation::Local);
    member.closer().close();
    let mut union = UnionInputGate::new(vec![member]);
    assert!(matches!(union.next_timeout(LONG), Err(GateError::Closed)));
    drop((union, producer));
    assert!(f.all_segments_back());
}

#[test]
fn a_union_closer_ends_a_members_wait_for_exclusive_segments() {
    // Cancelling the task closes the union, which closes its members too: a member's setup
    // stops waiting for exclusive segments other pools hold.
    let f = fixture();
    let union = UnionInputGate::new(vec![unset_gate(&f, ChannelLocation::Unknown)]);
    let closer = union.closer();
    assert_close_ends_the_wait_for_exclusive_segments(&f, union, closer, |union| {
        union.gates_mut()[0].setup()
    });
}

#[test]
fn a_union_names_a_members_failed_channel_in_its_own_numbering() {
    let f = fixture();
    let a = f.producer(14, 2);
    let b = f.producer(15, 1);
    let mut g0 = f.gate(&[(14, 0), (14, 1)], ChannelLocation::Local);
    let mut g1 = f.gate(&[(15, 0)], ChannelLocation::Local);
    g0.request_partitions(Instant::now()).unwrap();
    g1.request_partitions(Instant::now()).unwrap();
    let mut union = UnionInputGate::new(vec![g0, g1]);
    // The producer of the second gate's only channel, union channel 2, goes away.
    b.handle().release();
    let error = union.next_timeout(LONG).unwrap_err();
    assert!(
        matches!(error, GateError::Partition { channel: 2, .. }),
        "{error:?}"
    );
    drop((union, a, b));
    assert!(f.all_segments_back());
}

#[test]
fn task_events_sent_before_the_partition_exists_reach_it_once_found() {
    // Sent before setup, and while the local channel's request waits for its partition to
    // register: both reach the producer, in order, once the retried request finds it (they
    // were dropped; Flink refuses such a send instead).
    let f = fixture();
    let spec = ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: pid(16),
            subpartition: 0,
        },
        location: ChannelLocation::Local,
    };
    let mut gate =
        SingleInputGate::new(vec![spec], f.manager.clone(), &f.network, &f.config).with_backoff(
            Backoff::new(Duration::from_millis(100), Duration::from_millis(400)),
        );
    gate.send_task_event(&Event::Task(b"before setup".to_vec()))
        .unwrap();
    gate.setup().unwrap();
    let start = Instant::now();
    gate.request_partitions(start).unwrap();
    gate.send_task_event(&Event::Task(b"while missing".to_vec()))
        .unwrap();
    let producer = f.producer(16, 1);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    f.manager.subscribe_task_events(pid(16), events.clone());
    assert!(events.0.lock().unwrap().is_empty());
    gate.handle_timeout(start + Duration::from_millis(100))
        .unwrap();
    assert_eq!(
        *events.0.lock().unwrap(),
        [
            Event::Task(b"before setup".to_vec()),
            Event::Task(b"while missing".to_vec())
        ]
    );
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn task_events_beyond_what_a_channel_holds_for_a_missing_partition_are_refused() {
    // A channel keeps 1024 events for a partition not found yet. The next was dropped for it
    // (logged) while the send said it went out; now the send is refused, for every channel.
    let f = fixture();
    let spec = ChannelSpec {
        consumed: ConsumedSubpartition {
            partition: pid(17),
            subpartition: 0,
        },
        location: ChannelLocation::Local,
    };
    let mut gate =
        SingleInputGate::new(vec![spec], f.manager.clone(), &f.network, &f.config).with_backoff(
            Backoff::new(Duration::from_millis(100), Duration::from_millis(400)),
        );
    gate.setup().unwrap();
    let start = Instant::now();
    gate.request_partitions(start).unwrap();
    for n in 0..1024u32 {
        gate.send_task_event(&Event::Task(n.to_be_bytes().to_vec()))
            .unwrap();
    }
    assert!(matches!(
        gate.send_task_event(&Event::Task(b"one more".to_vec())),
        Err(GateError::TaskEventBacklog { channel: Some(0) })
    ));
    let producer = f.producer(17, 1);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    f.manager.subscribe_task_events(pid(17), events.clone());
    gate.handle_timeout(start + Duration::from_millis(100))
        .unwrap();
    assert_eq!(events.0.lock().unwrap().len(), 1024);
    gate.send_task_event(&Event::Task(b"after".to_vec()))
        .unwrap();
    assert_eq!(
        events.0.lock().unwrap().last(),
        Some(&Event::Task(b"after".to_vec()))
    );
    drop((gate, producer));
    assert!(f.all_segments_back());
}

#[test]
fn a_released_partition_s_local_reader_gives_back_the_buffer_its_writer_waits_for() {
    // With one buffer per subpartition, the writer waits for the buffer the local channel is
    // reading. Its consumer's next read reports the release and lets go of that buffer, so
    // the writer fails with Released instead of waiting until the gate closes.
    let f = fixture();
    let mut config = f.config.clone();
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let mut partition = ResultPartition::new(pid(17), 1, &f.network, &config).unwrap();
    f.manager.register(partition.handle()).unwrap();
    let handle = partition.handle();
    let mut gate = f.gate(&[(17, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    send(&mut partition, b"partly read");
    drop(
        gate.next_timeout(LONG)
            .unwrap()
            .expect("the flushed record"),
    );
    // More than the rest of the buffer: the writer needs the next one.
    let (writer, done_rx) = common::writer_until_failure(partition);
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the writer never waited"
    );
    handle.release();
    assert!(matches!(
        gate.poll_next(),
        Err(GateError::Partition { channel: 0, .. })
    ));
    let result = done_rx.recv_timeout(LONG).expect("the writer still waits");
    assert!(
        matches!(result, Err(PartitionError::Released)),
        "{result:?}"
    );
    drop((writer.join().unwrap(), gate));
    assert!(f.all_segments_back());
}

/// Reads every item `downstream` has now, dropping them (their segments go back).
fn drain(downstream: &mut SingleInputGate) -> usize {
    let mut items = 0;
    while let Some(item) = downstream.poll_next().unwrap() {
        drop(item);
        items += 1;
    }
    items
}

/// Flink's task reads no input while its output is unavailable, but still takes priority
/// events: an unaligned barrier reaches a back-pressured task at once, not after the
/// consumer downstream frees a buffer, and goes on ahead of the output's queued data. The
/// data the barrier overtook is read (and persisted) once the output takes records again.
#[test]
fn a_back_pressured_task_takes_an_unaligned_barrier_and_no_data() {
    let f = fixture();
    let ([mut upstream], mut input, sink) = unaligned_gate::<1>(&f, 60);
    let mut output = f.producer(62, 1);
    let mut downstream = f.gate(&[(62, 0)], ChannelLocation::Local);
    downstream.request_partitions(Instant::now()).unwrap();
    common::back_pressure(&mut output);
    send(&mut upstream, b"in-flight");
    upstream
        .broadcast_event(&barrier(9, Alignment::Unaligned), true)
        .unwrap();

    match input
        .wait_for_output(&mut output, Some(Instant::now() + LONG))
        .unwrap()
    {
        OutputWait::Event(item) => {
            assert_eq!(event(&item.item), &barrier(9, Alignment::Unaligned));
        }
        OutputWait::Available => panic!("the output was available"),
    }
    assert!(!output.is_available(), "still back-pressured");
    assert_eq!(
        input.pending_checkpoint(),
        Some(9),
        "the checkpoint started"
    );
    // Sent on without waiting for memory, ahead of the output's queued data.
    output
        .broadcast_event(&barrier(9, Alignment::Unaligned), true)
        .unwrap();
    let first = downstream.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(event(&first.item), &barrier(9, Alignment::Unaligned));
    drop(first);
    // No data is read while the output stays back-pressured.
    assert_eq!(
        input
            .wait_for_output(
                &mut output,
                Some(Instant::now() + Duration::from_millis(20))
            )
            .unwrap_err(),
        GateError::TimedOut
    );
    assert!(sink.data.lock().unwrap().is_empty());

    assert!(drain(&mut downstream) > 0);
    assert!(matches!(
        input
            .wait_for_output(&mut output, Some(Instant::now() + LONG))
            .unwrap(),
        OutputWait::Available
    ));
    let item = next_item(&mut input);
    assert_eq!(data(&item.item), common::framed_record(b"in-flight"));
    assert_eq!(
        *sink.data.lock().unwrap(),
        vec![(9, 0, common::framed_record(b"in-flight"))]
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![9]);
    drop((item, input, upstream, output, downstream));
    assert!(f.all_segments_back());
}

/// A task already waiting for its output (through a union) is woken by a priority barrier
/// queued later, then by the consumer downstream freeing buffers.
#[test]
fn a_task_waiting_for_its_output_wakes_for_a_barrier_then_for_room() {
    let f = fixture();
    let mut a = f.producer(63, 1);
    let mut b = f.producer(64, 1);
    let mut g0 = f.gate(&[(63, 0)], ChannelLocation::Local);
    let mut g1 = f.gate(&[(64, 0)], ChannelLocation::Local);
    g0.request_partitions(Instant::now()).unwrap();
    g1.request_partitions(Instant::now()).unwrap();
    let union = UnionInputGate::new(vec![g0, g1]);
    let mut input = CheckpointedInputGate::new(union, AlignmentMode::Unaligned, None);
    let mut output = f.producer(65, 1);
    let mut downstream = f.gate(&[(65, 0)], ChannelLocation::Local);
    downstream.request_partitions(Instant::now()).unwrap();
    common::back_pressure(&mut output);
    // Data on both members, which the waiting task must leave alone.
    send(&mut a, b"a-data");
    send(&mut b, b"b-data");
    let handle = output.handle();
    let (told, seen) = std::sync::mpsc::channel();
    let task = thread::spawn(move || {
        let mut waits = Vec::new();
        for _ in 0..2 {
            let waited = input.wait_for_output(&mut output, Some(Instant::now() + LONG));
            let waited = match waited.unwrap() {
                OutputWait::Event(item) => Some((item.channel, event(&item.item).clone())),
                OutputWait::Available => None,
            };
            told.send(()).unwrap();
            waits.push(waited);
        }
        let mut rest = Vec::new();
        while let Some(item) = input.poll_next().unwrap() {
            rest.push((item.channel, data(&item.item)));
        }
        (waits, rest, input, output)
    });
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the task waits for its output"
    );
    b.broadcast_event(&barrier(3, Alignment::Unaligned), true)
        .unwrap();
    seen.recv_timeout(LONG).expect("woken by the barrier");
    assert!(drain(&mut downstream) > 0);
    let (waits, mut rest, input, output) = task.join().unwrap();
    assert_eq!(
        waits,
        vec![Some((1, barrier(3, Alignment::Unaligned))), None],
        "first the barrier (union channel 1), then room"
    );
    rest.sort();
    assert_eq!(
        rest,
        vec![
            (0, common::framed_record(b"a-data")),
            (1, common::framed_record(b"b-data"))
        ]
    );
    drop((input, a, b, output, downstream));
    assert!(f.all_segments_back());
}

/// The async wait registers at both ends before it goes pending: a priority barrier queued
/// afterwards wakes it, and so does a segment freed downstream (each wake-up counted, with
/// no time involved).
#[test]
fn the_async_wait_for_output_is_woken_by_a_barrier_and_by_room() {
    let f = fixture();
    let ([mut upstream], mut input, _sink) = unaligned_gate::<1>(&f, 66);
    let mut output = f.producer(68, 1);
    let mut downstream = f.gate(&[(68, 0)], ChannelLocation::Local);
    downstream.request_partitions(Instant::now()).unwrap();
    common::back_pressure(&mut output);
    send(&mut upstream, b"data");
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let woken = || waker_state.1.load(Ordering::SeqCst);

    let mut wait = Box::pin(input.wait_for_output_async(&mut output));
    assert!(wait.as_mut().poll(&mut cx).is_pending(), "data is not read");
    let before = woken();
    upstream
        .broadcast_event(&barrier(5, Alignment::Unaligned), true)
        .unwrap();
    assert!(woken() > before, "the barrier woke the wait");
    match wait.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(OutputWait::Event(item))) => {
            assert_eq!(event(&item.item), &barrier(5, Alignment::Unaligned));
        }
        other => panic!("expected the barrier, got {other:?}"),
    }
    drop(wait);

    let mut wait = Box::pin(input.wait_for_output_async(&mut output));
    assert!(wait.as_mut().poll(&mut cx).is_pending());
    let before = woken();
    assert!(drain(&mut downstream) > 0);
    assert!(woken() > before, "freed segments woke the wait");
    assert!(matches!(
        wait.as_mut().poll(&mut cx),
        Poll::Ready(Ok(OutputWait::Available))
    ));
    drop(wait);
    let item = next_item(&mut input);
    assert_eq!(data(&item.item), common::framed_record(b"data"));
    drop((item, input, upstream, output, downstream));
    assert!(f.all_segments_back());
}

/// Flink's task waits for all of its writers together (`RecordWriterDelegate`): the wait
/// for several outputs hands out the barrier that comes while one is back-pressured, and
/// after the task handled it (here, with writes that filled the other output again) it
/// waits for that one too, whichever of the two it is; it ends only at a look at which
/// both take records. Each wake-up is counted, with no time involved.
#[test]
fn a_task_with_two_outputs_waits_until_both_take_records_at_one_look() {
    let f = fixture();
    let ([mut upstream], mut input, _sink) = unaligned_gate::<1>(&f, 300);
    let mut first = f.producer(301, 1);
    let mut second = f.producer(302, 1);
    let mut first_downstream = f.gate(&[(301, 0)], ChannelLocation::Local);
    let mut second_downstream = f.gate(&[(302, 0)], ChannelLocation::Local);
    first_downstream.request_partitions(Instant::now()).unwrap();
    second_downstream
        .request_partitions(Instant::now())
        .unwrap();
    common::back_pressure(&mut second);
    send(&mut upstream, b"data");
    let waker_state = Arc::new(ThreadWaker(thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(waker_state.clone());
    let mut cx = Context::from_waker(&waker);
    let woken = || waker_state.1.load(Ordering::SeqCst);

    {
        let mut outputs = [&mut first, &mut second];
        let mut wait = Box::pin(input.wait_for_outputs_async(&mut outputs));
        assert!(
            wait.as_mut().poll(&mut cx).is_pending(),
            "the second output is back-pressured, though the first takes records"
        );
        let before = woken();
        upstream
            .broadcast_event(&barrier(5, Alignment::Unaligned), true)
            .unwrap();
        assert!(woken() > before, "the barrier woke the wait");
        match wait.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(OutputWait::Event(item))) => {
                assert_eq!(event(&item.item), &barrier(5, Alignment::Unaligned));
            }
            other => panic!("expected the barrier, got {other:?}"),
        }
    }
    // Handling the barrier filled the first output; the second got room meanwhile.
    common::back_pressure(&mut first);
    assert!(drain(&mut second_downstream) > 0);
    assert!(second.is_available());
    {
        let mut outputs = [&mut first, &mut second];
        let mut wait = Box::pin(input.wait_for_outputs_async(&mut outputs));
        assert!(
            wait.as_mut().poll(&mut cx).is_pending(),
            "the first output is back-pressured now"
        );
        let before = woken();
        assert!(drain(&mut first_downstream) > 0);
        assert!(woken() > before, "room in the first output woke the wait");
        assert!(matches!(
            wait.as_mut().poll(&mut cx),
            Poll::Ready(Ok(OutputWait::Available))
        ));
    }
    assert!(first.is_available() && second.is_available());
    let item = next_item(&mut input);
    assert_eq!(data(&item.item), common::framed_record(b"data"));
    drop((item, input, upstream, first, second));
    drop((first_downstream, second_downstream));
    assert!(f.all_segments_back());
}

/// The blocking wait for several outputs, through a record reader: it returns once every
/// output takes records, not when the first of them does.
#[test]
fn a_record_reader_waits_for_all_its_outputs_before_it_reads_on() {
    let f = fixture();
    let ([mut upstream], input, _sink) = unaligned_gate::<1>(&f, 303);
    let first = f.producer(304, 1);
    let mut second = f.producer(305, 1);
    let mut second_downstream = f.gate(&[(305, 0)], ChannelLocation::Local);
    second_downstream
        .request_partitions(Instant::now())
        .unwrap();
    common::back_pressure(&mut second);
    send(&mut upstream, b"data");
    let second_handle = second.handle();
    let task = thread::spawn(move || {
        let mut reader = RecordReader::new(input, 1 << 16);
        let mut outputs = [first, second];
        let waited = reader
            .wait_for_outputs(&mut outputs, Some(Instant::now() + LONG))
            .map(|item| item.is_none());
        let all_available = outputs.iter().all(ResultPartition::is_available);
        let record = match reader.next() {
            Ok(Some(ReaderItem::Record { bytes, .. })) => bytes.to_vec(),
            other => panic!("expected the record, got {other:?}"),
        };
        drop(reader);
        (waited, all_available, record, outputs)
    });
    assert!(
        common::wait_until(LONG, || second_handle.is_back_pressured()),
        "the task waits for its second output"
    );
    assert!(drain(&mut second_downstream) > 0);
    let (waited, all_available, record, outputs) = task.join().unwrap();
    assert!(waited.expect("no error"), "room, not an event");
    assert!(
        all_available,
        "both outputs took records when the wait ended"
    );
    assert_eq!(record, b"data");
    drop((upstream, outputs, second_downstream));
    assert!(f.all_segments_back());
}

/// Flink's `unavailableSubpartitionsCount`: one subpartition holding `max-buffers-per-channel`
/// segments makes the output unavailable although its pool has segments free (the task's
/// next record may go there), and a segment its reader frees makes it available again.
#[test]
fn one_subpartition_at_its_limit_makes_the_output_unavailable() {
    let f = fixture();
    let limit = f.config.max_buffers_per_channel;
    let mut output = f.producer(70, 4);
    let mut downstream = f.gate(&[(70, 0)], ChannelLocation::Local);
    downstream.request_partitions(Instant::now()).unwrap();
    let record = [7u8; 1000];
    for _ in 0..10_000 {
        if output.pool().segments_of(0) == limit {
            break;
        }
        assert!(output.is_available(), "subpartition 0 is under its limit");
        output.emit_record(&record[..], 0).unwrap();
    }
    assert_eq!(output.pool().segments_of(0), limit);
    assert!(
        output.pool().is_available(1),
        "another subpartition could take a segment"
    );
    assert!(!output.is_available());
    output.flush_all();
    assert!(drain(&mut downstream) > 0);
    assert!(
        output.is_available(),
        "subpartition 0 is under its limit again"
    );
    drop((output, downstream));
    assert!(f.all_segments_back());
}

/// A record reader takes an unaligned barrier while its output is back-pressured, in the
/// middle of a buffer: the rest of that buffer goes to the sink first as in-flight data
/// (Flink's `getUnconsumedBuffer`), then the data the barrier overtook as it is read; the
/// buffer's records still come out afterwards, in order.
#[test]
fn a_record_reader_takes_a_barrier_mid_buffer_while_its_output_is_back_pressured() {
    let f = fixture();
    let ([mut upstream], input, sink) = unaligned_gate::<1>(&f, 72);
    let mut reader = RecordReader::new(input, 1 << 20);
    let mut output = f.producer(74, 1);
    let mut downstream = f.gate(&[(74, 0)], ChannelLocation::Local);
    downstream.request_partitions(Instant::now()).unwrap();
    for record in [&b"r0"[..], b"r1", b"r2"] {
        upstream.emit_record(record, 0).unwrap();
    }
    upstream.flush(0);
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"r0"),
        other => panic!("expected r0, got {other:?}"),
    }
    common::back_pressure(&mut output);
    send(&mut upstream, b"overtaken");
    upstream
        .broadcast_event(&barrier(6, Alignment::Unaligned), true)
        .unwrap();

    match reader
        .wait_for_output(&mut output, Some(Instant::now() + LONG))
        .unwrap()
    {
        Some(ReaderItem::Event { event, .. }) => {
            assert_eq!(event, barrier(6, Alignment::Unaligned));
        }
        other => panic!("expected the barrier, got {other:?}"),
    }
    let mut rest = common::framed_record(b"r1");
    rest.extend(common::framed_record(b"r2"));
    assert_eq!(*sink.stream.lock().unwrap(), vec![(6, 0, rest)]);

    assert!(drain(&mut downstream) > 0);
    assert!(reader
        .wait_for_output(&mut output, Some(Instant::now() + LONG))
        .unwrap()
        .is_none());
    let mut records = Vec::new();
    while let Some(item) = reader.poll_next().unwrap() {
        match item {
            ReaderItem::Record { bytes, .. } => records.push(bytes.to_vec()),
            other => panic!("expected records, got {other:?}"),
        }
    }
    assert_eq!(records, [&b"r1"[..], b"r2", b"overtaken"]);
    assert_eq!(
        sink.stream.lock().unwrap()[1..],
        [(6, 0, common::framed_record(b"overtaken"))]
    );
    assert_eq!(*sink.complete.lock().unwrap(), vec![6]);
    drop((reader, upstream, output, downstream));
    assert!(f.all_segments_back());
}

/// With `max-buffers-per-channel` 1 a subpartition's one segment is its open buffer, which
/// comes back only once the writer finishes it: it leaves the output available, or a task
/// waiting for its output would wait for good.
#[test]
fn an_open_buffer_at_a_limit_of_one_leaves_the_output_available() {
    let mut f = fixture();
    f.config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let mut output = f.producer(76, 2);
    output.emit_record(&b"r0"[..], 0).unwrap();
    output.emit_record(&b"r1"[..], 1).unwrap();
    assert_eq!(output.pool().segments_of(0), 1);
    assert_eq!(output.pool().segments_of(1), 1);
    assert!(output.is_available());
    let ([upstream], mut input, _sink) = unaligned_gate::<1>(&f, 77);
    assert!(matches!(
        input
            .wait_for_output(&mut output, Some(Instant::now() + LONG))
            .unwrap(),
        OutputWait::Available
    ));
    drop((input, upstream, output));
    assert!(f.all_segments_back());
}

/// FLIP-147: EndOfData goes out once; the gate reports the end of data once every channel
/// delivered it (drained, or stopped when one said not to drain); the producer learns that
/// its consumers processed every record only from each subpartition's acknowledgement, and
/// only then finishes.
#[test]
fn end_of_data_is_acknowledged_per_channel_before_the_producer_finishes() {
    use fluxgate::event::StopMode;
    use fluxgate::gate::EndOfDataStatus;
    for mode in [StopMode::Drain, StopMode::NoDrain] {
        let f = fixture();
        let mut producer = f.producer(80, 2);
        let mut gate = f.gate(&[(80, 0), (80, 1)], ChannelLocation::Local);
        gate.request_partitions(Instant::now()).unwrap();
        producer.emit_record(&b"r0"[..], 0).unwrap();
        producer.emit_record(&b"r1"[..], 1).unwrap();
        producer.notify_end_of_data(mode).unwrap();
        producer.notify_end_of_data(mode).unwrap();
        let mut ends = 0;
        let mut records = 0;
        while ends < 2 {
            let item = gate.next_timeout(LONG).unwrap().unwrap();
            match item.item {
                GateItem::Buffer(_) => records += 1,
                GateItem::Event {
                    event: Event::EndOfData(got),
                    ..
                } => {
                    assert_eq!(got, mode);
                    ends += 1;
                    let expected = match (ends, mode) {
                        (1, _) => EndOfDataStatus::NotEndOfData,
                        (_, StopMode::Drain) => EndOfDataStatus::Drained,
                        (_, StopMode::NoDrain) => EndOfDataStatus::Stopped,
                    };
                    assert_eq!(gate.end_of_data_status(), expected);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(records, 2);
        assert!(
            gate.poll_next().unwrap().is_none(),
            "EndOfData went out once"
        );
        assert!(!producer.is_all_data_processed());
        gate.acknowledge_all_records_processed(0).unwrap();
        assert!(!producer.is_all_data_processed(), "one of two acknowledged");
        assert!(!producer
            .wait_all_data_processed(Some(Instant::now() + Duration::from_millis(10)))
            .unwrap());
        gate.acknowledge_all_records_processed(1).unwrap();
        gate.acknowledge_all_records_processed(1).unwrap();
        assert!(producer
            .wait_all_data_processed(Some(Instant::now() + LONG))
            .unwrap());
        producer.finish().unwrap();
        let mut finished = 0;
        while let Some(item) = gate.next_timeout(LONG).unwrap() {
            assert_eq!(event(&item.item), &Event::EndOfPartition);
            finished += 1;
        }
        assert_eq!(finished, 2);
        drop((gate, producer));
        assert!(f.all_segments_back());
    }
}

/// A consumer that goes away without acknowledging ends the producer's wait with an error,
/// not at its deadline.
#[test]
fn a_consumer_gone_unacknowledged_fails_the_wait_for_its_acknowledgement() {
    let f = fixture();
    let mut producer = f.producer(82, 1);
    let mut gate = f.gate(&[(82, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    producer
        .notify_end_of_data(fluxgate::event::StopMode::Drain)
        .unwrap();
    let end = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(
        event(&end.item),
        &Event::EndOfData(fluxgate::event::StopMode::Drain)
    );
    let closer = gate.closer();
    let waiter = thread::spawn(move || {
        producer
            .wait_all_data_processed(Some(Instant::now() + LONG))
            .map(|done| (done, producer))
    });
    closer.close();
    assert!(matches!(gate.poll_next(), Err(GateError::Closed)));
    drop(gate);
    assert!(matches!(
        waiter.join().unwrap(),
        Err(PartitionError::Released)
    ));
    assert!(f.all_segments_back());
}

/// A checkpointed gate acknowledges a channel's EndOfData as it hands it to the task, as
/// Flink's does: the task has taken every record before it by then.
#[test]
fn a_checkpointed_gate_acknowledges_end_of_data_as_it_hands_it_out() {
    let f = fixture();
    let mut producer = f.producer(84, 1);
    let mut gate = f.gate(&[(84, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let mut reader = RecordReader::new(
        CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None),
        1 << 20,
    );
    producer.emit_record(&b"last"[..], 0).unwrap();
    producer
        .notify_end_of_data(fluxgate::event::StopMode::Drain)
        .unwrap();
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"last"),
        other => panic!("expected the record, got {other:?}"),
    }
    assert!(!producer.is_all_data_processed(), "not read as far yet");
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Event { event, .. }) => {
            assert_eq!(event, Event::EndOfData(fluxgate::event::StopMode::Drain))
        }
        other => panic!("expected EndOfData, got {other:?}"),
    }
    assert!(producer.is_all_data_processed());
    producer.finish().unwrap();
    drop((reader, producer));
    assert!(f.all_segments_back());
}

/// Record `j` of producer `p`: sizes from empty through one-byte and two-byte length prefixes
/// to records spanning several 4 KiB segments, bytes telling producer and record apart.
fn batch_test_record(p: u8, j: usize) -> Vec<u8> {
    const SIZES: [usize; 8] = [5, 0, 127, 128, 300, 9_000, 1, 64];
    let len = SIZES[j % SIZES.len()];
    (0..len)
        .map(|k| p ^ (j as u8).wrapping_add(k as u8))
        .collect()
}

#[test]
fn a_record_reader_s_batches_and_single_reads_give_every_record_once_in_order() {
    const RECORDS: usize = 400;
    let f = fixture();
    let producers = [f.producer(60, 1), f.producer(61, 1)];
    let mut gate = f.gate(&[(60, 0), (61, 0)], ChannelLocation::Local);
    gate.request_partitions(Instant::now()).unwrap();
    let writers: Vec<_> = producers
        .into_iter()
        .enumerate()
        .map(|(p, mut producer)| {
            thread::spawn(move || {
                for j in 0..RECORDS {
                    producer
                        .emit_record(&batch_test_record(p as u8, j)[..], 0)
                        .unwrap();
                    if j % 50 == 49 {
                        // An event ends the buffer a batch reads from.
                        producer
                            .broadcast_event(&Event::Task(vec![j as u8]), false)
                            .unwrap();
                    }
                }
                producer.finish().unwrap();
                producer
            })
        })
        .collect();
    let mut reader = RecordReader::new(gate, f.config.max_record_bytes);
    let mut got: [Vec<Vec<u8>>; 2] = Default::default();
    let mut events: [Vec<u8>; 2] = Default::default();
    let mut batches_taken = 0;
    // Bounded: each read takes a record, an event or a channel's end, and the producers
    // write a bounded number of each.
    for read in 0usize.. {
        let channel = match reader.next_timeout(LONG).unwrap() {
            Some(ReaderItem::Record { channel, bytes }) => {
                got[channel].push(bytes.to_vec());
                channel
            }
            Some(ReaderItem::Event {
                channel,
                event: Event::Task(payload),
            }) => {
                events[channel].extend(payload);
                continue;
            }
            Some(ReaderItem::Event { .. }) => continue,
            None => break,
        };
        // Take none, one, three or all of the batch after the record; the reader's next
        // read goes on where the batch was left.
        let Some(batch) = reader.records_in_buffer() else {
            continue;
        };
        assert_eq!(batch.channel(), channel);
        let take = [0, 1, 3, usize::MAX][read % 4];
        for record in batch.take(take) {
            got[channel].push(record.to_vec());
            batches_taken += 1;
        }
    }
    for (p, writer) in writers.into_iter().enumerate() {
        drop(writer.join().unwrap());
        let sent: Vec<_> = (0..RECORDS)
            .map(|j| batch_test_record(p as u8, j))
            .collect();
        assert!(
            got[p] == sent,
            "channel {p}: records differ from those sent"
        );
        let marks: Vec<u8> = (0..RECORDS)
            .filter(|j| j % 50 == 49)
            .map(|j| j as u8)
            .collect();
        assert_eq!(events[p], marks);
    }
    assert!(batches_taken > 0, "no record came in a batch");
    drop(reader);
    assert!(f.all_segments_back());
}
