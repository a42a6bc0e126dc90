//! The atomics the lock-free protocols use, switched to loom's model-checked versions under
//! `--cfg loom` (as tokio's `loom` shim does), so the same code is what loom explores.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
