//! Segments and their leases: the only module of the crate that touches the network memory
//! through raw pointers.
//!
//! The memory is a few anonymous arenas mapped once at start. A segment is `HEADROOM` bytes of
//! frame-header room followed by `segment_size` payload bytes; segment `i` lives in arena
//! `i / per_arena` at `(i % per_arena) * stride`. Who may touch which bytes is what keeps the
//! raw accesses below sound:
//!
//! * A [`Segment`] token is the exclusive right to a free segment. Tokens are minted once, when
//!   the global [`FreeList`] is filled, and only move (free list → lease → free list).
//! * A segment in use is shared by leases counted in its [`SegmentState::refs`]. Exactly one of
//!   them may be a [`BufferBuilder`], the only writer: it writes bytes at and after its position
//!   and publishes them with a release store of the segment's `marker`. Readers
//!   ([`BufferConsumer`], [`Buffer`]) only read bytes below a marker value they loaded with
//!   acquire, which the writer never touches again.
//! * The headroom before the payload may be written only through a [`Buffer`] that starts at
//!   payload offset 0 and is the segment's only lease (`refs == 1`), i.e. no builder and no other
//!   reader exists.
//! * The last lease to drop hands the token back to its [`Recycler`]; the memory stays mapped
//!   because every lease holds an `Arc` of its recycler, which holds the memory.
#![allow(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};

use super::{DataType, PoolError};
use crate::sync::{fence, ArrayQueue, AtomicU32, Ordering};

/// Bytes reserved before every segment's payload so a frame header can be written in place and
/// `[header | payload]` leaves in one contiguous send.
pub const HEADROOM: usize = 64;

/// Set in a segment's marker once its writer has finished.
const FINISHED: u32 = 1 << 31;

/// Tag of a segment that is not counted against any subpartition.
pub(crate) const NO_CHANNEL: u32 = u32::MAX;

/// The exclusive right to one free segment. Not `Clone`: whoever holds it owns the segment.
#[derive(Debug)]
pub struct Segment {
    index: u32,
}

impl Segment {
    /// The segment's handle in the network memory.
    pub fn index(&self) -> u32 {
        self.index
    }
}

/// A bounded free list of segment tokens (never allocates after creation).
pub(crate) struct FreeList {
    queue: ArrayQueue<u32>,
}

impl FreeList {
    /// An empty free list with room for `capacity` tokens.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            queue: ArrayQueue::new(capacity.max(1)),
        }
    }

    /// Pops a token.
    pub(crate) fn pop(&self) -> Option<Segment> {
        self.queue.pop().map(|index| Segment { index })
    }

    /// Pushes a token back; gives it back when the list is full.
    pub(crate) fn push(&self, segment: Segment) -> Result<(), Segment> {
        self.queue
            .push(segment.index)
            .map_err(|index| Segment { index })
    }

    /// Tokens in the list now.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

/// Per-segment shared state: the lease count, the writer's published position, and a tag the
/// owning pool uses for per-subpartition accounting.
///
/// One cache line each: a writer publishing record by record stores its segment's marker
/// per record, while the reader of the buffer before it, often on the other core, loads
/// that buffer's marker and drops its lease. Packed (12 bytes, five or six to a line), those
/// states shared lines, and each store pulled the line back from the reader's core: 8-byte
/// records one by one cost 19.1 ns against 18.0 aligned (remote, epoll). The line costs 64
/// bytes of heap per segment: 0.2 % of a 32 KiB segment, 1.6 % of the smallest (4 KiB).
#[derive(Debug)]
#[repr(align(64))]
pub(crate) struct SegmentState {
    refs: AtomicU32,
    marker: AtomicU32,
    tag: AtomicU32,
}

/// One mapped arena, as the io_uring driver registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRegion {
    /// First byte of the arena.
    pub base: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

/// The network memory: arenas, their base pointers, and every segment's state.
pub struct SegmentMemory {
    // Keeps the mappings alive; `bases` point into them.
    _arenas: Vec<MmapMut>,
    bases: Box<[NonNull<u8>]>,
    arena_len: usize,
    states: Box<[SegmentState]>,
    segment_size: u32,
    stride: usize,
    per_arena: u32,
}

// SAFETY: the raw base pointers point into mappings owned by this struct and never change; all
// access to the bytes behind them goes through the lease rules in the module docs, and the
// per-segment state is atomics.
unsafe impl Send for SegmentMemory {}
// SAFETY: as for `Send`; shared references only reach the atomics and the lease-checked bytes.
unsafe impl Sync for SegmentMemory {}

impl fmt::Debug for SegmentMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SegmentMemory")
            .field("arenas", &self.bases.len())
            .field("segments", &self.states.len())
            .field("segment_size", &self.segment_size)
            .finish()
    }
}

impl SegmentMemory {
    /// Segments per arena and arenas for [`map`](Self::map): as few arenas as hold the
    /// segments within `arena_bytes` each, with the segments spread evenly over them. Filled
    /// in turn, the last arena held a few segments but was mapped (and pre-faulted) whole:
    /// the default 64 MiB of 32 KiB segments (with their headroom, 2044 to an arena) mapped
    /// a second 64 MiB arena for its last 4 segments.
    fn arena_layout(segments: u32, stride: usize, arena_bytes: usize) -> (u32, usize) {
        let segments = segments.max(1);
        let most_per_arena = u32::try_from((arena_bytes / stride).max(1))
            .unwrap_or(u32::MAX)
            .min(segments);
        let arena_count = segments.div_ceil(most_per_arena);
        (segments.div_ceil(arena_count), arena_count as usize)
    }

    /// The bytes [`map`](Self::map) maps for these arguments: whole arenas, at most one
    /// segment per arena beyond the segments themselves.
    pub(crate) fn mapped_bytes(segments: u32, segment_size: usize, arena_bytes: usize) -> usize {
        let stride = HEADROOM + segment_size;
        let (per_arena, arena_count) = Self::arena_layout(segments, stride, arena_bytes);
        arena_count * per_arena as usize * stride
    }

    /// Maps `segments` segments of `segment_size` payload bytes in arenas of at most
    /// `arena_bytes`, pre-faulted, and returns the memory with a full free list.
    pub(crate) fn map(
        segments: u32,
        segment_size: u32,
        arena_bytes: usize,
    ) -> Result<(Self, FreeList), PoolError> {
        let stride = HEADROOM + segment_size as usize;
        let (per_arena, arena_count) = Self::arena_layout(segments, stride, arena_bytes);
        let arena_len = per_arena as usize * stride;
        let mut arenas = Vec::with_capacity(arena_count);
        let mut bases = Vec::with_capacity(arena_count);
        for _ in 0..arena_count {
            let mut map = MmapOptions::new()
                .len(arena_len)
                .populate()
                .map_anon()
                .map_err(|e| PoolError::Allocation {
                    bytes: arena_len,
                    reason: e.to_string(),
                })?;
            // Transparent huge pages cut TLB misses on the hot path; without them it still works.
            let _ = map.advise(memmap2::Advice::HugePage);
            let base = NonNull::new(map.as_mut_ptr()).expect("mmap never returns null");
            bases.push(base);
            arenas.push(map);
        }
        let states = (0..segments)
            .map(|_| SegmentState {
                refs: AtomicU32::new(0),
                marker: AtomicU32::new(0),
                tag: AtomicU32::new(NO_CHANNEL),
            })
            .collect();
        let free = FreeList::with_capacity(segments as usize);
        for index in 0..segments {
            free.push(Segment { index })
                .expect("the free list is sized for every segment");
        }
        let memory = Self {
            _arenas: arenas,
            bases: bases.into_boxed_slice(),
            arena_len,
            states,
            segment_size,
            stride,
            per_arena,
        };
        Ok((memory, free))
    }

    /// Payload bytes per segment.
    pub fn segment_size(&self) -> usize {
        self.segment_size as usize
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.states.len()
    }

    /// The arenas, for registering them with io_uring as fixed buffers.
    pub fn arenas(&self) -> Vec<ArenaRegion> {
        self.bases
            .iter()
            .map(|base| ArenaRegion {
                base: base.as_ptr(),
                len: self.arena_len,
            })
            .collect()
    }

    /// `(arena index, byte offset of the payload in the arena)` of a segment.
    pub fn locate(&self, index: u32) -> (usize, usize) {
        let arena = (index / self.per_arena) as usize;
        let slot = (index % self.per_arena) as usize;
        (arena, slot * self.stride + HEADROOM)
    }

    fn state(&self, index: u32) -> &SegmentState {
        &self.states[index as usize]
    }

    /// The first payload byte of a segment.
    fn payload(&self, index: u32) -> NonNull<u8> {
        let (arena, offset) = self.locate(index);
        // SAFETY: `bases[arena]` is bounds-checked, and `locate` gives a slot below the arena's
        // segment count, so `offset + segment_size <= arena_len`: the pointer stays inside the
        // arena's mapping.
        unsafe { self.bases[arena].add(offset) }
    }

    /// Bytes committed so far in segment `index` (its builder's published position), `None`
    /// for an index outside this memory. For a look from a thread that holds no lease of it:
    /// the state outlives every lease, and the answer may be old by the time it is used.
    pub(crate) fn written_bytes(&self, index: u32) -> Option<u32> {
        let state = self.states.get(index as usize)?;
        Some(state.marker.load(Ordering::Acquire) & !FINISHED)
    }

    /// The tag the owning pool gave a segment.
    pub(crate) fn tag(&self, segment: &Segment) -> u32 {
        self.state(segment.index).tag.load(Ordering::Relaxed)
    }

    /// Tags a segment the caller owns exclusively.
    pub(crate) fn set_tag(&self, segment: &Segment, tag: u32) {
        self.state(segment.index).tag.store(tag, Ordering::Relaxed);
    }
}

/// Copies `n` bytes; records of a few bytes (length prefixes, 8-byte keys) are copied with
/// plain loads and stores instead of a call into `memcpy`.
///
/// # Safety
///
/// As for `ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `n` bytes, not
/// overlapping.
#[inline(always)]
unsafe fn copy_small(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract; each access below stays within the `n` bytes.
    unsafe {
        match n {
            4 => dst
                .cast::<u32>()
                .write_unaligned(src.cast::<u32>().read_unaligned()),
            8 => dst
                .cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned()),
            1..=16 if n >= 8 => {
                dst.cast::<u64>()
                    .write_unaligned(src.cast::<u64>().read_unaligned());
                let tail = n - 8;
                dst.add(tail)
                    .cast::<u64>()
                    .write_unaligned(src.add(tail).cast::<u64>().read_unaligned());
            }
            _ => std::ptr::copy_nonoverlapping(src, dst, n),
        }
    }
}

/// Writes `[length prefix | bytes]` (see [`crate::record`]) at `at`: the one encoding of a
/// framed record, for [`BufferBuilder::append_framed`] and [`FramedRun::try_append`].
///
/// # Safety
///
/// `at` is valid for writes of `record::framed_len(bytes.len())` bytes that no one reads
/// meanwhile, and does not overlap `bytes`.
#[inline(always)]
unsafe fn write_framed(at: *mut u8, bytes: &[u8]) {
    // SAFETY: the caller's contract covers the prefix and the bytes after it.
    unsafe {
        // The common small record: a one-byte prefix, kept small enough to inline.
        let prefix_bytes = if bytes.len() < 0x80 {
            at.write(bytes.len() as u8);
            1
        } else {
            write_long_prefix(at, bytes.len())
        };
        copy_small(bytes.as_ptr(), at.add(prefix_bytes), bytes.len());
    }
}

/// [`write_framed`]'s prefix of two to five bytes (records of 128 bytes and more, whose copy
/// dominates); returns its length.
///
/// # Safety
///
/// `at` is valid for writes of `record::prefix_len(len)` bytes.
#[inline(never)]
unsafe fn write_long_prefix(at: *mut u8, len: usize) -> usize {
    let mut prefix = [0u8; crate::record::MAX_LENGTH_PREFIX];
    let prefix_bytes = crate::record::encode_prefix(len as u32, &mut prefix);
    // SAFETY: `prefix_bytes` is `prefix_len(len)`, which the caller guarantees room for.
    unsafe { std::ptr::copy_nonoverlapping(prefix.as_ptr(), at, prefix_bytes) };
    prefix_bytes
}

/// How far ahead of a sequential writer or reader of segment bytes the CPU is asked to fetch
/// their cache line: eight lines, far enough to cover a line's transfer from the other core
/// while the records before it are written or read (256 to 1 024 measured the same here).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const PREFETCH_AHEAD: usize = 512;

/// Records this long or longer get no prefetch: their own copy streams whole lines, which the
/// hardware prefetcher follows.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const PREFETCH_RECORDS_BELOW: usize = 128;

/// Asks the CPU to fetch, for writing, the cache line `PREFETCH_AHEAD` bytes past `position`
/// of the bytes at `start`, after a record of `record_len` bytes was written there.
///
/// A recycled segment's lines were last touched by another core: the kernel's copy out of it
/// on the I/O thread, or a consumer's reads. Without this, the producer's first store to each
/// line waits for the line to come over; in the 8-byte-record stream that wait was a third
/// of the serializing loop's samples. The hint is `prefetchw` where the build targets CPUs
/// that have it (`-C target-cpu`, `-C target-feature=+prfchw`), else `prefetcht0`, which
/// brings the line over shared, leaving the store only its upgrade (an explicit `prefetchw`
/// measured about 3 % better here, within the noise). Nothing at or past `end` is fetched:
/// the next segment's first lines may be another thread's to write (a socket read into it),
/// and pulling them here would cost that writer each line.
#[inline(always)]
pub(crate) fn prefetch_for_write(start: *const u8, position: usize, end: usize, record_len: usize) {
    #[cfg(target_arch = "x86_64")]
    prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(start, position, end, record_len);
    #[cfg(not(target_arch = "x86_64"))]
    prefetch(start, position, end, record_len);
}

/// Asks the CPU to fetch, for reading, the cache line `PREFETCH_AHEAD` bytes past `position`
/// of the bytes at `start`, after a record of `record_len` bytes was read there (a received
/// segment's bytes were written by the kernel on its I/O thread's core, a local one's by the
/// producer). Nothing at or past `end`, the readable bytes' end, is fetched: past it the
/// writer may still be writing.
#[inline(always)]
pub(crate) fn prefetch_for_read(start: *const u8, position: usize, end: usize, record_len: usize) {
    #[cfg(target_arch = "x86_64")]
    prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(start, position, end, record_len);
    #[cfg(not(target_arch = "x86_64"))]
    prefetch(start, position, end, record_len);
}

/// The two hints' shared part: `_mm_prefetch` with `HINT`, unless the record was large or the
/// line lies at or past `end`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<const HINT: i32>(start: *const u8, position: usize, end: usize, record_len: usize) {
    if record_len >= PREFETCH_RECORDS_BELOW || position + PREFETCH_AHEAD >= end {
        return;
    }
    // SAFETY: `_mm_prefetch` only needs SSE, which every x86_64 CPU has. A prefetch is a
    // hint: it reads and writes no memory the program can observe and does not fault,
    // whatever the address; the pointer is formed with `wrapping_add`, defined for any offset.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(
            start.wrapping_add(position + PREFETCH_AHEAD).cast(),
        );
    }
}

/// Other targets get no prefetch.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn prefetch(_start: *const u8, _position: usize, _end: usize, _record_len: usize) {}

/// Where a segment goes when its last lease drops: a local pool, a channel's exclusive set, or
/// the global pool.
pub trait Recycler: Send + Sync + 'static {
    /// The memory the recycler's segments live in.
    fn memory(&self) -> &SegmentMemory;
    /// Takes a segment back. Called from whichever thread dropped the last lease.
    fn recycle(&self, segment: Segment);
}

/// Drops one lease of `index`; the last one hands the segment back.
fn release(recycler: &Arc<dyn Recycler>, state: NonNull<SegmentState>, index: u32) {
    // SAFETY: `state` points into the segment states of the memory `recycler` keeps alive.
    let state = unsafe { state.as_ref() };
    if state.refs.fetch_sub(1, Ordering::Release) == 1 {
        // Pairs with the releases of the other leases: their reads of the segment happen before
        // the next owner's writes.
        fence(Ordering::Acquire);
        recycler.recycle(Segment { index });
    }
}

fn retain(state: NonNull<SegmentState>) {
    // SAFETY: `state` points into the segment states of memory that the caller's lease keeps
    // alive.
    let state = unsafe { state.as_ref() };
    // Relaxed is enough for an increment made by a holder of an existing lease (as in `Arc`).
    let previous = state.refs.fetch_add(1, Ordering::Relaxed);
    if previous >= u32::MAX / 2 {
        // Leases leaked by the billion (`mem::forget`): a count that went on could wrap and
        // recycle the segment under live readers. As `Arc` does, stop the process; a panic
        // could be caught and the increment retried.
        std::process::abort();
    }
    debug_assert!(previous > 0, "a lease taken on a segment nobody holds");
}

struct Owned {
    recycler: Arc<dyn Recycler>,
    segment: Segment,
}

/// A free segment owned by a pool's client, not yet written. Dropping it returns the segment to
/// its recycler; [`PooledSegment::into_builder`] starts writing it.
pub struct PooledSegment {
    owned: Option<Owned>,
}

impl fmt::Debug for PooledSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledSegment")
            .field("index", &self.owned.as_ref().map(|o| o.segment.index))
            .finish()
    }
}

impl PooledSegment {
    pub(crate) fn new(recycler: Arc<dyn Recycler>, segment: Segment) -> Self {
        Self {
            owned: Some(Owned { recycler, segment }),
        }
    }

    /// The segment's handle.
    pub fn index(&self) -> u32 {
        self.owned().segment.index
    }

    /// Payload capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.owned().recycler.memory().segment_size()
    }

    /// Takes the raw token back out, without recycling (for the pool that owns it).
    pub(crate) fn into_segment(mut self) -> Segment {
        self.owned.take().expect("present until consumed").segment
    }

    /// [`into_segment`](Self::into_segment) if the segment is `recycler`'s; else gives it back
    /// untouched (a segment of other memory, which a pool must never take for one of its own:
    /// its index would name a different segment there).
    pub(crate) fn into_segment_of(self, recycler: &Arc<dyn Recycler>) -> Result<Segment, Self> {
        let mine = self.owned.as_ref().is_some_and(|owned| {
            std::ptr::addr_eq(Arc::as_ptr(&owned.recycler), Arc::as_ptr(recycler))
        });
        if mine {
            Ok(self.into_segment())
        } else {
            Err(self)
        }
    }

    /// Starts writing the segment.
    pub fn into_builder(mut self, data_type: DataType) -> BufferBuilder {
        let Owned { recycler, segment } = self.owned.take().expect("present until consumed");
        BufferBuilder::new(recycler, segment, data_type)
    }

    fn owned(&self) -> &Owned {
        self.owned.as_ref().expect("present until consumed")
    }
}

/// Memory of its own for one segment outside the network memory (Flink's unpooled buffers):
/// the segment lives as long as its leases, and its last lease frees it.
struct Unpooled {
    memory: SegmentMemory,
}

impl Recycler for Unpooled {
    fn memory(&self) -> &SegmentMemory {
        &self.memory
    }

    fn recycle(&self, _segment: Segment) {
        // Nothing to give back: the lease that called this drops its `Arc` of the memory next.
    }
}

impl PooledSegment {
    /// A segment of `size` payload bytes mapped for this one use, outside every pool and not
    /// counted in any (its memory is unmapped when its last lease drops). For the rare data
    /// Flink reads into unpooled memory: an incoming event when the whole network memory is in
    /// use.
    pub fn unpooled(size: usize) -> Result<Self, PoolError> {
        // Below the marker's FINISHED bit: a position at or past it would read as finished.
        let size = u32::try_from(size.max(1))
            .ok()
            .filter(|&size| size < FINISHED)
            .ok_or_else(|| PoolError::Allocation {
                bytes: size,
                reason: "larger than a segment can be".to_owned(),
            })?;
        let (memory, free) = SegmentMemory::map(1, size, HEADROOM + size as usize)?;
        let segment = free.pop().expect("one segment was mapped");
        Ok(Self::new(Arc::new(Unpooled { memory }), segment))
    }
}

impl Drop for PooledSegment {
    fn drop(&mut self) {
        if let Some(Owned { recycler, segment }) = self.owned.take() {
            recycler.recycle(segment);
        }
    }
}

/// The single writer of a segment (Flink's `BufferBuilder`): appends bytes, publishes them with
/// [`commit`](Self::commit), and hands out [`BufferConsumer`]s that read what was committed
/// while writing goes on.
pub struct BufferBuilder {
    recycler: Arc<dyn Recycler>,
    payload: NonNull<u8>,
    state: NonNull<SegmentState>,
    index: u32,
    position: u32,
    committed: u32,
    capacity: u32,
    finished: bool,
    data_type: DataType,
}

// SAFETY: `payload` points into memory kept alive by `recycler`; the builder is the segment's
// only writer wherever it runs: every write takes `&mut self`, so a `&BufferBuilder` shared
// with another thread cannot write.
unsafe impl Send for BufferBuilder {}
// SAFETY: every `&self` method only reads the builder's own fields or the atomics.
unsafe impl Sync for BufferBuilder {}

impl fmt::Debug for BufferBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferBuilder")
            .field("index", &self.index)
            .field("position", &self.position)
            .field("capacity", &self.capacity)
            .field("finished", &self.finished)
            .field("data_type", &self.data_type)
            .finish()
    }
}

impl BufferBuilder {
    fn new(recycler: Arc<dyn Recycler>, segment: Segment, data_type: DataType) -> Self {
        let memory = recycler.memory();
        let state = memory.state(segment.index);
        // Not a swap: a segment handed out twice must not have its first owner's count
        // overwritten on the way to the panic.
        if let Err(previous) =
            state
                .refs
                .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed)
        {
            panic!(
                "segment {} handed out twice ({previous} leases)",
                segment.index
            );
        }
        state.marker.store(0, Ordering::Relaxed);
        let capacity = memory.segment_size;
        let payload = memory.payload(segment.index);
        let state = NonNull::from(state);
        Self {
            payload,
            state,
            index: segment.index,
            position: 0,
            committed: 0,
            capacity,
            finished: false,
            data_type,
            recycler,
        }
    }

    /// Copies as much of `bytes` as fits after the current position; returns how many.
    /// The bytes become visible to consumers on the next [`commit`](Self::commit).
    #[inline]
    pub fn append(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.remaining());
        if n > 0 {
            self.assert_writable();
            // SAFETY: `[position, position + n)` lies inside the segment's payload
            // (`n <= capacity - position`), no reader reads at or above the committed position
            // (`committed <= position`), and this builder is the segment's only writer.
            unsafe {
                copy_small(
                    bytes.as_ptr(),
                    self.payload.as_ptr().add(self.position as usize),
                    n,
                )
            }
            self.position += n as u32;
        }
        n
    }

    /// Appends `[length prefix | bytes]` (see [`crate::record`]) and publishes it: a whole
    /// record in one step. The caller checked that it fits
    /// (`remaining() >= record::framed_len(bytes.len())`).
    #[inline(always)]
    pub fn append_framed(&mut self, bytes: &[u8]) {
        let total = crate::record::framed_len(bytes.len());
        assert!(
            total <= self.remaining(),
            "append_framed past the segment's end"
        );
        self.assert_writable();
        // SAFETY: `[position, position + total)` lies inside the payload (checked above), above
        // every published byte, and this builder is the segment's only writer.
        unsafe { write_framed(self.payload.as_ptr().add(self.position as usize), bytes) }
        self.position += total as u32;
        prefetch_for_write(
            self.payload.as_ptr(),
            self.position as usize,
            self.capacity as usize,
            bytes.len(),
        );
        self.commit();
    }

    /// A run of framed appends with the write position kept out of the builder until the
    /// run ends (see [`FramedRun`]); `None` once the builder is finished.
    #[inline]
    pub fn framed_run(&mut self) -> Option<FramedRun<'_>> {
        if self.finished {
            return None;
        }
        // The run publishes everything up to its position: nothing half-written may be
        // there when it opens (see `UnicastRuns`).
        debug_assert_eq!(
            self.committed, self.position,
            "a run over uncommitted bytes"
        );
        Some(FramedRun {
            dst: self.payload,
            position: self.position,
            capacity: self.capacity,
            builder: self,
        })
    }

    /// Appends and publishes in one step; returns the bytes taken.
    pub fn append_and_commit(&mut self, bytes: &[u8]) -> usize {
        let n = self.append(bytes);
        self.commit();
        n
    }

    /// The writable bytes after the current position, e.g. for a socket read. Follow with
    /// [`advance`](Self::advance).
    pub fn unfilled_mut(&mut self) -> &mut [u8] {
        self.assert_writable();
        // SAFETY: the same region `append` writes: inside the payload, above every published
        // byte, and this builder is the only writer; the `&mut self` borrow keeps it unique.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.payload.as_ptr().add(self.position as usize),
                self.remaining(),
            )
        }
    }

    /// Marks `n` bytes after the position as written (after [`unfilled_mut`](Self::unfilled_mut)).
    pub fn advance(&mut self, n: usize) {
        // A finished buffer stays finished: a commit after it would clear the mark.
        self.assert_writable();
        assert!(n <= self.remaining(), "advance past the segment's end");
        self.position += n as u32;
    }

    /// Publishes everything appended so far to consumers.
    #[inline]
    pub fn commit(&mut self) {
        if self.committed != self.position {
            self.committed = self.position;
            self.state().marker.store(self.position, Ordering::Release);
        }
    }

    /// Drops what was appended since the last [`commit`](Self::commit); consumers never saw
    /// it. Returns whether anything was dropped.
    pub fn discard_uncommitted(&mut self) -> bool {
        let dropped = self.position != self.committed;
        self.position = self.committed;
        dropped
    }

    /// Publishes and marks the buffer complete; consumers see it as finished. Idempotent.
    /// Returns the bytes written.
    pub fn finish(&mut self) -> usize {
        if !self.finished {
            self.finished = true;
            self.committed = self.position;
            self.state()
                .marker
                .store(self.position | FINISHED, Ordering::Release);
        }
        self.position as usize
    }

    /// Lowers the capacity (buffer debloating) but never below what is written.
    pub fn trim(&mut self, capacity: usize) {
        let capacity = capacity.min(self.recycler.memory().segment_size()) as u32;
        self.capacity = capacity.max(self.position);
    }

    /// A reader of what is committed from now on.
    pub fn create_consumer(&self) -> BufferConsumer {
        self.consumer_at(self.committed)
    }

    /// A reader of everything committed, from the segment's first byte.
    pub fn create_consumer_from_beginning(&self) -> BufferConsumer {
        self.consumer_at(0)
    }

    fn consumer_at(&self, read: u32) -> BufferConsumer {
        retain(self.state);
        BufferConsumer {
            recycler: self.recycler.clone(),
            payload: self.payload,
            state: self.state,
            index: self.index,
            read,
            data_type: self.data_type,
        }
    }

    /// True when bytes were appended since the last [`commit`](Self::commit): a record is
    /// being written into this buffer.
    pub fn has_uncommitted(&self) -> bool {
        self.position != self.committed
    }

    /// Bytes written (committed or not).
    pub fn written(&self) -> usize {
        self.position as usize
    }

    /// Bytes that still fit.
    #[inline]
    pub fn remaining(&self) -> usize {
        (self.capacity - self.position) as usize
    }

    /// Capacity in bytes (the segment size unless trimmed).
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// True when nothing more fits.
    pub fn is_full(&self) -> bool {
        self.position == self.capacity
    }

    /// True after [`finish`](Self::finish).
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// What the buffer carries.
    pub fn data_type(&self) -> DataType {
        self.data_type
    }

    /// Sets what the buffer carries; consumers created afterwards report it.
    pub fn set_data_type(&mut self, data_type: DataType) {
        self.data_type = data_type;
    }

    /// The segment's handle.
    pub fn segment_index(&self) -> u32 {
        self.index
    }

    #[inline]
    fn state(&self) -> &SegmentState {
        // SAFETY: the states live as long as the memory, which `recycler` keeps alive.
        unsafe { self.state.as_ref() }
    }

    #[inline(always)]
    fn assert_writable(&self) {
        assert!(!self.finished, "write to a finished BufferBuilder");
    }
}

/// Framed records appended to one builder in a loop: the position lives here, where the
/// compiler can keep it in a register (through the builder, every byte stored to the payload
/// might have changed it, so it is loaded and stored again per record), and goes back to the
/// builder, published with one marker store, when the run is published or dropped.
/// Consumers see the run's records only then.
#[derive(Debug)]
pub struct FramedRun<'a> {
    builder: &'a mut BufferBuilder,
    dst: NonNull<u8>,
    position: u32,
    capacity: u32,
}

impl FramedRun<'_> {
    /// Appends `[length prefix | bytes]` if it ends strictly before the buffer's end (a
    /// record filling the buffer exactly is left to the caller's general path, which
    /// finishes the full buffer at once); false, writing nothing, otherwise.
    #[inline(always)]
    pub fn try_append(&mut self, bytes: &[u8]) -> bool {
        let framed = crate::record::framed_len(bytes.len());
        if framed >= (self.capacity - self.position) as usize {
            return false;
        }
        // SAFETY: `[position, position + framed)` lies inside the payload (checked above),
        // above every published byte (the run began at the builder's position, which is at
        // or above its committed one), and the run borrows the segment's only writer: while
        // the `&mut` borrow lasts, nothing else can write, finish or trim the builder (a
        // finished one gives no run), so `capacity` and the position stay the run's.
        unsafe { write_framed(self.dst.as_ptr().add(self.position as usize), bytes) }
        self.position += framed as u32;
        prefetch_for_write(
            self.dst.as_ptr(),
            self.position as usize,
            self.capacity as usize,
            bytes.len(),
        );
        true
    }

    /// Hands the run's position to the builder and publishes it (also when the run drops).
    #[inline]
    pub fn publish(&mut self) {
        self.builder.position = self.position;
        self.builder.commit();
    }
}

impl Drop for FramedRun<'_> {
    fn drop(&mut self) {
        self.publish();
    }
}

impl Drop for BufferBuilder {
    fn drop(&mut self) {
        // Consumers must be able to tell that no more bytes will come.
        self.finish();
        release(&self.recycler, self.state, self.index);
    }
}

/// Reads a segment that a [`BufferBuilder`] may still be writing (Flink's `BufferConsumer`).
pub struct BufferConsumer {
    recycler: Arc<dyn Recycler>,
    payload: NonNull<u8>,
    state: NonNull<SegmentState>,
    index: u32,
    read: u32,
    data_type: DataType,
}

// SAFETY: `payload` is kept alive by `recycler`; a consumer only reads bytes published to it.
unsafe impl Send for BufferConsumer {}
// SAFETY: `&self` methods only load atomics and the consumer's own fields.
unsafe impl Sync for BufferConsumer {}

impl fmt::Debug for BufferConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferConsumer")
            .field("index", &self.index)
            .field("read", &self.read)
            .field("data_type", &self.data_type)
            .finish()
    }
}

impl BufferConsumer {
    /// The bytes committed since the last build, as a buffer; empty when there are none.
    pub fn build(&mut self) -> Buffer {
        let end = self.marker() & !FINISHED;
        let start = self.read;
        self.read = end;
        retain(self.state);
        Buffer {
            recycler: self.recycler.clone(),
            payload: self.payload,
            state: self.state,
            index: self.index,
            offset: start,
            len: end - start,
            data_type: self.data_type,
            compressed: false,
        }
    }

    /// A second reader at the same position (broadcast: one segment, many subpartitions).
    pub fn copy(&self) -> BufferConsumer {
        retain(self.state);
        BufferConsumer {
            recycler: self.recycler.clone(),
            payload: self.payload,
            state: self.state,
            index: self.index,
            read: self.read,
            data_type: self.data_type,
        }
    }

    /// True once the writer has finished (no more bytes will be committed).
    pub fn is_finished(&self) -> bool {
        self.marker() & FINISHED != 0
    }

    /// True when committed bytes wait to be built.
    pub fn is_data_available(&self) -> bool {
        self.marker() & !FINISHED > self.read
    }

    /// The segment this consumer reads (its index in the network memory).
    pub(crate) fn segment_index(&self) -> u32 {
        self.index
    }

    /// Bytes of the segment already built: where the next build starts.
    pub(crate) fn read_position(&self) -> u32 {
        self.read
    }

    /// Committed bytes not yet built.
    pub fn unread_bytes(&self) -> usize {
        ((self.marker() & !FINISHED) - self.read) as usize
    }

    /// Bytes committed so far in the whole segment.
    pub fn written_bytes(&self) -> usize {
        (self.marker() & !FINISHED) as usize
    }

    /// What the buffer carries.
    pub fn data_type(&self) -> DataType {
        self.data_type
    }

    #[inline]
    fn marker(&self) -> u32 {
        // SAFETY: the states live as long as the memory, which `recycler` keeps alive.
        unsafe { self.state.as_ref() }
            .marker
            .load(Ordering::Acquire)
    }
}

impl Drop for BufferConsumer {
    fn drop(&mut self) {
        release(&self.recycler, self.state, self.index);
    }
}

/// A read-only, reference-counted view of committed bytes of one segment (Flink's `Buffer`).
/// Cloning shares the segment; the last drop recycles it.
pub struct Buffer {
    recycler: Arc<dyn Recycler>,
    payload: NonNull<u8>,
    state: NonNull<SegmentState>,
    index: u32,
    offset: u32,
    len: u32,
    data_type: DataType,
    compressed: bool,
}

// SAFETY: `payload` is kept alive by `recycler`; the viewed bytes were published before the
// buffer was built and are never written while any lease exists.
unsafe impl Send for Buffer {}
// SAFETY: `&Buffer` only reads immutable bytes; the headroom needs `&mut Buffer` and `refs == 1`.
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("index", &self.index)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("data_type", &self.data_type)
            .finish()
    }
}

impl Buffer {
    /// The readable bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `[offset, offset + len)` was published by the writer (acquire-loaded marker)
        // before this buffer existed, is inside the payload, and is never written again while
        // this lease keeps the segment from being recycled.
        unsafe {
            std::slice::from_raw_parts(
                self.payload.as_ptr().add(self.offset as usize),
                self.len as usize,
            )
        }
    }

    /// Readable bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when there are no readable bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the buffer carries.
    pub fn data_type(&self) -> DataType {
        self.data_type
    }

    /// Changes what the buffer says it carries (a consumer learns it from the wire).
    pub fn set_data_type(&mut self, data_type: DataType) {
        self.data_type = data_type;
    }

    /// True when the payload is compressed.
    pub fn is_compressed(&self) -> bool {
        self.compressed
    }

    /// Marks the payload as compressed or not.
    pub fn set_compressed(&mut self, compressed: bool) {
        self.compressed = compressed;
    }

    /// The segment's handle.
    pub fn segment_index(&self) -> u32 {
        self.index
    }

    /// Offset of the first readable byte from the segment's payload start.
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// A shared view of `start..start + len` of the readable bytes.
    pub fn slice(&self, start: usize, len: usize) -> Buffer {
        assert!(
            start <= self.len() && len <= self.len() - start,
            "slice out of range"
        );
        retain(self.state);
        Buffer {
            recycler: self.recycler.clone(),
            payload: self.payload,
            state: self.state,
            index: self.index,
            offset: self.offset + start as u32,
            len: len as u32,
            data_type: self.data_type,
            compressed: self.compressed,
        }
    }

    /// The 64 bytes before the payload, when this buffer may write them: it starts at the
    /// payload's first byte and is the segment's only lease. Otherwise `None`, and a frame
    /// header must go in a separate buffer.
    pub fn headroom_mut(&mut self) -> Option<&mut [u8; HEADROOM]> {
        let refs = self
            .recycler
            .memory()
            .state(self.index)
            .refs
            .load(Ordering::Acquire);
        if self.offset != 0 || refs != 1 {
            return None;
        }
        // SAFETY: the headroom lies inside the arena just before the payload; with `refs == 1`
        // this buffer is the only lease (no builder, no other reader), and `&mut self` keeps it
        // from being cloned while the borrow lives.
        Some(unsafe { &mut *self.payload.as_ptr().sub(HEADROOM).cast::<[u8; HEADROOM]>() })
    }

    /// `[headroom | readable bytes]` as one contiguous range, for sending a frame whose header
    /// was written with [`headroom_mut`](Self::headroom_mut).
    pub fn with_headroom(&self) -> &[u8] {
        assert_eq!(
            self.offset, 0,
            "only a buffer at the payload's start has headroom"
        );
        // SAFETY: the range starts HEADROOM bytes before the payload (inside the arena) and
        // covers published bytes; the headroom is only written through `&mut self`, which
        // cannot coexist with this borrow.
        unsafe {
            std::slice::from_raw_parts(
                self.payload.as_ptr().sub(HEADROOM),
                HEADROOM + self.len as usize,
            )
        }
    }

    /// A zero-copy [`bytes::Bytes`] of the readable bytes that keeps the segment leased until
    /// its last clone drops. (Bytes boxes its owner, so this allocates once; not for the hot
    /// path.)
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Clone for Buffer {
    fn clone(&self) -> Self {
        retain(self.state);
        Buffer {
            recycler: self.recycler.clone(),
            payload: self.payload,
            state: self.state,
            index: self.index,
            offset: self.offset,
            len: self.len,
            data_type: self.data_type,
            compressed: self.compressed,
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        release(&self.recycler, self.state, self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hints may be asked for any address (the bytes ahead of a position lie beyond the
    /// slice the caller holds), so they must neither fault nor write: here the fetched line
    /// is null's page, the last byte of the address space, a non-canonical address, and a
    /// line of bytes the test then reads back.
    #[test]
    fn a_prefetch_of_any_address_neither_faults_nor_writes() {
        let bytes = [7u8; PREFETCH_AHEAD + 64];
        for start in [
            std::ptr::null::<u8>(),
            (usize::MAX - PREFETCH_AHEAD) as *const u8,
            (0x8000_0000_0000_0000_u64 as usize).wrapping_sub(PREFETCH_AHEAD) as *const u8,
            bytes.as_ptr(),
        ] {
            for position in [0, 1, 63] {
                for len in [0, 8, PREFETCH_RECORDS_BELOW - 1, PREFETCH_RECORDS_BELOW] {
                    prefetch_for_write(start, position, usize::MAX, len);
                    prefetch_for_read(start, position, usize::MAX, len);
                }
            }
        }
        let bytes = std::hint::black_box(&bytes);
        assert!(bytes.iter().all(|&b| b == 7), "a hint changed memory");
    }
}
