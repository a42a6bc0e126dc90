//! The io_uring probe keeps a verdict for the process only when it lasts. A ring that could not
//! be created for want of descriptors is a shortage of the moment: kept, it would have left
//! every environment started later in the process on epoll.
//!
//! A test binary of its own: it lowers the process's descriptor limit (which would make any
//! test running beside it fail), and it must be the process's first probe.

#[macro_use]
mod common;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

#[test]
fn a_probe_that_found_no_descriptor_for_its_ring_probes_again() {
    let original = getrlimit(Resource::Nofile);
    let limit = common::highest_descriptor() + 1;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(limit),
            maximum: original.maximum,
        },
    )
    .expect("lowering the soft limit");
    // Every descriptor under the limit taken: the probe's ring finds none.
    let fillers: Vec<std::fs::File> = std::iter::from_fn(|| std::fs::File::open("/dev/null").ok())
        .take(limit as usize)
        .collect();
    let starved = fluxgate::io::uring::probe();
    // Restored before any assertion, so that a failure leaves the process usable.
    drop(fillers);
    setrlimit(Resource::Nofile, original).expect("restoring the soft limit");
    let fed = fluxgate::io::uring::probe();
    if let Err(reason) = &fed {
        // Kept from the starved probe: the bug this test is for.
        assert!(
            !reason.contains("Too many open files"),
            "the shortage was kept for the process: {reason}"
        );
        eprintln!("SKIPPED: the io_uring probe: io_uring unavailable: {reason}");
        return;
    }
    let reason = starved.expect_err("the ring found no descriptor");
    assert!(reason.contains("Too many open files"), "{reason}");
}
