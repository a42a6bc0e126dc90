//! Drivers: the only place that touches sockets. Each I/O thread owns a set of connections
//! for their whole life and pumps their protocol state machines (`protocol/`); task threads
//! never touch a socket. Two drivers over the same segments and the same state machines:
//!
//! * [`epoll`] — mio (epoll), vectored reads and writes; works everywhere.
//! * [`uring`] — io_uring: one ring per I/O thread, one read and at most one write chain in
//!   flight per connection, every submission of a loop turn in one `io_uring_enter`.
//!
//! Hand-off from task threads: commands go through a bounded queue; a parked I/O thread is
//! woken through the poller's waker only when its "parked" flag is set, so the busy path makes
//! no syscall.

mod conn;
pub mod epoll;
pub mod uring;
// Public only under `--cfg loom`, for the models in `tests/loom.rs`.
#[cfg(not(loom))]
mod waker;
#[cfg(loom)]
#[doc(hidden)]
pub mod waker;

pub(crate) use waker::IoWaker;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::buffer::NetworkBufferPool;
use crate::gate::RemoteChannelShared;
use crate::protocol::ServerConfig;
use crate::sync::ArrayQueue;

/// What an I/O thread needs to know (either driver).
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// This process's node identity.
    pub node: u128,
    /// Payload bytes per segment.
    pub segment_size: usize,
    /// Producer-side connection settings.
    pub server: ServerConfig,
    /// Channels one outgoing connection may carry.
    pub max_channels_per_connection: usize,
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// The network memory the segments come from. The io_uring driver registers its arenas
    /// as fixed buffers and writes segment bytes in place; without it every byte it writes is
    /// copied first. The epoll driver ignores it.
    pub network: Option<NetworkBufferPool>,
}

/// Which driver moves the bytes (`fluxgate.network.transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Transport {
    /// io_uring where the kernel allows it, else epoll.
    #[default]
    Auto,
    /// io_uring only.
    Uring,
    /// epoll (mio).
    Epoll,
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Transport::Auto),
            "uring" | "io_uring" => Ok(Transport::Uring),
            "epoll" => Ok(Transport::Epoll),
            other => Err(format!(
                "unknown transport `{other}` (auto | uring | epoll)"
            )),
        }
    }
}

/// Work handed to an I/O thread.
pub(crate) enum Command {
    /// Register a remote channel on the connection to `peer` (opened on first use).
    Connect {
        peer: SocketAddr,
        connection_index: usize,
        channel: Arc<RemoteChannelShared>,
    },
    /// Report every connection's state (diagnostics).
    Dump(std::sync::mpsc::Sender<String>),
    /// Close every connection and end the thread.
    Shutdown,
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Connect { peer, .. } => write!(f, "Connect({peer})"),
            Command::Dump(_) => f.write_str("Dump"),
            Command::Shutdown => f.write_str("Shutdown"),
        }
    }
}

/// The wake-up action of a parked I/O thread (an eventfd or mio waker write).
pub(crate) type WakeFn = Box<dyn Fn() + Send + Sync>;

/// What task threads hold of a running I/O thread (either driver): its command queue, its
/// waker and the thread. Dropping it shuts the thread down and waits for it.
pub(crate) struct DriverHandle {
    pub(crate) commands: Arc<ArrayQueue<Command>>,
    pub(crate) waker: Arc<IoWaker<WakeFn>>,
    pub(crate) thread: Option<thread::JoinHandle<()>>,
    pub(crate) local_addr: SocketAddr,
}

impl DriverHandle {
    /// Hands a command to the I/O thread. Blocks (bounded) only if its queue is full.
    pub(crate) fn submit(&self, command: Command) {
        self.waker.submit(&self.commands, command);
    }
}

impl Drop for DriverHandle {
    fn drop(&mut self) {
        self.submit(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
