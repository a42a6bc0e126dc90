//! The producer side: what a subpartition view returns, when its listener hears of it, and
//! where every segment goes.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::buffer::{DataType, NetworkBufferPool, PoolError};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::partition::{
    AvailabilityListener, BufferAndBacklog, BufferTimeout, ChannelSelector, KeyHashSelector,
    PartitionError, PartitionManager, RecordWriter, ResultPartition, ResultPartitionId,
    RoundRobinSelector, Selection, SubpartitionView,
};
use fluxgate::record::{RecordDeserializer, RecordError};
use fluxgate::NetworkConfig;
use proptest::prelude::*;

const LONG: Duration = Duration::from_secs(20);
const ID: ResultPartitionId = ResultPartitionId {
    partition: 1,
    producer: 7,
};

fn setup(segments: usize) -> (NetworkBufferPool, NetworkConfig) {
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
    config.set("fluxgate.memory.arena-size", "256kb").unwrap();
    (NetworkBufferPool::new(&config).unwrap(), config)
}

/// Counts notifications and lets a thread wait for the next one.
#[derive(Default)]
struct Signal {
    count: Mutex<usize>,
    cond: Condvar,
    priority: AtomicUsize,
}

impl Signal {
    fn notifications(&self) -> usize {
        *self.count.lock().unwrap()
    }

    /// Waits until more than `seen` notifications arrived; false after `LONG`.
    fn wait_beyond(&self, seen: usize) -> bool {
        let guard = self.count.lock().unwrap();
        let (guard, _) = self
            .cond
            .wait_timeout_while(guard, LONG, |count| *count <= seen)
            .unwrap();
        *guard > seen
    }
}

impl AvailabilityListener for Signal {
    fn notify_data_available(&self) {
        *self.count.lock().unwrap() += 1;
        self.cond.notify_all();
    }

    fn notify_priority_event(&self) {
        self.priority.fetch_add(1, Ordering::SeqCst);
        self.notify_data_available();
    }
}

fn view(partition: &ResultPartition, index: usize) -> (SubpartitionView, Arc<Signal>) {
    let signal = Arc::new(Signal::default());
    let view = partition
        .handle()
        .create_view(index, signal.clone())
        .unwrap();
    (view, signal)
}

fn records_of(item: &BufferAndBacklog) -> Vec<Vec<u8>> {
    assert_eq!(item.buffer.data_type(), DataType::DataBuffer);
    let mut reader = RecordDeserializer::new(1 << 20);
    reader.set_next_buffer(item.buffer.clone()).unwrap();
    let mut out = Vec::new();
    while let Some(r) = reader.next_record().unwrap() {
        out.push(r.to_vec());
    }
    out
}

/// Records read across buffers (a record may span several), each summarised as its length and
/// first byte so that a failed comparison prints a short line.
struct SpanningReader {
    reader: RecordDeserializer,
    records: Vec<(usize, u8)>,
}

impl SpanningReader {
    fn new() -> Self {
        Self {
            reader: RecordDeserializer::new(1 << 20),
            records: Vec::new(),
        }
    }

    fn read(&mut self, item: &BufferAndBacklog) {
        self.reader.set_next_buffer(item.buffer.clone()).unwrap();
        while let Some(record) = self.reader.next_record().unwrap() {
            assert!(
                record.iter().all(|&b| b == record[0]),
                "a record of mixed bytes"
            );
            self.records.push((record.len(), record[0]));
        }
    }
}

#[test]
fn partial_buffers_are_readable_only_after_a_flush_and_the_listener_hears_once() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&b"one"[..], 0).unwrap();
    partition.emit_record(&b"two"[..], 0).unwrap();
    assert!(view.poll_next().is_none(), "unflushed data is not readable");
    assert_eq!(signal.notifications(), 0);
    partition.flush(0);
    assert_eq!(signal.notifications(), 1);
    partition.flush(0);
    assert_eq!(
        signal.notifications(),
        1,
        "no second notification before the reader looks"
    );
    let item = view.poll_next().unwrap();
    assert_eq!(records_of(&item), vec![b"one".to_vec(), b"two".to_vec()]);
    assert_eq!(item.sequence_number, 0);
    assert!(view.poll_next().is_none());
    partition.emit_record(&b"three"[..], 0).unwrap();
    partition.flush(0);
    assert_eq!(
        signal.notifications(),
        2,
        "empty → readable again notifies again"
    );
    drop(item);
    let item = view.poll_next().unwrap();
    assert_eq!(records_of(&item), vec![b"three".to_vec()]);
    assert_eq!(
        item.buffer.offset(),
        8,
        "the same segment, read on from where it stopped (two 1-byte lengths, 6 bytes)"
    );
    assert_eq!(item.sequence_number, 1);
    drop((item, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A flush tells a parked reader only when it makes bytes readable that the reader has not
/// read (Flink's `flush` looks at the last buffer's data): readers of an idle subpartition,
/// with or without a half-read buffer, are not woken every buffer timeout. They were.
#[test]
fn a_flush_with_nothing_new_to_read_leaves_the_reader_parked() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.flush(0);
    assert_eq!(signal.notifications(), 0, "nothing written yet");
    partition.emit_record(&b"one"[..], 0).unwrap();
    partition.flush(0);
    assert_eq!(signal.notifications(), 1);
    let item = view.poll_next().expect("the flushed record");
    assert_eq!(records_of(&item), [b"one".to_vec()]);
    assert!(
        view.poll_next().is_none(),
        "read to the end of what was written"
    );
    partition.flush(0);
    partition.flush(0);
    assert_eq!(
        signal.notifications(),
        1,
        "the half-read buffer holds nothing new"
    );
    drop((item, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn full_buffers_are_readable_with_backlog_and_consecutive_sequence_numbers() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    let record = [9u8; 1022]; // 1024 bytes with its 2-byte prefix: 4 per segment
    for _ in 0..12 {
        partition.emit_record(&record[..], 0).unwrap();
    }
    // 12 records fill 3 segments exactly; the third is finished when the 13th needs room.
    partition.emit_record(&record[..], 0).unwrap();
    assert_eq!(
        signal.notifications(),
        1,
        "notified at the first finished buffer only"
    );
    let mut sequence = Vec::new();
    let mut backlogs = Vec::new();
    while let Some(item) = view.poll_next() {
        assert_eq!(records_of(&item).len(), 4);
        sequence.push(item.sequence_number);
        backlogs.push(item.backlog);
    }
    assert_eq!(sequence, vec![0, 1, 2]);
    assert_eq!(backlogs, vec![2, 1, 0]);
    let metrics = partition.handle();
    assert_eq!(metrics.metrics().num_buffers_out.get(), 3);
    assert_eq!(metrics.metrics().num_records_out.get(), 13);
    drop((view, metrics, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_broadcast_buffer_counts_once_per_subpartition_in_the_output_metrics() {
    // Flink's `numBuffersOut` and `numBytesOut` count a broadcast buffer once per subpartition:
    // each consumer receives its own copy.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 3, &network, &config).unwrap();
    let record = [5u8; 1022]; // 1024 bytes with its 2-byte prefix: 4 per segment
    for _ in 0..4 {
        partition.broadcast_record(&record[..]).unwrap();
    }
    partition.emit_record(&record[..], 1).unwrap(); // finishes the full broadcast buffer
    partition.finish().unwrap(); // finishes the unicast one
    let metrics = partition.metrics_snapshot();
    assert_eq!(metrics.num_buffers_out, 3 + 1);
    assert_eq!(metrics.num_bytes_out, 3 * 4096 + 1024);
    assert_eq!(metrics.num_records_out, 5);
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn buffers_a_release_drops_are_not_counted_as_sent() {
    // Flink closes the builders of a released partition without counting them: their bytes
    // never leave. The unicast buffer the broadcast finished was queued, and counts.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    partition.broadcast_record(&[2u8; 100][..]).unwrap();
    partition.release();
    let metrics = partition.metrics_snapshot();
    assert_eq!((metrics.num_buffers_out, metrics.num_bytes_out), (1, 101));
    assert_eq!(metrics.num_records_out, 2);
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_buffer_filled_to_its_end_is_finished_at_once() {
    // Flink finishes a builder the moment it is full: with no flushes, a record ending
    // exactly at the segment's end makes the buffer readable, without a later record.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    let record = [3u8; 1022]; // 1024 bytes with its 2-byte prefix: 4 fill a 4 KiB segment
    for _ in 0..4 {
        partition.emit_record(&record[..], 0).unwrap();
    }
    assert_eq!(signal.notifications(), 1, "the full buffer was announced");
    let item = view.poll_next().expect("the full buffer is readable");
    assert_eq!(records_of(&item).len(), 4);
    assert_eq!(item.backlog, 0);
    // The same through the general path: a spanning record that ends at a segment's end.
    partition.emit_record(&[4u8; 4096 + 4094][..], 0).unwrap();
    let first = view.poll_next().expect("the first segment of the record");
    let second = view.poll_next().expect("the second, full, segment");
    assert_eq!(first.buffer.len() + second.buffer.len(), 2 * 4096);
    drop((item, first, second, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A user record whose encoding fails after writing part of it.
struct FailingRecord {
    declared: usize,
    written: usize,
}

impl fluxgate::record::Record for FailingRecord {
    fn encoded_len(&self) -> usize {
        self.declared
    }

    fn encode<S: fluxgate::record::SegmentSink>(
        &self,
        out: &mut fluxgate::record::RecordOutput<'_, S>,
    ) -> Result<(), fluxgate::record::RecordError> {
        out.write(&vec![0xEE; self.written])?;
        Err(fluxgate::record::RecordError::Truncated)
    }
}

/// A user type whose encoding panics where [`FailingRecord`]'s returns its error.
struct PanickingRecord(FailingRecord);

impl fluxgate::record::Record for PanickingRecord {
    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
    }

    fn encode<S: fluxgate::record::SegmentSink>(
        &self,
        out: &mut fluxgate::record::RecordOutput<'_, S>,
    ) -> Result<(), fluxgate::record::RecordError> {
        let _ = self.0.encode(out);
        panic!("a user type's encoding fails");
    }
}

/// How the emit of a record ended: its result, or `Err` with the payload of a panic its
/// encoding raised (caught, as a caller that goes on writing does).
type Emitted = std::thread::Result<Result<(), PartitionError>>;

/// A writer emits `before`, then `record`, then `after`, and flushes: how `record`'s emit
/// ended and every record a reader then gets. Every segment is back at the end. `after`
/// must be written unless `record` failed after part of it was published (the partition is
/// released then).
fn records_around<R: fluxgate::record::Record>(
    before: &[u8],
    record: &R,
    after: &[u8],
) -> (Emitted, Vec<Vec<u8>>) {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(before, 0).unwrap();
    let emitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        partition.emit_record(record, 0)
    }));
    match partition.emit_record(after, 0) {
        Ok(()) => {}
        Err(PartitionError::Released) => assert!(partition.handle().is_released()),
        Err(other) => panic!("`after` failed: {other}"),
    }
    partition.flush(0);
    let mut reader = RecordDeserializer::new(1 << 20);
    let mut records = Vec::new();
    let mut items = Vec::new();
    for _ in 0..16 {
        let Some(item) = view.poll_next() else { break };
        reader.set_next_buffer(item.buffer.clone()).unwrap();
        while let Some(record) = reader.next_record().unwrap() {
            records.push(record.to_vec());
        }
        items.push(item);
    }
    drop((items, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
    (emitted, records)
}

/// A caller that catches a panic of its record's `encode` and goes on writing: the bytes the
/// panicking record left in the segment are not published with the next record (they were,
/// misframing everything after them).
#[test]
fn a_record_whose_encoding_panics_leaves_nothing_behind() {
    let panicking = PanickingRecord(FailingRecord {
        declared: 10,
        written: 3,
    });
    let (emitted, records) = records_around(&[0x11; 6], &panicking, &[0x22; 5]);
    assert!(emitted.is_err(), "the panic reaches the caller");
    assert_eq!(records, [vec![0x11; 6], vec![0x22; 5]]);
}

/// As above, once part of the record went out in a finished segment: it cannot be taken
/// back, so the partition is released (as a Flink task failing in serialization releases its
/// partitions) before any more of it is published. The reader gets no record made of it (it
/// got one padded with zeros, a record the producer never wrote), and the next write fails.
#[test]
fn a_record_whose_encoding_panics_after_crossing_a_segment_releases_the_partition() {
    // 3 + 4083 bytes leave ten bytes of the 4 KiB segment free: 50 bytes cross it.
    let panicking = PanickingRecord(FailingRecord {
        declared: 100,
        written: 50,
    });
    let (emitted, records) = records_around(&[0x11; 4083], &panicking, &[0x22; 5]);
    assert!(emitted.is_err(), "the panic reaches the caller");
    assert!(
        records.is_empty() || records == [vec![0x11; 4083]],
        "{:?}",
        records.iter().map(Vec::len).collect::<Vec<_>>()
    );
}

/// A broken user type: its contiguous bytes are longer than the length it declares.
struct LongerThanDeclared;

impl fluxgate::record::Record for LongerThanDeclared {
    fn encoded_len(&self) -> usize {
        4
    }

    fn encode<S: fluxgate::record::SegmentSink>(
        &self,
        out: &mut fluxgate::record::RecordOutput<'_, S>,
    ) -> Result<(), fluxgate::record::RecordError> {
        out.write(&[0xEE; 8])
    }

    fn as_contiguous(&self) -> Option<&[u8]> {
        Some(&[0xEE; 8])
    }
}

/// The fast path writes a contiguous record only when its bytes have the declared length,
/// the one its room and `max_record_bytes` were checked for. It used to write them whatever
/// their length: here the caller was told of success for a record it declared otherwise,
/// and with less room it panicked past the segment's end.
#[test]
fn contiguous_bytes_longer_than_declared_are_refused() {
    let (emitted, records) = records_around(&[0x11; 6], &LongerThanDeclared, &[0x22; 5]);
    assert!(matches!(
        emitted,
        Ok(Err(PartitionError::Record(RecordError::LengthMismatch {
            declared: 4,
            written: 8
        })))
    ));
    assert_eq!(records, [vec![0x11; 6], vec![0x22; 5]]);
}

/// The segment fills exactly as the failing record's bytes go in, and `encode` fails before
/// anything asks for the next segment: nothing is published yet, so the record is taken back
/// too. (It used to count as crossed into another segment at once, and went out padded with
/// zeros; or whole, though its caller was told it failed.)
#[test]
fn a_record_whose_encoding_fails_just_as_it_fills_the_segment_sends_nothing() {
    // The 2-byte prefix alone fills it (declared 200); the record's one byte fills it.
    for (declared, written) in [(200, 0), (1, 1)] {
        // 2 + 4092 bytes: two bytes of the 4 KiB segment stay free.
        let failed = FailingRecord { declared, written };
        let (emitted, records) = records_around(&[0x11; 4092], &failed, &[0x22; 5]);
        assert!(
            matches!(emitted, Ok(Err(_))),
            "declared {declared}, written {written}"
        );
        assert_eq!(
            records,
            [vec![0x11; 4092], vec![0x22; 5]],
            "declared {declared}, written {written}"
        );
    }
}

#[test]
fn a_record_whose_encoding_fails_within_a_segment_sends_nothing() {
    // Flink serializes into a separate buffer first, so a failed record sends nothing; here it
    // is written straight into the segment and taken back while no part of it was published.
    let failed = FailingRecord {
        declared: 100,
        written: 40,
    };
    let (emitted, records) = records_around(b"before", &failed, b"after");
    assert!(matches!(emitted, Ok(Err(_))));
    assert_eq!(records, [b"before".to_vec(), b"after".to_vec()]);
}

/// A record whose encoding fails as the first in a fresh buffer leaves that buffer empty: it
/// is never sent (the reader skips it), so it is not counted as a buffer sent either.
#[test]
fn an_empty_buffer_left_by_a_failed_record_is_not_counted_as_sent() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let failed = FailingRecord {
        declared: 100,
        written: 40,
    };
    assert!(partition.emit_record(&failed, 0).is_err());
    partition.finish().unwrap();
    let item = view.poll_next().expect("EndOfPartition");
    assert_eq!(event_of(&item), Event::EndOfPartition);
    let metrics = partition.metrics_snapshot();
    assert_eq!((metrics.num_buffers_out, metrics.num_bytes_out), (0, 0));
    drop((item, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_record_failing_after_its_prefix_filled_a_segment_releases_the_partition() {
    // The prefix fills the segment exactly, so writing the record's body publishes it: the
    // record can no longer be taken back, and the partition is released instead of a record
    // padded with zeros going out.
    // 4094 bytes with its 2-byte prefix leave 0; 4092 leave 2: the next prefix's size.
    let failed = FailingRecord {
        declared: 200,
        written: 100,
    };
    let (emitted, records) = records_around(&[1u8; 4092], &failed, b"after");
    assert!(matches!(emitted, Ok(Err(_))));
    let lengths: Vec<usize> = records.iter().map(Vec::len).collect();
    assert!(
        lengths.is_empty() || lengths == [4092],
        "no record made of the failed one: {lengths:?}"
    );
}

#[test]
fn an_aligned_barrier_is_refused_as_a_priority_event() {
    // It would not block its channel, so records after it would reach the consumer before the
    // alignment ends.
    let (network, config) = setup(16);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    for alignment in [Alignment::Aligned, Alignment::ForcedAligned] {
        assert_eq!(
            partition.broadcast_event(&barrier(1, alignment), true),
            Err(PartitionError::PriorityAlignedBarrier)
        );
    }
    assert!(view.poll_next().is_none(), "nothing was queued");
    partition
        .broadcast_event(&barrier(1, Alignment::Unaligned), true)
        .unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_event_ending_the_data_is_refused_as_a_priority_event() {
    // Overtaking, it would end its channels with the data before it still queued (a remote
    // consumer now refuses such a frame too).
    let (network, config) = setup(16);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    for event in [
        Event::EndOfPartition,
        Event::EndOfData(fluxgate::event::StopMode::Drain),
        Event::EndOfChannelState,
    ] {
        assert_eq!(
            partition.broadcast_event(&event, true),
            Err(PartitionError::PriorityEndEvent(event))
        );
    }
    assert!(view.poll_next().is_none(), "nothing was queued");
    partition
        .broadcast_event(&Event::CancelCheckpointMarker(1), true)
        .unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
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
fn an_unaligned_barrier_overtakes_queued_data_and_says_how_much() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    let record = [1u8; 2044]; // two records per 4 KiB segment
    for _ in 0..6 {
        partition.emit_record(&record[..], 0).unwrap();
    }
    partition
        .broadcast_event(&barrier(3, Alignment::Unaligned), true)
        .unwrap();
    assert_eq!(signal.priority.load(Ordering::SeqCst), 1);
    let first = view.poll_next().unwrap();
    assert_eq!(first.buffer.data_type(), DataType::PrioritizedEventBuffer);
    assert_eq!(
        Event::decode(first.buffer.as_slice()).unwrap(),
        barrier(3, Alignment::Unaligned)
    );
    assert_eq!(first.sequence_number, 0);
    assert_eq!(
        first.overtaken, 3,
        "three data buffers were queued before it"
    );
    assert_eq!(first.next_data_type, DataType::DataBuffer);
    let rest: Vec<_> = std::iter::from_fn(|| view.poll_next()).collect();
    assert_eq!(rest.len(), 3);
    assert!(rest.iter().all(|i| i.overtaken == 0));
    assert_eq!(
        rest.iter().map(|i| i.sequence_number).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    drop((first, rest, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_aligned_barrier_keeps_its_place_and_blocks_until_resumed() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(&b"before"[..], 0).unwrap();
    partition
        .broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    partition.emit_record(&b"after"[..], 0).unwrap();
    partition.flush(0);
    let before = view.poll_next().unwrap();
    assert_eq!(records_of(&before), vec![b"before".to_vec()]);
    assert_eq!(before.next_data_type, DataType::AlignedCheckpointBarrier);
    let barrier_item = view.poll_next().unwrap();
    assert_eq!(
        barrier_item.buffer.data_type(),
        DataType::AlignedCheckpointBarrier
    );
    assert!(view.is_blocked());
    assert!(
        view.poll_next().is_none(),
        "blocked until resume_consumption"
    );
    assert_eq!(view.availability_and_backlog(true), (false, 0));
    assert!(view.resume_consumption());
    let after = view.poll_next().unwrap();
    assert_eq!(records_of(&after), vec![b"after".to_vec()]);
    drop((before, barrier_item, after, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A partition of one subpartition whose reader took an aligned barrier: its view is blocked.
fn view_blocked_by_a_barrier() -> (
    NetworkBufferPool,
    ResultPartition,
    SubpartitionView,
    Arc<Signal>,
    BufferAndBacklog,
) {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition
        .broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    let barrier_item = view.poll_next().expect("the barrier");
    assert!(view.is_blocked());
    (network, partition, view, signal, barrier_item)
}

/// A view resumed after an aligned barrier whose look takes the buffer the writer started
/// meanwhile (not flushed yet): the next flush must judge by that buffer. It judged by the
/// "no buffer" the reader had parked with, and with nothing else queued stayed silent, the
/// record unread until the buffer filled.
#[test]
fn a_flush_after_a_resume_tells_of_the_buffer_started_while_blocked() {
    let (network, mut partition, mut view, signal, barrier_item) = view_blocked_by_a_barrier();
    partition.emit_record(&b"after"[..], 0).unwrap();
    assert!(!view.resume_consumption(), "the record is not flushed yet");
    let heard = signal.notifications();
    partition.flush(0);
    assert_eq!(
        signal.notifications(),
        heard + 1,
        "the flush tells the reader"
    );
    let after = view.poll_next().expect("the flushed record");
    assert_eq!(records_of(&after), vec![b"after".to_vec()]);
    drop((barrier_item, after, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// While an aligned barrier blocks the view, nothing the writer does is readable, so nothing
/// wakes the reader for it (Flink's subpartition notifies no blocked reader): a network
/// sender was woken for every buffer finished and every timed flush, only to park again.
/// Resuming, the reader looks itself.
#[test]
fn a_blocked_reader_is_not_woken_by_data_it_cannot_read() {
    let (network, mut partition, mut view, signal, barrier_item) = view_blocked_by_a_barrier();
    assert!(view.poll_next().is_none(), "blocked");
    let heard = signal.notifications();
    // 4094 bytes with their 2-byte prefix fill (and finish) a buffer; the flush makes the
    // next one's record readable too.
    partition.emit_record(&[1u8; 4094][..], 0).unwrap();
    partition.emit_record(&[2u8; 10][..], 0).unwrap();
    partition.flush(0);
    assert_eq!(signal.notifications(), heard, "a blocked reader was woken");
    assert!(view.resume_consumption(), "readable once resumed");
    let first = view.poll_next().expect("the full buffer");
    assert_eq!(records_of(&first), vec![vec![1u8; 4094]]);
    drop((barrier_item, first, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A barrier aligned with a timeout, of a checkpoint that started now.
fn timeoutable_barrier(id: u64, timeout_ms: u64) -> Event {
    common::timeoutable_barrier(id, timeout_ms, 0)
}

/// Reads a subpartition through its EndOfPartition: the records, and the events in order.
fn read_to_end(view: &mut SubpartitionView, signal: &Signal) -> (SpanningReader, Vec<Event>) {
    let mut spanning = SpanningReader::new();
    let mut events = Vec::new();
    while events.last() != Some(&Event::EndOfPartition) {
        let seen = signal.notifications();
        match view.poll_next() {
            Some(item) if item.buffer.data_type() == DataType::DataBuffer => spanning.read(&item),
            Some(item) => events.push(event_of(&item)),
            None => assert!(signal.wait_beyond(seen), "the writer stalled"),
        }
    }
    (spanning, events)
}

fn event_of(item: &BufferAndBacklog) -> Event {
    Event::decode(item.buffer.as_slice()).unwrap()
}

/// `barrier` as an alignment that timed out turns it.
fn unaligned(barrier: &Event) -> Event {
    match barrier {
        Event::CheckpointBarrier(b) => Event::CheckpointBarrier(b.as_unaligned()),
        other => panic!("not a barrier: {other:?}"),
    }
}

/// A one-subpartition partition over `segments` segments of network memory holding
/// `records` records of 2044 bytes (two per 4 KiB segment), then checkpoint 5's aligned
/// barrier with a timeout of `timeout_ms`; its view and that barrier.
fn records_then_a_timeoutable_barrier(
    segments: usize,
    records: usize,
    timeout_ms: u64,
) -> (
    NetworkBufferPool,
    ResultPartition,
    SubpartitionView,
    Arc<Signal>,
    Event,
) {
    let (network, config) = setup(segments);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (view, signal) = view(&partition, 0);
    let record = [1u8; 2044];
    for _ in 0..records {
        partition.emit_record(&record[..], 0).unwrap();
    }
    let barrier = timeoutable_barrier(5, timeout_ms);
    partition.broadcast_event(&barrier, false).unwrap();
    (network, partition, view, signal, barrier)
}

/// After `barrier` turned unaligned: no timer is left, its reader heard of a priority event,
/// and the barrier's unaligned copy comes out first (returned).
fn assert_unaligned_comes_first(
    view: &mut SubpartitionView,
    signal: &Signal,
    partition: &ResultPartition,
    barrier: &Event,
) -> BufferAndBacklog {
    assert_eq!(partition.aligned_barrier_deadline(), None);
    assert_eq!(signal.priority.load(Ordering::SeqCst), 1);
    let first = view.poll_next().unwrap();
    assert_eq!(first.buffer.data_type(), DataType::PrioritizedEventBuffer);
    assert_eq!(event_of(&first), unaligned(barrier));
    first
}

/// A back-pressured partition, whose every segment holds queued data, still turns its
/// barrier unaligned at the timeout: the copy goes into memory of its own, as Flink
/// serializes it into unpooled memory. It needed a pool or overdraft segment, and a
/// partition with none left kept its barrier aligned behind the data.
#[test]
fn a_barrier_times_out_into_memory_of_its_own_when_every_segment_is_queued() {
    let (network, mut partition, mut view, signal, barrier) =
        records_then_a_timeoutable_barrier(4, 6, 3_600_000);
    assert_eq!(network.available_segments(), 0, "every segment is queued");
    assert_eq!(partition.aligned_barrier_timeout(5), 1);
    drop(assert_unaligned_comes_first(
        &mut view, &signal, &partition, &barrier,
    ));
    // The data it overtook, then (with segments free again) the end.
    let mut records = SpanningReader::new();
    for _ in 0..3 {
        let item = view.poll_next().expect("a buffer of the data overtaken");
        records.read(&item);
    }
    assert_eq!(records.records.len(), 6);
    partition.finish().unwrap();
    let (_, events) = read_to_end(&mut view, &signal);
    assert_eq!(events, [Event::EndOfPartition]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A writer waiting in an async emit under back pressure still turns its aligned barrier
/// unaligned once the timeout passes: a future has no clock, so it is woken at the deadline,
/// as the blocking emit's wait fires the timer then. Nothing woke it, and the barrier stayed
/// aligned behind the data for as long as the consumer held the segments.
#[test]
fn an_async_emit_waiting_under_back_pressure_turns_its_barrier_unaligned_when_due() {
    let (network, mut partition, mut view, signal, barrier) =
        records_then_a_timeoutable_barrier(4, 6, 500);
    assert_eq!(network.available_segments(), 0, "every segment is queued");
    let waker = Arc::new(CountingWaker::default());
    let waker_handle = std::task::Waker::from(waker.clone());
    let mut context = std::task::Context::from_waker(&waker_handle);
    let mut overtaken = SpanningReader::new();
    {
        let mut emit = std::pin::pin!(partition.emit_record_async(&[2u8; 2044][..], 0));
        assert!(
            emit.as_mut().poll(&mut context).is_pending(),
            "no segment is free"
        );
        // Unless this thread was held up past the deadline before its first poll (which then
        // fired the timer itself), the wait must be woken at the deadline to fire it.
        if signal.priority.load(Ordering::SeqCst) == 0 {
            assert!(
                common::wait_until(LONG, || waker.0.load(Ordering::SeqCst) > 0),
                "the barrier's deadline woke the waiting writer"
            );
            assert!(
                emit.as_mut().poll(&mut context).is_pending(),
                "still no segment is free"
            );
        }
        assert_eq!(signal.priority.load(Ordering::SeqCst), 1);
        let first = view.poll_next().expect("the barrier's unaligned copy");
        assert_eq!(first.buffer.data_type(), DataType::PrioritizedEventBuffer);
        assert_eq!(event_of(&first), unaligned(&barrier));
        for _ in 0..3 {
            let item = view.poll_next().expect("a buffer of the data overtaken");
            overtaken.read(&item);
        }
        match emit.as_mut().poll(&mut context) {
            std::task::Poll::Ready(result) => result.unwrap(),
            std::task::Poll::Pending => panic!("segments came back, yet the record still waits"),
        }
    }
    assert_eq!(overtaken.records, [(2044, 1); 6]);
    assert_eq!(partition.aligned_barrier_deadline(), None);
    partition.finish().unwrap();
    let (after, events) = read_to_end(&mut view, &signal);
    assert_eq!(after.records, [(2044, 2)]);
    assert_eq!(
        events,
        [Event::EndOfPartition],
        "the aligned original is dropped"
    );
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Flink's producer-side `alignedBarrierTimeout`: an aligned barrier with a timeout still
/// queued when its timeout passes turns unaligned. Its unaligned copy overtakes the data
/// queued before it and says how much; the aligned original never comes out, so the view is
/// never blocked; the data after it follows in order.
#[test]
fn a_queued_barrier_turned_unaligned_overtakes_the_data_before_it() {
    let (network, mut partition, mut view, signal, barrier) =
        records_then_a_timeoutable_barrier(64, 4, 3_600_000);
    partition.emit_record(&b"after"[..], 0).unwrap();
    partition.flush(0);
    assert!(partition.aligned_barrier_deadline().is_some());
    assert_eq!(
        partition.aligned_barrier_timeout(4),
        0,
        "another checkpoint"
    );
    assert_eq!(partition.aligned_barrier_timeout(5), 1);
    let first = assert_unaligned_comes_first(&mut view, &signal, &partition, &barrier);
    assert_eq!(first.overtaken, 2, "two data buffers were queued before it");
    let rest: Vec<_> = std::iter::from_fn(|| view.poll_next()).collect();
    assert!(
        rest.iter()
            .all(|i| i.buffer.data_type() == DataType::DataBuffer),
        "the aligned original is dropped: {:?}",
        rest.iter()
            .map(|i| i.buffer.data_type())
            .collect::<Vec<_>>()
    );
    assert_eq!(rest.len(), 3);
    assert_eq!(records_of(&rest[2]), vec![b"after".to_vec()]);
    assert!(!view.is_blocked());
    assert_eq!(
        rest.iter().map(|i| i.sequence_number).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    drop((first, rest, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A barrier its reader took before the timeout went out aligned, in place: the timeout
/// turns nothing, and no second barrier follows.
#[test]
fn a_barrier_taken_before_its_timeout_stays_aligned() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(&b"before"[..], 0).unwrap();
    let barrier = timeoutable_barrier(6, 3_600_000);
    partition.broadcast_event(&barrier, false).unwrap();
    let before = view.poll_next().unwrap();
    assert_eq!(records_of(&before), vec![b"before".to_vec()]);
    let aligned = view.poll_next().unwrap();
    assert_eq!(
        aligned.buffer.data_type(),
        DataType::TimeoutableAlignedCheckpointBarrier
    );
    assert_eq!(event_of(&aligned), barrier);
    assert_eq!(partition.aligned_barrier_timeout(6), 0);
    assert!(!view.resume_consumption(), "nothing queued after it");
    assert!(view.poll_next().is_none(), "no second barrier");
    drop((before, aligned, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A reader that only looked at the barrier (the type of the next item, reported with the
/// item before it) has not taken it: the timeout still turns it unaligned, as Flink's
/// barrier times out until its reader polls it. The look claimed it, so it went out aligned
/// and blocked its channel at the consumer, whose alignment had timed out meanwhile.
#[test]
fn a_barrier_the_reader_only_looked_at_still_times_out() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&b"before"[..], 0).unwrap();
    let barrier = timeoutable_barrier(6, 3_600_000);
    partition.broadcast_event(&barrier, false).unwrap();
    let before = view.poll_next().unwrap();
    assert_eq!(records_of(&before), vec![b"before".to_vec()]);
    assert_eq!(
        before.next_data_type,
        DataType::TimeoutableAlignedCheckpointBarrier,
        "the reader looked at the barrier"
    );
    // The looks of a server deciding what it may send next take nothing either.
    let _ = view.availability_and_backlog(false);
    assert_eq!(partition.aligned_barrier_timeout(6), 1);
    let first = assert_unaligned_comes_first(&mut view, &signal, &partition, &barrier);
    assert_eq!(first.overtaken, 0, "nothing queued before it is left");
    assert!(
        view.poll_next().is_none(),
        "the aligned original is dropped"
    );
    partition.finish().unwrap();
    let (_, events) = read_to_end(&mut view, &signal);
    assert_eq!(events, [Event::EndOfPartition]);
    drop((before, first, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A timer outliving its barrier (taken in place) turns nothing of the next checkpoint's
/// barrier: conversion goes by checkpoint, and a barrier that cannot time out (a savepoint's)
/// is not tracked at all. (Timer 5 once sent barrier 5 again in place of barrier 6.)
#[test]
fn a_barrier_timer_turns_only_its_own_checkpoints_barrier() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let five = timeoutable_barrier(5, 3_600_000);
    partition.broadcast_event(&five, false).unwrap();
    let taken = view.poll_next().unwrap();
    assert_eq!(event_of(&taken), five);
    view.resume_consumption();
    let Event::CheckpointBarrier(mut six) = timeoutable_barrier(6, 3_600_000) else {
        unreachable!()
    };
    six.kind = CheckpointKind::Savepoint;
    partition.emit_record(&b"data"[..], 0).unwrap();
    partition
        .broadcast_event(&Event::CheckpointBarrier(six), false)
        .unwrap();
    assert_eq!(partition.aligned_barrier_timeout(5), 0);
    assert_eq!(
        partition.aligned_barrier_timeout(6),
        0,
        "a savepoint never times out"
    );
    let data = view.poll_next().unwrap();
    assert_eq!(records_of(&data), vec![b"data".to_vec()]);
    let next = view.poll_next().unwrap();
    assert_eq!(
        next.buffer.data_type(),
        DataType::TimeoutableAlignedCheckpointBarrier
    );
    assert_eq!(event_of(&next), Event::CheckpointBarrier(six));
    drop((taken, data, next, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Two checkpoints' barriers time out in one queue before the reader reaches either: both
/// go ahead unaligned, in order, and both originals are dropped. (The second one once stayed
/// aligned while the first one's original was still queued.)
#[test]
fn two_queued_barriers_both_turn_unaligned() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let five = timeoutable_barrier(5, 3_600_000);
    let six = timeoutable_barrier(6, 3_600_000);
    partition.emit_record(&b"a"[..], 0).unwrap();
    partition.broadcast_event(&five, false).unwrap();
    assert_eq!(partition.aligned_barrier_timeout(5), 1);
    partition.emit_record(&b"b"[..], 0).unwrap();
    partition.broadcast_event(&six, false).unwrap();
    partition.emit_record(&b"c"[..], 0).unwrap();
    partition.flush(0);
    // The second waits while the first one's original, still queued, holds the drop slot.
    assert_eq!(partition.aligned_barrier_timeout(6), 0);
    assert!(
        partition.aligned_barrier_deadline().is_some(),
        "tried again later"
    );
    let first = view.poll_next().unwrap();
    assert_eq!(event_of(&first), unaligned(&five));
    assert_eq!(first.overtaken, 1);
    let a = view.poll_next().unwrap();
    assert_eq!(records_of(&a), vec![b"a".to_vec()]);
    // The reader has passed the first original now (looking for what comes after "a").
    assert_eq!(partition.aligned_barrier_timeout(6), 1);
    let second = view.poll_next().unwrap();
    assert_eq!(event_of(&second), unaligned(&six));
    assert_eq!(second.overtaken, 1);
    let b = view.poll_next().unwrap();
    assert_eq!(
        records_of(&b),
        vec![b"b".to_vec()],
        "the first original was dropped"
    );
    let c = view.poll_next().unwrap();
    assert_eq!(
        records_of(&c),
        vec![b"c".to_vec()],
        "the second original was dropped"
    );
    assert!(view.poll_next().is_none());
    assert!(!view.is_blocked());
    drop((first, a, second, b, c, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A subpartition whose reader went away with a turned barrier's original still queued
/// does not keep later timers retrying (its drop slot stays taken for good): the next
/// barrier's timer turns it where it can and ends.
#[test]
fn a_released_subpartition_does_not_keep_a_barrier_timer_alive() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut kept, _signal) = view(&partition, 0);
    let (gone, _gone_signal) = view(&partition, 1);
    let five = timeoutable_barrier(5, 3_600_000);
    partition.broadcast_event(&five, false).unwrap();
    assert_eq!(partition.aligned_barrier_timeout(5), 2);
    drop(gone);
    let first = kept.poll_next().unwrap();
    assert_eq!(event_of(&first), unaligned(&five));
    assert!(kept.poll_next().is_none(), "the original was dropped");
    let six = timeoutable_barrier(6, 3_600_000);
    partition.broadcast_event(&six, false).unwrap();
    assert_eq!(partition.aligned_barrier_timeout(6), 1);
    assert_eq!(
        partition.aligned_barrier_deadline(),
        None,
        "the timer ended"
    );
    drop((first, kept, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A newer checkpoint's barrier ends the pending timer of an older one: its consumers abort
/// the older checkpoint, and the older barrier turned unaligned afterwards would come after
/// the newer one.
#[test]
fn a_newer_barrier_ends_an_older_barriers_timer() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let five = timeoutable_barrier(5, 3_600_000);
    partition.broadcast_event(&five, false).unwrap();
    partition
        .broadcast_event(&barrier(6, Alignment::Unaligned), true)
        .unwrap();
    assert_eq!(partition.aligned_barrier_deadline(), None);
    assert_eq!(partition.aligned_barrier_timeout(5), 0);
    let items: Vec<_> = std::iter::from_fn(|| view.poll_next())
        .map(|item| event_of(&item))
        .collect();
    assert_eq!(items, [barrier(6, Alignment::Unaligned), five]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A writer blocked by back pressure still turns its barrier unaligned when the timeout
/// passes (that is when the barrier sits behind data the most): the reader, which took
/// nothing meanwhile, finds the unaligned barrier first.
#[test]
fn a_back_pressured_writer_turns_its_barrier_unaligned_at_the_timeout() {
    let (network, config) = setup(16);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&[2u8; 2044][..], 0).unwrap();
    let barrier = timeoutable_barrier(7, 50);
    partition.broadcast_event(&barrier, false).unwrap();
    let writer = thread::spawn(move || {
        // More than the pool holds: the writer blocks until the reader takes.
        for _ in 0..64 {
            partition.emit_record(&[3u8; 2044][..], 0).unwrap();
        }
        partition.finish().unwrap();
        partition
    });
    let deadline = Instant::now() + LONG;
    while signal.priority.load(Ordering::SeqCst) == 0 {
        let seen = signal.notifications();
        assert!(
            Instant::now() < deadline && signal.wait_beyond(seen),
            "the barrier never turned unaligned"
        );
    }
    let first = view.poll_next().unwrap();
    assert_eq!(first.buffer.data_type(), DataType::PrioritizedEventBuffer);
    assert_eq!(event_of(&first), unaligned(&barrier));
    assert_eq!(first.overtaken, 1);
    let (spanning, events) = read_to_end(&mut view, &signal);
    let mut expected = vec![(2044, 2)];
    expected.extend(std::iter::repeat_n((2044, 3), 64));
    assert_eq!(spanning.records, expected);
    assert_eq!(
        events,
        vec![Event::EndOfPartition],
        "the aligned original is dropped"
    );
    let partition = writer.join().unwrap();
    drop((first, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn without_credit_only_an_event_counts_as_available() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(&b"data"[..], 0).unwrap();
    partition.flush(0);
    assert!(!view.availability_and_backlog(false).0);
    assert!(view.availability_and_backlog(true).0);
    view.poll_next().unwrap();
    partition
        .broadcast_event(&Event::CancelCheckpointMarker(4), false)
        .unwrap();
    assert!(view.availability_and_backlog(false).0);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn finish_ends_with_end_of_partition_and_refuses_more_records() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut a, _) = view(&partition, 0);
    let (mut b, _) = view(&partition, 1);
    partition.emit_record(&b"x"[..], 1).unwrap();
    partition.finish().unwrap();
    assert_eq!(
        partition.emit_record(&b"late"[..], 0).unwrap_err(),
        PartitionError::Finished
    );
    let end = a.poll_next().unwrap();
    assert_eq!(
        Event::decode(end.buffer.as_slice()).unwrap(),
        Event::EndOfPartition
    );
    assert_eq!(records_of(&b.poll_next().unwrap()), vec![b"x".to_vec()]);
    drop(end);
    let end = b.poll_next().unwrap();
    assert_eq!(
        Event::decode(end.buffer.as_slice()).unwrap(),
        Event::EndOfPartition
    );
    assert!(partition.handle().is_finished());
    drop((end, a, b, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn releasing_returns_every_segment_even_with_data_queued() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 3, &network, &config).unwrap();
    let (view, _) = view(&partition, 1);
    for i in 0..40 {
        partition.emit_record(&[i as u8; 700][..], i % 3).unwrap();
    }
    partition
        .broadcast_event(&barrier(1, Alignment::Unaligned), true)
        .unwrap();
    drop(view);
    partition.release();
    assert_eq!(
        partition.emit_record(&b"x"[..], 0).unwrap_err(),
        PartitionError::Released
    );
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn releasing_wakes_a_parked_reader_so_it_lets_go_of_its_segment() {
    // A reader (a server's, for a remote consumer) that read everything and parked must hear
    // of the release: else it never looks again, its consumer is not told, and the segment
    // under its half-read head stays out of the pool. Its next look gives that segment back.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&b"partly read"[..], 0).unwrap();
    partition.flush(0);
    assert!(view.poll_next().is_some(), "the flushed record");
    assert!(view.poll_next().is_none(), "nothing more: parked");
    let seen = signal.notifications();
    partition.release();
    assert!(signal.wait_beyond(seen), "the release wakes the reader");
    assert!(view.is_released());
    assert!(view.poll_next().is_none());
    drop(partition);
    assert_eq!(
        network.available_segments(),
        network.total_segments(),
        "the reader let go of its half-read head when it saw the release"
    );
    drop(view);
}

/// A producer dropped after `finish` leaves what it queued readable, the end behind it.
#[test]
fn dropping_a_finished_producer_keeps_queued_data_readable() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _) = view(&partition, 0);
    partition.emit_record(&b"kept"[..], 0).unwrap();
    partition.finish().unwrap();
    drop(partition);
    assert_eq!(
        records_of(&view.poll_next().unwrap()),
        vec![b"kept".to_vec()]
    );
    let end = view.poll_next().expect("the end of the partition");
    assert_eq!(end.buffer.data_type(), DataType::EventBuffer);
    drop(end);
    drop(view);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A producer dropped without `finish` failed (an early return, a panic): its partition is
/// released, as Flink's failing task releases its partitions, so readers see the release
/// instead of waiting for good for an end that never comes.
#[test]
fn dropping_an_unfinished_producer_releases_its_partition() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let handle = partition.handle();
    let (mut view, _) = view(&partition, 0);
    partition.emit_record(&b"lost"[..], 0).unwrap();
    drop(partition);
    assert!(handle.is_released());
    assert!(view.is_released());
    assert!(view.poll_next().is_none(), "a released view yields nothing");
    drop((view, handle));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_manager_that_released_everything_refuses_new_partitions() {
    // Its environment is going: a partition registered now would never be released, and its
    // writer would wait for room for good.
    let (network, config) = setup(64);
    let manager = PartitionManager::new();
    let before = ResultPartition::new(ID, 1, &network, &config).unwrap();
    manager.register(before.handle()).unwrap();
    manager.release_all();
    assert!(before.handle().is_released());
    let later = ResultPartition::new(
        ResultPartitionId {
            partition: 77,
            producer: 1,
        },
        1,
        &network,
        &config,
    )
    .unwrap();
    assert_eq!(
        manager.register(later.handle()).unwrap_err(),
        PartitionError::Released
    );
    drop((before, later));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_reader_leaving_in_the_middle_of_a_record_ends_only_its_own_subpartition() {
    // The record runs into a second segment, which its subpartition, released by its reader,
    // refuses: the record fails, and the partition's other reader goes on (a failure of the
    // record itself would release the whole partition; this one is not).
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (view0, _signal0) = view(&partition, 0);
    let (mut view1, _signal1) = view(&partition, 1);
    partition.emit_record(&[1u8; 10][..], 1).unwrap();
    partition.emit_record(&[0u8; 10][..], 0).unwrap();
    drop(view0);
    assert!(partition.emit_record(&[0u8; 5000][..], 0).is_err());
    assert!(
        !partition.handle().is_released(),
        "the other reader's stream goes on"
    );
    partition.emit_record(&[2u8; 20][..], 1).unwrap();
    partition.finish().unwrap();
    let mut reader = SpanningReader::new();
    for _ in 0..8 {
        let Some(item) = view1.poll_next() else { break };
        if item.buffer.data_type().is_buffer() {
            reader.read(&item);
        }
    }
    assert_eq!(reader.records, [(10, 1), (20, 2)]);
    drop((view1, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn the_manager_finds_partitions_and_allows_one_view_per_subpartition() {
    let (network, config) = setup(64);
    let manager = PartitionManager::new();
    let signal: Arc<dyn AvailabilityListener> = Arc::new(Signal::default());
    assert_eq!(
        manager.create_view(ID, 0, signal.clone()).unwrap_err(),
        PartitionError::PartitionNotFound(ID)
    );
    let partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    manager.register(partition.handle()).unwrap();
    assert_eq!(
        manager.register(partition.handle()).unwrap_err(),
        PartitionError::DuplicatePartition(ID)
    );
    let view = manager.create_view(ID, 0, signal.clone()).unwrap();
    assert_eq!(
        manager.create_view(ID, 0, signal.clone()).unwrap_err(),
        PartitionError::ViewExists(0)
    );
    assert!(matches!(
        manager.create_view(ID, 5, signal.clone()).unwrap_err(),
        PartitionError::NoSuchSubpartition { index: 5, count: 2 }
    ));
    manager.release(ID).unwrap();
    assert!(manager.is_empty());
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_record_for_no_subpartition_is_refused_before_it_changes_anything() {
    // It finished the open broadcast buffer first (its reader got it early, unflushed), and
    // could fire a due barrier timer; the async emit checked the index first.
    let (network, config) = setup(16);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.broadcast_record(&b"broadcast"[..]).unwrap();
    assert!(matches!(
        partition.emit_record(&b"nowhere"[..], 5),
        Err(PartitionError::NoSuchSubpartition { index: 5, count: 2 })
    ));
    assert!(
        view.poll_next().is_none(),
        "the broadcast buffer is still open, neither finished nor flushed"
    );
    partition.finish().unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Counts task events (a producer's listener).
#[derive(Default)]
struct TaskEvents(AtomicUsize);

impl fluxgate::partition::TaskEventListener for TaskEvents {
    fn on_task_event(&self, _event: &Event) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn the_manager_forgets_a_partition_its_consumers_released_and_its_listener() {
    let (network, config) = setup(64);
    let manager = PartitionManager::new();
    let consumed = ResultPartition::new(ID, 1, &network, &config).unwrap();
    manager.register(consumed.handle()).unwrap();
    let listener = Arc::new(TaskEvents::default());
    manager.subscribe_task_events(ID, listener.clone());
    assert!(manager.publish_task_event(ID, &Event::EndOfData(fluxgate::event::StopMode::Drain)));
    let signal: Arc<dyn AvailabilityListener> = Arc::new(Signal::default());
    // Its one consumer went away: the subpartition is released.
    manager.create_view(ID, 0, signal).unwrap().release();
    let next = ResultPartitionId {
        partition: ID.partition + 1,
        ..ID
    };
    let other = ResultPartition::new(next, 1, &network, &config).unwrap();
    manager.register(other.handle()).unwrap();
    assert_eq!(manager.len(), 1, "only the partition still to be consumed");
    assert!(matches!(
        manager.partition(ID),
        Err(PartitionError::PartitionNotFound(_))
    ));
    assert!(
        !manager.publish_task_event(ID, &Event::EndOfData(fluxgate::event::StopMode::Drain)),
        "its listener went with it"
    );
    assert_eq!(listener.0.load(Ordering::SeqCst), 1);
    drop((consumed, other));
    manager.release(next).unwrap();
    assert!(manager.is_empty());
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn broadcast_records_share_one_segment_across_subpartitions() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 3, &network, &config).unwrap();
    let mut views: Vec<_> = (0..3).map(|i| view(&partition, i).0).collect();
    partition.broadcast_record(&b"everyone"[..]).unwrap();
    partition.flush_all();
    let items: Vec<_> = views.iter_mut().map(|v| v.poll_next().unwrap()).collect();
    for item in &items {
        assert_eq!(records_of(item), vec![b"everyone".to_vec()]);
        assert_eq!(item.buffer.segment_index(), items[0].buffer.segment_index());
    }
    drop((items, views, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn selectors_spread_round_robin_and_keep_keys_together() {
    let (network, config) = setup(128);
    let partition = ResultPartition::new(ID, 4, &network, &config).unwrap();
    let mut views: Vec<_> = (0..4).map(|i| view(&partition, i).0).collect();
    let mut writer = RecordWriter::new(
        partition,
        RoundRobinSelector::default(),
        BufferTimeout::Always,
    );
    for i in 0..8u64 {
        writer.emit(&i).unwrap();
    }
    for (channel, view) in views.iter_mut().enumerate() {
        let got: Vec<_> = std::iter::from_fn(|| view.poll_next())
            .flat_map(|item| records_of(&item))
            .collect();
        let expected: Vec<_> = [channel as u64, channel as u64 + 4]
            .iter()
            .map(|v| v.to_be_bytes().to_vec())
            .collect();
        assert_eq!(got, expected);
    }
    drop((views, writer));

    let id = ResultPartitionId {
        partition: 2,
        producer: 7,
    };
    let partition = ResultPartition::new(id, 4, &network, &config).unwrap();
    let mut views: Vec<_> = (0..4).map(|i| view(&partition, i).0).collect();
    let by_key = KeyHashSelector::new(|r: &[u8]| u64::from(r[0]), 128);
    let mut writer = RecordWriter::new(partition, by_key, BufferTimeout::Never);
    for i in 0..64u8 {
        writer.emit(&[i % 8, i][..]).unwrap();
    }
    writer.flush_all();
    let mut channel_of_key = [None; 8];
    for (channel, view) in views.iter_mut().enumerate() {
        for item in std::iter::from_fn(|| view.poll_next()) {
            for record in records_of(&item) {
                let previous = channel_of_key[record[0] as usize].replace(channel);
                assert!(previous.is_none() || previous == Some(channel), "key split");
            }
        }
    }
    assert!(channel_of_key.iter().all(Option::is_some));
    drop((views, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn the_output_flusher_makes_data_readable_without_an_explicit_flush() {
    let (network, config) = setup(64);
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    let mut writer = RecordWriter::new(
        partition,
        RoundRobinSelector::default(),
        BufferTimeout::from_millis(5),
    );
    writer.emit(&b"soon"[..]).unwrap();
    assert!(signal.wait_beyond(0), "the flusher never flushed");
    assert_eq!(
        records_of(&view.poll_next().unwrap()),
        vec![b"soon".to_vec()]
    );
    drop((view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A listener whose first notification panics; it counts the later ones in `signal`.
#[derive(Default)]
struct PanicsFirst {
    panicked: std::sync::atomic::AtomicBool,
    signal: Signal,
}

impl AvailabilityListener for PanicsFirst {
    fn notify_data_available(&self) {
        if !self.panicked.swap(true, Ordering::SeqCst) {
            self.signal.notify_data_available(); // lets the test see the panic came
            panic!("a listener's panic (expected by the test)");
        }
        self.signal.notify_data_available();
    }

    fn notify_priority_event(&self) {
        self.notify_data_available();
    }
}

#[test]
fn the_output_flusher_outlives_a_panicking_listener() {
    let (network, config) = setup(64);
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let listener = Arc::new(PanicsFirst::default());
    let mut view = partition.handle().create_view(0, listener.clone()).unwrap();
    let mut writer = RecordWriter::new(
        partition,
        RoundRobinSelector::default(),
        BufferTimeout::from_millis(5),
    );
    writer.emit(&b"first"[..]).unwrap();
    assert!(listener.signal.wait_beyond(0), "the flusher never flushed");
    assert_eq!(records_of(&view.poll_next().unwrap()), [b"first".to_vec()]);
    // Read dry: the reader waits again, for the flusher's next notification.
    assert!(view.poll_next().is_none());
    let seen = listener.signal.notifications();
    writer.emit(&b"second"[..]).unwrap();
    assert!(
        listener.signal.wait_beyond(seen),
        "the flusher stopped at the listener's panic"
    );
    assert_eq!(records_of(&view.poll_next().unwrap()), [b"second".to_vec()]);
    drop((view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A listener that panics is told again of what comes next: its panic cost that
/// notification only (the reader's waiting flag was cleared before the call, so it heard of
/// nothing more), and not the writer's thread (the panic went up through its flush).
#[test]
fn a_listener_that_panicked_is_told_of_the_next_data() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let listener = Arc::new(PanicsFirst::default());
    let mut view = partition.handle().create_view(0, listener.clone()).unwrap();
    partition.emit_record(&b"first"[..], 0).unwrap();
    partition.flush(0);
    assert!(listener.panicked.load(Ordering::SeqCst), "no notification");
    let seen = listener.signal.notifications();
    partition.emit_record(&b"second"[..], 0).unwrap();
    partition.flush(0);
    assert!(
        listener.signal.notifications() > seen,
        "the reader heard nothing after its listener's panic"
    );
    assert_eq!(
        records_of(&view.poll_next().unwrap()),
        [b"first".to_vec(), b"second".to_vec()]
    );
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_slow_consumer_backpressures_the_producer_within_the_pool() {
    let (network, config) = setup(64);
    let partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let handle = partition.handle();
    let (mut view, signal) = view(&partition, 0);
    let max = partition.pool().spec().max_segments;
    const RECORDS: u64 = 20_000;
    let (done_tx, done_rx) = mpsc::channel();
    thread::scope(|s| {
        let producer = s.spawn(move || {
            let mut writer = RecordWriter::new(
                partition,
                fluxgate::partition::ForwardSelector,
                BufferTimeout::Never,
            );
            let mut peak_in_use = 0;
            let mut peak_of_channel = 0;
            for i in 0..RECORDS {
                writer.emit(&[i as u8; 100][..]).unwrap();
                let pool = writer.partition().pool();
                peak_in_use = peak_in_use.max(pool.in_use_segments());
                peak_of_channel = peak_of_channel.max(pool.segments_of(0));
            }
            writer.finish().unwrap();
            done_tx.send((peak_in_use, peak_of_channel)).unwrap();
        });
        let mut records = 0u64;
        let mut reader = RecordDeserializer::new(1 << 20);
        let mut seen = 0;
        let mut expected_sequence = 0;
        'read: for _ in 0..1_000_000 {
            match view.poll_next() {
                Some(item) => {
                    assert_eq!(item.sequence_number, expected_sequence);
                    expected_sequence += 1;
                    if item.buffer.data_type() != DataType::DataBuffer {
                        assert_eq!(
                            Event::decode(item.buffer.as_slice()).unwrap(),
                            Event::EndOfPartition
                        );
                        break 'read;
                    }
                    reader.set_next_buffer(item.buffer).unwrap();
                    while let Some(r) = reader.next_record().unwrap() {
                        assert_eq!(r, &[records as u8; 100][..]);
                        records += 1;
                    }
                }
                None => {
                    assert!(signal.wait_beyond(seen), "producer stalled: lost wake-up");
                    seen = signal.notifications();
                }
            }
        }
        assert_eq!(records, RECORDS);
        let (peak_in_use, peak_of_channel) = done_rx.recv_timeout(LONG).unwrap();
        assert!(
            peak_in_use <= max,
            "pool usage {peak_in_use} over its max {max}"
        );
        assert!(peak_of_channel <= config.max_buffers_per_channel);
        producer.join().unwrap();
    });
    drop(view);
    assert!(
        !handle.is_released(),
        "subpartition 1 still holds its EndOfPartition"
    );
    handle.release();
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_reader_woken_for_nothing_new_waits_again_and_hears_of_the_next_data() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&b"one"[..], 0).unwrap();
    partition.flush(0);
    assert_eq!(signal.notifications(), 1);
    assert!(view.poll_next().is_some());
    // A flush with nothing new leaves the (parked) reader alone...
    partition.flush(0);
    assert_eq!(signal.notifications(), 1);
    // ...and a reader that looks anyway and finds nothing must wait again to hear of what
    // comes next: the bytes written since into the buffer it read half.
    assert!(!view.availability_and_backlog(true).0);
    assert!(!view.wait_for_data());
    partition.emit_record(&b"two"[..], 0).unwrap();
    partition.flush(0);
    assert_eq!(signal.notifications(), 2);
    assert_eq!(
        records_of(&view.poll_next().unwrap()),
        vec![b"two".to_vec()]
    );
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_barrier_is_written_even_when_blocked_consumers_hold_the_whole_pool() {
    // The deadlock it prevents (seen on a loaded three-node cluster with aligned barriers
    // every 20 ms): every segment of a producer's pool sits in subpartitions whose consumers
    // blocked them for a barrier, and the next barrier — what unblocks them downstream — waited
    // for one of those segments.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (view0, _) = view(&partition, 0);
    let (view1, _) = view(&partition, 1);
    let max = partition.pool().spec().max_segments;
    let per_channel = config.max_buffers_per_channel;
    assert!(
        max > per_channel,
        "the pool outgrows one subpartition's cap"
    );
    // One full segment per record: nobody reads, so each record leases one more segment.
    let record = vec![1u8; 4096 - fluxgate::record::prefix_len(4096)];
    for _ in 0..per_channel {
        partition.emit_record(&record[..], 0).unwrap();
    }
    for _ in per_channel..max {
        partition.emit_record(&record[..], 1).unwrap();
    }
    assert_eq!(
        partition.pool().in_use_segments(),
        max,
        "the pool is exhausted"
    );
    let (done, finished) = mpsc::channel();
    let writer = thread::spawn(move || {
        let result = partition.broadcast_event(&barrier(1, Alignment::Aligned), false);
        let _ = done.send(result.is_ok());
        partition
    });
    assert_eq!(
        finished.recv_timeout(LONG),
        Ok(true),
        "the barrier was written without waiting for the pool"
    );
    drop(writer.join().unwrap());
    drop((view0, view1));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Polls `future` once with a waker that does nothing; `None` while it is pending.
fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

#[test]
fn an_async_unicast_record_after_a_broadcast_one_stays_between_the_broadcasts() {
    let (network, config) = setup(16);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.broadcast_record(&b"first broadcast"[..]).unwrap();
    poll_once(partition.emit_record_async(&b"unicast"[..], 0))
        .expect("a free segment: the future is ready at once")
        .unwrap();
    partition
        .broadcast_record(&b"second broadcast"[..])
        .unwrap();
    partition.flush_all();
    let mut records = Vec::new();
    while let Some(item) = view.poll_next() {
        records.extend(records_of(&item));
    }
    assert_eq!(
        records,
        vec![
            b"first broadcast".to_vec(),
            b"unicast".to_vec(),
            b"second broadcast".to_vec()
        ]
    );
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// The backlog a sender reports (Flink's `getBuffersInBacklogUnsafe`): finished buffers, plus
/// the unfinished tail when it is next in line and a flush made bytes in it readable. A
/// consumer without exclusive buffers asks for floating ones only for this count, so it must
/// neither miss a flushed tail (the sender would wait for credit forever) nor count one that
/// has nothing to read (the consumer would lend a floating buffer no data comes for).
#[test]
fn the_backlog_counts_a_flushed_tail_only_when_it_is_next_and_holds_bytes() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(&b"first"[..], 0).unwrap();
    assert_eq!(
        view.availability_and_backlog(true),
        (false, 0),
        "not flushed"
    );
    partition.flush(0);
    assert_eq!(view.availability_and_backlog(true), (true, 1), "flushed");
    let first = view.poll_next().unwrap();
    assert_eq!(records_of(&first), vec![b"first".to_vec()]);
    assert_eq!(first.backlog, 0, "the tail was read to its end");
    partition.flush(0);
    assert_eq!(
        view.availability_and_backlog(true),
        (false, 0),
        "a flush with nothing new to read"
    );
    // Five 1000-byte records fill the rest of the 4 KiB segment after "first" (records span
    // segments) and 920 bytes of the next one, which a flush makes readable behind the full
    // buffer.
    for _ in 0..5 {
        partition.emit_record(&[7u8; 1000][..], 0).unwrap();
    }
    partition.flush(0);
    assert_eq!(
        view.availability_and_backlog(true),
        (true, 1),
        "the flushed tail behind a finished buffer is not counted yet"
    );
    let full = view.poll_next().unwrap();
    assert_eq!(full.buffer.len(), 4096 - b"\x05first".len());
    assert_eq!(full.backlog, 1, "now the flushed tail is next: counted");
    let tail = view.poll_next().unwrap();
    assert_eq!(tail.buffer.len(), 6 + 5 * 1002 - 4096);
    assert_eq!(tail.backlog, 0);
    drop((first, full, tail, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn priority_events_for_a_reader_that_stopped_wait_for_memory_past_the_overdraft() {
    // A reader that stops reading while its producer keeps sending priority events (a
    // consumer stuck while unaligned checkpoints go on): each event overdraws the network
    // memory, and without a bound the lanes overflowed (the producer panicked) once there
    // were more events than twice the pool's maximum.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    let spec = partition.pool().spec();
    let queued_at_most = spec.max_segments + spec.max_overdraft_segments;
    assert!(
        queued_at_most < network.total_segments(),
        "the network memory outlasts the bound, so the bound is what stops the producer"
    );
    let events = queued_at_most as u64 + 10;
    let writer = thread::spawn(move || {
        let mut peak_overdraft = 0;
        for id in 0..events {
            partition.broadcast_event(&barrier(id, Alignment::Unaligned), true)?;
            peak_overdraft = peak_overdraft.max(partition.pool().overdraft_segments());
        }
        Ok::<_, PartitionError>((partition, peak_overdraft))
    });
    // Nothing is read until the producer has queued all the bound allows.
    for _ in 0..events {
        // The count before the look: an event counted after it then counts beyond `seen`.
        let seen = signal.notifications();
        if signal.priority.load(Ordering::SeqCst) >= queued_at_most {
            break;
        }
        assert!(signal.wait_beyond(seen), "the producer stopped early");
    }
    assert_eq!(signal.priority.load(Ordering::SeqCst), queued_at_most);
    let mut seen = signal.notifications();
    let mut next_id = 0;
    for _ in 0..10 * events {
        if next_id == events {
            break;
        }
        match view.poll_next() {
            Some(item) => {
                assert_eq!(
                    Event::decode(item.buffer.as_slice()).unwrap(),
                    barrier(next_id, Alignment::Unaligned)
                );
                next_id += 1;
            }
            None => {
                assert!(signal.wait_beyond(seen), "the producer stayed blocked");
                seen = signal.notifications();
            }
        }
    }
    assert_eq!(next_id, events, "every event arrived, in order");
    let (partition, peak_overdraft) = writer.join().expect("the producer does not panic").unwrap();
    assert!(peak_overdraft <= spec.max_overdraft_segments);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Counts its wake-ups.
#[derive(Default)]
struct CountingWaker(AtomicUsize);

impl std::task::Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn an_async_record_waits_for_room_in_a_full_lane_without_blocking_and_the_reader_wakes_it() {
    // A subpartition's queue holds twice `max-buffers-per-channel` items: its own buffers,
    // which the pool bounds by that option, and as many broadcast buffers and events (plus
    // the overdraft of a started record, none here).
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    config
        .set(
            "taskmanager.network.memory.max-overdraft-buffers-per-gate",
            "0",
        )
        .unwrap();
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    // Two broadcast buffers, one finished, one open (the second record spans into it): the
    // two items the lane holds.
    let big = vec![7u8; 4000];
    partition.broadcast_record(&big[..]).unwrap();
    partition.broadcast_record(&big[..]).unwrap();

    let waker = Arc::new(CountingWaker::default());
    let waker_handle = std::task::Waker::from(waker.clone());
    let mut context = std::task::Context::from_waker(&waker_handle);
    let mut reader = SpanningReader::new();
    {
        let mut emit = std::pin::pin!(partition.emit_record_async(&[9u8; 7][..], 0));
        assert!(
            emit.as_mut().poll(&mut context).is_pending(),
            "the lane is full: the record waits, without blocking the thread"
        );
        let first = view.poll_next().expect("the finished broadcast buffer");
        assert!(
            waker.0.load(Ordering::SeqCst) > 0,
            "the reader's take woke the waiting writer"
        );
        match emit.as_mut().poll(&mut context) {
            std::task::Poll::Ready(result) => result.unwrap(),
            std::task::Poll::Pending => panic!("the take made room, yet the record still waits"),
        }
        reader.read(&first);
    }
    partition.finish().unwrap();
    for _ in 0..8 {
        let Some(item) = view.poll_next() else { break };
        if item.buffer.data_type().is_buffer() {
            reader.read(&item);
        }
    }
    assert_eq!(reader.records, [(4000, 7), (4000, 7), (7, 9)]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Polls `emit` on another thread, where it must wait for a segment as a future (pending),
/// not block; then the reader takes `view`'s finished buffer (into `reader`), whose segment
/// coming back must wake the writer and let `emit` complete. Bounded: a poll that blocked the
/// thread is caught by the receive's timeout, and the buffer taken then ends it.
fn assert_waits_as_a_future_for_a_segment_given_back(
    mut emit: std::pin::Pin<&mut (impl Future<Output = Result<(), PartitionError>> + Send)>,
    view: &mut SubpartitionView,
    reader: &mut SpanningReader,
) {
    let waker = Arc::new(CountingWaker::default());
    let waker_handle = std::task::Waker::from(waker.clone());
    let (polled_tx, polled) = mpsc::channel();
    thread::scope(|scope| {
        scope.spawn(|| {
            let mut context = std::task::Context::from_waker(&waker_handle);
            let pending = emit.as_mut().poll(&mut context).is_pending();
            let _ = polled_tx.send(pending);
        });
        let polled = polled.recv_timeout(LONG);
        // Taken before the verdict: it also ends a poll that blocked, so the scope ends.
        let first = view.poll_next().expect("the finished buffer");
        reader.read(&first);
        assert_eq!(
            polled,
            Ok(true),
            "the record waits for its segment as a future"
        );
    });
    assert!(
        waker.0.load(Ordering::SeqCst) > 0,
        "the segment given back woke the waiting writer"
    );
    let mut context = std::task::Context::from_waker(&waker_handle);
    match emit.as_mut().poll(&mut context) {
        std::task::Poll::Ready(result) => result.unwrap(),
        std::task::Poll::Pending => panic!("a segment came back, yet the record still waits"),
    }
}

#[test]
fn an_async_record_running_past_the_open_buffer_waits_for_its_next_segment_without_blocking() {
    // The subpartition may hold two buffers: a finished one and the open one, which the next
    // record runs past. That record needs a third segment, at hand only once the reader
    // gives one back: the async emit must wait for it as a future. It blocked the thread
    // there (a single-threaded executor whose reader ran on it deadlocked).
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "2")
        .unwrap();
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    partition.emit_record(&[1u8; 3000][..], 0).unwrap();
    partition.emit_record(&[2u8; 3000][..], 0).unwrap();
    let mut reader = SpanningReader::new();
    assert_waits_as_a_future_for_a_segment_given_back(
        std::pin::pin!(partition.emit_record_async(&[3u8; 3000][..], 0)),
        &mut view,
        &mut reader,
    );
    partition.finish().unwrap();
    for _ in 0..8 {
        let Some(item) = view.poll_next() else { break };
        if item.buffer.data_type().is_buffer() {
            reader.read(&item);
        }
    }
    assert_eq!(reader.records, [(3000, 1), (3000, 2), (3000, 3)]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A partition of `subpartitions` that may queue few buffers each (`max-buffers-per-channel`
/// 1), with the first one's reader, which takes nothing: broadcast buffers, which the pool
/// does not count against a subpartition, fill its queue before the pool runs dry.
fn broadcasting_into_a_queue_that_fills(
    subpartitions: usize,
) -> (NetworkBufferPool, ResultPartition, SubpartitionView) {
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let partition = ResultPartition::new(ID, subpartitions, &network, &config).unwrap();
    let (view, _signal) = view(&partition, 0);
    (network, partition, view)
}

/// An async broadcast record running past its open buffer into a full queue waits for room
/// as a future, before its first byte, also one running into more than one buffer: it
/// blocked the thread inside the record (on a single-threaded executor whose reader ran on
/// it, for good).
#[test]
fn an_async_record_running_into_a_full_queue_waits_without_blocking() {
    // 1000 bytes: into the next buffer; 6000: into the next two (4 KiB segments).
    for size in [1000, 6000] {
        let (network, partition, view) = broadcasting_into_a_queue_that_fills(1);
        let (done, finished) = mpsc::channel();
        let writer = thread::spawn(move || {
            let mut partition = partition;
            let record = vec![7u8; size];
            // Bounded: the queue fills within a few records.
            let pending = (0..1_000)
                .any(|_| poll_once(partition.broadcast_record_async(&record[..])).is_none());
            done.send(pending).unwrap();
            partition
        });
        let pending = finished
            .recv_timeout(LONG)
            .unwrap_or_else(|_| panic!("the async broadcast of {size} bytes blocked its thread"));
        assert!(pending, "the queue never filled");
        let partition = writer.join().unwrap();
        drop((view, partition));
        assert_eq!(network.available_segments(), network.total_segments());
    }
}

/// The blocking broadcast stops before a record that would run into a full queue, as it
/// does before one for which no segment is at hand: what the other readers can read then
/// ends with a whole record. It stopped inside the record, its start already sent to every
/// reader.
#[test]
fn a_record_running_into_a_full_queue_waits_before_its_first_byte() {
    for size in [1000, 6000] {
        let (network, partition, stalled) = broadcasting_into_a_queue_that_fills(2);
        let (mut view, _signal) = view(&partition, 1);
        let handle = partition.handle();
        let writer = thread::spawn(move || {
            let mut partition = partition;
            let record = vec![7u8; size];
            // Bounded: the first queue fills within a few records; the release ends the wait.
            for _ in 0..1_000 {
                if partition.broadcast_record(&record[..]).is_err() {
                    break;
                }
            }
            partition
        });
        assert!(
            common::wait_until(LONG, || handle.is_back_pressured()),
            "the writer never waited"
        );
        // The second reader reads all there is; the first queue, full, keeps the writer
        // waiting.
        handle.flush_all();
        let mut readable = 0;
        while let Some(item) = view.poll_next() {
            if item.buffer.data_type().is_buffer() {
                readable += item.buffer.len();
            }
        }
        // Records of `size` bytes with their 2-byte prefix each, from the stream's start.
        assert!(readable > 0);
        assert_eq!(
            readable % (size + 2),
            0,
            "the stream of {size}-byte records stops inside one"
        );
        handle.release();
        let partition = writer.join().unwrap();
        drop((stalled, view, partition));
        assert_eq!(network.available_segments(), network.total_segments());
    }
}

/// A partition of one subpartition that may hold one buffer and refuses records over 1024
/// bytes, with its view.
fn refusing_records_over_1024() -> (NetworkBufferPool, ResultPartition, SubpartitionView) {
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    config.set("fluxgate.record.max-size", "1024").unwrap();
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (view, _signal) = view(&partition, 0);
    (network, partition, view)
}

/// `result` refused a record of `len` bytes as over the `max` allowed.
fn assert_too_large(result: Result<(), PartitionError>, len: usize, max: usize) {
    assert!(
        matches!(
            result,
            Err(PartitionError::Record(RecordError::TooLarge { len: l, max: m })) if l == len && m == max
        ),
        "{result:?}"
    );
}

/// An async emit refuses a record over `fluxgate.record.max-size` at once, as the blocking
/// one does, also while its subpartition is back-pressured: it waited for room and a buffer
/// first, pending for as long as the consumer stalled, only to refuse the record then.
#[test]
fn an_async_emit_refuses_a_record_too_large_without_waiting() {
    let (network, mut partition, view) = refusing_records_over_1024();
    // 4 × 1002 + 88 bytes fill the subpartition's one buffer to its end, finishing it: the
    // next record needs a second, which the subpartition may not have.
    for _ in 0..4 {
        partition.emit_record(&[0u8; 1000][..], 0).unwrap();
    }
    partition.emit_record(&[0u8; 87][..], 0).unwrap();
    for attempt in [
        poll_once(partition.emit_record_async(&[0u8; 1025][..], 0)),
        poll_once(partition.broadcast_record_async(&[0u8; 1025][..])),
    ] {
        assert_too_large(attempt.expect("refused at once"), 1025, 1024);
    }
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// The blocking emits refuse a record over `fluxgate.record.max-size` at once too, also with
/// its queue full: the wait before a record's first byte, for room, came first.
#[test]
fn a_blocking_emit_refuses_a_record_too_large_without_waiting() {
    let (network, mut partition, view) = refusing_records_over_1024();
    // Broadcast buffers fill the queue of a reader that takes nothing (bounded: within a few).
    assert!(
        (0..1_000).any(|_| poll_once(partition.broadcast_record_async(&[7u8; 1000][..])).is_none()),
        "the queue never filled"
    );
    let (done, refused) = mpsc::channel();
    let writer = thread::spawn(move || {
        let too_large = [0u8; 2000];
        let results = [
            partition.broadcast_record(&too_large[..]),
            partition.emit_record(&too_large[..], 0),
        ];
        done.send(results).unwrap();
        partition
    });
    let results = refused
        .recv_timeout(LONG)
        .expect("a record too large waited for room");
    for result in results {
        assert_too_large(result, 2000, 1024);
    }
    let partition = writer.join().unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A partition whose queue is clamped to its tiny pool (two segments, no floating buffers,
/// and as many overdraft segments) writes a record over more buffers than the queue holds.
/// The wait for room before it asked for all of them at once, with the writer's own open,
/// unflushed buffer in the queue and the reader parked untold: for good.
#[test]
fn a_record_over_more_buffers_than_a_tiny_queue_holds_still_goes_out() {
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.buffers-per-channel", "1")
        .unwrap();
    config
        .set("taskmanager.network.memory.floating-buffers-per-gate", "0")
        .unwrap();
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    // An open buffer holding a record, unflushed, which its reader has not looked at: nothing
    // tells the reader of it.
    partition.emit_record(&[1u8; 10][..], 0).unwrap();
    let (done, finished) = mpsc::channel();
    let writer = thread::spawn(move || {
        let mut partition = partition;
        partition.emit_record(&[2u8; 20_000][..], 0).unwrap();
        partition.finish().unwrap();
        done.send(()).unwrap();
        partition
    });
    // The reader looks once told: by the first buffer the long record finishes.
    assert!(
        signal.wait_beyond(0),
        "the writer stalled before the long record"
    );
    let (reader, events) = read_to_end(&mut view, &signal);
    finished.recv_timeout(LONG).expect("the writer stalled");
    assert_eq!(reader.records, [(10, 1), (20_000, 2)]);
    assert_eq!(events, [Event::EndOfPartition]);
    let partition = writer.join().unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A partition checks the configuration it is given (its fields are public): a
/// `max-buffers-per-channel` of 0 made the first emit wait for good.
#[test]
fn a_partition_refuses_a_configuration_that_cannot_work() {
    let (network, mut config) = setup(64);
    config.max_buffers_per_channel = 0;
    assert!(matches!(
        ResultPartition::new(ID, 1, &network, &config),
        Err(PartitionError::Pool(PoolError::Config(_)))
    ));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A selector that broadcasts every record and counts how often it was asked.
#[derive(Default)]
struct CountedBroadcast(usize);

impl ChannelSelector<[u8]> for CountedBroadcast {
    fn select(&mut self, _record: &[u8], _channels: usize) -> Selection {
        self.0 += 1;
        Selection::Broadcast
    }
}

/// An async emit of a broadcast record waits for its segment as a future, as a unicast one
/// does, and asks the selector once. It blocked the thread (a single-threaded executor whose
/// reader ran on it deadlocked), and asked the selector a second time, so a selector that
/// broadcasts some records could send one of them to a single channel instead.
#[test]
fn an_async_broadcast_waits_for_its_segment_without_blocking_and_selects_once() {
    // Two segments in the whole network: the third record, running past the second buffer,
    // needs one the reader has to give back first.
    let (network, config) = setup(2);
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let mut writer =
        RecordWriter::new(partition, CountedBroadcast::default(), BufferTimeout::Never);
    let waker = Arc::new(CountingWaker::default());
    let waker_handle = std::task::Waker::from(waker.clone());
    let mut reader = SpanningReader::new();
    for fill in [1u8, 2] {
        let mut context = std::task::Context::from_waker(&waker_handle);
        let record = [fill; 3000];
        let emit = std::pin::pin!(writer.emit_async(&record[..]));
        assert!(emit.poll(&mut context).is_ready(), "a segment was at hand");
    }
    let record = [3u8; 3000];
    assert_waits_as_a_future_for_a_segment_given_back(
        std::pin::pin!(writer.emit_async(&record[..])),
        &mut view,
        &mut reader,
    );
    assert_eq!(
        writer.selector().0,
        3,
        "the selector was asked once per record"
    );
    // The reader takes the finished buffer first: the end of partition needs its segment.
    let second = view
        .poll_next()
        .expect("the second buffer, finished by the third record");
    reader.read(&second);
    drop(second);
    writer.finish().unwrap();
    for _ in 0..8 {
        let Some(item) = view.poll_next() else { break };
        if item.buffer.data_type().is_buffer() {
            reader.read(&item);
        }
    }
    assert_eq!(reader.records, [(3000, 1), (3000, 2), (3000, 3)]);
    drop((view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn broadcasts_and_events_for_readers_that_stopped_wait_for_room_and_arrive_whole() {
    // Six subpartitions whose readers take nothing until the writer has queued all their
    // lanes hold (two items each, at one buffer per channel), then read everything: the
    // writer waits for them and goes on, and each reader gets every record and event in
    // order.
    const SUBPARTITIONS: usize = 6;
    const RECORDS: usize = 8;
    const MARKERS: u64 = 5;
    let (network, mut config) = setup(128);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let mut partition = ResultPartition::new(ID, SUBPARTITIONS, &network, &config).unwrap();
    let views: Vec<_> = (0..SUBPARTITIONS).map(|i| view(&partition, i)).collect();
    let writer = thread::spawn(move || {
        for i in 0..RECORDS {
            // About a buffer each.
            partition.broadcast_record(&vec![i as u8; 3000][..])?;
        }
        for id in 0..MARKERS {
            partition.broadcast_event(&Event::CancelCheckpointMarker(id), false)?;
        }
        partition.finish()?;
        Ok::<_, PartitionError>(partition)
    });
    // Every lane full (or the writer done) before anything is read.
    for (_, signal) in &views {
        assert!(signal.wait_beyond(0), "the writer queued nothing");
    }
    let readers: Vec<_> = views
        .into_iter()
        .map(|(mut view, signal)| {
            thread::spawn(move || {
                let (mut reader, mut markers) = (SpanningReader::new(), Vec::new());
                let mut seen = signal.notifications();
                for _ in 0..10 * (RECORDS + MARKERS as usize + 1) {
                    match view.poll_next() {
                        Some(item) if item.buffer.data_type().is_buffer() => reader.read(&item),
                        Some(item) => match Event::decode(item.buffer.as_slice()).unwrap() {
                            Event::EndOfPartition => return (reader.records, markers),
                            event => markers.push(event),
                        },
                        None => {
                            assert!(signal.wait_beyond(seen), "the writer stayed blocked");
                            seen = signal.notifications();
                        }
                    }
                }
                panic!("no EndOfPartition");
            })
        })
        .collect();
    let expected_records: Vec<(usize, u8)> = (0..RECORDS).map(|i| (3000, i as u8)).collect();
    let expected_markers: Vec<Event> = (0..MARKERS).map(Event::CancelCheckpointMarker).collect();
    for reader in readers {
        let (records, markers) = reader.join().expect("a reader failed");
        assert_eq!(records, expected_records);
        assert_eq!(markers, expected_markers);
    }
    let partition = writer.join().expect("the writer does not panic").unwrap();
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// Reads `view` until `wanted` returns true for an event, waiting for notifications; the
/// events read, in order. Panics when nothing new comes for `LONG`.
fn read_events_until(
    view: &mut SubpartitionView,
    signal: &Signal,
    mut wanted: impl FnMut(&Event) -> bool,
) -> Vec<Event> {
    let mut events = Vec::new();
    let mut seen = signal.notifications();
    for _ in 0..1000 {
        match view.poll_next() {
            Some(item) => {
                let event = Event::decode(item.buffer.as_slice()).unwrap();
                let done = wanted(&event);
                events.push(event);
                if done {
                    return events;
                }
            }
            None => {
                assert!(signal.wait_beyond(seen), "nothing more came: {events:?}");
                seen = signal.notifications();
            }
        }
    }
    panic!("too many events: {events:?}");
}

#[test]
fn a_broadcast_event_reaches_readers_with_room_while_a_stopped_one_holds_its_copy() {
    // Subpartition 0's reader takes nothing until subpartition 1's has the event that finds
    // subpartition 0's data lane full (ten items at one buffer per channel: two for buffers,
    // eight more for events). That event goes to subpartition 1 first; queued in order, it
    // would wait for reader 0, which waits for it.
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    let (mut view0, signal0) = view(&partition, 0);
    let (mut view1, signal1) = view(&partition, 1);
    const MARKERS: u64 = 12;
    let writer = thread::spawn(move || {
        for id in 0..MARKERS {
            partition.broadcast_event(&Event::CancelCheckpointMarker(id), false)?;
        }
        partition.finish()?;
        Ok::<_, PartitionError>(partition)
    });
    let marker = Event::CancelCheckpointMarker;
    let early = read_events_until(&mut view1, &signal1, |e| *e == marker(10));
    assert_eq!(early, (0..=10).map(marker).collect::<Vec<_>>());
    let all: Vec<Event> = (0..MARKERS)
        .map(marker)
        .chain([Event::EndOfPartition])
        .collect();
    let read0 = read_events_until(&mut view0, &signal0, |e| *e == Event::EndOfPartition);
    assert_eq!(read0, all);
    let rest1 = read_events_until(&mut view1, &signal1, |e| *e == Event::EndOfPartition);
    assert_eq!(rest1, all[11..]);
    drop(writer.join().expect("the writer does not panic").unwrap());
    drop((view0, view1));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_broadcast_skips_a_released_subpartition_and_the_others_get_it_whole() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 3, &network, &config).unwrap();
    let (mut view0, _) = view(&partition, 0);
    let (released, _) = view(&partition, 1);
    let (mut view2, _) = view(&partition, 2);
    partition.broadcast_record(&b"before"[..]).unwrap();
    released.release();
    // Spans two 4 KiB segments, each queued after subpartition 1 was released.
    let spanning: Vec<u8> = (0..6000u32).map(|i| i as u8).collect();
    partition.broadcast_record(&spanning[..]).unwrap();
    partition
        .broadcast_event(&barrier(4, Alignment::Aligned), false)
        .unwrap();
    partition.finish().unwrap();
    for view in [&mut view0, &mut view2] {
        let mut reader = RecordDeserializer::new(1 << 20);
        let mut records = Vec::new();
        let mut events = Vec::new();
        for _ in 0..16 {
            let Some(item) = view.poll_next() else { break };
            assert!(item.backlog < 16, "backlog {} wrapped", item.backlog);
            if item.buffer.data_type() == DataType::DataBuffer {
                reader.set_next_buffer(item.buffer).unwrap();
                while let Some(r) = reader.next_record().unwrap() {
                    records.push(r.to_vec());
                }
            } else {
                events.push(Event::decode(item.buffer.as_slice()).unwrap());
                // The aligned barrier blocked the view; the consumer aligned and resumes.
                view.resume_consumption();
            }
        }
        assert_eq!(records, vec![b"before".to_vec(), spanning.clone()]);
        assert_eq!(
            events,
            vec![barrier(4, Alignment::Aligned), Event::EndOfPartition]
        );
    }
    drop((view0, view2, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_broadcast_fails_once_every_subpartition_is_released() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 2, &network, &config).unwrap();
    for index in 0..2 {
        view(&partition, index).0.release();
    }
    assert!(matches!(
        partition.broadcast_record(&b"nobody"[..]),
        Err(PartitionError::Released)
    ));
    assert!(matches!(
        partition.broadcast_event(&barrier(1, Alignment::Aligned), false),
        Err(PartitionError::Released)
    ));
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A one-subpartition partition whose pool holds two 4 KiB segments, with `overdraft`
/// overdraft buffers (capped at the pool's two).
fn two_segment_partition(overdraft: &str) -> (NetworkBufferPool, ResultPartition) {
    let (network, mut config) = setup(64);
    for (key, value) in [
        ("taskmanager.network.memory.buffers-per-channel", "1"),
        ("taskmanager.network.memory.floating-buffers-per-gate", "1"),
        (
            "taskmanager.network.memory.max-overdraft-buffers-per-gate",
            overdraft,
        ),
    ] {
        config.set(key, value).unwrap();
    }
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    assert_eq!(partition.pool().spec().max_segments, 2);
    (network, partition)
}

#[test]
fn a_record_started_under_back_pressure_finishes_in_overdraft_segments() {
    // Flink's overdraft buffers: a record the writer has started goes on beyond the pool's
    // quota instead of stopping the task inside it. The next record that will not fit the
    // open buffer waits for the pool before its first byte, where a Flink task stops too,
    // though overdraft is left (the pool's two segments cap it at two; one is used).
    let (network, mut partition) = two_segment_partition("5");
    let handle = partition.handle();
    let (mut view, signal) = view(&partition, 0);
    let (written_tx, written_rx) = mpsc::channel();
    let writer = thread::spawn(move || {
        partition.emit_record(&[1u8; 7][..], 0)?;
        // Three segments: the pool's two and one of overdraft.
        partition.emit_record(&vec![2u8; 10_000][..], 0)?;
        written_tx.send(2).unwrap();
        // Runs past the third segment's end.
        partition.emit_record(&vec![3u8; 3_000][..], 0)?;
        written_tx.send(3).unwrap();
        partition.finish()?;
        Ok::<_, PartitionError>(partition)
    });
    assert_eq!(
        written_rx.recv_timeout(LONG),
        Ok(2),
        "the writer stopped inside the record with the pool used up"
    );
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the writer never waited"
    );
    assert!(
        written_rx.try_recv().is_err(),
        "the next record took overdraft instead of waiting for the pool"
    );
    let (spanning, events) = read_to_end(&mut view, &signal);
    assert_eq!(spanning.records, [(7, 1), (10_000, 2), (3_000, 3)]);
    assert_eq!(events, [Event::EndOfPartition]);
    let partition = writer.join().unwrap().unwrap();
    assert_eq!(partition.pool().overdraft_segments(), 0);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_record_needing_more_than_the_overdraft_waits_inside_itself_for_the_reader() {
    // Two pool segments and at most one overdraft segment (or none) are fewer than the four
    // the record needs (with the 7-byte one before it): the writer waits in the middle of it
    // until the reader takes.
    for overdraft in ["0", "1"] {
        let (network, mut partition) = two_segment_partition(overdraft);
        let handle = partition.handle();
        let (mut view, signal) = view(&partition, 0);
        let (written_tx, written_rx) = mpsc::channel();
        let writer = thread::spawn(move || {
            partition.emit_record(&[1u8; 7][..], 0)?;
            partition.emit_record(&vec![2u8; 14_000][..], 0)?;
            written_tx.send(()).unwrap();
            partition.finish()?;
            Ok::<_, PartitionError>(partition)
        });
        assert!(
            common::wait_until(LONG, || handle.is_back_pressured()),
            "the writer never waited (overdraft {overdraft})"
        );
        assert!(
            written_rx.try_recv().is_err(),
            "with overdraft {overdraft}, the record was written past what the pool and the overdraft hold"
        );
        let (spanning, events) = read_to_end(&mut view, &signal);
        assert_eq!(spanning.records, [(7, 1), (14_000, 2)]);
        assert_eq!(events, [Event::EndOfPartition]);
        let partition = writer.join().unwrap().unwrap();
        drop((view, partition));
        assert_eq!(network.available_segments(), network.total_segments());
    }
}

#[test]
fn a_partition_without_subpartitions_is_refused() {
    // It could never finish, and read as released and finished at once.
    let (network, config) = setup(8);
    assert!(matches!(
        ResultPartition::new(ID, 0, &network, &config),
        Err(PartitionError::NoSubpartitions)
    ));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_partition_of_more_subpartitions_than_the_memory_holds_is_refused() {
    // Its pool's minimum (one segment per subpartition and one more) added to what other
    // pools were promised overflowed (a panic in debug builds; in release builds a wrapped
    // sum admitted it and left the promise one short for good).
    let (network, config) = setup(8);
    let other = ResultPartition::new(ID, 1, &network, &config).unwrap();
    for subpartitions in [usize::MAX, usize::MAX - 1, 64] {
        assert!(
            matches!(
                ResultPartition::new(ID, subpartitions, &network, &config),
                Err(PartitionError::Pool(PoolError::Insufficient { .. }))
            ),
            "{subpartitions} subpartitions"
        );
    }
    drop(other);
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_writer_stuck_under_back_pressure_shows_in_its_back_pressured_time_while_it_waits() {
    // Flink's accumulated timer gauges count the wait under way: a metrics reporter looking at
    // a writer stuck behind a stalled consumer sees the time grow, not 0 until the wait ends.
    let (network, mut partition) = two_segment_partition("0");
    let handle = partition.handle();
    let (mut view, signal) = view(&partition, 0);
    let writer = thread::spawn(move || {
        partition.emit_record(&[1u8; 7][..], 0)?;
        partition.emit_record(&vec![2u8; 14_000][..], 0)?;
        partition.finish()?;
        Ok::<_, PartitionError>(partition)
    });
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the writer never waited"
    );
    assert!(
        common::wait_until(LONG, || handle.back_pressured_time()
            >= Duration::from_millis(1)),
        "the wait under way never showed in the back-pressured time"
    );
    assert!(
        handle.is_back_pressured(),
        "the writer stopped waiting though nothing was read"
    );
    let (spanning, _) = read_to_end(&mut view, &signal);
    assert_eq!(spanning.records, [(7, 1), (14_000, 2)]);
    let partition = writer.join().unwrap().unwrap();
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn records_running_past_the_one_buffer_a_subpartition_may_hold_go_on_as_its_reader_takes() {
    // With `max-buffers-per-channel` 1 the open buffer is all a subpartition may hold, and its
    // reader cannot give it back while it is open: a record that would run past its end
    // sends it first and starts in the next buffer once the reader gave this one back.
    let (network, mut config) = setup(64);
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "1")
        .unwrap();
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    const RECORDS: u8 = 20;
    let writer = thread::spawn(move || {
        let mut partition = partition;
        let mut peak = 0;
        for i in 0..RECORDS {
            partition.emit_record(&vec![i; 3_000][..], 0)?;
            peak = peak.max(partition.pool().segments_of(0));
        }
        partition.finish()?;
        Ok::<_, PartitionError>((partition, peak))
    });
    let (spanning, events) = read_to_end(&mut view, &signal);
    let expected: Vec<_> = (0..RECORDS).map(|i| (3_000, i)).collect();
    assert_eq!(spanning.records, expected);
    assert_eq!(events, [Event::EndOfPartition]);
    let (partition, peak) = writer.join().unwrap().unwrap();
    assert_eq!(peak, 1, "the subpartition held more than its one buffer");
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A checkpoint cancelled on the producer's side (its cancel marker sent, here as a priority
/// event) is not turned unaligned at its timeout: its barrier stays where it was queued, among
/// the data the marker counted as overtaken (it went ahead of the marker, unaligned, and the
/// marker then named one item written after it).
#[test]
fn a_cancelled_checkpoint_s_barrier_is_not_turned_at_its_timeout() {
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    let five = timeoutable_barrier(5, 60_000);
    partition.emit_record(&[1u8; 8][..], 0).unwrap();
    partition.broadcast_event(&five, false).unwrap();
    partition.emit_record(&[2u8; 8][..], 0).unwrap();
    partition
        .broadcast_event(&Event::CancelCheckpointMarker(5), true)
        .unwrap();
    assert_eq!(partition.aligned_barrier_timeout(5), 0, "nothing turned");
    let marker = view.poll_next().expect("the cancel marker");
    assert_eq!(event_of(&marker), Event::CancelCheckpointMarker(5));
    assert_eq!(
        marker.overtaken, 3,
        "the two buffers and the barrier between them"
    );
    let mut data_lane = Vec::new();
    for _ in 0..3 {
        let item = view.poll_next().expect("an item the marker overtook");
        data_lane.push(item.buffer.data_type());
        if item.buffer.data_type().requires_announcement() {
            // The aligned barrier blocks the subpartition until its consumer resumes.
            view.resume_consumption();
        }
    }
    assert_eq!(
        data_lane,
        [
            DataType::DataBuffer,
            DataType::TimeoutableAlignedCheckpointBarrier,
            DataType::DataBuffer
        ]
    );
    drop((marker, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// An unaligned barrier (in priority) with the number of data items its reader sends after
/// it that were queued before it.
fn priority_barrier_overtaking(view: &mut SubpartitionView) -> (Event, usize) {
    let item = view.poll_next().expect("the priority barrier");
    assert_eq!(item.buffer.data_type(), DataType::PrioritizedEventBuffer);
    (event_of(&item), item.overtaken)
}

#[test]
fn a_priority_barrier_does_not_count_an_empty_buffer_its_reader_never_sends() {
    // A record whose encoding failed in a fresh buffer leaves it empty; the reader drops it
    // unsent, so an unaligned barrier overtaking it overtakes only the full one before it.
    // Counted, the consumer would persist the first item after the barrier as in-flight data.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    // 4094 bytes with their 2-byte prefix fill a segment.
    partition.emit_record(&[1u8; 4094][..], 0).unwrap();
    let failed = FailingRecord {
        declared: 100,
        written: 40,
    };
    assert!(partition.emit_record(&failed, 0).is_err());
    let barrier = barrier(8, Alignment::Unaligned);
    partition.broadcast_event(&barrier, true).unwrap();
    partition.emit_record(&[2u8; 5][..], 0).unwrap();
    partition.finish().unwrap();
    assert_eq!(priority_barrier_overtaking(&mut view), (barrier, 1));
    let (spanning, events) = read_to_end(&mut view, &signal);
    assert_eq!(spanning.records, [(4094, 1), (5, 2)]);
    assert_eq!(events, [Event::EndOfPartition]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_priority_barrier_does_not_count_a_turned_barrier_its_reader_drops() {
    // An aligned barrier whose timeout turned it leaves its original queued, which the reader
    // drops unsent: an unaligned barrier queued after that does not overtake it.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, signal) = view(&partition, 0);
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    let turned = timeoutable_barrier(4, 60_000);
    partition.broadcast_event(&turned, false).unwrap();
    assert_eq!(partition.aligned_barrier_timeout(4), 1);
    let next = barrier(5, Alignment::Unaligned);
    partition.broadcast_event(&next, true).unwrap();
    partition.finish().unwrap();
    assert_eq!(
        priority_barrier_overtaking(&mut view),
        (unaligned(&turned), 1)
    );
    assert_eq!(priority_barrier_overtaking(&mut view), (next, 1));
    let (spanning, events) = read_to_end(&mut view, &signal);
    assert_eq!(spanning.records, [(100, 1)]);
    assert_eq!(events, [Event::EndOfPartition]);
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// One subpartition whose pool lets it hold `per_channel` segments
/// (`max-buffers-per-channel`), its view, and the network it draws from.
fn subpartition_holding(
    per_channel: usize,
) -> (
    NetworkBufferPool,
    ResultPartition,
    SubpartitionView,
    Arc<Signal>,
) {
    let (network, mut config) = setup(64);
    config
        .set(
            "taskmanager.network.memory.max-buffers-per-channel",
            &per_channel.to_string(),
        )
        .unwrap();
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (view, signal) = view(&partition, 0);
    (network, partition, view, signal)
}

/// A writer emitting on `partition` on its own thread, once it waits under back pressure,
/// and where its result comes.
fn writer_waiting(
    partition: ResultPartition,
) -> (
    thread::JoinHandle<ResultPartition>,
    mpsc::Receiver<Result<(), PartitionError>>,
) {
    let handle = partition.handle();
    let (writer, done_rx) = common::writer_until_failure(partition);
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the writer never waited"
    );
    (writer, done_rx)
}

/// Records written past the first buffer of `partition`'s subpartition 0, which is then
/// finished: that buffer, read (and kept) from `view`.
fn past_the_first_buffer(
    partition: &mut ResultPartition,
    view: &mut SubpartitionView,
) -> BufferAndBacklog {
    for _ in 0..50 {
        partition.emit_record(&[1u8; 100][..], 0).unwrap();
    }
    view.poll_next().expect("the first, finished buffer")
}

/// The released writer's result: its wait ended, with Released.
fn assert_writer_released(done_rx: &mpsc::Receiver<Result<(), PartitionError>>) {
    let result = done_rx.recv_timeout(LONG).expect("the writer still waits");
    assert!(
        matches!(result, Err(PartitionError::Released)),
        "{result:?}"
    );
}

#[test]
fn a_writer_waiting_for_the_segment_its_reader_holds_fails_once_the_subpartition_is_released() {
    // With one buffer per subpartition, the writer waits for the one the reader is reading.
    // A release (the consumer went away) must end that wait with Released: the reader gives
    // the buffer back when it sees the release, not only when its view is dropped.
    let (network, mut partition, mut view, _signal) = subpartition_holding(1);
    let handle = partition.handle();
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    partition.flush(0);
    drop(view.poll_next().expect("the flushed record"));
    // More than the rest of the buffer: the writer needs the next one.
    let (writer, done_rx) = writer_waiting(partition);
    handle.release();
    assert!(view.poll_next().is_none());
    assert_writer_released(&done_rx);
    drop((view, writer.join().unwrap()));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_writer_waiting_for_a_segment_a_consumer_keeps_fails_once_the_partition_is_released() {
    // As above, but the consumer task keeps the buffer it read (a local channel's reader in
    // the middle of it, or one that stopped): the release cannot make it give the segment
    // back. The writer's wait must still end with Released at the release (the environment's
    // shutdown releases every partition so), not when that buffer is dropped, if ever.
    let (network, mut partition, mut view, _signal) = subpartition_holding(1);
    let handle = partition.handle();
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    partition.flush(0);
    let kept = view.poll_next().expect("the flushed record");
    let (writer, done_rx) = writer_waiting(partition);
    handle.release();
    assert_writer_released(&done_rx);
    drop((kept, view, writer.join().unwrap()));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_writer_waiting_before_a_record_for_segments_a_consumer_keeps_fails_once_released() {
    // The same with two buffers per subpartition: the writer waits before its next record for
    // a segment to start it in (Flink's output availability), while the consumer keeps what
    // it read of both buffers. The release must end that wait too.
    let (network, mut partition, mut view, _signal) = subpartition_holding(2);
    let handle = partition.handle();
    let first = past_the_first_buffer(&mut partition, &mut view);
    let (writer, done_rx) = writer_waiting(partition);
    // What the writer put in its open second buffer, flushed (as the flusher would).
    handle.flush_all();
    let second = view.poll_next().expect("the second buffer, flushed");
    handle.release();
    assert_writer_released(&done_rx);
    drop((first, second, view, writer.join().unwrap()));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_async_writer_waiting_for_a_segment_a_consumer_keeps_fails_once_released() {
    // The async twin of the builder request above: pending while the consumer keeps the one
    // segment the subpartition may hold, then Released at the release, not pending on.
    let (network, mut partition, mut view, _signal) = subpartition_holding(1);
    let handle = partition.handle();
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    partition.flush(0);
    let kept = view.poll_next().expect("the flushed record");
    {
        let mut emit = std::pin::pin!(partition.emit_record_async(&[2u8; 5000][..], 0));
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(emit.as_mut().poll(&mut context).is_pending(), "no segment");
        handle.release();
        match emit.as_mut().poll(&mut context) {
            std::task::Poll::Ready(Err(PartitionError::Released)) => {}
            other => panic!("expected Released, got {other:?}"),
        }
    }
    drop((kept, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_async_writer_waiting_before_a_record_for_segments_a_consumer_keeps_fails_once_released() {
    // The async twin of the wait before a record: once released it must end with Released.
    // It looped instead (the wait, ready for good after the release, was looked at again
    // and again inside one poll), so the poll runs on a thread of its own here.
    let (network, mut partition, mut view, _signal) = subpartition_holding(2);
    let handle = partition.handle();
    let first = past_the_first_buffer(&mut partition, &mut view);
    handle.flush_all();
    let second = view.poll_next().expect("the second buffer, flushed");
    let (polled_tx, polled_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let writer = thread::spawn(move || {
        let outcome = {
            let mut emit = std::pin::pin!(partition.emit_record_async(&[2u8; 5000][..], 0));
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            let first_poll = emit.as_mut().poll(&mut context).is_pending();
            polled_tx.send(first_poll).unwrap();
            release_rx.recv().unwrap();
            match emit.as_mut().poll(&mut context) {
                std::task::Poll::Ready(result) => Some(result),
                std::task::Poll::Pending => None,
            }
        };
        polled_tx.send(true).unwrap();
        (outcome, partition)
    });
    assert!(polled_rx.recv_timeout(LONG).unwrap(), "no segment at first");
    handle.release();
    release_tx.send(()).unwrap();
    assert!(
        polled_rx.recv_timeout(LONG).is_ok(),
        "the poll after the release returned"
    );
    let (outcome, partition) = writer.join().unwrap();
    assert!(
        matches!(outcome, Some(Err(PartitionError::Released))),
        "{outcome:?}"
    );
    drop((first, second, view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_record_failing_in_its_second_buffer_releases_the_partition_for_every_reader() {
    // The record crosses into a second buffer and fails there: the partition is released,
    // its reader sees the release (no second buffer padded with zeros), and the writer's next
    // record fails.
    let (network, config) = setup(64);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    // 2002 bytes with the prefix leave 2094 in the first buffer; 6188 with a 2-byte prefix
    // fill those and the whole second one.
    partition.emit_record(&[1u8; 2000][..], 0).unwrap();
    let failed = FailingRecord {
        declared: 6188,
        written: 3000,
    };
    assert!(partition.emit_record(&failed, 0).is_err());
    assert!(partition.handle().is_released());
    assert!(view.poll_next().is_none(), "nothing of it readable");
    assert!(matches!(
        partition.emit_record(&[2u8; 10][..], 0),
        Err(PartitionError::Released)
    ));
    drop((view, partition));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// What a view hands out now, in order: data buffers by length, events decoded, each with
/// its sequence number.
#[derive(Debug, PartialEq)]
enum Out {
    Data(usize, u64),
    Event(Event, u64),
}

fn out_now(view: &mut SubpartitionView) -> Vec<Out> {
    let mut out = Vec::new();
    // Bounded: each poll takes an item off a queue the test filled.
    for _ in 0..16 {
        let Some(item) = view.poll_next() else {
            break;
        };
        out.push(if item.buffer.data_type().is_buffer() {
            Out::Data(item.buffer.len(), item.sequence_number)
        } else {
            Out::Event(event_of(&item), item.sequence_number)
        });
    }
    out
}

/// A partition of one subpartition on `segments` segments whose reader sends empty buffers
/// (or not), once that reader took a 100-byte record a flush made readable: its buffer is read
/// to its end so far.
fn reader_past_a_flushed_record(
    segments: usize,
    sends_empty: bool,
) -> (NetworkBufferPool, ResultPartition, SubpartitionView) {
    let (network, config) = setup(segments);
    let mut partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (mut view, _signal) = view(&partition, 0);
    if sends_empty {
        view.send_empty_buffers();
    }
    partition.emit_record(&[1u8; 100][..], 0).unwrap();
    partition.flush(0);
    // 100 bytes and their 1-byte length prefix.
    assert_eq!(out_now(&mut view), [Out::Data(101, 0)]);
    (network, partition, view)
}

#[test]
fn a_buffer_read_to_its_end_by_a_flush_is_sent_empty_only_to_a_consumer_without_exclusive_buffers()
{
    // The flush sends the record; the finish then leaves the buffer with nothing to read. The
    // backlog counted it, so a consumer without exclusive buffers may have lent a floating
    // buffer for it: it comes out empty, to spend that credit (Flink's pollBuffer). A
    // consumer with exclusive buffers never lends for the backlog: dropped.
    for sends_empty in [false, true] {
        let (network, mut partition, mut view) = reader_past_a_flushed_record(8, sends_empty);
        partition.finish().unwrap();
        let expected = if sends_empty {
            vec![Out::Data(0, 1), Out::Event(Event::EndOfPartition, 2)]
        } else {
            vec![Out::Event(Event::EndOfPartition, 1)]
        };
        assert_eq!(out_now(&mut view), expected, "sends empty: {sends_empty}");
        drop((view, partition));
        assert_eq!(network.available_segments(), network.total_segments());
    }
}

#[test]
fn empty_buffers_sent_behind_priority_barriers_are_not_counted_as_overtaken() {
    // Two buffers end empty behind unaligned barriers: one read to its end by a flush (its
    // record went out before), one left empty by a failed record (nothing ever went out).
    // Sent empty to a consumer without exclusive buffers, neither is a data item there: the
    // first barrier overtakes nothing, the second only the full buffer. Counted, the consumer
    // would persist records sent after a barrier as in-flight data of its checkpoint.
    for sends_empty in [false, true] {
        let (network, mut partition, mut view) = reader_past_a_flushed_record(64, sends_empty);
        let first = barrier(8, Alignment::Unaligned);
        partition.broadcast_event(&first, true).unwrap();
        // 4094 bytes with their 2-byte prefix fill a segment.
        partition.emit_record(&[2u8; 4094][..], 0).unwrap();
        let failed = FailingRecord {
            declared: 100,
            written: 40,
        };
        assert!(partition.emit_record(&failed, 0).is_err());
        let second = barrier(9, Alignment::Unaligned);
        partition.broadcast_event(&second, true).unwrap();
        partition.emit_record(&[3u8; 5][..], 0).unwrap();
        partition.finish().unwrap();
        for (barrier, overtaken) in [(&first, 0), (&second, 1)] {
            let item = view.poll_next().expect("a barrier");
            assert_eq!(
                (event_of(&item), item.overtaken),
                (barrier.clone(), overtaken),
                "sends empty: {sends_empty}"
            );
        }
        let expected = if sends_empty {
            vec![
                Out::Data(0, 3),
                Out::Data(4096, 4),
                Out::Data(0, 5),
                Out::Data(6, 6),
                Out::Event(Event::EndOfPartition, 7),
            ]
        } else {
            vec![
                Out::Data(4096, 3),
                Out::Data(6, 4),
                Out::Event(Event::EndOfPartition, 5),
            ]
        };
        assert_eq!(out_now(&mut view), expected, "sends empty: {sends_empty}");
        drop((view, partition));
        assert_eq!(network.available_segments(), network.total_segments());
    }
}

/// A selector following a script of choices, counting its calls.
struct Scripted {
    choices: Vec<Option<usize>>,
    calls: usize,
}

impl Scripted {
    /// Every record to `channel`.
    fn always(channel: usize) -> Self {
        Self {
            choices: vec![Some(channel)],
            calls: 0,
        }
    }
}

impl ChannelSelector<[u8]> for Scripted {
    fn select(&mut self, _record: &[u8], channels: usize) -> Selection {
        let choice = self.choices[self.calls % self.choices.len()];
        self.calls += 1;
        match choice {
            Some(channel) => Selection::Channel(channel % channels),
            None => Selection::Broadcast,
        }
    }
}

/// Every subpartition's buffers (records and events as bytes, in order) after `finish`.
fn subpartition_streams(partition: &ResultPartition, subpartitions: usize) -> Vec<Vec<Vec<u8>>> {
    (0..subpartitions)
        .map(|index| {
            let (mut view, _) = view(partition, index);
            let mut buffers = Vec::new();
            while let Some(item) = view.poll_next() {
                buffers.push(item.buffer.as_slice().to_vec());
            }
            buffers
        })
        .collect()
}

fn batch_partition(n: u64, subpartitions: usize) -> (NetworkBufferPool, ResultPartition) {
    let (network, mut config) = setup(1024);
    config
        .set(
            "taskmanager.network.memory.floating-buffers-per-gate",
            "600",
        )
        .unwrap();
    config
        .set("taskmanager.network.memory.max-buffers-per-channel", "600")
        .unwrap();
    config.set("fluxgate.record.max-size", "64kb").unwrap();
    let id = ResultPartitionId {
        partition: n,
        producer: 7,
    };
    let partition = ResultPartition::new(id, subpartitions, &network, &config).unwrap();
    (network, partition)
}

fn batch_record_len() -> impl Strategy<Value = usize> {
    // Empty, one-byte and two-byte prefixes, a 4 KiB segment's end, and spanning records.
    prop_oneof![
        4 => 0usize..12,
        2 => 120usize..136,
        2 => 4_080usize..4_100,
        1 => 4_100usize..9_000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_batch_leaves_every_subpartition_as_records_emitted_one_by_one_do(
        lens in prop::collection::vec(batch_record_len(), 0..60),
        // Taken modulo the subpartitions.
        choices in prop::collection::vec(prop::option::weighted(0.9, 0usize..17), 1..8),
        // Runs in every subpartition at once up to 16 subpartitions; beyond, one at a time.
        subpartitions in prop_oneof![3 => 1usize..4, 1 => Just(16usize), 1 => Just(17usize)],
        cuts in prop::collection::vec(0usize..60, 0..4),
        flush_every_record in prop::bool::weighted(0.25),
    ) {
        let timeout = if flush_every_record {
            BufferTimeout::Always
        } else {
            BufferTimeout::Never
        };
        let records: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| vec![i as u8; len])
            .collect();
        // 0: one call per record; 1: `emit_all`; 2: `emit_all_async`.
        let streams = |mode: u64| {
            let (network, partition) = batch_partition(40 + mode, subpartitions);
            let selector = Scripted { choices: choices.clone(), calls: 0 };
            let mut writer = RecordWriter::new(partition, selector, timeout);
            if mode > 0 {
                // The records in batches cut where `cuts` says.
                let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(records.len())).collect();
                cuts.sort_unstable();
                let mut start = 0;
                for end in cuts.into_iter().chain([records.len()]) {
                    let batch = records[start..end].iter().map(Vec::as_slice);
                    if mode == 1 {
                        writer.emit_all(batch).unwrap();
                    } else {
                        // The pool has room for every record: nothing waits.
                        poll_once(writer.emit_all_async(batch))
                            .expect("no back pressure")
                            .unwrap();
                    }
                    start = end;
                }
            } else {
                for record in &records {
                    writer.emit(&record[..]).unwrap();
                }
            }
            writer.finish().unwrap();
            let streams = subpartition_streams(writer.partition(), subpartitions);
            let records_out = writer.partition().metrics_snapshot().num_records_out;
            drop(writer);
            assert_eq!(network.available_segments(), network.total_segments());
            (streams, records_out)
        };
        let (one_by_one, counted) = streams(0);
        for mode in [1, 2] {
            let (batched, counted_batched) = streams(mode);
            prop_assert!(batched == one_by_one, "mode {}: the batched streams differ", mode);
            prop_assert_eq!(counted_batched, counted);
        }
    }
}

/// Records of a type serialized in pieces (no contiguous bytes: `u64`), round robin over
/// several subpartitions: a batch leaves every subpartition as one call per record does, and
/// counts them all.
#[test]
fn a_batch_of_records_without_contiguous_bytes_goes_out_as_one_by_one() {
    let streams = |batched: bool| {
        let (network, partition) = batch_partition(60 + u64::from(batched), 3);
        let mut writer = RecordWriter::new(
            partition,
            RoundRobinSelector::default(),
            BufferTimeout::Never,
        );
        let records: Vec<u64> = (0..2_000).collect();
        if batched {
            writer.emit_all(&records).unwrap();
        } else {
            for record in &records {
                writer.emit(record).unwrap();
            }
        }
        writer.finish().unwrap();
        let streams = subpartition_streams(writer.partition(), 3);
        let out = writer.partition().metrics_snapshot().num_records_out;
        drop(writer);
        assert_eq!(network.available_segments(), network.total_segments());
        (streams, out)
    };
    let (one_by_one, out) = streams(false);
    assert_eq!(out, 2_000);
    assert_eq!(streams(true), (one_by_one, out));
}

/// The batch partitions' `fluxgate.record.max-size`: 64 KiB.
const MAX_RECORD: usize = 64 << 10;

/// A record one byte over [`MAX_RECORD`].
fn one_byte_over_max_record() -> Vec<u8> {
    vec![0u8; MAX_RECORD + 1]
}

/// A refused record in a batch round robin over three subpartitions: the records before it
/// are in their subpartitions (published, with the runs of the others), it and the records
/// after it are not, and nothing after it was selected.
#[test]
fn a_batch_over_several_subpartitions_stops_at_a_refused_record_with_the_rest_published() {
    let (network, partition) = batch_partition(62, 3);
    let mut views: Vec<_> = (0..3).map(|index| view(&partition, index).0).collect();
    let selector = Scripted {
        choices: vec![Some(0), Some(1), Some(2)],
        calls: 0,
    };
    let mut writer = RecordWriter::new(partition, selector, BufferTimeout::Never);
    let too_large = one_byte_over_max_record();
    let batch: [&[u8]; 7] = [b"a", b"b", b"c", b"d", b"e", &too_large, b"f"];
    assert_too_large(writer.emit_all(batch), too_large.len(), MAX_RECORD);
    assert_eq!(
        writer.selector().calls,
        6,
        "nothing after the refused record"
    );
    assert_eq!(writer.partition().metrics_snapshot().num_records_out, 5);
    writer.flush_all();
    let read: Vec<Vec<u8>> = views
        .iter_mut()
        .map(|view| {
            let mut bytes = Vec::new();
            while let Some(item) = view.poll_next() {
                bytes.extend_from_slice(item.buffer.as_slice());
            }
            bytes
        })
        .collect();
    let framed = |records: &[&[u8]]| -> Vec<u8> {
        records
            .iter()
            .flat_map(|record| common::framed_record(record))
            .collect()
    };
    assert_eq!(
        read,
        [
            framed(&[b"a", b"d"]),
            framed(&[b"b", b"e"]),
            framed(&[b"c"])
        ]
    );
    drop((views, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_stops_at_a_refused_record_having_selected_nothing_after_it() {
    let (network, partition) = batch_partition(50, 1);
    let (mut view, _) = view(&partition, 0);
    let selector = Scripted::always(0);
    let mut writer = RecordWriter::new(partition, selector, BufferTimeout::Never);
    let too_large = one_byte_over_max_record();
    let batch: [&[u8]; 4] = [b"a", b"bc", &too_large, b"d"];
    assert_too_large(writer.emit_all(batch), too_large.len(), MAX_RECORD);
    assert_eq!(
        writer.selector().calls,
        3,
        "the record after the refused one was selected"
    );
    // The async batch stops there too.
    let result =
        poll_once(writer.emit_all_async(batch[2..].iter().copied())).expect("no back pressure");
    assert_too_large(result, too_large.len(), MAX_RECORD);
    assert_eq!(
        writer.selector().calls,
        4,
        "the async batch selected past the refused record"
    );
    writer.flush_all();
    let item = view
        .poll_next()
        .expect("the records before the refused one");
    assert_eq!(records_of(&item), [b"a".to_vec(), b"bc".to_vec()]);
    drop((item, view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn a_batch_s_records_are_published_for_a_flush_when_the_call_returns() {
    let (network, partition) = batch_partition(51, 2);
    let (mut view, signal) = view(&partition, 1);
    let mut writer = RecordWriter::new(partition, Scripted::always(1), BufferTimeout::Never);
    let records: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; 7]).collect();
    writer.emit_all(records.iter().map(Vec::as_slice)).unwrap();
    // No finish: only what the run published is readable after a flush.
    let seen = signal.notifications();
    writer.flush_all();
    assert!(signal.wait_beyond(seen), "the flush found nothing to read");
    let item = view.poll_next().expect("the flushed buffer");
    assert_eq!(records_of(&item), records);
    assert_eq!(writer.partition().metrics_snapshot().num_records_out, 100);
    drop((item, view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

/// A one-subpartition partition of the default pool sizes over 4 KiB segments, its view,
/// a writer, and 200 records of 1000 bytes: about 50 segments, far more than the
/// partition's pool may hold.
fn back_pressured_batch() -> (
    NetworkBufferPool,
    SubpartitionView,
    Arc<Signal>,
    RecordWriter<Scripted>,
    Vec<Vec<u8>>,
) {
    let (network, config) = setup(16);
    let partition = ResultPartition::new(ID, 1, &network, &config).unwrap();
    let (view, signal) = view(&partition, 0);
    let writer = RecordWriter::new(partition, Scripted::always(0), BufferTimeout::Never);
    let records = (0..200u32).map(|i| vec![i as u8; 1000]).collect();
    (network, view, signal, writer, records)
}

#[test]
fn an_async_batch_waits_under_back_pressure_and_goes_on_where_it_stopped_when_woken() {
    let (network, mut view, _, mut writer, records) = back_pressured_batch();
    let woken = Arc::new(CountingWaker::default());
    let waker = std::task::Waker::from(woken.clone());
    let mut context = std::task::Context::from_waker(&waker);
    let mut got = SpanningReader::new();
    let mut waits = 0;
    {
        let emit = writer.emit_all_async(records.iter().map(Vec::as_slice));
        // A task may move it between threads.
        fn require_send<T: Send>(_: &T) {}
        require_send(&emit);
        let mut emit = std::pin::pin!(emit);
        // Bounded: each pending poll is followed by reading every queued buffer, which frees
        // segments; 200 records cannot need more rounds than buffers.
        for _ in 0..200 {
            if let std::task::Poll::Ready(done) = emit.as_mut().poll(&mut context) {
                done.unwrap();
                break;
            }
            waits += 1;
            let wakes = woken.0.load(Ordering::SeqCst);
            while let Some(item) = view.poll_next() {
                got.read(&item);
            }
            assert!(
                woken.0.load(Ordering::SeqCst) > wakes,
                "the freed segments did not wake the batch"
            );
        }
    }
    assert!(waits > 0, "the batch never waited");
    writer.finish().unwrap();
    while let Some(item) = view.poll_next() {
        if item.buffer.data_type() == DataType::DataBuffer {
            got.read(&item);
        }
    }
    let sent: Vec<(usize, u8)> = records.iter().map(|r| (r.len(), r[0])).collect();
    assert_eq!(got.records, sent);
    assert_eq!(writer.partition().metrics_snapshot().num_records_out, 200);
    drop((view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}

#[test]
fn an_async_batch_dropped_while_it_waits_has_emitted_exactly_the_records_before() {
    let (network, mut view, signal, mut writer, records) = back_pressured_batch();
    let waited = poll_once(writer.emit_all_async(records.iter().map(Vec::as_slice)));
    assert!(waited.is_none(), "the batch did not wait for segments");
    let emitted = writer.partition().metrics_snapshot().num_records_out;
    assert!(emitted > 0 && emitted < 200, "{emitted} records emitted");
    writer.finish().unwrap();
    let (mut got, _) = read_to_end(&mut view, &signal);
    got.reader
        .finish()
        .expect("no record begun and not ended: the one waited for has no bytes out");
    let sent: Vec<(usize, u8)> = records[..emitted as usize]
        .iter()
        .map(|r| (r.len(), r[0]))
        .collect();
    assert_eq!(got.records, sent);
    drop((view, writer));
    assert_eq!(network.available_segments(), network.total_segments());
}
