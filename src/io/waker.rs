//! The parked flag of an I/O thread and its wake-up, apart from the drivers so loom can check
//! the protocol with the signal (eventfd / mio waker write) replaced by a closure.

use std::fmt;
use std::sync::Arc;
use std::task::Wake;
use std::thread;
use std::time::{Duration, Instant};

use crate::sync::{ArrayQueue, AtomicBool, Ordering};

/// The hand-off between task threads and one I/O thread: the "parked" flag and the wake-up
/// signal (`wake`: an eventfd or mio waker write in the drivers, a closure in the loom
/// models). The I/O thread parks with [`IoWaker::prepare_park`] and [`IoWaker::unpark`];
/// anyone with new work for it calls [`IoWaker::wake_if_parked`] (directly, through
/// [`IoWaker::submit`] or as a `std::task::Waker`), which signals only a parked thread, so the
/// busy path makes no syscall.
///
/// Why no wake-up is lost: the I/O thread stores `parked = true` and then looks for work; a
/// waker publishes its work and then loads `parked`. All four are SeqCst (the work queues'
/// `push` / `is_empty` too), so either the I/O thread's look sees the work, or the waker's
/// load comes after the store in the single SeqCst order and sees `parked` (the Dekker
/// pattern). `tests/loom.rs` checks it with this type and the real queue code.
pub struct IoWaker<W: Fn() + Send + Sync> {
    parked: AtomicBool,
    /// The I/O thread's loop has ended: nobody takes commands any more.
    stopped: AtomicBool,
    /// A submit found the command queue full for all of [`SUBMIT_PATIENCE`], and none has
    /// found room since: the thread is taken as stuck, and a submit that finds the queue
    /// full gives up at once rather than waiting its patience out again (creating a gate
    /// with many remote channels would wait that long per channel).
    stuck: AtomicBool,
    /// The thread is to end at its next turn: set when not even the shutdown command found
    /// room in its queue (a stuck thread), so it still ends once it comes back to its loop.
    shutdown_requested: AtomicBool,
    wake: W,
}

impl<W: Fn() + Send + Sync> fmt::Debug for IoWaker<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoWaker")
            .field("parked", &self.parked.load(Ordering::Relaxed))
            .finish()
    }
}

impl<W: Fn() + Send + Sync> IoWaker<W> {
    /// A running (not parked) thread's waker that signals with `wake`.
    pub fn new(wake: W) -> Self {
        Self {
            parked: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            stuck: AtomicBool::new(false),
            shutdown_requested: AtomicBool::new(false),
            wake,
        }
    }

    /// The I/O thread is about to sleep: announces it, then runs `recheck`, its last look for
    /// work (command queue, ready queues, registering its waker where work can appear). Returns
    /// what `recheck` returned: true means work raced in and the thread must not sleep (or
    /// sleep with a zero timeout). Either way [`IoWaker::unpark`] follows the sleep.
    pub fn prepare_park(&self, recheck: impl FnOnce() -> bool) -> bool {
        // SeqCst: ordered before the loads in `recheck` (see the type's docs).
        self.parked.store(true, Ordering::SeqCst);
        recheck()
    }

    /// The I/O thread is awake again: wakers stop signalling.
    pub fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
    }

    /// The end of an I/O thread's turn: it keeps polling while `busy_poll` says so, else it
    /// parks through [`IoWaker::prepare_park`] with `recheck`. [`IoWaker::end_wait`] follows
    /// the wait (a zero-timeout look unless [`IdleWait::Sleep`]).
    pub(crate) fn prepare_wait(
        &self,
        busy_poll: &mut BusyPoll,
        now: Instant,
        recheck: impl FnOnce() -> bool,
    ) -> IdleWait {
        if busy_poll.look_again(now) {
            IdleWait::Poll
        } else if self.prepare_park(recheck) {
            IdleWait::Raced
        } else {
            IdleWait::Sleep
        }
    }

    /// The I/O thread is back from `wait`: unparks it if it had parked.
    pub(crate) fn end_wait(&self, wait: IdleWait) {
        if wait != IdleWait::Poll {
            self.unpark();
        }
    }

    /// Signals the I/O thread if it is parked. Call it after publishing the work. Only the
    /// first waker of a parked thread makes the syscall: its compare-exchange clears the flag.
    pub fn wake_if_parked(&self) {
        // The plain load keeps the busy path (not parked) free of a cache-line write.
        //
        // A compare-exchange, not `swap(false)`: a waker that loses the race (the flag already
        // cleared by another waker or by `unpark`) writes nothing. Same values on real
        // hardware, but loom does not enforce RMW atomicity in its modification order: it
        // keeps a losing swap's `false` unordered with the I/O thread's later
        // `parked = true`, and lets a waker that happens after that store read the stale
        // `false` (a deadlock `tests/loom.rs` reported at 5 preemptions; see the model).
        if self.parked.load(Ordering::SeqCst)
            && self
                .parked
                .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            (self.wake)();
        }
    }

    /// A task thread hands `command` to the I/O thread through its bounded `queue` and wakes
    /// it if parked. Blocks (bounded) only if the queue is full; gives the command back when
    /// the queue stayed full for [`SUBMIT_PATIENCE`] (the I/O thread is stuck: until the queue
    /// has room again, later submits give up as soon as they find it full) or the thread
    /// has [stopped](Self::stop). A command it queued may still meet a thread that stopped
    /// meanwhile: [`take_back_if_stopped`](Self::take_back_if_stopped) says.
    pub fn submit<T>(&self, queue: &ArrayQueue<T>, command: T) -> Result<(), T> {
        self.submit_unless(queue, command, || false)
    }

    /// [`submit`](Self::submit), giving up (and handing the command back) as soon as
    /// `give_up` says so between attempts: for a submitter whose own work may be cancelled.
    pub fn submit_unless<T>(
        &self,
        queue: &ArrayQueue<T>,
        mut command: T,
        give_up: impl Fn() -> bool,
    ) -> Result<(), T> {
        // Bounded in time (and, should the clock stall, in count): the I/O thread drains the
        // queue every loop turn. Timed, not counted: on a loaded machine each 1 ms sleep may
        // take several, and whoever waits for the command relies on the patience.
        let deadline = Instant::now() + SUBMIT_PATIENCE;
        for _ in 0..1_000_000 {
            if give_up() || self.is_stopped() {
                return Err(command);
            }
            if Instant::now() >= deadline {
                self.stuck.store(true, Ordering::Relaxed);
                return Err(command);
            }
            match queue.push(command) {
                Ok(()) => {
                    if self.stuck.load(Ordering::Relaxed) {
                        self.stuck.store(false, Ordering::Relaxed);
                    }
                    self.wake_if_parked();
                    return Ok(());
                }
                Err(back) if self.stuck.load(Ordering::Relaxed) => {
                    // Still full since a submit waited its patience out: still stuck.
                    self.wake_if_parked();
                    return Err(back);
                }
                Err(back) => {
                    command = back;
                    // A full queue is drained as soon as the thread runs; make sure it does.
                    self.wake_if_parked();
                    thread::sleep(Duration::from_millis(1));
                }
            }
        }
        Err(command)
    }
}

/// How long [`IoWaker::submit`] waits for room in a full command queue before it gives up
/// (the I/O thread is taken as stuck).
#[cfg(not(test))]
pub const SUBMIT_PATIENCE: Duration = Duration::from_secs(10);
#[cfg(test)]
pub const SUBMIT_PATIENCE: Duration = Duration::from_millis(100);

impl<W: Fn() + Send + Sync> IoWaker<W> {
    /// The I/O thread's loop has ended, by shutdown or because an OS error stopped it: from
    /// now on [`submit`](Self::submit) refuses commands, and each one still in `queue` goes
    /// to `refuse` (a channel waiting to connect must fail, not wait for good).
    pub fn stop<T>(&self, queue: &ArrayQueue<T>, mut refuse: impl FnMut(T)) {
        // SeqCst, before the pops: against a submitter's push and then its load of `stopped`
        // (the Dekker pattern of `parked` again), either these pops find its command or
        // its `take_back_if_stopped` sees the flag.
        self.stopped.store(true, Ordering::SeqCst);
        // Bounded: the queue is bounded and nobody queues once `stopped` shows.
        while let Some(command) = queue.pop() {
            refuse(command);
        }
    }

    /// Asks the I/O thread to end at its next turn without a command (its queue has no room
    /// for one), and wakes it if it sleeps.
    pub fn request_shutdown(&self) {
        self.shutdown_requested.store(true, Ordering::SeqCst);
        self.wake_if_parked();
    }

    /// Whether [`request_shutdown`](Self::request_shutdown) was called: the loop ends.
    pub fn is_shutdown_requested(&self) -> bool {
        self.shutdown_requested.load(Ordering::SeqCst)
    }

    /// Whether the I/O thread has [stopped](Self::stop).
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Call after [`submit`](Self::submit) queued a command: if the thread stopped meanwhile,
    /// its last look at `queue` may have come before the push, so every command left there
    /// goes to `refuse` and this returns true (the command will not run).
    pub fn take_back_if_stopped<T>(
        &self,
        queue: &ArrayQueue<T>,
        mut refuse: impl FnMut(T),
    ) -> bool {
        if !self.is_stopped() {
            return false;
        }
        // Bounded as in `stop`.
        while let Some(command) = queue.pop() {
            refuse(command);
        }
        true
    }
}

impl<W: Fn() + Send + Sync> Wake for IoWaker<W> {
    fn wake(self: Arc<Self>) {
        self.wake_if_parked();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_if_parked();
    }
}

/// How an I/O thread waits once it runs out of work
/// (`fluxgate.network.io-thread.busy-poll-us`).
///
/// With no window (the default) it parks at once, and the next piece of work pays a wake-up:
/// a syscall by the waker and, on a virtual machine whose idle vCPU halted, tens of
/// microseconds before the thread runs. With a window it keeps looking (a zero-timeout poll
/// each turn, without announcing itself parked, so wakers make no syscall) until the window
/// has passed since its last work. After a turn that found nothing it yields its CPU before
/// looking again, so the CPU never halts and a thread sharing it gets turns; but a yielding
/// thread still takes its fair share of a CPU that another thread keeps busy, which is the
/// cost of the option.
#[derive(Debug)]
pub(crate) struct BusyPoll {
    window: Duration,
    last_work: Instant,
    /// Work since the last look: look again without yielding.
    worked_since_look: bool,
}

impl BusyPoll {
    /// An idle strategy that keeps looking for `window` after the last work.
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            window,
            last_work: Instant::now(),
            worked_since_look: false,
        }
    }

    /// The thread did some work at `now`: the window starts again.
    pub(crate) fn worked(&mut self, now: Instant) {
        if !self.window.is_zero() {
            self.last_work = now;
            self.worked_since_look = true;
        }
    }

    /// Whether the thread should look for work again instead of parking. When it should and
    /// its last turn found nothing, it has first yielded its CPU (a busy turn looks again at
    /// once: a `sched_yield` per turn of a busy thread would only cost a syscall).
    pub(crate) fn look_again(&mut self, now: Instant) -> bool {
        if self.window.is_zero() || now.saturating_duration_since(self.last_work) >= self.window {
            return false;
        }
        if !std::mem::take(&mut self.worked_since_look) {
            thread::yield_now();
        }
        true
    }
}

/// How an I/O thread waits at the end of a turn ([`IoWaker::prepare_wait`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdleWait {
    /// Busy-polling: it looks again at once, not announced as parked.
    Poll,
    /// Announced as parked, but work raced the announcement: it looks again at once.
    Raced,
    /// Parked with nothing to do: it sleeps until woken or its next deadline.
    Sleep,
}

impl IdleWait {
    /// Whether the thread must look again without sleeping (a zero timeout).
    pub(crate) fn at_once(self) -> bool {
        self != IdleWait::Sleep
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{BusyPoll, IoWaker};
    use crate::sync::ArrayQueue;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// A thread that stopped taking commands costs the first submit to its full queue its
    /// patience, and each later one a single look until the queue has room again: a gate
    /// with many remote channels waited the patience out once per channel.
    #[test]
    fn submits_to_a_stuck_thread_wait_their_patience_out_once() {
        let looks = AtomicUsize::new(0);
        let waker = IoWaker::new(|| {
            looks.fetch_add(1, Ordering::Relaxed);
        });
        let queue = ArrayQueue::new(1);
        waker.submit(&queue, 0).unwrap();
        // Parked, so that every look at the full queue signals (and counts).
        let park = || waker.prepare_park(|| false);
        let submit_parked = |command| {
            let looks_before = looks.load(Ordering::Relaxed);
            let submitted = waker.submit_unless(&queue, command, || {
                park();
                false
            });
            (submitted, looks.load(Ordering::Relaxed) - looks_before)
        };
        let (first, first_looks) = submit_parked(1);
        assert_eq!(first, Err(1), "the queue stayed full");
        assert!(first_looks > 1, "the first submit waited: {first_looks}");
        let (second, second_looks) = submit_parked(2);
        assert_eq!(second, Err(2));
        assert_eq!(second_looks, 1, "the next submit looked once");
        // Room again: the thread is no longer taken as stuck.
        assert_eq!(queue.pop(), Some(0));
        waker.submit(&queue, 3).unwrap();
        let (third, third_looks) = submit_parked(4);
        assert_eq!(third, Err(4));
        assert!(third_looks > 1, "a submit after room was found waits again");
    }

    #[test]
    fn without_a_window_the_thread_parks_at_once() {
        let mut busy_poll = BusyPoll::new(Duration::ZERO);
        let now = Instant::now();
        busy_poll.worked(now);
        assert!(!busy_poll.look_again(now));
    }

    #[test]
    fn the_thread_looks_again_until_the_window_has_passed_since_its_last_work() {
        let window = Duration::from_micros(300);
        let mut busy_poll = BusyPoll::new(window);
        let start = Instant::now();
        busy_poll.worked(start);
        assert!(busy_poll.look_again(start));
        assert!(busy_poll.look_again(start + window - Duration::from_nanos(1)));
        assert!(!busy_poll.look_again(start + window));
        // New work opens a new window.
        busy_poll.worked(start + window);
        assert!(busy_poll.look_again(start + window + window / 2));
        assert!(!busy_poll.look_again(start + window * 2));
    }
}
