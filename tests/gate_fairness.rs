//! Property: a single-threaded random interleaving of "producer k emits m records and flushes",
//! "producer k sends an unaligned priority barrier", "the gate polls once" and "producer k
//! finishes" over N local channels of one `SingleInputGate`:
//!
//! - loses nothing and delivers nothing twice: every record arrives exactly once, in its
//!   channel's emission order, and every barrier once;
//! - loses no wake-up: `poll_next` returns nothing only when nothing is readable;
//! - serves priority events first: while a barrier is pending, `poll_next` returns a barrier;
//! - starves no channel: once a channel has readable data, at most N - 1 data reads of other
//!   channels pass before it is served (the round-robin FIFO); priority reads are counted
//!   separately and do not count against that bound;
//!
//! and a final drain delivers everything and brings every segment back to the global pool.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use fluxgate::buffer::NetworkBufferPool;
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, GateItem, InputGate, SingleInputGate,
};
use fluxgate::partition::{PartitionError, PartitionManager, ResultPartition, ResultPartitionId};
use fluxgate::record::RecordDeserializer;
use fluxgate::NetworkConfig;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Producer `producer` emits one record per length, then flushes.
    Emit { producer: usize, lens: Vec<usize> },
    /// Producer k sends an unaligned checkpoint barrier through the priority lane.
    Barrier(usize),
    /// The gate's `poll_next`, once.
    Poll,
    /// Producer k finishes (EndOfPartition).
    Finish(usize),
}

fn record_len() -> impl Strategy<Value = usize> {
    // Mostly a few records per buffer; now and then one spanning up to three segments.
    prop_oneof![8 => 0usize..64, 1 => 0usize..9000]
}

fn ops(channels: usize) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0..channels, prop::collection::vec(record_len(), 0..5))
            .prop_map(|(producer, lens)| Op::Emit { producer, lens }),
        1 => (0..channels).prop_map(Op::Barrier),
        6 => Just(Op::Poll),
        1 => (0..channels).prop_map(Op::Finish),
    ];
    prop::collection::vec(op, 0..60)
}

fn record(id: u64, len: usize) -> Vec<u8> {
    let mut bytes = id.to_be_bytes().to_vec();
    bytes.resize(8 + len, id as u8 ^ 0x5A);
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

fn pid(k: usize) -> ResultPartitionId {
    ResultPartitionId {
        partition: k as u64,
        producer: 0,
    }
}

/// The system under test and the model of what each channel has readable.
struct Harness {
    channels: usize,
    network: NetworkBufferPool,
    manager: Arc<PartitionManager>,
    partitions: Vec<ResultPartition>,
    gate: SingleInputGate,
    deserializers: Vec<RecordDeserializer>,
    /// Record ids emitted per channel, in order.
    emitted: Vec<Vec<u64>>,
    /// Record ids read per channel, in order.
    read: Vec<Vec<u64>>,
    /// Barrier ids sent and not yet read, per channel.
    barriers: Vec<VecDeque<u64>>,
    finished: Vec<bool>,
    /// EndOfPartition read.
    ended: Vec<bool>,
    /// Data reads of other channels since this channel had readable data and was not served.
    waited: Vec<usize>,
    next_id: u64,
    priority_reads: usize,
    barriers_sent: usize,
}

impl Harness {
    fn new(channels: usize) -> Self {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.memory.segment-size", "4kb")
            .unwrap();
        // Room for the worst case: 60 ops of 4 unread records spanning up to 3 segments each.
        config.set("taskmanager.memory.network.max", "4mb").unwrap();
        config.set("fluxgate.memory.arena-size", "1mb").unwrap();
        // Large enough that the single-threaded property never blocks on back pressure.
        config
            .set(
                "taskmanager.network.memory.floating-buffers-per-gate",
                "1000",
            )
            .unwrap();
        config
            .set("taskmanager.network.memory.max-buffers-per-channel", "1000")
            .unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let manager = Arc::new(PartitionManager::new());
        let partitions: Vec<_> = (0..channels)
            .map(|k| {
                let partition = ResultPartition::new(pid(k), 1, &network, &config).unwrap();
                manager.register(partition.handle()).unwrap();
                partition
            })
            .collect();
        let specs = (0..channels)
            .map(|k| ChannelSpec {
                consumed: ConsumedSubpartition {
                    partition: pid(k),
                    subpartition: 0,
                },
                location: ChannelLocation::Local,
            })
            .collect();
        let mut gate = SingleInputGate::new(specs, manager.clone(), &network, &config);
        gate.setup().unwrap();
        gate.request_partitions(Instant::now()).unwrap();
        Self {
            channels,
            network,
            manager,
            partitions,
            gate,
            deserializers: (0..channels)
                .map(|_| RecordDeserializer::new(1 << 20))
                .collect(),
            emitted: vec![Vec::new(); channels],
            read: vec![Vec::new(); channels],
            barriers: vec![VecDeque::new(); channels],
            finished: vec![false; channels],
            ended: vec![false; channels],
            waited: vec![0; channels],
            next_id: 0,
            priority_reads: 0,
            barriers_sent: 0,
        }
    }

    /// Data (records or EndOfPartition) readable on channel `k`, as the model says: every Emit
    /// flushes, so every record emitted and not read is readable.
    fn data_readable(&self, k: usize) -> bool {
        self.read[k].len() < self.emitted[k].len() || (self.finished[k] && !self.ended[k])
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Emit { producer, ref lens } => {
                let partition = &mut self.partitions[producer];
                if self.finished[producer] {
                    if !lens.is_empty() {
                        prop_assert_eq!(
                            partition.emit_record(&record(u64::MAX, 0)[..], 0),
                            Err(PartitionError::Finished)
                        );
                    }
                    return Ok(());
                }
                for &len in lens {
                    let id = self.next_id;
                    self.next_id += 1;
                    partition.emit_record(&record(id, len)[..], 0).unwrap();
                    self.emitted[producer].push(id);
                }
                partition.flush(0);
            }
            Op::Barrier(producer) => {
                let partition = &mut self.partitions[producer];
                if self.finished[producer] {
                    prop_assert_eq!(
                        partition.broadcast_event(&barrier(u64::MAX), true),
                        Err(PartitionError::Finished)
                    );
                    return Ok(());
                }
                let id = self.next_id;
                self.next_id += 1;
                partition.broadcast_event(&barrier(id), true).unwrap();
                self.barriers[producer].push_back(id);
                self.barriers_sent += 1;
            }
            Op::Poll => {
                self.poll()?;
            }
            Op::Finish(producer) => {
                if !self.finished[producer] {
                    self.partitions[producer].finish().unwrap();
                    self.finished[producer] = true;
                }
            }
        }
        Ok(())
    }

    /// One `poll_next`, checked against the model. Returns whether it read something.
    fn poll(&mut self) -> Result<bool, TestCaseError> {
        let readable: Vec<bool> = (0..self.channels).map(|k| self.data_readable(k)).collect();
        let barrier_pending = self.barriers.iter().any(|b| !b.is_empty());
        let item = match self.gate.poll_next() {
            Ok(item) => item,
            Err(e) => return Err(TestCaseError::fail(format!("poll_next failed: {e}"))),
        };
        let Some(item) = item else {
            prop_assert!(
                !barrier_pending,
                "poll_next returned nothing while barriers are pending: {:?}",
                self.barriers
            );
            prop_assert!(
                !readable.contains(&true),
                "poll_next returned nothing while channels {:?} have readable data (lost wake-up)",
                (0..self.channels)
                    .filter(|&k| readable[k])
                    .collect::<Vec<_>>()
            );
            return Ok(false);
        };
        let j = item.channel;
        prop_assert!(j < self.channels);
        if let GateItem::Event {
            event,
            priority: true,
        } = &item.item
        {
            let Event::CheckpointBarrier(b) = event else {
                return Err(TestCaseError::fail(format!(
                    "unexpected priority event {event:?}"
                )));
            };
            prop_assert_eq!(
                Some(b.id),
                self.barriers[j].pop_front(),
                "channel {}: barrier out of order or not sent",
                j
            );
            prop_assert!(
                item.overtaken == 0 || readable[j],
                "channel {}: barrier overtook {} items of a channel with nothing readable",
                j,
                item.overtaken
            );
            // Priority reads jump the queue; they do not count against anyone's wait.
            self.priority_reads += 1;
            return Ok(true);
        }
        prop_assert!(
            !barrier_pending,
            "channel {} delivered data while barriers are pending: {:?}",
            j,
            self.barriers
        );
        prop_assert!(
            readable[j],
            "channel {} delivered {:?} although the model has nothing readable",
            j,
            item.item
        );
        match item.item {
            GateItem::Buffer(buffer) => {
                prop_assert!(!buffer.is_empty(), "channel {}: an empty buffer", j);
                let deserializer = &mut self.deserializers[j];
                deserializer.set_next_buffer(buffer).unwrap();
                while let Some(bytes) = deserializer.next_record().unwrap() {
                    let id = u64::from_be_bytes(bytes[..8].try_into().unwrap());
                    prop_assert!(
                        bytes[8..].iter().all(|&b| b == id as u8 ^ 0x5A),
                        "record {} payload corrupt",
                        id
                    );
                    let position = self.read[j].len();
                    prop_assert_eq!(
                        self.emitted[j].get(position).copied(),
                        Some(id),
                        "channel {}: record {} of {:?} read out of order, twice, or where it \
                         was never sent (read so far {:?})",
                        j,
                        position,
                        self.emitted[j],
                        self.read[j]
                    );
                    self.read[j].push(id);
                }
            }
            GateItem::Event {
                event: Event::EndOfPartition,
                priority: false,
            } => {
                prop_assert!(self.finished[j] && !self.ended[j]);
                prop_assert_eq!(
                    &self.read[j],
                    &self.emitted[j],
                    "channel {}: EndOfPartition before all its records",
                    j
                );
                prop_assert!(!self.deserializers[j].has_partial_record());
                self.ended[j] = true;
            }
            other => {
                return Err(TestCaseError::fail(format!(
                    "channel {j}: unexpected {other:?}"
                )))
            }
        }
        for (k, &had_data) in readable.iter().enumerate() {
            if k == j || !had_data {
                // Served now (it queues again at the tail if it has more), or not waiting.
                self.waited[k] = 0;
            } else {
                self.waited[k] += 1;
                prop_assert!(
                    self.waited[k] < self.channels,
                    "channel {} starved: {} data reads of other channels since it had data \
                     (N = {})",
                    k,
                    self.waited[k],
                    self.channels
                );
            }
        }
        Ok(true)
    }

    /// Finishes every producer and reads until every channel ended.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for k in 0..self.channels {
            self.apply(&Op::Finish(k))?;
        }
        for _ in 0..100_000 {
            if self.gate.is_finished() {
                break;
            }
            prop_assert!(
                self.poll()?,
                "nothing readable but the gate is not finished"
            );
        }
        prop_assert!(self.gate.is_finished());
        prop_assert!(self.gate.poll_next().unwrap().is_none());
        prop_assert_eq!(&self.read, &self.emitted, "records lost");
        prop_assert!(
            self.barriers.iter().all(VecDeque::is_empty),
            "barriers lost"
        );
        prop_assert!(self.ended.iter().all(|&e| e));
        Ok(())
    }

    /// Drops everything and checks that every segment went back to the global pool.
    fn teardown(self) -> Result<(), TestCaseError> {
        let Harness {
            channels,
            network,
            manager,
            partitions,
            gate,
            deserializers,
            ..
        } = self;
        drop(deserializers);
        drop(gate);
        drop(partitions);
        for k in 0..channels {
            manager.release(pid(k)).unwrap();
        }
        prop_assert_eq!(network.available_segments(), network.total_segments());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_gate_serves_channels_fairly_and_delivers_everything_once(
        (channels, ops) in (1usize..6).prop_flat_map(|n| (Just(n), ops(n)))
    ) {
        let mut harness = Harness::new(channels);
        for op in &ops {
            harness.apply(op)?;
        }
        harness.drain()?;
        // Every barrier was read once, through the priority lane.
        prop_assert_eq!(harness.priority_reads, harness.barriers_sent);
        harness.teardown()?;
    }
}
