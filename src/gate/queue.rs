//! The gate's queue of channels with data: two bounded lock-free lanes (priority, data) of
//! channel indexes with an "enqueued" flag per channel and lane, so a channel sits in a lane
//! at most once, plus the wake-up of a reader waiting for any channel.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::task::Waker;
use std::time::Duration;

use crate::buffer::PoolWaiters;
use crate::partition::AvailabilityListener;
use crate::sync::{
    fence, ArrayQueue, AtomicBool, AtomicUsize, AtomicWaker, Condvar, Mutex, Ordering,
};

/// Shared between the gate (its one reader) and every thread that notifies a channel.
pub struct ChannelQueue {
    data: ArrayQueue<u32>,
    priority: ArrayQueue<u32>,
    in_data: Box<[AtomicBool]>,
    in_priority: Box<[AtomicBool]>,
    closed: AtomicBool,
    /// Blocked reader threads; notifiers take the lock to wake them only if non-zero.
    waiting: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
    waker: AtomicWaker,
    /// A union gate's queue, told (with this gate's index) whenever a channel is queued here.
    parent: OnceLock<(Arc<ChannelQueue>, u32)>,
    /// A channel received an aligned barrier with a timeout (Flink's `EventAnnouncement`)
    /// that the gate's barrier handler has not looked at yet: the read looks at the channels
    /// only when this is set.
    announced: AtomicBool,
    /// The gate's pool, whose waiters (a setup waiting for exclusive segments) a close wakes.
    /// A lock, not a `OnceLock`: a close that finds it empty has set `closed` before the
    /// setup's store here, so the setup's wait sees `closed` when it looks.
    pool_waiters: Mutex<Option<PoolWaiters>>,
    /// A gate's queue, whose data wake-ups a [`hold_wakes`] may hold; not the protocol's
    /// ready queues ([`ChannelQueueHandle`]), whose owner (an I/O thread, perhaps another
    /// one) sends credit and requests and must not wait for this thread's reads.
    holdable: bool,
}

impl fmt::Debug for ChannelQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelQueue")
            .field("data", &self.data.len())
            .field("priority", &self.priority.len())
            .finish()
    }
}

impl ChannelQueue {
    pub fn new(channels: usize) -> Arc<Self> {
        Self::with_holdable(channels, true)
    }

    fn with_holdable(channels: usize, holdable: bool) -> Arc<Self> {
        let flags = || (0..channels).map(|_| AtomicBool::new(false)).collect();
        Arc::new(Self {
            data: ArrayQueue::new(channels.max(1)),
            priority: ArrayQueue::new(channels.max(1)),
            in_data: flags(),
            in_priority: flags(),
            closed: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
            waker: AtomicWaker::new(),
            parent: OnceLock::new(),
            announced: AtomicBool::new(false),
            pool_waiters: Mutex::new(None),
            holdable,
        })
    }

    /// A channel of this gate received an aligned barrier with a timeout (called before the
    /// channel is queued, so the read it wakes sees this). Wakes the reader itself: behind
    /// data the channel is queued already, so the enqueue that follows wakes no one, and a
    /// task whose output is back-pressured reads priority events only. Woken, it starts the
    /// alignment's timer, or moves the barrier ahead of the data when its checkpoint runs
    /// unaligned. Once per such barrier; a reader of a union is woken through the union.
    pub fn announce(&self) {
        self.announced.store(true, Ordering::Release);
        self.wake_readers();
    }

    /// Wakes whoever reads this queue (through the union it reports to, if any) without
    /// queueing anything: they look at what changed besides the lanes.
    fn wake_readers(&self) {
        // Pairs with a reader's look after it counts itself waiting or registers its waker.
        fence(Ordering::SeqCst);
        match self.parent.get() {
            Some((parent, _)) => parent.wake_readers(),
            None => self.wake_after_fence(),
        }
    }

    /// Whether a channel announced a barrier since the last call.
    pub fn take_announced(&self) -> bool {
        self.announced.load(Ordering::Relaxed) && self.announced.swap(false, Ordering::AcqRel)
    }

    /// Puts `channel` at the tail of a lane unless it is already in it, and wakes a waiting
    /// reader (for data on a gate, perhaps at the end of this thread's [`hold_wakes`]; a
    /// priority event, which is to overtake, at once). Called from any thread.
    pub fn enqueue(self: &Arc<Self>, channel: u32, priority: bool) {
        let (lane, flags) = if priority {
            (&self.priority, &self.in_priority)
        } else {
            (&self.data, &self.in_data)
        };
        let Some(flag) = flags.get(channel as usize) else {
            return;
        };
        if flag.swap(true, Ordering::AcqRel) {
            return;
        }
        if lane.push(channel).is_err() {
            unreachable!("a lane holds each channel at most once and has room for all");
        }
        if let Some((parent, gate)) = self.parent.get() {
            parent.enqueue(*gate, priority);
            return;
        }
        // No union yet: one being built may have set its link since, and then reads this
        // gate once without having seen the push. The fences (this one and the one in
        // `set_parent`) order push-then-look against link-then-read (store buffering): one
        // of the two sees the other's write. The same fence serves the wake-up below.
        fence(Ordering::SeqCst);
        match self.parent.get() {
            Some((parent, gate)) => parent.enqueue(*gate, priority),
            None => {
                if priority || !self.holdable || !held::hold(self) {
                    self.wake_after_fence();
                }
            }
        }
    }

    /// Makes this gate's queue report to a union gate's queue as entry `gate`. The union
    /// reads the gate once after this (see `enqueue` for why that read finds every channel
    /// queued without a link).
    pub fn set_parent(&self, parent: Arc<ChannelQueue>, gate: u32) {
        let _ = self.parent.set((parent, gate));
        fence(Ordering::SeqCst);
    }

    /// The next channel to read: priority lane first, then the data lane (FIFO: a channel that
    /// still has data goes back to the tail, so none starves).
    pub fn pop(&self) -> Option<(u32, bool)> {
        if let Some(channel) = self.priority.pop() {
            Self::clear(&self.in_priority[channel as usize]);
            return Some((channel, true));
        }
        let channel = self.data.pop()?;
        Self::clear(&self.in_data[channel as usize]);
        Some((channel, false))
    }

    /// The next channel queued for a priority event, leaving the data lane alone.
    pub fn pop_priority(&self) -> Option<u32> {
        let channel = self.priority.pop()?;
        Self::clear(&self.in_priority[channel as usize]);
        Some(channel)
    }

    /// Clears a popped channel's "enqueued" flag before the reader looks at the channel.
    ///
    /// An RMW, not a plain store: a notifier that publishes data and then finds the flag still
    /// set (and so does not queue the channel) wrote its `swap(true)` just before this clear
    /// in the flag's modification order; only an acquiring RMW is guaranteed to read that
    /// write and so see the data the reader is about to look for. A release store could be
    /// followed by a read of the channel that misses the data (the store-buffering pattern),
    /// leaving data in a channel that is in no lane: the lost notification the loom model
    /// `channel_queue_notify_races_pop_and_requeue` finds with `store(false, Release)`.
    fn clear(flag: &AtomicBool) {
        flag.swap(false, Ordering::AcqRel);
    }

    /// Lane lengths and the channels whose "enqueued" flags are set (diagnostics).
    pub fn debug_summary(&self) -> String {
        let set = |flags: &[AtomicBool]| -> Vec<usize> {
            (0..flags.len())
                .filter(|&i| flags[i].load(Ordering::Relaxed))
                .collect()
        };
        format!(
            "data lane {} (flags {:?}) priority lane {} (flags {:?}) closed {}",
            self.data.len(),
            set(&self.in_data),
            self.priority.len(),
            set(&self.in_priority),
            self.is_closed()
        )
    }

    /// True when a channel waits in either lane.
    pub fn has_channels(&self) -> bool {
        !self.priority.is_empty() || !self.data.is_empty()
    }

    /// True when a channel waits in the priority lane.
    pub fn has_priority(&self) -> bool {
        !self.priority.is_empty()
    }

    /// Makes [`close`](Self::close) wake `waiters` too.
    pub(crate) fn wake_on_close(&self, waiters: PoolWaiters) {
        *self.pool_waiters.lock().expect("not poisoned") = Some(waiters);
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        drop(self.lock.lock().expect("not poisoned"));
        self.cond.notify_all();
        self.waker.wake();
        let pool_waiters = self.pool_waiters.lock().expect("not poisoned").take();
        if let Some(waiters) = pool_waiters {
            waiters.wake();
        }
        // A union reads its members only when they are queued: queue this one there, so the
        // union's reader reads it, and its read reports the close.
        if let Some((parent, gate)) = self.parent.get() {
            parent.enqueue(*gate, false);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Blocks until a channel is queued, the queue is closed, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let guard = self.lock.lock().expect("not poisoned");
        // Checked under the lock a notifier must take: no wake-up slips between check and wait.
        if !self.has_channels() && !self.is_closed() {
            let _ = self
                .cond
                .wait_timeout(guard, timeout)
                .expect("not poisoned");
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Registers an async reader to be woken by the next enqueue. Returns true if a channel is
    /// already queued (no need to wait).
    pub fn register_waker(&self, waker: &Waker) -> bool {
        // An enqueue pushes before it wakes; AtomicWaker orders a later registration after
        // that wake, so this look sees the channel if the wake-up was missed.
        self.waker.register(waker);
        self.has_channels() || self.is_closed()
    }

    /// Wakes a waiting reader, once the caller ran a SeqCst fence after its push: that fence
    /// pairs with the increment of `waiting` before a reader's last look.
    fn wake_after_fence(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            drop(self.lock.lock().expect("not poisoned"));
            self.cond.notify_all();
        }
        self.waker.wake();
    }
}

/// The listener a channel's data source calls: it queues the channel at the gate.
pub(crate) struct ChannelNotifier {
    pub(crate) queue: Arc<ChannelQueue>,
    pub(crate) channel: u32,
}

impl AvailabilityListener for ChannelNotifier {
    fn notify_data_available(&self) {
        self.queue.enqueue(self.channel, false);
    }

    fn notify_priority_event(&self) {
        self.queue.enqueue(self.channel, true);
    }
}

/// The queue as another layer uses it: a deduplicated FIFO of slot numbers filled from any
/// thread, drained by one owner, with a waker for that owner (the protocol's ready queues).
#[derive(Clone, Debug)]
pub struct ChannelQueueHandle(Arc<ChannelQueue>);

impl ChannelQueueHandle {
    pub fn new(capacity: usize) -> Self {
        Self(ChannelQueue::with_holdable(capacity, false))
    }

    pub fn enqueue(&self, slot: u32) {
        self.0.enqueue(slot, false);
    }

    pub fn enqueue_priority(&self, slot: u32) {
        self.0.enqueue(slot, true);
    }

    pub fn pop(&self) -> Option<u32> {
        self.0.pop().map(|(slot, _)| slot)
    }

    pub fn capacity(&self) -> usize {
        self.0.in_data.len()
    }

    pub fn is_empty(&self) -> bool {
        !self.0.has_channels()
    }

    pub fn register_waker(&self, waker: &Waker) -> bool {
        self.0.register_waker(waker)
    }

    /// A listener that queues `slot` here when its source has data.
    pub fn notifier(&self, slot: u32) -> Arc<dyn AvailabilityListener> {
        Arc::new(ChannelNotifier {
            queue: self.0.clone(),
            channel: slot,
        })
    }
}

/// Holds back, until the returned guard drops, the wake-ups this thread's enqueues of data
/// owe to readers waiting on a gate (not those of priority events, nor of the protocol's
/// ready queues). An I/O thread takes it around its reads (epoll: one socket's read loop;
/// io_uring: one turn's completions and read-on rounds, of all its connections), and gives
/// what it holds every `READS_PER_WAKE` reads: a reader that drained its gate is then woken
/// once for several buffers, not once per buffer (each wake-up of a sleeping reader costs a
/// futex call on both sides and, on a guest whose idle vCPU halts, a halted vCPU's wake;
/// measured in the README under the 1 KiB figures). A short read ends an epoll read loop,
/// so a lone buffer's reader waits only for the rest of that loop, or under io_uring for
/// the rest of the turn's completions and the read-on rounds of sockets still full. Nested
/// holds are one hold, ended by the outermost guard.
pub fn hold_wakes() -> WakeHold {
    WakeHold {
        outermost: held::begin(),
        _not_send: std::marker::PhantomData,
    }
}

/// Gives the wake-ups this thread's hold kept so far and goes on holding (nothing without a
/// hold): a long read loop calls it every so many reads, so the reader of its first buffer
/// does not wait for the whole loop.
pub fn give_held_wakes() {
    held::give(false);
}

/// See [`hold_wakes`]. Neither `Send` nor `Sync`: the hold belongs to the thread.
#[derive(Debug)]
pub struct WakeHold {
    outermost: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for WakeHold {
    fn drop(&mut self) {
        if self.outermost {
            held::give(true);
        }
    }
}

/// The hold is a thread-local (loom's under `--cfg loom`, so the models in `tests/loom.rs`
/// explore a held wake-up against a reader's wait).
mod held {
    use std::cell::RefCell;
    use std::sync::Arc;

    use super::ChannelQueue;

    /// Distinct queues one hold keeps; a further queue's wake-up is given at once. One gate
    /// per consuming task is the common case; this bound keeps the hold allocation-free.
    pub(super) const CAPACITY: usize = 16;

    struct Held {
        active: bool,
        len: usize,
        queues: [Option<Arc<ChannelQueue>>; CAPACITY],
    }

    const IDLE: Held = Held {
        active: false,
        len: 0,
        queues: [const { None }; CAPACITY],
    };

    #[cfg(not(loom))]
    std::thread_local! {
        static HELD: RefCell<Held> = const { RefCell::new(IDLE) };
    }

    #[cfg(loom)]
    loom::thread_local! {
        static HELD: RefCell<Held> = RefCell::new(IDLE);
    }

    /// Starts a hold unless one is on; true if this call started it.
    pub(super) fn begin() -> bool {
        HELD.with(|held| !std::mem::replace(&mut held.borrow_mut().active, true))
    }

    /// Takes over the wake-up `queue` owes if a hold is on; false if the caller must wake.
    /// The caller's SeqCst fence after its push is what the later wake-up relies on: the
    /// reader's `waiting` increment is either seen then or was made after that fence, in
    /// which case the reader's own look sees the push.
    pub(super) fn hold(queue: &Arc<ChannelQueue>) -> bool {
        HELD.try_with(|held| {
            let Ok(mut held) = held.try_borrow_mut() else {
                return false;
            };
            if !held.active {
                return false;
            }
            let len = held.len;
            if held.queues[..len]
                .iter()
                .flatten()
                .any(|kept| Arc::ptr_eq(kept, queue))
            {
                return true;
            }
            if len == CAPACITY {
                return false;
            }
            held.queues[len] = Some(Arc::clone(queue));
            held.len = len + 1;
            true
        })
        .unwrap_or(false)
    }

    /// Gives the wake-ups the hold kept (and ends it if `end`), outside the thread-local's
    /// borrow: a waker may run code that enqueues again, which is then held again, or woken
    /// at once after the end.
    pub(super) fn give(end: bool) {
        let mut kept = [const { None }; CAPACITY];
        let len = HELD.with(|held| {
            let mut held = held.borrow_mut();
            if end {
                held.active = false;
            }
            std::mem::swap(&mut kept, &mut held.queues);
            std::mem::take(&mut held.len)
        });
        // Every kept wake-up is given even if one panics (a poisoned lock, a user's waker):
        // the first panic goes on after the others, unless the thread is unwinding already
        // (a hold dropped by a panic), where a second one would abort the process.
        let mut first_panic = None;
        for queue in kept[..len].iter().flatten() {
            let woken =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| queue.wake_after_fence()));
            if let Err(panic) = woken {
                first_panic.get_or_insert(panic);
            }
        }
        if let Some(panic) = first_panic {
            if !std::thread::panicking() {
                std::panic::resume_unwind(panic);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::task::{Wake, Waker};
    use std::time::Duration;

    use super::{give_held_wakes, hold_wakes, ChannelQueue};

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A queue with an async reader registered, and that reader's wake-up count.
    fn watched_queue() -> (Arc<ChannelQueue>, Arc<CountingWaker>) {
        let queue = ChannelQueue::new(2);
        let woken = Arc::new(CountingWaker::default());
        assert!(!queue.register_waker(&Waker::from(woken.clone())));
        (queue, woken)
    }

    fn wakes(woken: &CountingWaker) -> usize {
        woken.0.load(Ordering::SeqCst)
    }

    #[test]
    fn an_enqueue_wakes_at_once_without_a_hold() {
        let (queue, woken) = watched_queue();
        queue.enqueue(0, false);
        assert_eq!(wakes(&woken), 1);
    }

    #[test]
    fn a_priority_event_and_a_ready_queue_wake_at_once_under_a_hold() {
        let (queue, woken) = watched_queue();
        let ready = super::ChannelQueueHandle::new(1);
        let ready_woken = Arc::new(CountingWaker::default());
        assert!(!ready.register_waker(&Waker::from(ready_woken.clone())));
        let hold = hold_wakes();
        queue.enqueue(0, true);
        assert_eq!(wakes(&woken), 1, "a priority event overtakes: not held");
        ready.enqueue(0);
        assert_eq!(wakes(&ready_woken), 1, "a ready queue's owner is not held");
        drop(hold);
    }

    #[test]
    fn a_union_s_wake_up_is_held_too() {
        let member = ChannelQueue::new(1);
        let (union, woken) = watched_queue();
        member.set_parent(union.clone(), 1);
        let hold = hold_wakes();
        member.enqueue(0, false);
        assert_eq!(wakes(&woken), 0);
        drop(hold);
        assert_eq!(wakes(&woken), 1);
        assert_eq!(union.pop(), Some((1, false)));
    }

    #[test]
    fn a_hold_keeps_a_queue_once_however_often_it_is_enqueued() {
        // One queue enqueued again and again, and then as many others as a hold keeps less
        // one: if the first took a place per enqueue, the others would not fit, and their
        // wake-ups would be given at once.
        let (again, again_woken) = watched_queue();
        let others: Vec<_> = (1..super::held::CAPACITY)
            .map(|_| watched_queue())
            .collect();
        let hold = hold_wakes();
        for _ in 0..super::held::CAPACITY + 4 {
            again.enqueue(0, false);
            assert_eq!(again.pop(), Some((0, false)));
        }
        for (queue, _) in &others {
            queue.enqueue(0, false);
        }
        assert_eq!(wakes(&again_woken), 0);
        assert!(others.iter().all(|(_, woken)| wakes(woken) == 0));
        drop(hold);
        assert_eq!(wakes(&again_woken), 1);
        assert!(others.iter().all(|(_, woken)| wakes(woken) == 1));
    }

    struct PanickingWaker;

    impl Wake for PanickingWaker {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }

    #[test]
    fn a_panicking_wake_up_leaves_none_of_the_others_ungiven() {
        let panicking = ChannelQueue::new(1);
        assert!(!panicking.register_waker(&Waker::from(Arc::new(PanickingWaker))));
        let (queue, woken) = watched_queue();
        let hold = hold_wakes();
        panicking.enqueue(0, false);
        queue.enqueue(0, false);
        let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(hold)));
        assert!(ended.is_err(), "the waker's panic goes on");
        assert_eq!(wakes(&woken), 1, "the wake-up after it was given");
    }

    #[test]
    fn a_held_wake_up_is_given_once_when_the_hold_ends() {
        let (queue, woken) = watched_queue();
        let hold = hold_wakes();
        queue.enqueue(0, false);
        queue.enqueue(1, false);
        assert_eq!(wakes(&woken), 0, "held while the hold is on");
        drop(hold);
        assert_eq!(wakes(&woken), 1);
        assert_eq!(queue.pop(), Some((0, false)));
        assert_eq!(queue.pop(), Some((1, false)));
        // The hold is over: the next enqueue wakes at once again.
        assert!(!queue.register_waker(&Waker::from(woken.clone())));
        queue.enqueue(0, false);
        assert_eq!(wakes(&woken), 2);
    }

    #[test]
    fn a_hold_gives_what_it_held_when_asked_and_holds_on() {
        let (queue, woken) = watched_queue();
        let hold = hold_wakes();
        queue.enqueue(0, false);
        give_held_wakes();
        assert_eq!(wakes(&woken), 1, "given when asked");
        assert_eq!(queue.pop(), Some((0, false)));
        assert!(!queue.register_waker(&Waker::from(woken.clone())));
        queue.enqueue(0, false);
        assert_eq!(wakes(&woken), 1, "still held after giving");
        drop(hold);
        assert_eq!(wakes(&woken), 2);
    }

    #[test]
    fn a_nested_hold_ends_with_the_outermost() {
        let (queue, woken) = watched_queue();
        let outer = hold_wakes();
        drop(hold_wakes());
        queue.enqueue(0, false);
        drop(hold_wakes());
        assert_eq!(wakes(&woken), 0);
        drop(outer);
        assert_eq!(wakes(&woken), 1);
    }

    #[test]
    fn a_hold_wakes_the_queues_beyond_its_capacity_at_once_and_the_rest_at_its_end() {
        let watched: Vec<_> = (0..super::held::CAPACITY + 2)
            .map(|_| watched_queue())
            .collect();
        let hold = hold_wakes();
        for (queue, _) in &watched {
            queue.enqueue(0, false);
        }
        let (kept, beyond) = watched.split_at(super::held::CAPACITY);
        assert!(kept.iter().all(|(_, woken)| wakes(woken) == 0));
        assert!(beyond.iter().all(|(_, woken)| wakes(woken) == 1));
        drop(hold);
        assert!(watched.iter().all(|(_, woken)| wakes(woken) == 1));
    }

    /// The scheduler's state of a thread of this process (`S`: asleep), from `/proc`.
    fn thread_state(tid: i32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        // `pid (comm) state …`: the name may hold spaces and parentheses, the state follows
        // the last parenthesis.
        stat[stat.rfind(')')? + 1..].trim_start().chars().next()
    }

    #[test]
    fn the_end_of_a_hold_wakes_a_blocked_reader() {
        let queue = ChannelQueue::new(1);
        let (done, finished) = mpsc::channel();
        let (told_tid, tid) = mpsc::channel();
        let reader = {
            let queue = queue.clone();
            std::thread::spawn(move || {
                // `/proc/thread-self` links to `PID/task/TID`.
                let link = std::fs::read_link("/proc/thread-self").expect("procfs");
                let tid: i32 = link
                    .file_name()
                    .and_then(|name| name.to_str()?.parse().ok())
                    .expect("a thread id");
                let _ = told_tid.send(tid);
                // Bounded: a reader nobody wakes comes back only after an hour, and the
                // assertion below has long failed by then.
                while !queue.has_channels() {
                    queue.wait(Duration::from_secs(3600));
                }
                let _ = done.send(());
            })
        };
        // Asleep in its wait (counted as waiting, and off the CPU): only a wake-up ends it.
        let tid = tid
            .recv_timeout(Duration::from_secs(60))
            .expect("the reader's id");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let asleep = || queue.waiting.load(Ordering::SeqCst) > 0 && thread_state(tid) == Some('S');
        while !asleep() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(asleep(), "the reader sleeps in its wait");
        let hold = hold_wakes();
        queue.enqueue(0, false);
        drop(hold);
        assert!(
            finished.recv_timeout(Duration::from_secs(60)).is_ok(),
            "the reader was woken when the hold ended"
        );
        reader.join().expect("reader");
    }
}
