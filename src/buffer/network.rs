//! The global pool: all network memory of the process, mapped at start.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use super::local::{LocalBufferPool, LocalPoolShared, LocalPoolSpec};
use super::segment::{ArenaRegion, FreeList, PooledSegment, Recycler, Segment, SegmentMemory};
use super::PoolError;
use crate::config::NetworkConfig;
use crate::sync::{ArrayQueue, AtomicUsize, Ordering};

/// Local pools that may wait at once for the global pool to refill; beyond this, a waiting
/// pool falls back to its bounded re-check interval.
const STARVED_POOLS_MAX: usize = 4096;

/// How much memory is given back between a segment's return and its next use, when enough is
/// free: more than a core's L2 cache (1 MiB here), so the core that last read the segment no
/// longer holds its lines and the next writer pays no invalidation per line; well within the
/// shared L3, so that writer does not wait on DRAM either. Measured on a local 1→1 exchange of
/// 1 KiB records: 90–95 ns of CPU per record with 4–8 MiB between reuses, 126–128 ns when every
/// segment went round the whole 64 MiB, and 8-byte records three times slower when a pool
/// rewrote the segment just read.
const COOLING_BYTES: usize = 4 << 20;

/// The process's network memory (Flink's `NetworkBufferPool`): a few pre-faulted arenas cut
/// into fixed segments, with a lock-free free list. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct NetworkBufferPool {
    pub(crate) inner: Arc<NetworkInner>,
}

pub(crate) struct NetworkInner {
    memory: SegmentMemory,
    /// Segments given back lately, oldest first; taken from once `cooling` of them wait.
    recent: FreeList,
    /// How many recent segments wait before the oldest is taken: `COOLING_BYTES` worth.
    cooling: usize,
    /// The other free segments (all of them at start), taken when `recent` is short.
    reserve: FreeList,
    /// Sum of the guaranteed minimums of the live local pools (admission control only).
    promised: Mutex<usize>,
    /// Local pools waiting for a segment to come back to the global free list.
    starved: ArrayQueue<Weak<LocalPoolShared>>,
    starved_len: AtomicUsize,
}

impl fmt::Debug for NetworkBufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetworkBufferPool")
            .field("segments", &self.total_segments())
            .field("available", &self.available_segments())
            .field("segment_size", &self.segment_size())
            .finish()
    }
}

impl NetworkBufferPool {
    /// Maps the whole network memory the configuration asks for.
    pub fn new(config: &NetworkConfig) -> Result<Self, PoolError> {
        config
            .validate()
            .map_err(|e| PoolError::Config(e.to_string()))?;
        let segments = u32::try_from(config.segment_count())
            .map_err(|_| PoolError::Config("too many segments".into()))?;
        let (memory, reserve) =
            SegmentMemory::map(segments, config.segment_size as u32, config.arena_bytes)?;
        // At most half the segments cool, so a small pool still reaches its steady state.
        let cooling =
            (COOLING_BYTES / config.segment_size.max(1)).clamp(1, (segments as usize / 2).max(1));
        tracing::debug!(
            segments,
            segment_size = config.segment_size,
            arenas = memory.arenas().len(),
            "network memory mapped"
        );
        Ok(Self {
            inner: Arc::new(NetworkInner {
                memory,
                recent: FreeList::with_capacity(2 * cooling),
                cooling,
                reserve,
                promised: Mutex::new(0),
                starved: ArrayQueue::new(STARVED_POOLS_MAX),
                starved_len: AtomicUsize::new(0),
            }),
        })
    }

    /// Payload bytes per segment.
    pub fn segment_size(&self) -> usize {
        self.inner.memory.segment_size()
    }

    /// Segments in the whole network memory.
    pub fn total_segments(&self) -> usize {
        self.inner.memory.segment_count()
    }

    /// Segments on the global free lists now.
    pub fn available_segments(&self) -> usize {
        self.inner.recent.len() + self.inner.reserve.len()
    }

    /// The arenas, for registering them with io_uring.
    pub fn arenas(&self) -> Vec<ArenaRegion> {
        self.inner.memory.arenas()
    }

    /// `(arena index, payload offset in the arena)` of a segment.
    pub fn locate(&self, segment_index: u32) -> (usize, usize) {
        self.inner.memory.locate(segment_index)
    }

    /// Takes one segment straight from the global pool (not counted against any local pool);
    /// it returns here when dropped. For control paths and tests.
    pub fn request_segment(&self) -> Option<PooledSegment> {
        let segment = self.inner.take()?;
        Some(PooledSegment::new(self.inner.clone(), segment))
    }

    /// Creates a local pool. Fails when the guaranteed minimums of all live local pools would
    /// exceed the global pool.
    pub fn create_local_pool(&self, spec: LocalPoolSpec) -> Result<LocalBufferPool, PoolError> {
        if spec.min_segments > spec.max_segments || spec.max_segments == 0 {
            return Err(PoolError::Config(format!(
                "local pool needs 0 < min ({}) <= max ({})",
                spec.min_segments, spec.max_segments
            )));
        }
        {
            let mut promised = self.inner.promised.lock().expect("not poisoned");
            let total = self.total_segments();
            if *promised + spec.min_segments > total {
                return Err(PoolError::Insufficient {
                    required: spec.min_segments,
                    available: total - *promised,
                    total,
                    segment_size: self.segment_size(),
                });
            }
            *promised += spec.min_segments;
        }
        Ok(LocalBufferPool::new(self.inner.clone(), spec))
    }
}

impl NetworkInner {
    pub(crate) fn memory(&self) -> &SegmentMemory {
        &self.memory
    }

    /// Pops a free segment: the oldest of the recent ones once enough have cooled, else one
    /// from the reserve, else any. `None` only when no segment is free. (The length is read
    /// before the pop without a lock: a race only takes a segment that cooled a little less.)
    pub(crate) fn take(&self) -> Option<Segment> {
        if self.recent.len() >= self.cooling {
            if let Some(segment) = self.recent.pop() {
                return Some(segment);
            }
        }
        self.reserve.pop().or_else(|| self.recent.pop())
    }

    /// Swaps `segment` for one that has cooled (see [`take`](Self::take)), so a pool at its
    /// minimum does not write its few segments over and over while another core still caches
    /// them. Takes before it gives back: a starved pool woken by the give-back cannot leave
    /// this one short. Keeps `segment` when no other is free.
    pub(crate) fn exchange(&self, segment: Segment) -> Segment {
        match self.take() {
            Some(cooled) => {
                self.give_back(segment);
                cooled
            }
            None => segment,
        }
    }

    /// Returns a segment and wakes the local pools that were waiting for one.
    pub(crate) fn give_back(&self, segment: Segment) {
        // The reserve has room for every segment; `recent` only for twice the cooling depth.
        if let Err(segment) = self.recent.push(segment) {
            if self.reserve.push(segment).is_err() {
                unreachable!("the reserve has room for every segment");
            }
        }
        if self.starved_len.load(Ordering::SeqCst) > 0 {
            self.wake_starved();
        }
    }

    /// Registers a local pool to be called when the global free list refills.
    pub(crate) fn register_starved(&self, pool: Weak<LocalPoolShared>) -> bool {
        if self.starved.push(pool).is_err() {
            return false;
        }
        self.starved_len.fetch_add(1, Ordering::SeqCst);
        true
    }

    fn wake_starved(&self) {
        // Every pool waiting now retries once; one that still finds nothing registers again,
        // which is why the loop is bounded by the count taken before it.
        let waiting = self.starved_len.load(Ordering::SeqCst);
        for _ in 0..waiting {
            let Some(pool) = self.starved.pop() else {
                break;
            };
            self.starved_len.fetch_sub(1, Ordering::SeqCst);
            if let Some(pool) = pool.upgrade() {
                pool.on_global_available();
            }
        }
    }

    /// A local pool was destroyed: its minimum is no longer promised.
    pub(crate) fn forget_promise(&self, min_segments: usize) {
        let mut promised = self.promised.lock().expect("not poisoned");
        *promised -= min_segments;
    }
}

impl Recycler for NetworkInner {
    fn memory(&self) -> &SegmentMemory {
        &self.memory
    }

    fn recycle(&self, segment: Segment) {
        self.give_back(segment);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// `segments` segments of `segment_kb` KiB.
    fn pool(segments: usize, segment_kb: usize) -> Arc<NetworkInner> {
        let mut config = NetworkConfig::default();
        let size = segment_kb * 1024;
        config
            .set("taskmanager.memory.segment-size", &size.to_string())
            .unwrap();
        config
            .set(
                "taskmanager.memory.network.max",
                &(segments * size).to_string(),
            )
            .unwrap();
        config
            .set("fluxgate.memory.arena-size", &(segments * size).to_string())
            .unwrap();
        NetworkBufferPool::new(&config).unwrap().inner
    }

    /// 8 segments of 4 KiB: `cooling` is 4 (half the segments, less than 4 MiB).
    fn inner() -> Arc<NetworkInner> {
        pool(8, 4)
    }

    fn take_all(inner: &NetworkInner) -> Vec<Segment> {
        std::iter::from_fn(|| inner.take()).collect()
    }

    #[test]
    fn segments_given_back_are_taken_again_oldest_first_once_enough_cool() {
        let inner = inner();
        assert_eq!(inner.cooling, 4);
        let mut out = take_all(&inner);
        assert_eq!(out.len(), 8);
        let order: Vec<u32> = out.iter().map(Segment::index).collect();
        for segment in out.drain(..5) {
            inner.give_back(segment);
        }
        // Five recent, the reserve empty: oldest first.
        assert_eq!(inner.take().unwrap().index(), order[0]);
        assert_eq!(inner.take().unwrap().index(), order[1]);
        // Three recent, fewer than the depth, and the reserve empty: still taken, never `None`
        // while a segment is free.
        assert_eq!(inner.take().unwrap().index(), order[2]);
        assert_eq!(inner.recent.len(), 2);
        assert_eq!(inner.reserve.len(), 0);
    }

    #[test]
    fn below_the_cooling_depth_the_reserve_is_taken_first() {
        let inner = inner();
        let first = inner.take().unwrap();
        let index = first.index();
        inner.give_back(first);
        let next = inner.take().unwrap();
        assert_ne!(
            next.index(),
            index,
            "a segment just given back waits while others are free"
        );
        assert_eq!(inner.recent.len(), 1);
        assert_eq!(inner.reserve.len(), 6);
    }

    #[test]
    fn a_full_recent_list_spills_into_the_reserve_and_nothing_is_lost() {
        // 16 segments of 1 MiB: 4 MiB cool, so `recent` holds 8.
        let inner = pool(16, 1024);
        assert_eq!(inner.cooling, 4);
        for segment in take_all(&inner) {
            inner.give_back(segment);
        }
        assert_eq!(inner.recent.len(), 8);
        assert_eq!(inner.reserve.len(), 8);
        let mut again: Vec<u32> = take_all(&inner).iter().map(Segment::index).collect();
        again.sort_unstable();
        assert_eq!(again, (0..16).collect::<Vec<u32>>());
    }
}
