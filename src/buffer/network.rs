//! The global pool: all network memory of the process, mapped at start.

use std::cell::Cell;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use super::local::{LocalBufferPool, LocalPoolShared, LocalPoolSpec};
use super::segment::{ArenaRegion, FreeList, PooledSegment, Recycler, Segment, SegmentMemory};
use super::PoolError;
use crate::config::NetworkConfig;
use crate::sync::{ArrayQueue, AtomicUsize, Ordering};

/// Local pools that may wait at once in the lock-free starved queue for the global pool to
/// refill; more wait in a list behind a lock, taken only when that many wait.
#[cfg(not(test))]
const STARVED_POOLS_MAX: usize = 4096;
#[cfg(test)]
const STARVED_POOLS_MAX: usize = 2;

/// Most subpartitions, and most buffer listeners (input channels), one local pool counts:
/// as many channels as one connection may carry (`max-channels-per-connection`'s bound).
pub const MOST_POOL_CHANNELS: usize = 1 << 20;

/// How much other network memory an I/O thread's recycled segment waits behind before it is
/// handed out again (see [`NetworkInner::give_back`]): more than a core's L2 holds (2 MiB
/// on the machines we measure on), well under a shared L3 (32 MiB).
const WARM_REUSE_BYTES: usize = 4 << 20;

#[cfg(not(loom))]
std::thread_local! {
    /// Set on the I/O threads: what they give back they mostly sent (the kernel's send copy
    /// read it last) or received (the kernel's receive copy wrote it), not what a consumer
    /// task read on another core.
    static GIVES_BACK_ON_IO_THREAD: Cell<bool> = const { Cell::new(false) };
}
// Loom runs its model threads on one OS thread: a std thread-local would be shared by all of
// them and outlive a model's run.
#[cfg(loom)]
loom::thread_local! {
    static GIVES_BACK_ON_IO_THREAD: Cell<bool> = Cell::new(false);
}

/// Marks the calling thread as an I/O thread for the pool's reuse order
/// ([`NetworkInner::give_back`]). Public only for the loom models.
pub fn mark_io_thread() {
    GIVES_BACK_ON_IO_THREAD.with(|flag| flag.set(true));
}

fn on_io_thread() -> bool {
    GIVES_BACK_ON_IO_THREAD.with(Cell::get)
}

/// The process's network memory (Flink's `NetworkBufferPool`): a few pre-faulted arenas cut
/// into fixed segments, with a lock-free free list. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct NetworkBufferPool {
    pub(crate) inner: Arc<NetworkInner>,
}

pub(crate) struct NetworkInner {
    memory: SegmentMemory,
    /// Free segments in the order they came back (FIFO): what a take gets from here has been
    /// free longest, its cache lines long gone from every core.
    free: FreeList,
    /// Free segments an I/O thread gave back, reused after about `warm_depth` others (FIFO)
    /// rather than after the whole free list; it holds at most twice that, the rest spills
    /// into `free`.
    warm: FreeList,
    warm_depth: usize,
    /// Sum of the guaranteed minimums of the live local pools (admission control only).
    promised: Mutex<usize>,
    /// Local pools waiting for a segment to come back to the global free list.
    starved: ArrayQueue<Weak<LocalPoolShared>>,
    /// Those the queue had no room for: a pool with listeners waits on no timer, so none may
    /// be dropped. Each pool waits at most once (its `starved` flag), so this holds at most
    /// as many as there are pools.
    starved_overflow: Mutex<Vec<Weak<LocalPoolShared>>>,
    /// Pools in `starved_overflow`.
    overflow_len: AtomicUsize,
    /// Pools in `starved` and `starved_overflow`.
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

/// `Ok` when `bytes` of pre-faulted memory fit in what is `available` (unknown: they do).
fn fits_in_memory(bytes: usize, available: Option<usize>) -> Result<(), PoolError> {
    match available {
        Some(available) if bytes > available => Err(PoolError::Allocation {
            bytes,
            reason: format!(
                "only {available} bytes are available (MemAvailable, memory cgroup limits)"
            ),
        }),
        _ => Ok(()),
    }
}

/// The memory this process can still take, where the system tells: the kernel's
/// `MemAvailable`, less where a memory cgroup (v2 or v1; its own or an ancestor's) leaves
/// less room under its limit.
fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let system = meminfo.as_deref().and_then(|meminfo| {
        let line = meminfo
            .lines()
            .find(|line| line.starts_with("MemAvailable:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut room = system;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        // Usage counts page cache the kernel reclaims before it fails an allocation: its
        // inactive part is left out, as a working set is measured.
        let (base, limit_file, usage_file, cache_key) = if controllers.is_empty() {
            (
                "/sys/fs/cgroup",
                "memory.max",
                "memory.current",
                "inactive_file",
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        } else {
            continue;
        };
        // The cgroup and its ancestors: a limit anywhere above applies too.
        let mut dir = std::path::PathBuf::from(format!("{base}{path}"));
        for _ in 0..64 {
            let read = |file: &str| -> Option<usize> {
                std::fs::read_to_string(dir.join(file))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            if let (Some(limit), Some(usage)) = (read(limit_file), read(usage_file)) {
                let cache = std::fs::read_to_string(dir.join("memory.stat"))
                    .ok()
                    .and_then(|stat| {
                        stat.lines()
                            .find_map(|line| line.strip_prefix(cache_key)?.strip_prefix(' '))
                            .and_then(|value| value.trim().parse::<usize>().ok())
                    })
                    .unwrap_or(0);
                let left = limit.saturating_sub(usage.saturating_sub(cache));
                room = Some(room.map_or(left, |room| room.min(left)));
            }
            if dir.as_os_str().len() <= base.len() || !dir.pop() {
                break;
            }
        }
    }
    room
}

impl NetworkBufferPool {
    /// Maps the whole network memory the configuration asks for.
    pub fn new(config: &NetworkConfig) -> Result<Self, PoolError> {
        config
            .validate()
            .map_err(|e| PoolError::Config(e.to_string()))?;
        let segments = u32::try_from(config.segment_count())
            .map_err(|_| PoolError::Config("too many segments".into()))?;
        // The arenas are pre-faulted: memory the machine does not have would not fail the
        // mapping but bring the OOM killer, so a size beyond what is available is an error.
        let bytes = SegmentMemory::mapped_bytes(segments, config.segment_size, config.arena_bytes);
        fits_in_memory(bytes, available_memory())?;
        let (memory, free) =
            SegmentMemory::map(segments, config.segment_size as u32, config.arena_bytes)?;
        // The depth is at most a quarter of the segments (the list holds up to twice the
        // depth), so that a small pool still circulates; at least one segment.
        let warm_depth = (WARM_REUSE_BYTES / config.segment_size.max(1))
            .min(segments as usize / 4)
            .max(1);
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
                warm: FreeList::with_capacity(2 * warm_depth),
                warm_depth,
                promised: Mutex::new(0),
                starved: ArrayQueue::new(STARVED_POOLS_MAX),
                starved_overflow: Mutex::new(Vec::new()),
                overflow_len: AtomicUsize::new(0),
                starved_len: AtomicUsize::new(0),
            }),
        })
    }

    /// Payload bytes per segment.
    pub fn segment_size(&self) -> usize {
        self.inner.memory.segment_size()
    }

    /// The network memory's gauges now (Flink's `TotalMemorySegments`,
    /// `AvailableMemorySegments`, `UsedMemorySegments` and their sizes in bytes).
    pub fn metrics_snapshot(&self) -> crate::metrics::NetworkMetricsSnapshot {
        crate::metrics::NetworkMetricsSnapshot::of(
            self.total_segments(),
            self.available_segments(),
            self.segment_size(),
        )
    }

    /// Segments in the whole network memory.
    pub fn total_segments(&self) -> usize {
        self.inner.memory.segment_count()
    }

    /// Free segments in the global pool now (both of its lists).
    pub fn available_segments(&self) -> usize {
        let inner = &self.inner;
        // The two lengths are read one after the other: a segment moving from one list to
        // the other in between would be counted twice or not at all. Read again until the
        // warm list stood still across the read of the other (bounded: a busy pool gets the
        // last, possibly inexact, reading, never more than every segment).
        let mut count = 0;
        for _ in 0..64 {
            let warm = inner.warm.len();
            let free = inner.free.len();
            count = warm + free;
            if inner.warm.len() == warm {
                break;
            }
        }
        count.min(self.total_segments())
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
        // No pool holds more than the whole network memory: its free list and queues are
        // sized from these counts.
        let total = self.total_segments();
        let spec = LocalPoolSpec {
            max_segments: spec.max_segments.min(total.max(spec.min_segments)),
            max_overdraft_segments: spec.max_overdraft_segments.min(total),
            ..spec
        };
        if spec.min_segments > spec.max_segments || spec.max_segments == 0 {
            return Err(PoolError::Config(format!(
                "local pool needs 0 < min ({}) <= max ({})",
                spec.min_segments, spec.max_segments
            )));
        }
        {
            let mut promised = self.inner.promised.lock().expect("not poisoned");
            let total = self.total_segments();
            // Checked: a minimum near `usize::MAX` (a partition of that many subpartitions)
            // must be refused, not wrap the sum below the total.
            if promised
                .checked_add(spec.min_segments)
                .is_none_or(|needed| needed > total)
            {
                return Err(PoolError::Insufficient {
                    required: spec.min_segments,
                    available: total - *promised,
                    total,
                    segment_size: self.segment_size(),
                });
            }
            // Sized up front from the spec (a counter per subpartition, a queue slot per
            // listener): a caller's absurd count is refused, not an allocation that aborts.
            // After the admission, which tells a partition of too many subpartitions how
            // much memory it would need.
            if spec.subpartitions > MOST_POOL_CHANNELS || spec.max_listeners > MOST_POOL_CHANNELS {
                return Err(PoolError::Config(format!(
                    "local pool counts at most {MOST_POOL_CHANNELS} subpartitions and \
                     listeners, asked for {} and {}",
                    spec.subpartitions, spec.max_listeners
                )));
            }
            *promised += spec.min_segments;
        }
        Ok(LocalBufferPool::new(self.inner.clone(), spec))
    }
}

impl NetworkBufferPool {
    /// Bytes committed so far in segment `index` (see [`SegmentMemory::written_bytes`]).
    pub(crate) fn written_bytes(&self, index: u32) -> Option<u32> {
        self.inner.memory.written_bytes(index)
    }
}

impl NetworkInner {
    pub(crate) fn memory(&self) -> &SegmentMemory {
        &self.memory
    }

    /// Pops a free segment: the oldest an I/O thread gave back when the warm list is
    /// `warm_depth` deep, else the one free longest, else any.
    pub(crate) fn take(&self) -> Option<Segment> {
        if self.warm.len() >= self.warm_depth {
            if let Some(segment) = self.warm.pop() {
                return Some(segment);
            }
        }
        self.free.pop().or_else(|| self.warm.pop())
    }

    /// Swaps `segment` for another free one, so that a pool at its minimum does not write its
    /// few segments over and over while another core still caches them. Takes before it
    /// gives back: a starved pool woken by the give-back cannot leave this one short. Keeps
    /// `segment` when the global list is empty.
    pub(crate) fn exchange(&self, segment: Segment) -> Segment {
        match self.take() {
            Some(other) => {
                self.give_back(segment);
                other
            }
            None => segment,
        }
    }

    /// Returns a segment and wakes the local pools that were waiting for one.
    ///
    /// Where it goes decides when it is written again, and so what that write costs. A
    /// segment a consumer task read (a local exchange) is still in that core's cache:
    /// rewritten soon from another core, every cache line is a cross-core invalidation, which
    /// made a local 8-byte exchange 2.6 times slower. It goes to the back of the whole free
    /// list, and comes out cold. What an I/O thread gives back is mostly what it sent (the
    /// kernel's send copy read it last) or what a channel let go unused; waiting behind a few
    /// MiB of others (more than a core's L2 keeps) it comes out of the shared L3 instead of
    /// memory, which is what a producer of 1 KiB records spent most of its time on.
    pub(crate) fn give_back(&self, segment: Segment) {
        let segment = if on_io_thread() {
            self.warm.push(segment).err()
        } else {
            Some(segment)
        };
        if let Some(segment) = segment {
            if self.free.push(segment).is_err() {
                unreachable!("the global free list holds every segment");
            }
        }
        if self.starved_len.load(Ordering::SeqCst) > 0 {
            self.wake_starved();
        }
    }

    /// Registers a local pool to be called when the global free list refills.
    pub(crate) fn register_starved(&self, pool: Weak<LocalPoolShared>) {
        // Counted before the push: a wake-up that pops the entry at once counts it down, and
        // counted after, the count could wrap below zero for a moment (and a give-back then
        // woke every starved pool).
        self.starved_len.fetch_add(1, Ordering::SeqCst);
        if let Err(pool) = self.starved.push(pool) {
            let mut overflow = self
                .starved_overflow
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            overflow.push(pool);
            self.overflow_len.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wake_starved(&self) {
        // Every pool queued now retries once, in the order they came; one that still finds
        // nothing registers again, behind them: the loop is bounded by the length taken
        // before it, so a pool that keeps registering is not woken again in its place.
        let queued = self.starved.len();
        for _ in 0..queued {
            let Some(pool) = self.starved.pop() else {
                break;
            };
            self.starved_len.fetch_sub(1, Ordering::SeqCst);
            if let Some(pool) = pool.upgrade() {
                pool.on_global_available();
            }
        }
        // Then every pool of the overflow list (a pool still registering there has its own
        // second look for this give-back).
        if self.overflow_len.load(Ordering::SeqCst) > 0 {
            let overflow = std::mem::take(
                &mut *self
                    .starved_overflow
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            self.overflow_len
                .fetch_sub(overflow.len(), Ordering::SeqCst);
            self.starved_len.fetch_sub(overflow.len(), Ordering::SeqCst);
            for pool in overflow {
                if let Some(pool) = pool.upgrade() {
                    pool.on_global_available();
                }
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

/// A pool of `segments` 4 KiB segments in 64 KiB arenas, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn pool_of_4k_segments(segments: usize) -> NetworkBufferPool {
    NetworkBufferPool::new(&NetworkConfig {
        segment_size: 4096,
        network_memory_bytes: segments * 4096,
        arena_bytes: 64 * 1024,
        ..NetworkConfig::default()
    })
    .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::HEADROOM;

    /// Keeps the segments it is handed.
    #[derive(Default)]
    struct Keeps(std::sync::Mutex<Vec<PooledSegment>>);

    impl super::super::local::BufferListener for Keeps {
        fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment> {
            self.0.lock().unwrap().push(segment);
            Ok(())
        }
        fn on_pool_destroyed(&self) {}
    }

    /// Registers `listener` at `local`, whose global pool is empty (nothing is at hand).
    fn listen(local: &LocalBufferPool, listener: &Arc<Keeps>) {
        let listener: Arc<dyn super::super::local::BufferListener> = listener.clone();
        assert!(local
            .request_segment_or_listen(&listener)
            .unwrap()
            .is_none());
    }

    /// How many of `listeners` got their segment.
    fn served(listeners: &[Arc<Keeps>]) -> usize {
        listeners
            .iter()
            .filter(|l| l.0.lock().unwrap().len() == 1)
            .count()
    }

    #[test]
    fn more_starved_pools_than_the_starved_queue_holds_are_all_woken() {
        // Three local pools wait for the empty global pool with a listener each, one more than
        // the starved queue holds (2 under test). A listener waits on no timer: the third
        // pool's, left out of the queue, waited for good.
        let pool = pool_of_4k_segments(3);
        let taken: Vec<Segment> = std::iter::from_fn(|| pool.inner.take()).collect();
        assert_eq!(taken.len(), 3);
        let spec = LocalPoolSpec {
            min_segments: 1,
            max_segments: 1,
            subpartitions: 0,
            max_segments_per_channel: 1,
            max_listeners: 1,
            max_overdraft_segments: 0,
        };
        let locals: Vec<LocalBufferPool> = (0..3)
            .map(|_| pool.create_local_pool(spec).unwrap())
            .collect();
        let listeners: Vec<Arc<Keeps>> = (0..3).map(|_| Arc::new(Keeps::default())).collect();
        for (local, listener) in locals.iter().zip(&listeners) {
            listen(local, listener);
        }
        for segment in taken {
            pool.inner.give_back(segment);
        }
        let served = served(&listeners);
        assert_eq!(served, 3, "a starved pool's listener was never served");
        drop(listeners);
        drop(locals);
        assert_eq!(pool.available_segments(), pool.total_segments());
    }

    #[test]
    fn a_subpartition_index_beyond_the_pool_s_is_none_of_its_channels() {
        // The index one below `u32::MAX` read back as the overdraft's tag: its segment went
        // straight to the global pool on recycle, the overdraft count wrapped, and the pool
        // kept counting a segment it no longer held.
        let pool = pool_of_4k_segments(4);
        let spec = LocalPoolSpec {
            min_segments: 1,
            max_segments: 2,
            subpartitions: 1,
            max_segments_per_channel: 2,
            max_listeners: 1,
            max_overdraft_segments: 1,
        };
        let local = pool.create_local_pool(spec).unwrap();
        let stray = local
            .request_buffer_builder((u32::MAX - 1) as usize)
            .expect("a segment");
        drop(stray);
        let builders: Vec<_> = (0..2).map(|_| local.request_buffer_builder(0)).collect();
        assert!(
            builders.iter().all(Option::is_some),
            "the pool still has its two segments"
        );
        drop(builders);
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    }

    #[test]
    fn every_listener_of_a_starved_pool_is_served_as_segments_come_back() {
        // One pool, three listeners waiting for the empty global pool: the pool is queued as
        // starved once for all three. Only the first was served, and the segments given back
        // after it woke no pool: the other two waited with segments free.
        let pool = pool_of_4k_segments(3);
        let taken: Vec<Segment> = std::iter::from_fn(|| pool.inner.take()).collect();
        assert_eq!(taken.len(), 3);
        let spec = LocalPoolSpec {
            min_segments: 0,
            max_segments: 3,
            subpartitions: 0,
            max_segments_per_channel: 3,
            max_listeners: 3,
            max_overdraft_segments: 0,
        };
        let local = pool.create_local_pool(spec).unwrap();
        let listeners: Vec<Arc<Keeps>> = (0..3).map(|_| Arc::new(Keeps::default())).collect();
        for listener in &listeners {
            listen(&local, listener);
        }
        for segment in taken {
            pool.inner.give_back(segment);
        }
        let served = served(&listeners);
        assert_eq!(served, 3, "a listener waited with segments free");
        drop(listeners);
        drop(local);
        assert_eq!(pool.available_segments(), pool.total_segments());
    }

    #[test]
    fn a_segment_an_io_thread_gives_back_comes_out_after_the_warm_depth_others_after_all() {
        let pool = pool_of_4k_segments(64);
        let inner = pool.inner.clone();
        assert_eq!(inner.warm_depth, 16, "a quarter of 64 segments");
        let taken: Vec<Segment> = std::iter::from_fn(|| inner.take()).collect();
        assert_eq!(taken.len(), 64);
        let mut taken = taken.into_iter();
        // A task thread (this one) gives one back: it joins the whole free list.
        let cold = taken.next().unwrap();
        let cold_index = cold.index();
        inner.give_back(cold);
        // An I/O thread gives back as many as the warm depth.
        let warm: Vec<Segment> = taken.by_ref().take(16).collect();
        let warm_indexes: Vec<u32> = warm.iter().map(Segment::index).collect();
        let io_inner = inner.clone();
        std::thread::spawn(move || {
            mark_io_thread();
            for segment in warm {
                io_inner.give_back(segment);
            }
        })
        .join()
        .unwrap();
        assert_eq!(pool.available_segments(), 17);
        // The warm list is as deep as it should be: its oldest comes out first ...
        let first = inner.take().unwrap();
        assert_eq!(first.index(), warm_indexes[0]);
        // ... and below that depth the one free longest on the whole list.
        let second = inner.take().unwrap();
        assert_eq!(second.index(), cold_index);
        // Below the depth with the whole list empty, the warm list still serves: nothing is
        // held back from a pool that needs it.
        let rest: Vec<Segment> = std::iter::from_fn(|| inner.take()).collect();
        assert_eq!(rest.len(), 15);
        assert_eq!(rest[0].index(), warm_indexes[1]);
        for segment in [first, second].into_iter().chain(rest).chain(taken) {
            inner.give_back(segment);
        }
        assert_eq!(pool.available_segments(), 64, "every segment is back");
    }

    #[test]
    fn network_memory_beyond_what_is_available_is_an_error_not_an_oom_kill() {
        // Pure: asking `new` for more than the machine has would, were the check ever lost,
        // pre-fault it and bring the OOM killer to whatever else runs here.
        let gib = 1 << 30;
        assert!(matches!(
            fits_in_memory(3 * gib, Some(2 * gib)),
            Err(PoolError::Allocation { bytes, .. }) if bytes == 3 * gib
        ));
        assert!(fits_in_memory(gib, Some(2 * gib)).is_ok());
        assert!(fits_in_memory(3 * gib, None).is_ok(), "unknown: no refusal");
        // What the pool maps is whole arenas, the segments spread evenly over them: 17
        // segments in arenas of at most 16 take two arenas of 9.
        let stride = HEADROOM + 4096;
        assert_eq!(
            SegmentMemory::mapped_bytes(17, 4096, 16 * stride),
            18 * stride
        );
        // The default 64 MiB of 32 KiB segments: an arena holds 2044 of them with their
        // headroom, and the last 4 took a second arena of 64 MiB.
        let config = NetworkConfig::default();
        let segments = config.segment_count();
        let stride = HEADROOM + config.segment_size;
        let mapped = SegmentMemory::mapped_bytes(
            segments.try_into().unwrap(),
            config.segment_size,
            config.arena_bytes,
        );
        assert!(mapped < (segments + 2) * stride, "{mapped} bytes mapped");
        // This process can take at least what it already has mapped.
        assert!(available_memory().is_some_and(|room| room > 0));
    }
}
