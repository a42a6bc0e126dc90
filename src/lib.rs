//! # fluxgate
//!
//! Apache Flink's network stack — result partitions, input gates and credit-based flow
//! control — rebuilt for Linux around io_uring, a pool of registered fixed memory segments and
//! lock-free queues.
//!
//! ## The data path
//!
//! ```text
//!  producer task                         I/O thread (one ring)                  consumer task
//!  RecordWriter.emit(rec)                loop {                                 gate.next()
//!   └ serialize into the current           drain ready readers with credit        ▲ channels with data
//!     BufferBuilder (a pooled segment)     header into the segment's headroom     │
//!   └ full / flush / event: the            send [header|payload] ──── TCP ────▶ payload lands in the
//!     subpartition's queue                 on completion: recycle segment         channel's reserved segment
//!  backpressure = no free segment        }                                       drop → segment back → credit
//! ```
//!
//! Layers, bottom up (each its own module):
//!
//! * [`buffer`] — the [`NetworkBufferPool`](buffer::NetworkBufferPool) maps all network memory
//!   at start as a few arenas cut into fixed segments (each with 64 bytes of headroom for a
//!   frame header); [`LocalBufferPool`](buffer::LocalBufferPool)s give partitions and gates
//!   their quota; [`BufferBuilder`](buffer::BufferBuilder) / [`BufferConsumer`](buffer::BufferConsumer)
//!   / [`Buffer`](buffer::Buffer) lease segments and recycle them on the last drop.
//! * [`record`] — `[varint length | bytes]` records serialized straight into segments, spanning
//!   segments when they must; a deserializer yielding borrowed slices.
//! * [`event`] — in-band events (end of partition, checkpoint barriers, ...) and their bytes.
//! * [`partition`] — the producer: result partitions, pipelined subpartitions (lock-free data
//!   and priority lanes, backlog, sequence numbers), views, the record writer and its channel
//!   selectors, the partition manager.
//! * [`gate`] — the consumer: single and union input gates reading channels fairly through a
//!   lock-free queue, local channels (reading the producer's view by reference), remote
//!   channels' credit accounting, barrier alignment, a record reader.
//!
//! * [`protocol`] — the wire format and both ends of a connection as IO-free state machines:
//!   handshake (with the optional HMAC-SHA256 challenge–response of [`protocol::auth`]),
//!   partition requests with Flink's request back-off, credit, BufferResponses straight into
//!   segments, enforced limits (frame size, channels, request rate).
//! * [`io`] — the drivers, the only code touching sockets: io_uring (registered arenas and
//!   files, batched submissions, zero-copy sends to non-loopback peers) and epoll (also the
//!   one that carries optional mutual TLS), both with TCP keepalive and user timeout.
//! * [`env`](mod@env) — [`ShuffleEnvironment`], one per process: the network memory, the I/O thread, the
//!   server, one shared connection per peer, partitions and gates.
//!
//! Small records cost least in batches: [`RecordWriter::emit_all`](partition::RecordWriter::emit_all)
//! (or `emit_all_async`) appends records to their subpartitions' open buffers in runs (one
//! per subpartition at once, up to 16 subpartitions), and [`RecordReader::records_in_buffer`](gate::RecordReader::records_in_buffer)
//! hands out the rest of a buffer's records after the one just read; both keep the buffer's
//! position out of the buffer's shared state (in a register, for one subpartition or one
//! buffer) instead of storing and reloading it there per record. One call per
//! record (`emit`, `next`) works the same, at about twice the tasks' CPU per 8-byte record.
//!
//! Failures are typed: a broken connection fails every channel on it with
//! [`gate::GateError::ConnectionLost`] naming the peer; a released partition makes the writer's
//! next emit return [`partition::PartitionError::Released`]; every segment returns to its pool.
//!
//! Configuration options carry Flink's names; see [`config::NetworkConfig`].

pub mod buffer;
pub mod config;
pub mod env;
pub mod event;
pub mod flusher;
pub mod gate;
pub mod io;
pub mod metrics;
pub mod partition;
pub mod protocol;
pub mod record;
mod wake_timer;
// Public only under `--cfg loom`, for the models in `tests/loom.rs`.
#[cfg(not(loom))]
mod sync;
#[cfg(loom)]
#[doc(hidden)]
pub mod sync;

pub use config::{NetworkConfig, ZeroCopySend};
pub use env::{ChannelDescriptor, EnvConfig, ProducerLocation, ShuffleEnvironment};
