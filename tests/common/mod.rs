//! What the integration tests that run on both drivers share: `#[macro_use] mod common;`.

use fluxgate::io::Transport;

/// Runs `test` on `transport`; on io_uring only where the kernel allows it (and says so
/// loudly where it does not).
pub fn on(transport: Transport, test: impl FnOnce(Transport)) {
    if transport == Transport::Uring {
        if let Err(reason) = fluxgate::io::uring::probe() {
            eprintln!("SKIPPED: io_uring unavailable: {reason}");
            return;
        }
    }
    test(transport);
}

/// One test per driver: `on_both_drivers!(body, body_epoll, body_uring)`.
macro_rules! on_both_drivers {
    ($test:ident, $epoll:ident, $uring:ident) => {
        #[test]
        fn $epoll() {
            common::on(fluxgate::io::Transport::Epoll, $test);
        }

        #[test]
        fn $uring() {
            common::on(fluxgate::io::Transport::Uring, $test);
        }
    };
}
