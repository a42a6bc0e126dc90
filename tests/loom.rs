//! loom model checks of the segment lease protocol (run with `RUSTFLAGS="--cfg loom"`).
#![cfg(loom)]
