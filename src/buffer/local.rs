//! Local buffer pools: one per result partition and per input gate, each with a guaranteed
//! minimum and a maximum number of segments taken from the global pool.
//!
//! The request and recycle paths are lock-free (bounded `ArrayQueue`s and counters). Only a
//! task that has to *wait* touches a mutex/condvar pair, and a recycler takes it only when the
//! `waiting` counter says someone sleeps there.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::network::NetworkInner;
use super::segment::{
    BufferBuilder, FreeList, PooledSegment, Recycler, Segment, SegmentMemory, NO_CHANNEL,
};
use super::{DataType, PoolError};
use crate::config::NetworkConfig;
use crate::metrics::{WaitSpan, WaitTime};
use crate::sync::{
    fence, ArrayQueue, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, AtomicWaker, Condvar, Mutex,
    Ordering,
};

/// A blocked waiter re-checks at least this often, a safety net should a wake-up ever go
/// astray. Not a polling loop: wake-ups are explicit.
const WAIT_RECHECK: Duration = Duration::from_millis(50);

/// The tag of an overdraft segment: not a channel's, and not part of the pool's count.
const OVERDRAFT: u32 = NO_CHANNEL - 1;

/// Sizes of a local pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPoolSpec {
    /// Segments promised to this pool (admission control against the global pool).
    pub min_segments: usize,
    /// Most segments the pool may hold at once.
    pub max_segments: usize,
    /// Subpartitions whose segments are counted (0: no per-channel accounting); at most
    /// [`MOST_POOL_CHANNELS`](super::MOST_POOL_CHANNELS).
    pub subpartitions: usize,
    /// Most segments one subpartition may hold (`max-buffers-per-channel`).
    pub max_segments_per_channel: usize,
    /// Most buffer listeners waiting at once (an input gate's channel count); at most
    /// [`MOST_POOL_CHANNELS`](super::MOST_POOL_CHANNELS).
    pub max_listeners: usize,
    /// Most overdraft segments (taken outside the quota, for events and for the rest of a
    /// started record) held at once.
    pub max_overdraft_segments: usize,
}

impl LocalPoolSpec {
    /// A result partition's pool, sized as Flink sizes a bounded pipelined partition:
    /// min = subpartitions + 1, max = subpartitions × max(1, buffers-per-channel) +
    /// floating-per-gate (a job without exclusive buffers on its inputs still gives each
    /// output subpartition room for one).
    pub fn for_partition(subpartitions: usize, config: &NetworkConfig) -> Self {
        let min = subpartitions.saturating_add(1);
        let max = subpartitions
            .saturating_mul(config.buffers_per_channel.max(1))
            .saturating_add(config.floating_buffers_per_gate)
            .max(min);
        Self {
            min_segments: min,
            max_segments: max,
            subpartitions,
            max_segments_per_channel: config.max_buffers_per_channel,
            max_listeners: 1,
            // As many events at once as the pool has segments: events for readers that
            // stopped taking cannot take the whole network memory.
            max_overdraft_segments: max,
        }
    }

    /// An input gate's pool: exclusive buffers of every channel plus the floating ones.
    /// min = channels × buffers-per-channel + 1 (one floating buffer always exists),
    /// max = channels × buffers-per-channel + floating-per-gate.
    pub fn for_gate(channels: usize, config: &NetworkConfig) -> Self {
        let exclusive = channels.saturating_mul(config.buffers_per_channel);
        let min = exclusive.saturating_add(1);
        Self {
            min_segments: min,
            max_segments: exclusive
                .saturating_add(config.floating_buffers_per_gate)
                .max(min),
            subpartitions: 0,
            max_segments_per_channel: usize::MAX,
            max_listeners: channels.max(1),
            // Bounded per channel instead: a remote channel takes at most
            // `UNCREDITED_EVENTS` events beyond its credit.
            max_overdraft_segments: usize::MAX,
        }
    }
}

/// Told when a segment comes free in a pool it waits on (how floating buffers reach remote
/// input channels).
pub trait BufferListener: Send + Sync {
    /// A segment for the listener. `Ok` keeps it; `Err` gives it back to be offered elsewhere.
    /// The listener is unregistered by the call and registers again if it wants more, but
    /// not in a call that hands the segment back (it would be offered the same one again,
    /// for good).
    fn on_segment_available(&self, segment: PooledSegment) -> Result<(), PooledSegment>;
    /// The pool was destroyed; no segment will come.
    fn on_pool_destroyed(&self);
}

/// Tells `listener` its pool was destroyed: every listener hears it, whatever one of them
/// does (a panic is logged).
fn tell_destroyed(listener: &dyn BufferListener) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        listener.on_pool_destroyed()
    }))
    .is_err()
    {
        tracing::error!("a buffer listener panicked on its pool's destruction");
    }
}

/// A pool of segments for one result partition or input gate (Flink's `LocalBufferPool`).
/// Dropping it destroys it lazily: segments still in use return to the global pool later.
pub struct LocalBufferPool {
    shared: Arc<LocalPoolShared>,
}

pub(crate) struct LocalPoolShared {
    me: Weak<LocalPoolShared>,
    network: Arc<NetworkInner>,
    spec: LocalPoolSpec,
    /// Segments held here, ready to hand out.
    available: FreeList,
    /// Segments taken from the global pool and not yet given back.
    requested: AtomicUsize,
    /// Segments held per subpartition (leased and not recycled).
    per_channel: Box<[AtomicU32]>,
    /// Subpartitions holding `max-buffers-per-channel` segments or more: while any does, the
    /// pool is unavailable to the task's next record (Flink's
    /// `unavailableSubpartitionsCount`). Counted at the crossings of the limit, so it may
    /// read one off (even wrapped below zero) for the moment a take and a recycle of one
    /// subpartition overlap; only the writer takes, and it looks after its own takes. Not
    /// counted for a limit of 1: that one segment is the subpartition's open buffer, which
    /// its reader cannot give back before the writer finishes it, so a task waiting for it
    /// to come back would wait for good (its next record finishes it instead, and waits in
    /// the write).
    channels_at_limit: AtomicUsize,
    destroyed: AtomicBool,
    listeners: ArrayQueue<Arc<dyn BufferListener>>,
    /// Set while this pool sits in the global pool's starved queue.
    starved: AtomicBool,
    /// Blocked threads plus pending async requests; recyclers wake only when non-zero.
    waiting: AtomicUsize,
    /// A wake-up was sent and no waiter has looked since.
    notified: AtomicBool,
    /// Counts wake-ups given while someone waits: a blocking waiter reads it before it looks
    /// and again, under the lock, before it sleeps, so a wake-up between the two is never
    /// slept through (the look itself runs without the lock).
    wake_epoch: AtomicU64,
    /// Time during which a wait of this pool was under way, blocking or async (the writer's
    /// back-pressured time).
    blocked: WaitTime,
    /// Overdraft segments handed out and not yet recycled.
    overdraft: AtomicUsize,
    wait_lock: Mutex<()>,
    wait_cond: Condvar,
    waker: AtomicWaker,
}

impl fmt::Debug for LocalBufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBufferPool")
            .field("spec", &self.shared.spec)
            .field("requested", &self.requested_segments())
            .field("available", &self.available_segments())
            .field("listeners", &self.listener_count())
            .field("waiting", &self.shared.waiting.load(Ordering::Relaxed))
            .field("starved", &self.shared.starved.load(Ordering::Relaxed))
            .finish()
    }
}

impl LocalBufferPool {
    pub(crate) fn new(network: Arc<NetworkInner>, spec: LocalPoolSpec) -> Self {
        let shared = Arc::new_cyclic(|me| LocalPoolShared {
            me: me.clone(),
            network,
            spec,
            available: FreeList::with_capacity(spec.max_segments),
            requested: AtomicUsize::new(0),
            per_channel: (0..spec.subpartitions).map(|_| AtomicU32::new(0)).collect(),
            channels_at_limit: AtomicUsize::new(0),
            destroyed: AtomicBool::new(false),
            listeners: ArrayQueue::new(spec.max_listeners.max(1)),
            starved: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            notified: AtomicBool::new(false),
            wake_epoch: AtomicU64::new(0),
            blocked: WaitTime::default(),
            overdraft: AtomicUsize::new(0),
            wait_lock: Mutex::new(()),
            wait_cond: Condvar::new(),
            waker: AtomicWaker::new(),
        });
        Self { shared }
    }

    /// The pool as a recycler (where segments requested from it return).
    pub(crate) fn recycler(&self) -> Arc<dyn Recycler> {
        self.shared.clone()
    }

    /// The pool's sizes.
    pub fn spec(&self) -> LocalPoolSpec {
        self.shared.spec
    }

    /// A free segment not counted against any subpartition, if one is at hand now.
    pub fn request_segment(&self) -> Option<PooledSegment> {
        self.try_segment().ok().flatten()
    }

    /// [`request_segment`](Self::request_segment), telling a destroyed pool apart.
    fn try_segment(&self) -> Result<Option<PooledSegment>, PoolError> {
        let segment = self.shared.take(NO_CHANNEL)?;
        Ok(segment.map(|segment| PooledSegment::new(self.shared.clone(), segment)))
    }

    /// A builder for `subpartition`, if a segment is at hand now and the subpartition is under
    /// its `max-buffers-per-channel`.
    pub fn request_buffer_builder(&self, subpartition: usize) -> Option<BufferBuilder> {
        self.try_builder(subpartition).ok().flatten()
    }

    /// A builder for `subpartition`, waiting up to `timeout` for one (the producer's
    /// backpressure). Fails when the pool is destroyed or the time is up.
    pub fn request_buffer_builder_blocking(
        &self,
        subpartition: usize,
        timeout: Duration,
    ) -> Result<BufferBuilder, PoolError> {
        self.request_buffer_builder_blocking_unless(subpartition, timeout, &|| false)
    }

    /// [`request_buffer_builder_blocking`](Self::request_buffer_builder_blocking) that ends
    /// with [`PoolError::Cancelled`] once `cancelled` holds, looked at before each look for a
    /// segment (whoever makes it true wakes this pool's waiters, [`PoolWaiters::wake`]).
    pub(crate) fn request_buffer_builder_blocking_unless(
        &self,
        subpartition: usize,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<BufferBuilder, PoolError> {
        self.wait_for(timeout, || {
            if cancelled() {
                return Err(PoolError::Cancelled);
            }
            self.try_builder(subpartition)
        })
    }

    /// A builder for the rest of a record that `subpartition` already started (Flink's
    /// overdraft buffers, `max-overdraft-buffers-per-gate`): a segment of the pool if one is
    /// at hand, even past `max-buffers-per-channel` (counted all the same, as Flink's pool
    /// hands it out), else one of at most `max_overdraft` taken from the global pool beyond
    /// the pool's quota, so the writer finishes the record instead of stopping inside it
    /// under back pressure. Only with neither does it wait, up to `timeout`, as
    /// [`request_buffer_builder_blocking`](Self::request_buffer_builder_blocking) does. The
    /// writer waits for the pool before a record that needs a new buffer
    /// ([`wait_until_segment_at_hand`](Self::wait_until_segment_at_hand)), so overdraft only
    /// serves a record longer than the segment it found.
    pub fn request_continuation_builder_blocking(
        &self,
        subpartition: usize,
        max_overdraft: usize,
        timeout: Duration,
    ) -> Result<BufferBuilder, PoolError> {
        self.request_continuation_builder_blocking_unless(
            subpartition,
            max_overdraft,
            timeout,
            &|| false,
        )
    }

    /// [`request_continuation_builder_blocking`](Self::request_continuation_builder_blocking)
    /// that ends with [`PoolError::Cancelled`] once `cancelled` holds, as
    /// [`request_buffer_builder_blocking_unless`](Self::request_buffer_builder_blocking_unless).
    pub(crate) fn request_continuation_builder_blocking_unless(
        &self,
        subpartition: usize,
        max_overdraft: usize,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<BufferBuilder, PoolError> {
        let channel = self.shared.channel_tag(subpartition);
        self.wait_for(timeout, || {
            if cancelled() {
                return Err(PoolError::Cancelled);
            }
            let segment = match self.shared.take_past_channel_limit(channel)? {
                Some(segment) => PooledSegment::new(self.shared.clone(), segment),
                None => match self.overdraft_segment_within(max_overdraft) {
                    Some(segment) => segment,
                    None => return Ok(None),
                },
            };
            Ok(Some(segment.into_builder(DataType::DataBuffer)))
        })
    }

    /// Waits up to `timeout` until a segment for `subpartition` is at hand: free in the pool
    /// (taken from the global pool into it if need be) and the subpartition under
    /// `max-buffers-per-channel`. This is Flink's output availability, which a task waits
    /// for before it starts a record: a record that will not fit the open buffer waits here
    /// before its first byte, so it can only need overdraft for segments beyond the one it
    /// found. Returns at once when the pool was destroyed (the write then fails).
    pub fn wait_until_segment_at_hand(
        &self,
        subpartition: usize,
        timeout: Duration,
    ) -> Result<(), PoolError> {
        let channel = self.shared.channel_tag(subpartition);
        self.wait_until(timeout, || self.shared.stock_one(channel).unwrap_or(true))
    }

    /// True when a segment for `subpartition` is at hand now (see
    /// [`wait_until_segment_at_hand`](Self::wait_until_segment_at_hand)).
    pub(crate) fn segment_at_hand(&self, subpartition: usize) -> bool {
        let channel = self.shared.channel_tag(subpartition);
        self.shared.stock_one(channel).unwrap_or(true)
    }

    /// Flink's `LocalBufferPool.isAvailable` for a partition's pool: a segment is at hand
    /// (taken from the global pool into the free list if none was) and no subpartition holds
    /// `max-buffers-per-channel` segments, so the task's next record, wherever it goes, starts
    /// without waiting. True once the pool is destroyed (the write then fails at once).
    pub fn is_available_to_any(&self) -> bool {
        let shared = &self.shared;
        shared.destroyed.load(Ordering::Relaxed)
            || (shared.channels_at_limit.load(Ordering::Relaxed) == 0
                && shared.stock_one(NO_CHANNEL).unwrap_or(true))
    }

    /// A future resolving once [`is_available_to_any`](Self::is_available_to_any) holds (the
    /// partition's single writer's, like [`request_builder`](Self::request_builder)): a
    /// segment recycled, or the global pool refilled while this one was starved, wakes it.
    pub fn until_available_to_any(
        &self,
    ) -> impl Future<Output = Result<(), PoolError>> + Unpin + '_ {
        self.until_ready(move || self.is_available_to_any())
    }

    /// A segment, waiting up to `timeout` while none is free and the pool cannot grow (the
    /// global pool is empty): how a gate takes its channels' exclusive segments, as Flink
    /// waits for them up to `exclusive-buffers-request-timeout-ms`. Fails when the pool is
    /// destroyed or the time is up.
    pub fn request_segment_blocking(&self, timeout: Duration) -> Result<PooledSegment, PoolError> {
        self.request_segment_blocking_unless(timeout, &|| false)
    }

    /// [`request_segment_blocking`](Self::request_segment_blocking) that ends with
    /// [`PoolError::Cancelled`] once `cancelled` holds. It is looked at before each look for
    /// a segment, so whoever makes it true wakes this pool's waiters
    /// ([`PoolWaiters::wake`]) to end the wait at once.
    pub(crate) fn request_segment_blocking_unless(
        &self,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<PooledSegment, PoolError> {
        self.wait_for(timeout, || {
            if cancelled() {
                return Err(PoolError::Cancelled);
            }
            self.try_segment()
        })
    }

    /// Threads waiting in this pool now (for a segment, or for room in a partition's queues).
    pub fn waiting_requests(&self) -> usize {
        self.shared.waiting.load(Ordering::SeqCst)
    }

    /// A segment for an event: one of the pool's, else an overdraft segment, waiting up to
    /// `timeout` while the pool and its overdraft are both used up. Woken by the return of
    /// either kind. Fails when the pool is destroyed or the time is up.
    pub fn request_event_segment_blocking(
        &self,
        timeout: Duration,
    ) -> Result<PooledSegment, PoolError> {
        self.wait_for(timeout, || {
            Ok(self
                .try_segment()?
                .or_else(|| self.request_overdraft_segment()))
        })
    }

    /// Runs `attempt` until it yields, waiting between attempts for a segment to come back.
    fn wait_for<T>(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut() -> Result<Option<T>, PoolError>,
    ) -> Result<T, PoolError> {
        if let Some(found) = attempt()? {
            return Ok(found);
        }
        let shared = &self.shared;
        let started = Instant::now();
        // A timeout too long for the clock waits without a deadline.
        let deadline = started.checked_add(timeout);
        shared.waiting.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `wake_waiters`: either a give-back's wake-up sees this
        // waiter, or the look below sees what it gave back.
        fence(Ordering::SeqCst);
        let _unregister = WaitingGuard {
            waiting: &shared.waiting,
            _blocked: shared.blocked.span(),
        };
        loop {
            // The look runs without the lock: it may give a segment back to the global pool,
            // which can wake this very pool's waiters (the pool was registered as starved),
            // and with the lock held here that wake-up would take it again on this thread.
            let epoch = shared.wake_epoch.load(Ordering::SeqCst);
            if let Some(found) = attempt()? {
                return Ok(found);
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Err(PoolError::Timeout(timeout));
            }
            let wait = deadline.map_or(WAIT_RECHECK, |deadline| (deadline - now).min(WAIT_RECHECK));
            let guard = shared.wait_lock.lock().expect("not poisoned");
            // A wake-up since the look counted the epoch up before it looked at `notified`:
            // either this sees the new epoch (look again), or that wake-up finds `notified`
            // cleared, takes the lock, and so waits until this thread sleeps to wake it.
            shared.notified.store(false, Ordering::SeqCst);
            // Pairs with the second fence in `wake_waiters`.
            fence(Ordering::SeqCst);
            if shared.wake_epoch.load(Ordering::SeqCst) != epoch {
                continue;
            }
            drop(
                shared
                    .wait_cond
                    .wait_timeout(guard, wait)
                    .expect("not poisoned"),
            );
        }
    }

    /// A future resolving to a builder for `subpartition`, usable from any executor. One
    /// pending future per pool at a time (the partition's single writer).
    pub fn request_builder(&self, subpartition: usize) -> RequestBuilder<'_> {
        RequestBuilder {
            wait: AsyncWait::new(self),
            subpartition,
        }
    }

    /// [`request_builder`](Self::request_builder) that ends with [`PoolError::Cancelled`] once
    /// `cancelled` holds, looked at before each look for a segment (whoever makes it true
    /// wakes this pool's waiters, [`PoolWaiters::wake`]).
    pub(crate) fn request_builder_unless<C: Fn() -> bool + Unpin>(
        &self,
        subpartition: usize,
        cancelled: C,
    ) -> RequestBuilderUnless<'_, C> {
        RequestBuilderUnless {
            wait: AsyncWait::new(self),
            subpartition,
            cancelled,
        }
    }

    /// Waits up to `timeout` until `ready` holds. Woken by whatever wakes a blocked request,
    /// and by [`PoolWaiters::wake`] for state the pool does not own (a partition's writer
    /// waiting for room in a subpartition's queue). Fails when the pool is destroyed or the
    /// time is up.
    pub(crate) fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), PoolError> {
        self.wait_for(timeout, || self.ready_unless_destroyed(&mut ready))
    }

    /// [`wait_until`](Self::wait_until) as a future (no timeout; the partition's single
    /// writer's, like [`request_builder`](Self::request_builder)).
    pub(crate) fn until_ready<F: FnMut() -> bool + Unpin>(&self, ready: F) -> UntilReady<'_, F> {
        UntilReady {
            wait: AsyncWait::new(self),
            ready,
        }
    }

    fn ready_unless_destroyed(
        &self,
        ready: &mut impl FnMut() -> bool,
    ) -> Result<Option<()>, PoolError> {
        if self.is_destroyed() {
            return Err(PoolError::Destroyed);
        }
        Ok(ready().then_some(()))
    }

    /// What wakes this pool's waiters, for a holder of state they wait on besides the pool's.
    pub(crate) fn waiters(&self) -> PoolWaiters {
        PoolWaiters(self.shared.clone())
    }

    /// A segment now (`Some`, the listener is *not* registered), or else (`None`) `listener`
    /// is registered and gets the next free segment through
    /// [`BufferListener::on_segment_available`].
    pub fn request_segment_or_listen(
        &self,
        listener: &Arc<dyn BufferListener>,
    ) -> Result<Option<PooledSegment>, PoolError> {
        let shared = &self.shared;
        if let Some(segment) = shared.take(NO_CHANNEL)? {
            return Ok(Some(PooledSegment::new(shared.clone(), segment)));
        }
        shared
            .listeners
            .push(listener.clone())
            .map_err(|_| PoolError::TooManyListeners)?;
        // A segment recycled between the first attempt and the registration went to the free
        // list, not to a listener: hand it to the listeners now. (A destroyed pool is told to
        // its listeners below, this one included.)
        if let Ok(Some(segment)) = shared.take(NO_CHANNEL) {
            shared.place(segment);
        }
        if shared.destroyed.load(Ordering::SeqCst) {
            // `destroy` may have told the listeners before this one was queued: tell them now,
            // or it stays queued (and its pool with it: listeners hold their pool).
            while let Some(listener) = shared.listeners.pop() {
                tell_destroyed(&*listener);
            }
            return Err(PoolError::Destroyed);
        }
        Ok(None)
    }

    /// True when a request for `subpartition` would succeed now (best effort).
    pub fn is_available(&self, subpartition: usize) -> bool {
        let shared = &self.shared;
        let under_channel_limit = shared.per_channel.get(subpartition).is_none_or(|c| {
            (c.load(Ordering::Relaxed) as usize) < shared.spec.max_segments_per_channel
        });
        under_channel_limit
            && (shared.available.len() > 0
                || shared.requested.load(Ordering::Relaxed) < shared.spec.max_segments)
    }

    /// Segments taken from the global pool and not yet returned.
    pub fn requested_segments(&self) -> usize {
        self.shared.requested.load(Ordering::Relaxed)
    }

    /// Segments held here and free.
    pub fn available_segments(&self) -> usize {
        self.shared.available.len()
    }

    /// Buffer listeners registered and not yet told of a segment (one per remote channel
    /// waiting for a floating buffer at most).
    pub fn listener_count(&self) -> usize {
        self.shared.listeners.len()
    }

    /// Segments leased out now.
    pub fn in_use_segments(&self) -> usize {
        self.requested_segments()
            .saturating_sub(self.available_segments())
    }

    /// Segments `subpartition` holds now.
    pub fn segments_of(&self, subpartition: usize) -> usize {
        self.shared
            .per_channel
            .get(subpartition)
            .map_or(0, |c| c.load(Ordering::Relaxed) as usize)
    }

    /// Leased segments over the pool's maximum (Flink's `outPoolUsage` / `inPoolUsage`).
    pub fn usage(&self) -> f64 {
        self.in_use_segments() as f64 / self.shared.spec.max_segments as f64
    }

    /// Total nanoseconds during which a request waited for a segment, or the partition's writer
    /// for room in a subpartition's queue, blocking or as a future (back pressure); the wait
    /// under way counts up to now.
    pub fn blocked_nanos(&self) -> u64 {
        u64::try_from(self.shared.blocked.total().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A segment outside the pool's quota, straight from the global pool (Flink's overdraft
    /// buffer), for an item that must not wait behind back pressure (an event). `None` when
    /// the pool already holds `max_overdraft_segments` of them or the global pool is empty.
    /// It goes back to the global pool when dropped, and wakes this pool's waiters then: an
    /// event that found the overdraft used up waits on this pool.
    pub fn request_overdraft_segment(&self) -> Option<PooledSegment> {
        self.overdraft_segment_within(self.shared.spec.max_overdraft_segments)
    }

    /// An overdraft segment while the pool holds fewer than `limit` (and fewer than its
    /// `max_overdraft_segments`); see [`request_overdraft_segment`](Self::request_overdraft_segment).
    fn overdraft_segment_within(&self, limit: usize) -> Option<PooledSegment> {
        let shared = &self.shared;
        let limit = limit.min(shared.spec.max_overdraft_segments);
        // SeqCst, with the recycler's decrement and `notified` (see `recycle`): a waiter that
        // cleared `notified` before this look sees a decrement whose wake-up it missed.
        if shared.overdraft.load(Ordering::SeqCst) >= limit {
            return None;
        }
        // Taken before it is counted. Counted first, a segment the global pool did not have
        // was counted and then uncounted, with no wake-up: an event woken meanwhile (by a
        // give-back to the global pool) looked, found the overdraft used up and slept, with
        // the overdraft free again and the segment in the global pool. With the global pool
        // empty, an event waiting for this overdraft is woken when the global pool refills,
        // not only by a recycle here or its wait's periodic re-check.
        let segment = shared
            .network
            .take()
            .or_else(|| shared.listen_for_global_then_take())?;
        let mut held = shared.overdraft.load(Ordering::SeqCst);
        loop {
            if held >= limit {
                // Another request took the last overdraft segment meanwhile; the segment goes
                // back to the global pool, which wakes the pools starved for one.
                shared.network.give_back(segment);
                return None;
            }
            match shared.overdraft.compare_exchange_weak(
                held,
                held + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(current) => held = current,
            }
        }
        shared.network.memory().set_tag(&segment, OVERDRAFT);
        Some(PooledSegment::new(shared.clone(), segment))
    }

    /// Overdraft segments held now.
    pub fn overdraft_segments(&self) -> usize {
        self.shared.overdraft.load(Ordering::Relaxed)
    }

    /// True once destroyed.
    #[inline]
    pub fn is_destroyed(&self) -> bool {
        self.shared.destroyed.load(Ordering::SeqCst)
    }

    /// Destroys the pool: free segments go back to the global pool now, leased ones when their
    /// last lease drops; listeners and waiters are told. Idempotent.
    pub fn destroy(&self) {
        self.shared.destroy();
    }

    fn try_builder(&self, subpartition: usize) -> Result<Option<BufferBuilder>, PoolError> {
        let channel = self.shared.channel_tag(subpartition);
        let Some(segment) = self.shared.take(channel)? else {
            return Ok(None);
        };
        Ok(Some(
            PooledSegment::new(self.shared.clone(), segment).into_builder(DataType::DataBuffer),
        ))
    }
}

impl Drop for LocalBufferPool {
    fn drop(&mut self) {
        self.shared.destroy();
    }
}

/// Unregisters a blocked waiter; its wait ends as the span drops.
struct WaitingGuard<'a> {
    waiting: &'a AtomicUsize,
    _blocked: WaitSpan,
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wakes the waiters of one pool (see [`LocalBufferPool::waiters`]).
#[derive(Clone)]
pub(crate) struct PoolWaiters(Arc<LocalPoolShared>);

impl PoolWaiters {
    /// Wakes every blocked waiter and the pending future, which then look again.
    pub(crate) fn wake(&self) {
        self.0.wake_waiters();
    }

    /// True while a thread or a future waits on the pool.
    pub(crate) fn any_waiting(&self) -> bool {
        self.0.waiting.load(Ordering::SeqCst) > 0
    }

    /// The pool's waits so far, the one under way included.
    pub(crate) fn blocked_time(&self) -> Duration {
        self.0.blocked.total()
    }
}

/// The registration of a pending future of a pool: its waker is the pool's, and it counts
/// among the pool's waiters (so recyclers wake it) until it is dropped; from its first
/// `Pending` to then it is back-pressured time, as a blocking wait is.
struct AsyncWait<'a> {
    pool: &'a LocalBufferPool,
    /// Its wait, from when the future first registered (it then counts in `waiting`).
    registered: Option<WaitSpan>,
}

impl<'a> AsyncWait<'a> {
    fn new(pool: &'a LocalBufferPool) -> Self {
        Self {
            pool,
            registered: None,
        }
    }

    /// `attempt`, else registers the task's waker and attempts once more: a recycle or wake-up
    /// in between either saw the waker or left what the second attempt finds.
    fn poll<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut attempt: impl FnMut(&LocalBufferPool) -> Result<Option<T>, PoolError>,
    ) -> Poll<Result<T, PoolError>> {
        if let Some(found) = attempt(self.pool)? {
            return Poll::Ready(Ok(found));
        }
        let shared = &self.pool.shared;
        shared.waker.register(cx.waker());
        shared.notified.store(false, Ordering::SeqCst);
        if self.registered.is_none() {
            self.registered = Some(shared.blocked.span());
            shared.waiting.fetch_add(1, Ordering::SeqCst);
        }
        // Pairs with the fences in `wake_waiters`: either a give-back's wake-up sees this
        // waiter registered with `notified` clear, or the look below sees what it gave back.
        fence(Ordering::SeqCst);
        match attempt(self.pool)? {
            Some(found) => Poll::Ready(Ok(found)),
            None => Poll::Pending,
        }
    }
}

impl Drop for AsyncWait<'_> {
    fn drop(&mut self) {
        if self.registered.take().is_some() {
            self.pool.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Future of [`LocalBufferPool::request_builder`].
pub struct RequestBuilder<'a> {
    wait: AsyncWait<'a>,
    subpartition: usize,
}

impl fmt::Debug for RequestBuilder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestBuilder")
            .field("subpartition", &self.subpartition)
            .finish()
    }
}

impl Future for RequestBuilder<'_> {
    type Output = Result<BufferBuilder, PoolError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let subpartition = self.subpartition;
        self.wait.poll(cx, |pool| pool.try_builder(subpartition))
    }
}

/// Future of [`LocalBufferPool::request_builder_unless`].
pub(crate) struct RequestBuilderUnless<'a, C> {
    wait: AsyncWait<'a>,
    subpartition: usize,
    cancelled: C,
}

impl<C: Fn() -> bool + Unpin> Future for RequestBuilderUnless<'_, C> {
    type Output = Result<BufferBuilder, PoolError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let (subpartition, cancelled) = (this.subpartition, &this.cancelled);
        this.wait.poll(cx, |pool| {
            if cancelled() {
                return Err(PoolError::Cancelled);
            }
            pool.try_builder(subpartition)
        })
    }
}

/// Future of [`LocalBufferPool::until_ready`].
pub(crate) struct UntilReady<'a, F> {
    wait: AsyncWait<'a>,
    ready: F,
}

impl<F: FnMut() -> bool + Unpin> Future for UntilReady<'_, F> {
    type Output = Result<(), PoolError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let ready = &mut this.ready;
        this.wait
            .poll(cx, |pool| pool.ready_unless_destroyed(ready))
    }
}

impl LocalPoolShared {
    /// A free segment for `channel`: from the local free list, else grown from the global
    /// pool up to the maximum. `Ok(None)` when none is at hand now.
    fn take(&self, channel: u32) -> Result<Option<Segment>, PoolError> {
        if !self.under_channel_limit(channel)? {
            return Ok(None);
        }
        self.take_past_channel_limit(channel)
    }

    /// Whether `channel` may take one more segment (`max-buffers-per-channel`); fails once
    /// the pool is destroyed.
    fn under_channel_limit(&self, channel: u32) -> Result<bool, PoolError> {
        if self.destroyed.load(Ordering::Relaxed) {
            return Err(PoolError::Destroyed);
        }
        Ok(self
            .per_channel
            .get(channel as usize)
            .is_none_or(|counter| {
                (counter.load(Ordering::Relaxed) as usize) < self.spec.max_segments_per_channel
            }))
    }

    /// [`take`](Self::take) without the per-channel limit (the segment still counts for
    /// `channel`): the rest of a started record, as Flink's pool hands it out and only marks
    /// itself unavailable.
    fn take_past_channel_limit(&self, channel: u32) -> Result<Option<Segment>, PoolError> {
        if self.destroyed.load(Ordering::Relaxed) {
            return Err(PoolError::Destroyed);
        }
        let counter = self.per_channel.get(channel as usize);
        let Some(segment) = self.available.pop().or_else(|| self.grow()) else {
            return Ok(None);
        };
        if let Some(counter) = counter {
            let held = counter.fetch_add(1, Ordering::Relaxed) as usize + 1;
            if held == self.spec.max_segments_per_channel && held > 1 {
                self.channels_at_limit.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.network.memory().set_tag(&segment, channel);
        Ok(Some(segment))
    }

    /// True when a segment for `channel` is at hand: the channel under its limit and a
    /// segment free here, taken from the global pool into the free list if none was.
    fn stock_one(&self, channel: u32) -> Result<bool, PoolError> {
        if !self.under_channel_limit(channel)? {
            return Ok(false);
        }
        if self.available.len() > 0 {
            return Ok(true);
        }
        let Some(segment) = self.grow() else {
            return Ok(false);
        };
        // The free list holds every segment the pool may have (`grow` counted this one
        // against the maximum).
        if let Err(segment) = self.available.push(segment) {
            self.give_back(segment);
            return Ok(false);
        }
        // A concurrent `destroy` may have drained the free list before the push landed (as
        // in `place`): nothing would give this segment back.
        if self.destroyed.load(Ordering::SeqCst) {
            self.drain_available();
            return Err(PoolError::Destroyed);
        }
        Ok(true)
    }

    /// Takes one more segment from the global pool if under the maximum.
    fn grow(&self) -> Option<Segment> {
        if !self.reserve_one() {
            return None;
        }
        if let Some(segment) = self.network.take() {
            return Some(segment);
        }
        self.requested.fetch_sub(1, Ordering::Relaxed);
        let segment = self.listen_for_global_then_take()?;
        // Counted against the maximum again: another thread may have grown the pool to it
        // since the count was given back above.
        if self.reserve_one() {
            Some(segment)
        } else {
            self.network.give_back(segment);
            None
        }
    }

    /// After a take from the empty global pool: asks to be told when it refills (this pool's
    /// waiters are woken then), then looks once more, since a segment given back between the
    /// failed take and the registration would otherwise wake no one.
    fn listen_for_global_then_take(&self) -> Option<Segment> {
        if !self.starved.swap(true, Ordering::SeqCst) {
            self.network.register_starved(self.me.clone());
        }
        self.network.take()
    }

    /// The tag a segment for `subpartition` carries: its index, or `NO_CHANNEL` for none of
    /// this pool's subpartitions (a large index must not read back as another tag, such as
    /// the overdraft's).
    fn channel_tag(&self, subpartition: usize) -> u32 {
        u32::try_from(subpartition)
            .ok()
            .filter(|_| subpartition < self.per_channel.len())
            .unwrap_or(NO_CHANNEL)
    }

    /// Counts one more segment taken from the global pool, unless the pool is at its maximum.
    fn reserve_one(&self) -> bool {
        // SeqCst: a registering listener's second look must see a give-back's decrement, or
        // that give-back see the listener (`place`).
        let mut requested = self.requested.load(Ordering::SeqCst);
        loop {
            if requested >= self.spec.max_segments {
                return false;
            }
            match self.requested.compare_exchange_weak(
                requested,
                requested + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(current) => requested = current,
            }
        }
    }

    /// Called by the global pool when a segment came back while this pool was starved.
    pub(crate) fn on_global_available(&self) {
        self.starved.store(false, Ordering::SeqCst);
        if self.destroyed.load(Ordering::SeqCst) {
            return;
        }
        // Every listener waiting, not only the first: the pool was queued as starved once
        // for all of them, and the segments given back after this one wake no pool that is
        // not queued. Bounded: each round hands a segment to a listener (which the offer
        // unregisters) or ends when the global pool has none (`grow` queues this pool as
        // starved again, for the next give-back) or this pool is at its maximum.
        for _ in 0..self.spec.max_segments {
            if self.listeners.is_empty() || self.destroyed.load(Ordering::SeqCst) {
                break;
            }
            let Some(segment) = self.grow() else {
                break;
            };
            self.place(segment);
        }
        self.wake_waiters();
    }

    /// Offers a free segment to the listeners, else keeps it or gives it back to the global
    /// pool when the pool holds more than its minimum.
    fn place(&self, mut segment: Segment) {
        loop {
            let Some(free) = self.offer_to_listeners(segment) else {
                return;
            };
            if self.destroyed.load(Ordering::SeqCst)
                || self.requested.load(Ordering::Relaxed) > self.spec.min_segments
            {
                self.give_back(free);
                // A waiter of this pool can now grow from the global pool again.
                self.wake_waiters();
                // So can a listener that registered after `offer_to_listeners` looked: its
                // second look found the pool at its maximum, before `give_back` made room.
                // The count's decrement (SeqCst) before this look, and the registration
                // before that second look's read of the count (SeqCst, in `grow`; the
                // listener queue's push and is_empty are SeqCst inside crossbeam), make one
                // of the two see the other. Bounded: every listener offered a segment is
                // unregistered by the offer.
                if !self.destroyed.load(Ordering::SeqCst) && !self.listeners.is_empty() {
                    if let Some(grown) = self.grow() {
                        segment = grown;
                        continue;
                    }
                }
                return;
            }
            // Kept: under the minimum, so it stays this pool's, but not this segment. It was
            // just read on another core (the consumer, or the kernel's send copy), so its cache
            // lines sit in that core's cache; the next writer here would pay a cross-core
            // invalidation per line, which made a local 1→1 exchange up to three times slower
            // than one writing into segments that have been free longest. The global pool
            // hands out instead one that waited behind others (its `give_back` says how long).
            let free = self.network.exchange(free);
            if let Err(free) = self.available.push(free) {
                self.give_back(free);
                break;
            }
            // A listener that registered after `offer_to_listeners` looked found the free list
            // still without this segment (it looks once more after registering, before this
            // push): look at the listeners again after the push, or it waits for the next
            // recycle with a segment free here (the loom model
            // `local_pool_listener_races_recycle`). Bounded: every listener offered a segment
            // is unregistered by the offer.
            if self.listeners.is_empty() {
                break;
            }
            let Some(free) = self.available.pop() else {
                break; // someone took it: a request or the listener's own second look
            };
            segment = free;
        }
        // A concurrent `destroy` may have drained the free list before the push landed.
        if self.destroyed.load(Ordering::SeqCst) {
            self.drain_available();
        }
        self.wake_waiters();
    }

    fn offer_to_listeners(&self, mut segment: Segment) -> Option<Segment> {
        if self.listeners.is_empty() {
            return Some(segment);
        }
        let me: Arc<dyn Recycler> = self.me.upgrade()?;
        while let Some(listener) = self.listeners.pop() {
            let offered = segment.index();
            self.network.memory().set_tag(&segment, NO_CHANNEL);
            let offer = PooledSegment::new(me.clone(), segment);
            // The listener is a consumer's code, run on whichever thread gave a segment back
            // (another pool's task, an I/O thread): its panic costs its own offer only, not
            // that thread, nor the other listeners and waiters this give-back serves.
            let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                listener.on_segment_available(offer)
            }));
            let Ok(answer) = answer else {
                // The offer went back as the panic unwound (and was offered on from there),
                // unless the listener stored it first.
                tracing::error!("a buffer listener panicked");
                return None;
            };
            match answer {
                Ok(()) => return None,
                Err(rejected) if rejected.index() == offered => {
                    match rejected.into_segment_of(&me) {
                        Ok(returned) => segment = returned,
                        // Not this pool's: the listener kept the one offered and handed back
                        // another, which goes back to its own pool as it drops.
                        Err(foreign) => {
                            drop(foreign);
                            return None;
                        }
                    }
                }
                // Another segment of this pool: the listener kept the one offered. The one
                // handed back goes back as it drops, as what its tag says it is (an overdraft
                // segment, a subpartition's), not as the one offered, or the counts go wrong.
                Err(other) => {
                    drop(other);
                    return None;
                }
            }
        }
        Some(segment)
    }

    fn give_back(&self, segment: Segment) {
        // SeqCst: pairs with `grow`'s first read (see `place`).
        self.requested.fetch_sub(1, Ordering::SeqCst);
        self.network.give_back(segment);
    }

    fn wake_waiters(&self) {
        // One wake-up per wait: a burst of recycles (a whole `writev` of buffers) makes one
        // futex call, not one each. A blocking waiter clears `notified` under the lock just
        // before it sleeps, an async one before it looks again.
        // The fences pair with the waiters' (`wait_for`, `AsyncWait::poll`): what was given
        // back is published by queues and counters that are not all SeqCst, so the SeqCst
        // accesses to `waiting` and `notified` alone do not order it against a waiter's look
        // (and loom, which models SeqCst loads and stores as acquire and release only, finds
        // the lost wake-up). With them, this give-back or the waiter's look sees the other.
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.wake_epoch.fetch_add(1, Ordering::SeqCst);
        // Either the waiter's look after clearing `notified` sees the new epoch, or this
        // swap sees `notified` cleared and wakes it.
        fence(Ordering::SeqCst);
        if !self.notified.swap(true, Ordering::SeqCst) {
            drop(self.wait_lock.lock().expect("not poisoned"));
            self.wait_cond.notify_all();
            self.waker.wake();
        }
    }

    fn drain_available(&self) {
        while let Some(segment) = self.available.pop() {
            self.give_back(segment);
        }
    }

    fn destroy(&self) {
        if self.destroyed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.drain_available();
        while let Some(listener) = self.listeners.pop() {
            tell_destroyed(&*listener);
        }
        self.network.forget_promise(self.spec.min_segments);
        self.wake_epoch.fetch_add(1, Ordering::SeqCst);
        drop(self.wait_lock.lock().expect("not poisoned"));
        self.wait_cond.notify_all();
        self.waker.wake();
    }
}

impl Recycler for LocalPoolShared {
    fn memory(&self) -> &SegmentMemory {
        self.network.memory()
    }

    fn recycle(&self, segment: Segment) {
        let tag = self.network.memory().tag(&segment);
        if tag == OVERDRAFT {
            // Counted down before the give-back, which may wake a starved pool's waiter at
            // once, and before the wake-up of this pool's (an event waiting for overdraft).
            self.overdraft.fetch_sub(1, Ordering::SeqCst);
            self.network.give_back(segment);
            self.wake_waiters();
            return;
        }
        if let Some(counter) = self.per_channel.get(tag as usize) {
            let held = counter.fetch_sub(1, Ordering::Relaxed) as usize;
            if held == self.spec.max_segments_per_channel && held > 1 {
                // Published to a waiting writer by the fences of `place`'s wake-up.
                self.channels_at_limit.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.place(segment);
    }
}
