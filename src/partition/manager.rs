//! The registry of produced partitions (Flink's `ResultPartitionManager`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::result_partition::PartitionHandle;
use super::subpartition::SubpartitionView;
use super::{AvailabilityListener, PartitionError, ResultPartitionId};
use crate::event::Event;

/// Receives task events that consumers send upstream to a partition's producer (Flink's
/// `TaskEventHandler`, e.g. iteration synchronization).
pub trait TaskEventListener: Send + Sync {
    /// An event from a consumer of the partition.
    fn on_task_event(&self, event: &Event);
}

/// Produced partitions of this process, by id. Registration and view creation take a lock;
/// neither is on the per-record or per-buffer path.
#[derive(Debug, Default)]
pub struct PartitionManager {
    partitions: Mutex<HashMap<ResultPartitionId, PartitionHandle>>,
    task_event_listeners: Mutex<HashMap<ResultPartitionId, Arc<dyn TaskEventListener>>>,
    /// Set by [`release_all`](Self::release_all) under the partitions' lock: a partition
    /// registered after it would never be released (Flink's `isShutdown`).
    shut_down: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for dyn TaskEventListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskEventListener")
    }
}

impl PartitionManager {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a partition so consumers can find it. Partitions every consumer released
    /// are forgotten first, with their task-event listeners, as Flink's manager forgets a
    /// partition once it was consumed: a long-running process would otherwise keep an entry
    /// for every partition it produced. (Ids are not reused, as Flink's are not: they name
    /// one producer attempt.)
    pub fn register(&self, partition: PartitionHandle) -> Result<(), PartitionError> {
        let id = partition.id();
        // A listener the new producer of `id` subscribed before registering stays.
        self.forget_released(Some(id));
        let mut partitions = self.partitions.lock().expect("not poisoned");
        if self.shut_down.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(PartitionError::Released);
        }
        if partitions.contains_key(&id) {
            return Err(PartitionError::DuplicatePartition(id));
        }
        partitions.insert(id, partition);
        Ok(())
    }

    /// The registered partition with this id.
    pub fn partition(&self, id: ResultPartitionId) -> Result<PartitionHandle, PartitionError> {
        self.partitions
            .lock()
            .expect("not poisoned")
            .get(&id)
            .cloned()
            .ok_or(PartitionError::PartitionNotFound(id))
    }

    /// Creates the reader of `(id, subpartition)`; `PartitionNotFound` when the partition is
    /// not registered (yet: the consumer retries with back-off).
    pub fn create_view(
        &self,
        id: ResultPartitionId,
        subpartition: usize,
        listener: Arc<dyn AvailabilityListener>,
    ) -> Result<SubpartitionView, PartitionError> {
        self.partition(id)?.create_view(subpartition, listener)
    }

    /// Releases a partition and forgets it. `PartitionNotFound` when it is not registered,
    /// which includes one every consumer released and a later `register` already forgot.
    pub fn release(&self, id: ResultPartitionId) -> Result<(), PartitionError> {
        // The listener goes whether or not the partition is still registered (it may have
        // been forgotten as released already).
        self.task_event_listeners
            .lock()
            .expect("not poisoned")
            .remove(&id);
        let partition = self
            .partitions
            .lock()
            .expect("not poisoned")
            .remove(&id)
            .ok_or(PartitionError::PartitionNotFound(id))?;
        partition.release();
        Ok(())
    }

    /// Releases every registered partition (Flink's `ResultPartitionManager.shutdown`): the
    /// environment is going, and no consumer can reach them any more. Their writers' next
    /// emit, or the wait they are blocked in, ends with `Released`; a partition registered
    /// later is refused as released.
    pub fn release_all(&self) {
        self.task_event_listeners
            .lock()
            .expect("not poisoned")
            .clear();
        let partitions: Vec<PartitionHandle> = {
            let mut partitions = self.partitions.lock().expect("not poisoned");
            self.shut_down
                .store(true, std::sync::atomic::Ordering::Relaxed);
            partitions.drain().map(|(_, partition)| partition).collect()
        };
        // Outside the lock: a release wakes listeners, which may look partitions up.
        for partition in partitions {
            partition.release();
        }
    }

    /// Routes task events for partition `id` to its producer.
    pub fn subscribe_task_events(
        &self,
        id: ResultPartitionId,
        listener: Arc<dyn TaskEventListener>,
    ) {
        self.task_event_listeners
            .lock()
            .expect("not poisoned")
            .insert(id, listener);
    }

    /// Delivers a consumer's task event to the producer of `id`; false when no producer
    /// listens.
    pub fn publish_task_event(&self, id: ResultPartitionId, event: &Event) -> bool {
        let listener = self
            .task_event_listeners
            .lock()
            .expect("not poisoned")
            .get(&id)
            .cloned();
        let Some(listener) = listener else {
            return false;
        };
        // The listener is the producer's code, run on whichever thread delivers: an I/O thread
        // (a remote consumer's event), whose panic would end every connection it serves, or
        // a local consumer's task. Its panic costs the event only.
        let published = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            listener.on_task_event(event)
        }));
        if published.is_err() {
            tracing::error!(partition = ?id, "a task event listener panicked; the event is dropped");
        }
        true
    }

    /// Forgets partitions whose every subpartition was consumed or released.
    pub fn remove_released(&self) -> usize {
        self.forget_released(None)
    }

    /// Forgets partitions every consumer released, with their task-event listeners (but the
    /// one of `keep_listener`); returns how many.
    fn forget_released(&self, keep_listener: Option<ResultPartitionId>) -> usize {
        let mut forgotten = Vec::new();
        self.partitions
            .lock()
            .expect("not poisoned")
            .retain(|id, partition| {
                let released = partition.is_released();
                if released {
                    forgotten.push(*id);
                }
                !released
            });
        let mut listeners = self.task_event_listeners.lock().expect("not poisoned");
        for id in forgotten.iter().filter(|&&id| Some(id) != keep_listener) {
            listeners.remove(id);
        }
        forgotten.len()
    }

    /// Registered partitions.
    pub fn len(&self) -> usize {
        self.partitions.lock().expect("not poisoned").len()
    }

    /// True when none is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
