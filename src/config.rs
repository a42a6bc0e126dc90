//! Configuration: every option with the name Flink gives it where one matches, its default,
//! and the relations between options checked in one place.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::protocol::auth::{Secret, MIN_SECRET_LEN};
use crate::protocol::frame::BUFFER_RESPONSE_HEADER;

/// The name node certificates carry and consumers check (`security.ssl.internal.server-name`).
pub const DEFAULT_SSL_SERVER_NAME: &str = "fluxgate-node";

/// Longest `fluxgate.network.io-thread.busy-poll-us`: an I/O thread still sleeps after a
/// second without work.
const MAX_BUSY_POLL_US: usize = 1_000_000;

/// The environment variable holding the cluster secret when no secret file is configured.
pub const SECRET_ENV: &str = "FLUXGATE_SECRET";

/// Why a configuration value was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// No option has this name.
    #[error("unknown option `{0}`")]
    UnknownOption(String),
    /// The value does not parse or is out of range.
    #[error("invalid value `{value}` for `{key}`: {reason}")]
    InvalidValue {
        /// The option.
        key: String,
        /// What was given.
        value: String,
        /// What was wrong with it.
        reason: String,
    },
}

/// Whether connections authenticate (`fluxgate.security.auth`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum AuthMode {
    /// On when the server binds a non-loopback address, off on loopback (benchmarks and
    /// tests on one machine).
    #[default]
    Auto,
    /// Always: a secret must be configured, and every peer must prove it knows it.
    On,
    /// Never: no handshake proof is asked or given (a peer that requires one refuses us).
    Off,
}

impl AuthMode {
    /// Whether a server bound to `bind` authenticates.
    pub fn is_on_for(self, bind: SocketAddr) -> bool {
        match self {
            AuthMode::On => true,
            AuthMode::Off => false,
            AuthMode::Auto => !bind.ip().is_loopback(),
        }
    }
}

impl std::str::FromStr for AuthMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(AuthMode::Auto),
            "on" | "true" => Ok(AuthMode::On),
            "off" | "false" => Ok(AuthMode::Off),
            other => Err(format!("unknown mode `{other}` (auto | on | off)")),
        }
    }
}

/// Whether the io_uring driver sends large segments with zero-copy sends
/// (`fluxgate.network.zero-copy-send`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ZeroCopySend {
    /// Where it can pay: the kernel supports `IORING_OP_SEND_ZC`, the peer is not a loopback
    /// address, the write carries at least 16 KiB of segment bytes, and the connection's
    /// notifications have not reported that the kernel copied anyway.
    #[default]
    Auto,
    /// Never: every write is a plain (copying) send.
    Off,
    /// For tests and measurements: every write of at least 16 KiB of segment bytes, loopback
    /// peers included, and never switched off (where the kernel copies anyway, this only
    /// adds the cost of the notifications).
    Always,
}

impl std::str::FromStr for ZeroCopySend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ZeroCopySend::Auto),
            "off" | "false" => Ok(ZeroCopySend::Off),
            "always" => Ok(ZeroCopySend::Always),
            other => Err(format!("unknown mode `{other}` (auto | off | always)")),
        }
    }
}

/// Most buffers any of the buffer-count options may name (per channel, per gate): 2 GiB of
/// 32 KiB segments, far beyond a useful setting, and small enough that sizes computed from it
/// cannot overflow.
const MAX_BUFFER_COUNT: usize = 1 << 16;

/// Longest timeout an option may hold (a day): deadlines computed from it must not overflow.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// Network memory and exchange options of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// `taskmanager.memory.segment-size`: payload bytes per segment, a power of two from 4 KiB
    /// to 1 MiB (default 32 KiB). Each segment also reserves [`crate::buffer::HEADROOM`] bytes.
    pub segment_size: usize,
    /// `taskmanager.memory.network.max`: total payload bytes of network memory, allocated at
    /// start (default 64 MiB).
    pub network_memory_bytes: usize,
    /// Bytes per arena (one io_uring fixed buffer each; at most 1 GiB; default 64 MiB).
    pub arena_bytes: usize,
    /// `taskmanager.network.memory.buffers-per-channel`: exclusive buffers per remote input
    /// channel (default 2).
    pub buffers_per_channel: usize,
    /// `taskmanager.network.memory.floating-buffers-per-gate`: buffers an input gate shares
    /// among its channels on demand (default 8).
    pub floating_buffers_per_gate: usize,
    /// `taskmanager.network.memory.max-buffers-per-channel`: most buffers one subpartition may
    /// hold, so a skewed one backpressures instead of taking the whole pool (default 10).
    pub max_buffers_per_channel: usize,
    /// `taskmanager.network.memory.max-overdraft-buffers-per-gate`: segments a result
    /// partition may take beyond its pool (at most the pool's maximum, counted with events'
    /// overdraft) to finish a record it already started when the pool is used up (default
    /// 5), so its task does not stop inside a record under back pressure; a record that
    /// needs a new buffer still waits for the pool before it starts. 0: a record longer than
    /// the segment it found waits in the middle, as before Flink 1.16.
    pub max_overdraft_buffers_per_gate: usize,
    /// `taskmanager.network.memory.exclusive-buffers-request-timeout-ms` (default 30 s).
    pub buffer_request_timeout: Duration,
    /// Largest record a deserializer accepts; a longer length prefix is a corrupt stream
    /// (default 64 MiB).
    pub max_record_bytes: usize,
    /// `taskmanager.network.request-backoff.initial`: the first delay before a partition
    /// request (or a refused connection) is retried (default 100 ms).
    pub request_backoff_initial: Duration,
    /// `taskmanager.network.request-backoff.max`: the delay doubles up to this, and a request
    /// still refused after a retry at this delay fails with PartitionNotFound (or a transport
    /// error for a refused connection) (default 10 s).
    pub request_backoff_max: Duration,
    /// `taskmanager.network.netty.client.tcp.keepIdleSec` (applied to both ends of every
    /// connection here): seconds a connection may be idle before TCP keepalive probes start
    /// (default 5). With the two options below it bounds how long a peer that vanished
    /// without a FIN or RST (host down, cable cut) goes unnoticed on an idle connection.
    pub keepalive_idle: Duration,
    /// `taskmanager.network.netty.client.tcp.keepIntervalSec`: seconds between keepalive
    /// probes (default 1).
    pub keepalive_interval: Duration,
    /// `taskmanager.network.netty.client.tcp.keepCount`: unanswered probes before the
    /// connection is declared dead (default 3).
    pub keepalive_count: u32,
    /// `fluxgate.network.tcp.user-timeout-ms`: how long sent data may stay unacknowledged
    /// before the kernel drops the connection (TCP_USER_TIMEOUT; 0 = the kernel's default of
    /// about 15 minutes of retransmissions) (default 10000). Covers a peer that vanished while
    /// data was in flight, which keepalive does not.
    pub tcp_user_timeout: Duration,
    /// `fluxgate.security.auth`: whether connections prove knowledge of the cluster secret
    /// with an HMAC-SHA256 challenge–response before any partition request is served
    /// (default `auto`: on when binding a non-loopback address, off on loopback).
    pub auth: AuthMode,
    /// `fluxgate.security.secret-file`: the file holding the cluster secret (at least 16
    /// bytes; trailing whitespace and newlines are not part of it). Without one, the secret
    /// comes from the `FLUXGATE_SECRET` environment variable. With authentication on and
    /// neither set, the environment refuses to start.
    pub secret_file: Option<PathBuf>,
    /// `fluxgate.network.handshake-timeout` (ms): longest a connection may take to exchange
    /// handshakes and, with authentication on, proofs; a peer that connects and stays silent
    /// or never proves is closed then, so it cannot hold a `max-connections` slot or a
    /// consumer's requests forever (default 10000).
    pub handshake_timeout: Duration,
    /// `fluxgate.network.max-connections`: most connections a server keeps open at once;
    /// one more is accepted and closed at once, logged (default 1024).
    pub max_connections: usize,
    /// `fluxgate.network.max-channels-per-connection`: most channels one connection carries;
    /// a consumer requesting more gets an ErrorResponse and the connection closes
    /// (default 4096).
    pub max_channels_per_connection: usize,
    /// `fluxgate.network.max-frame-size`: longest frame accepted, header included, checked
    /// when its header arrives, before anything is read or reserved for its body. At least a
    /// segment plus its BufferResponse header; unset: the segment size plus its 64-byte
    /// headroom. Control frames are limited to 1 KiB besides.
    pub max_frame_size: Option<usize>,
    /// `fluxgate.network.partition-request-rate`: partition requests per second one
    /// connection may sustain; faster gets an ErrorResponse and the connection closes
    /// (default 1000; 0 = no limit).
    pub partition_request_rate: u32,
    /// `fluxgate.network.partition-request-burst`: partition requests one connection may send
    /// at once (default 4096; keep it at least `max-channels-per-connection`, or a consumer
    /// opening every channel of a connection at once is refused; the environment warns at
    /// start when it is lower).
    pub partition_request_burst: u32,
    /// `security.ssl.internal.enabled` (alias `fluxgate.security.ssl.enabled`): connections
    /// between nodes run over mutual TLS (rustls): every node presents a certificate signed
    /// by the cluster CA and verifies its peer's against that CA (default false). Runs on the
    /// epoll driver only.
    pub ssl_enabled: bool,
    /// `security.ssl.internal.cert-file`: this node's certificate chain (PEM), leaf first.
    pub ssl_cert_file: Option<PathBuf>,
    /// `security.ssl.internal.key-file`: the private key of that certificate (PEM; PKCS#8,
    /// PKCS#1 or SEC1).
    pub ssl_key_file: Option<PathBuf>,
    /// `security.ssl.internal.ca-file`: the cluster CA certificate(s) (PEM) that peers'
    /// certificates must chain to, in both directions.
    pub ssl_ca_file: Option<PathBuf>,
    /// `security.ssl.internal.server-name`: the name every node certificate carries as a DNS
    /// subject alternative name and a consumer checks on its producer's certificate (default
    /// `fluxgate-node`). Nodes are addressed by IP, so one fixed cluster name stands in for
    /// per-address names.
    pub ssl_server_name: String,
    /// `security.ssl.internal.handshake-timeout` (ms): longest a TLS handshake may take; a
    /// peer that has not completed it by then is closed (default 10 s; Flink's default -1,
    /// the TLS library's own timeout, reads as that).
    pub ssl_handshake_timeout: Duration,
    /// `fluxgate.network.zero-copy-send`: `auto` sends writes of at least 16 KiB of segment
    /// bytes to non-loopback peers with io_uring zero-copy sends (segments held until the
    /// kernel's notification), and turns them off for a connection whose notifications report
    /// that the kernel copied; `off` never uses them; `always` (tests and measurements) uses
    /// them for loopback peers too and never turns them off (default `auto`; the epoll driver
    /// never does).
    pub zero_copy_send: ZeroCopySend,
    /// `fluxgate.network.io-thread.busy-poll-us`: how long an I/O thread keeps looking for
    /// work after its last piece of work before it sleeps, yielding its CPU between looks
    /// (default 0: it sleeps at once). For low-latency deployments with CPU to spare: a thread
    /// that never sleeps needs no wake-up, and where waking a sleeping CPU is slow (a virtual
    /// machine halts an idle vCPU) that is most of a hop's latency. The price is CPU: the
    /// thread spins (in `sched_yield`) through every gap shorter than the window. At most
    /// 1 000 000 (1 s).
    pub io_thread_busy_poll: Duration,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            segment_size: 32 * 1024,
            network_memory_bytes: 64 * 1024 * 1024,
            arena_bytes: 64 * 1024 * 1024,
            buffers_per_channel: 2,
            floating_buffers_per_gate: 8,
            max_buffers_per_channel: 10,
            max_overdraft_buffers_per_gate: 5,
            buffer_request_timeout: Duration::from_secs(30),
            max_record_bytes: 64 * 1024 * 1024,
            request_backoff_initial: Duration::from_millis(100),
            request_backoff_max: Duration::from_secs(10),
            keepalive_idle: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(1),
            keepalive_count: 3,
            tcp_user_timeout: Duration::from_secs(10),
            auth: AuthMode::Auto,
            secret_file: None,
            handshake_timeout: Duration::from_secs(10),
            max_connections: 1024,
            max_channels_per_connection: 4096,
            max_frame_size: None,
            partition_request_rate: 1000,
            partition_request_burst: 4096,
            ssl_enabled: false,
            ssl_cert_file: None,
            ssl_key_file: None,
            ssl_ca_file: None,
            ssl_server_name: DEFAULT_SSL_SERVER_NAME.to_owned(),
            ssl_handshake_timeout: Duration::from_secs(10),
            zero_copy_send: ZeroCopySend::Auto,
            io_thread_busy_poll: Duration::ZERO,
        }
    }
}

impl NetworkConfig {
    /// Option names as `fluxgate` accepts them on the command line and in files.
    pub const OPTIONS: &'static [&'static str] = &[
        "taskmanager.memory.segment-size",
        "taskmanager.memory.network.max",
        "fluxgate.memory.arena-size",
        "taskmanager.network.memory.buffers-per-channel",
        "taskmanager.network.memory.floating-buffers-per-gate",
        "taskmanager.network.memory.max-buffers-per-channel",
        "taskmanager.network.memory.max-overdraft-buffers-per-gate",
        "taskmanager.network.memory.exclusive-buffers-request-timeout-ms",
        "fluxgate.record.max-size",
        "taskmanager.network.request-backoff.initial",
        "taskmanager.network.request-backoff.max",
        "taskmanager.network.netty.client.tcp.keepIdleSec",
        "taskmanager.network.netty.client.tcp.keepIntervalSec",
        "taskmanager.network.netty.client.tcp.keepCount",
        "fluxgate.network.tcp.user-timeout-ms",
        "fluxgate.security.auth",
        "fluxgate.security.secret-file",
        "fluxgate.network.handshake-timeout",
        "fluxgate.network.max-connections",
        "fluxgate.network.max-channels-per-connection",
        "fluxgate.network.max-frame-size",
        "fluxgate.network.partition-request-rate",
        "fluxgate.network.partition-request-burst",
        "security.ssl.internal.enabled",
        "fluxgate.security.ssl.enabled",
        "security.ssl.internal.cert-file",
        "security.ssl.internal.key-file",
        "security.ssl.internal.ca-file",
        "security.ssl.internal.server-name",
        "security.ssl.internal.handshake-timeout",
        "fluxgate.network.zero-copy-send",
        "fluxgate.network.io-thread.busy-poll-us",
    ];

    /// Sets one option by name. Sizes accept `k`, `kb`, `m`, `mb`, `g`, `gb` suffixes. The
    /// whole configuration must be valid afterwards; to change options that depend on each
    /// other (a back-off's initial and maximum), use [`set_all`](Self::set_all).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        self.set_all([(key, value)])
    }

    /// Sets several options, then checks the relations between options once: a file's
    /// options in any order (a back-off's initial above the old maximum, with the new
    /// maximum later). Nothing changes when one of them is refused.
    pub fn set_all<K: AsRef<str>, V: AsRef<str>>(
        &mut self,
        options: impl IntoIterator<Item = (K, V)>,
    ) -> Result<(), ConfigError> {
        let mut next = self.clone();
        let mut first = None;
        let mut count = 0;
        for (key, value) in options {
            next.apply(key.as_ref(), value.as_ref())?;
            count += 1;
            if first.is_none() {
                first = Some((key.as_ref().to_owned(), value.as_ref().to_owned()));
            }
        }
        next.validate().map_err(|e| match (e, first) {
            // One option set: a relation it broke is reported as its value's fault.
            (ConfigError::InvalidValue { reason, .. }, Some((key, value))) if count == 1 => {
                ConfigError::InvalidValue { key, value, reason }
            }
            (other, _) => other,
        })?;
        *self = next;
        Ok(())
    }

    /// Parses one option into this configuration, checking only its own value.
    fn apply(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |reason: &str| ConfigError::InvalidValue {
            key: key.to_owned(),
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let size = || parse_size(value).ok_or_else(|| invalid("expected a size like 32kb"));
        let count = || {
            value
                .trim()
                .parse::<usize>()
                .map_err(|_| invalid("expected a non-negative integer"))
        };
        let count32 = || {
            value
                .trim()
                .parse::<u32>()
                .map_err(|_| invalid("expected an integer from 0 to 4294967295"))
        };
        let path = || (!value.trim().is_empty()).then(|| PathBuf::from(value.trim()));
        match key {
            "taskmanager.memory.segment-size" => self.segment_size = size()?,
            "taskmanager.memory.network.max" => self.network_memory_bytes = size()?,
            "fluxgate.memory.arena-size" => self.arena_bytes = size()?,
            "taskmanager.network.memory.buffers-per-channel" => self.buffers_per_channel = count()?,
            "taskmanager.network.memory.floating-buffers-per-gate" => {
                self.floating_buffers_per_gate = count()?
            }
            "taskmanager.network.memory.max-buffers-per-channel" => {
                self.max_buffers_per_channel = count()?
            }
            "taskmanager.network.memory.max-overdraft-buffers-per-gate" => {
                self.max_overdraft_buffers_per_gate = count()?
            }
            "taskmanager.network.memory.exclusive-buffers-request-timeout-ms" => {
                self.buffer_request_timeout = Duration::from_millis(count()? as u64)
            }
            "fluxgate.record.max-size" => self.max_record_bytes = size()?,
            "taskmanager.network.request-backoff.initial" => {
                self.request_backoff_initial = Duration::from_millis(count()? as u64)
            }
            "taskmanager.network.request-backoff.max" => {
                self.request_backoff_max = Duration::from_millis(count()? as u64)
            }
            "taskmanager.network.netty.client.tcp.keepIdleSec" => {
                self.keepalive_idle = Duration::from_secs(count()? as u64)
            }
            "taskmanager.network.netty.client.tcp.keepIntervalSec" => {
                self.keepalive_interval = Duration::from_secs(count()? as u64)
            }
            "taskmanager.network.netty.client.tcp.keepCount" => self.keepalive_count = count32()?,
            "fluxgate.network.tcp.user-timeout-ms" => {
                self.tcp_user_timeout = Duration::from_millis(count()? as u64)
            }
            "fluxgate.security.auth" => {
                self.auth = value.parse().map_err(|reason: String| invalid(&reason))?
            }
            "fluxgate.security.secret-file" => self.secret_file = path(),
            "fluxgate.network.handshake-timeout" => {
                self.handshake_timeout = Duration::from_millis(count()? as u64)
            }
            "fluxgate.network.max-connections" => self.max_connections = count()?,
            "fluxgate.network.max-channels-per-connection" => {
                self.max_channels_per_connection = count()?
            }
            "fluxgate.network.max-frame-size" => self.max_frame_size = Some(size()?),
            "fluxgate.network.partition-request-rate" => self.partition_request_rate = count32()?,
            "fluxgate.network.partition-request-burst" => self.partition_request_burst = count32()?,
            "security.ssl.internal.enabled" | "fluxgate.security.ssl.enabled" => {
                // Any case, as Flink's configuration reads booleans.
                self.ssl_enabled = match value.trim().to_ascii_lowercase().as_str() {
                    "true" | "on" => true,
                    "false" | "off" => false,
                    _ => return Err(invalid("expected true or false")),
                }
            }
            "security.ssl.internal.cert-file" => self.ssl_cert_file = path(),
            "security.ssl.internal.key-file" => self.ssl_key_file = path(),
            "security.ssl.internal.ca-file" => self.ssl_ca_file = path(),
            "security.ssl.internal.handshake-timeout" => {
                // Flink's default, -1, means the TLS library's own timeout: 10 s here.
                self.ssl_handshake_timeout = if value.trim() == "-1" {
                    NetworkConfig::default().ssl_handshake_timeout
                } else {
                    Duration::from_millis(count()? as u64)
                }
            }
            "security.ssl.internal.server-name" => {
                let name = value.trim();
                if rustls::pki_types::DnsName::try_from(name).is_err() {
                    return Err(invalid("expected a DNS name like fluxgate-node"));
                }
                self.ssl_server_name = name.to_owned();
            }
            "fluxgate.network.zero-copy-send" => {
                self.zero_copy_send = value.parse().map_err(|reason: String| invalid(&reason))?
            }
            "fluxgate.network.io-thread.busy-poll-us" => {
                let micros = count()?;
                if micros > MAX_BUSY_POLL_US {
                    return Err(invalid(&format!(
                        "must be at most {MAX_BUSY_POLL_US} (1 s)"
                    )));
                }
                self.io_thread_busy_poll = Duration::from_micros(micros as u64)
            }
            _ => return Err(ConfigError::UnknownOption(key.to_owned())),
        }
        Ok(())
    }

    /// Checks every option's range and the relations between options.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, value: usize, reason: &str| {
            Err(ConfigError::InvalidValue {
                key: key.to_owned(),
                value: value.to_string(),
                reason: reason.to_owned(),
            })
        };
        let s = self.segment_size;
        if !s.is_power_of_two() || !(4096..=1 << 20).contains(&s) {
            return invalid(
                "taskmanager.memory.segment-size",
                s,
                "must be a power of two from 4 KiB to 1 MiB",
            );
        }
        if self.network_memory_bytes < s {
            return invalid(
                "taskmanager.memory.network.max",
                self.network_memory_bytes,
                "must hold at least one segment",
            );
        }
        if self.network_memory_bytes / s > u32::MAX as usize / 2 {
            return invalid(
                "taskmanager.memory.network.max",
                self.network_memory_bytes,
                "too many segments for 31-bit handles",
            );
        }
        if self.arena_bytes < s + crate::buffer::HEADROOM || self.arena_bytes > 1 << 30 {
            return invalid(
                "fluxgate.memory.arena-size",
                self.arena_bytes,
                "must hold one segment and be at most 1 GiB (io_uring's fixed-buffer limit)",
            );
        }
        if self.max_buffers_per_channel == 0 {
            return invalid(
                "taskmanager.network.memory.max-buffers-per-channel",
                0,
                "must be at least 1",
            );
        }
        // Queues and free lists are sized from these counts: beyond any network memory, a
        // value would only make them allocate what no pool can fill.
        for (key, count) in [
            (
                "taskmanager.network.memory.buffers-per-channel",
                self.buffers_per_channel,
            ),
            (
                "taskmanager.network.memory.floating-buffers-per-gate",
                self.floating_buffers_per_gate,
            ),
            (
                "taskmanager.network.memory.max-buffers-per-channel",
                self.max_buffers_per_channel,
            ),
            (
                "taskmanager.network.memory.max-overdraft-buffers-per-gate",
                self.max_overdraft_buffers_per_gate,
            ),
        ] {
            if count > MAX_BUFFER_COUNT {
                return invalid(key, count, "must be at most 65536");
            }
        }
        if self.buffer_request_timeout.is_zero() {
            return invalid(
                "taskmanager.network.memory.exclusive-buffers-request-timeout-ms",
                0,
                "must be at least 1 ms",
            );
        }
        if self.max_record_bytes == 0 || self.max_record_bytes > i32::MAX as usize {
            return invalid(
                "fluxgate.record.max-size",
                self.max_record_bytes,
                "must be from 1 byte to 2 GiB - 1",
            );
        }
        if self.request_backoff_initial.is_zero() {
            return invalid(
                "taskmanager.network.request-backoff.initial",
                0,
                "the initial back-off must be above 0 ms",
            );
        }
        if self.request_backoff_max < self.request_backoff_initial {
            return invalid(
                "taskmanager.network.request-backoff.max",
                self.request_backoff_max.as_millis() as usize,
                "the maximum back-off must be at least the initial one",
            );
        }
        // The kernel's own ranges (TCP_KEEPIDLE/KEEPINTVL ≤ 32767 s, TCP_KEEPCNT ≤ 127,
        // TCP_USER_TIMEOUT ≤ i32::MAX ms): outside them every socket option call fails.
        for (key, seconds) in [
            (
                "taskmanager.network.netty.client.tcp.keepIdleSec",
                self.keepalive_idle.as_secs(),
            ),
            (
                "taskmanager.network.netty.client.tcp.keepIntervalSec",
                self.keepalive_interval.as_secs(),
            ),
        ] {
            if !(1..=32767).contains(&seconds) {
                return invalid(key, seconds as usize, "must be 1 to 32767 s");
            }
        }
        if !(1..=127).contains(&self.keepalive_count) {
            return invalid(
                "taskmanager.network.netty.client.tcp.keepCount",
                self.keepalive_count as usize,
                "must be 1 to 127",
            );
        }
        if self.tcp_user_timeout.as_millis() > i32::MAX as u128 {
            return invalid(
                "fluxgate.network.tcp.user-timeout-ms",
                self.tcp_user_timeout.as_millis() as usize,
                "must be at most 2147483647",
            );
        }
        if self.handshake_timeout.is_zero() {
            return invalid(
                "fluxgate.network.handshake-timeout",
                0,
                "must be at least 1 ms",
            );
        }
        if self.max_connections == 0 {
            return invalid("fluxgate.network.max-connections", 0, "must be at least 1");
        }
        if !(1..=1 << 20).contains(&self.max_channels_per_connection) {
            return invalid(
                "fluxgate.network.max-channels-per-connection",
                self.max_channels_per_connection,
                "must be from 1 to 1048576",
            );
        }
        if let Some(max) = self.max_frame_size {
            if max < s + BUFFER_RESPONSE_HEADER || max > u32::MAX as usize {
                return invalid(
                    "fluxgate.network.max-frame-size",
                    max,
                    "must hold a full segment and its 48-byte header, and fit 32 bits",
                );
            }
        }
        if self.ssl_handshake_timeout.is_zero() {
            return invalid(
                "security.ssl.internal.handshake-timeout",
                0,
                "must be at least 1 ms",
            );
        }
        // Deadlines are computed from these (`now + timeout`, on the I/O thread for most), which
        // must not overflow: a day at most, as `ShuffleEnvironment::start` asks of its own.
        for (key, value) in [
            (
                "taskmanager.network.memory.exclusive-buffers-request-timeout-ms",
                self.buffer_request_timeout,
            ),
            (
                "taskmanager.network.request-backoff.max",
                self.request_backoff_max,
            ),
            ("fluxgate.network.handshake-timeout", self.handshake_timeout),
            (
                "security.ssl.internal.handshake-timeout",
                self.ssl_handshake_timeout,
            ),
        ] {
            if value > MAX_TIMEOUT {
                return invalid(
                    key,
                    value.as_millis().min(usize::MAX as u128) as usize,
                    "must be at most a day (86400000 ms)",
                );
            }
        }
        // Set as a field, the bound the key's parser keeps: an I/O thread spinning for longer
        // after each piece of work would take a core from the tasks.
        if self.io_thread_busy_poll > Duration::from_micros(MAX_BUSY_POLL_US as u64) {
            return invalid(
                "fluxgate.network.io-thread.busy-poll-us",
                self.io_thread_busy_poll.as_micros().min(usize::MAX as u128) as usize,
                "must be at most 1000000 (1 s)",
            );
        }
        if self.partition_request_rate > 0 && self.partition_request_burst == 0 {
            return invalid(
                "fluxgate.network.partition-request-burst",
                0,
                "must be at least 1 while partition-request-rate limits requests",
            );
        }
        Ok(())
    }

    /// The partition-request back-off these options describe.
    pub fn request_backoff(&self) -> crate::gate::Backoff {
        crate::gate::Backoff::new(self.request_backoff_initial, self.request_backoff_max)
    }

    /// The longest frame a connection accepts (`fluxgate.network.max-frame-size`, or the
    /// segment size plus its headroom).
    pub fn max_frame_size(&self) -> usize {
        self.max_frame_size
            .unwrap_or(self.segment_size + crate::buffer::HEADROOM)
    }

    /// The secret a server bound to `bind` authenticates with: none when authentication is
    /// off there; else from `fluxgate.security.secret-file`, or the `FLUXGATE_SECRET`
    /// environment variable. Fails when authentication is on and no usable secret is found.
    pub fn resolve_secret(&self, bind: SocketAddr) -> Result<Option<Secret>, SecretError> {
        if !self.auth.is_on_for(bind) {
            return Ok(None);
        }
        let why = match self.auth {
            AuthMode::Auto => {
                "fluxgate.security.auth is auto and the server binds the \
                               non-loopback address"
            }
            _ => "fluxgate.security.auth is on",
        };
        load_secret(self.secret_file.as_deref(), std::env::var_os(SECRET_ENV))
            .and_then(|secret| secret.ok_or_else(|| SecretError::Missing(format!("{why} {bind}"))))
            .map(Some)
    }

    /// Segments in the whole network memory.
    pub fn segment_count(&self) -> usize {
        self.network_memory_bytes / self.segment_size
    }
}

/// Why no cluster secret could be had.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretError {
    /// Authentication is on (the reason says why) and no secret is configured.
    #[error(
        "authentication is required ({0}) but no secret is configured: set \
         fluxgate.security.secret-file to a file holding it, or the FLUXGATE_SECRET \
         environment variable (or set fluxgate.security.auth = off on trusted networks)"
    )]
    Missing(String),
    /// The secret file could not be read.
    #[error("cannot read the secret file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
    /// The secret is too short to resist guessing.
    #[error("the secret from {origin} has {len} bytes; at least {MIN_SECRET_LEN} are required")]
    TooShort {
        /// Where it came from.
        origin: String,
        /// Its length.
        len: usize,
    },
}

/// The secret from `file` if one is named, else from `from_env` (the environment variable's
/// value); `None` when neither is set. Trailing whitespace (a file's final newline) is cut.
pub fn load_secret(
    file: Option<&Path>,
    from_env: Option<OsString>,
) -> Result<Option<Secret>, SecretError> {
    let (bytes, source) = match (file, from_env) {
        (Some(path), _) => {
            let bytes = std::fs::read(path).map_err(|error| SecretError::Unreadable {
                path: path.to_owned(),
                reason: error.to_string(),
            })?;
            (bytes, format!("the file {}", path.display()))
        }
        (None, Some(value)) => {
            use std::os::unix::ffi::OsStringExt;
            (value.into_vec(), format!("the variable {SECRET_ENV}"))
        }
        (None, None) => return Ok(None),
    };
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |last| last + 1);
    let secret = &bytes[..end];
    Secret::new(secret)
        .ok_or(SecretError::TooShort {
            origin: source,
            len: secret.len(),
        })
        .map(Some)
}

/// Parses `123`, `32k`, `32kb`, `64m`, `1g` (binary units, case-insensitive).
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim().to_ascii_lowercase();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let value: usize = digits.parse().ok()?;
    let multiplier = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    value.checked_mul(multiplier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_modes_parse_as_sizes_do_whatever_the_spacing_and_case() {
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.network.memory.buffers-per-channel", " 4 ")
            .unwrap();
        assert_eq!(config.buffers_per_channel, 4);
        config
            .set("fluxgate.network.zero-copy-send", "OFF")
            .unwrap();
        assert_eq!(config.zero_copy_send, ZeroCopySend::Off);
    }

    #[test]
    fn a_partition_without_exclusive_buffers_on_its_inputs_still_has_one_per_subpartition() {
        // Flink sizes outputs with max(1, buffers-per-channel).
        let mut config = NetworkConfig::default();
        config
            .set("taskmanager.network.memory.buffers-per-channel", "0")
            .unwrap();
        let spec = crate::buffer::LocalPoolSpec::for_partition(4, &config);
        assert_eq!(spec.max_segments, 4 + config.floating_buffers_per_gate);
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("32kb"), Some(32 * 1024));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("12q"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn limits_and_security_options_parse_and_validate() {
        let mut config = NetworkConfig::default();
        config.set("fluxgate.security.auth", "on").unwrap();
        assert_eq!(config.auth, AuthMode::On);
        assert!(config.set("fluxgate.security.auth", "maybe").is_err());
        config
            .set("fluxgate.security.secret-file", "/etc/fluxgate/secret")
            .unwrap();
        assert_eq!(
            config.secret_file.as_deref(),
            Some(Path::new("/etc/fluxgate/secret"))
        );
        config.set("fluxgate.network.max-connections", "3").unwrap();
        assert!(config.set("fluxgate.network.max-connections", "0").is_err());
        config
            .set("fluxgate.network.max-channels-per-connection", "8")
            .unwrap();
        assert_eq!(config.max_frame_size(), 32 * 1024 + 64);
        assert!(config
            .set("fluxgate.network.max-frame-size", "32kb")
            .is_err());
        config
            .set("fluxgate.network.max-frame-size", "33kb")
            .unwrap();
        assert_eq!(config.max_frame_size(), 33 * 1024);
        config
            .set("fluxgate.network.partition-request-rate", "10")
            .unwrap();
        assert!(config
            .set("fluxgate.network.partition-request-burst", "0")
            .is_err());
        config
            .set("fluxgate.network.partition-request-rate", "0")
            .unwrap();
        config
            .set("fluxgate.network.partition-request-burst", "0")
            .unwrap();
    }

    #[test]
    fn tls_options_parse_under_flink_names_and_the_alias() {
        let mut config = NetworkConfig::default();
        assert!(!config.ssl_enabled);
        assert_eq!(config.ssl_server_name, DEFAULT_SSL_SERVER_NAME);
        config.set("security.ssl.internal.enabled", "true").unwrap();
        assert!(config.ssl_enabled);
        config.set("fluxgate.security.ssl.enabled", "off").unwrap();
        assert!(!config.ssl_enabled);
        assert!(config.set("security.ssl.internal.enabled", "yes").is_err());
        config
            .set("security.ssl.internal.cert-file", "/etc/fluxgate/node.pem")
            .unwrap();
        config
            .set(
                "security.ssl.internal.key-file",
                "/etc/fluxgate/node-key.pem",
            )
            .unwrap();
        config
            .set("security.ssl.internal.ca-file", "/etc/fluxgate/ca.pem")
            .unwrap();
        assert_eq!(
            config.ssl_ca_file.as_deref(),
            Some(Path::new("/etc/fluxgate/ca.pem"))
        );
        config
            .set("security.ssl.internal.server-name", "shuffle.cluster-a")
            .unwrap();
        assert_eq!(config.ssl_server_name, "shuffle.cluster-a");
        config
            .set("security.ssl.internal.handshake-timeout", "250")
            .unwrap();
        assert_eq!(config.ssl_handshake_timeout, Duration::from_millis(250));
        assert!(config
            .set("security.ssl.internal.handshake-timeout", "0")
            .is_err());
        assert!(config
            .set("security.ssl.internal.server-name", "not a name")
            .is_err());
    }

    /// A timeout set past a day through the public fields (the string keys stop short of
    /// overflowing anyway) is refused: the I/O thread computes `now + timeout` from it, which
    /// would panic.
    #[test]
    fn timeouts_past_a_day_are_refused() {
        let fields: [fn(&mut NetworkConfig) -> &mut Duration; 4] = [
            |c| &mut c.buffer_request_timeout,
            |c| &mut c.request_backoff_max,
            |c| &mut c.handshake_timeout,
            |c| &mut c.ssl_handshake_timeout,
        ];
        for field in fields {
            let mut config = NetworkConfig::default();
            *field(&mut config) = Duration::from_secs(86_400);
            assert!(config.validate().is_ok(), "a day is allowed: {config:?}");
            *field(&mut config) = Duration::MAX;
            assert!(config.validate().is_err(), "refused: {config:?}");
        }
    }

    #[test]
    fn io_thread_busy_poll_is_off_by_default_and_bounded() {
        const KEY: &str = "fluxgate.network.io-thread.busy-poll-us";
        let mut config = NetworkConfig::default();
        assert_eq!(config.io_thread_busy_poll, Duration::ZERO);
        config.set(KEY, "250").unwrap();
        assert_eq!(config.io_thread_busy_poll, Duration::from_micros(250));
        config.set(KEY, "1000000").unwrap();
        assert_eq!(config.io_thread_busy_poll, Duration::from_secs(1));
        for refused in ["1000001", "-1", "1ms"] {
            assert!(config.set(KEY, refused).is_err(), "{refused} refused");
        }
        assert_eq!(
            config.io_thread_busy_poll,
            Duration::from_secs(1),
            "unchanged"
        );
        assert!(config.validate().is_ok());
        // Set as a field, past the key's bound: refused at validation, as the key is.
        for refused in [Duration::from_micros(1_000_001), Duration::MAX] {
            config.io_thread_busy_poll = refused;
            assert!(config.validate().is_err(), "{refused:?} refused");
        }
        assert!(NetworkConfig::OPTIONS.contains(&KEY));
    }

    #[test]
    fn zero_copy_send_is_auto_or_off() {
        let mut config = NetworkConfig::default();
        assert_eq!(config.zero_copy_send, ZeroCopySend::Auto);
        config
            .set("fluxgate.network.zero-copy-send", "off")
            .unwrap();
        assert_eq!(config.zero_copy_send, ZeroCopySend::Off);
        config
            .set("fluxgate.network.zero-copy-send", "auto")
            .unwrap();
        assert_eq!(config.zero_copy_send, ZeroCopySend::Auto);
        config
            .set("fluxgate.network.zero-copy-send", "always")
            .unwrap();
        assert_eq!(config.zero_copy_send, ZeroCopySend::Always);
        assert!(config.set("fluxgate.network.zero-copy-send", "on").is_err());
        assert!(NetworkConfig::OPTIONS.contains(&"fluxgate.network.zero-copy-send"));
    }

    #[test]
    fn auto_authenticates_only_off_loopback() {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let any = SocketAddr::from(([0, 0, 0, 0], 0));
        let v6_loopback: SocketAddr = "[::1]:0".parse().unwrap();
        assert!(!AuthMode::Auto.is_on_for(loopback));
        assert!(!AuthMode::Auto.is_on_for(v6_loopback));
        assert!(AuthMode::Auto.is_on_for(any));
        assert!(AuthMode::On.is_on_for(loopback));
        assert!(!AuthMode::Off.is_on_for(any));
        let config = NetworkConfig::default();
        assert_eq!(config.resolve_secret(loopback), Ok(None));
    }

    #[test]
    fn secrets_come_from_the_file_first_then_the_environment() {
        let dir = std::env::temp_dir().join(format!("fluxgate-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, b"0123456789abcdef-from-file\n").unwrap();
        let from_file = load_secret(Some(&file), Some("0123456789abcdef-env".into()))
            .unwrap()
            .unwrap();
        assert_eq!(
            from_file,
            Secret::new(b"0123456789abcdef-from-file").unwrap()
        );
        let from_env = load_secret(None, Some("0123456789abcdef-env".into()))
            .unwrap()
            .unwrap();
        assert_eq!(from_env, Secret::new(b"0123456789abcdef-env").unwrap());
        assert_eq!(load_secret(None, None), Ok(None));
        assert!(matches!(
            load_secret(None, Some("short\n".into())),
            Err(SecretError::TooShort { len: 5, .. })
        ));
        assert!(matches!(
            load_secret(Some(&dir.join("missing")), None),
            Err(SecretError::Unreadable { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        // On with nothing configured: a startup error saying what to set.
        let mut config = NetworkConfig::default();
        config.set("fluxgate.security.auth", "on").unwrap();
        config
            .set(
                "fluxgate.security.secret-file",
                dir.join("missing").to_str().unwrap(),
            )
            .unwrap();
        let error = config
            .resolve_secret(SocketAddr::from(([127, 0, 0, 1], 0)))
            .unwrap_err();
        assert!(matches!(error, SecretError::Unreadable { .. }), "{error}");
    }

    #[test]
    fn segment_size_must_be_a_power_of_two_in_range() {
        let mut config = NetworkConfig::default();
        assert!(config.set("taskmanager.memory.segment-size", "4k").is_ok());
        assert!(config.set("taskmanager.memory.segment-size", "1m").is_ok());
        assert!(config.set("taskmanager.memory.segment-size", "2m").is_err());
        assert!(config
            .set("taskmanager.memory.segment-size", "5000")
            .is_err());
        assert!(config.set("taskmanager.memory.segment-size", "2k").is_err());
        assert!(matches!(
            config.set("no.such.option", "1"),
            Err(ConfigError::UnknownOption(_))
        ));
    }

    #[test]
    fn options_that_depend_on_each_other_can_be_set_together_in_any_order() {
        let initial = "taskmanager.network.request-backoff.initial";
        let max = "taskmanager.network.request-backoff.max";
        let mut config = NetworkConfig::default();
        // Alone, an initial back-off above the maximum is refused, and names its key.
        match config.set(initial, "20000") {
            Err(ConfigError::InvalidValue { key, .. }) => assert_eq!(key, initial),
            other => panic!("expected a refusal, got {other:?}"),
        }
        config
            .set_all([(initial, "20000"), (max, "60000")])
            .unwrap();
        assert_eq!(config.request_backoff_initial, Duration::from_secs(20));
        assert_eq!(config.request_backoff_max, Duration::from_secs(60));
        // A refused set changes nothing.
        assert!(config.set_all([(max, "70000"), (initial, "-1")]).is_err());
        assert_eq!(config.request_backoff_max, Duration::from_secs(60));
    }

    /// Options set together in a file: a value refused only by a check spanning several
    /// options still names its own key and value (the checks once blamed the back-off's
    /// maximum and the keepalive idle time for every such value).
    #[test]
    fn a_refusal_among_several_options_names_the_option_at_fault() {
        let segment_size = ("taskmanager.memory.segment-size", "32kb");
        for (key, value) in [
            ("taskmanager.network.netty.client.tcp.keepCount", "0"),
            (
                "taskmanager.network.netty.client.tcp.keepIntervalSec",
                "40000",
            ),
            ("taskmanager.network.netty.client.tcp.keepIdleSec", "0"),
            ("taskmanager.network.request-backoff.initial", "0"),
        ] {
            let refused = NetworkConfig::default().set_all([(key, value), segment_size]);
            match refused {
                Err(ConfigError::InvalidValue {
                    key: named,
                    value: named_value,
                    ..
                }) => assert_eq!((named.as_str(), named_value.as_str()), (key, value)),
                other => panic!("{key} = {value}: expected a refusal, got {other:?}"),
            }
        }
    }

    #[test]
    fn buffer_counts_are_bounded_and_the_request_timeout_is_not_zero() {
        let mut config = NetworkConfig::default();
        for key in [
            "taskmanager.network.memory.buffers-per-channel",
            "taskmanager.network.memory.floating-buffers-per-gate",
            "taskmanager.network.memory.max-buffers-per-channel",
        ] {
            assert!(config.set(key, "65536").is_ok(), "{key}");
            assert!(config.set(key, "65537").is_err(), "{key}");
            assert!(config.set(key, "2147483647").is_err(), "{key}");
        }
        let timeout = "taskmanager.network.memory.exclusive-buffers-request-timeout-ms";
        assert!(config.set(timeout, "0").is_err());
        assert!(config.set(timeout, "1").is_ok());
    }

    #[test]
    fn a_tls_handshake_timeout_of_minus_one_is_flink_s_default() {
        let mut config = NetworkConfig::default();
        let key = "security.ssl.internal.handshake-timeout";
        config.set(key, "250").unwrap();
        config.set(key, "-1").unwrap();
        assert_eq!(
            config.ssl_handshake_timeout,
            NetworkConfig::default().ssl_handshake_timeout
        );
        assert!(config.set(key, "-2").is_err());
    }

    #[test]
    fn booleans_and_modes_read_in_any_case() {
        let mut config = NetworkConfig::default();
        config.set("security.ssl.internal.enabled", "True").unwrap();
        assert!(config.ssl_enabled);
        config
            .set("security.ssl.internal.enabled", "FALSE")
            .unwrap();
        assert!(!config.ssl_enabled);
        assert_eq!(" On ".parse::<AuthMode>(), Ok(AuthMode::On));
    }
}
