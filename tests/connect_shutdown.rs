//! An environment that ends while a connect is under way (a peer that drops SYNs) cancels and
//! joins the helper thread making it: no thread outlives the environment. Before, the helper
//! sat in a blocking connect until `connect_timeout` and ran on after the environment was
//! gone.
//!
//! A test binary of its own: it counts the process's connect helper threads, which a test
//! running beside it would start too.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use fluxgate::gate::{ConsumedSubpartition, InputGate};
use fluxgate::io::Transport;
use fluxgate::partition::ResultPartitionId;
use fluxgate::{ChannelDescriptor, EnvConfig, NetworkConfig, ProducerLocation, ShuffleEnvironment};

const LONG: Duration = Duration::from_secs(20);

/// Threads of this process named as connect helpers ("fluxgate-connect", cut to the 15
/// characters a Linux thread name keeps).
fn connect_helpers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "fluxgate-connec")
        .count()
}

fn an_environment_ending_mid_connect_leaves_no_helper_thread(transport: Transport) {
    let (hole, filler) = common::black_hole();
    let hole_addr = hole.local_addr().unwrap().as_socket().unwrap();
    let mut network = NetworkConfig::default();
    network
        .set_all([
            ("taskmanager.memory.segment-size", "8kb"),
            ("taskmanager.memory.network.max", "4mb"),
            ("fluxgate.memory.arena-size", "4mb"),
        ])
        .unwrap();
    let env = ShuffleEnvironment::start(EnvConfig {
        network,
        node: 1,
        transport,
        // Far beyond the test: only a cancellation ends the connect in time.
        connect_timeout: LONG * 30,
        ..EnvConfig::default()
    })
    .unwrap();
    let mut gate = env
        .create_gate(&[ChannelDescriptor {
            consumed: ConsumedSubpartition {
                partition: ResultPartitionId {
                    partition: 0,
                    producer: 0,
                },
                subpartition: 0,
            },
            location: ProducerLocation::Remote(hole_addr),
        }])
        .unwrap();
    gate.request_partitions(Instant::now()).unwrap();
    assert!(
        common::wait_until(LONG, || connect_helpers() == 1),
        "a helper thread connects to the black hole"
    );
    assert!(matches!(gate.poll_next(), Ok(None)), "still connecting");
    drop(env);
    // A joined thread may still show in /proc for a moment after its join returned; the old
    // code's helper stayed for the whole connect timeout (30 × LONG).
    assert!(
        common::wait_until(LONG, || connect_helpers() == 0),
        "the environment's end cancelled and joined the helper"
    );
    assert!(gate.poll_next().is_err(), "the waiting channel failed");
    drop((gate, hole, filler));
}

#[test]
fn an_environment_ending_mid_connect_leaves_no_helper_thread_on_either_driver() {
    // One test, the drivers in turn: two tests would count each other's helpers.
    for transport in [Transport::Epoll, Transport::Uring] {
        common::on(
            transport,
            an_environment_ending_mid_connect_leaves_no_helper_thread,
        );
    }
}
