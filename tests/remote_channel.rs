//! Remote input channels through the public API: credit-based flow control on the consumer
//! side (exclusive and floating segments, unannounced credit and its announcement), the
//! sequence check, the receive bound, release and priority events. The tests play the
//! transport: they take a segment from the channel, write it, and hand the buffer to
//! `RemoteChannelShared::on_buffer`, then read through the gate.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::buffer::{Buffer, DataType, LocalPoolSpec, NetworkBufferPool, PooledSegment};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    AlignmentMode, BufferOrEvent, ChannelLocation, ChannelSpec, CheckpointedInputGate,
    ConsumedSubpartition, CreditListener, GateError, GateItem, InputGate, ReaderItem, RecordReader,
    RemoteChannelShared, SingleInputGate, UnionInputGate, UNCREDITED_EVENTS,
};
use fluxgate::partition::{PartitionManager, ResultPartitionId};
use fluxgate::NetworkConfig;

/// Bound of every blocking read and wait; never reached when the code is right.
const LONG: Duration = Duration::from_secs(20);

/// `taskmanager.network.memory.buffers-per-channel` (Flink's default, set explicitly below).
const EXCLUSIVE: usize = 2;
/// `taskmanager.network.memory.floating-buffers-per-gate` (Flink's default).
const FLOATING: usize = 8;

struct Fixture {
    network: NetworkBufferPool,
    config: NetworkConfig,
    manager: Arc<PartitionManager>,
}

fn fixture() -> Fixture {
    fixture_with_exclusive(EXCLUSIVE)
}

/// [`fixture`] with `exclusive` buffers per channel.
fn fixture_with_exclusive(exclusive: usize) -> Fixture {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config.set("taskmanager.memory.network.max", "2mb").unwrap();
    config.set("fluxgate.memory.arena-size", "1mb").unwrap();
    config
        .set(
            "taskmanager.network.memory.buffers-per-channel",
            &exclusive.to_string(),
        )
        .unwrap();
    config
        .set(
            "taskmanager.network.memory.floating-buffers-per-gate",
            &FLOATING.to_string(),
        )
        .unwrap();
    Fixture {
        network: NetworkBufferPool::new(&config).unwrap(),
        config,
        manager: Arc::new(PartitionManager::new()),
    }
}

impl Fixture {
    /// A set-up, requested gate of `channels` remote channels (channel `i` consumes
    /// subpartition 0 of partition `i`).
    fn remote_gate(&self, channels: usize) -> SingleInputGate {
        let specs = (0..channels)
            .map(|i| ChannelSpec {
                consumed: ConsumedSubpartition {
                    partition: ResultPartitionId {
                        partition: i as u64,
                        producer: 0,
                    },
                    subpartition: 0,
                },
                location: ChannelLocation::Remote,
            })
            .collect();
        let mut gate =
            SingleInputGate::new(specs, self.manager.clone(), &self.network, &self.config);
        gate.setup().unwrap();
        gate.request_partitions(Instant::now()).unwrap();
        gate
    }

    /// Segments taken out of the global pool right now.
    fn leased(&self) -> usize {
        self.network.total_segments() - self.network.available_segments()
    }
}

/// Counts `on_channel_ready` calls and records the channel each was for.
#[derive(Default)]
struct Announcements {
    calls: AtomicUsize,
    channels: Mutex<Vec<usize>>,
}

impl CreditListener for Announcements {
    fn on_channel_ready(&self, channel: usize) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.channels.lock().unwrap().push(channel);
    }
}

impl Announcements {
    fn count(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn channels(&self) -> Vec<usize> {
        self.channels.lock().unwrap().clone()
    }
}

/// Attaches a fresh counting listener to remote channel `index` and returns the channel's
/// shared half (what the transport holds).
fn attach(gate: &SingleInputGate, index: usize) -> (Arc<RemoteChannelShared>, Arc<Announcements>) {
    let channel = gate.remote_channel(index).expect("a remote channel");
    let announcements = Arc::new(Announcements::default());
    channel.attach(announcements.clone());
    (channel.shared().clone(), announcements)
}

/// Writes `bytes` into `segment` as the transport does when a frame arrives.
fn fill(segment: PooledSegment, bytes: &[u8], data_type: DataType) -> Buffer {
    let mut builder = segment.into_builder(data_type);
    assert_eq!(builder.append_and_commit(bytes), bytes.len());
    let mut consumer = builder.create_consumer_from_beginning();
    let buffer = consumer.build();
    drop(builder);
    drop(consumer);
    buffer
}

fn encoded(event: &Event) -> Vec<u8> {
    let mut bytes = Vec::new();
    event.encode(&mut bytes);
    bytes
}

fn barrier(id: u64) -> Event {
    Event::CheckpointBarrier(CheckpointBarrier {
        id,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Unaligned,
    })
}

fn data(item: &GateItem) -> Vec<u8> {
    match item {
        GateItem::Buffer(buffer) => buffer.as_slice().to_vec(),
        other => panic!("expected data, got {other:?}"),
    }
}

fn into_buffer(item: GateItem) -> Buffer {
    match item {
        GateItem::Buffer(buffer) => buffer,
        other => panic!("expected data, got {other:?}"),
    }
}

/// The sender's side of one channel as the transport sees it: the credit it was granted
/// (initial credit plus every AddCredit) and what it sent. Flink's invariant: the receiver's
/// free segments equal the sender's credit plus the credit not announced yet.
struct Sender {
    shared: Arc<RemoteChannelShared>,
    granted: usize,
    sent: usize,
    sequence: u64,
}

impl Sender {
    fn new(shared: &Arc<RemoteChannelShared>) -> Self {
        Self {
            shared: shared.clone(),
            granted: shared.buffers().initial_credit() as usize,
            sent: 0,
            sequence: 0,
        }
    }

    /// Sends an AddCredit message with the unannounced credit; returns it.
    fn announce(&mut self) -> usize {
        let credit = self.shared.buffers().take_unannounced_credit() as usize;
        self.granted += credit;
        credit
    }

    /// The sender's remaining credit.
    fn credit(&self) -> usize {
        self.granted - self.sent
    }

    /// Takes a segment to receive into: uses one credit.
    fn take(&mut self) -> PooledSegment {
        assert!(self.credit() > 0, "the sender has no credit left");
        let segment = self
            .shared
            .buffers()
            .take_segment()
            .expect("the receiver has a free segment for every credit");
        self.sent += 1;
        segment
    }

    /// Hands `bytes` written into `segment` to the channel as item `sequence`.
    fn deliver(
        &mut self,
        segment: PooledSegment,
        bytes: &[u8],
        data_type: DataType,
        sequence: u64,
        backlog: usize,
        overtaken: usize,
    ) -> Result<(), GateError> {
        self.sequence = sequence + 1;
        self.shared.on_buffer(
            fill(segment, bytes, data_type),
            sequence,
            backlog,
            overtaken,
        )
    }

    /// Receives one buffer of `data_type` carrying `bytes` with the next sequence number.
    fn send(&mut self, bytes: &[u8], data_type: DataType, backlog: usize) -> Result<(), GateError> {
        let sequence = self.sequence;
        self.send_as(bytes, data_type, sequence, backlog)
    }

    /// Receives checkpoint `id`'s aligned barrier (it stops the sender until resumed) with
    /// the next sequence number, in an event segment (events need no credit).
    fn send_aligned_barrier(&mut self, id: u64) {
        let barrier = Event::CheckpointBarrier(CheckpointBarrier {
            id,
            timestamp: 0,
            kind: CheckpointKind::Checkpoint,
            alignment: Alignment::Aligned,
        });
        let segment = self.shared.buffers().event_segment(64).unwrap();
        let sequence = self.sequence;
        self.deliver(
            segment,
            &encoded(&barrier),
            DataType::AlignedCheckpointBarrier,
            sequence,
            0,
            0,
        )
        .unwrap();
    }

    /// Like `send` but with an explicit sequence number.
    fn send_as(
        &mut self,
        bytes: &[u8],
        data_type: DataType,
        sequence: u64,
        backlog: usize,
    ) -> Result<(), GateError> {
        let segment = self.take();
        self.deliver(segment, bytes, data_type, sequence, backlog, 0)
    }

    /// Receiver's free segments == sender's credit + credit not announced yet.
    fn assert_balanced(&self) {
        let buffers = self.shared.buffers();
        assert_eq!(
            buffers.available(),
            self.credit() + buffers.unannounced_credit() as usize,
            "free segments vs. sender credit {} + unannounced {}",
            self.credit(),
            buffers.unannounced_credit()
        );
    }
}

#[test]
fn exclusive_credit_is_announced_once_per_zero_to_positive_transition() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();

    assert_eq!(buffers.initial_credit() as usize, EXCLUSIVE);
    assert_eq!(buffers.available(), EXCLUSIVE);
    assert_eq!(buffers.unannounced_credit(), 0);
    assert_eq!(
        f.leased(),
        EXCLUSIVE + 1,
        "the exclusive segments and the gate's one floating segment are taken"
    );
    assert_eq!(shared.channel(), 0);
    assert_eq!(shared.expected_sequence(), 0);

    let mut sender = Sender::new(&shared);
    sender.send(b"zero", DataType::DataBuffer, 0).unwrap();
    assert_eq!(buffers.available(), 1);
    sender.send(b"one", DataType::DataBuffer, 0).unwrap();
    assert_eq!(buffers.available(), 0);
    assert_eq!(shared.expected_sequence(), 2);
    assert!(
        buffers.take_segment().is_none(),
        "no segment beyond the credit granted"
    );
    sender.assert_balanced();

    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(first.channel, 0);
    assert_eq!(data(&first.item), b"zero");
    assert!(first.more_available);
    let second = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(data(&second.item), b"one");
    assert!(gate.poll_next().unwrap().is_none());
    assert_eq!(
        announcements.count(),
        0,
        "nothing recycled, nothing to announce"
    );
    let metrics = gate.channel(0).unwrap().metrics().unwrap();
    assert_eq!(metrics.num_buffers_in.get(), 2);
    assert_eq!(metrics.num_bytes_in.get(), 7);

    // The first recycle: credit 0 -> 1, one announcement.
    drop(first);
    assert_eq!(buffers.available(), 1);
    assert_eq!(buffers.unannounced_credit(), 1);
    assert_eq!(announcements.count(), 1);
    assert_eq!(announcements.channels(), vec![0]);
    sender.assert_balanced();

    // The second before the transport took the credit: 1 -> 2, no second announcement.
    drop(second);
    assert_eq!(buffers.available(), 2);
    assert_eq!(buffers.unannounced_credit(), 2);
    assert_eq!(announcements.count(), 1);
    sender.assert_balanced();

    assert_eq!(sender.announce(), 2);
    assert_eq!(buffers.unannounced_credit(), 0);
    assert_eq!(buffers.take_unannounced_credit(), 0, "taken once");
    assert_eq!(announcements.count(), 1);
    sender.assert_balanced();

    // After the transport took it, the next recycle is announced again.
    sender.send(b"two", DataType::DataBuffer, 0).unwrap();
    let third = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(data(&third.item), b"two");
    assert_eq!(announcements.count(), 1);
    drop(third);
    assert_eq!(buffers.unannounced_credit(), 1);
    assert_eq!(announcements.count(), 2);
    assert_eq!(announcements.channels(), vec![0, 0]);
    sender.assert_balanced();
    assert_eq!(
        f.leased(),
        EXCLUSIVE + 1,
        "no floating segment was needed beyond the gate's one"
    );
    assert_eq!(gate.pool().unwrap().available_segments(), 1);

    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// An event whose bytes do not decode fails that read, and the buffer queued behind it is
/// read next: the channel stays in the gate's queue. It was left out, and a reader that read
/// on after the error waited for good.
#[test]
fn a_buffer_behind_an_undecodable_event_is_read_after_the_error() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    sender
        .send(b"\xFFnot an event", DataType::EventBuffer, 0)
        .unwrap();
    sender.send(b"after", DataType::DataBuffer, 0).unwrap();
    assert!(matches!(
        gate.next_timeout(LONG),
        Err(GateError::Event { channel: 0, .. })
    ));
    let after = gate
        .next_timeout(LONG)
        .unwrap()
        .expect("the buffer behind the bad event");
    assert_eq!(data(&after.item), b"after");
    drop(after);
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A blocking barrier whose bytes do not decode fails that read and then its channel for
/// good: its sender stopped behind it until a resume no reader will ask for, so the channel
/// could deliver nothing more. It failed one read and then went quiet, and a reader waited
/// for good.
#[test]
fn an_undecodable_blocking_barrier_fails_its_channel_for_good() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    let segment = shared.buffers().event_segment(64).unwrap();
    sender
        .deliver(
            segment,
            b"\xFFnot a barrier",
            DataType::AlignedCheckpointBarrier,
            0,
            0,
            0,
        )
        .unwrap();
    assert!(matches!(
        gate.next_timeout(LONG),
        Err(GateError::Event { channel: 0, .. })
    ));
    assert!(
        matches!(
            gate.next_timeout(LONG),
            Err(GateError::Transport { channel: 0, .. })
        ),
        "the next read fails: the channel is done"
    );
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// The same in a union: the member gate whose channel read the bad event stays in the
/// union's turn while its other channel has data queued. It was left out, and the other
/// channel's notifications folded into the member's entry that was gone: read for good.
#[test]
fn a_union_reads_a_member_on_after_one_of_its_channels_read_an_undecodable_event() {
    let f = fixture();
    let member = f.remote_gate(2);
    let (bad, _) = attach(&member, 0);
    let (good, _) = attach(&member, 1);
    let mut union = UnionInputGate::new(vec![member]);
    let mut bad_sender = Sender::new(&bad);
    let mut good_sender = Sender::new(&good);
    bad_sender
        .send(b"\xFFnot an event", DataType::EventBuffer, 0)
        .unwrap();
    good_sender.send(b"good", DataType::DataBuffer, 0).unwrap();
    assert!(matches!(
        union.next_timeout(LONG),
        Err(GateError::Event { channel: 0, .. })
    ));
    let item = union
        .next_timeout(LONG)
        .unwrap()
        .expect("the other channel's buffer");
    assert_eq!((item.channel, data(&item.item)), (1, b"good".to_vec()));
    drop(item);
    union.close();
    drop(union);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// `Duration::MAX`, a common way to say "no deadline", waits without one: it panicked adding
/// itself to the clock, in the gate's read and in the record reader's.
#[test]
fn a_timeout_beyond_the_clock_waits_without_a_deadline() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    sender.send(b"ready", DataType::DataBuffer, 0).unwrap();
    let ready = gate.next_timeout(Duration::MAX).unwrap().expect("a buffer");
    assert_eq!(data(&ready.item), b"ready");
    drop(ready);
    // The reader waits (its idle time grows) before the record comes.
    let idle = gate.metrics().idle.clone();
    let closer = gate.closer();
    let mut reader = RecordReader::new(gate, 1 << 10);
    let late = thread::spawn(move || {
        if !common::wait_until(LONG, || idle.total() > Duration::ZERO) {
            // The read without a deadline then ends (failing) rather than waiting for good.
            closer.close();
            panic!("the reader never waited");
        }
        sender
            .send(&common::framed_record(b"late"), DataType::DataBuffer, 0)
            .unwrap();
    });
    match reader.next_timeout(Duration::MAX).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"late"),
        other => panic!("expected the record, got {other:?}"),
    }
    late.join().unwrap();
    reader.gate_mut().close();
    drop(reader);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A channel's stream that ends inside a record fails the read with `Truncated`, and the
/// channel's EndOfPartition still comes out next, as it does once for every channel: the
/// error took its place, so a caller reading on never saw that channel end.
#[test]
fn a_stream_ending_inside_a_record_fails_the_read_and_still_ends_its_channel() {
    let f = fixture();
    let gate = f.remote_gate(1);
    let (shared, _) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    // A record of 100 bytes (one prefix byte) of which 10 came.
    let mut begun = vec![100u8];
    begun.extend_from_slice(&[7; 10]);
    sender.send(&begun, DataType::DataBuffer, 0).unwrap();
    sender
        .send(&encoded(&Event::EndOfPartition), DataType::EventBuffer, 0)
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 10);
    match reader.next_timeout(LONG) {
        Err(fluxgate::gate::ReaderError::Record {
            channel: 0,
            source: fluxgate::record::RecordError::Truncated,
        }) => {}
        other => panic!("expected the truncated record, got {other:?}"),
    }
    match reader.next_timeout(LONG) {
        Ok(Some(ReaderItem::Event {
            channel: 0,
            event: Event::EndOfPartition,
        })) => {}
        other => panic!("expected the channel's end, got {other:?}"),
    }
    assert!(matches!(reader.next_timeout(LONG), Ok(None)));
    drop(reader);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A remote channel that ended takes task events and drops them: no connection serves it to
/// take them out, so queued they would fill its backlog, and the gate would refuse task
/// events for its other channels for good.
#[test]
fn task_events_for_a_remote_channel_that_ended_are_dropped_not_held() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    sender
        .send(&encoded(&Event::EndOfPartition), DataType::EventBuffer, 0)
        .unwrap();
    let end = gate.next_timeout(LONG).unwrap().expect("the channel's end");
    assert!(matches!(
        end.item,
        GateItem::Event {
            event: Event::EndOfPartition,
            ..
        }
    ));
    for n in 0..1100u32 {
        gate.send_task_event(&Event::Task(n.to_be_bytes().to_vec()))
            .unwrap();
    }
    assert!(shared.take_task_events().is_empty(), "nothing was held");
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A channel can hold more segments than its exclusive ones and the gate's floating quota:
/// the exclusive segments of channels that ended go back to the gate's pool and can be lent
/// to it. It receives that many buffers, in order. Its lanes keep room only for the usual
/// number and grow beyond it while needed (they were sized for the gate's whole pool, each:
/// memory that grew with the square of the channel count).
#[test]
fn a_channel_holding_more_than_its_usual_segments_receives_them_all_in_order() {
    const CHANNELS: usize = 12;
    let f = fixture();
    let mut gate = f.remote_gate(CHANNELS);
    let attached: Vec<_> = (0..CHANNELS).map(|i| attach(&gate, i)).collect();
    // Every channel but the first ends: its exclusive segments go back to the gate's pool.
    for (shared, _) in &attached[1..] {
        let mut sender = Sender::new(shared);
        let segment = shared.buffers().event_segment(64).unwrap();
        sender
            .deliver(
                segment,
                &encoded(&Event::EndOfPartition),
                DataType::EventBuffer,
                0,
                0,
                0,
            )
            .unwrap();
    }
    for _ in 1..CHANNELS {
        let item = gate
            .next_timeout(LONG)
            .unwrap()
            .expect("an end of partition");
        assert!(matches!(item.item, GateItem::Event { .. }), "{item:?}");
    }
    let (shared, _) = &attached[0];
    shared.buffers().on_sender_backlog(1000);
    let mut sender = Sender::new(shared);
    // Sends on every credit the channel announces, until it announces none (the gate's pool
    // is all in this channel's buffers).
    let mut sent = 0u32;
    for _ in 0..1000 {
        sender.announce();
        if sender.credit() == 0 {
            break;
        }
        while sender.credit() > 0 {
            sender
                .send(&sent.to_be_bytes(), DataType::DataBuffer, 1000)
                .unwrap();
            sent += 1;
        }
    }
    assert_eq!(
        sent as usize,
        CHANNELS * EXCLUSIVE + FLOATING,
        "the whole gate pool"
    );
    assert!(sent as usize > EXCLUSIVE + FLOATING + UNCREDITED_EVENTS);
    for i in 0..sent {
        let item = gate.next_timeout(LONG).unwrap().expect("a buffer");
        assert_eq!(
            (item.channel, data(&item.item)),
            (0, i.to_be_bytes().to_vec())
        );
    }
    gate.close();
    drop(gate);
    drop(attached);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_backlog_brings_floating_segments_bounded_by_the_gate_pool() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let pool = gate.pool().unwrap().clone();
    assert_eq!(pool.spec().max_segments, EXCLUSIVE + FLOATING);
    let mut sender = Sender::new(&shared);

    // Backlog 5: the channel wants 5 + 2 segments; it holds 1 free exclusive after the
    // buffer, so it borrows 6 floating ones.
    sender.send(b"a", DataType::DataBuffer, 5).unwrap();
    assert_eq!(buffers.available(), 5 + EXCLUSIVE);
    assert_eq!(buffers.unannounced_credit(), 6);
    assert_eq!(announcements.count(), 1, "one announcement for 0 -> 6");
    assert_eq!(f.leased(), EXCLUSIVE + 6);
    assert_eq!(pool.requested_segments(), EXCLUSIVE + 6);
    sender.assert_balanced();
    assert_eq!(sender.announce(), 6);
    sender.assert_balanced();

    // Backlog 20 asks for 22 segments; the pool has 2 floating left, so it stops there and
    // the channel waits as a listener.
    sender.send(b"b", DataType::DataBuffer, 20).unwrap();
    assert_eq!(pool.requested_segments(), EXCLUSIVE + FLOATING);
    assert_eq!(f.leased(), EXCLUSIVE + FLOATING, "bounded by the gate pool");
    // 10 segments in the channel's hands: 2 in received buffers, 8 free.
    assert_eq!(buffers.available(), EXCLUSIVE + FLOATING - 2);
    assert_eq!(buffers.unannounced_credit(), 2);
    assert_eq!(announcements.count(), 2);
    sender.assert_balanced();
    assert_eq!(sender.announce(), 2);

    let a = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    let b = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    assert_eq!((a.as_slice(), b.as_slice()), (&b"a"[..], &b"b"[..]));

    // "a" was written into an exclusive segment: back to the channel, announced.
    drop(a);
    assert_eq!(buffers.available(), EXCLUSIVE + FLOATING - 1);
    assert_eq!(buffers.unannounced_credit(), 1);
    assert_eq!(announcements.count(), 3);
    sender.assert_balanced();

    // "b" was written into a floating segment: back to the pool, which hands it to the
    // waiting channel again: one more credit, no new announcement (1 -> 2).
    drop(b);
    assert_eq!(buffers.available(), EXCLUSIVE + FLOATING);
    assert_eq!(buffers.unannounced_credit(), 2);
    assert_eq!(announcements.count(), 3);
    assert_eq!(f.leased(), EXCLUSIVE + FLOATING);
    sender.assert_balanced();

    drop(pool); // a strong handle would keep the pool from being destroyed on close
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_channel_waiting_for_floating_segments_gets_the_next_one_recycled() {
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared0, announcements0) = attach(&gate, 0);
    let (shared1, announcements1) = attach(&gate, 1);
    let (buffers0, buffers1) = (shared0.buffers().clone(), shared1.buffers().clone());
    let pool = gate.pool().unwrap().clone();
    assert_eq!(pool.spec().max_segments, 2 * EXCLUSIVE + FLOATING);
    let mut sender0 = Sender::new(&shared0);
    let mut sender1 = Sender::new(&shared1);

    // Channel 1 wants 7 + 2 and holds one free exclusive: it takes all 8 floating segments.
    sender1.send(b"one", DataType::DataBuffer, 7).unwrap();
    assert_eq!(buffers1.available(), 7 + EXCLUSIVE);
    assert_eq!(buffers1.unannounced_credit(), FLOATING as u32);
    assert_eq!(pool.requested_segments(), pool.spec().max_segments);
    assert_eq!(f.leased(), 2 * EXCLUSIVE + FLOATING);
    assert_eq!(sender1.announce(), FLOATING);
    sender1.assert_balanced();

    // Channel 0 wants 3 + 2 but the pool is exhausted: it registers as a listener.
    sender0.send(b"zero", DataType::DataBuffer, 3).unwrap();
    assert_eq!(buffers0.available(), EXCLUSIVE - 1);
    assert_eq!(buffers0.unannounced_credit(), 0);
    assert_eq!(announcements0.count(), 0);
    sender0.assert_balanced();

    // The transport of channel 1 gives back a floating segment unused (e.g. a cancelled
    // read): the pool hands it to channel 0, whose credit grows by one and is announced.
    let spare = sender1.take();
    assert_eq!(buffers1.available(), 7 + EXCLUSIVE - 1);
    drop(spare);
    assert_eq!(
        buffers1.available(),
        7 + EXCLUSIVE - 1,
        "a floating segment does not return to the channel that used it"
    );
    assert_eq!(buffers0.available(), EXCLUSIVE);
    assert_eq!(buffers0.unannounced_credit(), 1);
    assert_eq!(announcements0.count(), 1);
    assert_eq!(announcements0.channels(), vec![0]);
    assert_eq!(
        f.leased(),
        2 * EXCLUSIVE + FLOATING,
        "it never left the gate"
    );
    sender0.assert_balanced();

    // Channel 0 is still short (2 of 5) and waits again: the next recycled floating
    // segment, a buffer read from channel 1, goes to it as well.
    sender1.send(b"floating", DataType::DataBuffer, 0).unwrap();
    let mut read = Vec::new();
    while let Some(item) = gate.poll_next().unwrap() {
        read.push((item.channel, into_buffer(item.item)));
    }
    let texts: Vec<(usize, &[u8])> = read.iter().map(|(c, b)| (*c, b.as_slice())).collect();
    assert_eq!(
        texts,
        vec![(1, &b"one"[..]), (0, &b"zero"[..]), (1, &b"floating"[..])],
        "channels in turn, each in order"
    );
    let floating = read.pop().unwrap().1;
    drop(floating);
    assert_eq!(buffers0.available(), EXCLUSIVE + 1);
    assert_eq!(buffers0.unannounced_credit(), 2);
    assert_eq!(announcements0.count(), 1, "1 -> 2 is not announced");
    sender0.assert_balanced();
    assert_eq!(announcements1.channels(), vec![1]);
    drop(read);
    sender0.assert_balanced();
    sender1.assert_balanced();

    drop(pool);
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn floating_segments_are_used_first_and_surplus_ones_go_back_to_the_pool() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let mut sender = Sender::new(&shared);

    // Exclusive segment for "a"; backlog 3 wants 5 segments: 4 floating.
    sender.send(b"a", DataType::DataBuffer, 3).unwrap();
    assert_eq!(buffers.available(), 5);
    assert_eq!(sender.announce(), 4);
    assert_eq!(f.leased(), EXCLUSIVE + 4);
    let calls = announcements.count();

    // "b" goes into a floating segment although an exclusive one is free. The backlog
    // dropped to 1: the channel now wants 3 segments and holds 4.
    sender.send(b"b", DataType::DataBuffer, 1).unwrap();
    assert_eq!(buffers.available(), 4);
    let a = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    let b = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    assert_eq!(b.as_slice(), b"b");

    // A floating segment leaves the gate (the pool is above its minimum): no credit.
    drop(b);
    assert_eq!(f.leased(), EXCLUSIVE + 3, "b's segment went back");
    assert_eq!(buffers.available(), 4, "and not to the channel");
    assert_eq!(buffers.unannounced_credit(), 0);
    sender.assert_balanced();

    // The exclusive segment returns while the channel holds more than it needs (5 > 3): a
    // floating one goes back to the pool instead of adding credit.
    assert_eq!(a.as_slice(), b"a");
    drop(a);
    assert_eq!(buffers.available(), 4);
    assert_eq!(buffers.unannounced_credit(), 0);
    assert_eq!(announcements.count(), calls, "no credit, no announcement");
    assert_eq!(
        f.leased(),
        EXCLUSIVE + 2,
        "a floating segment left the gate"
    );
    sender.assert_balanced();

    // Both exclusive segments are free again: the next two buffers go to the 2 floating
    // ones first, then the exclusive ones. The first floating segment leaves the gate; the
    // second stays in the gate's pool, which keeps its minimum (2 exclusive + 1).
    let pool = gate.pool().unwrap().clone();
    assert_eq!(pool.spec().min_segments, EXCLUSIVE + 1);
    for (i, leased, pooled) in [(0u8, EXCLUSIVE + 1, 0), (1, EXCLUSIVE + 1, 1)] {
        sender.send(&[i], DataType::DataBuffer, 0).unwrap();
        let item = gate.next_timeout(LONG).unwrap().unwrap();
        assert_eq!(data(&item.item), [i]);
        drop(item);
        assert_eq!(f.leased(), leased);
        assert_eq!(pool.available_segments(), pooled);
    }
    drop(pool);
    assert_eq!(buffers.available(), EXCLUSIVE);
    sender.send(b"x", DataType::DataBuffer, 0).unwrap();
    let item = gate.next_timeout(LONG).unwrap().unwrap();
    drop(item);
    assert_eq!(
        buffers.available(),
        EXCLUSIVE,
        "exclusive: back to the channel"
    );
    assert_eq!(buffers.unannounced_credit(), 1);
    sender.assert_balanced();

    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// Every response's backlog sets what the channel wants, a backlog of 0 too (Flink's
/// `onBuffer`): once the sender reports nothing queued, floating segments freed in the
/// channel go back to the gate's pool instead of staying as credit nothing will use, which
/// channels whose senders do have buffers may need.
#[test]
fn a_backlog_of_zero_lets_surplus_floating_segments_go_back() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let mut sender = Sender::new(&shared);
    // An exclusive segment for "a"; a backlog of 3 wants 5 free segments: 4 floating.
    sender.send(b"a", DataType::DataBuffer, 3).unwrap();
    assert_eq!(sender.announce(), 4);
    assert_eq!(buffers.available(), 5);
    // "b" (into a floating segment) says the sender has nothing more queued.
    sender.send(b"b", DataType::DataBuffer, 0).unwrap();
    assert_eq!(buffers.available(), 4);
    let a = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    assert_eq!(a.as_slice(), b"a");
    let leased = f.leased();
    // The exclusive segment comes back while the channel holds 4 free and wants 2: a floating
    // one leaves instead, and no credit is added.
    drop(a);
    assert_eq!(buffers.available(), 4);
    assert_eq!(buffers.unannounced_credit(), 0);
    assert_eq!(f.leased(), leased - 1, "a floating segment went back");
    sender.assert_balanced();
    let b = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    drop(b);
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// An aligned barrier stops the sender until consumption resumes, so the backlog the data
/// before it announced no longer holds: a channel with exclusive segments stops taking
/// floating ones (the channels still to bring their barriers need them). It kept waiting for
/// them through the whole alignment, and took each one the pool got back as credit its
/// blocked sender could not use.
#[test]
fn a_blocked_channel_takes_no_more_floating_segments() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let mut sender = Sender::new(&shared);
    // A backlog beyond the gate's pool: every floating segment, and still waiting for more.
    buffers.on_sender_backlog(FLOATING + 10);
    assert_eq!(buffers.available(), EXCLUSIVE + FLOATING);
    assert!(buffers.is_waiting_for_floating());
    sender.announce();
    // "a" goes into a floating segment, so its return goes to the gate's pool.
    sender
        .send(b"a", DataType::DataBuffer, FLOATING + 10)
        .unwrap();
    sender.send_aligned_barrier(1);
    let a = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    assert_eq!(a.as_slice(), b"a");
    drop(a);
    assert_eq!(
        buffers.unannounced_credit(),
        0,
        "the blocked channel took the returned segment as credit"
    );
    assert_eq!(buffers.available(), EXCLUSIVE + FLOATING - 1);
    assert!(!buffers.is_waiting_for_floating());
    let read = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(read.item, GateItem::Event { .. }), "the barrier");
    drop(read);
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A channel without exclusive segments gives its floating ones back when an aligned barrier
/// blocks its sender (Flink's `onBlockingUpstream`), takes no new ones while blocked, and on
/// resume drops the credit it had not announced for them; a resume that no barrier blocked
/// before keeps its credit.
#[test]
fn a_blocked_channel_without_exclusive_segments_gives_its_floating_ones_back() {
    let f = fixture_with_exclusive(0);
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    assert_eq!(buffers.initial_credit(), 0);
    let mut sender = Sender::new(&shared);
    // A backlog of 3 brings three floating segments; two are announced, one more follows
    // unannounced.
    buffers.on_sender_backlog(2);
    assert_eq!(sender.announce(), 2);
    buffers.on_sender_backlog(3);
    assert_eq!(buffers.unannounced_credit(), 1);
    sender.send(b"data", DataType::DataBuffer, 2).unwrap();
    assert_eq!(buffers.available(), 2);
    let before = f.leased();
    // The aligned barrier: the two free floating segments go back to the gate's pool, and
    // they leave the gate (it is above its minimum of one).
    sender.send_aligned_barrier(1);
    assert_eq!(buffers.available(), 0);
    assert_eq!(
        f.leased(),
        before - 2 + 1,
        "two floating segments out, the barrier in"
    );
    // While blocked nothing is taken as credit: a segment coming free is not kept.
    let data = gate.next_timeout(LONG).unwrap().unwrap();
    drop(data);
    assert_eq!(buffers.available(), 0);
    let item = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(item.item, GateItem::Event { .. }));
    drop(item);
    // The resume drops the credit counted for segments the channel no longer holds.
    assert_eq!(buffers.unannounced_credit(), 1);
    gate.resume_consumption(0).unwrap();
    assert_eq!(buffers.unannounced_credit(), 0);
    // A later resume with no barrier before it keeps what the channel holds and counted.
    buffers.on_sender_backlog(1);
    assert_eq!(buffers.available(), 1);
    assert_eq!(buffers.unannounced_credit(), 1);
    gate.resume_consumption(0).unwrap();
    assert_eq!(buffers.unannounced_credit(), 1);
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A gate holds one floating segment from its setup on (Flink's `reserveSegments(1)`,
/// FLINK-24035): its channel without exclusive segments gets credit for a backlog although
/// another pool of the process took every free segment of the network meanwhile. Without it,
/// the channel waited for that pool to give one back (for good, when that pool's consumer
/// waits for this gate).
#[test]
fn a_gate_keeps_one_floating_segment_from_its_setup_on() {
    let f = fixture_with_exclusive(0);
    let mut gate = f.remote_gate(1);
    let (shared, announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let total = f.network.total_segments();
    let other = f
        .network
        .create_local_pool(LocalPoolSpec {
            min_segments: 1,
            max_segments: total,
            subpartitions: 1,
            max_segments_per_channel: total,
            max_listeners: 1,
            max_overdraft_segments: 0,
        })
        .unwrap();
    let taken: Vec<_> = (0..total)
        .map_while(|_| other.request_buffer_builder(0))
        .collect();
    assert_eq!(f.network.available_segments(), 0);
    buffers.on_sender_backlog(1);
    assert_eq!(
        buffers.unannounced_credit(),
        1,
        "the gate's floating segment is the channel's credit"
    );
    assert_eq!(announcements.count(), 1);
    drop((taken, other));
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_sequence_gap_fails_the_channel_and_recycles_the_buffer() {
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared, _announcements) = attach(&gate, 1);
    let buffers = shared.buffers().clone();
    let mut sender = Sender::new(&shared);

    sender.send(b"zero", DataType::DataBuffer, 0).unwrap();
    assert_eq!(shared.expected_sequence(), 1);
    let error = sender
        .send_as(b"two", DataType::DataBuffer, 2, 0)
        .unwrap_err();
    assert_eq!(
        error,
        GateError::Reordering {
            channel: 1,
            expected: 1,
            actual: 2
        }
    );
    assert_eq!(shared.expected_sequence(), 1, "the gap is not skipped");
    // The rejected buffer's segment is free again (one credit), the accepted one is queued.
    assert_eq!(buffers.available(), EXCLUSIVE - 1);
    assert_eq!(buffers.unannounced_credit(), 1);
    sender.assert_balanced();

    // The gate's next read of the channel fails with it, before the queued buffer.
    assert_eq!(gate.next_timeout(LONG).unwrap_err(), error);

    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn data_cannot_exceed_credit_and_a_flood_of_events_fails_the_channel() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let capacity = gate.pool().unwrap().spec().max_segments;

    // Data goes into the channel's own segments: once the credit is used up the transport
    // finds no segment to receive into (Flink's "No buffer available in credit-based input
    // channel"), so data alone cannot overflow the channel.
    let mut sender = Sender::new(&shared);
    for i in 0..EXCLUSIVE {
        sender.send(&[i as u8], DataType::DataBuffer, 0).unwrap();
    }
    assert_eq!(sender.credit(), 0);
    assert!(buffers.take_segment().is_none());

    // Events need no credit: the transport reads them into overdraft segments of the global
    // pool. They neither use nor grant credit, but the channel holds at most as many
    // received items as the gate pool has segments plus a few uncredited events.
    let bound = capacity + UNCREDITED_EVENTS;
    for sequence in EXCLUSIVE..bound {
        let segment = buffers.event_segment(64).expect("overdraft memory");
        let event = Event::Task(vec![sequence as u8]);
        sender
            .deliver(
                segment,
                &encoded(&event),
                DataType::EventBuffer,
                sequence as u64,
                0,
                0,
            )
            .unwrap();
    }
    assert_eq!(buffers.available(), 0);
    assert_eq!(buffers.unannounced_credit(), 0);
    assert_eq!(
        f.leased(),
        bound + 1,
        "2 exclusive + one overdraft segment per event, and the gate's floating segment"
    );
    let leased = f.leased();
    let segment = buffers.event_segment(64).unwrap();
    let error = sender
        .deliver(
            segment,
            &encoded(&Event::Task(vec![0xff])),
            DataType::EventBuffer,
            bound as u64,
            0,
            0,
        )
        .unwrap_err();
    assert_eq!(error, GateError::CreditExceeded(0));
    assert_eq!(f.leased(), leased, "the refused event's segment went back");
    assert_eq!(announcements.count(), 0, "overdraft segments are no credit");
    assert_eq!(gate.next_timeout(LONG).unwrap_err(), error);

    gate.close();
    assert!(
        buffers.event_segment(64).is_none(),
        "no event memory for a closed gate"
    );
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn closing_the_gate_returns_every_exclusive_and_floating_segment() {
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared0, announcements0) = attach(&gate, 0);
    let (shared1, announcements1) = attach(&gate, 1);
    let mut sender0 = Sender::new(&shared0);
    let mut sender1 = Sender::new(&shared1);

    // Channel 0 borrows every floating segment and still waits for more (listener).
    sender0.send(b"a0", DataType::DataBuffer, 30).unwrap();
    assert_eq!(shared0.buffers().available(), EXCLUSIVE - 1 + FLOATING);
    assert_eq!(sender0.announce(), FLOATING);
    sender0.send(b"a1", DataType::DataBuffer, 30).unwrap();
    sender0.send(b"a2", DataType::DataBuffer, 30).unwrap();
    // Channel 1 uses both exclusive segments and waits for floating ones too.
    sender1.send(b"b0", DataType::DataBuffer, 4).unwrap();
    sender1.send(b"b1", DataType::DataBuffer, 4).unwrap();
    assert_eq!(shared1.buffers().available(), 0);
    assert_eq!(f.leased(), 2 * EXCLUSIVE + FLOATING);

    // The task holds two read buffers (one exclusive, one floating), the transport one
    // segment it is receiving into; the rest stays queued.
    let held_a0 = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    let held_b0 = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    let held_a1 = into_buffer(gate.next_timeout(LONG).unwrap().unwrap().item);
    assert_eq!(
        (held_a0.as_slice(), held_b0.as_slice(), held_a1.as_slice()),
        (&b"a0"[..], &b"b0"[..], &b"a1"[..])
    );
    let in_flight = shared0.buffers().take_segment().unwrap();
    let (before0, before1) = (announcements0.count(), announcements1.count());

    gate.close();
    assert!(gate.is_closed());
    assert!(shared0.is_released() && shared1.is_released());
    assert_eq!(gate.poll_next().unwrap_err(), GateError::Closed);
    assert_eq!(shared0.buffers().available(), 0);
    assert_eq!(shared1.buffers().available(), 0);
    assert!(shared0.buffers().take_segment().is_none());
    // The transport hears of the release (to send CancelPartitionRequest).
    assert!(announcements0.count() > before0);
    assert!(announcements1.count() > before1);
    assert_eq!(*announcements0.channels().last().unwrap(), 0);
    assert_eq!(*announcements1.channels().last().unwrap(), 1);

    // A buffer arriving after release is dropped quietly.
    let late = shared1
        .buffers()
        .take_segment()
        .or_else(|| f.network.request_segment())
        .unwrap();
    shared1
        .on_buffer(fill(late, b"late", DataType::DataBuffer), 2, 0, 0)
        .unwrap();

    drop(in_flight);
    drop(held_a0);
    drop(held_b0);
    drop(held_a1);
    // The gate and the transport's handles are still alive: the memory must not wait for
    // them.
    assert_eq!(
        f.network.available_segments(),
        f.network.total_segments(),
        "segments still out after close: {}",
        f.leased()
    );
    drop((shared0, shared1));
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_priority_event_overtakes_received_data() {
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared, _announcements) = attach(&gate, 1);
    let (other, _) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    let mut other_sender = Sender::new(&other);

    other_sender
        .send(b"other", DataType::DataBuffer, 0)
        .unwrap();
    sender.send(b"d0", DataType::DataBuffer, 2).unwrap();
    assert_eq!(sender.announce(), 3, "2 + 2 wanted, 1 free: 3 floating");
    sender.send(b"d1", DataType::DataBuffer, 1).unwrap();
    let event = barrier(7);
    // Events come in overdraft segments: no credit used, none granted when it is recycled.
    // The sender had sent d0 and d1 already: it counts no overtaken data of its own; the two
    // still queued here are overtaken all the same.
    let segment = shared.buffers().event_segment(64).unwrap();
    sender
        .deliver(
            segment,
            &encoded(&event),
            DataType::PrioritizedEventBuffer,
            2,
            0,
            0,
        )
        .unwrap();
    assert_eq!(shared.expected_sequence(), 3);

    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(first.channel, 1);
    match &first.item {
        GateItem::Event {
            event: read,
            priority,
        } => {
            assert_eq!(read, &event);
            assert!(priority);
        }
        other => panic!("expected the priority event, got {other:?}"),
    }
    assert_eq!(first.overtaken, 2);
    assert!(first.more_available);
    let available = shared.buffers().available();
    drop(first);
    assert_eq!(shared.buffers().available(), available);
    sender.assert_balanced();

    let mut rest = Vec::new();
    while let Some(item) = gate.poll_next().unwrap() {
        rest.push((item.channel, data(&item.item)));
    }
    assert_eq!(
        rest,
        vec![
            (0, b"other".to_vec()),
            (1, b"d0".to_vec()),
            (1, b"d1".to_vec())
        ]
    );

    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A priority event overtakes the data its sender still held (the header's count) and the
/// data received before it that the gate has not read yet; data read before it is not
/// overtaken.
#[test]
fn a_priority_event_overtakes_the_sender_s_data_and_the_unread_received_data() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    sender.send(b"d0", DataType::DataBuffer, 0).unwrap();
    sender.send(b"d1", DataType::DataBuffer, 0).unwrap();
    let read = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(data(&read.item), b"d0");
    drop(read);
    // The sender queued one more data buffer (d2) before the barrier and had not sent it.
    let segment = shared.buffers().event_segment(64).unwrap();
    sender
        .deliver(
            segment,
            &encoded(&barrier(8)),
            DataType::PrioritizedEventBuffer,
            2,
            1,
            1,
        )
        .unwrap();
    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(first.item, GateItem::Event { priority: true, .. }));
    assert_eq!(first.overtaken, 2, "d1 unread here, d2 still at the sender");
    drop(first);
    let next = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(data(&next.item), b"d1");
    assert_eq!(next.overtaken, 0);
    drop(next);
    gate.close();
    drop(gate);
    drop(shared);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// Forwards announcements to the transport thread.
struct Wakeups(Mutex<mpsc::Sender<usize>>);

impl CreditListener for Wakeups {
    fn on_channel_ready(&self, channel: usize) {
        let _ = self.0.lock().unwrap().send(channel);
    }
}

#[test]
fn a_transport_thread_sends_only_on_credit_and_everything_arrives_in_order() {
    const ITEMS: usize = 2_000;
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (wake_tx, wake_rx) = mpsc::channel();
    gate.remote_channel(0)
        .unwrap()
        .attach(Arc::new(Wakeups(Mutex::new(wake_tx))));
    let shared = gate.remote_channel(0).unwrap().shared().clone();

    let transport = thread::spawn(move || {
        let mut sender = Sender::new(&shared);
        let mut waits = 0;
        for i in 0..=ITEMS {
            while sender.credit() == 0 {
                // Bounded: a missing announcement fails the test instead of hanging it.
                wake_rx
                    .recv_timeout(LONG)
                    .expect("credit announced before the deadline");
                sender.announce();
                waits += 1;
            }
            if i == ITEMS {
                sender
                    .send(&encoded(&Event::EndOfPartition), DataType::EventBuffer, 0)
                    .unwrap();
            } else {
                sender
                    .send(
                        &(i as u32).to_be_bytes(),
                        DataType::DataBuffer,
                        ITEMS - i - 1,
                    )
                    .unwrap();
            }
        }
        waits
    });

    let mut next = 0u32;
    loop {
        let item = gate.next_timeout(LONG).unwrap().expect("until the end");
        match item.item {
            GateItem::Buffer(buffer) => {
                assert_eq!(buffer.as_slice(), next.to_be_bytes());
                next += 1;
            }
            GateItem::Event { event, .. } => {
                assert_eq!(event, Event::EndOfPartition);
                break;
            }
        }
    }
    assert_eq!(next as usize, ITEMS);
    assert!(gate.is_finished());
    let waits = transport.join().unwrap();
    assert!(waits > 0, "the sender ran out of credit at least once");
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn in_pool_usage_counts_segments_holding_data_not_free_credit() {
    // Flink's inPoolUsage leaves out the segments a channel holds free as credit: a gate whose
    // channels wait for data is not using its pool.
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared, _) = attach(&gate, 0);
    let max = (2 * EXCLUSIVE + FLOATING) as f64;
    assert_eq!(gate.metrics_snapshot().in_pool_usage, 0.0);

    let mut sender = Sender::new(&shared);
    sender.send(b"zero", DataType::DataBuffer, 0).unwrap();
    sender.send(b"one", DataType::DataBuffer, 0).unwrap();
    assert_eq!(gate.pool_usage(), 2.0 / max, "two received, not yet read");
    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(
        gate.pool_usage(),
        2.0 / max,
        "one read and held, one queued"
    );
    drop(first);
    assert_eq!(gate.pool_usage(), 1.0 / max);
    let second = gate.next_timeout(LONG).unwrap().unwrap();
    drop(second);
    assert_eq!(gate.metrics_snapshot().in_pool_usage, 0.0);

    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// Flink's `inputExclusiveBuffersUsage` and `inputFloatingBuffersUsage` split the segments
/// holding data by where they came from; floating segments lent as credit and not yet
/// filled count in neither.
#[test]
fn exclusive_and_floating_usage_count_segments_holding_data_by_kind() {
    let f = fixture();
    let mut gate = f.remote_gate(2);
    let (shared, _) = attach(&gate, 0);
    let exclusive = (2 * EXCLUSIVE) as f64;
    let floating = FLOATING as f64;
    let usages = |gate: &fluxgate::gate::SingleInputGate| {
        let m = gate.metrics_snapshot();
        (
            m.input_exclusive_buffers_usage,
            m.input_floating_buffers_usage,
        )
    };
    assert_eq!(usages(&gate), (0.0, 0.0));

    let mut sender = Sender::new(&shared);
    // Into an exclusive segment (no floating one lent yet); the backlog asks for floating
    // ones, which wait as credit.
    sender.send(b"first", DataType::DataBuffer, 3).unwrap();
    assert!(
        shared.buffers().available() > EXCLUSIVE - 1,
        "floating credit lent"
    );
    assert_eq!(usages(&gate), (1.0 / exclusive, 0.0));
    assert!(sender.announce() > 0);
    // Into a floating one (taken first).
    sender.send(b"second", DataType::DataBuffer, 0).unwrap();
    assert_eq!(usages(&gate), (1.0 / exclusive, 1.0 / floating));

    for _ in 0..2 {
        drop(gate.next_timeout(LONG).unwrap().unwrap());
    }
    assert_eq!(usages(&gate), (0.0, 0.0));
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_union_reports_its_members_input_and_its_own_idle_time() {
    let f = fixture();
    let members = vec![f.remote_gate(1), f.remote_gate(1)];
    let (shared, _) = attach(&members[1], 0);
    let mut union = UnionInputGate::new(members);
    // Nothing comes: the read waits its whole timeout, and that wait is idle time.
    assert!(matches!(
        union.next_timeout(Duration::from_millis(20)),
        Err(GateError::TimedOut)
    ));
    assert!(
        union.metrics_snapshot().idle_time_ms > 0,
        "the union's wait was booked"
    );

    let mut sender = Sender::new(&shared);
    sender.send(b"data", DataType::DataBuffer, 0).unwrap();
    let max = (2 * (EXCLUSIVE + FLOATING)) as f64;
    assert_eq!(union.metrics_snapshot().in_pool_usage, 1.0 / max);
    let item = union.next_timeout(LONG).unwrap().unwrap();
    assert_eq!(item.channel, 1);
    drop(item);
    let metrics = union.metrics_snapshot();
    assert_eq!((metrics.num_bytes_in, metrics.num_buffers_in), (4, 1));
    assert_eq!(metrics.in_pool_usage, 0.0);

    union.close();
    drop(union);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn an_async_read_that_waited_books_idle_time() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _) = attach(&gate, 0);
    let waker = std::task::Waker::noop();
    let mut context = std::task::Context::from_waker(waker);
    let mut sender = Sender::new(&shared);
    // What a metrics reporter on another thread holds.
    let idle = gate.metrics().idle.clone();
    {
        let mut read = std::pin::pin!(gate.next_async());
        assert!(std::future::Future::poll(read.as_mut(), &mut context).is_pending());
        // The wait under way counts before it ends, as Flink's timer gauges count it.
        assert!(
            common::wait_until(LONG, || idle.total() >= Duration::from_millis(1)),
            "a pending read's wait did not show in the idle time"
        );
        sender.send(b"data", DataType::DataBuffer, 0).unwrap();
        match std::future::Future::poll(read.as_mut(), &mut context) {
            std::task::Poll::Ready(item) => drop(item.unwrap().unwrap()),
            std::task::Poll::Pending => panic!("the buffer arrived, yet the read still waits"),
        }
    }
    let waited = idle.total();
    std::thread::yield_now();
    assert_eq!(idle.total(), waited, "the wait ended with the read");
    gate.close();
    drop(gate);
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_barrier_in_a_buffer_of_the_wrong_type_fails_the_read() {
    // An unaligned barrier in a blocking buffer would block its channel with no alignment to
    // resume it; an aligned one as a priority event would be aligned on a channel that never
    // blocked. Either is the sender's fault: a typed error, and nothing leaks.
    let aligned = Event::CheckpointBarrier(CheckpointBarrier {
        id: 3,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Aligned,
    });
    // An event that ends the channel's data (or its recovered state) as a priority one
    // would overtake the data queued before it: the channel ended with it dropped.
    for (event, data_type) in [
        (barrier(3), DataType::AlignedCheckpointBarrier),
        (aligned.clone(), DataType::PrioritizedEventBuffer),
        (aligned, DataType::EventBuffer),
        (Event::EndOfPartition, DataType::PrioritizedEventBuffer),
        (
            Event::EndOfData(fluxgate::event::StopMode::Drain),
            DataType::PrioritizedEventBuffer,
        ),
        (Event::EndOfChannelState, DataType::PrioritizedEventBuffer),
    ] {
        let f = fixture();
        let mut gate = f.remote_gate(1);
        let (shared, _) = attach(&gate, 0);
        let mut sender = Sender::new(&shared);
        sender.send(&encoded(&event), data_type, 0).unwrap();
        match gate.next_timeout(LONG) {
            Err(GateError::Event {
                channel: 0,
                source: fluxgate::event::EventError::WrongBufferType { .. },
            }) => {}
            other => panic!("{event:?} as {data_type:?}: {other:?}"),
        }
        gate.close();
        drop(gate);
        assert_eq!(f.network.available_segments(), f.network.total_segments());
    }
}

/// A gate's exclusive segments wait for the global pool, as Flink waits up to
/// `exclusive-buffers-request-timeout-ms`: a back-pressured partition grown past its minimum
/// holds them for a while and gives them back as it drains. (Setup failed at once with
/// "insufficient network buffers" before, although the gate's pool had been admitted.)
#[test]
fn exclusive_segments_wait_for_segments_another_pool_gives_back() {
    let f = fixture();
    let (hog, held) = common::hog_every_segment(&f.network);
    assert_eq!(f.network.available_segments(), 0);
    let pool = Arc::new(
        f.network
            .create_local_pool(fluxgate::buffer::LocalPoolSpec::for_gate(1, &f.config))
            .unwrap(),
    );
    let setup = {
        let pool = pool.clone();
        thread::spawn(move || {
            fluxgate::gate::BufferManager::new(0, pool, EXCLUSIVE, FLOATING, LONG)
        })
    };
    assert!(
        common::wait_until(LONG, || pool.waiting_requests() > 0),
        "the setup never waited"
    );
    drop(held);
    let manager = setup.join().unwrap().expect("the exclusive segments came");
    assert_eq!(manager.available(), EXCLUSIVE);
    manager.release();
    drop((manager, pool, hog));
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

/// A buffer manager dropped without `release` gives its exclusive segments back (they were
/// lost to the global pool for the life of the process).
#[test]
fn a_buffer_manager_dropped_unreleased_gives_its_exclusive_segments_back() {
    let f = fixture();
    let pool = Arc::new(
        f.network
            .create_local_pool(fluxgate::buffer::LocalPoolSpec::for_gate(1, &f.config))
            .unwrap(),
    );
    let manager =
        fluxgate::gate::BufferManager::new(0, pool.clone(), EXCLUSIVE, FLOATING, LONG).unwrap();
    assert_eq!(manager.available(), EXCLUSIVE);
    drop((manager, pool));
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

impl Sender {
    /// Receives `event` as an item of `data_type` (in a segment of its own, without credit)
    /// that overtook `overtaken` items the sender still held.
    fn send_event(&mut self, event: &Event, data_type: DataType, overtaken: usize) {
        let segment = self.shared.buffers().event_segment(64).unwrap();
        let sequence = self.sequence;
        self.deliver(segment, &encoded(event), data_type, sequence, 0, overtaken)
            .unwrap();
    }
}

/// A two-remote-channel gate checkpointed unaligned into a recording sink, with each
/// channel's sender.
fn unaligned_remote_gate(
    f: &Fixture,
) -> (
    CheckpointedInputGate<SingleInputGate>,
    Arc<common::RecordingSink>,
    [Sender; 2],
) {
    let gate = f.remote_gate(2);
    let senders = [0, 1].map(|i| Sender::new(&attach(&gate, i).0));
    let sink = Arc::new(common::RecordingSink::default());
    let gate = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    (gate, sink, senders)
}

/// Checkpoint 5 running unaligned: channel 0's timeoutable barrier, past its timeout, was
/// the first read (returned, as the task has it); channel 1 sent nothing yet. Also the
/// barrier, for channel 1 to send.
fn checkpoint_5_unaligned(
    f: &Fixture,
) -> (
    CheckpointedInputGate<SingleInputGate>,
    Arc<common::RecordingSink>,
    [Sender; 2],
    BufferOrEvent,
    Event,
) {
    let (mut gate, sink, [mut sender0, sender1]) = unaligned_remote_gate(f);
    let barrier = common::timeoutable_barrier(5, 10, 60_000);
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let first = unaligned_barrier_first(&mut gate, 5);
    (gate, sink, [sender0, sender1], first, barrier)
}

/// The first read: checkpoint `id`'s barrier, unaligned, as the timed-out alignment hands it
/// to the task.
fn unaligned_barrier_first(
    gate: &mut CheckpointedInputGate<SingleInputGate>,
    id: u64,
) -> BufferOrEvent {
    let first = gate.poll_next().unwrap().expect("the barrier");
    assert!(
        matches!(
            first.item,
            GateItem::Event { event: Event::CheckpointBarrier(b), .. }
                if b.id == id && b.alignment == Alignment::Unaligned
        ),
        "{first:?}"
    );
    first
}

fn persisted(sink: &common::RecordingSink) -> Vec<(u64, usize, Vec<u8>)> {
    sink.data.lock().unwrap().clone()
}

#[test]
fn a_barrier_received_behind_data_goes_ahead_of_it_when_its_alignment_times_out() {
    // Flink's convertToPriorityEvent: an aligned barrier with a timeout that a channel holds
    // behind data the task has not read moves ahead of it once the alignment times out. The
    // data goes to the checkpoint at once, and the checkpoint completes without waiting for
    // the task to read it.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let barrier = common::timeoutable_barrier(5, 10, 60_000);
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    sender1.send(b"two", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);

    let first = unaligned_barrier_first(&mut gate, 5);
    let one = gate.poll_next().unwrap().expect("channel 1's data");
    assert_eq!((one.channel, data(&one.item)), (1, b"one".to_vec()));
    assert_eq!(
        persisted(&sink),
        [(5, 1, b"one".to_vec()), (5, 1, b"two".to_vec())],
        "the data before channel 1's barrier is in the checkpoint before the task read it"
    );
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    for shared in [&sender0.shared, &sender1.shared] {
        assert!(shared.take_resume_request(), "both senders resume");
    }
    let two = gate.poll_next().unwrap().expect("channel 1's data");
    assert_eq!((two.channel, data(&two.item)), (1, b"two".to_vec()));
    assert!(
        gate.poll_next().unwrap().is_none(),
        "the barrier moved ahead is not read again"
    );
    assert_eq!(persisted(&sink).len(), 2, "nothing persisted twice");
    // Every item received counts as read in, the barrier moved ahead too (Flink reads it from
    // the head of the queue, where it counts like any other).
    let metrics = gate.gate().metrics_snapshot();
    let barrier_bytes = encoded(&barrier).len() as u64;
    assert_eq!(
        (metrics.num_buffers_in, metrics.num_bytes_in),
        (4, 2 * barrier_bytes + 6)
    );
    drop((first, one, two, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

/// Reads what the gate delivers now, dropping it; returns the data read, concatenated.
fn read_all_now(gate: &mut CheckpointedInputGate<SingleInputGate>) -> Vec<u8> {
    let mut read = Vec::new();
    for _ in 0..64 {
        let Some(item) = gate.poll_next().unwrap() else {
            return read;
        };
        if let GateItem::Buffer(buffer) = &item.item {
            read.extend_from_slice(buffer.as_slice());
        }
    }
    panic!("the gate delivered more than 64 items");
}

#[test]
fn a_newer_unaligned_barrier_ahead_of_data_an_older_barrier_moved_ahead_persists_only_that() {
    // The producer sends a newer unaligned barrier ahead of an older timeoutable one still in
    // its queue. Here the older one's alignment times out before the task reads on, and moves
    // it ahead of the data before it: that data is the newer checkpoint's in-flight data as
    // well (the newer barrier overtook it), but once, and the older barrier, dropped, is not
    // waited for; what the sender wrote after the newer barrier is not in its checkpoint.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let five = common::timeoutable_barrier(5, 60_000, 0);
    sender0.send_event(&five, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    assert!(gate.poll_next().unwrap().is_none(), "channel 0 aligns on 5");
    // The sender's queue held one, two and barrier 5 behind barrier 6.
    sender1.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 3);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    sender1.send(b"two", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&five, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    gate.handle_timeout(Instant::now() + Duration::from_secs(120))
        .unwrap();
    assert_eq!(read_all_now(&mut gate), b"onetwo");
    assert_eq!(sink.channel_state(5, 1), b"onetwo");
    assert!(
        sender1.announce() > 0,
        "the buffers read came back as credit"
    );
    sender1.send(b"three", DataType::DataBuffer, 0).unwrap();
    sender0.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 0);
    assert_eq!(read_all_now(&mut gate), b"three");
    assert_eq!(sink.channel_state(6, 1), b"onetwo");
    assert_eq!(*sink.complete.lock().unwrap(), [5, 6]);
    // Every barrier each channel delivered counts, the one moved ahead and dropped too.
    assert_eq!(
        (gate.barriers_received(0), gate.barriers_received(1)),
        (2, 2)
    );
    drop((gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_priority_barrier_twice_on_a_channel_persists_its_data_once() {
    // A sender that sends its unaligned barrier twice (hostile, or broken): the data the
    // first overtook here goes to the checkpoint once, not again with the second.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    sender1.send(b"two", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 0);
    let first = gate.poll_next().unwrap().expect("the barrier");
    assert!(matches!(
        first.item,
        GateItem::Event { event: Event::CheckpointBarrier(b), .. } if b.id == 6
    ));
    sender1.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 0);
    assert_eq!(read_all_now(&mut gate), b"onetwo");
    sender0.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 0);
    assert!(read_all_now(&mut gate).is_empty());
    assert_eq!(sink.channel_state(6, 1), b"onetwo");
    assert_eq!(*sink.complete.lock().unwrap(), [6]);
    drop((first, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn the_data_a_priority_barrier_overtook_here_is_persisted_when_the_barrier_comes() {
    // As Flink's channel hands its queued buffers to the channel-state writer when an
    // unaligned barrier comes: what the channel received before the barrier goes to the
    // checkpoint at once; what the sender still held (one item) as it arrives and is read.
    let f = fixture();
    let (mut gate, sink, [mut other, mut sender]) = unaligned_remote_gate(&f);
    sender.send(b"one", DataType::DataBuffer, 1).unwrap();
    sender.send(b"two", DataType::DataBuffer, 1).unwrap();
    sender.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 1);

    let first = gate.poll_next().unwrap().expect("the barrier");
    assert!(matches!(
        first.item,
        GateItem::Event { event: Event::CheckpointBarrier(b), .. } if b.id == 6
    ));
    let one = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&one.item), b"one");
    assert_eq!(
        persisted(&sink),
        [(6, 1, b"one".to_vec()), (6, 1, b"two".to_vec())]
    );
    let two = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&two.item), b"two");
    assert!(
        sink.complete.lock().unwrap().is_empty(),
        "the item the sender held is in flight still"
    );
    sender.announce();
    sender.send(b"three", DataType::DataBuffer, 0).unwrap();
    let three = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&three.item), b"three");
    assert_eq!(
        persisted(&sink),
        [
            (6, 1, b"one".to_vec()),
            (6, 1, b"two".to_vec()),
            (6, 1, b"three".to_vec())
        ]
    );
    assert!(sink.complete.lock().unwrap().is_empty(), "channel 0 is due");
    other.send_event(&barrier(6), DataType::PrioritizedEventBuffer, 0);
    assert!(
        gate.poll_next().unwrap().is_none(),
        "a later barrier is swallowed"
    );
    assert_eq!(*sink.complete.lock().unwrap(), [6]);
    drop((first, one, two, three, gate, other, sender));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_timed_out_alignment_whose_barriers_had_nothing_before_them_completes() {
    // Channel 1's barrier waits at the head of its queue when channel 0's alignment times
    // out: it moves ahead of nothing, and no item would ever come to complete the checkpoint
    // (both senders stopped behind their aligned barriers). The next read completes it.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let barrier = common::timeoutable_barrier(5, 10, 60_000);
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let first = unaligned_barrier_first(&mut gate, 5);
    assert!(gate.poll_next().unwrap().is_none(), "nothing else was sent");
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    for shared in [&sender0.shared, &sender1.shared] {
        assert!(shared.take_resume_request(), "both senders resume");
    }
    drop((first, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_barrier_arriving_after_its_alignment_timed_out_goes_ahead_of_the_data_before_it() {
    // Channel 1's barrier was still on its way when the alignment timed out: the channel's
    // data is then persisted as it is read, until the barrier arrives behind more of it; that
    // rest goes to the checkpoint at once, without waiting for the task to read it.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let barrier = common::timeoutable_barrier(5, 10, 60_000);
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    let first = unaligned_barrier_first(&mut gate, 5);
    sender1.send(b"two", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let one = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&one.item), b"one");
    let two = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&two.item), b"two");
    assert_eq!(
        persisted(&sink),
        [(5, 1, b"one".to_vec()), (5, 1, b"two".to_vec())]
    );
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    assert!(
        gate.poll_next().unwrap().is_none(),
        "the barrier is not read again"
    );
    drop((first, one, two, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_barrier_received_behind_data_while_the_checkpoint_is_unaligned_goes_ahead_for_a_back_pressured_task(
) {
    // Flink's processBarrierAnnouncement while unaligned: channel 1's barrier arrives behind
    // data after the checkpoint turned unaligned, while the task, its output back-pressured,
    // reads priority events only. The barrier goes ahead of the data at once and the
    // checkpoint completes; before, it waited until the task read a buffer of channel 1,
    // that is, until a consumer downstream freed a buffer.
    let f = fixture();
    let (mut gate, sink, [sender0, mut sender1], first, barrier) = checkpoint_5_unaligned(&f);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    assert!(
        gate.poll_priority().unwrap().is_none(),
        "nothing for the task: the barrier was its checkpoint's last"
    );
    assert_eq!(persisted(&sink), [(5, 1, b"one".to_vec())]);
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    assert_eq!(gate.pending_checkpoint(), None);
    // The data is still the task's, once, in order; the barrier is not read again.
    let one = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&one.item), b"one");
    assert!(gate.poll_next().unwrap().is_none());
    assert_eq!(persisted(&sink).len(), 1, "persisted once");
    drop((first, one, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_barrier_received_behind_queued_data_wakes_a_task_waiting_for_priority_events() {
    // A back-pressured task waits for priority events only, with channel 1 queued for data
    // it does not read: the barrier arriving behind that data queues nothing new, so only
    // its announcement can wake the task to move it ahead (or start its timer). Before, the
    // task slept on until its output freed a buffer (async), or its 100 ms re-check.
    let f = fixture();
    let (mut gate, sink, [sender0, mut sender1], first, barrier) = checkpoint_5_unaligned(&f);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    assert!(gate.poll_priority().unwrap().is_none(), "data only");
    let woken = Arc::new(WakeCount::default());
    let waker = std::task::Waker::from(woken.clone());
    assert!(
        InputGate::register_waker(&gate, &waker),
        "channel 1 is queued (for data)"
    );
    let before = woken.0.load(Ordering::SeqCst);
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    assert!(
        woken.0.load(Ordering::SeqCst) > before,
        "the barrier's arrival woke the task"
    );
    assert!(gate.poll_priority().unwrap().is_none());
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    let one = gate.poll_next().unwrap().expect("data");
    drop((first, one, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[derive(Default)]
struct WakeCount(AtomicUsize);

impl std::task::Wake for WakeCount {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_newer_checkpoint_announced_while_one_runs_unaligned_gets_its_timer_after_it() {
    // While 5 runs unaligned, channel 2 (past its barrier 5) receives 7's barrier behind
    // data, and channel 1 receives 5's: the look that moves 5's ahead (completing 5) takes
    // the gate's announcement flag, so it must leave 7 to be found once 5 ended, or 7's timer
    // would wait until the task read as far as 7.
    let f = fixture();
    let gate = f.remote_gate(3);
    let mut senders: Vec<Sender> = (0..3).map(|i| Sender::new(&attach(&gate, i).0)).collect();
    let sink = Arc::new(common::RecordingSink::default());
    let mut gate = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink.clone()));
    // 5 starts unaligned (no announcement is noted before it).
    let unaligned_five = Event::CheckpointBarrier(CheckpointBarrier {
        id: 5,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Unaligned,
    });
    senders[0].send_event(&unaligned_five, DataType::PrioritizedEventBuffer, 0);
    let first = gate.poll_next().unwrap().expect("5, unaligned");
    assert_eq!(gate.pending_checkpoint(), Some(5));
    // Channel 2's 5, unaligned too: its sender goes on (an aligned one would stop it).
    senders[2].send_event(&unaligned_five, DataType::PrioritizedEventBuffer, 0);
    assert!(
        gate.poll_next().unwrap().is_none(),
        "channel 2's 5, swallowed"
    );
    let five = common::timeoutable_barrier(5, 3_600_000, 0);
    senders[2].send(b"two", DataType::DataBuffer, 0).unwrap();
    let seven = common::timeoutable_barrier(7, 10_800_000, 0);
    senders[2].send_event(&seven, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    senders[1].send(b"one", DataType::DataBuffer, 0).unwrap();
    senders[1].send_event(&five, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    assert!(gate.poll_priority().unwrap().is_none());
    assert_eq!(persisted(&sink), [(5, 1, b"one".to_vec())]);
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    // The next look finds 7, announced while 5 ran unaligned.
    assert!(gate.poll_priority().unwrap().is_none());
    let deadline = gate.alignment_deadline().expect("7's timer runs");
    assert!(deadline > Instant::now() + Duration::from_secs(2 * 3_600));
    drop((first, gate, senders));
    assert_eq!(f.leased(), 0);
}

#[test]
fn an_alignment_times_out_at_a_barrier_received_behind_data_the_task_has_not_read() {
    // Flink's barrier announcement: a timeoutable barrier received behind data starts the
    // alignment's timer when it arrives, not when the task reads as far as it. Here the
    // checkpoint started past its timeout, and no barrier has been read: the first read is
    // its barrier, unaligned, and the data before it is in the checkpoint at once. Before,
    // the task read every buffer queued before the barrier first, however long that took.
    let f = fixture();
    let (mut gate, sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let barrier = common::timeoutable_barrier(5, 10, 60_000);
    sender0.send(b"zero", DataType::DataBuffer, 0).unwrap();
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();

    let first = unaligned_barrier_first(&mut gate, 5);
    assert_eq!(first.channel, 0);
    // Channel 0's data before its barrier goes to the checkpoint at the next read, taken
    // ahead of its turn (read next); channel 1's as it is read, until its barrier.
    let mut read = Vec::new();
    for _ in 0..4 {
        let Some(item) = gate.poll_next().unwrap() else {
            break;
        };
        if read.is_empty() {
            assert_eq!(
                persisted(&sink),
                [(5, 0, b"zero".to_vec())],
                "in the checkpoint before the task read it"
            );
        }
        read.push((item.channel, data(&item.item)));
    }
    read.sort();
    assert_eq!(read, [(0, b"zero".to_vec()), (1, b"one".to_vec())]);
    assert_eq!(
        persisted(&sink),
        [(5, 0, b"zero".to_vec()), (5, 1, b"one".to_vec())]
    );
    assert_eq!(gate.gate().metrics_snapshot().num_buffers_in, 3);
    assert!(
        sink.complete.lock().unwrap().is_empty(),
        "channel 1's barrier is missing"
    );
    sender1.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    assert!(
        gate.poll_next().unwrap().is_none(),
        "its barrier completes the checkpoint, and is not handed to the task"
    );
    assert_eq!(*sink.complete.lock().unwrap(), [5]);
    assert_eq!(gate.pending_checkpoint(), None);
    drop((first, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_barrier_received_behind_unread_data_starts_the_alignment_timer() {
    // Within its timeout: the data comes first, in order, but the gate names the deadline
    // (a polling task's next poll, a blocking read's wake-up) before any barrier was read.
    let f = fixture();
    let (mut gate, sink, [mut sender0, sender1]) = unaligned_remote_gate(&f);
    let barrier = common::timeoutable_barrier(6, 3_600_000, 0);
    sender0.send(b"zero", DataType::DataBuffer, 0).unwrap();
    sender0.send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let zero = gate.poll_next().unwrap().expect("channel 0's data");
    assert_eq!((zero.channel, data(&zero.item)), (0, b"zero".to_vec()));
    assert_eq!(gate.pending_checkpoint(), None, "no barrier read yet");
    let deadline = gate.alignment_deadline().expect("the timer runs");
    assert!(deadline > Instant::now() + Duration::from_secs(3_000));
    assert!(persisted(&sink).is_empty());
    drop((zero, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_union_times_out_at_a_barrier_a_member_s_channel_received_behind_unread_data() {
    // The announcement comes from the second member's only channel: union channel 2.
    let f = fixture();
    let first_member = f.remote_gate(2);
    let second_member = f.remote_gate(1);
    let mut senders: Vec<Sender> = [(&first_member, 0), (&first_member, 1), (&second_member, 0)]
        .into_iter()
        .map(|(gate, i)| Sender::new(&attach(gate, i).0))
        .collect();
    let sink = Arc::new(common::RecordingSink::default());
    let mut gate = CheckpointedInputGate::new(
        UnionInputGate::new(vec![first_member, second_member]),
        AlignmentMode::Unaligned,
        Some(sink.clone()),
    );
    let barrier = common::timeoutable_barrier(7, 10, 60_000);
    senders[2].send(b"two", DataType::DataBuffer, 0).unwrap();
    senders[2].send_event(&barrier, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let first = gate.poll_next().unwrap().expect("the barrier");
    assert!(
        matches!(
            first.item,
            GateItem::Event { event: Event::CheckpointBarrier(b), .. }
                if b.id == 7 && b.alignment == Alignment::Unaligned
        ),
        "{first:?}"
    );
    assert_eq!(first.channel, 2);
    let two = gate.poll_next().unwrap().expect("the data taken ahead");
    assert_eq!((two.channel, data(&two.item)), (2, b"two".to_vec()));
    assert_eq!(persisted(&sink), [(7, 2, b"two".to_vec())]);
    assert_eq!(gate.blocked_channels(), &[2]);
    drop((first, two, gate, senders));
    assert_eq!(f.leased(), 0);
}

#[test]
fn a_cancelled_checkpoint_s_announcement_gives_the_timer_to_the_next_one() {
    // Checkpoint 5's and 6's barriers are both received behind data before the task reads
    // anything: the timer runs for 5, the older. 5 is cancelled (its marker overtakes the
    // data) before any of its barriers was read: the timer must go to 6, at 6's deadline.
    // Before, 5's deadline stayed and would have turned 6 unaligned at it, and 6, passed
    // over for 5 when both were announced, was not looked at again.
    let f = fixture();
    let (mut gate, _sink, [mut sender0, mut sender1]) = unaligned_remote_gate(&f);
    let five = common::timeoutable_barrier(5, 3_600_000, 0);
    let six = common::timeoutable_barrier(6, 7_200_000, 0);
    sender0.send(b"zero", DataType::DataBuffer, 0).unwrap();
    sender0.send_event(&five, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    sender1.send(b"one", DataType::DataBuffer, 0).unwrap();
    sender1.send_event(&six, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let zero = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&zero.item), b"zero");
    let hour = Instant::now() + Duration::from_secs(3_600);
    let five_s = gate.alignment_deadline().expect("the timer runs for 5");
    assert!(five_s <= hour, "5's deadline, an hour away");
    sender1.send_event(
        &Event::CancelCheckpointMarker(5),
        DataType::PrioritizedEventBuffer,
        0,
    );
    let marker = gate.poll_next().unwrap().expect("the marker");
    assert!(
        matches!(
            marker.item,
            GateItem::Event {
                event: Event::CancelCheckpointMarker(5),
                ..
            }
        ),
        "{marker:?}"
    );
    let one = gate.poll_next().unwrap().expect("data");
    assert_eq!(data(&one.item), b"one");
    let six_s = gate.alignment_deadline().expect("the timer runs for 6");
    assert!(
        six_s > hour + Duration::from_secs(1_800),
        "6's deadline, two hours away"
    );
    assert_eq!(gate.pending_checkpoint(), None);
    drop((zero, marker, one, gate, sender0, sender1));
    assert_eq!(f.leased(), 0);
}

#[test]
fn one_channel_may_borrow_every_floating_segment_of_its_gate() {
    // Flink caps a subpartition at `max-buffers-per-channel`, not an input channel: the hot
    // channel of a skewed input takes every floating segment its backlog asks for. It was
    // capped at 10 here, so raising `floating-buffers-per-gate` bought it nothing.
    let mut f = fixture();
    f.config
        .set("taskmanager.network.memory.floating-buffers-per-gate", "32")
        .unwrap();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let buffers = shared.buffers().clone();
    let mut sender = Sender::new(&shared);
    // Backlog 30 asks for 32 segments: one exclusive is free after the buffer, so 31
    // floating ones.
    sender.send(b"a", DataType::DataBuffer, 30).unwrap();
    assert_eq!(buffers.available(), 30 + EXCLUSIVE);
    assert_eq!(buffers.unannounced_credit(), 31);
    assert_eq!(f.leased(), EXCLUSIVE + 31);
    sender.assert_balanced();
    gate.close();
    drop((gate, shared, buffers, sender));
    assert_eq!(f.network.available_segments(), f.network.total_segments());
}

#[test]
fn a_gate_counts_remote_input_and_its_queue_under_flinks_names() {
    let f = fixture();
    let mut gate = f.remote_gate(1);
    let (shared, _announcements) = attach(&gate, 0);
    let mut sender = Sender::new(&shared);
    for bytes in [&b"one"[..], b"two"] {
        sender.send(bytes, DataType::DataBuffer, 0).unwrap();
    }
    let queued = gate.metrics_snapshot();
    assert_eq!(queued.input_queue_length, 2, "{queued}");
    assert_eq!(queued.num_buffers_in_remote, 0, "nothing read yet");
    let one = gate.next_timeout(LONG).unwrap().expect("a buffer");
    let read = gate.metrics_snapshot();
    assert_eq!(read.input_queue_length, 1, "{read}");
    assert_eq!(
        (read.num_buffers_in_remote, read.num_bytes_in_remote),
        (1, 3),
        "{read}"
    );
    assert_eq!((read.num_buffers_in_local, read.num_bytes_in_local), (0, 0));
    assert_eq!(
        (read.num_buffers_in, read.num_bytes_in),
        (read.num_buffers_in_remote, read.num_bytes_in_remote)
    );
    drop(one);
    gate.close();
    drop((gate, shared, sender));
    assert_eq!(f.leased(), 0);
}

#[test]
fn an_announcement_passed_over_is_found_after_its_older_checkpoint_is_aborted_unaligned() {
    // Checkpoint 7's barrier waits behind data on channel 1 while 5's, older, holds the
    // timer. 5 turns unaligned, then 6 aborts it: 5's announcement goes stale while 6 runs
    // unaligned, when nothing is scanned. Once 6 ends (cancelled), the gate must still look
    // for what the first scan passed over: 7 gets its timer. (The rescan owed was dropped
    // with the stale announcement, and 7's timer waited for the task to read as far as 7.)
    let f = fixture();
    let gate = f.remote_gate(3);
    let mut senders: Vec<Sender> = (0..3).map(|i| Sender::new(&attach(&gate, i).0)).collect();
    let sink = Arc::new(common::RecordingSink::default());
    let mut gate = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, Some(sink));
    let unaligned = |id| {
        Event::CheckpointBarrier(CheckpointBarrier {
            id,
            timestamp: 0,
            kind: CheckpointKind::Checkpoint,
            alignment: Alignment::Unaligned,
        })
    };
    let next = |gate: &mut CheckpointedInputGate<SingleInputGate>| {
        gate.poll_next().unwrap().expect("an item")
    };
    senders[0].send(b"zero", DataType::DataBuffer, 0).unwrap();
    let five = common::timeoutable_barrier(5, 3_600_000, 0);
    senders[0].send_event(&five, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    senders[1].send(b"one", DataType::DataBuffer, 0).unwrap();
    let seven = common::timeoutable_barrier(7, 10_800_000, 0);
    senders[1].send_event(&seven, DataType::TimeoutableAlignedCheckpointBarrier, 0);
    let zero = next(&mut gate);
    assert_eq!(data(&zero.item), b"zero");
    assert!(gate.alignment_deadline().is_some(), "5's timer");
    // 5 turns unaligned (channel 1 has not sent its barrier 5), then 6 aborts it.
    senders[2].send_event(&unaligned(5), DataType::PrioritizedEventBuffer, 0);
    let u5 = next(&mut gate);
    assert!(
        matches!(u5.item, GateItem::Event { event: Event::CheckpointBarrier(b), .. } if b.id == 5)
    );
    senders[2].send_event(&unaligned(6), DataType::PrioritizedEventBuffer, 0);
    let cancel5 = next(&mut gate);
    assert!(matches!(
        cancel5.item,
        GateItem::Event {
            event: Event::CancelCheckpointMarker(5),
            ..
        }
    ));
    let u6 = next(&mut gate);
    assert!(
        matches!(u6.item, GateItem::Event { event: Event::CheckpointBarrier(b), .. } if b.id == 6)
    );
    assert_eq!(gate.pending_checkpoint(), Some(6));
    // 6 is cancelled.
    senders[0].send_event(
        &Event::CancelCheckpointMarker(6),
        DataType::PrioritizedEventBuffer,
        0,
    );
    let cancel6 = next(&mut gate);
    assert!(matches!(
        cancel6.item,
        GateItem::Event {
            event: Event::CancelCheckpointMarker(6),
            ..
        }
    ));
    assert_eq!(gate.pending_checkpoint(), None);
    let one = next(&mut gate);
    assert_eq!(data(&one.item), b"one");
    let deadline = gate.alignment_deadline().expect("7's timer runs");
    assert!(deadline > Instant::now() + Duration::from_secs(2 * 3_600));
    drop((zero, u5, cancel5, u6, cancel6, one, gate, senders));
    assert_eq!(f.leased(), 0);
}
