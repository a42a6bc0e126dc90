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

/// The process's network memory (Flink's `NetworkBufferPool`): a few pre-faulted arenas cut
/// into fixed segments, with a lock-free free list. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct NetworkBufferPool {
    pub(crate) inner: Arc<NetworkInner>,
}

pub(crate) struct NetworkInner {
    memory: SegmentMemory,
    free: FreeList,
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
        let (memory, free) =
            SegmentMemory::map(segments, config.segment_size as u32, config.arena_bytes)?;
        tracing::debug!(
            segments,
            segment_size = config.segment_size,
            arenas = memory.arenas().len(),
            "network memory mapped"
        );
        Ok(Self {
            inner: Arc::new(NetworkInner {
                memory,
                free,
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

    /// Segments on the global free list now.
    pub fn available_segments(&self) -> usize {
        self.inner.free.len()
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
        let segment = self.inner.free.pop()?;
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

    /// Pops a free segment.
    pub(crate) fn take(&self) -> Option<Segment> {
        self.free.pop()
    }

    /// Swaps `segment` for the one that has been free longest (the global list is FIFO), so a
    /// pool at its minimum does not write its few segments over and over while another core
    /// still caches them. Takes before it gives back: a starved pool woken by the give-back
    /// cannot leave this one short. Keeps `segment` when the global list is empty.
    pub(crate) fn exchange(&self, segment: Segment) -> Segment {
        match self.free.pop() {
            Some(longest_free) => {
                self.give_back(segment);
                longest_free
            }
            None => segment,
        }
    }

    /// Returns a segment and wakes the local pools that were waiting for one.
    pub(crate) fn give_back(&self, segment: Segment) {
        if self.free.push(segment).is_err() {
            unreachable!("the global free list holds every segment");
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
