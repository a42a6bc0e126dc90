//! A remote channel's lane of received items.

use std::collections::VecDeque;
use std::fmt;

use crate::sync::{ArrayQueue, AtomicBool, AtomicUsize, Mutex, Ordering};

/// One lane of a remote channel's received items: a FIFO with a single pusher (the
/// transport's thread) and a single popper (the gate's reader). A lock-free ring holds what a
/// channel usually holds (its exclusive segments, the gate's floating ones, and the events it
/// may take without credit), so its memory does not grow with the gate's channel count. A
/// channel that holds more (floating segments its gate got back from released channels)
/// spills the rest, in order, into a list behind a lock, which either side touches only while
/// something is spilled.
///
/// Why the order holds: every item in the ring is older than every spilled one. The pusher
/// puts an item into the ring only while nothing is spilled; the popper, under the lock, takes
/// from the ring before the list, and moves spilled items back into the ring only while the
/// pusher waits for that lock.
pub struct SpillQueue<T> {
    ring: ArrayQueue<T>,
    /// Set by the pusher (under the lock) when it spills; cleared by the popper (under the
    /// lock) that empties `overflow`. While set, pushes go to `overflow`.
    spilled: AtomicBool,
    overflow: Mutex<VecDeque<T>>,
    overflow_len: AtomicUsize,
    /// Most items the lane holds, ring and overflow together.
    max_items: usize,
}

impl<T> fmt::Debug for SpillQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpillQueue")
            .field("len", &self.len())
            .field("spilled", &self.spilled.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T> SpillQueue<T> {
    /// A lane holding up to `max_items`, `usual` of them in the ring.
    pub fn new(usual: usize, max_items: usize) -> Self {
        let ring = usual.clamp(1, max_items.max(1));
        Self {
            ring: ArrayQueue::new(ring),
            spilled: AtomicBool::new(false),
            overflow: Mutex::new(VecDeque::new()),
            overflow_len: AtomicUsize::new(0),
            max_items: max_items.max(ring),
        }
    }

    /// Queues `item` behind everything before it; gives it back when the lane holds
    /// `max_items` already.
    pub fn push(&self, item: T) -> Result<(), T> {
        let item = if self.spilled.load(Ordering::SeqCst) {
            item
        } else {
            match self.ring.push(item) {
                Ok(()) => return Ok(()),
                Err(item) => item,
            }
        };
        let mut overflow = self.overflow.lock().expect("not poisoned");
        if self.ring.len() + overflow.len() >= self.max_items {
            return Err(item);
        }
        overflow.push_back(item);
        self.overflow_len.store(overflow.len(), Ordering::Relaxed);
        self.spilled.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// The oldest item, if any.
    pub fn pop(&self) -> Option<T> {
        self.pop_after_first_look(|| {})
    }

    /// [`pop`](Self::pop), running `between` after its lock-free look at the ring (the window
    /// in which the pusher may fill the ring and spill: a test steps into it).
    #[inline(always)]
    fn pop_after_first_look(&self, between: impl FnOnce()) -> Option<T> {
        if let Some(item) = self.ring.pop() {
            return Some(item);
        }
        between();
        if !self.spilled.load(Ordering::SeqCst) {
            return None;
        }
        let mut overflow = self.overflow.lock().expect("not poisoned");
        // The ring may have filled after the look above, before the pusher spilled: what it
        // holds is older than anything spilled.
        if let Some(item) = self.ring.pop() {
            return Some(item);
        }
        let item = overflow.pop_front();
        // The ring is empty and takes no push while `spilled` is set (pushers queue behind
        // this lock): the spilled items move back into it, in order, so the lane returns to
        // the lock-free path as soon as they fit.
        while let Some(next) = overflow.pop_front() {
            if let Err(next) = self.ring.push(next) {
                overflow.push_front(next);
                break;
            }
        }
        self.overflow_len.store(overflow.len(), Ordering::Relaxed);
        if overflow.is_empty() {
            // Its memory goes too: spilling is the exception.
            *overflow = VecDeque::new();
            self.spilled.store(false, Ordering::SeqCst);
        }
        item
    }

    /// Items queued now (a snapshot while the other side works).
    pub fn len(&self) -> usize {
        self.ring.len() + self.overflow_len.load(Ordering::Relaxed)
    }

    /// True when nothing is queued (an item still being pushed may not show yet; its
    /// pusher's notification follows the push).
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty() && !self.spilled.load(Ordering::SeqCst)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::SpillQueue;
    use std::sync::Arc;

    /// The pusher fills the ring and spills while the popper is between its look at the
    /// empty ring and its look at the spill: the popper takes the ring's items first. It took
    /// the spilled one ahead of them.
    #[test]
    fn a_popper_that_saw_the_ring_empty_still_takes_its_items_before_the_spilled_ones() {
        let lane = SpillQueue::new(2, 8);
        let first = lane.pop_after_first_look(|| {
            for item in 0..3u32 {
                lane.push(item).unwrap();
            }
        });
        assert_eq!(first, Some(0));
        let rest: Vec<u32> = std::iter::from_fn(|| lane.pop()).take(8).collect();
        assert_eq!(rest, [1, 2]);
        assert!(lane.is_empty());
    }

    /// A pusher and a popper on two threads, the ring two items long: every item comes out
    /// once and in order, spilled or not, as spilled items move back into the ring.
    #[test]
    fn items_come_out_in_order_across_spills() {
        const ITEMS: u32 = 200_000;
        let lane = Arc::new(SpillQueue::new(2, 64));
        let pusher = {
            let lane = lane.clone();
            std::thread::spawn(move || {
                let mut spilled = 0u64;
                for item in 0..ITEMS {
                    let mut item = item;
                    // Bounded: the popper empties the lane.
                    for _ in 0..100_000_000u64 {
                        match lane.push(item) {
                            Ok(()) => break,
                            Err(back) => {
                                item = back;
                                std::thread::yield_now();
                            }
                        }
                    }
                    spilled += u64::from(lane.spilled.load(std::sync::atomic::Ordering::Relaxed));
                }
                spilled
            })
        };
        let mut next = 0u32;
        // Bounded: each round either takes an item or yields to the pusher.
        for _ in 0..100_000_000u64 {
            if next == ITEMS {
                break;
            }
            match lane.pop() {
                Some(item) => {
                    assert_eq!(item, next, "out of order");
                    next += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        let spilled = pusher.join().unwrap();
        assert_eq!(next, ITEMS, "every item came out");
        assert!(lane.is_empty());
        assert!(spilled > 0, "the lane spilled");
    }
}
