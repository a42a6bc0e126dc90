//! Property: a random interleaving of emit / flush / event / poll / resume / finish on a
//! partition behaves as a simple sequential model says — order kept, sequence numbers
//! consecutive, priority events overtaking exactly the data they report, nothing lost or
//! duplicated, and every segment back in the pool at the end.

use std::sync::Arc;

use fluxgate::buffer::{DataType, NetworkBufferPool};
use fluxgate::event::{Alignment, CheckpointBarrier, CheckpointKind, Event};
use fluxgate::partition::{
    AvailabilityListener, ResultPartition, ResultPartitionId, SubpartitionView,
};
use fluxgate::record::RecordDeserializer;
use fluxgate::NetworkConfig;
use proptest::prelude::*;

const SUBPARTITIONS: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Emit { target: usize, len: usize },
    Flush(usize),
    Event { priority: bool, aligned: bool },
    Poll(usize),
    Resume(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SUBPARTITIONS, prop_oneof![0usize..40, 0usize..9000]).prop_map(|(target, len)| Op::Emit { target, len }),
        2 => (0..SUBPARTITIONS).prop_map(Op::Flush),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(priority, aligned)| Op::Event { priority, aligned }),
        4 => (0..SUBPARTITIONS).prop_map(Op::Poll),
        1 => (0..SUBPARTITIONS).prop_map(Op::Resume),
    ]
}

struct Quiet;
impl AvailabilityListener for Quiet {
    fn notify_data_available(&self) {}
}

/// What the reader of one subpartition observed, item by item.
#[derive(Debug, PartialEq, Eq, Clone)]
enum Seen {
    /// Records of one data buffer, by emission index.
    Data(Vec<u64>),
    /// A barrier or end of partition, by the emission index of the event.
    Event {
        id: u64,
        priority: bool,
        overtaken: usize,
    },
    End,
}

struct Reader {
    view: SubpartitionView,
    deserializer: RecordDeserializer,
    next_sequence: u64,
    seen: Vec<Seen>,
}

impl Reader {
    fn poll(&mut self) -> bool {
        let Some(item) = self.view.poll_next() else {
            return false;
        };
        assert_eq!(
            item.sequence_number, self.next_sequence,
            "sequence numbers consecutive"
        );
        self.next_sequence += 1;
        if item.buffer.data_type() == DataType::DataBuffer {
            self.deserializer.set_next_buffer(item.buffer).unwrap();
            let mut records = Vec::new();
            while let Some(record) = self.deserializer.next_record().unwrap() {
                records.push(u64::from_be_bytes(record[..8].try_into().unwrap()));
                assert!(
                    record[8..].iter().all(|&b| b == record[0] ^ 0x5A),
                    "payload intact"
                );
            }
            self.seen.push(Seen::Data(records));
        } else {
            match Event::decode(item.buffer.as_slice()).unwrap() {
                Event::CheckpointBarrier(b) => self.seen.push(Seen::Event {
                    id: b.id,
                    priority: item.buffer.data_type() == DataType::PrioritizedEventBuffer,
                    overtaken: item.overtaken,
                }),
                Event::EndOfPartition => self.seen.push(Seen::End),
                other => panic!("unexpected event {other:?}"),
            }
        }
        true
    }
}

fn record(index: u64, len: usize) -> Vec<u8> {
    let mut bytes = index.to_be_bytes().to_vec();
    let fill = bytes[0] ^ 0x5A;
    bytes.resize(8 + len, fill);
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn partition_matches_the_sequential_model(ops in prop::collection::vec(op(), 0..80)) {
        let mut config = NetworkConfig::default();
        config.set("taskmanager.memory.segment-size", "4kb").unwrap();
        config.set("taskmanager.memory.network.max", "4mb").unwrap();
        config.set("fluxgate.memory.arena-size", "1mb").unwrap();
        // Large enough that the single-threaded property never blocks on back pressure.
        config.set("taskmanager.network.memory.floating-buffers-per-gate", "600").unwrap();
        config.set("taskmanager.network.memory.max-buffers-per-channel", "600").unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let id = ResultPartitionId { partition: 1, producer: 1 };
        let mut partition = ResultPartition::new(id, SUBPARTITIONS, &network, &config).unwrap();
        let mut readers: Vec<Reader> = (0..SUBPARTITIONS)
            .map(|i| Reader {
                view: partition.handle().create_view(i, Arc::new(Quiet)).unwrap(),
                deserializer: RecordDeserializer::new(1 << 20),
                next_sequence: 0,
                seen: Vec::new(),
            })
            .collect();
        // The model: per subpartition, the emitted stream in order.
        let mut emitted: Vec<Vec<Seen>> = vec![Vec::new(); SUBPARTITIONS];
        let mut next_index = 0u64;
        for op in ops {
            match op {
                Op::Emit { target, len } => {
                    partition.emit_record(&record(next_index, len)[..], target).unwrap();
                    emitted[target].push(Seen::Data(vec![next_index]));
                    next_index += 1;
                }
                Op::Flush(target) => partition.flush(target),
                Op::Event { priority, aligned } => {
                    let alignment = if aligned && !priority { Alignment::Aligned } else { Alignment::Unaligned };
                    let barrier = Event::CheckpointBarrier(CheckpointBarrier {
                        id: next_index,
                        timestamp: 0,
                        kind: CheckpointKind::Checkpoint,
                        alignment,
                    });
                    partition.broadcast_event(&barrier, priority).unwrap();
                    for stream in emitted.iter_mut() {
                        stream.push(Seen::Event { id: next_index, priority, overtaken: 0 });
                    }
                    next_index += 1;
                }
                Op::Poll(target) => {
                    readers[target].poll();
                }
                Op::Resume(target) => {
                    readers[target].view.resume_consumption();
                }
            }
        }
        partition.finish().unwrap();
        for reader in readers.iter_mut() {
            // Bounded: every poll either returns an item or we resume a blocked view.
            for _ in 0..10_000 {
                if reader.seen.last() == Some(&Seen::End) {
                    break;
                }
                if !reader.poll() {
                    prop_assert!(reader.view.is_blocked(), "data lost: nothing readable before the end");
                    reader.view.resume_consumption();
                }
            }
            prop_assert_eq!(reader.seen.last(), Some(&Seen::End));
            prop_assert_eq!(reader.view.backlog(), 0);
        }
        for (reader, expected) in readers.iter().zip(&emitted) {
            check_stream(&reader.seen, expected)?;
        }
        drop(readers);
        drop(partition);
        prop_assert_eq!(network.available_segments(), network.total_segments());
    }
}

/// Compares what a reader saw with what was emitted to it.
fn check_stream(seen: &[Seen], emitted: &[Seen]) -> Result<(), TestCaseError> {
    // Without priority events the non-priority items come in emission order; records flatten.
    let flatten = |items: &[Seen], keep_priority: bool| -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        for item in items {
            match item {
                Seen::Data(records) => out.extend(records.iter().map(|&r| (r, false))),
                Seen::Event { id, priority, .. } if keep_priority || !priority => {
                    out.push((*id, true))
                }
                _ => {}
            }
        }
        out
    };
    prop_assert_eq!(
        flatten(&seen[..seen.len() - 1], false),
        flatten(emitted, false)
    );
    // Every priority event arrives once, and overtakes exactly what it reports.
    for (position, item) in seen.iter().enumerate() {
        let Seen::Event {
            id,
            priority: true,
            overtaken,
        } = item
        else {
            continue;
        };
        prop_assert_eq!(
            emitted
                .iter()
                .filter(|e| matches!(e, Seen::Event { id: i, priority: true, .. } if i == id))
                .count(),
            1
        );
        let later_non_priority: Vec<&Seen> = seen[position + 1..]
            .iter()
            .filter(|s| !matches!(s, Seen::Event { priority: true, .. }))
            .collect();
        let (overtaken_items, rest) =
            later_non_priority.split_at((*overtaken).min(later_non_priority.len()));
        prop_assert_eq!(overtaken_items.len(), *overtaken);
        for s in overtaken_items {
            if let Seen::Data(records) = s {
                prop_assert!(
                    records.iter().all(|r| r < id),
                    "overtaken buffer holds a later record"
                );
            }
        }
        for s in rest {
            match s {
                Seen::Data(records) => prop_assert!(
                    records.iter().all(|r| r > id),
                    "an earlier record was not reported overtaken"
                ),
                Seen::Event { id: other, .. } => prop_assert!(other > id),
                Seen::End => {}
            }
        }
    }
    Ok(())
}
