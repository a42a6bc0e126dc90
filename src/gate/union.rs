//! `UnionInputGate`: several gates read as one, channel indexes remapped, gates served in
//! turn (Flink's `UnionInputGate`).

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::queue::ChannelQueue;
use super::single::{GateCloser, GateMetrics, SingleInputGate};
use super::{BufferOrEvent, EndOfDataStatus, GateError, InputGate};
use crate::event::CheckpointBarrier;
use crate::metrics::{InputMetricsSnapshot, WaitTime};

/// Gates behind one reader: gate 0's channels are `0..n0`, gate 1's `n0..n0+n1`, and so on.
/// A gate with data waits in a FIFO of gates, so each gate gets its turn.
pub struct UnionInputGate {
    gates: Vec<SingleInputGate>,
    /// First union channel index of each gate.
    offsets: Vec<usize>,
    /// Queue of gates with data (entries are gate indexes).
    queue: Arc<ChannelQueue>,
    /// Wakes a pending `next_async` for a member's partition-request retry.
    timer: super::WakeTimer,
    /// The union's idle time (its reader waits for all members at once).
    metrics: GateMetrics,
}

impl fmt::Debug for UnionInputGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnionInputGate")
            .field("gates", &self.gates.len())
            .field("offsets", &self.offsets)
            .finish()
    }
}

impl UnionInputGate {
    /// Unions `gates` (in this order).
    pub fn new(gates: Vec<SingleInputGate>) -> Self {
        let queue = ChannelQueue::new(gates.len());
        let mut offsets = Vec::with_capacity(gates.len());
        let mut next = 0;
        for (index, gate) in gates.iter().enumerate() {
            offsets.push(next);
            next += gate.channel_count();
            gate.queue().set_parent(queue.clone(), index as u32);
            // Every member once, whatever it holds: data queued before the union existed, or
            // a member closed already, whose read then reports it (a member looked at only
            // when it had channels would be read never).
            queue.enqueue(index as u32, gate.queue().has_priority());
        }
        Self {
            gates,
            offsets,
            queue,
            metrics: GateMetrics::default(),
            timer: super::WakeTimer::default(),
        }
    }

    /// Waits for the next item of any member without blocking the thread (any executor);
    /// members' partition requests waiting for their retry are retried when due.
    pub async fn next_async(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        let timer = self.timer.clone();
        super::read_async(self, timer).await
    }

    /// The union's idle time (the member gates' own stay 0 while read through the union).
    pub fn metrics(&self) -> &GateMetrics {
        &self.metrics
    }

    /// The input metrics of the union, as Flink reports a task's input: bytes and buffers
    /// summed over the member gates, `inPoolUsage` over their pools together (segments holding
    /// data over the sum of the pools' maxima), and the union reader's idle time.
    pub fn metrics_snapshot(&self) -> InputMetricsSnapshot {
        let mut snapshot = InputMetricsSnapshot {
            idle_time_ms: self.metrics.idle.total_ms(),
            ..InputMetricsSnapshot::default()
        };
        let mut usage = super::single::SegmentUsage::default();
        for gate in &self.gates {
            gate.add_channel_counts(&mut snapshot);
            usage.add(gate.segment_usage());
        }
        usage.set_usages(&mut snapshot);
        snapshot
    }

    /// The member gates.
    pub fn gates(&self) -> &[SingleInputGate] {
        &self.gates
    }

    /// The member gates, mutably (setup, requests, updates). Not for reading: a member's
    /// channels tell the union, not the member, when they have data, so a member's own
    /// `next_async` is never woken and its blocking read sees data only at its periodic
    /// re-check. Read through the union. Nor for replacing one (`std::mem::replace`): the
    /// union was linked to the gates it was built with, so a gate put in their place is never
    /// read, and the one taken out can join no other union.
    pub fn gates_mut(&mut self) -> &mut [SingleInputGate] {
        &mut self.gates
    }

    /// `(gate, channel within the gate)` of a union channel index.
    pub fn locate(&self, channel: usize) -> Option<(usize, usize)> {
        let gate = self.offsets.partition_point(|&offset| offset <= channel);
        let gate = gate.checked_sub(1)?;
        let local = channel - self.offsets[gate];
        (local < self.gates[gate].channel_count()).then_some((gate, local))
    }

    /// Closes every member gate and wakes a blocked reader.
    pub fn close(&mut self) {
        for gate in self.gates.iter_mut() {
            gate.close();
        }
        self.queue.close();
    }

    /// Member `index` failed with `error`: a close (its own closer) closes the union, which
    /// stays closed; any other error is named in the union's channel numbering.
    fn member_failed(&mut self, index: usize, error: GateError) -> GateError {
        if error == GateError::Closed {
            self.close();
            return error;
        }
        error.offset_channel(self.offsets[index])
    }

    /// A handle that closes the union from another thread (task cancellation): a reader
    /// blocked in [`next`](InputGate::next) wakes with [`GateError::Closed`], and the read
    /// closes every member gate, releasing their channels. A member gate's own closer closes
    /// the union's reads the same way.
    pub fn closer(&self) -> GateCloser {
        GateCloser::with_members(
            self.queue.clone(),
            self.gates.iter().map(|g| g.queue().clone()).collect(),
        )
    }
}

impl InputGate for UnionInputGate {
    fn poll_next(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if self.queue.is_closed() {
            // Closed from another thread: release the members' channels here, on the reader.
            self.close();
            return Err(GateError::Closed);
        }
        // Every member's due retries, not only those of the members read: a member whose
        // channels all wait for their partition has nothing queued, so it would be read only
        // once the others went idle (as its own reads do, see `retry_due_requests`).
        let now = Instant::now();
        for index in 0..self.gates.len() {
            let retried = self.gates[index].retry_due_requests(now);
            retried.map_err(|error| self.member_failed(index, error))?;
        }
        for _ in 0..=2 * self.gates.len() {
            let Some((index, _)) = self.queue.pop() else {
                return Ok(None);
            };
            let gate = &mut self.gates[index as usize];
            let offset = self.offsets[index as usize];
            let read = match gate.poll_next() {
                Err(GateError::Closed) => {
                    // A member's closer cancels the whole union: it stays closed.
                    self.close();
                    return Err(GateError::Closed);
                }
                Err(error) => {
                    // The member reads on after a channel's error (a bad event fails only that
                    // read): it stays in turn while its other channels are queued, whose flags
                    // fold their next notifications into its entry here.
                    let gate = &self.gates[index as usize];
                    if gate.queue().has_channels() {
                        self.queue.enqueue(index, gate.queue().has_priority());
                    }
                    return Err(error.offset_channel(offset));
                }
                Ok(read) => read,
            };
            let Some(mut item) = read else {
                // Channels queued again while the member read (their flags set, so their
                // next notifications are folded into these entries): the member stays in
                // turn, or they would wait for good.
                let gate = &self.gates[index as usize];
                if gate.queue().has_channels() {
                    self.queue.enqueue(index, gate.queue().has_priority());
                }
                continue;
            };
            let gate = &mut self.gates[index as usize];
            item.channel += self.offsets[index as usize];
            if gate.queue().has_channels() {
                // Back to the tail of the gate FIFO.
                self.queue.enqueue(index, gate.queue().has_priority());
            }
            item.more_available = self.queue.has_channels();
            return Ok(Some(item));
        }
        Ok(None)
    }

    fn poll_priority_event(&mut self) -> Result<Option<BufferOrEvent>, GateError> {
        if self.queue.is_closed() {
            self.close();
            return Err(GateError::Closed);
        }
        // Each member is in the priority lane at most once, so this bounds stale entries.
        for _ in 0..=self.gates.len() {
            let Some(index) = self.queue.pop_priority() else {
                return Ok(None);
            };
            let read = self.gates[index as usize].poll_priority_event();
            // The member stays in turn for what it still holds, in the lane its head asks for
            // (the data lane for a stale entry).
            let gate = &self.gates[index as usize];
            if gate.queue().has_channels() {
                self.queue.enqueue(index, gate.queue().has_priority());
            }
            let offset = self.offsets[index as usize];
            match read {
                Err(GateError::Closed) => {
                    self.close();
                    return Err(GateError::Closed);
                }
                Err(error) => return Err(error.offset_channel(offset)),
                Ok(None) => continue,
                Ok(Some(mut item)) => {
                    item.channel += offset;
                    item.more_available = self.queue.has_channels();
                    return Ok(Some(item));
                }
            }
        }
        Ok(None)
    }

    fn has_priority_event(&self) -> bool {
        self.queue.has_priority()
    }

    fn end_of_data_status(&self) -> EndOfDataStatus {
        let mut status = EndOfDataStatus::Drained;
        for gate in &self.gates {
            match gate.end_of_data_status() {
                EndOfDataStatus::NotEndOfData => return EndOfDataStatus::NotEndOfData,
                EndOfDataStatus::Stopped => status = EndOfDataStatus::Stopped,
                EndOfDataStatus::Drained => {}
            }
        }
        status
    }

    fn acknowledge_all_records_processed(&mut self, channel: usize) -> Result<(), GateError> {
        let (gate, local) = self
            .locate(channel)
            .ok_or(GateError::NoSuchChannel(channel))?;
        self.gates[gate]
            .acknowledge_all_records_processed(local)
            .map_err(|error| error.offset_channel(self.offsets[gate]))
    }

    fn next_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<BufferOrEvent>, GateError> {
        super::read_until(
            self,
            deadline,
            |union| union.poll_timeout(),
            |union, sleep| union.queue.wait(sleep),
        )
    }

    fn resume_consumption(&mut self, channel: usize) -> Result<(), GateError> {
        let (gate, local) = self
            .locate(channel)
            .ok_or(GateError::NoSuchChannel(channel))?;
        self.gates[gate]
            .resume_consumption(local)
            .map_err(|error| error.offset_channel(self.offsets[gate]))
    }

    fn channel_count(&self) -> usize {
        self.gates.iter().map(|g| g.channel_count()).sum()
    }

    fn take_unread_before_priority(&mut self, channel: usize) -> usize {
        self.locate(channel).map_or(0, |(gate, local)| {
            self.gates[gate].take_unread_before_priority(local)
        })
    }

    fn for_each_new_announcement(
        &mut self,
        rescan: bool,
        f: &mut dyn FnMut(usize, CheckpointBarrier),
    ) {
        for (gate, offset) in self.gates.iter_mut().zip(&self.offsets) {
            gate.for_each_new_announcement(rescan, &mut |channel, barrier| {
                f(offset + channel, barrier)
            });
        }
    }

    fn convert_barrier_to_priority(&mut self, channel: usize, checkpoint: u64) -> bool {
        self.locate(channel).is_some_and(|(gate, local)| {
            self.gates[gate].convert_barrier_to_priority(local, checkpoint)
        })
    }

    fn for_each_taken_ahead(&self, channel: usize, f: &mut dyn FnMut(&crate::buffer::Buffer)) {
        if let Some((gate, local)) = self.locate(channel) {
            self.gates[gate].for_each_taken_ahead(local, f);
        }
    }

    fn is_finished(&self) -> bool {
        self.gates.iter().all(|g| g.is_finished())
    }

    fn is_channel_finished(&self, channel: usize) -> bool {
        self.locate(channel)
            .is_none_or(|(gate, local)| self.gates[gate].is_channel_finished(local))
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.gates.iter().filter_map(|g| g.poll_timeout()).min()
    }

    fn register_waker(&self, waker: &std::task::Waker) -> bool {
        self.queue.register_waker(waker)
    }

    fn idle_time(&self) -> &WaitTime {
        &self.metrics.idle
    }

    fn handle_timeout(&mut self, now: Instant) -> Result<(), GateError> {
        if self.queue.is_closed() {
            // Closed from another thread (the blocking read comes here first after the close
            // woke it): the members' channels are released here, on the reader.
            self.close();
            return Err(GateError::Closed);
        }
        for index in 0..self.gates.len() {
            let handled = self.gates[index].handle_timeout(now);
            handled.map_err(|error| self.member_failed(index, error))?;
        }
        Ok(())
    }
}
