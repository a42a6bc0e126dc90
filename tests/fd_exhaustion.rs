//! An accept that fails for want of descriptors (`EMFILE`) leaves the connection queued in the
//! listener's backlog. The epoll listener is edge-triggered, so no new event says it is still
//! there, and io_uring's failed accept is not re-armed by itself: each driver must accept
//! again once descriptors are free, or the connection waits until some other connection
//! arrives.
//!
//! A test binary of its own: it lowers the process's descriptor limit, which would make any
//! test running beside it fail.

#[macro_use]
mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::time::Duration;

use fluxgate::env::{EnvConfig, ShuffleEnvironment};
use fluxgate::io::Transport;
use fluxgate::NetworkConfig;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use socket2::{Domain, Socket, Type};

const LONG: Duration = Duration::from_secs(20);
const CLIENTS: usize = 3;

fn descriptor_limit() -> Rlimit {
    getrlimit(Resource::Nofile)
}

fn set_descriptor_limit(limit: Rlimit) {
    setrlimit(Resource::Nofile, limit).expect("lowering or restoring the soft limit");
}

fn producer(transport: Transport) -> ShuffleEnvironment {
    let mut network = NetworkConfig::default();
    for (key, value) in [
        ("taskmanager.memory.segment-size", "8kb"),
        ("taskmanager.memory.network.max", "1mb"),
        ("fluxgate.memory.arena-size", "512kb"),
    ] {
        network.set(key, value).unwrap();
    }
    let env = ShuffleEnvironment::start(EnvConfig {
        network,
        node: 1,
        transport,
        ..EnvConfig::default()
    })
    .unwrap();
    assert_eq!(env.transport(), transport, "the requested driver runs");
    env
}

fn failed_accepts(env: &ShuffleEnvironment) -> u64 {
    env.driver_stats().map_or(0, |stats| stats.failed_accepts)
}

/// Connects `CLIENTS` sockets while the producer has no descriptor left to accept them with,
/// then frees descriptors: every client must then hear the producer's handshake, the first
/// bytes a producer sends on a connection it accepted.
fn queued_connections_are_accepted_once_descriptors_are_free(transport: Transport) {
    let env = producer(transport);
    let addr: SocketAddr = env.local_addr();
    let original = descriptor_limit();
    let limit = common::highest_descriptor() + 1 + CLIENTS as u64;
    set_descriptor_limit(Rlimit {
        current: Some(limit),
        maximum: original.maximum,
    });
    // Every free descriptor under the limit taken (lower ones closed earlier too), then
    // exactly the clients' sockets' worth given back: the producer's accepts find none.
    let mut fillers = Vec::new();
    for _ in 0..limit {
        match std::fs::File::open("/dev/null") {
            Ok(file) => fillers.push(file),
            Err(_) => break,
        }
    }
    fillers.truncate(fillers.len().saturating_sub(CLIENTS));
    let sockets: Result<Vec<Socket>, _> = (0..CLIENTS)
        .map(|_| Socket::new(Domain::IPV4, Type::STREAM, None))
        .collect();
    let connected = sockets.and_then(|sockets| {
        for socket in &sockets {
            // Completes in the kernel's backlog, whether or not the producer accepts.
            socket.connect(&addr.into())?;
        }
        Ok(sockets)
    });
    // An accept failed; and every connection's readiness, signalled before `connect`
    // returned, was handled before the limit is restored: the driver answers a stats request
    // at the start of a turn, so the turn between two answers polled and handled what was
    // pending. A readiness still pending would accept them all without any retry.
    let tried = common::wait_until(LONG, || failed_accepts(&env) > 0);
    let _ = (env.driver_stats_within(LONG), env.driver_stats_within(LONG));
    // Restored before any assertion, so that a failure leaves the process usable.
    drop(fillers);
    set_descriptor_limit(original);
    let sockets = connected.expect("the clients' sockets fit the limit");
    assert!(
        tried,
        "{transport:?}: the producer's accept ran out of descriptors"
    );
    for (index, socket) in sockets.into_iter().enumerate() {
        let mut stream: std::net::TcpStream = socket.into();
        stream.set_read_timeout(Some(LONG)).unwrap();
        let mut first = [0u8; 1];
        // `read_exact` reads again after an interrupted read (EINTR).
        let heard = stream.read_exact(&mut first);
        assert!(
            heard.is_ok(),
            "{transport:?}: client {index} was never accepted: {heard:?}"
        );
    }
    drop(env);
}

#[test]
fn connections_queued_while_descriptors_ran_out_are_accepted_once_they_are_free() {
    // Both drivers in one test: the limit is the process's, so they must not run at once.
    common::on(
        Transport::Epoll,
        queued_connections_are_accepted_once_descriptors_are_free,
    );
    common::on(
        Transport::Uring,
        queued_connections_are_accepted_once_descriptors_are_free,
    );
}
