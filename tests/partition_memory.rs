//! A partition's bookkeeping grows with its subpartition count, not with its square.
//!
//! Each subpartition queues what its reader has not taken yet. Sized by the partition's pool
//! (about two segments per subpartition), those queues together held a number of slots that
//! grew with the square of the subpartition count: a partition of 2000 subpartitions, as a job
//! of parallelism 2000 has, allocated over a gigabyte before a record was written.
//!
//! A test binary of its own: it measures the process's resident memory, which a test running
//! beside it would change.

#[macro_use]
mod common;

use fluxgate::buffer::NetworkBufferPool;
use fluxgate::partition::{ResultPartition, ResultPartitionId};
use fluxgate::NetworkConfig;

const SUBPARTITIONS: usize = 2000;

#[test]
fn a_partition_of_many_subpartitions_allocates_in_proportion_to_their_count() {
    let mut config = NetworkConfig::default();
    // Room for the partition's pool as Flink sizes it: 2 × 2000 + 8 segments at most.
    config
        .set_all([
            ("taskmanager.memory.segment-size", "4kb"),
            ("taskmanager.memory.network.max", "32mb"),
        ])
        .unwrap();
    let network = NetworkBufferPool::new(&config).unwrap();
    let id = ResultPartitionId {
        partition: 1,
        producer: 1,
    };

    let before = common::resident_bytes();
    let partition = ResultPartition::new(id, SUBPARTITIONS, &network, &config).unwrap();
    let allocated = common::resident_bytes().saturating_sub(before);

    // The segments themselves were mapped with the network memory; what a subpartition needs
    // besides is its state and its queues, a few kilobytes each at Flink's default of 10
    // buffers per channel.
    let per_subpartition = allocated / SUBPARTITIONS;
    assert!(
        per_subpartition <= 8 * 1024,
        "{allocated} bytes more resident for {SUBPARTITIONS} subpartitions: \
         {per_subpartition} bytes each"
    );
    drop(partition);
    assert_eq!(network.available_segments(), network.total_segments());
}
