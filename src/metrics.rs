//! Counters named as Flink names its network metrics.

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
    /// back-pressured nanoseconds taken
    /// `interval_nanos` apart.
    pub fn back_pressured_ms_per_second(earlier: u64, later: u64, interval_nanos: u64) -> f64 {
        if interval_nanos == 0 {
            return 0.0;
        }
        later.saturating_sub(earlier) as f64 / interval_nanos as f64 * 1000.0
    }
}
