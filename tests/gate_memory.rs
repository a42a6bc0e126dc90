//! A gate's bookkeeping grows with its channel count, not with its square.
//!
//! Each remote channel queues what its task has not read yet. Sized by the gate's pool (two
//! exclusive segments per channel plus the floating ones), those queues held a number of slots
//! that grew with the square of the channel count: a gate of 1000 remote channels, as an
//! all-to-all edge of parallelism 1000 has, allocated 288 MiB before a buffer arrived.
//!
//! A test binary of its own: it measures the process's resident memory, which a test running
//! beside it would change.

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::Instant;

use fluxgate::buffer::NetworkBufferPool;
use fluxgate::gate::{ChannelLocation, ChannelSpec, ConsumedSubpartition, SingleInputGate};
use fluxgate::partition::{PartitionManager, ResultPartitionId};
use fluxgate::NetworkConfig;

const CHANNELS: usize = 1000;

#[test]
fn a_gate_of_many_remote_channels_allocates_in_proportion_to_their_count() {
    let mut config = NetworkConfig::default();
    // Room for the gate's pool as Flink sizes it: 2 × 1000 + 8 segments.
    config
        .set_all([
            ("taskmanager.memory.segment-size", "4kb"),
            ("taskmanager.memory.network.max", "16mb"),
        ])
        .unwrap();
    let network = NetworkBufferPool::new(&config).unwrap();
    let specs = (0..CHANNELS)
        .map(|i| ChannelSpec {
            consumed: ConsumedSubpartition {
                partition: ResultPartitionId {
                    partition: i as u64,
                    producer: 1,
                },
                subpartition: 0,
            },
            location: ChannelLocation::Remote,
        })
        .collect();

    let before = common::resident_bytes();
    let mut gate =
        SingleInputGate::new(specs, Arc::new(PartitionManager::new()), &network, &config);
    gate.setup().unwrap();
    gate.request_partitions(Instant::now()).unwrap();
    let allocated = common::resident_bytes().saturating_sub(before);

    // The segments were mapped with the network memory; what a channel needs besides is its
    // state and its queues, a few kilobytes each at Flink's defaults.
    let per_channel = allocated / CHANNELS;
    assert!(
        per_channel <= 32 * 1024,
        "{allocated} bytes more resident for {CHANNELS} remote channels: {per_channel} bytes each"
    );
    gate.close();
    drop(gate);
    assert_eq!(network.available_segments(), network.total_segments());
}
