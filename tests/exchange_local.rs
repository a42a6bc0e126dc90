//! End-to-end local exchange in one process: P producer threads (a `RecordWriter` over a
//! `ResultPartition` with C subpartitions each) and C consumer threads (a `RecordReader` over a
//! `SingleInputGate` whose channel i is producer i's subpartition c), for every selector and
//! buffer timeout. Each run checks that every consumer received exactly the records its selector
//! sent it, in order per channel, with one EndOfPartition per channel, and that every segment is
//! back in the global pool afterwards.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use fluxgate::buffer::NetworkBufferPool;
use fluxgate::event::Event;
use fluxgate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, InputGate, ReaderItem, RecordReader,
    SingleInputGate,
};
use fluxgate::partition::{
    BroadcastSelector, BufferTimeout, ChannelSelector, ForwardSelector, KeyHashSelector,
    PartitionManager, RecordWriter, ResultPartition, ResultPartitionId, RoundRobinSelector,
};
use fluxgate::record::{Record, RecordError, RecordOutput, SegmentSink};
use fluxgate::NetworkConfig;

/// Bound of every blocking read: only reached when something is broken.
const LONG: Duration = Duration::from_secs(10);
const SEGMENT: usize = 4096;
/// Records each producer emits per run.
const RECORDS: u64 = 1000;
/// Distinct keys of the key-hash runs (shared by all producers).
const KEYS: u64 = 13;
/// Flink's default max parallelism (key groups).
const KEY_GROUPS: usize = 128;

const TOPOLOGIES: [(usize, usize); 3] = [(1, 1), (3, 2), (4, 4)];
const TIMEOUTS: [BufferTimeout; 3] = [
    BufferTimeout::Always,
    BufferTimeout::Never,
    BufferTimeout::Every(Duration::from_millis(1)),
];

/// A test record: who produced it and its position in that producer's output; its payload
/// length and bytes follow from both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Rec {
    producer: u32,
    seq: u64,
}

/// `producer: u32 | seq: u64`, then the payload.
const HEADER: usize = 12;

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer.
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Rec {
    fn seed(&self) -> u64 {
        mix(((self.producer as u64) << 40) ^ self.seq)
    }

    /// Mostly small records (several per buffer), one in eight up to three segments long.
    fn payload_len(&self) -> usize {
        let h = self.seed();
        if h % 8 == 0 {
            ((h >> 8) % (3 * SEGMENT as u64)) as usize
        } else {
            ((h >> 8) % 300) as usize
        }
    }

    fn payload_byte(&self, index: usize) -> u8 {
        (self.seed() >> 16).wrapping_add((index as u64).wrapping_mul(0x9d)) as u8
    }

    fn key(&self) -> u64 {
        self.seq % KEYS
    }

    /// Parses and checks a received record.
    fn decode(bytes: &[u8]) -> Rec {
        assert!(bytes.len() >= HEADER, "record of {} bytes", bytes.len());
        let rec = Rec {
            producer: u32::from_be_bytes(bytes[..4].try_into().unwrap()),
            seq: u64::from_be_bytes(bytes[4..HEADER].try_into().unwrap()),
        };
        let payload = &bytes[HEADER..];
        assert_eq!(payload.len(), rec.payload_len(), "length of {rec:?}");
        if let Some(i) = (0..payload.len()).find(|&i| payload[i] != rec.payload_byte(i)) {
            panic!("payload of {rec:?} corrupt at byte {i}");
        }
        rec
    }
}

impl Record for Rec {
    fn encoded_len(&self) -> usize {
        HEADER + self.payload_len()
    }

    fn encode<S: SegmentSink>(&self, out: &mut RecordOutput<'_, S>) -> Result<(), RecordError> {
        out.write(&self.producer.to_be_bytes())?;
        out.write(&self.seq.to_be_bytes())?;
        let len = self.payload_len();
        let mut chunk = [0u8; 256];
        let mut written = 0;
        while written < len {
            let n = (len - written).min(chunk.len());
            for (i, byte) in chunk[..n].iter_mut().enumerate() {
                *byte = self.payload_byte(written + i);
            }
            out.write(&chunk[..n])?;
            written += n;
        }
        Ok(())
    }
}

fn pid(producer: usize) -> ResultPartitionId {
    ResultPartitionId {
        partition: producer as u64,
        producer: 0,
    }
}

fn config() -> NetworkConfig {
    let mut config = NetworkConfig::default();
    config
        .set("taskmanager.memory.segment-size", "4kb")
        .unwrap();
    config
        .set("taskmanager.memory.network.max", "16mb")
        .unwrap();
    config.set("fluxgate.memory.arena-size", "4mb").unwrap();
    config
}

/// What one consumer saw, in arrival order.
#[derive(Debug)]
struct Received {
    records: Vec<Rec>,
    /// EndOfPartition events per channel.
    ends: Vec<usize>,
}

fn consume(gate: SingleInputGate, max_record_bytes: usize) -> Received {
    let channels = gate.channel_count();
    let mut reader = RecordReader::new(gate, max_record_bytes);
    let mut records = Vec::new();
    let mut ends = vec![0; channels];
    loop {
        match reader.next_timeout(LONG) {
            Ok(Some(ReaderItem::Record { channel, bytes })) => {
                let rec = Rec::decode(bytes);
                assert_eq!(
                    rec.producer as usize, channel,
                    "{rec:?} arrived on channel {channel}"
                );
                assert_eq!(ends[channel], 0, "{rec:?} after EndOfPartition");
                records.push(rec);
            }
            Ok(Some(ReaderItem::Event { channel, event })) => {
                assert_eq!(event, Event::EndOfPartition, "channel {channel}");
                ends[channel] += 1;
            }
            Ok(None) => break,
            Err(e) => panic!("reader failed after {} records: {e}", records.len()),
        }
    }
    assert!(reader.gate().is_finished());
    Received { records, ends }
}

/// Runs one P×C exchange and checks it against `targets` (the consumers a record must reach).
/// Returns what each consumer received.
fn exchange<S, F, T>(
    producers: usize,
    consumers: usize,
    timeout: BufferTimeout,
    selector: F,
    targets: T,
) -> Vec<Vec<Rec>>
where
    S: ChannelSelector<Rec> + Send,
    F: Fn(usize) -> S,
    T: Fn(&Rec, usize) -> Vec<usize>,
{
    let context = format!("{producers}x{consumers} {timeout:?}");
    let config = config();
    let network = NetworkBufferPool::new(&config).unwrap();
    let manager = Arc::new(PartitionManager::new());
    let writers: Vec<_> = (0..producers)
        .map(|p| {
            let partition = ResultPartition::new(pid(p), consumers, &network, &config).unwrap();
            manager.register(partition.handle()).unwrap();
            RecordWriter::new(partition, selector(p), timeout)
        })
        .collect();
    let gates: Vec<_> = (0..consumers)
        .map(|c| {
            let specs = (0..producers)
                .map(|p| ChannelSpec {
                    consumed: ConsumedSubpartition {
                        partition: pid(p),
                        subpartition: c,
                    },
                    location: ChannelLocation::Local,
                })
                .collect();
            let mut gate = SingleInputGate::new(specs, manager.clone(), &network, &config);
            gate.setup().unwrap();
            gate.request_partitions(Instant::now()).unwrap();
            gate
        })
        .collect();
    let max_record_bytes = config.max_record_bytes;
    let received: Vec<Received> = thread::scope(|s| {
        let producer_threads: Vec<_> = writers
            .into_iter()
            .enumerate()
            .map(|(p, mut writer)| {
                s.spawn(move || {
                    for seq in 0..RECORDS {
                        let rec = Rec {
                            producer: p as u32,
                            seq,
                        };
                        writer.emit(&rec).unwrap();
                    }
                    writer.finish().unwrap();
                    writer.partition().handle().metrics().num_records_out.get()
                })
            })
            .collect();
        let consumer_threads: Vec<_> = gates
            .into_iter()
            .map(|gate| s.spawn(move || consume(gate, max_record_bytes)))
            .collect();
        for (p, t) in producer_threads.into_iter().enumerate() {
            let out = t.join().expect("producer panicked");
            assert_eq!(out, RECORDS, "{context}: numRecordsOut of producer {p}");
        }
        consumer_threads
            .into_iter()
            .map(|t| t.join().expect("consumer panicked"))
            .collect()
    });

    // What the selector should have delivered.
    let mut expected: Vec<Vec<Rec>> = vec![Vec::new(); consumers];
    for p in 0..producers {
        for seq in 0..RECORDS {
            let rec = Rec {
                producer: p as u32,
                seq,
            };
            for c in targets(&rec, consumers) {
                expected[c].push(rec);
            }
        }
    }
    for (c, (got, want)) in received.iter().zip(&expected).enumerate() {
        assert_eq!(
            got.ends,
            vec![1; producers],
            "{context}: consumer {c}: EndOfPartition per channel"
        );
        // Order per channel: a producer's records arrive in the order it wrote them.
        for p in 0..producers {
            let seqs: Vec<u64> = got
                .records
                .iter()
                .filter(|r| r.producer as usize == p)
                .map(|r| r.seq)
                .collect();
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "{context}: consumer {c}: channel {p} out of order: {seqs:?}"
            );
        }
        let mut sorted = got.records.clone();
        sorted.sort();
        assert_eq!(
            sorted.len(),
            want.len(),
            "{context}: consumer {c}: record count"
        );
        assert!(
            sorted == *want,
            "{context}: consumer {c}: records differ from what the selector sent"
        );
    }

    for p in 0..producers {
        manager.release(pid(p)).unwrap();
    }
    assert!(manager.is_empty());
    assert_eq!(
        network.available_segments(),
        network.total_segments(),
        "{context}: segments leaked"
    );
    received.into_iter().map(|r| r.records).collect()
}

#[test]
fn round_robin_sends_each_record_to_the_next_consumer() {
    for (producers, consumers) in TOPOLOGIES {
        for timeout in TIMEOUTS {
            exchange(
                producers,
                consumers,
                timeout,
                RoundRobinSelector::starting_at,
                |rec, consumers| vec![(rec.producer as usize + rec.seq as usize) % consumers],
            );
        }
    }
}

fn key_hash(rec: &Rec) -> u64 {
    rec.key()
}

#[test]
fn key_hash_keeps_every_key_at_one_consumer() {
    let reference = KeyHashSelector::new(key_hash as fn(&Rec) -> u64, KEY_GROUPS);
    for (producers, consumers) in TOPOLOGIES {
        for timeout in TIMEOUTS {
            let received = exchange(
                producers,
                consumers,
                timeout,
                |_| KeyHashSelector::new(key_hash as fn(&Rec) -> u64, KEY_GROUPS),
                |rec, consumers| vec![reference.key_group(key_hash(rec)) * consumers / KEY_GROUPS],
            );
            let mut owners: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
            for (c, records) in received.iter().enumerate() {
                for rec in records {
                    owners.entry(rec.key()).or_default().insert(c);
                }
            }
            assert_eq!(owners.len() as u64, KEYS.min(RECORDS));
            let mut used = BTreeSet::new();
            for (key, at) in owners {
                assert_eq!(at.len(), 1, "key {key} reached consumers {at:?}");
                used.extend(at);
            }
            // The keys spread: the property is not met by sending everything to one consumer.
            assert_eq!(
                used.len() > 1,
                consumers > 1,
                "keys reached consumers {used:?}"
            );
        }
    }
}

#[test]
fn broadcast_gives_every_consumer_every_record() {
    for (producers, consumers) in TOPOLOGIES {
        for timeout in TIMEOUTS {
            exchange(
                producers,
                consumers,
                timeout,
                |_| BroadcastSelector,
                |_, consumers| (0..consumers).collect(),
            );
        }
    }
}

#[test]
fn forward_connects_one_producer_to_one_consumer() {
    for timeout in TIMEOUTS {
        exchange(1, 1, timeout, |_| ForwardSelector, |_, _| vec![0]);
    }
}
