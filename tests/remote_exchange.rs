//! Remote exchanges over loopback TCP between two shuffle environments in one process, each
//! on both drivers (`_epoll`, `_uring`; the io_uring variants skip loudly where the kernel
//! refuses io_uring).

#[macro_use]
mod common;

use std::thread;
use std::time::{Duration, Instant};

use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    AlignmentMode, ChannelLocation, CheckpointedInputGate, ConsumedSubpartition, GateError,
    GateItem, InputChannel, InputGate, OutputWait, ReaderError, ReaderItem, RecordReader,
    UnionInputGate,
};
use fluxgate::io::Transport;
use fluxgate::partition::{
    BufferTimeout, RecordWriter, ResultPartitionId, RoundRobinSelector, TaskEventListener,
};
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

const LONG: Duration = Duration::from_secs(20);

fn env(node: u128, transport: Transport) -> ShuffleEnvironment {
    env_with(node, transport, &[])
}

/// An environment with some options changed.
fn env_with(node: u128, transport: Transport, options: &[(&str, &str)]) -> ShuffleEnvironment {
    let env = env_from(node, transport, options, |_| {});
    assert_eq!(env.transport(), transport, "the requested driver runs");
    env
}

fn pid(producer: usize) -> ResultPartitionId {
    ResultPartitionId {
        partition: producer as u64,
        producer: 9,
    }
}

/// P producers on one environment, C consumers on another; every record checked.
fn exchange(producers: usize, consumers: usize, records: u64, transport: Transport) {
    exchange_with(producers, consumers, records, transport, &[]);
}

/// [`exchange`] between environments with `options` changed on both.
fn exchange_with(
    producers: usize,
    consumers: usize,
    records: u64,
    transport: Transport,
    options: &[(&str, &str)],
) {
    let producer_env = env_with(1, transport, options);
    let consumer_env = env_with(2, transport, options);
    let peer = producer_env.local_addr();
    let partitions: Vec<_> = (0..producers)
        .map(|p| producer_env.create_partition(pid(p), consumers).unwrap())
        .collect();
    let gates: Vec<_> = (0..consumers)
        .map(|c| {
            let channels: Vec<_> = (0..producers)
                .map(|p| ChannelDescriptor {
                    consumed: ConsumedSubpartition {
                        partition: pid(p),
                        subpartition: c,
                    },
                    location: ProducerLocation::Remote(peer),
                })
                .collect();
            consumer_env.create_gate(&channels).unwrap()
        })
        .collect();
    thread::scope(|s| {
        for (p, partition) in partitions.into_iter().enumerate() {
            s.spawn(move || common::write_records(partition, p, records, 5, None));
        }
        let readers: Vec<_> = gates
            .into_iter()
            .enumerate()
            .map(|(c, gate)| {
                let producer_env = &producer_env;
                s.spawn(move || {
                    let mut reader = RecordReader::new(gate, 1 << 20);
                    let mut next = vec![None::<u64>; producers];
                    let mut count = 0u64;
                    let mut ends = 0;
                    let mut failure = None;
                    loop {
                        let item = match reader.next_timeout(LONG) {
                            Ok(item) => item,
                            Err(error) => {
                                failure = Some(error);
                                break;
                            }
                        };
                        match item {
                            Some(ReaderItem::Record { channel, bytes }) => {
                                let producer =
                                    u64::from_be_bytes(bytes[..8].try_into().unwrap()) as usize;
                                let seq = u64::from_be_bytes(bytes[8..16].try_into().unwrap());
                                assert_eq!(producer, channel);
                                assert_eq!(bytes, &common::record(producer, seq)[..], "payload intact");
                                // Round robin from 0: producer p's record s goes to s % C.
                                assert_eq!(seq as usize % consumers, c);
                                if let Some(previous) = next[producer] {
                                    assert_eq!(
                                        seq,
                                        previous + consumers as u64,
                                        "in order, none lost"
                                    );
                                }
                                next[producer] = Some(seq);
                                count += 1;
                            }
                            Some(ReaderItem::Event { event, .. }) => {
                                assert_eq!(event, Event::EndOfPartition);
                                ends += 1;
                            }
                            None => break,
                        }
                    }
                    if let Some(error) = failure {
                        let gate = reader.gate();
                        for i in 0..producers {
                            let ch = gate.remote_channel(i).unwrap().shared();
                            eprintln!(
                                "consumer {c} channel {i}: next seq {} queued {} available {} unannounced {} pool usage {:.2}",
                                ch.expected_sequence(),
                                ch.queued(),
                                ch.buffers().available(),
                                ch.buffers().unannounced_credit(),
                                gate.pool_usage()
                            );
                        }
                        eprintln!("{}", gate.debug_summary());
                        eprintln!("{}", producer_env.debug_dump());
                        panic!("consumer {c}: {error}");
                    }
                    assert_eq!(ends, producers);
                    count
                })
            })
            .collect();
        let total: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert_eq!(total, records * producers as u64);
    });
    assert!(
        common::pools_full(&[&producer_env, &consumer_env]),
        "segments leaked"
    );
}

fn one_to_one_over_loopback(transport: Transport) {
    exchange(1, 1, 20_000, transport);
}
on_both_drivers!(
    one_to_one_over_loopback,
    one_to_one_over_loopback_epoll,
    one_to_one_over_loopback_uring
);

/// One record at a time, each read before the next is written, between environments with
/// `options`: every I/O thread runs out of work after each record. Returns how often the I/O
/// threads of both environments slept (`DriverStats::sleeps`) from the second record to the
/// last; the first one connects, requests the partition and brings the first credit.
fn sleeps_in_a_ping_pong(transport: Transport, options: &[(&str, &str)], records: u64) -> u64 {
    let producer_env = env_with(1, transport, options);
    let consumer_env = env_with(2, transport, options);
    let partition = producer_env.create_partition(pid(0), 1).unwrap();
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    let sleeps = || {
        [&producer_env, &consumer_env]
            .iter()
            .map(|env| {
                env.driver_stats_within(LONG)
                    .expect("the I/O thread answers")
                    .sleeps
            })
            .sum::<u64>()
    };
    let (read, wait_read) = std::sync::mpsc::sync_channel::<()>(1);
    let slept = thread::scope(|s| {
        // Owned by the scope's closure, so a failing consumer drops it and the producer's
        // wait ends at once instead of after LONG.
        let read = read;
        s.spawn(move || {
            let mut writer = RecordWriter::new(
                partition,
                RoundRobinSelector::default(),
                BufferTimeout::Always,
            );
            for seq in 0..records {
                writer.emit(&common::record(0, seq)[..]).unwrap();
                wait_read.recv_timeout(LONG).expect("the consumer read it");
            }
            writer.finish().unwrap();
        });
        let mut reader = RecordReader::new(gate, 1 << 20);
        let mut before = 0;
        for seq in 0..records {
            match reader.next_timeout(LONG).unwrap() {
                Some(ReaderItem::Record { bytes, .. }) => {
                    assert_eq!(bytes, &common::record(0, seq)[..])
                }
                other => panic!("record {seq} expected, got {other:?}"),
            }
            if seq == 0 {
                before = sleeps();
            }
            if seq + 1 == records {
                break;
            }
            read.send(()).unwrap();
        }
        let slept = sleeps() - before;
        read.send(()).unwrap();
        match reader.next_timeout(LONG).unwrap() {
            Some(ReaderItem::Event { event, .. }) => assert_eq!(event, Event::EndOfPartition),
            other => panic!("the end of the partition expected, got {other:?}"),
        }
        assert!(reader.next_timeout(LONG).unwrap().is_none());
        slept
    });
    assert!(
        common::pools_full(&[&producer_env, &consumer_env]),
        "segments leaked"
    );
    slept
}

/// With a window longer than any gap of a ping-pong, the I/O threads find every record and
/// credit by polling: hardly a sleep. Without one they sleep several times per record, which
/// shows the count can tell the two apart. (This checks that polling replaces parking, by
/// the driver's own count of its sleeps; what that buys in latency is the benchmark's to
/// show.)
fn busy_polling_io_threads_do_not_sleep_between_records(transport: Transport) {
    const RECORDS: u64 = 200;
    // The two drivers' runs take turns: each has two I/O threads polling for a whole second
    // after their last work, and both at once on two vCPUs could stall a ping-pong long
    // enough for a window to close.
    static POLLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = POLLING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let polling = sleeps_in_a_ping_pong(
        transport,
        &[("fluxgate.network.io-thread.busy-poll-us", "1000000")],
        RECORDS,
    );
    assert!(
        polling < RECORDS / 4,
        "{polling} sleeps over {RECORDS} records with a 1 s busy-poll window"
    );
    let parking = sleeps_in_a_ping_pong(transport, &[], RECORDS);
    assert!(
        parking >= RECORDS / 2,
        "only {parking} sleeps over {RECORDS} records without busy polling"
    );
}
on_both_drivers!(
    busy_polling_io_threads_do_not_sleep_between_records,
    busy_polling_io_threads_do_not_sleep_between_records_epoll,
    busy_polling_io_threads_do_not_sleep_between_records_uring
);

/// I/O threads that keep polling for a while before they sleep: the work they find without
/// a wake-up, and the work that wakes them once the window has passed (a consumer that
/// falls behind, or the producers' 5 ms flush timeout, can leave gaps longer than it), all
/// arrive exactly.
fn four_to_four_with_busy_polling_io_threads(transport: Transport) {
    exchange_with(
        4,
        4,
        5_000,
        transport,
        &[("fluxgate.network.io-thread.busy-poll-us", "200")],
    );
}
on_both_drivers!(
    four_to_four_with_busy_polling_io_threads,
    four_to_four_with_busy_polling_io_threads_epoll,
    four_to_four_with_busy_polling_io_threads_uring
);

fn four_to_four_over_one_connection(transport: Transport) {
    exchange(4, 4, 5_000, transport);
}
on_both_drivers!(
    four_to_four_over_one_connection,
    four_to_four_over_one_connection_epoll,
    four_to_four_over_one_connection_uring
);

/// Sixteen channels to one producer with room for three per connection: the consumer opens
/// more connections as each fills (a channel beyond a full one failed with "no room").
fn channels_beyond_a_full_connection_open_another(transport: Transport) {
    exchange_with(
        4,
        4,
        2_000,
        transport,
        &[("fluxgate.network.max-channels-per-connection", "3")],
    );
}
on_both_drivers!(
    channels_beyond_a_full_connection_open_another,
    channels_beyond_a_full_connection_open_another_epoll,
    channels_beyond_a_full_connection_open_another_uring
);

/// Dropping the environment releases the partitions it served: a writer blocked for room in
/// a partition no consumer asked for ends with an error (it waited for good).
fn dropping_the_environment_ends_a_writer_no_consumer_reads(transport: Transport) {
    let env = env(1, transport);
    let partition = env.create_partition(pid(0), 1).unwrap();
    let handle = partition.handle();
    let (ended_tx, ended) = std::sync::mpsc::channel();
    let writer = thread::spawn(move || {
        let mut writer = RecordWriter::new(
            partition,
            RoundRobinSelector::default(),
            BufferTimeout::from_millis(1),
        );
        // Bounded: far more than the pool holds; ends with an error once released.
        let failed = (0..10_000_000u64).any(|seq| writer.emit(&[seq as u8; 1000][..]).is_err());
        let _ = ended_tx.send(failed);
    });
    assert!(
        common::wait_until(LONG, || handle.is_back_pressured()),
        "the writer never waited"
    );
    drop(env);
    assert_eq!(
        ended.recv_timeout(LONG),
        Ok(true),
        "the writer ended with an error"
    );
    writer.join().unwrap();
}
on_both_drivers!(
    dropping_the_environment_ends_a_writer_no_consumer_reads,
    dropping_the_environment_ends_a_writer_no_consumer_reads_epoll,
    dropping_the_environment_ends_a_writer_no_consumer_reads_uring
);

fn sixteen_to_sixteen_multiplexed(transport: Transport) {
    exchange(16, 16, 500, transport);
}
on_both_drivers!(
    sixteen_to_sixteen_multiplexed,
    sixteen_to_sixteen_multiplexed_epoll,
    sixteen_to_sixteen_multiplexed_uring
);

/// Channels without exclusive buffers (`buffers-per-channel` 0, as Flink allows): every
/// segment a consumer receives into is floating, asked for only when the sender reports a
/// backlog. Two ways a sender could be left with data and no credit, waiting forever for
/// credit the consumer never asks for, are covered: a buffer the flush timeout made readable
/// before it filled must count in the backlog, and a sender at zero credit that was woken for
/// nothing must still hear of the next buffer to announce it.
fn channels_without_exclusive_buffers_live_on_floating_ones(transport: Transport) {
    let options = [("taskmanager.network.memory.buffers-per-channel", "0")];
    exchange_with(1, 1, 5_000, transport, &options);
    exchange_with(4, 4, 50_000, transport, &options);
    // One floating buffer for four channels, the extreme Flink allows: lent only to a channel
    // whose sender has a buffer for it, or a producer blocked on its other subpartitions
    // never fills the one that holds it.
    let one_floating = [
        ("taskmanager.network.memory.buffers-per-channel", "0"),
        ("taskmanager.network.memory.floating-buffers-per-gate", "1"),
    ];
    exchange_with(4, 4, 20_000, transport, &one_floating);
}
on_both_drivers!(
    channels_without_exclusive_buffers_live_on_floating_ones,
    channels_without_exclusive_buffers_live_on_floating_ones_epoll,
    channels_without_exclusive_buffers_live_on_floating_ones_uring
);

/// Flink's `onBlockingUpstream`: a channel without exclusive buffers gives its floating ones
/// back when an aligned barrier blocks it, and both sides drop the credit they stood for when
/// consumption resumes. With one floating buffer for four such channels, a blocked channel
/// keeping it would stop the others from bringing their barriers: alignment would never end.
fn aligned_barriers_with_one_floating_buffer_and_no_exclusive_ones(transport: Transport) {
    aligned_exchange_without_exclusive_buffers(transport, false);
}
on_both_drivers!(
    aligned_barriers_with_one_floating_buffer_and_no_exclusive_ones,
    aligned_barriers_with_one_floating_buffer_and_no_exclusive_ones_epoll,
    aligned_barriers_with_one_floating_buffer_and_no_exclusive_ones_uring
);

/// The same through a union of two remote gates (two channels each, one floating buffer
/// each): the union hands its barriers to the aligner and its resumes to the member gates.
fn aligned_barriers_through_a_union_of_remote_gates(transport: Transport) {
    aligned_exchange_without_exclusive_buffers(transport, true);
}
on_both_drivers!(
    aligned_barriers_through_a_union_of_remote_gates,
    aligned_barriers_through_a_union_of_remote_gates_epoll,
    aligned_barriers_through_a_union_of_remote_gates_uring
);

/// Reads `gate` through an aligning [`CheckpointedInputGate`] to its end: the payload bytes
/// per channel and the checkpoints handed over, in order.
fn read_aligned<const CHANNELS: usize, G: InputGate>(gate: G) -> ([u64; CHANNELS], Vec<u64>) {
    let mut checkpointed = CheckpointedInputGate::new(gate, AlignmentMode::Aligned, None);
    let mut bytes = [0u64; CHANNELS];
    let mut checkpoints = Vec::new();
    // Bounded: the producers send finitely many buffers and events, then the end.
    loop {
        match checkpointed.next_until(Some(Instant::now() + LONG)) {
            Ok(Some(item)) => match item.item {
                GateItem::Buffer(buffer) => bytes[item.channel] += buffer.len() as u64,
                GateItem::Event {
                    event: Event::CheckpointBarrier(barrier),
                    ..
                } => checkpoints.push(barrier.id),
                GateItem::Event { event, .. } => assert_eq!(event, Event::EndOfPartition),
            },
            Ok(None) => return (bytes, checkpoints),
            Err(error) => {
                panic!("stalled with {bytes:?} bytes read and checkpoints {checkpoints:?}: {error}")
            }
        }
    }
}

/// Four producers, aligned barriers every 300 records, consumed through one gate of four
/// channels or (`union`) a union of two gates of two; every byte and checkpoint checked.
fn aligned_exchange_without_exclusive_buffers(transport: Transport, union: bool) {
    const CHANNELS: usize = 4;
    const RECORDS: u64 = 3_000;
    const CHECKPOINTS: u64 = 10;
    let producer_env = env(1, transport);
    let consumer_env = env_with(
        2,
        transport,
        &[
            ("taskmanager.network.memory.buffers-per-channel", "0"),
            ("taskmanager.network.memory.floating-buffers-per-gate", "1"),
        ],
    );
    let peer = producer_env.local_addr();
    let partitions: Vec<_> = (0..CHANNELS)
        .map(|p| producer_env.create_partition(pid(p), 1).unwrap())
        .collect();
    let channels: Vec<_> = (0..CHANNELS)
        .map(|p| ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(p),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(peer),
        })
        .collect();
    // Every producer sends records of the same sizes.
    let expected_bytes: u64 = (0..RECORDS)
        .map(|seq| common::framed_record(&common::record(0, seq)).len() as u64)
        .sum();
    let every = RECORDS / CHECKPOINTS;
    thread::scope(|s| {
        for (p, partition) in partitions.into_iter().enumerate() {
            s.spawn(move || common::write_records(partition, p, RECORDS, 1, Some(every)));
        }
        let gate = |channels| consumer_env.create_gate(channels).unwrap();
        let (bytes, checkpoints) = if union {
            let members = vec![gate(&channels[..2]), gate(&channels[2..])];
            read_aligned::<CHANNELS, _>(UnionInputGate::new(members))
        } else {
            read_aligned::<CHANNELS, _>(gate(&channels))
        };
        assert_eq!(bytes, [expected_bytes; CHANNELS]);
        assert_eq!(checkpoints, (1..=CHECKPOINTS).collect::<Vec<_>>());
    });
    assert!(
        common::pools_full(&[&producer_env, &consumer_env]),
        "segments leaked"
    );
}

fn a_slow_consumer_keeps_the_producer_within_its_pool(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let partition = producer_env.create_partition(pid(0), 1).unwrap();
    let max = partition.pool().spec().max_segments;
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    let records = 3_000u64;
    let peak = std::sync::atomic::AtomicUsize::new(0);
    thread::scope(|s| {
        let peak = &peak;
        let producer = s.spawn(move || {
            let mut writer = RecordWriter::new(
                partition,
                RoundRobinSelector::default(),
                BufferTimeout::Never,
            );
            for _ in 0..records {
                writer.emit(&[7u8; 1000][..]).unwrap();
                let in_use = writer.partition().pool().in_use_segments();
                peak.fetch_max(in_use, std::sync::atomic::Ordering::Relaxed);
            }
            writer.finish().unwrap();
            writer.partition().pool().blocked_nanos()
        });
        // The consumer reads nothing until the producer ran into its pool's limit (the
        // consumer's credit is taken by then): back pressure, not a race, holds it back.
        assert!(
            common::wait_until(LONG, || {
                peak.load(std::sync::atomic::Ordering::Relaxed) == max
            }),
            "the producer never filled its pool"
        );
        let mut reader = RecordReader::new(gate, 1 << 20);
        let mut count = 0;
        let mut peak_gate = 0.0f64;
        // Bounded: each read waits at most LONG, and the stream ends.
        loop {
            match reader.next_timeout(LONG).unwrap() {
                Some(ReaderItem::Record { .. }) => count += 1,
                Some(ReaderItem::Event { .. }) => {}
                None => break,
            }
            peak_gate = peak_gate.max(reader.gate().pool_usage());
        }
        assert_eq!(count, records);
        let blocked = producer.join().unwrap();
        assert!(blocked > 0, "the producer was never held back");
        let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
        assert!(peak <= max, "producer used {peak} segments, pool max {max}");
        assert!(peak_gate <= 1.0);
    });
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_slow_consumer_keeps_the_producer_within_its_pool,
    a_slow_consumer_keeps_the_producer_within_its_pool_epoll,
    a_slow_consumer_keeps_the_producer_within_its_pool_uring
);

fn barriers_cross_the_wire_unaligned_overtaking_and_aligned_blocking(transport: Transport) {
    let producer_env = env(1, transport);
    // Little credit, so the producer still holds data when the unaligned barrier comes: with
    // no floating buffers the gate's pool has one segment beyond the two exclusive ones, and
    // the test keeps two received buffers until the end.
    let consumer_env = env_with(
        2,
        transport,
        &[("taskmanager.network.memory.floating-buffers-per-gate", "0")],
    );
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let mut gate = remote_gate(&consumer_env, producer_env.local_addr());
    let barrier = |id, alignment| {
        Event::CheckpointBarrier(CheckpointBarrier {
            id,
            timestamp: 0,
            kind: CheckpointKind::Checkpoint,
            alignment,
        })
    };
    partition.emit_record(&b"before"[..], 0).unwrap();
    partition.flush(0);
    partition
        .broadcast_event(&barrier(1, Alignment::Aligned), false)
        .unwrap();
    partition.emit_record(&b"after"[..], 0).unwrap();
    partition.flush(0);
    let first = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(first.item, GateItem::Buffer(_)));
    let second = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(
        second.item,
        GateItem::Event {
            event: Event::CheckpointBarrier(_),
            ..
        }
    ));
    // Blocked: the producer does not send "after" before ResumeConsumption.
    assert_eq!(
        gate.next_timeout(Duration::from_millis(200)).unwrap_err(),
        GateError::TimedOut
    );
    gate.resume_consumption(0).unwrap();
    let third = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(third.item, GateItem::Buffer(_)));
    // Unaligned: a priority barrier overtakes data the producer still holds.
    for _ in 0..3 {
        partition.emit_record(&[1u8; 8000][..], 0).unwrap();
    }
    partition
        .broadcast_event(&barrier(2, Alignment::Unaligned), true)
        .unwrap();
    let mut saw_barrier_at = None;
    for i in 0..6 {
        let item = gate.next_timeout(LONG).unwrap().unwrap();
        if let GateItem::Event {
            event: Event::CheckpointBarrier(b),
            priority,
        } = item.item
        {
            assert_eq!(b.id, 2);
            assert!(priority);
            saw_barrier_at = Some(i);
            break;
        }
    }
    assert!(
        saw_barrier_at.is_some_and(|i| i < 3),
        "the barrier overtook queued data (seen at {saw_barrier_at:?})"
    );
    drop((first, third));
    drop(gate);
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    barriers_cross_the_wire_unaligned_overtaking_and_aligned_blocking,
    barriers_cross_the_wire_unaligned_overtaking_and_aligned_blocking_epoll,
    barriers_cross_the_wire_unaligned_overtaking_and_aligned_blocking_uring
);

/// A task whose output is back-pressured still takes an unaligned barrier that came over
/// the wire behind data it has not read, and sends it on ahead of its own queued output;
/// the data comes after, once the output has room (Flink's availability-driven task loop).
fn a_back_pressured_task_takes_an_unaligned_barrier_from_the_wire(transport: Transport) {
    let source_env = env(1, transport);
    let task_env = env(2, transport);
    let sink_env = env(3, transport);
    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
        id: 4,
        timestamp: 0,
        kind: CheckpointKind::Checkpoint,
        alignment: Alignment::Unaligned,
    });
    let mut source = source_env.create_partition(pid(0), 1).unwrap();
    let gate = remote_gate(&task_env, source_env.local_addr());
    let mut input = CheckpointedInputGate::new(gate, AlignmentMode::Unaligned, None);
    // No consumer yet: what the task writes stays queued, and its output stays unavailable.
    let mut output = task_env.create_partition(pid(1), 1).unwrap();
    common::back_pressure(&mut output);
    source.emit_record(&b"in-flight"[..], 0).unwrap();
    source.flush(0);
    source.broadcast_event(&barrier, true).unwrap();

    match input
        .wait_for_output(&mut output, Some(Instant::now() + LONG))
        .unwrap()
    {
        OutputWait::Event(item) => assert!(matches!(
            item.item,
            GateItem::Event { event, priority: true } if event == barrier
        )),
        OutputWait::Available => panic!("the output was available"),
    }
    assert_eq!(input.pending_checkpoint(), Some(4));
    output.broadcast_event(&barrier, true).unwrap();
    assert_eq!(
        input
            .wait_for_output(
                &mut output,
                Some(Instant::now() + Duration::from_millis(20))
            )
            .unwrap_err(),
        GateError::TimedOut,
        "no data is read while the output is back-pressured"
    );

    // The consumer comes: the barrier first, ahead of the queued data, whose transfer frees
    // the task's output.
    let mut downstream = sink_env
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(1),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(task_env.local_addr()),
        }])
        .unwrap();
    let first = downstream.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(
        first.item,
        GateItem::Event { event, priority: true } if event == barrier
    ));
    assert!(matches!(
        input
            .wait_for_output(&mut output, Some(Instant::now() + LONG))
            .unwrap(),
        OutputWait::Available
    ));
    let item = input
        .next_until(Some(Instant::now() + LONG))
        .unwrap()
        .unwrap();
    match &item.item {
        GateItem::Buffer(buffer) => {
            assert_eq!(buffer.as_slice(), common::framed_record(b"in-flight"))
        }
        other => panic!("expected the data, got {other:?}"),
    }
    assert_eq!(
        input.pending_checkpoint(),
        None,
        "its in-flight data was read"
    );
    drop((item, input, source, output, downstream));
    assert!(common::pools_full(&[&source_env, &task_env, &sink_env]));
}
on_both_drivers!(
    a_back_pressured_task_takes_an_unaligned_barrier_from_the_wire,
    a_back_pressured_task_takes_an_unaligned_barrier_from_the_wire_epoll,
    a_back_pressured_task_takes_an_unaligned_barrier_from_the_wire_uring
);

/// FLIP-147 across the wire: the consumer's acknowledgement that it processed every record
/// before EndOfData reaches the producer (AckAllUserRecordsProcessed), which only then sees
/// all data processed and finishes.
fn end_of_data_is_acknowledged_across_the_wire(transport: Transport) {
    for close_at_once in [false, true] {
        end_of_data_acknowledged(transport, close_at_once);
    }
}

/// [`end_of_data_is_acknowledged_across_the_wire`], the consumer closing its gate right after
/// its acknowledgement (`close_at_once`): the acknowledgement still goes out, ahead of the
/// cancel the close sends.
fn end_of_data_acknowledged(transport: Transport, close_at_once: bool) {
    use fluxgate::event::StopMode;
    use fluxgate::gate::EndOfDataStatus;
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let mut gate = remote_gate(&consumer_env, producer_env.local_addr());
    partition.emit_record(&b"last record"[..], 0).unwrap();
    partition.notify_end_of_data(StopMode::Drain).unwrap();
    let mut records = 0;
    loop {
        let item = gate.next_timeout(LONG).unwrap().unwrap();
        match item.item {
            GateItem::Buffer(_) => records += 1,
            GateItem::Event {
                event: Event::EndOfData(StopMode::Drain),
                ..
            } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(records, 1);
    assert_eq!(gate.end_of_data_status(), EndOfDataStatus::Drained);
    assert!(!partition.is_all_data_processed());
    gate.acknowledge_all_records_processed(0).unwrap();
    if close_at_once {
        gate.close();
        drop(gate);
        assert!(
            partition
                .wait_all_data_processed(Some(Instant::now() + LONG))
                .unwrap(),
            "the acknowledgement went out before the cancel"
        );
        drop(partition);
        assert!(common::pools_full(&[&producer_env, &consumer_env]));
        return;
    }
    assert!(
        partition
            .wait_all_data_processed(Some(Instant::now() + LONG))
            .unwrap(),
        "the acknowledgement crossed the wire"
    );
    partition.finish().unwrap();
    let end = gate.next_timeout(LONG).unwrap().unwrap();
    assert!(matches!(
        end.item,
        GateItem::Event {
            event: Event::EndOfPartition,
            ..
        }
    ));
    assert!(gate.next_timeout(LONG).unwrap().is_none());
    drop((end, gate, partition));
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    end_of_data_is_acknowledged_across_the_wire,
    end_of_data_is_acknowledged_across_the_wire_epoll,
    end_of_data_is_acknowledged_across_the_wire_uring
);

/// Reads on until the reader fails (each read bounded by LONG): its error.
fn first_error<G: fluxgate::gate::InputGate>(reader: &mut RecordReader<G>) -> ReaderError {
    loop {
        match reader.next_timeout(LONG) {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the gate ended normally"),
            Err(error) => return error,
        }
    }
}

/// A producer that fails says why (Flink's `release(cause)`): its consumer's read returns
/// `ProducerFailed` with that cause, across the wire and in the same process alike. Before,
/// a remote consumer got a transport error reading "the partition was released", and a local
/// one a bare release: one producer's crash showed as N network failures with no cause.
fn a_failing_producer_s_cause_reaches_its_consumers(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    for local in [false, true] {
        let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
        let (gate_env, location) = if local {
            (&producer_env, ProducerLocation::Local)
        } else {
            (
                &consumer_env,
                ProducerLocation::Remote(producer_env.local_addr()),
            )
        };
        let mut reader = RecordReader::new(one_channel_gate(gate_env, location), 1 << 20);
        partition.emit_record(&b"last words"[..], 0).unwrap();
        partition.flush(0);
        assert!(matches!(
            reader.next_timeout(LONG).unwrap(),
            Some(ReaderItem::Record { .. })
        ));
        partition.fail("disk full on /data");
        match first_error(&mut reader) {
            ReaderError::Gate(GateError::ProducerFailed { channel, cause }) => {
                assert_eq!((channel, cause.as_str()), (0, "disk full on /data"))
            }
            other => panic!("local {local}: expected ProducerFailed, got {other:?}"),
        }
        drop((reader, partition));
        producer_env.partition_manager().release(pid(0)).ok();
    }
    // A request that comes after the failure hears the cause too (it heard the release).
    let partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.handle().fail("lost its disk");
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    let mut reader = RecordReader::new(gate, 1 << 20);
    match reader.next_timeout(LONG) {
        Err(ReaderError::Gate(GateError::ProducerFailed { cause, .. })) => {
            assert_eq!(cause, "lost its disk")
        }
        other => panic!("expected ProducerFailed, got {other:?}"),
    }
    drop((reader, partition));
    producer_env.partition_manager().release(pid(0)).ok();
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_failing_producer_s_cause_reaches_its_consumers,
    a_failing_producer_s_cause_reaches_its_consumers_epoll,
    a_failing_producer_s_cause_reaches_its_consumers_uring
);

fn a_producer_that_disappears_fails_the_consumer_with_a_typed_error(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    partition.emit_record(&b"last words"[..], 0).unwrap();
    partition.flush(0);
    let mut reader = RecordReader::new(gate, 1 << 20);
    assert!(matches!(
        reader.next_timeout(LONG).unwrap(),
        Some(ReaderItem::Record { .. })
    ));
    // The producer's process goes away: its I/O thread and sockets close (the partition,
    // dropped unfinished, is released only after: the consumer sees the connection's loss).
    let producer_addr = producer_env.local_addr();
    drop(producer_env);
    drop(partition);
    match first_error(&mut reader) {
        ReaderError::Gate(GateError::ConnectionLost { channel, peer, .. }) => {
            assert_eq!(
                (channel, peer),
                (0, producer_addr),
                "names the lost producer"
            )
        }
        other => panic!("expected ConnectionLost, got {other:?}"),
    }
    drop(reader);
    assert!(common::pools_full(&[&consumer_env]));
}
on_both_drivers!(
    a_producer_that_disappears_fails_the_consumer_with_a_typed_error,
    a_producer_that_disappears_fails_the_consumer_with_a_typed_error_epoll,
    a_producer_that_disappears_fails_the_consumer_with_a_typed_error_uring
);

fn a_partition_registered_late_is_found_within_the_request_timeout(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let gate = consumer_env
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(3),
                subpartition: 0,
            },
            location: ProducerLocation::Remote(producer_env.local_addr()),
        }])
        .unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    assert!(matches!(
        reader.next_timeout(Duration::from_millis(100)),
        Err(ReaderError::Gate(GateError::TimedOut))
    ));
    let mut partition = producer_env.create_partition(pid(3), 1).unwrap();
    partition.emit_record(&b"late"[..], 0).unwrap();
    partition.finish().unwrap();
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"late"),
        other => panic!("expected the record, got {other:?}"),
    }
    // Both drivers answer the diagnostics dump.
    let dump = producer_env.debug_dump();
    assert!(
        dump.contains("connection") && dump.contains("server:"),
        "{dump}"
    );
    assert!(matches!(
        reader.next_timeout(LONG).unwrap(),
        Some(ReaderItem::Event {
            event: Event::EndOfPartition,
            ..
        })
    ));
    drop(reader);
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_partition_registered_late_is_found_within_the_request_timeout,
    a_partition_registered_late_is_found_within_the_request_timeout_epoll,
    a_partition_registered_late_is_found_within_the_request_timeout_uring
);

#[test]
fn auto_picks_io_uring_where_available() {
    let env = ShuffleEnvironment::start(EnvConfig {
        transport: Transport::Auto,
        ..EnvConfig::default()
    })
    .unwrap();
    match fluxgate::io::uring::probe() {
        Ok(()) => assert_eq!(env.transport(), Transport::Uring),
        Err(reason) => {
            eprintln!("io_uring unavailable ({reason}): auto must pick epoll");
            assert_eq!(env.transport(), Transport::Epoll);
        }
    }
}

fn a_peer_speaking_garbage_gets_an_error_response_and_is_disconnected(transport: Transport) {
    use std::io::{Read, Write};
    let producer_env = env(1, transport);
    let mut socket = std::net::TcpStream::connect(producer_env.local_addr()).unwrap();
    socket.set_read_timeout(Some(LONG)).unwrap();
    socket.write_all(&[0xFF; 64]).unwrap();
    let mut answer = Vec::new();
    socket
        .read_to_end(&mut answer)
        .expect("the server closes the connection");
    assert!(
        !answer.is_empty(),
        "an error response came before the close"
    );
    // The server is still serving: a well-behaved consumer gets its data.
    let consumer_env = env(2, transport);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    partition.emit_record(&b"still here"[..], 0).unwrap();
    partition.finish().unwrap();
    let mut reader = RecordReader::new(gate, 1 << 20);
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"still here"),
        other => panic!("expected the record, got {other:?}"),
    }
    drop(reader);
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_peer_speaking_garbage_gets_an_error_response_and_is_disconnected,
    a_peer_speaking_garbage_gets_an_error_response_and_is_disconnected_epoll,
    a_peer_speaking_garbage_gets_an_error_response_and_is_disconnected_uring
);

/// An environment from a full `EnvConfig` (bind address, request timeout) plus network
/// options.
fn env_from(
    node: u128,
    transport: Transport,
    options: &[(&str, &str)],
    adjust: impl FnOnce(&mut EnvConfig),
) -> ShuffleEnvironment {
    let mut config = config_for(node, transport, options);
    adjust(&mut config);
    ShuffleEnvironment::start(config).unwrap()
}

/// The tests' environment settings: small segments and network memory.
fn config_for(node: u128, transport: Transport, options: &[(&str, &str)]) -> EnvConfig {
    let mut network = NetworkConfig::default();
    for (key, value) in [
        ("taskmanager.memory.segment-size", "8kb"),
        ("taskmanager.memory.network.max", "16mb"),
        ("fluxgate.memory.arena-size", "4mb"),
    ]
    .iter()
    .chain(options)
    {
        network.set(key, value).unwrap();
    }
    EnvConfig {
        network,
        node,
        transport,
        ..EnvConfig::default()
    }
}

/// A one-channel gate on `consumer_env` reading `pid(0)` from `peer`.
fn remote_gate(
    consumer_env: &ShuffleEnvironment,
    peer: std::net::SocketAddr,
) -> fluxgate::gate::SingleInputGate {
    one_channel_gate(consumer_env, ProducerLocation::Remote(peer))
}

/// A one-channel gate on `consumer_env` reading `pid(0)`, its producer at `location`.
fn one_channel_gate(
    consumer_env: &ShuffleEnvironment,
    location: ProducerLocation,
) -> fluxgate::gate::SingleInputGate {
    consumer_env
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: pid(0),
                subpartition: 0,
            },
            location,
        }])
        .unwrap()
}

/// The transport's retries for the gate's channel 0.
fn retries_of(gate: &fluxgate::gate::SingleInputGate) -> u64 {
    match gate.channel(0) {
        Some(fluxgate::gate::InputChannel::Remote(channel)) => channel.shared().request_retries(),
        other => panic!("a remote channel, got {other:?}"),
    }
}

/// Waits (bounded) until `condition` holds.
fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        common::wait_until(LONG, condition),
        "timed out waiting until {what}"
    );
}

/// Reads one record through `gate` and checks it, then the end of the partition.
fn read_one(gate: fluxgate::gate::SingleInputGate, expected: &[u8]) {
    let mut reader = RecordReader::new(gate, 1 << 20);
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, expected),
        other => panic!("expected the record, got {other:?}"),
    }
    loop {
        match reader.next_timeout(LONG).unwrap() {
            Some(ReaderItem::Event { .. }) => {}
            None => break,
            other => panic!("expected the end, got {other:?}"),
        }
    }
}

const FAST_BACKOFF: [(&str, &str); 2] = [
    ("taskmanager.network.request-backoff.initial", "5"),
    ("taskmanager.network.request-backoff.max", "2000"),
];

fn a_partition_refused_at_first_is_found_by_a_retried_request(transport: Transport) {
    // The producer answers PartitionNotFound at once (no server-side wait), so only the
    // consumer's back-off and re-request can find the partition registered later.
    let producer_env = env_from(1, transport, &[], |c| {
        c.partition_request_timeout = Duration::ZERO;
    });
    let consumer_env = env_from(2, transport, &FAST_BACKOFF, |_| {});
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    wait_until("the request was refused and sent again", || {
        retries_of(&gate) >= 1
    });
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"found late"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(gate, b"found late");
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_partition_refused_at_first_is_found_by_a_retried_request,
    a_partition_refused_at_first_is_found_by_a_retried_request_epoll,
    a_partition_refused_at_first_is_found_by_a_retried_request_uring
);

fn a_partition_never_registered_fails_with_partition_not_found(transport: Transport) {
    let producer_env = env_from(1, transport, &[], |c| {
        c.partition_request_timeout = Duration::ZERO;
    });
    let consumer_env = env_from(
        2,
        transport,
        &[
            ("taskmanager.network.request-backoff.initial", "2"),
            ("taskmanager.network.request-backoff.max", "16"),
        ],
        |_| {},
    );
    let gate = remote_gate(&consumer_env, producer_env.local_addr());
    let mut reader = RecordReader::new(gate, 1 << 20);
    match reader.next_timeout(LONG) {
        Err(ReaderError::Gate(GateError::Partition {
            source: fluxgate::partition::PartitionError::PartitionNotFound(id),
            ..
        })) => assert_eq!(id, pid(0)),
        other => panic!("expected PartitionNotFound, got {other:?}"),
    }
    // 2, 4, 8, 16 ms: four re-requests, then the one answered at the maximum gives up.
    assert_eq!(retries_of(reader.gate()), 4);
    drop(reader);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_partition_never_registered_fails_with_partition_not_found,
    a_partition_never_registered_fails_with_partition_not_found_epoll,
    a_partition_never_registered_fails_with_partition_not_found_uring
);

/// A loopback address nobody listens on, and the socket that holds it: bound, never
/// listening, so connects to it are refused and no other socket of the machine (another
/// test's listener, an outgoing connection's port) takes it while it is held.
fn unused_addr() -> (std::net::SocketAddr, socket2::Socket) {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket
        .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    (addr, socket)
}

fn a_refused_connection_is_retried_until_the_producer_listens(transport: Transport) {
    // Nodes started apart: the consumer asks before the producer's process listens.
    let (addr, held) = unused_addr();
    let consumer_env = env_from(2, transport, &FAST_BACKOFF, |_| {});
    let gate = remote_gate(&consumer_env, addr);
    wait_until("the connection was refused and tried again", || {
        retries_of(&gate) >= 1
    });
    drop(held);
    let producer_env = env_from(1, transport, &[], |c| c.bind = addr);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"listening now"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(gate, b"listening now");
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_refused_connection_is_retried_until_the_producer_listens,
    a_refused_connection_is_retried_until_the_producer_listens_epoll,
    a_refused_connection_is_retried_until_the_producer_listens_uring
);

fn a_connection_refused_for_good_fails_the_channel(transport: Transport) {
    let (addr, _held) = unused_addr();
    let consumer_env = env_from(
        2,
        transport,
        &[
            ("taskmanager.network.request-backoff.initial", "2"),
            ("taskmanager.network.request-backoff.max", "16"),
        ],
        |_| {},
    );
    let gate = remote_gate(&consumer_env, addr);
    let mut reader = RecordReader::new(gate, 1 << 20);
    match reader.next_timeout(LONG) {
        Err(ReaderError::Gate(GateError::Transport { reason, .. })) => {
            assert!(
                reason.contains(&addr.to_string()),
                "names the peer: {reason}"
            )
        }
        other => panic!("expected a transport error, got {other:?}"),
    }
    assert_eq!(retries_of(reader.gate()), 4);
    drop(reader);
    assert!(common::pools_full(&[&consumer_env]));
}
on_both_drivers!(
    a_connection_refused_for_good_fails_the_channel,
    a_connection_refused_for_good_fails_the_channel_epoll,
    a_connection_refused_for_good_fails_the_channel_uring
);

fn a_peer_that_never_answers_does_not_hold_up_other_connections(transport: Transport) {
    let (hole, filler) = common::black_hole();
    let hole_addr = hole.local_addr().unwrap().as_socket().unwrap();
    let producer_env = env(1, transport);
    // The connect to the black hole times out only long after the test's other waits end.
    let consumer_env = env_from(2, transport, &[], |c| c.connect_timeout = LONG * 3);
    let mut stuck = remote_gate(&consumer_env, hole_addr);
    // Asked for after the black hole's connection: a driver that connected on its I/O
    // thread would serve it only once that connect timed out.
    let served = remote_gate(&consumer_env, producer_env.local_addr());
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"not held up"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(served, b"not held up");
    assert!(
        matches!(stuck.poll_next(), Ok(None)),
        "the black hole's channel still waits for its connection"
    );
    drop((partition, producer_env));
    // The environment ends while the connect is under way: the waiting channel fails.
    drop(consumer_env);
    match stuck.poll_next() {
        Err(GateError::Transport { reason, .. }) => {
            assert!(reason.contains("shut down"), "{reason}")
        }
        other => panic!("the waiting channel fails at shutdown, got {other:?}"),
    }
    drop((stuck, hole, filler));
}
on_both_drivers!(
    a_peer_that_never_answers_does_not_hold_up_other_connections,
    a_peer_that_never_answers_does_not_hold_up_other_connections_epoll,
    a_peer_that_never_answers_does_not_hold_up_other_connections_uring
);

fn a_channel_located_twice_is_connected_once(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let mut gate = one_channel_gate(&consumer_env, ProducerLocation::Unknown);
    gate.request_partitions(Instant::now()).unwrap();
    let located = ProducerLocation::Remote(producer_env.local_addr());
    // Lazy scheduling may report a producer's location more than once.
    consumer_env
        .update_channel(&mut gate, 0, located.clone())
        .unwrap();
    consumer_env.update_channel(&mut gate, 0, located).unwrap();
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"located"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(gate, b"located");
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_channel_located_twice_is_connected_once,
    a_channel_located_twice_is_connected_once_epoll,
    a_channel_located_twice_is_connected_once_uring
);

/// Environment 1 serving on `listener` (`start_on`) with `transport`, and a copy of the
/// listener's descriptor: the same open socket, whose status flags and state are its.
fn env_on(
    listener: std::net::TcpListener,
    transport: Transport,
) -> (ShuffleEnvironment, std::net::TcpListener) {
    let same_socket = listener.try_clone().unwrap();
    let env = ShuffleEnvironment::start_on(listener, config_for(1, transport, &[])).unwrap();
    assert_eq!(env.transport(), transport, "the requested driver runs");
    (env, same_socket)
}

/// A listener handed over non-blocking (a service manager's socket often is) serves as any
/// other. The io_uring driver makes it blocking: its ring's Accept waits on its own, and on
/// kernels before 5.19 a non-blocking listener's Accept completed at once with EAGAIN, so
/// the I/O thread re-armed it every turn and never slept. (The epoll driver wants it
/// non-blocking and makes it so.)
fn a_listener_handed_over_non_blocking_serves(transport: Transport) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let (producer_env, same_socket) = env_on(listener, transport);
    let non_blocking = socket2::SockRef::from(&same_socket).nonblocking().unwrap();
    assert_eq!(
        non_blocking,
        transport == Transport::Epoll,
        "the listener's mode is the one its driver's accept needs"
    );
    let consumer_env = env(2, transport);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"handed over"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(
        remote_gate(&consumer_env, producer_env.local_addr()),
        b"handed over",
    );
    drop((partition, same_socket));
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_listener_handed_over_non_blocking_serves,
    a_listener_handed_over_non_blocking_serves_epoll,
    a_listener_handed_over_non_blocking_serves_uring
);

/// A listener that stops listening (shut down under the environment here) fails every accept
/// for good: the driver gives it up and says so, rather than retrying every 10 ms for as
/// long as the process lives, and the connections already open go on.
fn a_listener_that_failed_for_good_is_given_up(transport: Transport) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (producer_env, same_socket) = env_on(listener, transport);
    let consumer_env = env(2, transport);
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let mut reader = RecordReader::new(
        remote_gate(&consumer_env, producer_env.local_addr()),
        1 << 20,
    );
    partition.emit_record(&b"before"[..], 0).unwrap();
    partition.flush(0);
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"before"),
        other => panic!("expected the first record, got {other:?}"),
    }
    socket2::SockRef::from(&same_socket)
        .shutdown(std::net::Shutdown::Read)
        .unwrap();
    assert!(
        common::wait_until(LONG, || producer_env
            .driver_stats()
            .is_some_and(|stats| stats.listener_failed)),
        "the driver gives the listener up"
    );
    partition.emit_record(&b"after"[..], 0).unwrap();
    partition.finish().unwrap();
    match reader.next_timeout(LONG).unwrap() {
        Some(ReaderItem::Record { bytes, .. }) => assert_eq!(bytes, b"after"),
        other => panic!("the open connection goes on, got {other:?}"),
    }
    while let Some(item) = reader.next_timeout(LONG).unwrap() {
        assert!(matches!(item, ReaderItem::Event { .. }), "{item:?}");
    }
    let stats = producer_env.driver_stats_within(LONG).unwrap();
    assert_eq!(
        stats.failed_accepts, 1,
        "the failed listener is not retried"
    );
    drop((reader, partition, same_socket));
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_listener_that_failed_for_good_is_given_up,
    a_listener_that_failed_for_good_is_given_up_epoll,
    a_listener_that_failed_for_good_is_given_up_uring
);

/// A gate the environment created connects its remote channels through the environment: one
/// located as remote through the gate alone (no producer address) would wait for good, so
/// the gate refuses, and the environment's update still connects it.
#[test]
fn a_gate_of_the_environment_locates_remote_channels_only_through_it() {
    let producer_env = env(1, Transport::Epoll);
    let consumer_env = env(2, Transport::Epoll);
    let mut gate = one_channel_gate(&consumer_env, ProducerLocation::Unknown);
    assert_eq!(
        gate.update_channel(0, ChannelLocation::Remote, Instant::now()),
        Err(GateError::LocateThroughEnvironment(0))
    );
    assert!(matches!(gate.channel(0), Some(InputChannel::Unknown(_))));
    consumer_env
        .update_channel(
            &mut gate,
            0,
            ProducerLocation::Remote(producer_env.local_addr()),
        )
        .unwrap();
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    partition.emit_record(&b"located"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(gate, b"located");
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}

/// Task events a producer's partition received; with `panic_on_first`, the delivery of the
/// first one panics instead (a producer's bug).
#[derive(Default)]
struct ReceivedTaskEvents {
    events: std::sync::Mutex<Vec<Event>>,
    panic_on_first: bool,
    panicked: std::sync::atomic::AtomicBool,
}

impl TaskEventListener for ReceivedTaskEvents {
    fn on_task_event(&self, event: &Event) {
        if self.panic_on_first
            && !self
                .panicked
                .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("a producer's task event listener fails");
        }
        self.events.lock().unwrap().push(event.clone());
    }
}

/// A consumer sends two task events to a remote producer whose partition `listener` hears,
/// one before its partition request and one after, waits until `expected` arrived, then
/// reads a record through the same connection; the events the listener received.
fn task_events_to_a_remote_producer(
    transport: Transport,
    listener: ReceivedTaskEvents,
    expected: usize,
) -> Vec<Event> {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    let listener = std::sync::Arc::new(listener);
    producer_env
        .partition_manager()
        .subscribe_task_events(pid(0), listener.clone());
    let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
    let mut gate = remote_gate(&consumer_env, producer_env.local_addr());
    gate.send_task_event(&Event::Task(b"before the request".to_vec()))
        .unwrap();
    gate.request_partitions(Instant::now()).unwrap();
    gate.send_task_event(&Event::Task(b"after the request".to_vec()))
        .unwrap();
    wait_until("the producer received the task events", || {
        listener.events.lock().unwrap().len() == expected
    });
    partition.emit_record(&b"data"[..], 0).unwrap();
    partition.finish().unwrap();
    read_one(gate, b"data");
    drop(partition);
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
    let received = listener.events.lock().unwrap().clone();
    received
}

/// A consumer's task events reach the remote producer's partition (Flink's
/// `RemoteInputChannel.sendTaskEvent` → TaskEventRequest), those sent before the channel had
/// its connection too, in order. Before, remote channels dropped them.
fn task_events_reach_a_remote_producer(transport: Transport) {
    assert_eq!(
        task_events_to_a_remote_producer(transport, ReceivedTaskEvents::default(), 2),
        [
            Event::Task(b"before the request".to_vec()),
            Event::Task(b"after the request".to_vec())
        ]
    );
}
on_both_drivers!(
    task_events_reach_a_remote_producer,
    task_events_reach_a_remote_producer_epoll,
    task_events_reach_a_remote_producer_uring
);

/// A producer's task event listener runs on the I/O thread. Its panic costs that one event,
/// not the I/O thread: before, the thread ended, and with it every connection it served.
fn a_panicking_task_event_listener_leaves_the_io_thread_running(transport: Transport) {
    let listener = ReceivedTaskEvents {
        panic_on_first: true,
        ..ReceivedTaskEvents::default()
    };
    assert_eq!(
        task_events_to_a_remote_producer(transport, listener, 1),
        [Event::Task(b"after the request".to_vec())]
    );
}
on_both_drivers!(
    a_panicking_task_event_listener_leaves_the_io_thread_running,
    a_panicking_task_event_listener_leaves_the_io_thread_running_epoll,
    a_panicking_task_event_listener_leaves_the_io_thread_running_uring
);

fn open_connections(env: &ShuffleEnvironment) -> u64 {
    env.driver_stats()
        .map_or(u64::MAX, |stats| stats.open_connections)
}

fn a_connection_closes_when_its_last_channel_leaves(transport: Transport) {
    let producer_env = env(1, transport);
    let consumer_env = env(2, transport);
    for round in 0..2u8 {
        let gate = remote_gate(&consumer_env, producer_env.local_addr());
        let mut partition = producer_env.create_partition(pid(0), 1).unwrap();
        partition.emit_record(&[round][..], 0).unwrap();
        partition.finish().unwrap();
        wait_until("the consumer's connection opened", || {
            open_connections(&consumer_env) == 1
        });
        // Reads to the end and drops the gate: its one channel leaves the connection.
        read_one(gate, &[round]);
        wait_until("the consumer closed its idle connection", || {
            open_connections(&consumer_env) == 0
        });
        wait_until("the producer saw it close", || {
            open_connections(&producer_env) == 0
        });
        drop(partition);
        producer_env.partition_manager().release(pid(0)).ok();
    }
    assert!(common::pools_full(&[&producer_env, &consumer_env]));
}
on_both_drivers!(
    a_connection_closes_when_its_last_channel_leaves,
    a_connection_closes_when_its_last_channel_leaves_epoll,
    a_connection_closes_when_its_last_channel_leaves_uring
);

#[test]
fn an_environment_refuses_timeouts_it_cannot_work_with() {
    for (adjust, field) in [
        (
            (|c: &mut EnvConfig| c.connect_timeout = Duration::ZERO) as fn(&mut EnvConfig),
            "connect_timeout",
        ),
        (
            |c: &mut EnvConfig| c.partition_request_timeout = Duration::MAX,
            "partition_request_timeout",
        ),
    ] {
        let mut config = EnvConfig {
            transport: Transport::Epoll,
            ..EnvConfig::default()
        };
        adjust(&mut config);
        match ShuffleEnvironment::start(config) {
            Err(fluxgate::env::EnvError::Config { field: named, .. }) => assert_eq!(named, field),
            Err(other) => panic!("{field}: expected a config error, got {other}"),
            Ok(_) => panic!("{field}: expected a config error, got an environment"),
        }
    }
}

#[test]
fn a_port_in_use_is_an_io_error_whatever_the_transport() {
    // Bound once, before the drivers: io_uring's start reported it as its own failure (and
    // auto then bound again for epoll).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    for transport in [Transport::Epoll, Transport::Uring, Transport::Auto] {
        let config = EnvConfig {
            bind: taken.local_addr().unwrap(),
            transport,
            ..EnvConfig::default()
        };
        match ShuffleEnvironment::start(config) {
            Err(fluxgate::env::EnvError::Io(error)) => {
                assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{transport:?}")
            }
            Err(other) => panic!("{transport:?}: expected an I/O error, got {other}"),
            Ok(_) => panic!("{transport:?}: bound a port in use"),
        }
    }
}
