//! `ShuffleEnvironment`: one per process. It owns the network memory, the partition manager,
//! the I/O thread with its listening server, and the connection manager (one connection per
//! peer and connection index, opened on the first partition request and shared by every
//! channel between the two processes). Partitions and gates are created through it.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::buffer::{NetworkBufferPool, PoolError};
use crate::config::{NetworkConfig, SecretError};
use crate::gate::{
    ChannelLocation, ChannelSpec, ConsumedSubpartition, GateError, InputChannel, SingleInputGate,
};
use crate::io::epoll::EpollDriver;
use crate::io::tls::{TlsContext, TlsError};
use crate::io::uring::{self, UringDriver};
use crate::io::{Command, DriverConfig, DriverHandle, Transport};
use crate::partition::{PartitionError, PartitionManager, ResultPartition, ResultPartitionId};
use crate::protocol::{ClientConfig, RequestRate, ServerConfig};

/// Why the environment could not start or build something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// Network memory could not be set up.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Binding the server or starting the I/O thread failed.
    #[error("starting the network failed: {0}")]
    Io(#[from] std::io::Error),
    /// The requested transport is not available here.
    #[error("transport {0:?} is not available: {1}")]
    Transport(Transport, String),
    /// A partition could not be created or registered.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// A gate could not be set up.
    #[error(transparent)]
    Gate(#[from] GateError),
    /// Authentication is on and no usable secret is configured (`fluxgate.security.*`).
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// TLS is on (`security.ssl.internal.enabled`) and its certificates cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The environment's I/O thread has stopped (an OS error or a panic ended it): nothing it
    /// creates could be served or connected.
    #[error("the network's I/O thread has stopped")]
    Stopped,
    /// An `EnvConfig` field the environment cannot work with.
    #[error("EnvConfig::{field}: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// Longest `partition_request_timeout` and `connect_timeout` (a day): deadlines are computed
/// from them on the I/O thread, which must not overflow.
const MAX_ENV_TIMEOUT: Duration = Duration::from_secs(86_400);

/// Settings of one process's network.
#[derive(Clone, Debug)]
pub struct EnvConfig {
    /// Memory and channel options.
    pub network: NetworkConfig,
    /// Where the server listens (`taskmanager.data.port`; port 0 picks one).
    pub bind: SocketAddr,
    /// Which driver moves the bytes.
    pub transport: Transport,
    /// This process's identity in handshakes.
    pub node: u128,
    /// `taskmanager.network.max-num-tcp-connections`: connections per peer (default 1).
    pub connections_per_peer: usize,
    /// `taskmanager.network.partition-request-timeout` (10 s).
    pub partition_request_timeout: Duration,
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
}

impl Default for EnvConfig {
    fn default() -> Self {
        Self {
            network: NetworkConfig::default(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            transport: Transport::Auto,
            node: 0,
            connections_per_peer: 1,
            partition_request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Where a gate channel's producer is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProducerLocation {
    /// In this process.
    Local,
    /// In the process listening at this address.
    Remote(SocketAddr),
    /// Not known yet.
    Unknown,
}

/// One channel of a gate to create: what it consumes and from where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelDescriptor {
    /// The subpartition consumed.
    pub consumed: ConsumedSubpartition,
    /// Where its producer runs.
    pub location: ProducerLocation,
}

/// The I/O thread, whichever driver runs it.
#[derive(Debug)]
enum Driver {
    Epoll(EpollDriver),
    Uring(UringDriver),
}

impl Driver {
    /// What both drivers hand out the same way: the command queue, the waker, the address.
    fn handle(&self) -> &DriverHandle {
        match self {
            Driver::Epoll(d) => d.handle(),
            Driver::Uring(d) => d.handle(),
        }
    }

    fn local_addr(&self) -> SocketAddr {
        self.handle().local_addr
    }

    fn shut_down(&mut self) {
        match self {
            Driver::Epoll(d) => d.handle_mut().shut_down(),
            Driver::Uring(d) => d.handle_mut().shut_down(),
        }
    }

    fn submit(&self, command: Command) {
        self.handle().submit(command);
    }
}

/// The network of one process (Flink's `NettyShuffleEnvironment`).
pub struct ShuffleEnvironment {
    config: EnvConfig,
    network: NetworkBufferPool,
    manager: Arc<PartitionManager>,
    driver: Driver,
    transport: Transport,
}

impl Drop for ShuffleEnvironment {
    /// Stops the I/O thread, then releases the partitions it served, as Flink's environment
    /// shuts its connection manager down before its partition manager: consumers see their
    /// connections close, and a writer whose partition no consumer had asked for yet (which
    /// would otherwise wait for room in it for good) fails with `Released`.
    fn drop(&mut self) {
        self.driver.shut_down();
        self.manager.release_all();
    }
}

impl fmt::Debug for ShuffleEnvironment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShuffleEnvironment")
            .field("local_addr", &self.local_addr())
            .field("transport", &self.transport)
            .field("network", &self.network)
            .finish()
    }
}

/// The cluster secret and the TLS context the configuration asks for.
struct Security {
    secret: Option<Arc<crate::protocol::Secret>>,
    tls: Option<Arc<TlsContext>>,
}

impl Security {
    /// Read and checked for a server bound to `bound` (`fluxgate.security.auth = auto` turns
    /// authentication on for a non-loopback address).
    fn from_config(config: &EnvConfig, bound: SocketAddr) -> Result<Self, EnvError> {
        let secret = config.network.resolve_secret(bound)?.map(Arc::new);
        if secret.is_some() {
            tracing::info!(%bound, "connections authenticate with the cluster secret");
        }
        let tls = TlsContext::from_config(&config.network)?.map(Arc::new);
        if tls.is_some() {
            if config.transport == Transport::Uring {
                return Err(EnvError::Transport(
                    Transport::Uring,
                    "TLS (security.ssl.internal.enabled) runs on the epoll driver only; \
                     choose transport epoll or auto"
                        .into(),
                ));
            }
            tracing::info!(%bound, "connections run over mutual TLS with the cluster CA");
        }
        Ok(Self { secret, tls })
    }
}

/// The environment's timeouts are within what its loops can wait for.
fn check_timeouts(config: &EnvConfig) -> Result<(), EnvError> {
    for (field, value, zero_allowed) in [
        (
            "partition_request_timeout",
            config.partition_request_timeout,
            true,
        ),
        ("connect_timeout", config.connect_timeout, false),
    ] {
        if value > MAX_ENV_TIMEOUT || (value.is_zero() && !zero_allowed) {
            return Err(EnvError::Config {
                field,
                reason: format!(
                    "{value:?}: must be {}",
                    if zero_allowed {
                        "at most a day"
                    } else {
                        "above zero and at most a day"
                    }
                ),
            });
        }
    }
    Ok(())
}

impl ShuffleEnvironment {
    /// Maps the network memory, binds the server and starts the I/O thread. Fails when
    /// authentication is on (`fluxgate.security.auth`) and no secret is configured, when TLS
    /// is on (`security.ssl.internal.enabled`) and its files cannot be used, and when TLS is
    /// on with `transport = uring` (TLS runs on the epoll driver only).
    pub fn start(config: EnvConfig) -> Result<Self, EnvError> {
        check_timeouts(&config)?;
        // The configuration's own errors first, whether or not the port is free.
        let security = Security::from_config(&config, config.bind)?;
        // Bound before the network memory is mapped, whichever driver serves it: a port in
        // use is `EnvError::Io` at once, not a failed driver, and auto's fallback does not
        // bind again.
        let listener = std::net::TcpListener::bind(config.bind)?;
        Self::serve(listener, config, security)
    }

    /// As [`start`](Self::start), serving on `listener`, which the caller bound (a socket
    /// handed over by a service manager, a port a resource manager reserved); `config.bind`
    /// is not used. Whether connections must authenticate (`fluxgate.security.auth = auto`)
    /// follows the listener's address. Blocking or not, it serves: the driver sets the mode
    /// its accept needs (blocking for io_uring, non-blocking for epoll) on the socket, which
    /// a copy of it the caller kept shares.
    pub fn start_on(listener: std::net::TcpListener, config: EnvConfig) -> Result<Self, EnvError> {
        check_timeouts(&config)?;
        let security = Security::from_config(&config, listener.local_addr()?)?;
        Self::serve(listener, config, security)
    }

    fn serve(
        listener: std::net::TcpListener,
        config: EnvConfig,
        security: Security,
    ) -> Result<Self, EnvError> {
        let Security { secret, tls } = security;
        let network = NetworkBufferPool::new(&config.network)?;
        let manager = Arc::new(PartitionManager::new());
        let options = &config.network;
        if options.partition_request_rate > 0
            && (options.partition_request_burst as usize) < options.max_channels_per_connection
        {
            tracing::warn!(
                burst = options.partition_request_burst,
                max_channels = options.max_channels_per_connection,
                "fluxgate.network.partition-request-burst is below max-channels-per-connection: \
                 a consumer opening every channel of one connection at once will be refused"
            );
        }
        let driver_config = DriverConfig {
            node: config.node,
            segment_size: options.segment_size,
            server: ServerConfig {
                node: config.node,
                segment_size: options.segment_size,
                max_channels: options.max_channels_per_connection,
                partition_request_timeout: config.partition_request_timeout,
                max_frame_size: options.max_frame_size(),
                request_rate: RequestRate {
                    per_second: options.partition_request_rate,
                    burst: options.partition_request_burst,
                },
                secret: secret.clone(),
                handshake_timeout: options.handshake_timeout,
                ..ServerConfig::default()
            },
            client: ClientConfig {
                node: config.node,
                max_channels: options.max_channels_per_connection,
                segment_size: options.segment_size,
                max_frame_size: options.max_frame_size(),
                handshake_timeout: options.handshake_timeout,
                secret,
            },
            max_connections: options.max_connections,
            connect_timeout: config.connect_timeout,
            request_backoff: config.network.request_backoff(),
            liveness: crate::io::Liveness::from_config(&config.network),
            network: Some(network.clone()),
            tls: tls.clone(),
            zero_copy_send: options.zero_copy_send,
            busy_poll: options.io_thread_busy_poll,
        };
        let (driver, transport) = match config.transport {
            Transport::Epoll => {
                tracing::info!(transport = ?Transport::Epoll, "network transport chosen: requested");
                let driver = EpollDriver::start(listener, driver_config, manager.clone())?;
                (Driver::Epoll(driver), Transport::Epoll)
            }
            Transport::Uring => {
                uring::probe().map_err(|reason| EnvError::Transport(Transport::Uring, reason))?;
                let driver = UringDriver::start(listener, driver_config, manager.clone()).map_err(
                    |error| {
                        EnvError::Transport(
                            Transport::Uring,
                            format!("starting the io_uring driver failed: {error}"),
                        )
                    },
                )?;
                tracing::info!(transport = ?Transport::Uring, "network transport chosen: requested");
                (Driver::Uring(driver), Transport::Uring)
            }
            Transport::Auto if tls.is_some() => {
                tracing::info!(
                    transport = ?Transport::Epoll,
                    "network transport chosen: auto, TLS is on and runs on the epoll driver only"
                );
                let driver = EpollDriver::start(listener, driver_config, manager.clone())?;
                (Driver::Epoll(driver), Transport::Epoll)
            }
            Transport::Auto => {
                let started = uring::probe().and_then(|()| {
                    // A second descriptor of the one socket: a failed start closes only it.
                    let listener = listener
                        .try_clone()
                        .map_err(|error| format!("sharing the listener failed: {error}"))?;
                    UringDriver::start(listener, driver_config.clone(), manager.clone())
                        .map_err(|error| format!("starting the io_uring driver failed: {error}"))
                });
                match started {
                    Ok(driver) => {
                        tracing::info!(
                            transport = ?Transport::Uring,
                            "network transport chosen: auto, io_uring is available"
                        );
                        (Driver::Uring(driver), Transport::Uring)
                    }
                    Err(reason) => {
                        tracing::info!(
                            transport = ?Transport::Epoll,
                            %reason,
                            "network transport chosen: auto, io_uring is not usable"
                        );
                        let driver = EpollDriver::start(listener, driver_config, manager.clone())?;
                        (Driver::Epoll(driver), Transport::Epoll)
                    }
                }
            }
        };
        Ok(Self {
            config,
            network,
            manager,
            driver,
            transport,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.driver.local_addr()
    }

    /// The driver in use.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The network memory.
    pub fn network(&self) -> &NetworkBufferPool {
        &self.network
    }

    /// The registry of this process's produced partitions.
    pub fn partition_manager(&self) -> &Arc<PartitionManager> {
        &self.manager
    }

    /// The configuration.
    pub fn config(&self) -> &EnvConfig {
        &self.config
    }

    /// False once the I/O thread has stopped: an OS error or a panic ended its loop (it logs
    /// why). Partitions and remote gates are refused from then on (`EnvError::Stopped`).
    pub fn is_running(&self) -> bool {
        !self.driver.handle().waker.is_stopped()
    }

    /// Creates and registers a pipelined partition with `subpartitions` subpartitions.
    pub fn create_partition(
        &self,
        id: ResultPartitionId,
        subpartitions: usize,
    ) -> Result<ResultPartition, EnvError> {
        // No consumer could reach it: its writer would wait for room for good.
        if !self.is_running() {
            return Err(EnvError::Stopped);
        }
        let partition =
            ResultPartition::new(id, subpartitions, &self.network, &self.config.network)?;
        self.manager.register(partition.handle())?;
        Ok(partition)
    }

    /// Creates a gate over `channels`, sets it up, requests its partitions and connects its
    /// remote channels (connection index = channel index modulo connections per peer).
    pub fn create_gate(&self, channels: &[ChannelDescriptor]) -> Result<SingleInputGate, EnvError> {
        // A channel that is or may turn remote would never be connected.
        if !self.is_running()
            && channels
                .iter()
                .any(|c| !matches!(c.location, ProducerLocation::Local))
        {
            return Err(EnvError::Stopped);
        }
        let specs = channels
            .iter()
            .map(|c| ChannelSpec {
                consumed: c.consumed,
                location: match c.location {
                    ProducerLocation::Local => ChannelLocation::Local,
                    ProducerLocation::Remote(_) => ChannelLocation::Remote,
                    ProducerLocation::Unknown => ChannelLocation::Unknown,
                },
            })
            .collect();
        let mut gate = SingleInputGate::new(
            specs,
            self.manager.clone(),
            &self.network,
            &self.config.network,
        );
        gate.set_connected_by_environment();
        gate.setup()?;
        gate.request_partitions(Instant::now())?;
        for (index, descriptor) in channels.iter().enumerate() {
            if let ProducerLocation::Remote(peer) = descriptor.location {
                self.connect(&gate, index, peer);
            }
        }
        Ok(gate)
    }

    /// Locates an unknown channel of `gate` (lazy scheduling): it becomes local or remote and
    /// is requested.
    pub fn update_channel(
        &self,
        gate: &mut SingleInputGate,
        index: usize,
        location: ProducerLocation,
    ) -> Result<(), EnvError> {
        let (channel_location, peer) = match location {
            ProducerLocation::Local => (ChannelLocation::Local, None),
            ProducerLocation::Remote(peer) => (ChannelLocation::Remote, Some(peer)),
            ProducerLocation::Unknown => return Ok(()),
        };
        // Only a channel this call locates is connected: one already located (a repeated
        // update, or a channel created remote) is registered on its connection already, and
        // a second registration would request its subpartition twice, which fails it.
        let was_unknown = matches!(gate.channel(index), Some(InputChannel::Unknown(_)));
        gate.locate_channel(index, channel_location, Instant::now())?;
        if let (true, Some(peer)) = (was_unknown, peer) {
            self.connect(gate, index, peer);
        }
        Ok(())
    }

    /// Every connection's state as text (diagnostics; waits up to a second for the I/O thread).
    pub fn debug_dump(&self) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        self.driver.submit(Command::Dump(tx));
        rx.recv_timeout(Duration::from_secs(1))
            .unwrap_or_else(|_| "the I/O thread did not answer".into())
    }

    /// The I/O thread's operation counts (diagnostics and tests: sleeps, zero-copy sends,
    /// registered files); `None` when the I/O thread did not answer within a second.
    pub fn driver_stats(&self) -> Option<crate::io::DriverStats> {
        self.driver_stats_within(Duration::from_secs(1))
    }

    /// [`driver_stats`](Self::driver_stats) waiting up to `timeout` for the I/O thread: a
    /// loaded machine may keep a live thread from answering within a second.
    pub fn driver_stats_within(&self, timeout: Duration) -> Option<crate::io::DriverStats> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.driver.submit(Command::Stats(tx));
        rx.recv_timeout(timeout).ok()
    }

    fn connect(&self, gate: &SingleInputGate, index: usize, peer: SocketAddr) {
        if let Some(InputChannel::Remote(channel)) = gate.channel(index) {
            self.driver.submit(Command::Connect {
                peer,
                connection_index: index % self.config.connections_per_peer.max(1),
                channel: channel.shared().clone(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{mpsc, Mutex};

    /// A producer's task-event listener that blocks the I/O thread calling it until told.
    struct BlockingListener {
        entered: Mutex<mpsc::Sender<()>>,
        release: Mutex<mpsc::Receiver<()>>,
    }

    impl crate::partition::TaskEventListener for BlockingListener {
        fn on_task_event(&self, _event: &crate::event::Event) {
            let _ = self.entered.lock().unwrap().send(());
            let _ = self
                .release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
        }
    }

    /// An environment dropped while its I/O thread is stuck (in a producer's task-event
    /// listener) and its command queue full cannot queue the shutdown and does not wait; the
    /// thread still ends, closing its listener, once the listener returns. It ran on for good
    /// (the address kept accepting connections).
    #[test]
    fn a_stuck_io_thread_ends_when_it_comes_back_after_the_environment_was_dropped() {
        stuck_io_thread_ends_after_the_drop(Transport::Epoll);
        stuck_io_thread_ends_after_the_drop(Transport::Uring);
    }

    fn stuck_io_thread_ends_after_the_drop(transport: Transport) {
        let env = match ShuffleEnvironment::start(EnvConfig {
            transport,
            ..EnvConfig::default()
        }) {
            Ok(env) => env,
            Err(error) if transport == Transport::Uring => {
                eprintln!("SKIPPED on io_uring: the kernel refuses it here ({error})");
                return;
            }
            Err(error) => panic!("{error}"),
        };
        let addr = env.local_addr();
        let id = ResultPartitionId {
            partition: 1,
            producer: 1,
        };
        let partition = env.create_partition(id, 1).unwrap();
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        env.manager.subscribe_task_events(
            id,
            Arc::new(BlockingListener {
                entered: Mutex::new(entered_tx),
                release: Mutex::new(release_rx),
            }),
        );
        let mut gate = env
            .create_gate(&[ChannelDescriptor {
                consumed: crate::gate::ConsumedSubpartition {
                    partition: id,
                    subpartition: 0,
                },
                location: ProducerLocation::Remote(addr),
            }])
            .unwrap();
        gate.send_task_event(&crate::event::Event::Task(b"block".to_vec()))
            .unwrap();
        entered
            .recv_timeout(Duration::from_secs(20))
            .expect("the I/O thread calls the listener");
        let handle = env.driver.handle();
        let waker = handle.waker.clone();
        let commands = handle.commands.clone();
        // Bounded by the queue's capacity.
        while commands.push(Command::Dump(mpsc::channel().0)).is_ok() {}
        drop(env);
        assert!(!waker.is_stopped(), "the thread is still in the listener");
        release.send(()).unwrap();
        // Bounded wait for the loop's end (it stops when it comes back to its loop) and for
        // its listener to close (as the loop's state drops, after it stopped).
        let deadline = Instant::now() + Duration::from_secs(20);
        let ended = || waker.is_stopped() && std::net::TcpStream::connect(addr).is_err();
        while !ended() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            waker.is_stopped(),
            "{transport:?}: the I/O thread ran on after the drop"
        );
        assert!(
            ended(),
            "{transport:?}: the dropped environment's address still accepts connections"
        );
        drop((gate, partition));
    }

    #[test]
    fn an_environment_whose_io_thread_stopped_refuses_what_it_could_not_serve() {
        let mut env = ShuffleEnvironment::start(EnvConfig {
            transport: Transport::Epoll,
            ..EnvConfig::default()
        })
        .unwrap();
        let id = |partition| ResultPartitionId {
            partition,
            producer: 1,
        };
        let local = ChannelDescriptor {
            consumed: crate::gate::ConsumedSubpartition {
                partition: id(1),
                subpartition: 0,
            },
            location: ProducerLocation::Local,
        };
        let remote = ChannelDescriptor {
            location: ProducerLocation::Remote(env.local_addr()),
            ..local
        };
        assert!(env.is_running());
        // As an OS error or a panic ends the loop.
        env.driver.shut_down();
        assert!(!env.is_running());
        assert!(matches!(
            env.create_partition(id(2), 1),
            Err(EnvError::Stopped)
        ));
        assert!(matches!(env.create_gate(&[remote]), Err(EnvError::Stopped)));
        // Local channels need no I/O thread.
        let partition = ResultPartition::new(id(1), 1, &env.network, &env.config.network).unwrap();
        env.manager.register(partition.handle()).unwrap();
        let gate = env.create_gate(&[local]).unwrap();
        drop((gate, partition));
        assert_eq!(
            env.network.available_segments(),
            env.network.total_segments()
        );
    }
}
