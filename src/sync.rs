//! The synchronisation primitives the lock-free protocols use, switched to loom's
//! model-checked versions (or loom-aware stand-ins) under `--cfg loom`, as tokio's `loom` shim
//! does, so the same code is what loom explores. Without `--cfg loom` every name here is the
//! std / crossbeam / atomic-waker type itself: no wrapper, no cost.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};

// The locks a waiter sleeps on. Under loom they are loom's, so a notification that can be lost
// shows up as a deadlock, and `wait_timeout` never times out (no bounded re-check hides a
// lost wake-up).
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex};

#[cfg(not(loom))]
pub(crate) use atomic_waker::AtomicWaker;
#[cfg(not(loom))]
pub(crate) use crossbeam_queue::ArrayQueue;

// `pub` (under `--cfg loom` only) so the models can build the queues they hand to the crate.
#[cfg(loom)]
pub use self::model::{ArrayQueue, AtomicWaker};

/// Loom-aware stand-ins for the two third-party lock-free types, whose std atomics loom cannot
/// see: loom would neither interleave inside them nor carry their happens-before edges, and
/// would then report orderings the real types forbid.
#[cfg(loom)]
mod model {
    use std::collections::VecDeque;
    use std::fmt;
    use std::task::Waker;

    use loom::sync::Mutex;

    /// `crossbeam_queue::ArrayQueue` as loom sees it: a bounded FIFO with the same `push` /
    /// `pop` / `len` / `is_empty` behaviour (a full queue hands the item back).
    ///
    /// Why a `Mutex<VecDeque>` and not the crossbeam algorithm on loom atomics: crossbeam's
    /// queue is linearizable, and what makes it so (and what our protocols rely on: an
    /// `is_empty` after a `push` in another thread sees the item, SeqCst `head`/`tail`) is
    /// SeqCst accesses, which loom models only as AcqRel; modelled op by op, loom would report
    /// executions the real queue cannot have. A lock gives every operation one place in a total
    /// order with acquire/release edges between them: the same contract, which loom models
    /// exactly. Each operation is one loom step that loom interleaves with everything else;
    /// what the models check are the flags, counters, fences and wake-ups around the queues.
    pub struct ArrayQueue<T> {
        items: Mutex<VecDeque<T>>,
        capacity: usize,
    }

    impl<T> fmt::Debug for ArrayQueue<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ArrayQueue")
                .field("capacity", &self.capacity)
                .finish()
        }
    }

    impl<T> ArrayQueue<T> {
        pub fn new(capacity: usize) -> Self {
            assert!(capacity > 0, "capacity must be non-zero");
            Self {
                items: Mutex::new(VecDeque::new()),
                capacity,
            }
        }

        pub fn push(&self, value: T) -> Result<(), T> {
            let mut items = self.items.lock().unwrap();
            if items.len() == self.capacity {
                return Err(value);
            }
            items.push_back(value);
            Ok(())
        }

        pub fn pop(&self) -> Option<T> {
            self.items.lock().unwrap().pop_front()
        }

        pub fn len(&self) -> usize {
            self.items.lock().unwrap().len()
        }

        pub fn is_empty(&self) -> bool {
            self.items.lock().unwrap().is_empty()
        }

        pub fn is_full(&self) -> bool {
            self.len() == self.capacity
        }
    }

    /// `atomic_waker::AtomicWaker` as loom sees it: `wake` takes the last registered waker and
    /// wakes it; a `register` ordered after a `wake` stores its waker for the next `wake` and
    /// sees everything before that `wake` (acquire/release through the lock, as the real type's
    /// AcqRel state word gives). loom's own `future::AtomicWaker` prints a `dbg!` line per call,
    /// too noisy for thousands of executions.
    pub struct AtomicWaker {
        waker: Mutex<Option<Waker>>,
    }

    impl fmt::Debug for AtomicWaker {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("AtomicWaker")
        }
    }

    impl Default for AtomicWaker {
        fn default() -> Self {
            Self::new()
        }
    }

    impl AtomicWaker {
        pub fn new() -> Self {
            Self {
                waker: Mutex::new(None),
            }
        }

        pub fn register(&self, waker: &Waker) {
            let mut slot = self.waker.lock().unwrap();
            match &*slot {
                Some(old) if old.will_wake(waker) => {}
                _ => *slot = Some(waker.clone()),
            }
        }

        pub fn wake(&self) {
            // Woken outside the lock, as the real type does: the waker may call back in.
            let waker = self.waker.lock().unwrap().take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}
