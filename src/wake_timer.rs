//! Wakes a pending future when something time-based comes due: a future has no clock, and
//! nothing else would wake it then.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::time::{Duration, Instant};

/// Longest one wait of the timer thread: a due time decoded from a peer's barrier may lie
/// centuries ahead, and a wait that long is better taken in pieces.
const LONGEST_WAIT: Duration = Duration::from_secs(3600);

/// Wakes the task that polled last at a due time: a gate's async read when a partition
/// request's retry or an alignment's timeout comes due, a partition's async emit when its
/// aligned barrier's timeout does. One timer thread per owner at most, waiting for the
/// earliest due time asked for: an earlier one re-arms it, a later one waits behind it (the
/// task, woken, asks again). The thread ends once nothing is due, or once the owner (the gate,
/// the partition, and the futures holding a clone) is gone; the path is taken only while
/// such a thing is pending. The owner keeps it, not the future: a future dropped while
/// pending (the other branch of a `select!` won) leaves the armed timer known to the next,
/// which it wakes.
#[derive(Clone, Debug, Default)]
pub(crate) struct WakeTimer(Arc<Owner>);

/// What the owner's handles share; dropping the last one ends the thread.
#[derive(Debug, Default)]
struct Owner(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<TimerState>,
    /// Told when the due time moved earlier or the owner went.
    changed: Condvar,
}

#[derive(Debug, Default)]
struct TimerState {
    /// The earliest due time asked for and not yet woken for.
    due: Option<Instant>,
    /// The task of the last pending future.
    waker: Option<Waker>,
    /// A timer thread runs.
    running: bool,
    /// Every handle was dropped: the thread ends.
    closed: bool,
    /// Timer threads started, for the tests.
    #[cfg(test)]
    started: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, TimerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The timer thread: wakes the task at each due time, until nothing is due or the owner
    /// is gone.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            if state.closed {
                state.running = false;
                return;
            }
            let Some(due) = state.due else {
                state.running = false;
                return;
            };
            let now = Instant::now();
            if due <= now {
                state.due = None;
                let waker = state.waker.clone();
                drop(state);
                if let Some(waker) = waker {
                    // A waker that panics must not end the thread with `running` set: no
                    // later due time would be waited for.
                    let woken =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
                    if woken.is_err() {
                        tracing::error!("a task's waker panicked; the wake timer goes on");
                    }
                }
                state = self.lock();
                continue;
            }
            let wait = (due - now).min(LONGEST_WAIT);
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.changed.notify_all();
    }
}

impl WakeTimer {
    /// Makes sure `waker` is woken at `due` (or earlier, for an earlier due time asked for).
    pub(crate) fn wake_at(&self, due: Instant, waker: &Waker) {
        let shared = &(self.0).0;
        let mut state = shared.lock();
        if !state.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            state.waker = Some(waker.clone());
        }
        if state.due.is_some_and(|armed| armed <= due) {
            return; // an earlier wake-up is on its way
        }
        state.due = Some(due);
        if state.running {
            shared.changed.notify_all();
            return;
        }
        let thread_shared = shared.clone();
        let started = std::thread::Builder::new()
            .name("fluxgate-timer".into())
            .spawn(move || thread_shared.run());
        match started {
            Ok(_) => {
                state.running = true;
                #[cfg(test)]
                {
                    state.started += 1;
                }
            }
            Err(_) => {
                // Without a thread, wake at once: the executor polls again (and again) until
                // due.
                state.due = None;
                waker.wake_by_ref();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn until(what: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if what() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        what()
    }

    struct Panics;

    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }

    /// A task's waker that panics costs only its own wake-up: the thread goes on, and wakes
    /// the next task when due (it ended with its running flag set, and no due time was waited
    /// for again).
    #[test]
    fn a_panicking_waker_leaves_the_timer_working() {
        let timer = WakeTimer::default();
        timer.wake_at(Instant::now(), &Waker::from(Arc::new(Panics)));
        let shared = (timer.0).0.clone();
        assert!(until(|| !shared.lock().running), "the due time passed");
        let count = Arc::new(Count::default());
        timer.wake_at(Instant::now(), &Waker::from(count.clone()));
        assert!(
            until(|| count.0.load(Ordering::SeqCst) == 1),
            "woken when due"
        );
    }

    /// Earlier due times, each asked for while a later one waits (a peer's barriers can set
    /// deadlines centuries ahead): one thread waits for them all, and it ends with its owner
    /// (a thread was started for each, and slept to its own due time, the owner long gone).
    #[test]
    fn one_thread_waits_for_the_earliest_due_time_and_ends_with_its_owner() {
        let timer = WakeTimer::default();
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let now = Instant::now();
        for hours in (1..=50).rev() {
            timer.wake_at(now + Duration::from_secs(3600 * hours), &waker);
        }
        let shared = (timer.0).0.clone();
        assert_eq!(shared.lock().started, 1, "one timer thread");
        timer.wake_at(Instant::now(), &waker);
        assert!(
            until(|| count.0.load(Ordering::SeqCst) == 1),
            "woken when due"
        );
        // Nothing more due: the thread ended; the next due time starts one again.
        assert!(until(|| !shared.lock().running));
        timer.wake_at(Instant::now() + Duration::from_secs(3600), &waker);
        assert_eq!(shared.lock().started, 2);
        drop(timer);
        assert!(
            until(|| Arc::strong_count(&shared) == 1),
            "the timer thread ended with its owner"
        );
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once");
    }
}
