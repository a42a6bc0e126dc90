//! Counters named as Flink names its network metrics.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::sync::{AtomicU64, Ordering};

/// A counter written by one thread and read by any: the writer's increment is a plain load and
/// store (no read-modify-write on the hot path).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the owning thread may call this.
    #[inline]
    pub fn add(&self, n: u64) {
        let value = self.0.load(Ordering::Relaxed);
        self.0.store(value.wrapping_add(n), Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Time spent waiting, counted as Flink's timer gauges count it: the waits that ended plus the
/// one under way, so a snapshot taken in the middle of a long wait (a writer stuck behind a
/// stalled consumer) shows it. Waits that overlap (several threads waiting on one pool) count
/// once: the time during which at least one waited. Clones share the count.
///
/// A lock, taken as a wait begins and ends and by a snapshot: waits are the slow path, and the
/// begin, the end and the reading must agree for the total never to go down.
#[derive(Debug, Clone, Default)]
pub struct WaitTime(Arc<Mutex<WaitState>>);

#[derive(Debug, Default)]
struct WaitState {
    waiters: u32,
    since: Option<Instant>,
    ended: Duration,
}

impl WaitTime {
    /// A wait begins (another may be under way).
    pub fn begin(&self) {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if state.waiters == 0 {
            state.since = Some(Instant::now());
        }
        state.waiters += 1;
    }

    /// A wait [`begin`](Self::begin) started ends.
    pub fn end(&self) {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        state.waiters = state.waiters.saturating_sub(1);
        if state.waiters == 0 {
            if let Some(since) = state.since.take() {
                state.ended += since.elapsed();
            }
        }
    }

    /// A wait that ends when the returned guard drops (it holds a clone of the count, so
    /// it need not borrow what owns it).
    pub fn span(&self) -> WaitSpan {
        self.begin();
        WaitSpan(self.clone())
    }

    /// The waits so far, the one under way included.
    pub fn total(&self) -> Duration {
        let state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        state.ended + state.since.map_or(Duration::ZERO, |since| since.elapsed())
    }

    /// [`total`](Self::total) in whole milliseconds, as Flink reports it.
    pub fn total_ms(&self) -> u64 {
        u64::try_from(self.total().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Ends its wait when dropped (see [`WaitTime::span`]).
#[derive(Debug)]
pub struct WaitSpan(WaitTime);

impl Drop for WaitSpan {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// Output metrics of a result partition.
#[derive(Debug, Default)]
pub struct OutputMetrics {
    /// `numRecordsOut`.
    pub num_records_out: Counter,
    /// `numBytesOut`: bytes of finished buffers.
    pub num_bytes_out: Counter,
    /// `numBuffersOut`: finished buffers.
    pub num_buffers_out: Counter,
}

impl OutputMetrics {
    /// `backPressuredTimeMsPerSecond` between two samples of the partition's total
    /// back-pressured nanoseconds taken `interval_nanos` apart: at most 1000, as Flink's
    /// `TimerGauge` caps it (the samples and the interval come from separate clock reads, so
    /// the quotient can come out a little above).
    pub fn back_pressured_ms_per_second(earlier: u64, later: u64, interval_nanos: u64) -> f64 {
        if interval_nanos == 0 {
            return 0.0;
        }
        (later.saturating_sub(earlier) as f64 / interval_nanos as f64 * 1000.0).min(1000.0)
    }
}

/// A partition's output metrics at one moment (see
/// [`ResultPartition::metrics_snapshot`](crate::partition::ResultPartition::metrics_snapshot)).
/// Serialized and displayed with Flink's metric names.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OutputMetricsSnapshot {
    /// `numRecordsOut`: records emitted (a broadcast record counts once).
    #[serde(rename = "numRecordsOut")]
    pub num_records_out: u64,
    /// `numBytesOut`: bytes of finished buffers.
    #[serde(rename = "numBytesOut")]
    pub num_bytes_out: u64,
    /// `numBuffersOut`: finished buffers.
    #[serde(rename = "numBuffersOut")]
    pub num_buffers_out: u64,
    /// `outPoolUsage`: leased segments of the partition's pool over its maximum, 0 to 1.
    #[serde(rename = "outPoolUsage")]
    pub out_pool_usage: f64,
    /// `accumulatedBackPressuredTimeMs`: total time the writer waited for a free buffer.
    #[serde(rename = "accumulatedBackPressuredTimeMs")]
    pub back_pressured_time_ms: u64,
    /// `outputQueueLength`: finished buffers and events queued in the subpartitions, not yet
    /// taken by their readers (Flink's sum over its subpartitions' queues).
    #[serde(rename = "outputQueueLength", default)]
    pub output_queue_length: u64,
}

impl OutputMetricsSnapshot {
    /// `(Flink name, value)` of every field, in declaration order.
    pub fn fields(&self) -> [(&'static str, f64); 6] {
        [
            ("numRecordsOut", self.num_records_out as f64),
            ("numBytesOut", self.num_bytes_out as f64),
            ("numBuffersOut", self.num_buffers_out as f64),
            ("outPoolUsage", self.out_pool_usage),
            (
                "accumulatedBackPressuredTimeMs",
                self.back_pressured_time_ms as f64,
            ),
            ("outputQueueLength", self.output_queue_length as f64),
        ]
    }
}

impl fmt::Display for OutputMetricsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "numRecordsOut={} numBytesOut={} numBuffersOut={} outPoolUsage={:.3} \
             accumulatedBackPressuredTimeMs={} outputQueueLength={}",
            self.num_records_out,
            self.num_bytes_out,
            self.num_buffers_out,
            self.out_pool_usage,
            self.back_pressured_time_ms,
            self.output_queue_length
        )
    }
}

/// A gate's input metrics at one moment (see
/// [`SingleInputGate::metrics_snapshot`](crate::gate::SingleInputGate::metrics_snapshot)), summed
/// over its channels. Serialized and displayed with Flink's metric names.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct InputMetricsSnapshot {
    /// `numBytesIn`: bytes of buffers and events read.
    #[serde(rename = "numBytesIn")]
    pub num_bytes_in: u64,
    /// `numBuffersIn`: buffers and events read.
    #[serde(rename = "numBuffersIn")]
    pub num_buffers_in: u64,
    /// `inPoolUsage`: segments of the gate's pool holding data (not free in a channel as
    /// credit) over the pool's maximum, 0 to 1 (0 for a gate of local channels only, which has
    /// no pool).
    #[serde(rename = "inPoolUsage")]
    pub in_pool_usage: f64,
    /// `accumulatedIdleTimeMs`: total time the reader waited for data.
    #[serde(rename = "accumulatedIdleTimeMs")]
    pub idle_time_ms: u64,
    /// `numBytesInLocal`: the part of `numBytesIn` read from local channels.
    #[serde(rename = "numBytesInLocal")]
    pub num_bytes_in_local: u64,
    /// `numBytesInRemote`: the part of `numBytesIn` read from remote channels.
    #[serde(rename = "numBytesInRemote")]
    pub num_bytes_in_remote: u64,
    /// `numBuffersInLocal`: the part of `numBuffersIn` read from local channels.
    #[serde(rename = "numBuffersInLocal")]
    pub num_buffers_in_local: u64,
    /// `numBuffersInRemote`: the part of `numBuffersIn` read from remote channels.
    #[serde(rename = "numBuffersInRemote")]
    pub num_buffers_in_remote: u64,
    /// `inputQueueLength`: buffers and events remote channels received and the gate has not
    /// read yet (as Flink counts it, remote channels only).
    #[serde(rename = "inputQueueLength")]
    pub input_queue_length: u64,
    /// `inputExclusiveBuffersUsage`: the remote channels' exclusive segments holding data
    /// over all their exclusive segments, 0 to 1.
    #[serde(rename = "inputExclusiveBuffersUsage", default)]
    pub input_exclusive_buffers_usage: f64,
    /// `inputFloatingBuffersUsage`: floating segments holding data over the segments the
    /// gate's pool may lend as floating ones (its maximum less the exclusive ones), 0 to 1.
    #[serde(rename = "inputFloatingBuffersUsage", default)]
    pub input_floating_buffers_usage: f64,
}

impl InputMetricsSnapshot {
    /// `(Flink name, value)` of every field (the usages together).
    pub fn fields(&self) -> [(&'static str, f64); 11] {
        [
            ("numBytesIn", self.num_bytes_in as f64),
            ("numBuffersIn", self.num_buffers_in as f64),
            ("inPoolUsage", self.in_pool_usage),
            (
                "inputExclusiveBuffersUsage",
                self.input_exclusive_buffers_usage,
            ),
            (
                "inputFloatingBuffersUsage",
                self.input_floating_buffers_usage,
            ),
            ("accumulatedIdleTimeMs", self.idle_time_ms as f64),
            ("numBytesInLocal", self.num_bytes_in_local as f64),
            ("numBytesInRemote", self.num_bytes_in_remote as f64),
            ("numBuffersInLocal", self.num_buffers_in_local as f64),
            ("numBuffersInRemote", self.num_buffers_in_remote as f64),
            ("inputQueueLength", self.input_queue_length as f64),
        ]
    }
}

impl fmt::Display for InputMetricsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "numBytesIn={} numBuffersIn={} inPoolUsage={:.3} inputExclusiveBuffersUsage={:.3} \
             inputFloatingBuffersUsage={:.3} accumulatedIdleTimeMs={} \
             numBytesInLocal={} numBytesInRemote={} numBuffersInLocal={} \
             numBuffersInRemote={} inputQueueLength={}",
            self.num_bytes_in,
            self.num_buffers_in,
            self.in_pool_usage,
            self.input_exclusive_buffers_usage,
            self.input_floating_buffers_usage,
            self.idle_time_ms,
            self.num_bytes_in_local,
            self.num_bytes_in_remote,
            self.num_buffers_in_local,
            self.num_buffers_in_remote,
            self.input_queue_length
        )
    }
}

/// The network memory's gauges now, with Flink's names (its TaskManager's
/// `Status.Shuffle.Netty.*`): segments and bytes in all, free in the global pool, and leased
/// to local pools (partitions' and gates', overdraft included). From
/// [`NetworkBufferPool::metrics_snapshot`](crate::buffer::NetworkBufferPool::metrics_snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NetworkMetricsSnapshot {
    /// `TotalMemorySegments`.
    #[serde(rename = "TotalMemorySegments")]
    pub total_memory_segments: u64,
    /// `AvailableMemorySegments`: free in the global pool.
    #[serde(rename = "AvailableMemorySegments")]
    pub available_memory_segments: u64,
    /// `UsedMemorySegments`: the rest.
    #[serde(rename = "UsedMemorySegments")]
    pub used_memory_segments: u64,
    /// `TotalMemory`, bytes.
    #[serde(rename = "TotalMemory")]
    pub total_memory: u64,
    /// `AvailableMemory`, bytes.
    #[serde(rename = "AvailableMemory")]
    pub available_memory: u64,
    /// `UsedMemory`, bytes.
    #[serde(rename = "UsedMemory")]
    pub used_memory: u64,
}

impl NetworkMetricsSnapshot {
    /// The gauges of `total` segments of `segment_size` bytes, `available` of them free.
    pub(crate) fn of(total: usize, available: usize, segment_size: usize) -> Self {
        let (total, available) = (total as u64, available.min(total) as u64);
        let bytes = segment_size as u64;
        Self {
            total_memory_segments: total,
            available_memory_segments: available,
            used_memory_segments: total - available,
            total_memory: total * bytes,
            available_memory: available * bytes,
            used_memory: (total - available) * bytes,
        }
    }

    /// `(Flink name, value)` of every field, in declaration order.
    pub fn fields(&self) -> [(&'static str, f64); 6] {
        [
            ("TotalMemorySegments", self.total_memory_segments as f64),
            (
                "AvailableMemorySegments",
                self.available_memory_segments as f64,
            ),
            ("UsedMemorySegments", self.used_memory_segments as f64),
            ("TotalMemory", self.total_memory as f64),
            ("AvailableMemory", self.available_memory as f64),
            ("UsedMemory", self.used_memory as f64),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::buffer::NetworkBufferPool;
    use crate::gate::{
        ChannelLocation, ChannelSpec, ConsumedSubpartition, ReaderItem, RecordReader,
        SingleInputGate,
    };
    use crate::partition::{PartitionManager, ResultPartition, ResultPartitionId};
    use crate::NetworkConfig;

    #[test]
    fn back_pressured_time_per_second_is_at_most_all_of_it() {
        // 1.001 s of back pressure seen over an interval read as 1 s: separate clock reads.
        assert_eq!(
            OutputMetrics::back_pressured_ms_per_second(0, 1_001_000_000, 1_000_000_000),
            1000.0
        );
        assert_eq!(
            OutputMetrics::back_pressured_ms_per_second(0, 250_000_000, 1_000_000_000),
            250.0
        );
        assert_eq!(OutputMetrics::back_pressured_ms_per_second(5, 9, 0), 0.0);
    }

    // 300 × 101 bytes: eight 4 KiB buffers, under the subpartition's 10-buffer limit.
    const RECORDS: u64 = 300;
    const RECORD: [u8; 100] = [7; 100];

    /// One partition of one subpartition, a gate reading it over a local channel; emits
    /// `RECORDS` records, finishes, reads everything. Returns both snapshots taken after the
    /// read and the snapshot of the partition taken before it.
    fn exchange() -> (
        OutputMetricsSnapshot,
        OutputMetricsSnapshot,
        InputMetricsSnapshot,
    ) {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.memory.segment-size", "4kb")
            .unwrap();
        config.set("taskmanager.memory.network.max", "4mb").unwrap();
        config.set("fluxgate.memory.arena-size", "1mb").unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let manager = Arc::new(PartitionManager::new());
        let id = ResultPartitionId {
            partition: 1,
            producer: 0,
        };
        let mut partition = ResultPartition::new(id, 1, &network, &config).unwrap();
        manager.register(partition.handle()).unwrap();
        assert_eq!(
            partition.metrics_snapshot(),
            OutputMetricsSnapshot::default()
        );
        let spec = ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: id,
                subpartition: 0,
            },
            location: ChannelLocation::Local,
        };
        let mut gate = SingleInputGate::new(vec![spec], manager, &network, &config);
        gate.setup().unwrap();
        gate.request_partitions(Instant::now()).unwrap();
        assert_eq!(gate.metrics_snapshot(), InputMetricsSnapshot::default());
        // Few enough records to fit the partition's pool: no reader needed while writing.
        for _ in 0..RECORDS {
            partition.emit_record(&RECORD[..], 0).unwrap();
        }
        partition.finish().unwrap();
        let written = partition.metrics_snapshot();
        let mut reader = RecordReader::new(gate, config.max_record_bytes);
        let mut read = 0;
        while let Some(item) = reader.next_timeout(Duration::from_secs(10)).unwrap() {
            if let ReaderItem::Record { bytes, .. } = item {
                assert_eq!(bytes, &RECORD[..]);
                read += 1;
            }
        }
        assert_eq!(read, RECORDS);
        (
            written,
            partition.metrics_snapshot(),
            reader.gate().metrics_snapshot(),
        )
    }

    #[test]
    fn network_gauges_count_leased_segments() {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.memory.segment-size", "4kb")
            .unwrap();
        config.set("taskmanager.memory.network.max", "1mb").unwrap();
        config.set("fluxgate.memory.arena-size", "1mb").unwrap();
        let network = NetworkBufferPool::new(&config).unwrap();
        let idle = network.metrics_snapshot();
        assert_eq!(
            (idle.total_memory_segments, idle.used_memory_segments),
            (256, 0)
        );
        assert_eq!(idle.total_memory, 1 << 20);
        let held: Vec<_> = (0..3).map(|_| network.request_segment().unwrap()).collect();
        let busy = network.metrics_snapshot();
        assert_eq!(
            (busy.available_memory_segments, busy.used_memory_segments),
            (253, 3)
        );
        assert_eq!(
            (busy.used_memory, busy.available_memory),
            (3 * 4096, 253 * 4096)
        );
        drop(held);
        assert_eq!(network.metrics_snapshot(), idle);
    }

    #[test]
    fn snapshots_count_what_went_through() {
        let (written, after, input) = exchange();
        assert_eq!(written.num_records_out, RECORDS);
        // Every record is a 1-byte length and 100 bytes; finish closes the last buffer.
        assert_eq!(written.num_bytes_out, RECORDS * 101);
        assert!(written.num_buffers_out >= RECORDS * 101 / 4096);
        assert!(
            written.out_pool_usage > 0.0 && written.out_pool_usage <= 1.0,
            "{written}"
        );
        assert_eq!(written.back_pressured_time_ms, 0, "the pool never ran dry");
        // Finished, nothing read yet: every buffer and the EndOfPartition are queued.
        assert!(
            written.output_queue_length > written.num_buffers_out,
            "{written}"
        );
        // Reading returns every segment: the counters stay, the usage drops to zero.
        assert_eq!(after.num_records_out, RECORDS);
        assert_eq!(after.out_pool_usage, 0.0, "{after}");
        assert_eq!(after.output_queue_length, 0, "{after}");
        // Every data buffer plus the EndOfPartition event, and every byte of them.
        assert!(input.num_buffers_in > 0);
        assert!(input.num_buffers_in > written.num_buffers_out, "{input}");
        assert!(input.num_bytes_in >= written.num_bytes_out, "{input}");
        assert_eq!(
            input.in_pool_usage, 0.0,
            "local channels only: no gate pool"
        );
        assert_eq!(
            (input.num_bytes_in_local, input.num_buffers_in_local),
            (input.num_bytes_in, input.num_buffers_in),
            "local channels only"
        );
        assert_eq!(
            (input.num_bytes_in_remote, input.num_buffers_in_remote),
            (0, 0)
        );
        assert_eq!(input.input_queue_length, 0, "counts remote channels only");
    }

    #[test]
    fn snapshots_speak_flinks_names() {
        let (written, _, input) = exchange();
        let json = serde_json::to_value(written).unwrap();
        assert_eq!(json["numRecordsOut"], RECORDS);
        for (name, _) in written.fields() {
            assert!(json.get(name).is_some(), "{name} in {json}");
            assert!(written.to_string().contains(&format!("{name}=")));
        }
        let json = serde_json::to_value(input).unwrap();
        for (name, value) in input.fields() {
            assert_eq!(json[name].as_f64(), Some(value), "{name} in {json}");
            assert!(input.to_string().contains(&format!("{name}=")));
        }
    }
}
