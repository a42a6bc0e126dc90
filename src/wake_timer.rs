//! Wakes a pending future when something time-based comes due: a future has no clock, and
//! nothing else would wake it then.

use std::sync::Arc;
use std::task::Waker;
use std::time::Instant;

/// Wakes the task that polled last at a due time: a gate's async read when a partition
/// request's retry or an alignment's timeout comes due, a partition's async emit when its
/// aligned barrier's timeout does. At most one timer thread per owner sleeps at a time, for
/// the earliest due time; the path is taken only while such a thing is pending. The owner
/// (the gate, the partition) keeps it, not the future: a future dropped while pending (the
/// other branch of a `select!` won) leaves the armed timer known to the next, which it wakes.
#[derive(Clone, Debug, Default)]
pub(crate) struct WakeTimer(Arc<std::sync::Mutex<TimerState>>);

#[derive(Debug, Default)]
struct TimerState {
    /// When the timer thread sleeping now fires.
    fires: Option<Instant>,
    /// The task of the last pending future.
    waker: Option<Waker>,
}

impl WakeTimer {
    /// Makes sure `waker` is woken at `due`.
    pub(crate) fn wake_at(&self, due: Instant, waker: &Waker) {
        let now = Instant::now();
        let mut state = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !state.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            state.waker = Some(waker.clone());
        }
        if state.fires.is_some_and(|fires| fires <= due && fires > now) {
            return; // an earlier wake-up is on its way
        }
        let shared = self.0.clone();
        let started = std::thread::Builder::new()
            .name("fluxgate-timer".into())
            .spawn(move || {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let waker = {
                    let mut state = shared
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if state.fires == Some(due) {
                        state.fires = None;
                    }
                    state.waker.clone()
                };
                if let Some(waker) = waker {
                    waker.wake();
                }
            });
        match started {
            Ok(_) => state.fires = Some(due),
            // Without a thread, wake at once: the executor polls again (and again) until due.
            Err(_) => waker.wake_by_ref(),
        }
    }
}
